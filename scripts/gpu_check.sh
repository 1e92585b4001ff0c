#!/usr/bin/env bash
# GPU checks for bytebound, run on the device machine from the repository root.
#
#   scripts/gpu_check.sh                 # every section, in the order of SECTIONS below
#   scripts/gpu_check.sh kernels         # one or more named sections
#   scripts/gpu_check.sh --list          # the section names
#
# Logs and JSON go to $OUT (the device tool's result folder) or ./out/gpu_check. Wheels in .whl/ (fla-core,
# humming-kernels) are installed into /tmp/site and put on PYTHONPATH first. Every section runs even if an
# earlier one failed; the exit status is non-zero if any failed, and the last lines summarise them.
#
# Adding a section: write a function section_<name> and add <name> to SECTIONS. Each section gets its own
# log $OUT/<name>.log; use `run_step <label> <command...>` inside it so failures are recorded, not fatal.
# Environment: SECTION_TIMEOUT (seconds per step, default 300), TEST_TIMEOUT (seconds per pytest test, default 200), BYTEBOUND_COMMIT (recorded by benchmarks when
# the checkout has no .git), PYTEST_K (a pytest -k expression, e.g. "not humming"), BENCH_MOE_ARGS
# (extra bench_moe.py arguments, e.g. "--quick --layers 4"), BENCH_DECODE_ARGS (extra bench_decode.py
# arguments, e.g. "--moe-backends triton,torch --ttft-len 0"), NANO_ARGS (extra train_nano.py arguments for the
# on-demand section ``nano``, e.g. "--qat-frac 0.7 --mxfp4-scale mse"), NANO_EVAL_ARGS (its eval_nano.py arguments,
# default "--greedy-n 200 --quant-ablation 200"), MTP_ARGS (extra mtp_accept.py arguments for the
# on-demand section ``mtp``, e.g. "--no-sampled"), MTP_MODES ("eager graph", the default, or any of eager, graph, fp32),
# BYTEBOUND_MOE_CONFIG (a triton MoE config table, e.g. the one
# bench_moe --tune just wrote to $OUT/triton_moe_configs.json, instead of the committed one), LADDER_* (the
# on-demand section ``ladder``: LADDER_BUDGET seconds for the whole section, default 400; LADDER_LENS, default
# 2048,32768; LADDER_OUT_LEN, default 256; LADDER_GSM8K_LIMIT, default 50; LADDER_DRAFT_VOCAB, default 1024;
# LADDER_ACCEPT, the committed trained-model accept-length record the synthetic +mtp row is priced at first).

set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/out/gpu_check}"
mkdir -p "$OUT"
SECTION_TIMEOUT="${SECTION_TIMEOUT:-300}"
export PYTHONUNBUFFERED=1
export BYTEBOUND_COMMIT="${BYTEBOUND_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"

SECTIONS=(kernels engine bench_moe decode verify)
ON_DEMAND=(env nano mtp bisect numerics shared defaults pdl e2e floor prefill fp8gemm kda mla gemv ladder integration adaptive ab rk retune ring ringocc kernela nr regcap gemvcap moetable routerseg mlalong ticketrope kdancu rb chainstream chainmma chainsplit)   # run only when named
FAILED=()

install_wheels() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || { echo "wheel install failed"; return 1; }
        export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    else
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
}

# run_step LABEL CMD...: run with a timeout, tee into the current section log, record failure.
run_step() {
    local label="$1"; shift
    echo "=== [$CURRENT] $label: $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$SECTION_TIMEOUT" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== [$CURRENT] $label: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
    if [ "$rc" -ne 0 ]; then FAILED+=("$CURRENT/$label(rc=$rc)"); fi
    return 0
}

# A per-test limit (pytest-timeout, when installed) so a hung test prints its traceback and the failure summary
# still appears before the step's own timeout.
pytest_timeout() {
    python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${TEST_TIMEOUT:-200}"
}

section_kernels() {      # GPU kernel tests vs torch / float64 references
    # (the fused router / norm tests run on the GPU when CUDA is there, in the interpreter elsewhere)
    run_step pytest python3 -m pytest tests/gpu/test_kernels_gpu.py tests/test_triton_router.py tests/test_triton_norm.py \
        tests/test_triton_moe_reduce.py \
        -v -p no:cacheprovider --durations=15 \
        -rfE --tb=short $(pytest_timeout) \
        --junitxml="$OUT/kernels_junit.xml" ${PYTEST_K:+-k "$PYTEST_K"}
}

section_kda() {          # the fused KDA decode/verify kernel (kda backend 'triton'): tests at Ling's shape, then one
    # layer's fused path vs today's fla + glue path at M = 1 and 4 under CUDA graphs (JSON in $OUT)
    run_step pytest python3 -m pytest tests/gpu/test_kda_gpu.py tests/gpu/test_fuse_gpu.py tests/test_triton_kda.py \
        -v -p no:cacheprovider \
        -rfE --tb=short $(pytest_timeout) --junitxml="$OUT/kda_junit.xml" ${PYTEST_K:+-k "$PYTEST_K"}
    run_step bench python3 scripts/bench_kda.py --out "$OUT/bench_kda.json"
}

section_bench_moe() {    # per-layer MoE microbenchmark (+ triton config sweep), JSON in $OUT
    run_step bench python3 scripts/bench_moe.py --out "$OUT" --tune ${BENCH_MOE_ARGS:-}
}

section_engine() {       # engine on GPU: graph replay == eager over 64 steps, trained nano GPU vs CPU greedy, logprobs
    run_step pytest python3 -m pytest -m gpu tests/gpu/test_engine_gpu.py tests/gpu/test_logprobs_gpu.py -v \
        -p no:cacheprovider -rfE --tb=short \
        $(pytest_timeout) \
        --junitxml="$OUT/engine_junit.xml" ${PYTEST_K:+-k "$PYTEST_K"}
}

section_decode() {       # full-scale Ling-3.0-flash decode benchmark, dummy weights: TPOT, per-op, U, MTP round cost
    run_step bench python3 scripts/bench_decode.py --out "$OUT" ${BENCH_DECODE_ARGS:-}
}

section_verify() {       # start-up canaries on GPU, and their cost at full scale
    run_step pytest env BYTEBOUND_FULLSCALE=1 BYTEBOUND_TIMING_OUT="$OUT/canary_timing.json" \
        python3 -m pytest tests/test_verify.py -v -p no:cacheprovider -rfE --tb=short $(pytest_timeout) \
        -k "gpu or cuda or full_scale"
}

section_bisect() {       # the full-scale canaries once per GPU path: engine defaults (fast paths on), eager MTP rounds,
    #                        the one-launch fused MoE kernel (int64 atomics) instead of the committed table's entries,
    #                        and each fast path off by itself
    canaries() {         # canaries LABEL [VAR=VALUE ...]: the full-scale canary test with those variables set
        run_step "$1" env BYTEBOUND_FULLSCALE=1 "${@:2}" python3 -m pytest \
            tests/test_verify.py::test_full_scale_canary_cost -q -p no:cacheprovider -rfE --tb=line
    }
    canaries defaults
    canaries eager_rounds BYTEBOUND_FULLSCALE_ENGINE='{"spec_static_round": false}'
    local tab="$OUT/moe_fused.json"
    run_step fused_moe_table python3 -c 'import json, sys
from bytebound.kernels.moe_host import DEFAULT_CONFIG, load_configs
t = load_configs()
n = 0
for gpu, table in t.items():
    for key in (list(table) if isinstance(table, dict) else ()):
        table[key] = dict(DEFAULT_CONFIG)
        n += 1
assert n, "no entry in the committed table"
json.dump(t, open(sys.argv[1], "w"))
print(f"{n} entries -> the fused kernel, int64 atomics: {sys.argv[1]}")' "$tab"
    if [ -s "$tab" ]; then
        canaries fused_moe BYTEBOUND_MOE_CONFIG="$tab"
    else
        echo "no fused-MoE table: skipping that step" | tee -a "$LOG"; FAILED+=("bisect/fused_moe")
    fi
    local flag
    for flag in fused_router fused_norm kv_buckets; do
        canaries "no_$flag" BYTEBOUND_FULLSCALE_ENGINE="{\"$flag\": false}"
    done
}

section_mtp() {          # issue 6 on the GPU: greedy parity over 50 GSM8K prompts (eager rounds, then captured
    #                        rounds, the CUDA default) and accept length, trained ling-nano
    # MTP_MODES: "eager graph" by default; eager rounds are slow on the GPU (over 140 s for the 50 prompts)
    local m
    for m in ${MTP_MODES:-eager graph}; do
        case "$m" in eager|graph|fp32) ;; *) echo "MTP_MODES: unknown mode '$m' (eager, graph, fp32)" | tee -a "$LOG"
                                       FAILED+=("mtp/MTP_MODES=$m") ;; esac
    done
    if [[ " ${MTP_MODES:-eager graph} " == *" eager "* ]]; then
        run_step eager python3 scripts/mtp_accept.py --device cuda --out "$OUT" --name mtp-accept-nano-h200 \
            --no-spec-static-round ${MTP_ARGS:-}
    fi
    if [[ " ${MTP_MODES:-eager graph} " == *" graph "* ]]; then
        run_step graph python3 scripts/mtp_accept.py --device cuda --out "$OUT" --name mtp-accept-nano-h200-graph \
            --spec-static-round ${MTP_ARGS:-}
    fi
    if [[ " ${MTP_MODES:-eager graph} " == *" fp32 "* ]]; then   # float32 activations, torch GEMMs: parity without
        #                                                           BF16 near-ties (captured rounds)
        run_step fp32 python3 scripts/mtp_accept.py --device cuda --out "$OUT" --name mtp-accept-nano-h200-fp32 \
            --spec-static-round --dtype fp32 --lm-head fp32 --backends moe=torch,linear=torch,lm_head=torch,kda=torch ${MTP_ARGS:-}
    fi
}

