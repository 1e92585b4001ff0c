"""Compile the persistent MoE kernel (``kernels.triton_moe_persist``, Gluon) for sm_90 without a GPU and print
ptxas' resource usage (registers, spills, shared memory) and the programs per SM that implies
(``programs_per_sm``): a register-pressure check that runs on a CPU machine.

Pointers are declared 16-divisible, as Triton specialises them at a real launch on the engine's tensors.

    python scripts/persist_ptxas.py [--m 1,4] [--warps 4] [--shared 1] [--hc 512] [--ic 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ptxas_util  # noqa: E402  (scripts/ptxas_util.py)

LING = dict(h=2560, i=768, k=8)


def compile_persist(m: int, warps: int = 4, shared: bool = True, hc: int = 512, ic: int = 256, arch: int = 90,
                    h: int = LING["h"], i: int = LING["i"], k: int = LING["k"], limit: bool = True):
    """The compiled kernel (``triton.compile`` of a ``GluonASTSource``) for one specialisation, as
    ``launch_persist`` would build it."""
    from bytebound.kernels import triton_moe_persist as tp
    cfg = tp.fit_persist_config({"num_warps": warps, "HC": hc, "IC": ic}, h, i)
    nw, bi = cfg["num_warps"], cfg["BI"]
    s = m * k
    const = dict(H=h, I=i, TOPK=k, M=m, MP=tp.token_pad(m), SP=max(32, 1 << (s - 1).bit_length()), BI=bi,
                 HC=cfg["HC"], IC=cfg["IC"], G=tp.slot_group(nw, m, k), HAS_LIMIT=limit, SHARED=shared,
                 PREFETCH=True, PDL_IN=0, WA=tp.word_layout(2 * bi, cfg["HC"] // 128, nw),
                 WA8=tp.fp8_word_layout(2 * bi, max(1, cfg["HC"] // 256), nw) if shared else None,
                 WB=tp.word_layout(16 * nw, cfg["IC"] // 128, nw),
                 WB8=tp.fp8_word_layout(16 * nw, max(1, cfg["IC"] // 256), nw) if shared else None)
    types = dict(x_ptr="*bf16", ids_ptr="*i64", tw_ptr="*fp32", w13_ptr="*i32", s13_ptr="*u8", w2_ptr="*i32",
                 s2_ptr="*u8", act_ptr="*bf16", out_ptr="*bf16", bar_ptr="*i32", lut_ptr="*i32", limit="fp32",
                 sw13_ptr="*i32", ss13_ptr="*i32", sw2_ptr="*i32", ss2_ptr="*i32", slimit="fp32", NP="i32")
    return ptxas_util.compile_kernel(tp._moe_persist, const, types, arch, dict(num_warps=nw), gluon=True), nw


def resource_usage(kernel) -> str:
    """ptxas' resource line of ``kernel`` (``scripts/ptxas_util.py``)."""
    return ptxas_util.resource_usage(kernel)


def main(argv=None) -> int:
    from bytebound.kernels.triton_moe_persist import programs_per_sm
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--m", default="1,4")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--shared", type=int, default=1)
    ap.add_argument("--hc", type=int, default=512)
    ap.add_argument("--ic", type=int, default=256)
    ap.add_argument("--check-ptx", action="store_true",
                    help="fail unless the PTX has the L2 prefetch, the barrier's fence and its volatile spin load")
    a = ap.parse_args(argv)
    for m in (int(v) for v in a.m.split(",")):
        for w in (int(v) for v in a.warps.split(",")):
            k, nw = compile_persist(m, w, bool(a.shared), a.hc, a.ic, a.arch)
            use = resource_usage(k)
            if a.check_ptx:
                ptx = k.asm["ptx"]
                for need in ("cp.async.bulk.prefetch.L2", "fence.acq_rel.gpu", "ld.volatile",
                             "atom.global.gpu.acq_rel.add", "atom.global.gpu.release.add"):
                    if need not in ptx:
                        print(f"M={m}: {need!r} missing from the PTX", flush=True)
                        return 1
            regs = ptxas_util.resource_fields(use)["REG"]
            per_sm = programs_per_sm(regs, k.metadata.shared, nw)
            print(f"M={m} num_warps={nw} HC={a.hc} IC={a.ic} shared={a.shared}: {use}; Triton shared "
                  f"{k.metadata.shared} B -> {per_sm} programs/SM", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
