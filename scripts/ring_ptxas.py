"""Compile kernel A's TMA-ring form (``kernels.triton_moe_ring``, config key ``TR``) for sm_90 without a GPU and
print ptxas' resource usage and the SASS counts of its loads and mma: the offline check before a device run.

    python scripts/ring_ptxas.py [--m 1,4] [--config '{"BI": 64, "num_warps": 8, "TR_ST": 4}']
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ptxas_util  # noqa: E402  (scripts/ptxas_util.py)

LING = dict(h=2560, i=768, k=8)


def compile_ring(m: int, cfg: dict, arch: int = 90, dq: int = 1, shared: bool = True):
    from bytebound.kernels import triton_moe_ring as tr
    from triton.runtime.jit import mangle_type
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    import torch
    c = tr.ring_constexprs(m, LING["k"], LING["h"], LING["i"], cfg, True, 1, dq, shared, True)
    ns = c["NS"]
    lay = tr.weight_layout(ns)
    t = torch.empty(0, dtype=torch.int32).new_empty((512 * 2 * LING["i"], LING["h"] // 8), device="meta")
    d = TensorDescriptor(t, list(t.shape), list(t.stride()), [cfg["BI"], 16 * ns], lay)
    ws = int(cfg.get("TR", 1)) == 2
    opts = dict(num_warps=cfg["num_warps"], **(dict(maxnreg=int(cfg.get("TR_REGS", 128))) if ws else {}))
    return ptxas_util.compile_kernel(tr._moe_gateup_ring_ws if ws else tr._moe_gateup_ring, c,
                                     dict(desc=mangle_type(d), s13_ptr="*u8", x_ptr="*bf16", ids_ptr="*i64",
                                          part_ptr="*fp32", lut_ptr="*i32", sw13_ptr="*i32", ss13_ptr="*i32",
                                          act_ptr="*bf16", cnt_ptr="*i32", info_ptr="*i32", slimit="fp32"), arch,
                                     opts, gluon=True,
                                     aligned=lambda name, ty: ty.startswith("*"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,4")
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--shared", type=int, default=1, help="with the shared expert's items (default 1)")
    a = ap.parse_args(argv)
    for m in (int(v) for v in a.m.split(",")):
        for cj in a.config or ['{"BI": 64, "num_warps": 8}']:
            cfg = json.loads(cj)
            k = compile_ring(m, cfg, shared=bool(a.shared))
            sass = ptxas_util.sass(k)
            n = lambda pat: len(re.findall(pat, sass))  # noqa: E731
            print(f"M={m} {json.dumps(cfg)}: {ptxas_util.resource_usage(k)}; shared {k.metadata.shared} B; "
                  f"SASS: {n(r'LDS')} LDS, {n(r'UTMALDG')} UTMALDG, {n(r'LDG')} LDG, {n(r'HMMA')} HMMA, "
                  f"{n(r'SYNCS')} SYNCS, {n(r'REDUX')} REDUX", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
