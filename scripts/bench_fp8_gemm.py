#!/usr/bin/env python3
"""Prefill FP8 block-scaled GEMM microbenchmark at Ling-3.0-flash shapes (dense projections, hidden 2560).

For each projection shape (N x K) and M (default 2048, the prefill chunk, and 8192) it times, on one GPU:

* ``dequant``: today's prefill path of ``linear`` backend ``triton``: dequantise the FP8 weight to BF16 (one Triton
  kernel, ``2*N*K`` bytes written) + ``F.linear`` (cuBLAS BF16);
* ``bf16_cublas``: the cuBLAS BF16 GEMM alone on a pre-dequantised weight (what dequant would cost with a resident
  BF16 copy: twice the weight memory, not an option, shown as the reference point);
* ``fp8``: ``fp8_block_gemm`` (1x128 activation quantiser + Triton GEMM on FP8 tensor cores), and ``fp8_gemm``
  its GEMM launch alone;
* ``scaled_mm``: the same quantiser + cuBLASLt block-scaled ``torch._scaled_mm`` (1x128 x 128x128), when the probe
  ``scaled_mm_available`` passes on this torch/GPU (else the reason is recorded).

Reported per case: median device time over ``--reps`` calls (CUDA events, after warm-up), TFLOP/s = 2*M*N*K / t,
and the rel error against the float64 reference (for the FP8 paths the product of the quantised operands, for
the BF16 paths the product with the BF16 activations). ``--sweep`` also times a fixed set of Triton launch
configs per case and reports the fastest (the candidates for ``triton_fp8.gemm_config``). Weights are synthetic
(random, power-of-two scales). Prints device, date and commit, a table last, and writes ``bench_fp8_gemm.json`` to
``$OUT`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bytebound.analysis.bandwidth import cuda_event_times  # noqa: E402
from bytebound.bench.report import git_commit  # noqa: E402

SHAPES = {          # name: (N, K)
    "kda_qkvfg": (20480, 2560), "kda_o": (2560, 4096), "mla_q": (6144, 2560), "mla_kv_a": (576, 2560),
    "mla_kv_b": (8192, 512), "dense_o": (2560, 4096), "mlp_gate_up": (6144, 2560), "mlp_down": (2560, 6144),
    "shared_gate_up": (768, 2560), "shared_down": (2560, 768),
}
SWEEP = [dict(BM=bm, BN=bn, BK=128, GROUP_M=8, num_warps=w, num_stages=s) for bm, bn, w, s in
         [(128, 128, 8, 4), (128, 128, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3),
          (128, 64, 4, 4), (64, 128, 4, 4), (64, 256, 8, 3), (64, 64, 4, 5)]]


def rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def timed(fn, reps: int) -> float:
    return statistics.median(cuda_event_times(fn, reps, warmup=3))


def bench_case(fp8k, name: str, n: int, k: int, m: int, reps: int, sweep: bool) -> dict:
    from bytebound.quant import dequantize_fp8_block, fp8_block_matmul_ref, quantize_fp8_block, quantize_fp8_group
    g = torch.Generator(device="cuda").manual_seed(n + k)
    wq, ws = quantize_fp8_block(torch.randn(n, k, device="cuda", generator=g) * 0.02, (128, 128), pow2=True)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    flop = 2.0 * m * n * k
    wd64 = dequantize_fp8_block(wq, ws, (128, 128), torch.float64)
    exact = x.double() @ wd64.t()
    xq, sx = quantize_fp8_group(x, 128)
    ref_q = fp8_block_matmul_ref(xq, sx, wq, ws)
    del wd64
    row = {"name": name, "N": n, "K": k, "M": m, "flop": flop, "paths": {}}

    def record(path, fn, ref):
        try:
            y = fn()
            err = rel(y, ref)
            t = timed(fn, reps)
            row["paths"][path] = {"s": t, "tflops": flop / t / 1e12, "rel_err": err}
        except Exception as e:      # noqa: BLE001 - a path that fails here is reported, the others still run
            row["paths"][path] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}

    record("dequant", lambda: fp8k.fp8_block_linear(x, wq, ws, (128, 128), prefill="dequant"), exact)
    wbf = dequantize_fp8_block(wq, ws, (128, 128), torch.bfloat16)
    record("bf16_cublas", lambda: F.linear(x, wbf), exact)
    del wbf
    record("fp8", lambda: fp8k.fp8_block_gemm(x, wq, ws), ref_q)
    q, s = fp8k.quantize_fp8_groups(x, 128)
    record("fp8_quant", lambda: fp8k.quantize_fp8_groups(x, 128)[0], xq.float())
    cfg = fp8k.gemm_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    row["fp8_config"] = cfg
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    def gemm_only(c):
        grid = (fp8k.triton.cdiv(m, c["BM"]) * fp8k.triton.cdiv(n, c["BN"]),)
        fp8k._fp8_block_gemm[grid](q, s, wq, ws, out, m, n, k, ws.shape[1], SBN=128, SBK=128, BM=c["BM"],
                                   BN=c["BN"], BK=c["BK"], GROUP_M=c["GROUP_M"], EVEN_K=(k % c["BK"] == 0),
                                   num_warps=c["num_warps"], num_stages=c["num_stages"])
        return out
    record("fp8_gemm", lambda: gemm_only(cfg), ref_q)
    why = fp8k.scaled_mm_available("cuda")
    if why is None:
        sb = fp8k.scaled_mm_weight_scale(ws)
        record("scaled_mm", lambda: fp8k.scaled_mm_block_gemm(x, wq, sb), ref_q)
        record("scaled_mm_gemm", lambda: fp8k._scaled_mm_call(fp8k._SCALED_MM[fp8k._cuda_dev("cuda")][0][0], q, s,
                                                              wq, sb), ref_q)
    else:
        row["paths"]["scaled_mm"] = {"error": why}
    if sweep:
        best = None
        row["sweep"] = []
        for c in SWEEP:
            try:
                err = rel(gemm_only(c), ref_q)
                t = timed(lambda: gemm_only(c), reps)
                row["sweep"].append({**c, "s": t, "rel_err": err})
                if err <= 1e-2 and (best is None or t < best["s"]):
                    best = {**c, "s": t, "tflops": flop / t / 1e12}
            except Exception as e:      # noqa: BLE001 - e.g. out of shared memory for a large tile
                row["sweep"].append({**c, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        row["sweep_best"] = best
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[2048, 8192], help="token counts (prefill chunk sizes)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time the Triton launch configs in SWEEP")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    import bytebound.kernels.triton_fp8 as fp8k
    why = fp8k.available(torch.device("cuda"))
    if why:
        print(f"bench_fp8_gemm: linear[triton] unusable: {why}", file=sys.stderr)
        return 2
    head = {"device": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
            "torch": torch.__version__, "triton": fp8k.triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "reps": a.reps,
            "scaled_mm": fp8k.scaled_mm_variant("cuda") or fp8k.scaled_mm_available("cuda")}
    print(json.dumps(head))
    rows = []
    for m in a.m:
        for name in a.shapes:
            n, k = SHAPES[name]
            rows.append(bench_case(fp8k, name, n, k, m, a.reps, a.sweep))
            torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_fp8_gemm.json").write_text(json.dumps({**head, "rows": rows}, indent=1))
    paths = ["dequant", "bf16_cublas", "fp8", "fp8_gemm", "scaled_mm"]
    print(f"\n{'shape':>15} {'M':>5} {'N':>6} {'K':>5} | " + " | ".join(f"{p:>17}" for p in paths)
          + (" | sweep best" if a.sweep else ""))
    print(f"{'':>15} {'':>5} {'':>6} {'':>5} | " + " | ".join(f"{'us  TFLOP/s':>17}" for _ in paths))
    for r in rows:
        cells = []
        for p in paths:
            d = r["paths"].get(p, {})
            cells.append(f"{d['s'] * 1e6:8.1f} {d['tflops']:7.1f}" if "s" in d else f"{'n/a':>17}")
        line = f"{r['name']:>15} {r['M']:>5} {r['N']:>6} {r['K']:>5} | " + " | ".join(cells)
        if a.sweep and r.get("sweep_best"):
            b = r["sweep_best"]
            line += f" | {b['tflops']:.1f} ({b['BM']}x{b['BN']} w{b['num_warps']} s{b['num_stages']})"
        print(line)
    errs = {p: max((r["paths"][p]["rel_err"] for r in rows if "rel_err" in r["paths"].get(p, {})), default=None)
            for p in paths}
    print("worst rel err vs float64:", json.dumps(errs))
    failed = [f"{r['name']} M={r['M']} {p}: {d['error']}" for r in rows for p, d in r["paths"].items()
              if "error" in d and p != "scaled_mm"]
    for f in failed:
        print("FAILED", f, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
