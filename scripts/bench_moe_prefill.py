#!/usr/bin/env python3
"""Prefill routed-MoE microbenchmark at Ling-3.0-flash shapes (E 512, H 2560, I 768, top-8): one layer at M tokens.

Backends, same run, same synthetic MXFP4 experts (random codes, E8M0 bytes 118..122) and uniform random routing:
``grouped`` (``kernels.triton_moe_grouped``, the engine's prefill path; a small sweep of tilings with ``--sweep``),
``slices`` (the decode ``split`` kernels over 4-token slices, the previous prefill path; M <= 2048 only, it is slow),
``humming`` (humming-kernels, when installed). Each output is checked against the float32 torch reference on a
subset of rows. Times are medians of ``triton.testing.do_bench`` (eager: a prefill chunk is not graph-captured).

Per row: ms per layer, TFLOP/s (2 * 3 * H * I * M * k), and the expert bytes read if every expert is decoded once
(``E x 3,133,440 B``) over the time, against the streaming-read bandwidth measured in the same run. Prints device,
date, commit and weights (synthetic), a table last, and writes ``bench_moe_prefill.json`` to ``$OUT`` / ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bytebound.bench.report import git_commit  # noqa: E402

E, H, I, K = 512, 2560, 768, 8


def make_experts(seed=0):
    from bytebound.layers.moe import RoutedExperts
    g = torch.Generator(device="cuda").manual_seed(seed)
    ex = RoutedExperts(E, H, I, "mxfp4", torch.bfloat16, "cuda", None)
    u8 = dict(generator=g, device="cuda", dtype=torch.uint8)
    ex.w13.data = torch.randint(0, 256, (E, 2 * I, H // 2), **u8)
    ex.w13_scale.data = torch.randint(118, 123, (E, 2 * I, H // 32), **u8)
    ex.w2.data = torch.randint(0, 256, (E, H, I // 2), **u8)
    ex.w2_scale.data = torch.randint(118, 123, (E, H, I // 32), **u8)
    return ex


def routing(m, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.rand(m, E, generator=g).argsort(-1)[:, :K]
    w = torch.rand(m, K, generator=g) + 0.1
    return ids.cuda(), (w / w.sum(-1, keepdim=True) * 2.5).float().cuda()


def reference_rows(ex, x, ids, w, rows):
    from bytebound.kernels.torch_ref import moe_reference
    return moe_reference(ex, x[rows].float().to(torch.bfloat16), ids[rows], w[rows]).float()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="512,2048,8192", help="token counts (comma-separated)")
    ap.add_argument("--sweep", action="store_true", help="also time a few alternative tilings of 'grouped'")
    ap.add_argument("--no-slices", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    import triton
    from triton.testing import do_bench

    from bytebound.analysis.bandwidth import measure_read_bandwidth
    from bytebound.kernels.moe_host import MoEKernel
    from bytebound.kernels.triton_moe_grouped import GroupedMoE, prefill_config
    from bytebound.runner.backends import prefill_slices
    dev = torch.cuda.get_device_name()
    meta = {"device": dev, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "weights": "synthetic (random MXFP4 codes, E8M0 118..122)",
            "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv)}
    print(f"device {dev}  date {meta['date']}  commit {meta['commit']}  weights synthetic", flush=True)
    bw = measure_read_bandwidth(torch.device("cuda"))
    print(f"streaming read {bw:.0f} GB/s (measured in this run)", flush=True)
    ex = make_experts()
    layer_bytes = E * (2 * I * H // 2 + 2 * I * H // 32 + H * I // 2 + H * I // 32)
    rows = []

    def record(name, m, cfg, fn, x, ids, w):
        check = torch.arange(0, m, max(1, m // 64), device="cuda")
        out = fn(x, ids, w)
        ref = reference_rows(ex, x, ids, w, check)
        err = float((out[check].float() - ref).norm() / ref.norm())
        ms = do_bench(lambda: fn(x, ids, w), warmup=50, rep=300, return_mode="median")
        tflops = 2 * 3 * H * I * m * K / (ms * 1e-3) / 1e12
        gbs = layer_bytes / (ms * 1e-3) / 1e9
        row = {"backend": name, "M": m, "config": cfg, "ms": ms, "tflops": tflops, "expert_bytes_gbs": gbs,
               "read_share": gbs / bw, "rel_err_vs_torch": err}
        rows.append(row)
        print(f"  {name:<10} M {m:>5}  {ms:8.3f} ms  {tflops:6.1f} TFLOP/s  {gbs:6.0f} GB/s  rel {err:.1e}  {cfg or ''}",
              flush=True)

    for m in [int(v) for v in args.m.split(",")]:
        x = torch.randn(m, H, device="cuda").to(torch.bfloat16)
        ids, w = routing(m, m)
        base = prefill_config(m, K, E)
        cfgs = [None]
        if args.sweep:
            alt = [dict(deq="float"), dict(BN=128, num_warps=8), dict(BK=64, num_stages=4),
                   dict(num_warps=4 if base["num_warps"] == 8 else 8), dict(num_stages=4), dict(BN2=256),
                   dict(BM=min(256, base["BM"] * 2)), dict(BM=max(16, base["BM"] // 2))]
            cfgs += [dict(base, **a) for a in alt]
        for cfg in cfgs:
            try:
                record("grouped", m, cfg, GroupedMoE(ex, cfg), x, ids, w)
            except triton.runtime.errors.OutOfResources as exc:    # a sweep tiling too large for this GPU
                print(f"  grouped    M {m:>5}  skipped {cfg}: {exc}", flush=True)
        if not args.no_slices and m <= 2048:
            k = MoEKernel(ex)
            record("slices", m, None, prefill_slices(k), x, ids, w)
        try:
            from bytebound.kernels.humming_moe import HummingMoEBackend
            record("humming", m, None, HummingMoEBackend().bind(ex, torch.bfloat16), x, ids, w)
        except Exception as exc:  # not installed, or refuses the shape
            print(f"  humming    M {m:>5}  skipped: {exc}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_moe_prefill.json").write_text(json.dumps({"meta": meta, "bandwidth_gbs": bw,
                                                            "layer_expert_bytes": layer_bytes, "rows": rows},
                                                           indent=1))
    print(f"\n{'backend':<10} {'M':>6} {'ms/layer':>9} {'TFLOP/s':>8} {'GB/s':>7}  config")
    for r in rows:
        print(f"{r['backend']:<10} {r['M']:>6} {r['ms']:9.3f} {r['tflops']:8.1f} {r['expert_bytes_gbs']:7.0f}  "
              f"{r['config'] or 'default'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
