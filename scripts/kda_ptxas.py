"""Compile the fused KDA kernel (``kernels.triton_kda``) for a GPU target without a GPU and print ptxas' resource
usage (registers, stack = spills) per (V_SPLIT, num_warps): a register-pressure check that runs on a CPU machine.
The token count M and the history flag are run-time arguments of the kernel, so one binary serves decode and verify.

Pointers and row strides are declared 16-divisible, as Triton specialises them at a real launch on the engine's
tensors (the layout, and so the register count, depends on it). Needs Triton with its bundled ptxas/cuobjdump.

    python scripts/kda_ptxas.py [--arch 90] [--heads 32 --head-dim 128] [--warps 4,8,16] [--v-splits 1,2,4,8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ptxas_util  # noqa: E402  (scripts/ptxas_util.py)


def resource_usage(warps: int, heads: int, d: int, arch: int, safe: bool = True, v_split: int = 1,
                   hidden: int = 2560) -> str:
    """ptxas' ``REG:.. STACK:..`` line for one specialisation of ``_fused_kda_kernel`` (beta computed in the
    kernel from an input of ``hidden`` channels, as the engine binds it)."""
    import triton
    from bytebound.kernels import triton_kda as tk
    fn = tk._fused_kda_kernel
    f32, bf16 = "*fp32", "*bf16"
    types = dict(qkv_ptr=bf16, f_ptr=bf16, gate_ptr=bf16, b_ptr=bf16, x_ptr=bf16, wb_ptr=bf16, o_ptr=bf16,
                 ticket_ptr="*i32",
                 lower_bound="fp32", eps="fp32", scale="fp32", B="i32", HIST="i32")
    bk = triton.next_power_of_2(d)
    # M, HIST and SCR are run-time arguments of the kernel (one binary for decode and verify); PDL as the engine
    # launches it
    const = dict(H=heads, K=d, V=d, BK=bk, BV=bk, SAFE_GATE=safe, VS=v_split, FENCE=True, PDL=True, PF=True,
                 NTH=32 * warps, BETA_X=True, HID=hidden, HB=triton.next_power_of_2(hidden),
                 MT=tk.TAIL_ROWS)
    k = ptxas_util.compile_kernel(fn, const, types, arch, dict(num_warps=warps),
                                  default=lambda n: f32 if n.endswith("_ptr") else "i32",
                                  aligned=lambda n, ty: ty.startswith("*") or n.startswith("s_"))
    return ptxas_util.resource_usage(k)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--v-splits", default="1")
    a = ap.parse_args(argv)
    for vs in (int(x) for x in a.v_splits.split(",")):
        for w in (int(x) for x in a.warps.split(",")):
            print(f"V_SPLIT={vs} num_warps={w}: {resource_usage(w, a.heads, a.head_dim, a.arch, v_split=vs)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
