"""One Ling-3.0-flash KDA layer at batch 1 on one GPU: the fused decode/verify kernel (kda backend ``triton``,
``kernels.triton_kda``) against today's layer path (fla-core + torch glue), decode (M = 1) and verify (M = 4 with
the per-token history an MTP rollback needs), each call captured in a CUDA graph and replayed.

Rows (median device time per call: a CUDA graph of ``--calls`` back-to-back calls, default 8, replayed and timed with
CUDA events, divided by the calls; one call per graph would add the graph's launch latency to a kernel of a few us):

* ``layer``: the whole layer forward ``x -> o_proj(...)`` with the FP8 projections (q|k|v|f|g fused, b_proj, o_proj
  on the CUDA default linear backend), for ``--backends`` (default ``fla,triton``);
* ``projections``: q|k|v|f|g + b_proj + o_proj alone, so ``layer - projections`` is the cost between them;
* ``fused kernel``: ``triton_kda.fused_kda`` alone (the part the layer's glue + recurrence becomes), at its
  resolved launch (``resolve_launch``: the table entry or the default), then at each ``--v-splits`` value
  (programs per head) x each ``--warps`` value (and that V_SPLIT's default width); the fastest of these is
  printed as the ``configs/triton_kda.json`` entry for this GPU and shape (``table_entry`` in the JSON);
* ``fla fused_recurrent`` (M = 1): fla-core's recurrence kernel alone, on pre-computed q, k, v, g, beta: the
  same-run yardstick of the recurrence by itself.

It also counts the CUDA kernels one eager layer call launches (torch.profiler), which a graph replays one for one.
Weights are synthetic (random E4M3 at the real shapes): speed only. Writes JSON to ``--out`` when given.

    python scripts/bench_kda.py [--tokens 1,4] [--reps 200] [--calls 8] [--v-splits 1,2,4,8,16] [--warps 1,2,4,8,16]
                                [--out bench-results/kda.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bytebound.analysis.bandwidth import cuda_event_times  # noqa: E402
from bytebound.bench.report import git_commit  # noqa: E402
from bytebound.checkpoint.synthetic import dummy_fill_  # noqa: E402
from bytebound.config import LING3_FLASH_CONFIG, LingConfig  # noqa: E402
from bytebound.kernels.registry import resolve  # noqa: E402
from bytebound.layers.kda import KimiDeltaAttention  # noqa: E402
from bytebound.layers.linear import QLinear, fuse_rows  # noqa: E402
from bytebound.runner.graphs import capture_graph  # noqa: E402


def ling_kda_layer(cfg: LingConfig, dev, dtype=torch.bfloat16, seed: int = 0) -> KimiDeltaAttention:
    """One KDA layer of ``cfg`` with the ``dummy`` load format's random weights, projections bound to the CUDA
    default linear backend and q|k|v|f|g fused as ``runner.backends.bind_model`` does."""
    from bytebound.models.bailing_moe_v3 import _lin_fmt
    torch.manual_seed(seed)
    with torch.device("meta"):
        layer = KimiDeltaAttention(cfg, _lin_fmt(cfg, f"model.layers.{cfg.kda_layers[0]}.attention"), dtype)
    layer = dummy_fill_(layer.to_empty(device=dev), dev)
    lin, _ = resolve("linear", "triton", torch.device(dev))
    parts = [layer.q_proj, layer.k_proj, layer.v_proj, layer.f_proj, layer.g_proj]
    fused = fuse_rows(parts)
    layer.proj_fn = lin.bind(fused, dtype) if fused is not None else None
    for m in layer.modules():
        if isinstance(m, QLinear) and (fused is None or all(m is not p for p in parts)):
            m.fn = lin.bind(m, dtype)
    return layer


def bind_kda(layer, backend: str) -> None:
    impl, _ = resolve("kda", backend, torch.device("cuda"))
    layer.kda_fn = impl.bind(layer, torch.bfloat16)
    bind = getattr(impl, "bind_fused", None)        # as runner.backends.bind_model binds it
    layer.fused_fn = bind(layer, torch.bfloat16) if bind is not None else None


def graph_ms(fn, reps: int, calls: int = 1) -> float:
    """Median device ms per call of ``fn``: a CUDA graph holding ``calls`` back-to-back calls, replayed ``reps``
    times, each replay's time divided by ``calls``. With one call a replay's time includes the graph's own launch
    latency, which for a kernel of a few us is as large as the kernel and varies from process to process
    (docs/perf/session35/, section 1)."""
    def many():
        for _ in range(calls):
            out = fn()
        return out
    g, _ = capture_graph(many, warmup=3)
    ts = sorted(cuda_event_times(g.replay, reps, warmup=5))
    return ts[len(ts) // 2] * 1e3 / calls


def kernels_per_call(fn) -> int | None:
    """CUDA kernels one eager call of ``fn`` launches (torch.profiler); None where the profiler is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(LING3_FLASH_CONFIG))
    ap.add_argument("--tokens", default="1,4", help="M values (verify rows record the per-token history)")
    ap.add_argument("--backends", default="fla,triton", help="kda backends for the layer rows")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--calls", type=int, default=8, help="back-to-back calls per captured graph; each row is the "
                    "replay's time / calls (1: one call per graph, the graph's launch latency included)")
    ap.add_argument("--warps", default="1,2,4,8,16", help="num_warps values to time the fused kernel at (besides "
                    "each V_SPLIT's default); empty: only the defaults")
    ap.add_argument("--v-splits", default="1,2,4,8,16", help="V_SPLIT values (programs per head) to time the fused "
                    "kernel at; empty: only the resolved launch")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.calls < 1:
        ap.error(f"--calls must be >= 1, got {a.calls}")
    if not torch.cuda.is_available():
        print("bench_kda: needs a CUDA GPU", file=sys.stderr)
        return 2
    from bytebound.kernels import triton_kda
    cfg = LingConfig.from_file(a.config)
    dev = "cuda"
    layer = ling_kda_layer(cfg, dev)
    h, d = layer.heads, layer.head_dim
    rows = []
    table_entry = {}

    def add(name, m, ms, kernels=None):
        rows.append({"row": name, "M": m, "us": round(ms * 1e3, 2), "kernels": kernels})
        print(f"{name:<44} M={m}  {ms * 1e3:8.2f} us" + (f"  {kernels} kernels" if kernels is not None else ""),
              flush=True)

    with torch.inference_mode():
        for m in (int(t) for t in a.tokens.split(",")):
            x = (torch.randn(1, m, cfg.hidden_size, device=dev) * 0.5).to(torch.bfloat16)
            hist = m > 1                                  # M > 1 is the MTP verify: record every token's state
            for be in a.backends.split(","):
                bind_kda(layer, be)
                st = layer.new_state(1, dev)

                def call(st=st):
                    if hist:
                        st.history = []
                    return layer(x, st)
                label = f"layer kda={be}" + (" (verify, history)" if hist else " (decode)")
                add(label, m, graph_ms(call, a.reps, a.calls), kernels_per_call(call))
            bind_kda(layer, "fla")

            o_in = (torch.randn(1, m, layer.dim, device=dev) * 0.5).to(torch.bfloat16)

            def proj():
                layer.proj_fn(x)
                layer.b_proj(x)
                return layer.o_proj(o_in)
            add("projections (qkvfg + b + o)", m, graph_ms(proj, a.reps, a.calls), kernels_per_call(proj))
            fk = triton_kda.FusedKDA(layer)
            y = layer.proj_fn(x)
            qkv, f, gate = y[..., :3 * layer.dim], y[..., 3 * layer.dim:4 * layer.dim], y[..., 4 * layer.dim:]
            st = layer.new_state(1, dev)

            def fused(st=st):       # beta's b_proj inside the kernel where it is plain (fk.beta)
                if hist:
                    st.history = []
                return fk(qkv, f, gate, x, st, torch.bfloat16)
            vs0, nw0, src = triton_kda.resolve_launch(1, h, d, d, m, dev)
            name = "fused kernel" + (" (history)" if hist else "")
            add(f"{name} resolved V_SPLIT={vs0} num_warps={nw0} ({src})", m, graph_ms(fused, a.reps, a.calls),
                kernels_per_call(fused))
            best = None
            for vs in (int(v) for v in a.v_splits.split(",") if v):
                fk.v_split = vs
                widths = [triton_kda.default_num_warps(d, d, vs)] + [int(w) for w in a.warps.split(",") if w]
                for nw in dict.fromkeys(widths):
                    fk.num_warps = nw
                    ms = graph_ms(fused, a.reps, a.calls)
                    add(f"{name} V_SPLIT={vs} num_warps={nw}", m, ms)
                    if best is None or ms < best[0]:
                        best = (ms, vs, nw)
            fk.v_split = fk.num_warps = None
            if best is not None:
                table_entry[triton_kda.shape_key(1, h, d, d, m)] = {"v_split": best[1], "num_warps": best[2]}
            if m == 1:
                from bytebound.kernels.fla_kda import make_kda_fn
                fla = make_kda_fn(inplace=True)
                q, k, v = (torch.randn(1, 1, h, d, device=dev) for _ in range(3))
                g = -torch.rand(1, 1, h, d, device=dev)
                beta = torch.rand(1, 1, h, device=dev)
                rec = torch.zeros(1, h, d, d, device=dev)
                add("fla fused_recurrent (recurrence only)", m,
                    graph_ms(lambda: fla(q, k, v, g, beta, rec), a.reps, a.calls),
                    kernels_per_call(lambda: fla(q, k, v, g, beta, rec)))
    res = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "config": a.config,
           "heads": h, "head_dim": d, "hidden": cfg.hidden_size, "reps": a.reps, "calls_per_graph": a.calls,
           "rows": rows,
           "table_entry": {torch.cuda.get_device_name(): table_entry}}
    if table_entry:
        print(f"configs/triton_kda.json entry (fastest fused kernel per M): "
              f"{json.dumps({torch.cuda.get_device_name(): table_entry})}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