section_numerics() {     # verify (M = 4) vs decode (M = 1) per layer at full widths, dummy weights: BF16 with the
    #                        default backends and a torch-backend yardstick (6 and 42 layers), then float32, 42 layers
    run_step bf16 python3 scripts/verify_vs_decode.py --device cuda --layers 6,42 --baseline moe=torch,linear=torch \
        --json "$OUT/verify-vs-decode-bf16.json"
    run_step fp32 python3 scripts/verify_vs_decode.py --device cuda --dtype fp32 --layers 42 \
        --backends moe=torch,linear=torch,lm_head=torch,kda=torch --json "$OUT/verify-vs-decode-fp32.json"
}

section_nano() {         # retrain ling-nano (issue 3) and measure quantised vs float on the device, where the float
    #                        weights are (they do not fit the 16 MiB return limit); the export comes back as .tar.xz
    #                        in 15 MiB parts (join: cat ling-nano-export.tar.xz.part* > x.tar.xz)
    local d=/tmp/nano_run
    run_step train python3 scripts/train_nano.py --out "$d" --export-dir "$d/export" --train-log-dir "$OUT" ${NANO_ARGS:-}
    run_step eval python3 scripts/eval_nano.py --ckpt "$d/export" --float-weights "$d/nano_float.pt" --device cuda \
        ${NANO_EVAL_ARGS:---greedy-n 200 --quant-ablation 200} --out "$OUT/ling-nano-eval.json"
    run_step pack bash -c 'tar -cJf /tmp/nano_export.tar.xz -C "$1" export && split -b 15m -d /tmp/nano_export.tar.xz "$2/ling-nano-export.tar.xz.part" && sha256sum /tmp/nano_export.tar.xz' _ "$d" "$OUT"
}

section_shared() {       # issue 5: the shared expert inside the split MoE kernels (EngineConfig.fused_shared) and the
    #                        router GEMV + routing as one kernel (fused_router_gemv): their GPU tests, the per-layer
    #                        same-run comparison (dense vs fused shared expert) and full-scale decode without, with the
    #                        shared expert, and with both, in one process (dummy weights); 3 files in $OUT besides the log
    run_step pytest python3 -m pytest tests/gpu/test_kernels_gpu.py tests/test_triton_router.py -v -p no:cacheprovider \
        -rfE --tb=short $(pytest_timeout) -k "shared_expert or split or graph or route" --junitxml="$OUT/shared_junit.xml"
    run_step bench_moe python3 scripts/bench_moe.py --out "$OUT" --backends triton --shared --layers 4 --reps 20
    run_step decode python3 scripts/bench_decode.py --out "$OUT" --name decode-shared --contexts 2048 --ttft-len 0 \
        --moe-backends triton,triton+shared,triton+shared+gemv --heads fp8 --verify-ops
}

engine_default_tests() { # the engine tests that cover the CUDA defaults: graph == eager, verify == decode on every
    #                         path, the captured MTP round, nano GPU == CPU
    run_step engine python3 -m pytest -m gpu tests/gpu/test_engine_gpu.py -q -p no:cacheprovider -rfE --tb=short \
        $(pytest_timeout) -k "verify_equals or captured_mtp or (64_steps and triton-triton) or nano_greedy" \
        --junitxml="$OUT/engine_junit.xml"
}

section_defaults() {     # issue 5, after the fused shared expert became a CUDA default (2026-11-30): its kernel tests and the
    #                        router's (2-D routing, warps per row), the router / whole-MoE-layer timings, the full-scale
    #                        canaries and the engine tests with the new defaults, and decode with / without it
    run_step pytest python3 -m pytest tests/gpu/test_kernels_gpu.py tests/test_triton_router.py -q -p no:cacheprovider \
        -rfE --tb=short $(pytest_timeout) -k "shared_expert or split or graph or route" --junitxml="$OUT/kernels_junit.xml"
    run_step bench_moe python3 scripts/bench_moe.py --out "$OUT" --backends triton --router --layers 4 --reps 20
    section_verify
    engine_default_tests
    run_step decode python3 scripts/bench_decode.py --out "$OUT" --name decode-defaults --contexts 2048 --ttft-len 0 \
        --moe-backends triton,triton+dense --heads fp8 --verify-ops
}

section_pdl() {          # issue 5: kernel A as a PDL dependent of the router (config pdl_in 1/2) and the one-load router
    #                        GEMV (gemv_route): their kernel tests, the router / whole-layer timings and decode with each
    run_step pytest python3 -m pytest tests/gpu/test_kernels_gpu.py tests/test_triton_router.py -q -p no:cacheprovider \
        -rfE --tb=short $(pytest_timeout) -k "pdl_in or shared_expert or route or graph" --junitxml="$OUT/pdl_junit.xml"
    run_step bench_moe python3 scripts/bench_moe.py --out "$OUT" --backends triton --router --layers 4 --reps 20
    run_step decode python3 scripts/bench_decode.py --out "$OUT" --name decode-pdl --contexts 2048 --ttft-len 0 \
        --moe-backends triton+nogemv+pdl0,triton+gemv+pdl0,triton+nogemv+pdl2,triton+gemv+pdl2 --heads fp8 --verify-ops
}

section_e2e() {          # the engine's CUDA defaults end to end (after each change of them): the full-scale canaries, the
    #                        engine tests (graph == eager, verify == decode on every path, captured MTP round, nano
    #                        GPU == CPU) and decode with today's defaults against the sixth session's (dense shared
    #                        expert, cuBLAS GEMV + routing kernel, kernel A an ordinary launch), in one process
    section_verify
    engine_default_tests
    run_step decode python3 scripts/bench_decode.py --out "$OUT" --name decode-e2e --contexts 2048 --ttft-len 0 \
        --moe-backends triton,triton+dense+nogemv+pdl0 --heads fp8 --verify-ops
}

section_floor() {        # issue 5: what pure streaming reads reach at the MoE layer's byte counts (one kernel; the three
    #                        phases as three launches), next to the layer's kernels in the same run
    run_step bench_moe python3 scripts/bench_moe.py --out "$OUT" --backends triton --floor --router --layers 4 --reps 20
}

section_prefill() {      # issue 20: the grouped prefill MoE kernel's GPU tests and per-layer sweep (grouped vs 4-token
    #                        slices vs humming), then TTFT at 2K / 8K / 32K through the engine with the start-up split
    #                        (full scale, dummy weights, FP8 head, strict canaries) and one 2K prefill's kernel table
    run_step pytest python3 -m pytest tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider -rfE --tb=short \
        $(pytest_timeout) -k "grouped" --junitxml="$OUT/prefill_junit.xml"
    run_step bench_moe python3 scripts/bench_moe_prefill.py --out "$OUT" ${BENCH_PREFILL_ARGS:---sweep}
    run_step ttft python3 -m bytebound.cli bench synthetic --model bytebound/assets/configs/ling-3.0-flash.json \
        --load-format dummy --device cuda --lm-head fp8 --input-len 2048 --output-len 64 \
        --ttft-lens ${TTFT_LENS:-2048,8192,32768} --profile-prefill 2048 --no-progress --weights-label synthetic \
        --out "$OUT" --name synthetic-prefill
}

section_fp8gemm() {      # issue 20: prefill FP8 block GEMMs (Triton FP8 tensor cores, _scaled_mm block-wise) vs float64 at
    #                        Ling shapes, then dequant+cuBLAS vs FP8 timings (BENCH_FP8_ARGS, e.g. "--sweep --m 2048")
    run_step pytest python3 -m pytest tests/gpu/test_fp8_gemm_gpu.py tests/test_triton_fp8_gemm.py -q -s \
        -p no:cacheprovider -rfEs --tb=short $(pytest_timeout) --junitxml="$OUT/fp8gemm_junit.xml"
    run_step bench python3 scripts/bench_fp8_gemm.py --out "$OUT" ${BENCH_FP8_ARGS:-}
}

section_gemv() {         # issue 19: the decode/verify FP8 GEMV (linear=triton, M <= 4): the config sweep first (its
    #                        best per shape and M -> $OUT/gemv_table.json), then the GPU tests and the final bench
    #                        with that table (BYTEBOUND_GEMV_CONFIG) against the same-bytes read (GEMV_SWEEP_ARGS)
    run_step sweep python3 scripts/bench_gemv.py --sweep --jobs 12 --out "$OUT/gemv_sweep" ${GEMV_SWEEP_ARGS:-}
    local table="$OUT/gemv_sweep/gemv_table.json"
    [ -s "$table" ] && export BYTEBOUND_GEMV_CONFIG="$table"
    run_step pytest python3 -m pytest tests/gpu/test_gemv_gpu.py tests/gpu/test_kernels_gpu.py -k "gemv or fp8_linear" \
        -q -p no:cacheprovider -rfEs --tb=short $(pytest_timeout) --junitxml="$OUT/gemv_junit.xml"
    run_step bench python3 scripts/bench_gemv.py --out "$OUT"
    unset BYTEBOUND_GEMV_CONFIG
}

