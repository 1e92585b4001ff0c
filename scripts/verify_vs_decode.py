"""Does a 4-token verify forward give the logits of 4 sequential decode steps? (CPU diagnostic, full widths.)

Builds the Ling-3.0-flash config with ``--layers`` decoder layers (>= 6, so that MoE, KDA and one MLA layer are
all there; full widths: 512 experts, H 2560; dummy weights, float32, CPU), prefills 30 random tokens, decodes 4
tokens one at a time (positions 30-33: across the 32-slot bucket edge with ``buckets``), restores the state and
runs the same 4 tokens as one verify forward (the MTP round's M = 4 path). Prints the relative error and argmax per
position. ``--paths`` switches on GPU paths that can run here: ``router`` / ``norm`` (the Triton kernels, in
Triton's interpreter: needs ``triton`` installed and ``TRITON_INTERPRET=1`` set before start), ``static`` (the
CUDA path's fixed attention span over the cache) and ``buckets`` (per-span attention, with ``static``).
Used to clear those paths when the full-scale spec_vs_plain canary failed on the H200 (docs/perf/gpu-tests-h200.md).
Exit status 1 if any position's argmax differs or the relative error exceeds 1e-4.

    TRITON_INTERPRET=1 python scripts/verify_vs_decode.py --paths router      # ~1 min, ~9 GB RAM
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
from bytebound.runner.runner import ModelRunner  # noqa: E402
from bytebound.verify.canaries import decode_vs_verify  # noqa: E402


KNOWN = {"router", "norm", "static", "buckets"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--paths", default="", help="comma list of router, norm, static, buckets")
    a = ap.parse_args()
    paths = set(filter(None, a.paths.split(",")))
    if paths - KNOWN:
        ap.error(f"unknown --paths {sorted(paths - KNOWN)} (known: {sorted(KNOWN)})")
    if a.layers < 6:
        ap.error("--layers must be >= 6: the first MLA layer is layer 5 (and layers 0-1 are dense)")
    torch.manual_seed(0)
    d = json.loads(Path(LING3_FLASH_CONFIG).read_text())
    d["num_hidden_layers"] = a.layers
    cfg = LingConfig.from_dict(d)
    model = dummy_model(cfg, "cpu", torch.float32)
    stack = contextlib.ExitStack()
    if paths & {"router", "norm"}:
        from conftest import triton_kernels
        rt = stack.enter_context(triton_kernels("bytebound.kernels.triton_router")) if "router" in paths else None
        nm = stack.enter_context(triton_kernels("bytebound.kernels.triton_norm")) if "norm" in paths else None
        for m in model.modules():
            if rt is not None and isinstance(m, MoE):
                m.route_fn = rt.fused_route
            elif nm is not None and isinstance(m, RMSNormGated):
                m.fn = nm.rmsnorm_gated
            elif nm is not None and isinstance(m, RMSNorm):
                m.fn = nm.rmsnorm
    r = ModelRunner(model, 256, "cpu", (16, 32) if "buckets" in paths else None)
    r.static_kv = bool(paths & {"static", "buckets"})
    bad = False
    with stack, torch.inference_mode():
        h = r.prefill(torch.randint(0, cfg.vocab_size, (30,)))
        seq, ver = decode_vs_verify(r, model.logits(h[-1:]).argmax(-1), 4)
        for i in range(4):
            err = float((seq[i] - ver[i]).norm() / seq[i].norm())
            same = int(seq[i].argmax()) == int(ver[i].argmax())
            bad |= err > 1e-4 or not same
            print(f"paths={sorted(paths) or 'none'} position {i}: rel err {err:.2e}, argmax decode "
                  f"{int(seq[i].argmax())} verify {int(ver[i].argmax())}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
