"""``bytebound bench``: synthetic, gsm8k and ablation runs, each writing JSON + markdown + PNG.

Usage::

    bytebound bench synthetic [engine flags] --input-len 32768 --output-len 2048 [--num-requests 1]
        [--bandwidth auto|none|GBs] [--out DIR] [--name NAME]
    bytebound bench gsm8k [engine flags] [--limit N] [--shots 5] [--max-tokens 512]
        [--temperature 0.6 --top-p 0.95 --top-k 29] [--seed 0] [--out DIR]
    bytebound bench ablation [engine flags] [--workload synthetic|gsm8k] [--input-len ... | --limit ...]
        [--baseline-moe torch] [--kernel-moe triton] [--tpot-tolerance 0.01] [--allow-fallback] [--out DIR]

Engine flags are the shared ones (``--model``, ``--device``, ``--load-format dummy``, ``--lm-head``, backends,
``--speculative-algorithm NEXTN``...). The ablation sets the MoE backend, LM head and MTP itself, step by step.
The synthetic defaults (32768 in / 2048 out) need the full-scale config (``--model
bytebound/assets/configs/ling-3.0-flash.json --load-format dummy --device cuda``); the bundled ling-nano has
4096 positions, so give it shorter ``--input-len``/``--output-len``.
Files: ``DIR/NAME.json``, ``DIR/NAME.md``, ``DIR/NAME_*.png`` (NAME defaults to the benchmark's name).
Exit codes: 0 done; 2 the engine could not start or a bad argument; 3 the ablation stopped early.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace

from bytebound.bench import report as rp
from bytebound.errors import ByteboundError

# --shots ceiling: twice the usual GSM8K protocols (5 or 8 exemplars). An exemplar is ~200 tokens (bundled
# tokenizer), so 16 shots (~3000 tokens) still fit the default --max-model-len 4096; more would skip every question.
MAX_SHOTS = 16


def _common(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--out", default="bench-results", help="output folder (default: bench-results)")
    p.add_argument("--name", default=name, help=f"file stem of the report (default: {name})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights-label", default=None,
                   help=f"what the weights are, for the report (default: dummy -> '{rp.WEIGHTS_SYNTHETIC}', "
                        f"bundled ling-nano -> '{rp.WEIGHTS_TRAINED}')")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--note", default=None, help="free text recorded in the report (a workaround, a caveat)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (CPU; 1 is fastest for tiny models on a busy machine)")


def _synthetic_args(p, input_len: int = 32768, output_len: int = 2048) -> None:
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--num-requests", type=int, default=1, help="timed requests (distinct seeded prompts)")
    p.add_argument("--warmup", type=int, default=1, help="short untimed requests first")


def _gsm8k_args(p) -> None:
    p.add_argument("--limit", type=int, default=None, help="first N test questions (default: all 1319)")
    p.add_argument("--shots", type=int, default=5, help=f"exemplars per prompt, 0-{MAX_SHOTS} (default 5)")
    p.add_argument("--max-tokens", type=int, default=512, help="per question, clamped to the room in max_model_len")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=29)


def add_parser(subparsers) -> argparse.ArgumentParser:
    from bytebound.cli import add_engine_args
    from bytebound.verify.cli import add_verify_args
    p = subparsers.add_parser("bench", help="benchmarks: synthetic, gsm8k, ablation", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench", required=True)
    s = sub.add_parser("synthetic", help="fixed-length greedy decode (default 32768 in / 2048 out)")
    add_engine_args(s)
    _common(s, "synthetic")
    _synthetic_args(s)
    s.add_argument("--bandwidth", default="auto", help="auto (measure here), none, or GB/s for the byte floor")
    s.add_argument("--ttft-lens", default="", help="also time prefill-only requests of these prompt lengths "
                   "(comma-separated, e.g. 2048,8192,32768): TTFT and achieved TFLOP/s")
    s.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                   help="device time by kernel of one N-token prefill (torch.profiler), in the report")
    add_verify_args(s, strict_default=True)
    s.set_defaults(fn=cmd_synthetic)
    g = sub.add_parser("gsm8k", help="GSM8K 5-shot accuracy and latency")
    add_engine_args(g)
    _common(g, "gsm8k")
    _gsm8k_args(g)
    add_verify_args(g, strict_default=True)
    g.set_defaults(fn=cmd_gsm8k)
    a = sub.add_parser("ablation", help="baseline -> +kernel -> +fp8-head -> +mtp, one lever at a time",
                       description=__import__("bytebound.bench.ablation", fromlist=["x"]).__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(a)
    _common(a, "ablation")
    a.add_argument("--workload", default="synthetic", choices=["synthetic", "gsm8k"])
    _synthetic_args(a, 32768, 2048)
    _gsm8k_args(a)
    a.add_argument("--baseline-moe", default="torch", help="generic routed-MoE backend of the baseline")
    a.add_argument("--kernel-moe", default="triton", help="shape-specialised routed-MoE backend (+kernel step)")
    a.add_argument("--tpot-tolerance", type=float, default=0.01,
                   help="an active step whose TPOT rises more than this fraction stops the ladder (default 0.01)")
    a.set_defaults(fn=cmd_ablation)
    return p


# ---- helpers ----------------------------------------------------------------------------------------------
def _config(a, synthetic: bool = False, min_len: int = 0):
    """EngineConfig of the command line; ``synthetic``: with ``max_model_len`` raised to what the fixed-length
    requests need (flag errors first, then the length check of :func:`_synthetic_len`), and to ``min_len``."""
    from bytebound.cli import engine_config
    cfg = engine_config(a)
    if hasattr(a, "no_canaries"):      # synthetic / gsm8k: start-up canaries, strict unless --no-strict
        from bytebound.verify.cli import apply_verify_args
        cfg = apply_verify_args(cfg, a)
    if not synthetic:
        return cfg
    return replace(cfg, max_model_len=max(cfg.max_model_len, _synthetic_len(a, a.speculative_num_steps), min_len))


def _start(cfg):
    from bytebound.cli import print_fallbacks
    from bytebound.engine.engine import Engine
    t = time.perf_counter()
    eng = Engine(cfg)
    print_fallbacks(eng)
    print(f"[bench] engine started in {time.perf_counter() - t:.1f} s (head path {eng.model.lm_head.mode}, "
          f"MTP steps={cfg.speculative_steps}; kernels: " + ", ".join(f"{op}={r.resolved}" for op, r in
                                                                     eng.plan.resolutions.items()) + ")", flush=True)
    return eng


def _synthetic_len(a, steps: int) -> int:
    """Cache slots a synthetic request needs; raises ConfigError naming --input-len/--output-len when the model's
    ``max_position_embeddings`` is smaller (the engine's own check would name --max-model-len, which the bench
    raised by itself)."""
    need = a.input_len + a.output_len + steps + 1
    from bytebound.config import LingConfig
    from bytebound.errors import ConfigError
    limit = LingConfig.from_file(a.model).max_position_embeddings
    if need > limit:
        from bytebound.config import LING3_FLASH_CONFIG
        raise ConfigError(f"--input-len {a.input_len} + --output-len {a.output_len} (+ {steps + 1} slots for the "
                          f"last decode/verify step) need {need} positions, but {a.model} has "
                          f"max_position_embeddings {limit}: pass shorter lengths, or run the full-scale model "
                          f"with synthetic weights (--model {LING3_FLASH_CONFIG} --load-format dummy --device cuda)")
    return need


def _print(paths: dict) -> None:
    print(f"[bench] wrote {paths['json']}, {paths['markdown']}" + "".join(f", {p}" for p in paths["png"]))


def _validate(a) -> None:
    """Reject bad numbers and an unwritable --out before any work is done (results are never lost at the end)."""
    from pathlib import Path
    from bytebound.errors import ConfigError
    for name in ("limit", "shots", "input_len", "output_len", "num_requests", "warmup", "max_tokens"):
        v = getattr(a, name, None)
        low = 1 if name in ("limit", "input_len", "output_len", "num_requests", "max_tokens") else 0
        if v is not None and v < low:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
    if getattr(a, "shots", None) is not None and a.shots > MAX_SHOTS:
        raise ConfigError(f"--shots must be <= {MAX_SHOTS}, got {a.shots} (an exemplar is ~200 tokens; "
                          "GSM8K protocols use 5 or 8)")
    if getattr(a, "bandwidth", None) is not None and a.bandwidth not in ("auto", "none"):
        from bytebound.analysis.cli import parse_bandwidth
        parse_bandwidth(a.bandwidth, "'auto' or 'none'")         # the same rule as analyze, before the engine loads
    tol = getattr(a, "tpot_tolerance", None)
    if tol is not None and not 0 <= tol < math.inf:
        raise ConfigError(f"--tpot-tolerance must be a fraction >= 0 (0.01 = 1 %), got {tol}")
    # the report files are OUT/NAME.json, .md and NAME_*.png: a separator would write outside --out
    if not a.name.strip() or "/" in a.name or "\\" in a.name:
        raise ConfigError(f"--name must be a plain file stem (no path separators, not empty), got {a.name!r}")
    Path(a.out).mkdir(parents=True, exist_ok=True)


def _guard(fn):
    def run(a) -> int:
        if a.torch_threads:
            import torch
            torch.set_num_threads(a.torch_threads)
        try:
            _validate(a)
            return fn(a)
        except (ByteboundError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
            print(f"[bench] error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    run.__name__ = fn.__name__
    return run


# ---- synthetic --------------------------------------------------------------------------------------------
@_guard
def cmd_synthetic(a) -> int:
    from bytebound.bench.synthetic import byte_floor, draw_token_times, floor_ratio, measure_bandwidth, run_synthetic
    ttft_lens = _int_list(a.ttft_lens, "--ttft-lens")
    eng = _start(_config(a, synthetic=True, min_len=max([n + 2 for n in ttft_lens], default=0)))
    meta = rp.run_meta(eng, weights=a.weights_label, note=a.note)
    # prefill-only requests first: they compile the long-chunk shapes, so the timed request below runs warm
    prefill = _prefill_section(eng, ttft_lens, a.profile_prefill, a.seed)
    res = run_synthetic(eng, a.input_len, a.output_len, a.num_requests, a.warmup, a.seed, not a.no_progress)
    s = rp.summarize(res["outputs"])
    bw, bw_note = measure_bandwidth(eng.device, a.bandwidth)
    acc = s.get("accept_length", {}).get("aggregate")
    floor = byte_floor(eng, bw, a.input_len + a.output_len // 2, acc)
    ratio = floor_ratio(floor, s["tpot_ms"]["mean"])
    floor.update(bandwidth_note=bw_note, tpot_over_floor=ratio)
    title = f"Synthetic benchmark: {a.input_len} in / {a.output_len} out, greedy, batch 1"
    md = [f"# {title}", ""] + rp.meta_section(meta) + ["", "## Results", ""] + rp.latency_table(s) + ["", "## Byte floor", ""]
    if "floor_ms" in floor:
        line = (f"One decode step reads {floor['step_bytes'] / 1e9:.3f} GB (weights {floor['weight_bytes'] / 1e9:.3f} GB, "
                f"LM head {floor['ledger_head']}, + KDA state and MLA cache at {floor['context']} tokens); at "
                f"{bw:.1f} GB/s the floor is **{floor['floor_ms']:.3f} ms**")
        if "mtp_floor_ms_per_token" in floor:
            line += (f", {floor['mtp_floor_ms_per_token']:.3f} ms per token with MTP at accept length "
                     f"{floor['accept_length']:.2f}")
        md.append(line + (f". Measured TPOT / floor = **{ratio:.2f}x**." if ratio else "."))
    md += ["", f"Bandwidth: {bw_note}.", f"Ledger: {floor.get('note', '')}."]
    md += _prefill_markdown(prefill, getattr(eng, "startup", None))
    data = {"benchmark": "synthetic", "meta": meta, "workload": {"input_len": a.input_len, "output_len": a.output_len,
            "num_requests": a.num_requests, "sampling": "greedy, ignore_eos", "seed": a.seed},
            "summary": s, "byte_floor": floor, "prefill": prefill, "startup": getattr(eng, "startup", None),
            "requests": [{"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
                          "ttft_s": o.ttft_s, "tpot_s": o.tpot_s, "e2e_s": o.e2e_s, "spec": o.spec}
                         for o in res["outputs"]]}
    paths = rp.write_report(a.out, a.name, data, md, {"tokens": draw_token_times(res["token_times"], title)})
    t = s["tpot_ms"]
    print(f"[bench] synthetic: TPOT {t['mean']:.3f} ms (P50 {t['p50']:.3f}, P95 {t['p95']:.3f}), decode "
          f"{s['decode_tok_s']['aggregate']:.1f} tok/s, TTFT {s['ttft_ms']['mean']:.1f} ms"
          + (f", accept length {acc:.2f}" if acc else ""))
    print("[bench] byte floor: " + (f"{floor['floor_ms']:.3f} ms, TPOT/floor {ratio:.2f}x ({bw_note})"
                                     if ratio else bw_note))
    _print(paths)
    return 0


def _int_list(spec: str, flag: str) -> list[int]:
    from bytebound.errors import ConfigError
    try:
        out = [int(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated token counts, got {spec!r}") from None
    if any(v < 1 for v in out):
        raise ConfigError(f"{flag}: every length must be >= 1, got {spec!r}")
    return out


def _prefill_section(eng, lens: list[int], profile_n: int, seed: int) -> dict:
    from bytebound.bench.synthetic import profile_prefill, run_ttft
    out = {"ttft": run_ttft(eng, lens, seed) if lens else []}
    for r in out["ttft"]:
        print(f"[bench] TTFT {r['input_len']} tokens: {r['ttft_s'] * 1e3:.1f} ms warm ({r['tflops']:.1f} TFLOP/s), "
              f"first request {r['first_ttft_s'] * 1e3:.1f} ms", flush=True)
    if profile_n:
        out["profile"] = profile_prefill(eng, profile_n, seed)
    return out


def _prefill_markdown(prefill: dict, startup: dict | None) -> list[str]:
    md = []
    if prefill.get("ttft"):
        md += ["", "## Prefill (TTFT, prefill-only requests)", "",
               "| prompt tokens | TTFT (warm) | TFLOP/s achieved | first request (compiles new shapes) |",
               "|---:|---:|---:|---:|"]
        md += [f"| {r['input_len']} | {r['ttft_s'] * 1e3:.1f} ms | {r['tflops']:.1f} | {r['first_ttft_s'] * 1e3:.1f} ms |"
               for r in prefill["ttft"]]
        md += ["", "TFLOP/s: 2 x active weights (LM head excluded) per token + causal MLA attention, over TTFT "
               "(`bench.synthetic.prefill_flops`)."]
    p = prefill.get("profile")
    if p and p["rows"]:
        md += ["", f"## Device time by kernel, one {p['tokens']}-token prefill", "",
               f"wall {p['wall_s'] * 1e3:.1f} ms, device {p['device_s'] * 1e3:.1f} ms, {p['kernels']} kernels", "",
               "| kernel | calls | device ms | share |", "|---|---:|---:|---:|"]
        md += [f"| `{r['name']}` | {r['calls']} | {r['device_ms']:.2f} | {100 * r['share']:.1f} % |" for r in p["rows"]]
    if startup:
        md += ["", "## Start-up", "", "| phase | seconds |", "|---|---:|"]
        md += [f"| {k[:-2]} | {v:.1f} |" for k, v in startup.items() if k.endswith("_s") and k != "total_s"]
        md += [f"| **total** | **{startup['total_s']:.1f}** |"]
        if "triton_compiled" in startup:
            md += ["", f"Triton kernels compiled during start-up: {startup['triton_compiled']} ("
                   f"{'warm cache' if startup['triton_compiled'] == 0 else 'cold cache'}, `{startup['triton_cache']}`)."]
    return md


# ---- gsm8k ------------------------------------------------------------------------------------------------
def gsm8k_markdown(res: dict, s: dict, meta: dict, title: str) -> list[str]:
    n, k = res["n"], res["correct"]
    lo, hi = rp.wilson(k, n)
    sp = res["sampling"]
    skip = f"{_skipped(res)} (not in the accuracy). " if res.get("skipped") else ""
    md = [f"# {title}", ""] + rp.meta_section(meta) + ["", "## Accuracy", "",
          f"**{k}/{n} = {100 * k / max(n, 1):.1f}%** (95% Wilson interval {100 * lo:.1f}-{100 * hi:.1f}%). {skip}"
          f"{sp['shots']}-shot prompts (exemplars from train, seed {sp['seed']}), temperature {sp['temperature']}, "
          f"top-p {sp['top_p']}, top-k {sp['top_k']}, max_tokens {sp['max_tokens']}, stop {sp['stop']!r}; "
          "answer = first number after `####` (commas stripped).", "", "## Latency", ""]
    md += rp.latency_table(s)
    return md


def _skipped(res: dict) -> str:
    """``"N skipped: prompt does not fit max_model_len"`` (not in the accuracy), or ``""``."""
    return f"{res['skipped']} skipped: prompt does not fit max_model_len" if res.get("skipped") else ""


@_guard
def cmd_gsm8k(a) -> int:
    from bytebound.bench.gsm8k import run_gsm8k
    eng = _start(_config(a))
    meta = rp.run_meta(eng, weights=a.weights_label, note=a.note)
    res = run_gsm8k(eng, a.limit, a.shots, a.seed, a.max_tokens, a.temperature, a.top_p, a.top_k, not a.no_progress)
    s = rp.summarize(res["outputs"])
    n, k = res["n"], res["correct"]
    title = f"GSM8K benchmark: {len(res['rows'])} test questions, batch 1"
    data = {"benchmark": "gsm8k", "meta": meta, "sampling": res["sampling"],
            "accuracy": k / n if n else 0.0, "correct": k, "n": n, "skipped": res["skipped"],
            "ci95": list(rp.wilson(k, n)), "summary": s, "questions": res["rows"]}
    md = gsm8k_markdown(res, s, meta, title)
    paths = rp.write_report(a.out, a.name, data, md, {"latency": rp.draw_latency(res["outputs"], title)})
    acc = s.get("accept_length", {}).get("aggregate")
    skip = f" ({_skipped(res)})" if res["skipped"] else ""       # skipped questions are not in k/n
    print(f"[bench] gsm8k: accuracy {k}/{n} = {100 * k / max(n, 1):.1f}%{skip}, "
          f"TPOT {rp.fmt(s['tpot_ms']['mean'], 3)} ms, decode {rp.fmt(s['decode_tok_s']['aggregate'], 1)} tok/s, "
          f"TTFT {rp.fmt(s['ttft_ms']['mean'], 1)} ms, "
          f"e2e mean {rp.fmt(s['e2e_ms']['mean'], 0)} ms" + (f", accept length {acc:.2f}" if acc else ""))
    _print(paths)
    return 0


# ---- ablation ---------------------------------------------------------------------------------------------
@_guard
def cmd_ablation(a) -> int:
    from bytebound.bench.ablation import draw_ladder, run_ablation
    progress = not a.no_progress
    if a.workload == "synthetic":
        from bytebound.bench.synthetic import run_synthetic
        base = _config(a, synthetic=True)
        workload_desc = {"workload": "synthetic", "input_len": a.input_len, "output_len": a.output_len,
                         "num_requests": a.num_requests, "sampling": "greedy, ignore_eos"}

        def workload(eng):
            return run_synthetic(eng, a.input_len, a.output_len, a.num_requests, a.warmup, a.seed, progress)["outputs"], {}
    else:
        from bytebound.bench.gsm8k import run_gsm8k
        base = _config(a)
        workload_desc = {"workload": "gsm8k", "limit": a.limit, "shots": a.shots, "max_tokens": a.max_tokens,
                         "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k}

        def workload(eng):
            r = run_gsm8k(eng, a.limit, a.shots, a.seed, a.max_tokens, a.temperature, a.top_p, a.top_k, progress)
            return r["outputs"], {"accuracy": r["correct"] / r["n"] if r["n"] else 0.0}
    meta: dict = {}

    def make(cfg):
        eng = _start(cfg)
        if not meta:
            meta.update(rp.run_meta(eng, weights=a.weights_label, note=a.note))
        return eng

    res = run_ablation(base, workload, a.baseline_moe, a.kernel_moe, a.speculative_num_steps, a.tpot_tolerance,
                       a.allow_fallback, make_engine=make)
    data = {"benchmark": "ablation", "meta": meta, "workload": workload_desc, **res}
    paths = rp.write_report(a.out, a.name, data, ablation_markdown(res, meta, workload_desc),
                            {"ladder": draw_ladder(res)})
    _print(paths)
    return 3 if res["status"] == "stopped" else 0


def ablation_markdown(res: dict, meta: dict, workload: dict) -> list[str]:
    md = ["# Ablation ladder: one lever at a time", "", f"Workload: `{workload}`. Each step is a fresh engine that "
          "changes one lever of the previous step and checks that the lever is active before it is timed.", ""]
    skipped = [s["step"] for s in res["steps"] if s.get("skipped")]
    if res["stop"]:
        md += [f"**Stopped at step `{res['stop']['step']}`: {res['stop']['message']}**", ""]
    elif res.get("tpot_rule", "enforced") != "enforced":
        md += ["**CPU run: complete as far as a CPU can show.** " + (f"Skipped: {', '.join(skipped)} (see the "
               "check column). " if skipped else "") + "Each lever that ran was checked active; TPOT changes are "
               "recorded, not enforced: the levers cut bytes per token, and a CPU decode of a small model is bound "
               "by per-op overhead, not memory bandwidth. The speed ladder is a CUDA measurement.", ""]
    else:
        md += ["**Complete: every lever active, no step made TPOT worse.**", ""]
    md += ["| step | lever | active | check | mean TPOT [ms] | vs previous | vs baseline | decode tok/s | "
           "TTFT [ms] | accept length | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in res["steps"]:
        sm = s.get("summary", {})
        acc = sm.get("accept_length", {}).get("aggregate")
        active = "skipped" if s.get("skipped") else ("yes" if s["active"] else "NO")
        md.append(f"| {s['step']} | {s['lever']} | {active} | {s['check']} | "
                  f"{rp.fmt(s.get('tpot_ms'), 3)} | "
                  + (f"{s['change_pct']:+.2f}% ({s['change_ms']:+.3f} ms)" if "change_pct" in s else "-") + " | "
                  + (f"{s['change_vs_baseline_pct']:+.2f}%" if "change_vs_baseline_pct" in s else "-") + " | "
                  f"{rp.fmt(sm.get('decode_tok_s', {}).get('aggregate'), 1)} | {rp.fmt(sm.get('ttft_ms', {}).get('mean'), 1)} | "
                  f"{rp.fmt(acc)} | {s.get('note', '')} |")
    if meta:
        md += ["", "## Run (baseline engine)", ""] + rp.meta_section(meta)
    md += ["", f"TPOT tolerance {100 * res['tolerance']:.1f}%; --allow-fallback {res['allow_fallback']} "
           "(inactive levers are recorded and not compared instead of stopping the ladder)."]
    return md