section_mla() {          # issue 19: the triton MLA decode/verify backend (mla=triton): kernel tests at Ling shapes and
    #                        the small-shape suite compiled for real, the attention-part benchmark (BENCH_MLA_ARGS,
    #                        e.g. "--sweep"), and decode at 2K/32K with the backend
    run_step pytest python3 -m pytest tests/gpu/test_mla_gpu.py tests/test_triton_mla.py -v -p no:cacheprovider \
        -rfE --tb=short -s $(pytest_timeout) --junitxml="$OUT/mla_junit.xml" ${PYTEST_K:+-k "$PYTEST_K"}
    run_step bench_mla python3 scripts/bench_mla.py --out "$OUT" ${BENCH_MLA_ARGS:-}
    run_step decode python3 scripts/bench_decode.py --out "$OUT" --name decode-mla --contexts 2048,32768 --ttft-len 0 \
        --moe-backends triton --heads fp8 --mla-backend triton
}

# budget_step CAP LABEL CMD...: run_step with a timeout of CAP seconds or what is left of the section's budget
# (LADDER_END, in $SECONDS) less LADDER_RESERVE seconds kept for the steps after it, whichever is less. The reserve
# gives way when under 15 s would remain (the earlier step is the more important); skipped (recorded as failed)
# when under 15 s of the budget are left at all.
budget_step() {
    local cap="$1" label="$2"; shift 2
    local left=$(( LADDER_END - SECONDS ))
    if [ "$left" -lt 15 ]; then
        echo "=== [$CURRENT] $label: skipped, ${left} s of the section's budget left" | tee -a "$LOG"
        FAILED+=("$CURRENT/$label(no time)"); return 0
    fi
    local t=$(( left - ${LADDER_RESERVE:-0} ))
    [ "$t" -lt 15 ] && t=$left
    SECTION_TIMEOUT=$(( cap < t ? cap : t )) run_step "$label" "$@"
}

has_mtp_accept() {       # has_mtp_accept FILE: FILE is an ablation record with a measured +mtp accept length, or an
    #                        mtp_accept.py record with a greedy one
    [ -s "$1" ] && python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
ok = any(s.get("step") == "+mtp" and (s.get("summary") or {}).get("accept_length") for s in d.get("steps", [])) \
    if d.get("benchmark") == "ablation" else bool(d.get("greedy"))
sys.exit(0 if ok else 1)' "$1" 2>/dev/null
}

section_ab() {           # the twentieth session's A/Bs in one call (docs/perf/round-ab-twentieth.md): the GPU tests of
    # the fused head argmax and the router's split tail; the router under its switches (bench_router); the head's greedy
    # token both ways (bench_head); the MTP round and the plain step with the defaults and the fused argmax on the full
    # head too (profile_round --token-ab, AB_DRAFT_VOCAB rows of hot head, default 32768). Synthetic weights.
    run_step tests python3 -m pytest tests/test_head_argmax.py tests/test_triton_router.py -q -p no:cacheprovider \
        -rfE --tb=short $(pytest_timeout) -k "argmax or split_tail or gemv_route"
    run_step router python3 scripts/bench_router.py --m 1,4 --out "$OUT"
    run_step head python3 scripts/bench_head.py --out "$OUT"
    local r=(python3 scripts/profile_round.py --no-phases --ctx 2048 --draft-vocab "${AB_DRAFT_VOCAB:-32768}" --out "$OUT")
    run_step round_default "${r[@]}" --token-ab --name round-default
    run_step round_argmax_all env BYTEBOUND_HEAD_ARGMAX=1 "${r[@]}" --name round-argmax-all
}

section_ticketrope() {   # the thirty-fourth session's offline changes (docs/perf/session34/, section 5; their GPU tests
    # first ran in the thirty-fifth session, docs/perf/session35/, section 3, bench_mla not): the
    # split tickets through kernels.pdl.ticket (offline sm_90 SASS identical for the engine's launches) under the engine,
    # KDA, router / head-argmax and MLA GPU tests; the opt-in MLA rope_split: its MLA GPU tests and bench_mla at 2K
    # against the default, two pairs in alternation. Synthetic weights.
    local c='{"rope_split": true}' r
    for r in 1 2; do
        run_step "bench_mla_default_$r" python3 scripts/bench_mla.py --contexts 2049 --m 1 4 --span bucket \
            --backends triton --out "$OUT/ropesplit-default-$r"
        run_step "bench_mla_split_$r" env BYTEBOUND_MLA_CFG="$c" python3 scripts/bench_mla.py --contexts 2049 --m 1 4 \
            --span bucket --backends triton --out "$OUT/ropesplit-split-$r"
    done
    run_step tests_engine python3 -m pytest tests/gpu/test_engine_gpu.py -q -p no:cacheprovider -rfE --tb=short \
        $(pytest_timeout) -k "verify_equals or captured_mtp or nano_greedy"
    run_step tests_kda python3 -m pytest tests/gpu/test_kda_gpu.py -q -p no:cacheprovider -rfE --tb=short $(pytest_timeout)
    run_step tests_mla_split env BYTEBOUND_MLA_CFG="$c" python3 -m pytest tests/gpu/test_mla_gpu.py -q -p no:cacheprovider \
        -rfE --tb=short $(pytest_timeout)
    run_step tests_router python3 -m pytest tests/test_head_argmax.py tests/test_triton_router.py -q -p no:cacheprovider \
        -rfE --tb=short $(pytest_timeout) -k "argmax or split_tail or gemv_route"
}

section_kdancu() {       # what the fused KDA kernel's time in the step is made of (docs/perf/session35/: joining its
    # per-token reductions cut barriers but not its in-step time):
    # Nsight Compute, full set with source counters, on the kernel's first two launches of one eager decode step and the
    # first two of one eager 4-token verify (profile_decode --ncu-range: 35 KDA launches per phase), then the
    # details table and the SASS source page. Synthetic weights.
    local n skip
    for n in decode verify; do
        skip=0; [ "$n" = verify ] && skip=35
        echo "=== [$CURRENT] ncu_$n" | tee -a "$LOG"
        timeout "$SECTION_TIMEOUT" ncu --clock-control none --profile-from-start off --kernel-name regex:_fused_kda \
            --launch-skip "$skip" --launch-count 2 --set full --import-source yes -f -o "$OUT/kda-$n" \
            python3 scripts/profile_decode.py --ncu-range --ctx 2048 --verify-m 4 --out /tmp/kdancu \
            > "$OUT/kda-$n.log" 2>&1 || FAILED+=("$CURRENT/ncu_$n")
        ncu -i "$OUT/kda-$n.ncu-rep" --page details --csv > "$OUT/kda-$n-details.csv" 2>&1
        ncu -i "$OUT/kda-$n.ncu-rep" --page source --csv --print-source sass > "$OUT/kda-$n-sass.csv" 2>&1
        grep -E '"(Duration|DRAM Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|Warp Cycles Per Issued Instruction)"' \
            "$OUT/kda-$n-details.csv" | tee -a "$LOG"
    done
}

section_rb() {           # the thirty-sixth session's MoE config key RB (kernel B forms its operand from kernel A's
    # partials: no ticket tail in kernel A, no third launch; bit-equal by construction, opt-in until this has run):
    # its kernel tests (float64 references and key on == off bit for bit), then a candidate table with RB in the M = 1
    # entry and in place of RK in the M = 4 entry, bench_decode with the verify ops (decode graph, 4-token verify,
    # kernels per step) committed vs candidate after a discarded warm-up process in ABBA order (RB_PAIRS, default 2),
    # and table_checks with it (engine tests, full-scale canaries, plain step + MTP round). Synthetic weights.
    # RB_PARTS (default "tests decode checks") picks the parts: all three take more than one 10-minute device command,
    # so e.g. RB_PARTS="tests decode" in one call and RB_PARTS=checks in the next.
    local tab="$OUT/rb-table.json" parts=" ${RB_PARTS:-tests decode checks} "
    [[ "$parts" == *" tests "* ]] && kernel_tests_by_id 'keeps_the_bits\[RB-|shared_expert\[.*-rb\]'
    python3 -c 'import json, sys
t = json.load(open("bytebound/kernels/configs/triton_moe.json"))
g = t["NVIDIA H200"]
g["E512_H2560_I768_k8_M1"]["RB"] = 1
g["E512_H2560_I768_k8_M4"].pop("RK", None)
g["E512_H2560_I768_k8_M4"]["RB"] = 1
json.dump(t, open(sys.argv[1], "w"), indent=1)' "$tab" || { FAILED+=("rb/table"); return 0; }
    local d=(python3 scripts/bench_decode.py --contexts 2048 --ttft-len 0 --moe-backends triton --heads fp8
        --verify-ops --out "$OUT")
    if [[ "$parts" == *" decode "* ]]; then
        run_step decode_warmup env -u BYTEBOUND_MOE_CONFIG "${d[@]}" --name rb-warmup
        ab_table_pairs "${RB_PAIRS:-2}" decode BYTEBOUND_MOE_CONFIG "$tab" --name rb "${d[@]}"
    fi
    [[ "$parts" == *" checks "* ]] && table_checks BYTEBOUND_MOE_CONFIG "$tab" rb
    return 0
}

