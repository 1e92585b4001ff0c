#!/usr/bin/env python3
"""MLA decode/verify microbenchmark at Ling-3.0-flash shapes: the layer's attention part, torch vs triton.

"Attention part" = everything a ``GatedMLA`` layer does between its projections: kv_a RMSNorm, RoPE, the cache
write, q absorption, latent attention over the cache, v absorption and the head gate. The projections
(q_proj, kv_a_proj_with_mqa, g_proj, dense) are stubbed to return fixed tensors (``QLinear.fn``), so both backends
run the layer's real ``forward`` and differ only in that part: ``torch`` (the float32 absorbed reference) and
``triton`` (``kernels.triton_mla``).

Method: ``--layers`` separate layers (default 8, own absorbed weights of 8 MB and own cache each) so one pass
reads more than the L2 holds, as in a decode step where the other layers' weights evict the cache; M new tokens
at positions ``ctx - M .. ctx - 1`` over a static span of ``ctx`` slots (the runner's bucket); the pass over all
layers is captured in one CUDA graph and replayed ``--reps`` times (CUDA events, median, divided by the layer
count). Also per case: kernels per layer call (torch.profiler over one replay), the bytes the call must read
(cache rows ``[0, ctx)`` x 1152 B + W_kc + W_vc) and the time that takes at the streaming-read bandwidth measured
in the same run, and the triton output's relative error against the torch path's.

Prints device, date and commit and a table; writes ``bench_mla.json`` to ``$OUT`` (or ``--out``).
Run on a GPU: ``python3 scripts/bench_mla.py --out $OUT`` (default contexts 2048 32768, M 1 4).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bytebound.bench.report import git_commit  # noqa: E402
from bytebound.runner.graphs import capture_graph  # noqa: E402
from bytebound.runner.runner import pow2_buckets  # noqa: E402


def make_case(n_layers: int, ctx: int, m: int, seed: int = 0, device: str = "cuda", span: int | None = None):
    """``n_layers`` Ling-shape GatedMLA layers with stubbed projections, filled caches and static inputs; each
    cache has ``span`` slots (default ``ctx``), the first ``ctx - m`` filled."""
    from bytebound.config import LING3_FLASH_CONFIG, LingConfig
    from bytebound.layers.mla import GatedMLA, MLAState
    cfg = LingConfig.from_file(LING3_FLASH_CONFIG)
    g = torch.Generator(device=device).manual_seed(seed)
    layers, states = [], []
    for _ in range(n_layers):
        layer = GatedMLA(cfg, lambda name: "plain", dtype=torch.bfloat16, device=device).to(device)
        with torch.no_grad():
            w = layer.kv_b_proj.weight
            w.copy_(torch.randn(w.shape, generator=g, device=device) / w.shape[1] ** 0.5)
            layer.kv_a_layernorm.weight.copy_(torch.rand(layer.rank, generator=g, device=device) + 0.5)
        layer.prepare(torch.bfloat16)
        h = layer.heads
        q = torch.randn(1, m, h * (layer.nope + layer.rope_dim), generator=g, device=device).to(torch.bfloat16)
        ckv = torch.randn(1, m, layer.rank + layer.rope_dim, generator=g, device=device).to(torch.bfloat16)
        gl = torch.randn(1, m, h, generator=g, device=device).to(torch.bfloat16)
        layer.q_proj.fn = lambda x, q=q: q
        layer.kv_a_proj_with_mqa.fn = lambda x, c=ckv: c
        layer.g_proj.fn = lambda x, t=gl: t
        layer.dense.fn = lambda y: y
        kv = torch.zeros(1, span or ctx, layer.rank + layer.rope_dim, device=device, dtype=torch.bfloat16)
        kv[:, : ctx - m].normal_(generator=g)
        layers.append(layer)
        states.append(MLAState(kv))
    x = torch.zeros(1, m, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    positions = torch.arange(ctx - m, ctx, device=device)
    return layers, states, x, positions


def bench_case(backend: str, layers, states, x, positions, ctx: int, reps: int, cfg: dict | None = None,
               profile_kernels: bool = True) -> dict:
    from bytebound.analysis.bandwidth import cuda_event_times
    from bytebound.kernels.triton_mla import TritonMLA
    for layer in layers:
        layer.attn_fn = TritonMLA(cfg).bind(layer, torch.bfloat16) if backend == "triton" else None

    def one(i):
        return layers[i](x, positions, states[i], ctx)

    def all_layers():
        return [one(i) for i in range(len(layers))]

    with torch.inference_mode():
        out0 = one(0).clone()
        graph, _ = capture_graph(all_layers, warmup=2)
        t = statistics.median(cuda_event_times(graph.replay, reps)) / len(layers)
        del graph
        if not profile_kernels:
            return {"us": t * 1e6, "out": out0}
        from torch.profiler import ProfilerActivity, profile
        g1, _ = capture_graph(lambda: one(0), warmup=1)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g1.replay()
            torch.cuda.synchronize()
    kernels = {}
    for ev in prof.key_averages():
        total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if ev.count and total:
            kernels[ev.key[:80]] = {"count": ev.count, "us": total / ev.count}
    return {"us": t * 1e6, "kernels": sum(k["count"] for k in kernels.values()), "kernel_table": kernels,
            "out": out0}


SWEEP_ATTN = [dict(BM=bm, BN=bn, num_warps=w) for bm in (32, 64) for bn in (32, 64) for w in (4, 8)]
# target_single None: the default tiling halves a default target (None) at long spans and M = 1
# (triton_mla.resolve_cfg), which would make the None ("one per SM") entries measure "half" there
SWEEP_SPLIT = [dict(target_programs=tp, min_split=ms, target_single=None) for tp in (None, "2x", "half")
               for ms in (32, 64, 128, 256)]
SWEEP_COMBINE = [dict(combine_BV=bv, combine_BK=bk) for bv in (32, 64) for bk in (64, 128)]


def sweep(layers, states, x, positions, ctx: int, reps: int, ref: torch.Tensor, log) -> dict:
    """``--sweep``, in stages, each keeping the best of the previous: the attention kernel's tilings, the split
    sizing (programs per SM: one, two, half; minimum keys per split), the merge kernel's tiling. A config whose
    output is off the torch path by more than 1e-2 relative is dropped. Each config overrides the span's default
    tiling (``triton_mla.resolve_cfg``: the short-span keys up to ``SHORT_SPAN`` slots), so the first stage runs
    with that default's split sizing; ``best_resolved`` is the best config merged with it, as the kernels ran."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best: dict = {}
    tried = []
    for stage in (SWEEP_ATTN, SWEEP_SPLIT, SWEEP_COMBINE):
        best_t, best_c = None, best
        for c in stage:
            c = {**best, **c}
            c["target_programs"] = {"2x": 2 * sms, "half": sms // 2}.get(c.get("target_programs"),
                                                                          c.get("target_programs"))
            try:
                r = bench_case("triton", layers, states, x, positions, ctx, reps, c, profile_kernels=False)
            except Exception as e:           # an unsupported tiling (shared memory, registers) is skipped
                log(f"  skip {c}: {type(e).__name__}: {str(e)[:120]}")
                continue
            err = float((r["out"].double() - ref.double()).norm() / ref.double().norm())
            tried.append({"cfg": c, "us": r["us"], "rel_err": err})
            if err < 1e-2 and (best_t is None or r["us"] < best_t):
                best_t, best_c = r["us"], c
        best = best_c
    log(f"  best {best}: {best_t:.2f} us" if best_t is not None else "  no config passed")
    from bytebound.kernels.triton_mla import resolve_cfg
    return {"best": best, "best_us": best_t, "best_resolved": resolve_cfg(ctx, best, positions.numel()),
            "tried": tried}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--backends", nargs="+", default=["torch", "triton"])
    ap.add_argument("--span", choices=["ctx", "bucket"], default="ctx",
                    help="static span attended: ctx (= the context; no slot past the sequence) or bucket (the "
                         "runner's: the smallest power of two >= max(ctx, 1024), as a decode at positions "
                         "ctx - M .. ctx - 1 runs in the engine; e.g. --contexts 2049 for the step after 2K)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the triton tilings per case (SWEEP_ATTN, "
                    "SWEEP_SPLIT, SWEEP_COMBINE in turn) and report the best")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mla needs a CUDA GPU")
    if args.sweep and os.environ.get("BYTEBOUND_MLA_CFG"):
        raise SystemExit("bench_mla --sweep: unset BYTEBOUND_MLA_CFG (it overrides every swept config)")
    from bytebound.analysis.bandwidth import measure_read_bandwidth
    dev = torch.cuda.get_device_name()
    commit = git_commit()
    print(f"# bench_mla  {dev}  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  commit {commit}")
    bw = measure_read_bandwidth("cuda")
    print(f"streaming read: {bw:.0f} GB/s")
    rows = []
    for ctx in args.contexts:
        for m in args.m:
            # bucket: the runner's spans (runner.pow2_buckets), the first that holds ctx slots
            span = ctx if args.span == "ctx" else next(s for s in pow2_buckets(2 * ctx) if s >= ctx)
            layers, states, x, positions = make_case(args.layers, ctx, m, span=span)
            l0 = layers[0]
            nbytes = ctx * (l0.rank + l0.rope_dim) * 2 + 2 * l0.heads * l0.nope * l0.rank * 2
            res = {b: bench_case(b, layers, states, x, positions, span, args.reps) for b in args.backends}
            row = {"ctx": ctx, "m": m, "span": span, "bytes": nbytes, "floor_us": nbytes / (bw * 1e3)}
            for b, r in res.items():
                row[b] = {k: v for k, v in r.items() if k != "out"}
            if "torch" in res and "triton" in res:
                a, ref = res["triton"]["out"].double(), res["torch"]["out"].double()
                row["triton_rel_err_vs_torch"] = float((a - ref).norm() / ref.norm())
                if args.sweep:
                    print(f"sweep ctx {ctx} M {m}", flush=True)
                    row["sweep"] = sweep(layers, states, x, positions, span, args.reps, res["torch"]["out"],
                                         lambda s: print(s, flush=True))
            rows.append(row)
            del layers, states
            torch.cuda.empty_cache()
    print(f"{'ctx':>6} {'span':>6} {'M':>2} {'floor us':>9} " + " ".join(f"{b + ' us':>10} {b[:5] + ' kern':>10}"
                                                          for b in args.backends) + "  rel err")
    for r in rows:
        cells = " ".join(f"{r[b]['us']:10.2f} {r[b]['kernels']:10d}" for b in args.backends)
        sw = r.get("sweep")
        best = f"  sweep best {sw['best_us']:.2f} us {sw['best']}" if sw and sw["best_us"] is not None else ""
        print(f"{r['ctx']:6d} {r['span']:6d} {r['m']:2d} {r['floor_us']:9.2f} {cells}  "
              f"{r.get('triton_rel_err_vs_torch', '')}{best}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_mla.json").write_text(json.dumps({"device": dev, "commit": commit, "read_gbps": bw,
                                                    "layers": args.layers, "reps": args.reps, "span": args.span,
                                                    "mla_cfg_env": os.environ.get("BYTEBOUND_MLA_CFG"),
                                                    "rows": rows},
                                                   indent=1))


if __name__ == "__main__":
    main()
