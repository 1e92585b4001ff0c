"""Compile the FP8 GEMV (``kernels.triton_fp8._fp8_gemv``, or with ``"MMA": true`` the Gluon tensor-core kernel
``kernels.gluon_fp8_gemv._fp8_gemv_mma``) for a GPU target without a GPU and print ptxas' resource usage and the
instruction mix of its SASS per config: a register, spill and instruction-count check that runs on a CPU machine
(Triton's bundled ptxas and nvdisasm).

    python scripts/gemv_ptxas.py [--arch 90] [--n 2560 --k 4096] [--m 1,4] [--configs '[{"BN":16,...}]'] [--sass]
    python scripts/gemv_ptxas.py --mma [--m 1,4]     # the MMA kernel at every decode shape (bench_gemv's list
                                                     # and the MLA parts 576 x 2560, 32 x 2560) for
                                                     # bench_gemv.MMA_CONFIGS (R 64/128 x NC 1/2/4, split auto)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ptxas_util  # noqa: E402  (scripts/ptxas_util.py)
os.environ.pop("TRITON_INTERPRET", None)


def compile_one(n: int, k: int, m: int, cfg: dict, arch: int = 90, norm: bool = False):
    """(resource line, Counter of SASS opcodes) of one config (fitted by ``fit_gemv_config``); ``norm``: the MMA
    kernel with the input add + RMSNorm folded in (``NORM``, the opt-in fold)."""
    import triton
    from bytebound.kernels import triton_fp8 as tf
    from bytebound.kernels.device import maxnreg
    c = tf.fit_gemv_config(cfg, n, k, m)
    types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", o_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32")
    if c.get("MMA"):
        from bytebound.kernels import gluon_fp8_gemv as gk
        from bytebound.kernels.triton_moe_split import fp8_word_layout
        fn = gk._fp8_gemv_mma
        const = dict(K=k, M=m, KS=c["KS"], SPLIT=c["SPLIT"], EVEN_N=n % c["BN"] == 0, PDL=c["PDL"],
                     WD8=fp8_word_layout(c["BN"], c["NC"], c["num_warps"]),
                     WD1=fp8_word_layout(c["BN"], 1, c["num_warps"]), NORM=norm,
                     KP=1 << max(0, (k - 1).bit_length()))
        types.update(w_ptr="*i32", h_ptr="*bf16", d_ptr="*bf16", nw_ptr="*fp32", ho_ptr="*bf16", xs_ptr="*bf16",
                     eps="fp32")
    else:
        fn = tf._fp8_gemv
        const = dict(K=k, SK=triton.cdiv(k, 128), M=m, BN=c["BN"], BK=c["BK"], KS=c["KS"], SPLIT=c["SPLIT"],
                     SBN=128, SBK=128, EVEN_N=n % c["BN"] == 0, EVEN_K=k % c["KS"] == 0, DOT=c["DOT"],
                     PRE=c["PRE"], PF=c["PF"], PDL=c["PDL"], HW=True, NT=32 * c["num_warps"])
    kern = ptxas_util.compile_kernel(fn, const, types, arch,
                                     dict(num_warps=c["num_warps"], num_stages=c["num_stages"],
                                          **maxnreg(c.get("NR"))),
                                     gluon=bool(c.get("MMA")), default=lambda a: "i32")
    sass = ptxas_util.sass(kern)
    ops = collections.Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    return c, ptxas_util.resource_usage(kern), ops, sass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--n", type=int, default=2560)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", default="1,4")
    ap.add_argument("--configs", default='[{"BN": 16, "BK": 256, "num_warps": 4}]')
    ap.add_argument("--sass", action="store_true", help="print the whole SASS")
    ap.add_argument("--norm", action="store_true", help="the MMA kernel with the input add + RMSNorm folded in")
    ap.add_argument("--mma", action="store_true", help="the MMA kernel at every decode shape (--configs: MMA "
                    "configs, default MMA_CONFIGS)")
    a = ap.parse_args(argv)
    if a.mma:
        from bench_gemv import MMA_CONFIGS, decode_shapes
        shapes = [(e["n"], e["k"]) for e in decode_shapes()] + [(576, 2560), (32, 2560)]   # + the MLA parts
        cfgs = json.loads(a.configs) if "--configs" in (argv or sys.argv) else MMA_CONFIGS
        cfgs = [dict(c, MMA=True) for c in cfgs]
    else:
        shapes, cfgs = [(a.n, a.k)], json.loads(a.configs)
    keys = ("BN", "BK", "NC", "KS", "SPLIT", "num_warps", "DOT", "PRE", "PF", "MMA", "NR", "MMA_WHY")
    for n, k in shapes:
        for m in (int(x) for x in a.m.split(",")):
            for cfg in cfgs:
                c, line, ops, sass = compile_one(n, k, m, cfg, a.arch, a.norm)
                top = ", ".join(f"{op} {v}" for op, v in ops.most_common(14))
                print(f"{n}x{k} M={m} {json.dumps({kk: c[kk] for kk in keys if kk in c})}: {line}\n    {top}",
                      flush=True)
                if a.sass:
                    print(sass)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