section_chainstream() {  # the thirty-seventh session's `stream` execution of bench_chain (scripts/chain_stream.py):
    # the chain of dependent FP8 GEMVs as one persistent kernel whose weight tiles stream by TMA into a deep
    # shared-memory ring ahead of its counter waits (docs/perf/u08-design.md section 7), against plain / pdl / read
    # in the same process: a 2-op smoke run first (a lost TMA copy would hang in an mbarrier wait: 90 s cap), then
    # the 6.6 MB-per-op chain (2560x2560, BN 8: the pdl row's best tiling) and the 41.9 MB one (2560x16384 /
    # 16384x2560, BN 16), each with `streamfree` (the same kernel, no dependencies: the stream's own rate), then the
    # stream's tile rows / warps / tiles per stage on the small chain. Synthetic weights.
    local before=${#FAILED[@]} r w c
    SECTION_TIMEOUT=90 run_step smoke python3 scripts/bench_chain.py --shapes 2560x2560 --layers 2 --bn 8 --bk 512 \
        --only plain,stream --reps 5 --out "$OUT" --name chain-smoke
    [ "${#FAILED[@]}" -gt "$before" ] && return 0
    run_step small python3 scripts/bench_chain.py --shapes 2560x2560 --bn 8 --bk 512 \
        --only plain,pdl,read,stream,streamfree --out "$OUT" --name chain-small
    run_step big python3 scripts/bench_chain.py --only plain,pdl,read,stream,streamfree --out "$OUT" --name chain-big
    for v in "32 8 4" "16 4 2" "32 4 4" "16 4 1" "8 4 4"; do
        read -r r w c <<< "$v"
        run_step "sweep_r${r}_w${w}_c${c}" python3 scripts/bench_chain.py --shapes 2560x2560 --bn 8 --bk 512 \
            --only read,stream,streamfree --stream-rows "$r" --stream-warps "$w" --stream-cps "$c" --out "$OUT" \
            --name "chain-small-r$r-w$w-c$c"
    done
}

section_chainmma() {     # the stream of section_chainstream with the mma consumer (--stream-consumer mma: E4M3 ->
    # FP16 mma fragments by the hardware conversion, x staged in FP16): the thirty-eighth session found the FMA
    # consumer's rate (3.4-7.6 bytes per cycle per SM) to be what limits the stream (u08-design.md section 7.1).
    # A 2-op smoke run (90 s cap), then the 6.6 MB-per-op chain at R 16 / 1 warp, R 32 / 2 warps and R 64 / 4 warps
    # (a 16-row mma tile per warp), each with streamfree, against read / pdl and the FMA consumer's best (R 32, 4
    # warps) in the same run, then the 41.9 MB chain at R 32 / 2 warps. Synthetic weights.
    local before=${#FAILED[@]} r w
    SECTION_TIMEOUT=90 run_step smoke python3 scripts/bench_chain.py --shapes 2560x2560 --layers 2 --bn 8 --bk 512 \
        --only plain,stream --stream-consumer mma --stream-rows 32 --stream-warps 2 --reps 5 --out "$OUT" \
        --name chainmma-smoke
    [ "${#FAILED[@]}" -gt "$before" ] && return 0
    run_step small_fma python3 scripts/bench_chain.py --shapes 2560x2560 --bn 8 --bk 512 \
        --only pdl,read,stream,streamfree --stream-rows 32 --stream-warps 4 --out "$OUT" --name chainmma-small-fma
    for v in "16 1" "32 2" "64 4"; do
        read -r r w <<< "$v"
        run_step "small_r${r}_w${w}" python3 scripts/bench_chain.py --shapes 2560x2560 --bn 8 --bk 512 \
            --only read,stream,streamfree --stream-consumer mma --stream-rows "$r" --stream-warps "$w" --out "$OUT" \
            --name "chainmma-small-r$r-w$w"
    done
    run_step big python3 scripts/bench_chain.py --only pdl,read,stream,streamfree --stream-consumer mma \
        --stream-rows 32 --stream-warps 2 --out "$OUT" --name chainmma-big
}

section_chainsplit() {   # the mma stream with each row block split over K as well (--stream-ksplit; u08-design.md
    # section 7.2: with 16-row mma tiles per warp an op had only 40-80 row blocks for 132 SMs): a 2-op smoke run
    # (90 s cap), then the 6.6 MB-per-op chain against pdl / read at R 64 / 4 warps with 2 and 4 K parts (80 / 160
    # items per op) and R 32 / 2 warps with 2 (160), then the 41.9 MB chain at R 64 / 4 warps with 4. Synthetic.
    local before=${#FAILED[@]} v r w c k
    SECTION_TIMEOUT=90 run_step smoke python3 scripts/bench_chain.py --shapes 2560x2560 --layers 2 --bn 8 --bk 512 \
        --only plain,stream --stream-consumer mma --stream-rows 64 --stream-warps 4 --stream-cps 1 --stream-ksplit 4 \
        --reps 5 --out "$OUT" --name chainsplit-smoke
    [ "${#FAILED[@]}" -gt "$before" ] && return 0
    for v in "64 4 2 2" "64 4 1 4" "32 2 2 2"; do
        read -r r w c k <<< "$v"
        run_step "small_r${r}_w${w}_k${k}" python3 scripts/bench_chain.py --shapes 2560x2560 --bn 8 --bk 512 \
            --only pdl,read,stream,streamfree --stream-consumer mma --stream-rows "$r" --stream-warps "$w" \
            --stream-cps "$c" --stream-ksplit "$k" --out "$OUT" --name "chainsplit-small-r$r-w$w-k$k"
    done
    run_step big python3 scripts/bench_chain.py --only pdl,read,stream,streamfree --stream-consumer mma \
        --stream-rows 64 --stream-warps 4 --stream-cps 1 --stream-ksplit 4 --out "$OUT" --name chainsplit-big
}

section_mlalong() {      # the long-span attention tiling of the 4-token verify (BM 32, BN 64): 8 warps (the default
    # since the thirty-fourth session, docs/perf/session34/) against 4 (spills 104 B in an offline sm_90 compile)
    # and BN 32 with 8 warps. An explicit num_warps also sets the one-token calls' warps (triton_mla.resolve_cfg), so
    # the 4-warp arm is the tiling before (one-token calls ran 4 warps then too). The MLA GPU tests with 4 warps;
    # bench_mla at the engine's spans for each setting; bench_decode at 32K with the verify ops, two processes per
    # setting in alternation. Synthetic weights.
    local c4='{"num_warps": 4}' c32='{"BN": 32, "num_warps": 8}'
    run_step tests env BYTEBOUND_MLA_CFG="$c4" python3 -m pytest tests/gpu/test_mla_gpu.py -q -p no:cacheprovider \
        -rfE --tb=short $(pytest_timeout) -k "float64 or graph_replay"
    local n=0 c r
    for c in '' "$c4" "$c32"; do
        n=$((n + 1))
        run_step "bench_mla_$n" env BYTEBOUND_MLA_CFG="$c" python3 scripts/bench_mla.py --contexts 2049 32768 \
            --m 1 4 --span bucket --backends triton --out "$OUT/mlalong-$n"
    done
    for r in 1 2; do
        n=0
        for c in '' "$c4"; do
            n=$((n + 1))
            run_step "decode_32k_${n}_$r" env BYTEBOUND_MLA_CFG="$c" python3 scripts/bench_decode.py --contexts 32768 \
                --ttft-len 0 --moe-backends triton --heads fp8 --verify-ops --out "$OUT" --name "decode-mlalong-$n-$r"
        done
    done
}

# moe_key_ab KEY PARTS: an MoE config key on against off. Two copies of the committed table set KEY 1 and KEY 0 in
# every "split" entry. With "tests" in PARTS its GPU tests run, selected by node id (not -k: -k also matches the
# checkout's directory names, and a root under /root/work matches "rk"), with the graph-replay tests; none collected
# is a failure, not a run of every test. Then the parts named in PARTS (default "layer round"): the whole MoE layer
# (bench_moe --router, M = 1 and 4) and the MTP round with the plain step (profile_round, AB_DRAFT_VOCAB rows of hot
# head, default 32768), each with the key off and on in alternating processes (the table is read when a layer binds:
# one process per arm), AB_PAIRS pairs (default 2). Synthetic weights.
# kernel_tests_by_id REGEX [EXTRA_REGEX]: the tests of tests/gpu/test_kernels_gpu.py whose node ids match REGEX (plus,
# when any did, those matching EXTRA_REGEX), run as one step "tests"; none collected is a failure, and pytest is never
# run without ids (that would run its whole default path). Used by moe_key_ab and the sections nr and regcap.
kernel_tests_by_id() {
    local all ids
    all=$(python3 -m pytest tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider --collect-only 2>>"$LOG")
    mapfile -t ids < <(grep -E "^tests/.*($1)" <<< "$all")
    echo "$CURRENT: ${#ids[@]} tests selected by $1 (+ ${2:-nothing})" | tee -a "$LOG"
    if [ "${#ids[@]}" -eq 0 ]; then
        FAILED+=("$CURRENT/tests(none collected by $1)")
        return 0
    fi
    [ -n "${2:-}" ] && mapfile -t -O "${#ids[@]}" ids < <(grep -E "^tests/.*($2)" <<< "$all")
    run_step tests python3 -m pytest "${ids[@]}" -q -p no:cacheprovider -rfE --tb=short $(pytest_timeout)
}

moe_key_ab() {
    local key="$1" parts="${2:-layer round}" lk tab base i
    lk=$(echo "$key" | tr '[:upper:]' '[:lower:]')
    tab="$OUT/$lk-table.json"
    base="$OUT/$lk-off-table.json"
    # two copies of the committed table: KEY 1 in every "split" entry, and KEY 0 in every one (the base arm is off
    # everywhere, even where the committed entry sets the key)
    python3 -c 'import json, sys
for path, val in ((sys.argv[1], 1), (sys.argv[2], 0)):
    t = json.load(open("bytebound/kernels/configs/triton_moe.json"))
    for gpu, entries in t.items():
        if not gpu.startswith("_"):
            for e in entries.values():
                if e.get("variant") == "split":
                    e[sys.argv[3]] = val
    json.dump(t, open(path, "w"), indent=1)' "$tab" "$base" "$key"
    if [[ " $parts " == *" tests "* ]]; then
        kernel_tests_by_id "-$lk\]|keeps_the_bits.*\[$key-" graph_replay
    fi
    local b=(python3 scripts/bench_moe.py --backends '' --router --m 1,4 --layers 4 --reps 20)
    local r=(python3 scripts/profile_round.py --no-phases --ctx 2048 --draft-vocab "${AB_DRAFT_VOCAB:-32768}" --out "$OUT")
    for i in $(seq 1 "${AB_PAIRS:-2}"); do
        if [[ " $parts " == *" layer "* ]]; then
            run_step "layer_base_$i" env BYTEBOUND_MOE_CONFIG="$base" "${b[@]}" --out "$OUT/layer-base-$i"
            run_step "layer_${lk}_$i" env BYTEBOUND_MOE_CONFIG="$tab" "${b[@]}" --out "$OUT/layer-$lk-$i"
        fi
    done
    for i in $(seq 1 "${AB_PAIRS:-2}"); do
        if [[ " $parts " == *" round "* ]]; then
            run_step "round_base_$i" env BYTEBOUND_MOE_CONFIG="$base" "${r[@]}" --name "round-base-$i"
            run_step "round_${lk}_$i" env BYTEBOUND_MOE_CONFIG="$tab" "${r[@]}" --name "round-$lk-$i"
        fi
    done
}

section_rk() {           # the twenty-third session's MoE config key RK (kernel A's partials summed and SwiGLU applied by a
    # launch of their own; docs/perf/session23-h100-w4a8/, section 4): moe_key_ab (AB_PARTS, default "tests layer
    # round"): RK off everywhere against on everywhere. The committed table has it in the M = 4 entry only since the
    # twenty-fourth session (docs/perf/session24-h100-rk/), so neither arm is the committed table
    moe_key_ab RK "${AB_PARTS:-tests layer round}"
}

section_retune() {       # the M = 4 (verify) entry's tiling re-tuned now that it has RK (no ticket tail in kernel A, so
    # more H slices may pay; the twenty-fourth session's next step): bench_moe --tune-stream at M = 4 over RETUNE_A
    # (kernel-A candidates, a JSON list of overrides of the committed entry; default below; RETUNE_B the kernel-B ones), then the MTP round with
    # the plain step (profile_round) with the committed table and with the sweep's best M = 4 entry, alternating,
    # AB_PAIRS pairs (default 2). Synthetic weights, random routing in the sweep.
    local cand='[{"KP": 5, "KC": 2}, {"KP": 5, "KC": 1}, {"KP": 10, "KC": 1}, {"BI": 32, "num_warps": 4, "KP": 10, "KC": 1},
        {"BI": 32, "num_warps": 4, "KP": 5, "KC": 2}, {"KP": 1, "KC": 10}]' i
    [ -n "${RETUNE_A:-}" ] && cand="$RETUNE_A"
    # RETUNE_B: kernel-B candidates tried with the best kernel A (default none)
    run_step tune python3 scripts/bench_moe.py --backends '' --m 4 --layers 4 --reps 20 --tune-stream \
        --out "$OUT/retune" --stream-a "$cand" --stream-b "${RETUNE_B:-[]}"
    python3 -c 'import json, sys
t = json.load(open("bytebound/kernels/configs/triton_moe.json"))
best = next(iter(json.load(open(sys.argv[1])).values()))["E512_H2560_I768_k8_M4"]
t["NVIDIA H200"]["E512_H2560_I768_k8_M4"] = best
print("retune: best M = 4 entry", json.dumps(best))
json.dump(t, open(sys.argv[2], "w"), indent=1)' "$OUT/retune/triton_moe_configs.json" "$OUT/retune-table.json" \
        | tee -a "$LOG" || { FAILED+=("retune/table"); return 0; }
    local r=(python3 scripts/profile_round.py --no-phases --ctx 2048 --draft-vocab "${AB_DRAFT_VOCAB:-32768}" --out "$OUT")
    for i in $(seq 1 "${AB_PAIRS:-2}"); do
        run_step "round_base_$i" "${r[@]}" --name "round-base-$i"
        run_step "round_retune_$i" env BYTEBOUND_MOE_CONFIG="$OUT/retune-table.json" "${r[@]}" --name "round-retune-$i"
    done
}

section_ring() {         # the twenty-fifth session's TR (kernel A as a persistent TMA ring, kernels/triton_moe_ring.py;
    # docs/perf/session25-h100-ring/): its GPU tests (TR == the split kernels at its partition, bit for bit), then
    # section retune over the TR candidates (M = 4 tune-stream + the MTP round with the best entry against the
    # committed one), then the same candidates at M = 1 (tune-stream only: the decode entry)
    local cand='[{"TR": 1, "NR": null}, {"TR": 1, "NR": null, "TR_ST": 6}, {"TR": 2, "NR": null}, {"TR": 2, "NR": null, "TR_ST": 6},
        {"TR": 1, "NR": null, "BI": 32, "num_warps": 4, "TR_ST": 4, "TR_G": 2}]'
    [ -n "${RING_A:-}" ] && cand="$RING_A"
    run_step tests python3 -m pytest tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider -rfE --tb=short \
        -k ring_kernel_a $(pytest_timeout)
    RETUNE_A="$cand" section_retune
    run_step tune_m1 python3 scripts/bench_moe.py --backends '' --m 1 --layers 4 --reps 20 --tune-stream \
        --out "$OUT/ring-m1" --stream-a "$cand" --stream-b '[]'
}

section_ringocc() {      # the twenty-sixth session (docs/perf/session26-h100-ring/): TR at one program of 8 warps per SM
    # lost to the split kernels (M = 4: 67-72 against 57.9 us). Hypothesis: too few warps resident to hide the decode's
    # latency (the split kernel A runs at ~41 % achieved occupancy, the ring at 12.5 %), not the TMA or the barriers.
    # So: the TR_XS 0 GPU tests (B from global memory: ~68 KB of shared memory a BI 64 program instead of ~109), then
    # section retune over TR with 2-6 programs per SM (TR_G), AB_PAIRS (default 1) rounds; the same at M = 1; then
    # ncu of the ring kernel at M = 4 at one program per SM and at three (TR_XS 0). Everything except the logs in
    # $OUT/ringocc.tar ($OUT returns at most 8 files). Every TR candidate says "NR": null: the committed M = 4 entry caps
    # the split kernel A (NR 80 since 31d0de8), which the ring refuses
    local cand='[{"TR": 1, "NR": null, "TR_G": 2}, {"TR": 1, "NR": null, "TR_G": 3, "TR_XS": 0}, {"TR": 1, "NR": null, "TR_G": 2, "TR_XS": 0},
        {"TR": 1, "NR": null, "BI": 32, "num_warps": 4, "TR_G": 6, "TR_XS": 0}, {"TR": 2, "NR": null, "TR_G": 2, "TR_XS": 0, "TR_REGS": 112},
        {"TR": 1, "NR": null, "BI": 32, "num_warps": 4, "TR_G": 3}]' x=/tmp/ringocc g
    [ -n "${RING_A:-}" ] && cand="$RING_A"
    rm -rf "$x"; mkdir -p "$x"
    run_step tests python3 -m pytest tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider -rfE --tb=short \
        -k "ring_kernel_a and xs0" $(pytest_timeout)
    OUT="$x" AB_PAIRS="${AB_PAIRS:-1}" RETUNE_A="$cand" section_retune
    run_step tune_m1 python3 scripts/bench_moe.py --backends '' --m 1 --layers 4 --reps 20 --tune-stream \
        --out "$x/m1" --stream-a "$cand" --stream-b '[]'
    for g in '{"TR": 1, "NR": null}' '{"TR": 1, "NR": null, "TR_G": 3, "TR_XS": 0}'; do
        local n; n=$(python3 -c 'import json, sys; c = json.loads(sys.argv[1]); print("g%d-xs%d" % (c.get("TR_G", 1), c.get("TR_XS", 1)))' "$g")
        python3 -c 'import json, sys
t = json.load(open("bytebound/kernels/configs/triton_moe.json"))
e = t["NVIDIA H200"]["E512_H2560_I768_k8_M4"]
e.update(json.loads(sys.argv[2]))
if e.get("NR") is None:
    e.pop("NR", None)
json.dump(t, open(sys.argv[1], "w"), indent=1)' "$x/ring-$n.json" "$g"
        echo "=== [$CURRENT] ncu_$n ($g at M = 4)" | tee -a "$LOG"
        BYTEBOUND_MOE_CONFIG="$x/ring-$n.json" timeout "$SECTION_TIMEOUT" ncu --clock-control none \
            --profile-from-start off --csv --page details --section SpeedOfLight --section LaunchStats \
            --section Occupancy --section WarpStateStats --metrics dram__bytes_read.sum \
            --kernel-name 'regex:_moe_|spin_kernel' python3 scripts/bench_moe.py --ncu-range --backends triton --m 4 \
            --layers 2 --out "$x/ncu-run-$n" > "$x/ncu-$n.csv" 2>&1 || FAILED+=("$CURRENT/ncu_$n")
        python3 scripts/ncu_table.py "$x/ncu-$n.csv" > "$x/ncu-$n.md" 2>&1
        cat "$x/ncu-$n.md" | tee -a "$LOG"
    done
    tar -cf "$OUT/ringocc.tar" -C "$x" . 2>&1 | tee -a "$LOG"
}

