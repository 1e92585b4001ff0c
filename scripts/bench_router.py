#!/usr/bin/env python3
"""The router launch of one MoE layer (``kernels.triton_router.gemv_route_add_norm``: post-attention add + RMSNorm,
router GEMV, group-limited top-8, the engine's decode/verify call) at Ling-3.0-flash shapes, M = 1..4, under
several settings of its A/B switches in one process, alternating, so the differences are same-run differences.

Each setting is ``VAR=VALUE[;VAR=VALUE]`` (``""`` = the defaults; ``bench.ab.ab_settings``, as
``profile_decode.py --ab``), e.g. ``BYTEBOUND_ROUTER_SPLIT_TAIL=0`` or
``"BYTEBOUND_ROUTER_SPLIT_TAIL=0;BYTEBOUND_ROUTER_BATCH_ROWS=0"``. The switches
are read at each call, so each setting gets its own CUDA graph of ``--layers`` calls over distinct router weights
(5.2 MB each: the 60 MB L2 does not hold 16 of them), replayed ``--reps`` times per round, ``--rounds`` rounds with
the settings' order rotated; per-call time = replay time / layers, median over all replays. Every setting's ids
and weights are checked against the first setting's (the switches must not change the routing: bit-equal, or a
near-tie with x one BF16 step off, reported). Synthetic weights. Prints device, date and commit; JSON to ``--out``.
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

from bytebound.bench.ab import ab_settings, alternating_times, env_applied, run_meta, write_rows  # noqa: E402
from bytebound.runner.graphs import capture_graph  # noqa: E402

E, H, K, G, TG, SCALE = 512, 2560, 8, 8, 4, 2.5      # Ling-3.0-flash routing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ab", nargs="+", default=["", "BYTEBOUND_ROUTER_SPLIT_TAIL=0",
                                                 "BYTEBOUND_ROUTER_SPLIT_TAIL=0;BYTEBOUND_ROUTER_BATCH_ROWS=0"],
                    help="settings to compare (each VAR=VALUE[;VAR=VALUE]; '' = defaults)")
    ap.add_argument("--m", default="1,4", help="token counts")
    ap.add_argument("--layers", type=int, default=16, help="router calls per graph (distinct weights)")
    ap.add_argument("--reps", type=int, default=20, help="timed replays per round and setting")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--name", default="bench_router")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_router: needs a CUDA GPU", file=sys.stderr)
        return 2
    from bytebound.kernels.triton_router import gemv_route_add_norm
    settings = [ab_settings(s) for s in args.ab]
    meta = run_meta("bench_router", "synthetic (random)", layers=args.layers, reps=args.reps, rounds=args.rounds)
    g = torch.Generator(device="cuda").manual_seed(7)
    wg = [torch.randn(E, H, generator=g, device="cuda") * 0.02 for _ in range(args.layers)]
    bias = [torch.randn(E, generator=g, device="cuda") * 0.01 for _ in range(args.layers)]
    nw = [(1 + 0.1 * torch.randn(H, generator=g, device="cuda")).to(torch.bfloat16) for _ in range(args.layers)]
    rows = []
    for m in (int(t) for t in args.m.split(",")):
        h = [torch.randn(m, H, generator=g, device="cuda").to(torch.bfloat16) for _ in range(args.layers)]
        d = [(0.3 * torch.randn(m, H, generator=g, device="cuda")).to(torch.bfloat16) for _ in range(args.layers)]

        def call(li):
            return gemv_route_add_norm(d[li], h[li], nw[li], 1e-6, wg[li], bias[li], K, G, TG, True, SCALE)

        graphs, outs = [], []
        for st in settings:
            with env_applied(st):
                outs.append([tuple(t.clone() for t in call(li)) for li in range(args.layers)])

                def all_layers():
                    for li in range(args.layers):
                        call(li)
                graphs.append(capture_graph(all_layers, warmup=2)[0])
        times = alternating_times([gr.replay for gr in graphs], args.reps, args.rounds, per=args.layers)
        base = outs[0]
        for i, st in enumerate(settings):
            same_ids = sum(torch.equal(a[0], b[0]) for a, b in zip(outs[i], base))
            same_w = sum(torch.equal(a[1], b[1]) for a, b in zip(outs[i], base))
            same_x = sum(torch.equal(a[2], b[2]) for a, b in zip(outs[i], base))
            med = statistics.median(times[i]) * 1e6
            r = {"M": m, "setting": args.ab[i] or "defaults", "us_median": med, "us_min": min(times[i]) * 1e6,
                 "layers_ids_equal_first": same_ids, "layers_w_equal_first": same_w,
                 "layers_x_equal_first": same_x, "layers": args.layers}
            rows.append(r)
            print(f"M={m}  {r['setting']:64s} {med:7.2f} us (min {r['us_min']:6.2f})  ids == first in "
                  f"{same_ids}/{args.layers} layers, w {same_w}, x {same_x}")
    write_rows(args.out, args.name, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
