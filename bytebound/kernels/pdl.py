"""Programmatic dependent launch (PDL, sm_90+) for the small decode/verify kernels.

Inside a CUDA graph a kernel boundary still costs the next grid's launch and ramp (~1-3 us). With PDL a kernel
launched with ``launch_pdl=True`` may start as soon as every program of the kernel before it has issued
``griddepcontrol.launch_dependents``; its own ``griddepcontrol.wait`` then blocks until that kernel has
completed and its memory is visible (CUDA Programming Guide, "Programmatic Dependent Launch and
Synchronization"; PTX ISA ``griddepcontrol``). :func:`enter` issues both at the very top of a kernel, before any
load or store, so the kernel is safe whatever it follows (the caching allocator may hand it memory the
previous kernel still reads: nothing is touched before the wait) and lets the next kernel launch early. The
FP8 GEMVs (``triton_fp8``) additionally prefetch their weights between the two; the MoE kernels keep their own
protocol (``triton_moe_split``). Users of :func:`enter`: the RMSNorm / add+RMSNorm kernel (``triton_norm``) and the
three MLA decode/verify kernels (``triton_mla``). :func:`ticket` is the fence + barrier + acq_rel add with which a
split's last program is found (the Triton kernels' split-K tickets). The fused KDA kernel (``triton_kda``) issues
the same two PDL instructions itself, with :func:`l2_prefetch` of its weights and state between them when
:func:`early` names it; the router GEMV (``triton_router.gemv_route``) is a PDL dependent (wait, prefetch before
it) only when :func:`early` names it (``BYTEBOUND_PDL_PREFETCH``, default off for both).

A kernel not launched with ``launch_pdl`` waits for full completion of the previous one, as without PDL, and
its ``griddepcontrol.wait`` returns at once. ``BYTEBOUND_PDL=0`` in the environment turns PDL off for these
kernels (a diagnostic for A/B timing; read once at import); the router's trigger for the MoE kernels follows
:func:`capable` alone, as the MoE kernels' own protocol does.
"""

from __future__ import annotations

import functools
import os

import torch

from bytebound.kernels.registry import optional_triton

triton, tl, _TRITON_ERR = optional_triton()      # None, None, reason on machines without Triton

_OFF = os.environ.get("BYTEBOUND_PDL", "1") == "0"


@functools.lru_cache(maxsize=None)
def _sm_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def capable(device: torch.device) -> bool:
    """Whether ``griddepcontrol`` can run for a launch on ``device``: CUDA with compute capability >= 9.0, not under
    Triton's interpreter (no PTX there)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return False
    return _sm_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def early(kernel: str, device: torch.device) -> bool:
    """Whether ``kernel`` (``"router"``: ``triton_router.gemv_route``, ``"kda"``: the fused KDA kernel) launches as
    a PDL dependent that streams its static bytes into L2 (:func:`l2_prefetch`) before its wait: :func:`enabled`
    and named in ``BYTEBOUND_PDL_PREFETCH`` (a comma list; default empty: neither, as the H200 A/B of both, either and
    neither showed no gain beyond its run-to-run spread, docs/perf/decode-h200.md). Read at each
    launch, so a benchmark can A/B it in one process by re-capturing its graphs (``profile_decode.py --ab``)."""
    return enabled(device) and kernel in {k.strip() for k in os.environ.get("BYTEBOUND_PDL_PREFETCH", "").split(",")}


def enabled(device: torch.device) -> bool:
    """PDL for the kernels that enter through :func:`enter` and the FP8 GEMVs: :func:`capable` and not switched
    off by ``BYTEBOUND_PDL=0``. A kernel that calls :func:`enter` is launched with ``launch_pdl=True`` when this
    holds."""
    return not _OFF and capable(device)


if tl is not None:
    @triton.jit
    def gdc(ASM: tl.constexpr, NT: tl.constexpr):
        """One PTX instruction with no operands (``griddepcontrol.*``, ``fence.*``) issued by every thread (``NT``
        = 32 * num_warps elements of a 1-D tensor: at least one per thread)."""
        tl.inline_asm_elementwise(ASM, "=r,r", [tl.arange(0, NT)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def enter(PDL: tl.constexpr, NT: tl.constexpr):
        """First statement of a PDL kernel (``PDL`` true): let the next kernel launch, then wait for the previous
        kernel's completion and memory. ``NT``: 32 * num_warps. A no-op when ``PDL`` is false."""
        if PDL:
            gdc("griddepcontrol.launch_dependents; mov.u32 $0, 0;", NT)
            gdc("griddepcontrol.wait; mov.u32 $0, 0;", NT)

    @triton.jit
    def ticket(cnt_ptr, FENCE: tl.constexpr, NT: tl.constexpr, idx=0):
        """Take a split's ticket: every thread's earlier global stores are made visible GPU-wide (``fence.acq_rel.gpu``
        by every thread, with ``FENCE``; False only under Triton's interpreter, which has no PTX and runs the programs
        one after another), a CTA barrier (every thread's fence before the atomic), then one ``acq_rel`` add of 1 at
        ``cnt_ptr + idx`` (int32, GPU scope). Returns the count before the add: the program that reads (programs - 1)
        is the last of its group and sees every other program's stores (the split-K pattern of ``triton_moe_split``).
        ``idx`` (a program's counter in an array of them) is added here, after the barrier, as the kernels' own
        copies of this sequence did: ``cnt_ptr + pid`` passed in is computed before the fence, and ptxas then
        allocated 56 registers instead of 48 for one sm_90 specialisation of ``triton_fp8._fp8_gemv``.
        ``NT``: 32 * num_warps gives every thread one element; a tensor smaller than the CTA is replicated (every
        thread still holds one), a larger one gives threads several (each issues the fence once per element)."""
        if FENCE:
            gdc("fence.acq_rel.gpu; mov.u32 $0, 0;", NT)
        tl.debug_barrier()
        return tl.atomic_add(cnt_ptr + idx, 1, sem="acq_rel", scope="gpu")

    # $1 a 16-byte aligned global address, $2 a byte count (a multiple of 16; 0: nothing). Thread 0 of the CTA
    # issues it: one bulk request per program, not one per thread that holds a replica of the pointer.
    ASM_L2_PREFETCH_T0 = tl.constexpr(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.ne.and.u32 p, $2, 0, p; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")

    @triton.jit
    def l2_prefetch(ptr, nbytes, NT: tl.constexpr):
        """``cp.async.bulk.prefetch.L2`` (sm_90) of ``nbytes`` (a multiple of 16, may be 0) at ``ptr`` (16-byte
        aligned), issued once per program. A hint: nothing is written or waited for, so a PDL dependent may issue
        it before ``griddepcontrol.wait`` for bytes the kernels before it do not write (weights, its own state);
        being inline asm like the wait, it keeps its place before it. ``NT``: 32 * num_warps."""
        tl.inline_asm_elementwise(ASM_L2_PREFETCH_T0, "=r,l,r",
                                  [ptr + tl.zeros([NT], tl.int32), nbytes + tl.zeros([NT], tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