section_kernela() {      # the twenty-sixth session's open questions on the MoE kernel A (docs/perf/session26-h100-ring/,
    # sections 4-5), in one call: (1) the ring's GPU tests at the slot-row build (0e14850, never run on a GPU; 40
    # cases); (2) bench_moe --tune-stream at M = 4 and M = 1 over the ring with its slot rows (TR 2, TR 1, TR 2 with
    # TR_XS 0 at 2 programs per SM) and the register cap NR 64 / 56 / 48 on the committed split tiling (KERNELA_A
    # overrides the candidates); (3) ncu LaunchStats + Occupancy of the committed kernel A at M = 1 and 4: what
    # holds it to 3 programs per SM when ptxas gives it 64 registers offline
    local cand='[{"TR": 2, "NR": null}, {"TR": 1, "NR": null}, {"TR": 2, "NR": null, "TR_XS": 0, "TR_G": 2, "TR_REGS": 112}, {"NR": 64}, {"NR": 56},
        {"NR": 48}]' m
    [ -n "${KERNELA_A:-}" ] && cand="$KERNELA_A"
    run_step tests python3 -m pytest tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider -rfE --tb=short \
        -k ring_kernel_a $(pytest_timeout)
    for m in 4 1; do
        run_step "tune_m$m" python3 scripts/bench_moe.py --backends '' --m "$m" --layers 4 --reps 20 --tune-stream \
            --out "$OUT/kernela-m$m" --stream-a "$cand" --stream-b '[]'
    done
    echo "=== [$CURRENT] ncu: LaunchStats + Occupancy of the committed kernel A, M = 1 and 4" | tee -a "$LOG"
    timeout "$SECTION_TIMEOUT" ncu --clock-control none --profile-from-start off --kernel-name regex:_moe_gateup \
        --section LaunchStats --section Occupancy python3 scripts/bench_moe.py --ncu-range --backends triton \
        --m 1,4 --layers 1 --out /tmp/kernela-ncu > "$OUT/ncu-occupancy.txt" 2>&1 || FAILED+=("$CURRENT/ncu")
    grep -E "_moe_gateup|Registers Per|Block Limit|Theoretical Occ|Achieved Occ|Waves Per SM|Shared Memory" \
        "$OUT/ncu-occupancy.txt" | tee -a "$LOG"
}

