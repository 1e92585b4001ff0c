"""kernels.pdl's host-side switches, and the PTX of the kernels that L2-prefetch before their PDL wait (compiled
offline for sm_90: Triton's own ptxas, no GPU needed)."""

from __future__ import annotations

import re

import pytest
import torch

from bytebound.kernels import pdl
from conftest import compiled_in_subprocess

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("value, router, kda", [
    (None, False, False), ("", False, False), ("router", True, False), ("kda", False, True),
    ("router,kda", True, True), ("kda, router", True, True), (" router ,", True, False), ("routerkda", False, False),
    ("Router", False, False)])
def test_early_parses_the_prefetch_list(monkeypatch, value, router, kda):
    """``BYTEBOUND_PDL_PREFETCH`` is a comma list of kernel names (blanks around a name ignored; default empty:
    no kernel launches early), read at each call."""
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    if value is None:
        monkeypatch.delenv("BYTEBOUND_PDL_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("BYTEBOUND_PDL_PREFETCH", value)
    assert (pdl.early("router", CUDA), pdl.early("kda", CUDA)) == (router, kda)


def test_early_needs_pdl(monkeypatch):
    """Named or not, nothing launches early where PDL is off (no sm_90, the interpreter, ``BYTEBOUND_PDL=0``)."""
    monkeypatch.setenv("BYTEBOUND_PDL_PREFETCH", "router,kda")
    monkeypatch.setattr(pdl, "enabled", lambda device: False)
    assert not pdl.early("router", CUDA) and not pdl.early("kda", CUDA)
    monkeypatch.undo()
    monkeypatch.setenv("BYTEBOUND_PDL_PREFETCH", "router,kda")
    assert not pdl.early("kda", torch.device("cpu"))


_MEM = re.compile(r"\b(ld\.global|ld\.shared|st\.|atom\.|red\.|cp\.async\.(?!bulk\.prefetch))")


def _check_prefetch_ptx(ptx: str, n_prefetch: int) -> None:
    """The kernel's PTX: launch_dependents, then ``n_prefetch`` thread-0 bulk L2 prefetches and no other memory
    access before ``griddepcontrol.wait``."""
    wait = ptx.index("griddepcontrol.wait")
    pre = ptx[:wait]
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == n_prefetch
    assert pre.count("cp.async.bulk.prefetch.L2.global") == n_prefetch
    bad = [ln.strip() for ln in pre.splitlines() if _MEM.search(ln)]
    assert not bad, bad
    assert pre.count("setp.eq.u32 p, t, 0") == n_prefetch      # issued by thread 0 only


@pytest.mark.parametrize("kernel", ["router", "kda"])
def test_prefetch_kernels_compile_for_sm90(kernel):
    """``gemv_route``'s kernel as a PDL dependent and the fused KDA kernel with ``PF`` compile for sm_90 (ptxas
    accepts the inline PTX), with nothing but the L2 prefetches between their start and the PDL wait. Runs in a
    subprocess without the interpreter (conftest puts this session's Triton in interpreter mode)."""
    pytest.importorskip("triton")
    if compiled_in_subprocess(__file__, f"test_prefetch_kernels_compile_for_sm90[{kernel}]"):
        return
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def build(fn, types, const, warps):
        sig, attrs = {}, {}
        for i, n in enumerate(fn.arg_names):
            sig[n] = "constexpr" if n in const else types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
            if sig[n].startswith("*") or n.startswith("s_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        assert k.asm.get("cubin")
        return k.asm["ptx"]

    if kernel == "router":
        from bytebound.kernels import triton_router as tr
        for m, be, warps, add, seg in ((1, 2, 4, False, 1), (4, 4, 8, True, 1), (1, 2, 4, True, 4)):
            h = 2048
            const = dict(H=h, E=256, G=8, TOPK_GROUP=4, K=8, KP=8, HAS_BIAS=True, NORM=True, M=m, MP=m, BE=be,
                         HP=h, FENCE=True, PDL_OUT=True, ADD_NORM=add, PDL_IN=True, PF=be * h * 4, NTH=32 * warps,
                         SPLIT_TAIL=m > 1, BATCH_ROWS=m > 1, ROUTE=True, SEG=seg)
            types = dict(x_ptr="*bf16", wg_ptr="*fp32", cnt_ptr="*i32", ids_ptr="*i64", scale="fp32",
                         d_ptr="*bf16", nw_ptr="*bf16", hout_ptr="*bf16", xout_ptr="*bf16", eps="fp32")
            _check_prefetch_ptx(build(tr._gemv_route_kernel, types, const, warps), 1)
    else:
        from bytebound.kernels import triton_kda as tk
        bf16 = "*bf16"
        types = dict(qkv_ptr=bf16, f_ptr=bf16, gate_ptr=bf16, b_ptr=bf16, x_ptr=bf16, wb_ptr=bf16, o_ptr=bf16,
                     ticket_ptr="*i32", lower_bound="fp32", eps="fp32", scale="fp32")
        for vs, warps in ((1, 4), (4, 4)):
            const = dict(H=32, K=128, V=128, BK=128, BV=128, SAFE_GATE=True, VS=vs, FENCE=True, PDL=True, PF=True,
                         NTH=32 * warps, BETA_X=True, HID=2560, HB=4096, MT=tk.TAIL_ROWS)
            # the state, the b_proj row and the value-side conv weights/windows; the q/k ones (4) from slice 0
            _check_prefetch_ptx(build(tk._fused_kda_kernel, types, const, warps), 8)
