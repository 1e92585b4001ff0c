"""Does a 4-token verify forward give the logits of 4 sequential decode steps? (diagnostic, full widths)

Builds the Ling-3.0-flash config with ``--layers`` decoder layers (each >= 6, so that MoE, KDA and one MLA layer
are all there; full widths: 512 experts, H 2560; dummy weights), prefills 30 random tokens, decodes 4 tokens one
at a time (positions 30-33: across the 32-slot bucket edge with ``buckets``), restores the state and runs the same
4 tokens as one verify forward (the MTP round's M = 4 path). Prints the relative error and argmax per position,
and for position 0 (same state, same token: only M differs) the relative error **after every decoder layer**, so
a divergence that starts at one layer (a bug) can be told from one that grows layer by layer from rounding (random
weights amplify any difference).

``--baseline moe=torch,linear=torch`` (CUDA) adds the yardstick: the same decode step with other, equally correct
backends, per layer. If verify-vs-decode is no larger than backend-vs-backend, the verify path is as exact as the
arithmetic allows.

``--paths`` (CPU) switches on GPU paths that can run here: ``router`` / ``norm`` (the Triton kernels, in Triton's
interpreter: needs ``triton`` installed and ``TRITON_INTERPRET=1`` set before start), ``static`` (the CUDA path's
fixed attention span over the cache) and ``buckets`` (per-span attention, with ``static``).
It also names the first position and layer where the verify routes to other experts than the decode step
(``verify.routing``). Used on the full-scale spec_vs_plain canary failures (docs/perf/gpu-tests-h200.md). Exit
status 1 if any position's argmax differs or the relative error exceeds ``--tol`` (default 1e-4 for float32, 3e-2
for bf16), unless a route flip whose router inputs agree within ``--tol`` (a routing near-tie) comes first.

    TRITON_INTERPRET=1 python scripts/verify_vs_decode.py --paths router       # CPU, ~1 min, ~9 GB RAM
    python scripts/verify_vs_decode.py --device cuda --layers 6,12,24,42 --baseline moe=torch,linear=torch \\
        --json out.json                                                          # H200, bf16, default backends
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from bytebound.checkpoint.synthetic import dummy_model  # noqa: E402
from bytebound.config import LING3_FLASH_CONFIG, LingConfig  # noqa: E402
from bytebound.layers.moe import MoE  # noqa: E402
from bytebound.layers.norm import RMSNorm, RMSNormGated  # noqa: E402
from bytebound.kernels.limits import MAX_VERIFY_M  # noqa: E402
from bytebound.runner.backends import BackendPlan, bind_model, parse_overrides  # noqa: E402
from bytebound.runner.plan import PLAIN_SWITCHES  # noqa: E402
from bytebound.runner.runner import ModelRunner  # noqa: E402
from bytebound.verify.canaries import decode_vs_verify  # noqa: E402
from bytebound.verify.routing import first_route_flip, position_routes  # noqa: E402


KNOWN = {"router", "norm", "static", "buckets"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@contextlib.contextmanager
def layer_outputs(model):
    """Collect every decoder layer's output (float32 ``[T, H]``) in call order (a layer returns ``(h, delta)``,
    its output being ``h + delta``: the add the next norm fuses)."""
    outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append((o[0] + o[1])[0].float().clone()))
             for layer in model.decoder_layers]
    try:
        yield outs
    finally:
        for h in hooks:
            h.remove()


def run_depth(cfg_dict: dict, layers: int, a, paths: set[str], stack) -> dict:
    d = dict(cfg_dict, num_hidden_layers=layers)
    cfg = LingConfig.from_dict(d)
    dev, dtype = torch.device(a.device), DTYPES[a.dtype]
    model = dummy_model(cfg, dev, dtype)
    head = "fp8" if dev.type == "cuda" and a.dtype == "bf16" else "bf16"
    plan = None
    if dev.type == "cuda":
        # the registry backends alone unless --backends names a switch (router=gemv, norm=triton, ...)
        plan = bind_model(model, BackendPlan.default("cuda", **{**PLAIN_SWITCHES, **parse_overrides(a.backends)}),
                          dev, head)
    if paths & {"router", "norm"}:
        from conftest import triton_kernels
        rt = stack.enter_context(triton_kernels("bytebound.kernels.triton_router")) if "router" in paths else None
        nm = stack.enter_context(triton_kernels("bytebound.kernels.triton_norm")) if "norm" in paths else None
        for m in model.modules():
            if rt is not None and isinstance(m, MoE):
                m.route_fn, m.route_m = rt.fused_route, MAX_VERIFY_M
            elif nm is not None and isinstance(m, RMSNormGated):
                m.fn = nm.rmsnorm_gated
            elif nm is not None and isinstance(m, RMSNorm):
                m.fn, m.add_fn = nm.rmsnorm, nm.add_rmsnorm
    r = ModelRunner(model, 256, dev, (16, 32) if "buckets" in paths else None)
    if dev.type == "cpu":
        r.static_kv = bool(paths & {"static", "buckets"})
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        h = r.prefill(torch.randint(0, cfg.vocab_size, (30,), generator=g))
        tok = model.logits(h[-1:]).argmax(-1)
        seq, ver = decode_vs_verify(r, tok, 4)
        snap = r.snapshot()
        toks = [int(tok)] + seq[:3].argmax(-1).tolist()
        with layer_outputs(model) as outs:            # per layer: the decode steps, then the verify
            with position_routes(r) as dec_routes:
                for t in toks:
                    r.forward(torch.tensor([t], device=dev))
            n = len(outs) // 4
            r.restore(snap)
            with position_routes(r) as ver_routes:
                r.verify(torch.tensor(toks, device=dev))
            r.restore(snap)
        flip = first_route_flip(dec_routes, ver_routes, range(r.pos, r.pos + 4))
        res = {"layers": layers, "dtype": a.dtype, "lm_head": head,
               "backends": {k: v.resolved for k, v in plan.resolutions.items()} if plan else "torch (CPU)",
               "rel_err": [_rel(ver[i], seq[i]) for i in range(4)],
               "argmax_equal": [int(seq[i].argmax()) == int(ver[i].argmax()) for i in range(4)],
               "layer_rel_err_pos0": [_rel(outs[4 * n + k][0], outs[k][0]) for k in range(n)],
               "route_flip": flip,
               "layer_norm_pos0": [float(outs[k][0].norm()) for k in range(n)]}
        if a.baseline:
            both = {**PLAIN_SWITCHES, **parse_overrides(a.backends), **parse_overrides(a.baseline)}
            bind_model(model, BackendPlan.default(dev, **both), dev, head)
            with layer_outputs(model) as outs2:
                lb = model.logits(r.forward(tok.view(1))).float()[0]
            r.restore(snap)
            res["baseline"] = a.baseline
            res["baseline_rel_err_pos0"] = _rel(lb, seq[0])
            res["baseline_layer_rel_err_pos0"] = [_rel(outs2[k][0], outs[k][0]) for k in range(n)]
    del model, r
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="6", help="decoder layer counts, comma-separated (each >= 6)")
    ap.add_argument("--paths", default="", help="CPU only: comma list of router, norm, static, buckets")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--backends", default="", help="CUDA: op=backend overrides of the defaults, e.g. moe=torch")
    ap.add_argument("--baseline", default="", help="CUDA: op=backend set for the backend-vs-backend yardstick")
    ap.add_argument("--tol", type=float, default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    paths = set(filter(None, a.paths.split(",")))
    if paths - KNOWN:
        ap.error(f"unknown --paths {sorted(paths - KNOWN)} (known: {sorted(KNOWN)})")
    if paths and a.device != "cpu":
        ap.error("--paths emulates GPU paths on the CPU; on CUDA they are EngineConfig flags")
    if (a.backends or a.baseline) and a.device != "cuda":
        ap.error("--backends / --baseline choose CUDA backends")
    depths = [int(x) for x in a.layers.split(",")]
    if min(depths) < 6:
        ap.error("--layers must be >= 6: the first MLA layer is layer 5 (and layers 0-1 are dense)")
    tol = a.tol if a.tol is not None else (1e-4 if a.dtype == "fp32" else 3e-2)
    torch.manual_seed(0)
    base = json.loads(Path(LING3_FLASH_CONFIG).read_text())
    bad, results = False, []
    for layers in depths:
        with contextlib.ExitStack() as stack:
            res = run_depth(base, layers, a, paths, stack)
        results.append(res)
        off = max(res["rel_err"]) > tol or not all(res["argmax_equal"])
        flip = res["route_flip"]
        tie = flip is not None and flip["input_rel_err"] <= tol     # a routing near-tie explains what follows it
        bad |= off and not tie
        le = res["layer_rel_err_pos0"]
        print(f"{layers} layers, {a.dtype}, paths={sorted(paths) or 'none'}: verify vs decode rel err "
              f"{[f'{e:.2e}' for e in res['rel_err']]}, argmax equal {res['argmax_equal']}")
        print("  position 0, per layer (verify vs decode): " + " ".join(f"{e:.1e}" for e in le))
        print("  position 0, per layer (hidden norm):      " + " ".join(f"{x:.0f}" for x in res["layer_norm_pos0"]))
        if flip is not None:
            print(f"  first route flip: position {flip['position'] - 30}, layer {flip['layer']}, router inputs "
                  f"{flip['input_rel_err']:.2e} apart ({'a near-tie' if tie else 'beyond rounding'}): experts "
                  f"{flip['experts_a']} (decode) vs {flip['experts_b']} (verify)")
        if "baseline" in res:
            print(f"  yardstick {res['baseline']}: logits rel err {res['baseline_rel_err_pos0']:.2e}; per layer "
                  + " ".join(f"{e:.1e}" for e in res["baseline_layer_rel_err_pos0"]))
    if a.json:
        Path(a.json).write_text(json.dumps({"device": a.device, "tol": tol, "results": results}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