# abba_pair I BASE_LABEL BASE_CMD CAND_LABEL CAND_CMD: run_step both arms of pair I, the base first in odd pairs and
# the candidate first in even ones (ABBA), so neither arm always runs first. BASE_CMD / CAND_CMD name arrays.
abba_pair() {
    local i="$1" base_label="$2" cand_label="$4"
    local -n abba_base_cmd="$3" abba_cand_cmd="$5"
    if [ $((i % 2)) -eq 1 ]; then
        run_step "$base_label" "${abba_base_cmd[@]}"
        run_step "$cand_label" "${abba_cand_cmd[@]}"
    else
        run_step "$cand_label" "${abba_cand_cmd[@]}"
        run_step "$base_label" "${abba_base_cmd[@]}"
    fi
}

# ab_table_pairs PAIRS STEP VAR TABLE FLAG PREFIX CMD...: PAIRS pairs in ABBA order (abba_pair) of CMD with VAR unset
# (the committed table; step STEP_base_i, CMD given FLAG PREFIX-base-i) and with VAR=TABLE (STEP_cand_i, PREFIX-cand-i).
ab_table_pairs() {
    local pairs="$1" step="$2" var="$3" tab="$4" flag="$5" prefix="$6" i base_cmd cand_cmd
    shift 6
    for i in $(seq 1 "$pairs"); do
        base_cmd=(env -u "$var" "$@" "$flag" "$prefix-base-$i")
        cand_cmd=(env "$var=$tab" "$@" "$flag" "$prefix-cand-$i")
        abba_pair "$i" "${step}_base_$i" base_cmd "${step}_cand_$i" cand_cmd
    done
}

# table_checks VAR TABLE LABEL [BASE]: with VAR=TABLE in the environment (BYTEBOUND_MOE_CONFIG or BYTEBOUND_GEMV_CONFIG),
# the engine tests of the CUDA defaults and the full-scale canaries; then the plain step and the MTP round
# (profile_round), BASE (VAR=BASE, or the committed table where BASE is empty) against TABLE, after a discarded
# warm-up process, AB_PAIRS pairs (default 2) in ABBA order. The sections nr, regcap, gemvcap and moetable end with it.
table_checks() {
    local var="$1" tab="$2" label="$3" base="${4:-}" i b
    # (b on a line of its own: within one `local`, "$var" would expand before var is assigned)
    b=(-u "$var")                           # the base arm: the committed table, even with VAR exported by the caller
    [ -n "$base" ] && b=("$var=$base")
    run_step engine env "$var=$tab" python3 -m pytest -m gpu tests/gpu/test_engine_gpu.py -q \
        -p no:cacheprovider -rfE --tb=short $(pytest_timeout) \
        -k "verify_equals or captured_mtp or (64_steps and triton-triton) or nano_greedy"
    run_step canaries env "$var=$tab" BYTEBOUND_FULLSCALE=1 \
        BYTEBOUND_TIMING_OUT="$OUT/canary_timing.json" python3 -m pytest \
        tests/test_verify.py::test_full_scale_canary_cost -q -p no:cacheprovider -rfE --tb=line
    local r=(python3 scripts/profile_round.py --no-phases --ctx 2048 --draft-vocab "${AB_DRAFT_VOCAB:-32768}" --out "$OUT")
    # the first process of a call ran the plain step 150-250 us slow in five of the six calls of sessions 27-28
    # (docs/perf/session28-h100-caps/): a discarded
    # warm-up process first, then the pairs in ABBA order, so neither arm always goes first
    run_step round_warmup "${r[@]}" --name round-warmup
    local base_cmd cand_cmd
    for i in $(seq 1 "${AB_PAIRS:-2}"); do
        base_cmd=(env "${b[@]}" "${r[@]}" --name "round-base-$i")
        cand_cmd=(env "$var=$tab" "${r[@]}" --name "round-$label-$i")
        abba_pair "$i" "round_base_$i" base_cmd "round_${label}_$i" cand_cmd
    done
}

section_moetable() {     # a candidate MoE table (MOE_TABLE, a path) against the committed one, as the engine runs the
    # layer: (1) bench_moe --shared (routed + the shared expert fused into the split kernels, and as a dense MLP) at
    # M = 1 and 4, after a discarded warm-up process, committed and candidate in ABBA order, MOETABLE_PAIRS pairs
    # (default 4); (2) the kernel
    # tests of NR and the engine tests + full-scale canaries + round/step A/B of table_checks with the candidate.
    # The twenty-eighth session's candidate (docs/perf/session28-h100-caps/call2-regcap-table.json: M = 1 with DQ 1
    # and NR 64, 8 % faster routed-only; M = 4 with BI 32 at 4 warps, 1.7 %) was swept routed-only; this measures it
    # with the shared slot, which the seventeenth session found turned DQ 1 at M = 1 from faster to slower (H200)
    local tab="${MOE_TABLE:-}" i
    if [ -z "$tab" ] || [ ! -f "$tab" ]; then
        echo "moetable: set MOE_TABLE to a table file (got '${tab}')" | tee -a "$LOG"; FAILED+=("moetable/no-table")
        return 0
    fi
    local bm=(python3 scripts/bench_moe.py --backends '' --m 1,4 --layers 4 --reps 20 --shared)
    # a discarded warm-up process (the first process of a call ran slow in five of six calls), then ABBA pairs
    run_step shared_warmup env -u BYTEBOUND_MOE_CONFIG "${bm[@]}" --out "$OUT/moetable-warmup"
    ab_table_pairs "${MOETABLE_PAIRS:-4}" shared BYTEBOUND_MOE_CONFIG "$tab" --out "$OUT/moetable" "${bm[@]}"
    grep -E "^shared M=|^=== \[moetable\] shared_(warmup|(base|cand)_[0-9]+): [^r]" "$LOG" | tee -a "$OUT/moetable-summary.txt"
    kernel_tests_by_id 'keeps_the_bits\[NR-'
    table_checks BYTEBOUND_MOE_CONFIG "$tab" moetable
}

section_routerseg() {    # the segmented routing tail (twenty-ninth session: kernels/triton_router.py _route_rows_seg, opt-in with
    # BYTEBOUND_ROUTER_SEG=1 until this section has passed; 0 is the one-segment tail): the router tests on the GPU (ids bit-equal to the previous
    # code and to the one-segment tail on ties, signs, -inf; the split tail), the router bench with the switch off
    # and on in ABBA order, then table_checks with the switch: engine tests, canaries, plain step + round A/B
    run_step tests python3 -m pytest tests/test_triton_router.py tests/gpu/test_kernels_gpu.py -k "rout" -q \
        -p no:cacheprovider -rfE --tb=short $(pytest_timeout)
    local b=(python3 scripts/bench_moe.py --backends '' --router --m 1,4 --layers 4 --reps 20) i n=2 base_cmd cand_cmd
    [ "${ROUTERSEG_BENCH:-1}" = 0 ] && n=0          # (skip the bench: a short call)
    for i in $(seq 1 $n); do
        base_cmd=(env BYTEBOUND_ROUTER_SEG=0 "${b[@]}" --out "$OUT/routerseg-$i-seg0")
        cand_cmd=(env BYTEBOUND_ROUTER_SEG=1 "${b[@]}" --out "$OUT/routerseg-$i-seg1")
        abba_pair "$i" "bench_seg0_$i" base_cmd "bench_seg1_$i" cand_cmd
    done
    grep -E "^=== \[routerseg\] bench_seg|gemv_route_add_norm \(engine|layer: gemv_route \+ split\+shared \(A pdl_in 1\)" \
        "$LOG" | grep -v ": rc=" | tee -a "$OUT/routerseg-summary.txt"
    table_checks BYTEBOUND_ROUTER_SEG 1 seg 0
}

