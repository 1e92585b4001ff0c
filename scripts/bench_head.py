#!/usr/bin/env python3
"""The greedy token of the FP8 LM head, two ways, at Ling-3.0-flash shapes: the head GEMV writing the logits, then
torch's argmax (and, for a row subset, the ``index_select`` of its vocabulary ids) - against ``fp8_head_argmax``,
the argmax (and the gather) inside the head kernel. Rows: the full head (V = 157,184) and the hot-vocabulary draft
head (``--hot``, default 32,768 rows), M = 1 and 4 tokens.

Why: on the full head's plain greedy step the fused kernel measured slower (H100, twentieth session:
docs/perf/round-ab-twentieth.md) while the draft heads gained; this isolates the kernels so a change to the fused
kernel (e.g. its ticket) can be judged per shape. Each variant is a CUDA graph of ``--calls`` head calls over
distinct synthetic weights (the 402 MB full head fits once; the copies beyond the L2's 60 MB are what is read),
replayed ``--reps`` times per round, ``--rounds`` rounds alternating; the ids of both ways are compared. Prints
device, date and commit, the weights (synthetic) and the per-call time against a pure read of the same bytes
measured in the same run (``analysis.bandwidth.measure_read_bandwidth``, best of its reads); JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bytebound.analysis.bandwidth import measure_read_bandwidth  # noqa: E402
from bytebound.bench.ab import alternating_times, run_meta, write_rows  # noqa: E402
from bytebound.runner.graphs import capture_graph  # noqa: E402

V, H = 157184, 2560


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hot", type=int, default=32768, help="rows of the draft head (0: skip it)")
    ap.add_argument("--m", default="1,4", help="token counts")
    ap.add_argument("--calls", type=int, default=4, help="head calls per graph (distinct weights)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--name", default="bench_head")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_head: needs a CUDA GPU", file=sys.stderr)
        return 2
    from bytebound.kernels.triton_fp8 import fp8_head_argmax, fp8_head_logits
    meta = run_meta("bench_head", "synthetic (random E4M3)", calls=args.calls, reps=args.reps, rounds=args.rounds)
    g = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for name, n in (("full head", V), ("hot draft head", args.hot)):
        if n <= 0:
            continue
        w = [(torch.randn(n, H, generator=g, device="cuda") * 0.1).to(torch.float8_e4m3fn) for _ in range(args.calls)]
        sc = [torch.rand(n, generator=g, device="cuda") * 1e-2 + 1e-3 for _ in range(args.calls)]
        vmap = (torch.randperm(V, generator=g, device="cuda")[:n].sort().values if n < V else None)
        nbytes = n * H + 4 * n
        floor = nbytes / (measure_read_bandwidth("cuda", nbytes=nbytes) * 1e9) * 1e6     # us, a pure read
        for m in (int(t) for t in args.m.split(",")):
            x = torch.randn(m, H, generator=g, device="cuda").to(torch.bfloat16)

            def unfused(i):
                ids = fp8_head_logits(x, w[i], sc[i]).argmax(-1)
                return ids if vmap is None else vmap.index_select(0, ids)

            def fused(i):
                return fp8_head_argmax(x, w[i], sc[i], index_map=vmap)

            same = all(torch.equal(unfused(i), fused(i)) for i in range(args.calls))
            graphs = {}
            for label, fn in (("logits + argmax", unfused), ("fused argmax", fused)):
                graphs[label] = capture_graph(lambda fn=fn: [fn(i) for i in range(args.calls)], warmup=2)[0]
            times = alternating_times([gr.replay for gr in graphs.values()], args.reps, args.rounds, per=args.calls)
            for label, ts in zip(graphs, times):
                med = statistics.median(ts) * 1e6
                r = {"head": name, "rows": n, "M": m, "way": label, "us_median": med, "us_min": min(ts) * 1e6,
                     "read_floor_us": floor, "ratio_to_floor": med / floor, "ids_equal": same}
                rows.append(r)
                print(f"{name:15s} {n:7d} rows M={m}  {label:16s} {med:8.2f} us (min {r['us_min']:7.2f})  "
                      f"read floor {floor:7.2f} us ({r['ratio_to_floor']:.2f}x)  ids equal: {same}")
    write_rows(args.out, args.name, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