section_nr() {           # the twenty-seventh session's register cap of kernel A at M = 4 (docs/perf/session27-h100-nr/):
    # NR 80 measured 54.1 us against 57.1-57.7 uncapped (ptxas gives the uncapped kernel 72 registers at run time,
    # 3 programs per SM; NR 64 gives 4 and is slower). In one call: (1) tune-stream at M = 4 around it; (2) the
    # bit-equality tests of NR (on vs absent, every tiling, M = 1/2/4, clamps, graph replay); (3) with a table that
    # has NR_VALUE (default 80) in the M = 4 entry: the engine tests of the CUDA defaults and the full-scale
    # canaries; (4) the MTP round with the plain step, the table without NR vs with NR_VALUE, alternating, AB_PAIRS
    # pairs. The sweep's base is the committed entry (NR 80 since 31d0de8); the round's base arm runs the table
    # without the cap (nr-off-table.json)
    local v="${NR_VALUE:-80}" tab="$OUT/nr-table.json" off="$OUT/nr-off-table.json"
    local cand='[{"NR": 72}, {"NR": 80}, {"NR": 88}]'
    [ -n "${NR_CAND:-}" ] && cand="$NR_CAND"
    python3 -c 'import json, sys
for path, val in ((sys.argv[1], int(sys.argv[3])), (sys.argv[2], None)):
    t = json.load(open("bytebound/kernels/configs/triton_moe.json"))
    for gpu, entries in t.items():
        if not gpu.startswith("_"):
            for key, e in entries.items():
                if key.endswith("_M4") and e.get("variant") == "split":
                    e.pop("NR", None)
                    if val is not None:
                        e["NR"] = val
    json.dump(t, open(path, "w"), indent=1)' "$tab" "$off" "$v" || { FAILED+=("nr/table"); return 0; }
    run_step tune_m4 python3 scripts/bench_moe.py --backends '' --m 4 --layers 4 --reps 20 --tune-stream \
        --out "$OUT/nr-m4" --stream-a "$cand" --stream-b '[]'
    kernel_tests_by_id 'keeps_the_bits\[NR-' graph_replay
    table_checks BYTEBOUND_MOE_CONFIG "$tab" nr "$off"
}

section_regcap() {       # register caps beyond NR 80 at M = 4 (the twenty-seventh session): kernel B's cap NR2 at M = 1 and 4,
    # kernel A's NR at M = 1. (1) tune-stream at each M: kernel-A candidates REGCAP_A1 / REGCAP_A4, then kernel-B
    # candidates REGCAP_B1 / REGCAP_B4 with the best kernel A; (2) the bit-equality tests of NR2; (3) a table with
    # each M's best entry: the engine tests of the CUDA defaults and the full-scale canaries with it; (4) the MTP
    # round and the plain step (profile_round), committed table vs that one, alternating, AB_PAIRS pairs (default 2).
    # REGCAP_SHARED (default 1, since the twenty-eighth session): the sweeps time the layer with the shared slot, as
    # the engine runs it (0: routed experts only, as before).
    # REGCAP_TESTS: the kernel tests' id pattern of step (2) (default the NR2 ones). REGCAP_PROFILE=1 adds the
    # kernel table of one decode step and one 4-token verify with the committed table (profile_decode.py, eager)
    local tab="$OUT/regcap-table.json"
    # (defaults as plain assignments: a "}" inside ${VAR:-...} would end the expansion)
    local a1='[{"NR": 72}, {"NR": 80}, {"NR": 96}]' a4='[]'
    local b1='[{"NR2": 64}, {"NR2": 80}, {"NR2": 96}, {"NR2": 128}]'
    local b4='[{"NR2": 96}, {"NR2": 112}, {"NR2": 128}, {"NR2": 168}]'
    a1="${REGCAP_A1:-$a1}"; a4="${REGCAP_A4:-$a4}"; b1="${REGCAP_B1:-$b1}"; b4="${REGCAP_B4:-$b4}"
    local sh=()
    [ "${REGCAP_SHARED:-1}" = 1 ] && sh=(--tune-shared)
    run_step tune_m1 python3 scripts/bench_moe.py --backends '' --m 1 --layers 4 --reps 20 --tune-stream "${sh[@]}" \
        --out "$OUT/regcap-m1" --stream-a "$a1" --stream-b "$b1"
    run_step tune_m4 python3 scripts/bench_moe.py --backends '' --m 4 --layers 4 --reps 20 --tune-stream "${sh[@]}" \
        --out "$OUT/regcap-m4" --stream-a "$a4" --stream-b "$b4"
    python3 -c 'import json, sys
t = json.load(open("bytebound/kernels/configs/triton_moe.json"))
for path in sys.argv[2:]:
    for key, e in next(iter(json.load(open(path)).values())).items():
        t["NVIDIA H200"][key] = e
        print("regcap: best", key, json.dumps(e))
json.dump(t, open(sys.argv[1], "w"), indent=1)' "$tab" "$OUT/regcap-m1/triton_moe_configs.json" \
        "$OUT/regcap-m4/triton_moe_configs.json" | tee -a "$LOG" || { FAILED+=("regcap/table"); return 0; }
    kernel_tests_by_id "${REGCAP_TESTS:-keeps_the_bits\[NR2-}"
    table_checks BYTEBOUND_MOE_CONFIG "$tab" regcap
    if [ "${REGCAP_PROFILE:-0}" = 1 ]; then
        run_step profile python3 scripts/profile_decode.py --ctx 2048 --verify-m 4 --eager-decode --top 40 \
            --out "$OUT" --name "profile-decode-$BYTEBOUND_COMMIT"
    fi
}

section_gemvcap() {      # the MMA FP8 GEMV's register cap NR (the twenty-seventh session: kernel A of the MoE ran 5 % faster
    # capped at or above ptxas' own count; the GEMV kernels use 106-164 registers). (1) the bit-equality tests of NR;
    # (2) bench_gemv --overrides GEMVCAP (default NR 96 / 128 / 168 / 200) at M = 1 and 4 for every decode shape;
    # (3) a GEMV table with, per shape, the cap whose M = 1 + M = 4 time beats the committed config's by >= 2 %
    # (in all four M entries of that shape: one config for decode and verify); (4) with it, the engine tests of the
    # CUDA defaults and the full-scale canaries; (5) the plain step and the MTP round (profile_round), committed
    # table vs that one, alternating, AB_PAIRS pairs (default 2)
    local tab="$OUT/gemvcap-table.json" cand='[{"NR": 96}, {"NR": 128}, {"NR": 168}, {"NR": 200}]'
    [ -n "${GEMVCAP:-}" ] && cand="$GEMVCAP"
    run_step tests python3 -m pytest tests/gpu/test_gemv_gpu.py -q -p no:cacheprovider -rfE --tb=short \
        $(pytest_timeout) -k register_cap
    run_step bench python3 scripts/bench_gemv.py --out "$OUT/gemvcap" --m 1,4 --overrides "$cand"
    python3 -c 'import collections, json, sys
from bytebound.kernels.triton_fp8 import gemv_key
t = json.load(open("bytebound/kernels/configs/triton_fp8_gemv.json"))
arch = next(a for a in t if not a.startswith("_"))
rows = json.load(open(sys.argv[2]))["results"]
n_m = len({r["M"] for r in rows})
tot = collections.defaultdict(lambda: collections.defaultdict(list))   # (n, k) -> {NR or None: [us per M]}
for r in rows:
    c = None if r["candidate"] is None else r["candidate"].get("NR")
    if r["rel_err"] <= 1e-2 and r["repeat_bit_equal"] and (r["candidate"] is None or c is not None):
        tot[r["n"], r["k"]][c].append(r["us"])
for (n, k), by in sorted(tot.items()):
    by = {c: sum(v) for c, v in by.items() if len(v) == n_m}     # a config timed right at every M
    base = by.pop(None, None)
    if base is None or not by:
        continue
    c, us = min(by.items(), key=lambda kv: kv[1])
    print(f"gemvcap: {n}x{k}: committed {base:.2f} us, best NR {c} {us:.2f} us (M = 1 + 4)")
    if us <= 0.98 * base:
        for m in (1, 2, 3, 4):
            e = t[arch].get(gemv_key(n, k, m))
            if e is not None and e.get("MMA"):
                e["NR"] = int(c)
json.dump(t, open(sys.argv[1], "w"), indent=1, sort_keys=True)' "$tab" "$OUT/gemvcap/bench_gemv.json" \
        | tee -a "$LOG" || { FAILED+=("gemvcap/table"); return 0; }
    table_checks BYTEBOUND_GEMV_CONFIG "$tab" gemvcap
}

section_ladder() {       # issue 21: the seed's ablation ladder with today's engine (CUDA defaults), one lever at a time:
    #   1. full scale, synthetic weights, 2K and 32K in (one engine per step, both lengths on it): humming MoE + FP32
    #      logits -> + triton MoE -> + FP8 head -> + MTP (hot-vocabulary draft head, LADDER_SYNTH_DRAFT_VOCAB); the +mtp
    #      row's measured round cost priced at the committed trained-model accept length (LADDER_ACCEPT);
    #   2. GSM8K 5-shot on the bundled ling-nano (trained), the seed's sampling (T 0.6, top-p 0.95, top-k 29);
    #   3. greedy parity spec == plain on 50 GSM8K prompts, full draft head and hot-vocabulary head;
    #   4. tests/gpu/test_adaptive_gpu.py::test_adaptive_synthetic_weights_falls_back (fixed in 700569a, not yet run);
    #   5. the synthetic ladder re-priced at this call's own accept lengths (no engine), the small records tarred.
    # Everything inside LADDER_BUDGET seconds (default 400); at most 8 files in $OUT: ablation_h200.{json,md} and
    # ablation_h200_ladder.png, the same three for ablation_h200_gsm8k, ladder.log, ladder-extra.tar (the mtp_accept
    # records). The names are docs/perf's, so the files are committed as they come back. The ladders write their report
    # after every step, so a step cut off by its timeout keeps the rows before it. --tpot-rule record: a TPOT rise
    # is listed in the report instead of stopping the ladder (one device call: every row is wanted);
    # --allow-fallback: a lever that cannot run is a row marked inactive, not the end of the ladder.
    LADDER_END=$(( SECONDS + ${LADDER_BUDGET:-400} ))
    local x=/tmp/ladder_extra full=bytebound/assets/configs/ling-3.0-flash.json
    # The +mtp rung's draft head at full scale: LADDER_SYNTH_DRAFT_VOCAB rows of the FP8 head (default 32768, the
    # issue's N; 0 = the full head). Synthetic weights have no token counts, so the hot set is ids 0..N-1 (the
    # bytes and kernels are what the rung measures); its price is the trained nano's hot-head accept length.
    local hot="${LADDER_SYNTH_DRAFT_VOCAB:-32768}" dv=() accept parity_rec
    rm -rf "$x"; mkdir -p "$x"
    if [ "$hot" != 0 ]; then
        python3 -c 'import json, sys; json.dump(list(range(int(sys.argv[1]))), open(sys.argv[2], "w"))' \
            "$hot" "$x/hot-ids.json" && dv=(--speculative-draft-vocab "$x/hot-ids.json")
        accept="${LADDER_ACCEPT:-docs/perf/mtp-accept-nano-h200-hot1024-e7bbb39.json}"
        parity_rec="$x/mtp-accept-nano-h200-hot.json"
    else
        accept="${LADDER_ACCEPT:-docs/perf/mtp-accept-nano-h200-full-e7bbb39.json}"
        parity_rec="$x/mtp-accept-nano-h200-full.json"
    fi
    LADDER_RESERVE=190 budget_step 200 synthetic python3 -m bytebound.cli bench ablation --model "$full" \
        --load-format dummy --device cuda --baseline-moe humming --input-len "${LADDER_LENS:-2048,32768}" \
        --output-len "${LADDER_OUT_LEN:-256}" --tpot-rule record --allow-fallback --price-accept-from "$accept" \
        "${dv[@]}" --no-progress --out "$OUT" --name ablation_h200
    local gsm=(python3 -m bytebound.cli bench ablation --workload gsm8k --device cuda --limit "${LADDER_GSM8K_LIMIT:-50}"
               --tpot-rule record --allow-fallback --no-progress --out "$OUT" --name ablation_h200_gsm8k)
    LADDER_RESERVE=90 budget_step 110 gsm8k "${gsm[@]}" --baseline-moe humming
    if ! python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
sys.exit(0 if d.get("steps") and (d.get("stop") or {}).get("step") != "baseline" else 1)' "$OUT/ablation_h200_gsm8k.json" \
            2>/dev/null; then   # humming is untried at the bundled model's widths (H 256, I 128): if the baseline
        #                         could not run, once more with the torch baseline (the first attempt is in the log)
        LADDER_RESERVE=80 budget_step 110 gsm8k_torch_baseline "${gsm[@]}" --baseline-moe torch
    fi
    LADDER_RESERVE=70 budget_step 50 parity_full python3 scripts/mtp_accept.py --device cuda --no-sampled --limit 50 \
        --out "$x" --name mtp-accept-nano-h200-full
    LADDER_RESERVE=50 budget_step 50 parity_hot python3 scripts/mtp_accept.py --device cuda --no-sampled --limit 50 \
        --speculative-draft-vocab "${LADDER_DRAFT_VOCAB:-1024}" --out "$x" --name mtp-accept-nano-h200-hot
    LADDER_RESERVE=8 budget_step 60 adaptive python3 -m pytest tests/gpu/test_adaptive_gpu.py -q -s -p no:cacheprovider \
        -rfE --tb=short $(pytest_timeout) -k test_adaptive_synthetic_weights_falls_back
    local more=() f
    for f in "$OUT/ablation_h200_gsm8k.json" "$parity_rec"; do
        has_mtp_accept "$f" && more+=(--price-accept-from "$f")
    done
    if [ -s "$OUT/ablation_h200.json" ] && [ ${#more[@]} -gt 0 ]; then
        LADDER_RESERVE=0 budget_step 30 reprice python3 -m bytebound.cli bench ablation --reprice \
            "$OUT/ablation_h200.json" --price-accept-from "$accept" "${more[@]}"
    fi
    rm -f "$x/hot-ids.json"
    tar -cf "$OUT/ladder-extra.tar" -C "$x" . 2>&1 | tee -a "$LOG"
}

section_integration() {  # ninth session: the merged decode fusions (add+RMSNorm, b_proj and the post-attention norm
    #                        inside kernels, V-split KDA, PDL entries, the swept GEMV table) and the plan/state
    #                        refactors: the kernel-level GPU tests, the kernel table of one decode step and one
    #                        verify, then the KDA V_SPLIT timings that pick the table entry (engine tests: engine)
    local q="-q -p no:cacheprovider -rfE --tb=short $(pytest_timeout)"
    run_step fuse python3 -m pytest tests/gpu/test_fuse_gpu.py tests/gpu/test_plan_gpu.py $q
    run_step kda python3 -m pytest tests/gpu/test_kda_gpu.py $q -k "graph_replay or default_launch or nano or full_width"
    run_step mla python3 -m pytest tests/gpu/test_mla_gpu.py $q -k "graph or nano"
    run_step profile python3 scripts/profile_decode.py --ctx 2048 --verify-m 4 --top 40 --out "$OUT" \
        --name "profile-decode-h200-$BYTEBOUND_COMMIT"
    run_step profile_nopdl env BYTEBOUND_PDL=0 python3 scripts/profile_decode.py --ctx 2048 --verify-m 0 --top 10 \
        --out "$OUT" --name "profile-decode-nopdl-h200-$BYTEBOUND_COMMIT"
    run_step bench_kda python3 scripts/bench_kda.py --tokens 1,4 --backends triton --warps 4,8 --v-splits 1,2,4,8 \
        --out "$OUT/bench_kda.json"
}

section_adaptive() {     # issue 21: adaptive speculation on the bundled model's GSM8K (trained ling-nano, the seed's
    #                        sampling T 0.6 / top-p 0.95 / top-k 29, captured sampled rounds): plain, fixed MTP and
    #                        adaptive MTP on the same questions; acceptance: adaptive stays on and its TPOT is no worse
    #                        than fixed MTP. The three reports' .md in $OUT, everything (json, md, png) in
    #                        $OUT/adaptive.tar: $OUT returns at most 8 files (questions: ADAPTIVE_LIMIT, default 30)
    local n="${ADAPTIVE_LIMIT:-30}" x=/tmp/adaptive_runs
    rm -rf "$x"; mkdir -p "$x"
    local b=(python3 -m bytebound.cli bench gsm8k --device cuda --no-progress --out "$x" --limit "$n")
    run_step plain "${b[@]}" --name gsm8k-plain
    run_step mtp "${b[@]}" --speculative-algorithm NEXTN --name gsm8k-mtp
    run_step adaptive "${b[@]}" --speculative-algorithm NEXTN --speculative-adaptive --name gsm8k-adaptive
    cp "$x"/*.md "$OUT"/ 2>/dev/null
    tar -cf "$OUT/adaptive.tar" -C "$x" . 2>&1 | tee -a "$LOG"
}

section_env() {          # what the machine has
    run_step env bash -c 'nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; python3 -m pip list 2>/dev/null | grep -i -E "fla|humming|triton|torch"'
}

main() {
    if [ "${1:-}" = "--list" ]; then printf '%s\n' "${SECTIONS[@]}" "${ON_DEMAND[@]}"; return 0; fi
    local todo=("$@")
    [ ${#todo[@]} -eq 0 ] && todo=("${SECTIONS[@]}")
    install_wheels || FAILED+=("install_wheels")
    for s in "${todo[@]}"; do
        if ! declare -F "section_$s" >/dev/null; then
            echo "unknown section '$s' (have: ${SECTIONS[*]} ${ON_DEMAND[*]})"; FAILED+=("$s(unknown)"); continue
        fi
        CURRENT="$s"; LOG="$OUT/$s.log"; : >"$LOG"
        "section_$s"
    done
    echo "gpu_check: sections ${todo[*]}; commit $BYTEBOUND_COMMIT; logs in $OUT"
    if [ ${#FAILED[@]} -gt 0 ]; then echo "FAILED: ${FAILED[*]}"; return 1; fi
    echo "all passed"
}

main "$@"
