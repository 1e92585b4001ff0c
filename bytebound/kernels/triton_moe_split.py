"""Variant ``split`` of backend ``triton``, op ``moe``: the routed MoE as two kernels built for bytes in flight.

Why a second variant: the fused kernel (``triton_moe_variants.py``) is latency-bound. Each of its ~96 programs keeps two
weight tiles in flight and runs gate/up, SwiGLU and down in series; the H200 sweep put it at 13 % of the read
bandwidth at M = 1, nearly independent of the tiling (docs/perf/moe-kernels-h200.md). By Little's law a 4.3 TB/s
part with ~1 us load latency needs ~4 MB in flight, ~33 KB per SM. Here the work is cut into a thousand-odd
small programs; each issues *all* of its weight loads at once, as 16-byte vectors straight into registers (no
shared-memory staging of the weights), and only then computes.

**Fragments without a shuffle.** The E2M1 words are decoded straight into mma.m16n8k16 A fragments
(:func:`frag_dequant`). The tensor core wants lane ``4g + t`` to hold k pairs ``2t, 2t+1, 2t+8, 2t+9`` of each 16-wide
k tile, which are spread over four 8-value words. A dot product does not care in which order it sums, so the
kernel uses a *logical* k order: ``kappa = 128s + 32tau + 16p + 8h + 2t + j`` holds physical column ``128s + 32t +
8tau + 4p + 2h + j``. Then a lane's 16-byte vector of 4 consecutive words (one E8M0 block) is exactly the 32 values
its fragments need over 8 k tiles, the layout conversion is free (asserted at compile time), and only the small B
operand (x or the activations, L2-resident) is gathered in the permuted order (:func:`_load_b`).

Kernel A, gate/up, grid ``(I/BI, M*top_k, KP)``: program ``(j, s, p)`` multiplies rows ``gate[j-slice] |
up[j-slice]`` of expert ``e = ids.flat[s]`` by ``x`` over the ``p``-th of ``KP`` slices of H. With ``KP = 1`` it
applies SwiGLU (optional clamp) and the per-token routing weight itself; with ``KP > 1`` it stores a float32 partial
and the last of the ``KP`` programs (an acq_rel ticket) sums the partials in the fixed order ``p = 0..KP-1`` and
applies the epilogue. Output: ``act bf16 [S, M, I]``, ``act[s, m] = w_tok[m] * SwiGLU(gate_e x_m, up_e x_m)``
with ``w_tok[m]`` the weight token ``m`` gave ``e`` (0 if it did not pick it).

Kernel B, down, grid ``(H/BH, M*top_k, KP2)``: program ``(b, s, q)`` computes ``W2[e, b-rows, q-slice] @
act[s, :, q-slice]^T`` (float32 ``[BH, M]``) into its own slot; the last of the ``S*KP2`` programs of row block
``b`` sums the slots in the fixed order (s, then q) and writes the BF16 output. It is launched with programmatic
dependent launch (PDL, sm_90+): its programs load and decode their weights while kernel A still runs, and only
then wait (``griddepcontrol.wait``) for A's activations.

Dedup (M > 1): a slot whose expert an earlier slot already chose does no work (kernel A) and stores a zero
partial (kernel B), so each distinct expert's bytes are read once per call. Determinism: no float atomics; every
sum runs in an order fixed by the launch shape, so outputs are bit-identical run to run and graph == eager. The
tickets are reset by their last program, so each launch is self-contained and CUDA-graph safe.

Scratch (``act``, the two partial buffers and the tickets, and ``ring_info`` under ``TR``; ``kernels.scratch``) is shared by every binding on a
device: the MoE layers run one after another on one stream, and each launch has consumed its scratch before the
next one starts. Kernel A either is an ordinary launch (it starts after the previous B completed) or, with
``pdl_in``, a PDL dependent of the kernel before it whose every program runs ``griddepcontrol.wait`` before it
touches ``ids``, x or the scratch, and only then ``launch_dependents`` (``_pdl_in``); B overlaps only its own A
and touches none of A's buffers before its dependency wait.

**The PDL invariant B relies on.** B reads ``ids`` *before* its wait. That is safe only because B cannot launch
before every A program has triggered, and every A program triggers only after A itself saw ``ids`` complete:
with ``pdl_in 0`` A started after the router finished; with ``pdl_in > 0`` each A program triggers after its own
``griddepcontrol.wait``. Keep the trigger after the wait in any change to kernel A.

Config keys (``configs/triton_moe.json``, variant ``"split"``): ``BI`` (intermediate rows per kernel-A program; it
reads 2*BI rows), ``KP`` (H slices), ``num_warps`` (kernel A), ``BH`` (hidden rows per kernel-B program), ``KP2``
(I slices), ``down_warps``, ``KC`` (default 1: kernel A's H slice in KC chunks through a two-deep register
pipeline, :func:`_gateup_routed`), ``SG`` (default 1: kernel B's slots per program, summed in registers in slot
order, :func:`_down_routed_group`), ``pdl`` (default true), ``pdl_in`` (0, the default: kernel A is an ordinary
launch; 1: A is launched as a PDL dependent of the kernel before it, the router, so its programs start while the
router runs and wait before touching ``ids``, x or the scratch; 2: as 1, and the shared slot loads its first weights
before waiting), ``DQ`` (the E2M1 decode of the routed slots, :func:`frag_dequant`: 1, the default, shifts the
codes into BF16 with 2^126 folded into the E8M0 scale; 0 decodes through PRMT tables. A binding whose E8M0 scales
exceed :data:`SHIFT_DECODE_MAX_E8M0` runs 0 whatever the config says, ``MoEKernel.shift_decode``), ``RK`` (default 0;
1 with ``KP > 1``: kernel A's programs store their partials and end, and :func:`_moe_reduce_swiglu`, a third launch
between the two kernels, sums them and applies SwiGLU: the same sums in the same order, so the same bits, without the
fence, ticket and last-program tail in kernel A; the committed M = 4 entry sets it, the M = 1 decode entry does not:
one more launch per MoE layer there would take the step past its kernel budget), ``RB`` (default 0; 1 with ``KP >
1``, excludes ``RK`` and ``TR``: kernel A's programs store their partials and end, as with ``RK``, and kernel B's
programs, after their PDL wait, form their activation operand from those partials themselves,
:func:`_b_from_partials`: the same sums in the same order and the same SwiGLU arithmetic, so the same bits, with
neither kernel A's ticket tail nor a third launch; each B program re-reads the ``KP`` partials of its I slice from
L2, ``KP`` x 2 float32 values per activation it multiplies instead of one BF16; that re-read costs more than the tail
it removes, measured in docs/perf/session38/, so no committed entry sets it), ``XS`` (default 0; experimental: kernel
A stages x for its whole H slice in shared memory once, :func:`_stage_b`, instead of every warp loading its own copy
into registers; the same bits; only where that slice is 128 x 2^n columns, else fitted to 0), ``TR`` (default 0;
experimental: kernel A as a persistent TMA ring, ``kernels.triton_moe_ring``, 2 = warp-specialised; fits KP to H/256,
KC 1, RK 1, whose bits it reproduces; ``TR_ST`` stages, ``TR_G`` programs per SM, ``TR_NS``, ``TR_REGS``, ``TR_XS``; sm_90
only), ``NR`` (default none; kernel A's register cap per thread, ptxas ``maxnreg``: the same arithmetic, so the same
bits, and another register allocation and schedule: given a cap, ptxas hoists the weight loads further above
their use; the committed M = 4 entry sets 80, the largest count that keeps 3 programs per SM, docs/perf/history.md;
``scripts/split_ptxas.py --sched`` shows the count and the hoisting offline, with int64 ids as the engine's router
writes them: 72 registers uncapped at M = 4; not with ``TR``, whose kernels take ``TR_REGS``: a candidate that
turns the ring on over the M = 4 entry says ``"NR": None``), ``NR2`` (default none; kernel B's register cap, the same
for kernel B: the same bits; below ptxas' own count it spills; measured no faster at M = 1 or 4,
docs/perf/session27-h100-nr/). Constraints: H/(KP*KC) and I/KP2 are
128 x a power of two, ``2*BI >= 16*num_warps`` and ``BH >= 16*down_warps`` (an mma row tile per warp);
:func:`fit_split_config` fits a config to a model's shape or raises BackendError.

This module also owns the device code the fused variants share (``kernels.triton_moe_variants``): the Gluon import
(:data:`gluon`, :data:`gl`, :data:`GLUON_ERR`), the E2M1 decode (:data:`ASM_DEQ8` with its PRMT tables
:data:`LUT_WORDS`, :func:`lut_tensor`), the release/acquire fence (:data:`ASM_FENCE`) and :func:`fit_pow2`. The
benchmark's time-attribution probes (``scripts/bench_moe.py --probe``) are not here: ``bytebound.bench.moe_probe``
builds a private copy of this module with the weight-tile loader (:func:`mxfp4_tile`) and the decode
(:func:`frag_dequant`) replaced.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from bytebound.errors import BackendError
from bytebound.kernels.device import check_register_cap, maxnreg
from bytebound.kernels.scratch import scratch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    GLUON_ERR = None
except Exception as exc:  # pragma: no cover
    gluon = gl = mma_v2 = None
    GLUON_ERR = f"triton.experimental.gluon is not importable: {exc}"


# E2M1 -> BF16 lookup tables for PRMT (bytes 0..7 = magnitude codes 0..7):
#   low byte  [00 00 80 C0 00 40 80 C0] and high byte [00 3F 3F 3F 40 40 40 40] of 0, .5, 1, 1.5, 2, 3, 4, 6;
#   sign byte table [00 80] indexed by the code's bit 3.
LUT_WORDS = (0xC0800000, 0xC0804000, 0x3F3F3F00, 0x40404040, 0x00008000)


def lut_tensor(device) -> torch.Tensor:
    """:data:`LUT_WORDS` as the kernels' ``lut`` argument: int32 ``[8]`` on ``device`` (the five words, then
    zeros), passed to :data:`ASM_DEQ8` as registers."""
    vals = [v - (1 << 32) if v >= 1 << 31 else v for v in LUT_WORDS]
    return torch.tensor(vals + [0, 0, 0], dtype=torch.int32, device=device)


def fit_pow2(block: int, n: int, lo: int) -> int:
    """Largest power-of-two block <= ``block`` that divides ``n`` (>= ``lo``), else 0 (tensor shapes must be
    powers of two)."""
    b = 1 << (max(int(block), 1).bit_length() - 1)
    while b >= lo:
        if n % b == 0:
            return b
        b //= 2
    return 0


if gluon is not None:
    # One int32 word = 8 E2M1 codes (code t in bits 4t..4t+3 = k order). $8 word, $9 bf16x2 (scale, scale),
    # $10..$14 the LUT words (passed as registers so ptxas keeps them resident instead of re-materialising).
    # Outputs $0..$7: the 8 BF16 values in k order.
    ASM_DEQ8 = gl.constexpr("""
{
.reg .b32 a<13>;
.reg .b32 o<4>;
and.b32  a0, $8, 0x88888888;
shr.u32  a1, a0, 3;
and.b32  a2, $8, 0x77777777;
shr.u32  a3, a2, 16;
shr.u32  a4, a0, 19;
prmt.b32 a5, $10, $11, a2;
prmt.b32 a6, $10, $11, a3;
prmt.b32 a7, $12, $13, a2;
prmt.b32 a8, $12, $13, a3;
prmt.b32 a9, $14, 0, a1;
prmt.b32 a10, $14, 0, a4;
or.b32   a11, a7, a9;
or.b32   a12, a8, a10;
prmt.b32 o0, a5, a11, 0x5140;
prmt.b32 o1, a5, a11, 0x7362;
prmt.b32 o2, a6, a12, 0x5140;
prmt.b32 o3, a6, a12, 0x7362;
mul.rn.bf16x2 o0, o0, $9;
mul.rn.bf16x2 o1, o1, $9;
mul.rn.bf16x2 o2, o2, $9;
mul.rn.bf16x2 o3, o3, $9;
mov.b32 {$0, $1}, o0;
mov.b32 {$2, $3}, o1;
mov.b32 {$4, $5}, o2;
mov.b32 {$6, $7}, o3;
}
""")

    # The shift decode (``DQ`` 1): no table. Output register r (0..3) holds codes r and r + 4 of the word, 16 bits
    # apart as the two BF16 halves are. A code's magnitude bits (e1 e0 m) go to bits 8, 7, 6 of its half and its
    # sign to bit 15: the BF16 exponent field is then e (0..3) and the top mantissa bit m, so a normal code (e >= 1)
    # reads 2^(e-127) (1 + m/2) and the subnormal one (e = 0) m 2^-127: E2M1's 2^(e-1) (1 + m/2) and m/2 times
    # 2^-126 alike. $9 is the BF16x2 factor 2^126 x the E8M0 scale = 2^(E-1) (E <= 128: a normal BF16), so the
    # product is the LUT decode's value bit for bit (the same real product, the same rounding); BF16 multiplies
    # keep subnormal inputs (PTX: no .ftz for bf16). ~19 instructions per word against the table's ~21 + the
    # table registers' moves, and no table registers.
    ASM_DEQ8_SHIFT = gl.constexpr("""
{
.reg .b32 a<8>;
shl.b32  a0, $8, 6;
and.b32  a0, a0, 0x01C001C0;
shl.b32  a1, $8, 12;
and.b32  a1, a1, 0x80008000;
or.b32   a0, a0, a1;
shl.b32  a2, $8, 2;
and.b32  a2, a2, 0x01C001C0;
shl.b32  a3, $8, 8;
and.b32  a3, a3, 0x80008000;
or.b32   a2, a2, a3;
shr.u32  a4, $8, 2;
and.b32  a4, a4, 0x01C001C0;
shl.b32  a5, $8, 4;
and.b32  a5, a5, 0x80008000;
or.b32   a4, a4, a5;
shr.u32  a6, $8, 6;
and.b32  a6, a6, 0x01C001C0;
and.b32  a7, $8, 0x80008000;
or.b32   a6, a6, a7;
mul.rn.bf16x2 a0, a0, $9;
mul.rn.bf16x2 a2, a2, $9;
mul.rn.bf16x2 a4, a4, $9;
mul.rn.bf16x2 a6, a6, $9;
mov.b32 {$0, $1}, a0;
mov.b32 {$2, $3}, a2;
mov.b32 {$4, $5}, a4;
mov.b32 {$6, $7}, a6;
}
""")

    ASM_FENCE = gl.constexpr("fence.acq_rel.gpu; mov.u32 $0, 0;")
else:  # pragma: no cover
    ASM_DEQ8 = ASM_DEQ8_SHIFT = ASM_FENCE = None

# The largest E8M0 byte the shift decode takes: its factor 2^(E-1) must be a finite BF16 (E - 1 <= 127).
SHIFT_DECODE_MAX_E8M0 = 128

# The shared-memory layout of a staged B operand (``[128*NS, 8]`` BF16, k contiguous per token column, an XOR
# swizzle over 16-byte groups so that the 8 token columns of a fragment load fall in different banks).
XS_LAYOUT = gl.SwizzledSharedLayout(8, 1, 8, [0, 1]) if gl is not None else None

SPLIT_DEFAULT = {"variant": "split", "BI": 32, "KP": 10, "num_warps": 4, "BH": 64, "KP2": 3, "down_warps": 4,
                 "pdl": True, "DQ": 1}

if gluon is not None:
    @gluon.jit
    def _fence_all(NW: gl.constexpr):
        """Every thread: ``fence.acq_rel.gpu`` (its partial stores are visible before the CTA takes a ticket)."""
        FL: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        fz = gl.arange(0, 32 * NW, layout=FL)
        gl.inline_asm_elementwise(ASM_FENCE, "=r,r", [fz], gl.int32, False, 1)
        gl.thread_barrier()

    @gluon.jit
    def frag_dequant(w, s, c0, c1, c2, c3, c4, DA: gl.constexpr, DQ: gl.constexpr = 0):
        """E2M1 words straight into mma A fragments, with no shared-memory round trip.

        ``w`` int32 ``[R, NS, 4, 4]`` in :func:`word_layout` (row, 128-column super-block, scale block t, word
        tau of that block) and ``s`` uint8 ``[R, NS, 4]`` (its E8M0 bytes) -> BF16 ``[R, 128*NS]`` in the mma A
        layout ``DA`` *in logical k order*: logical ``kappa = 128s + 32tau + 16p + 8h + 2t + j`` holds the value at
        physical column ``128s + 32t + 8tau + 4p + 2h + j``. The B operand must be permuted the same way
        (:func:`_load_b`); a dot product does not care in which order it sums. The permutation is chosen so that
        each thread's 16-byte vector of 4 words is exactly the 32 values its A fragments need over 8 k tiles, so
        the layout conversion below is free (asserted at compile time).

        ``DQ`` 0: the PRMT table decode (:data:`ASM_DEQ8`, the table words ``c0..c4``); value ``(p, h, j)`` of a word
        is its code ``4p + 2h + j``. ``DQ`` 1: the shift decode (:data:`ASM_DEQ8_SHIFT`, no table: ``c0..c4`` are
        unused; every E8M0 byte at most :data:`SHIFT_DECODE_MAX_E8M0`); value ``(p, h, j)`` is code ``4j + 2p + h``,
        so the physical column above reads ``128s + 32t + 8tau + 4j + 2p + h``, and :func:`_load_b` must be given
        the same ``DQ``."""
        R: gl.constexpr = w.shape[0]
        NS: gl.constexpr = w.shape[1]
        if DQ == 1:
            # (E + 126) in both halves' exponent fields: the BF16x2 factor 2^(E-1) (E <= 128 keeps it below 2^31)
            sf = s.to(gl.int32) * 0x00800080 + 0x3F003F00
            s2 = gl.broadcast(gl.expand_dims(sf, 3), w)[0]
            v = gl.inline_asm_elementwise(ASM_DEQ8_SHIFT, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, s2],
                                          (gl.bfloat16,) * 8, True, 1)
        else:
            s16 = s.to(gl.int32) << 7
            s2 = gl.broadcast(gl.expand_dims(s16 | (s16 << 16), 3), w)[0]
            v = gl.inline_asm_elementwise(ASM_DEQ8, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r",
                                          [w, s2, c0, c1, c2, c3, c4], (gl.bfloat16,) * 8, True, 1)
        # v[i] is value i = 4p + 2h + j of the word (its code: above); joins append dims j, h, p
        a = gl.join(gl.join(gl.join(v[0], v[1]), gl.join(v[2], v[3])),
                    gl.join(gl.join(v[4], v[5]), gl.join(v[6], v[7])))
        a = gl.permute(a, [0, 1, 3, 6, 5, 2, 4])          # [R, NS, t, tau, j, h, p] -> [R, NS, tau, p, h, t, j]
        return gl.convert_layout(gl.reshape(a, [R, NS * 128]), DA, assert_trivial=True)

    # 4 FP8 E4M3 bytes of a word -> 4 BF16, times a BF16x2 factor ($5). The byte goes into the high byte of a
    # 16-bit half (prmt), then sign | (exponent, mantissa) >> 4 is the BF16 pattern of the value x 2^-120 (exact for
    # normals and subnormals: E4M3's exponent bias is 7, BF16's 127); the factor is the block scale x 2^120
    # (:meth:`MoEKernel.bind_shared` checks it is exact).
    _ASM_FP8X4 = gl.constexpr("""
{
.reg .b32 a<4>;
prmt.b32 a0, $4, 0, 0x1404;
prmt.b32 a1, $4, 0, 0x3424;
and.b32  a2, a0, 0x80008000;
shr.u32  a0, a0, 4;
and.b32  a0, a0, 0x07F007F0;
or.b32   a0, a0, a2;
and.b32  a3, a1, 0x80008000;
shr.u32  a1, a1, 4;
and.b32  a1, a1, 0x07F007F0;
or.b32   a1, a1, a3;
mul.rn.bf16x2 a0, a0, $5;
mul.rn.bf16x2 a1, a1, $5;
mov.b32 {$0, $1}, a0;
mov.b32 {$2, $3}, a1;
}
""")

    # E4M3 pairs -> FP16 pairs by the hardware conversion (sm_89+), exact: 2 instructions per word against the
    # BF16 decode's ~12 (_ASM_FP8X4); _frag_fp8's F16 operands (then the B operand must be FP16 too)
    _ASM_FP8X4_F16 = gl.constexpr("""
{
.reg .b16 l, h;
.reg .b32 a0, a1;
mov.b32 {l, h}, $4;
cvt.rn.f16x2.e4m3x2 a0, l;
cvt.rn.f16x2.e4m3x2 a1, h;
mov.b32 {$0, $1}, a0;
mov.b32 {$2, $3}, a1;
}
""")

    @gluon.jit
    def _frag_fp8(w, s, DA: gl.constexpr, F16: gl.constexpr = False):
        """FP8 E4M3 words straight into mma A fragments, in the logical k order of :func:`frag_dequant` (so the
        same B operand, :func:`_load_b`, fits). ``w`` int32 ``[R, NS, 4, 8]`` in :func:`fp8_word_layout` (row,
        128-column super-block, lane column group t, word): lane ``t``'s 32 bytes are physical columns ``128s +
        32t + o``, ``o = 8tau + 4p + 2h + j`` in word ``2tau + p``, byte ``2h + j``; ``s`` int32 ``[R, NS]``, the
        BF16x2 factor (block scale x 2^120) of each row and super-block. -> BF16 ``[R, 128*NS]`` in layout ``DA``.
        ``F16``: the E4M3 values themselves as FP16 (exact; ``s`` unused, any scale applied by the caller), by the
        hardware conversion (``_ASM_FP8X4_F16``, sm_89+)."""
        R: gl.constexpr = w.shape[0]
        NS: gl.constexpr = w.shape[1]
        if F16:
            v = gl.inline_asm_elementwise(_ASM_FP8X4_F16, "=h,=h,=h,=h,r", [w], (gl.float16,) * 4, True, 1)
        else:
            s2 = gl.broadcast(gl.expand_dims(gl.expand_dims(s, 2), 3), w)[0]
            v = gl.inline_asm_elementwise(_ASM_FP8X4, "=h,=h,=h,=h,r,r", [w, s2], (gl.bfloat16,) * 4, True, 1)
        # v[i] is byte i = 2h + j of the word; the joins append dims j, then h
        a = gl.join(gl.join(v[0], v[1]), gl.join(v[2], v[3]))          # [R, NS, t, word, j, h]
        a = gl.reshape(a, [R, NS, 4, 4, 2, 2, 2])                        # word = 2tau + p
        a = gl.permute(a, [0, 1, 3, 4, 6, 2, 5])      # [R, NS, t, tau, p, j, h] -> [R, NS, tau, p, h, t, j]
        return gl.convert_layout(gl.reshape(a, [R, NS * 128]), DA, assert_trivial=True)

    @gluon.jit
    def _load_b(src_ptr, row_stride, M: gl.constexpr, NS: gl.constexpr, NW: gl.constexpr, DB: gl.constexpr,
                ok=True, DQ: gl.constexpr = 0):
        """B operand ``[128*NS, 8]`` BF16 (tokens padded to 8 columns, 0 for ``n >= M``) straight into the mma
        B-fragment layout ``DB``, in the logical k order of :func:`frag_dequant`: ``B[kappa, n] = src[n *
        row_stride + phys(kappa)]``. Lane ``4g + t`` needs token ``g``'s 32 contiguous columns ``128s + 32t ..
        128s + 32t + 31`` of each super-block, so it loads them as four 16-byte vectors and the reshape to ``DB`` is
        free (asserted). ``src`` is x or act (L2-resident); every warp loads the whole operand (the B fragments are
        the same in every warp). ``ok`` false (a scalar): all zeros, nothing loaded (a slot kernel B's slot loop
        skips). ``DQ``: the A operand's decode (:func:`frag_dequant`), whose order within a word this follows (0 also
        for the FP8 operands, :func:`_frag_fp8`)."""
        XL: gl.constexpr = gl.BlockedLayout([1, 1, 1, 32], [1, 8, 4, 1], [1, 1, 1, NW], [3, 2, 1, 0])
        return gl.convert_layout(_b_logical(src_ptr, row_stride, M, NS, XL, ok, DQ), DB, assert_trivial=True)

    @gluon.jit
    def _b_logical(src_ptr, row_stride, M: gl.constexpr, NS: gl.constexpr, XL: gl.constexpr, ok, DQ: gl.constexpr):
        """The B operand ``[128*NS, 8]`` BF16 in the logical k order of :func:`frag_dequant` (``DQ``), loaded as
        ``[NS, 8, 4, 32]`` (super-block, token, lane column group, column) in layout ``XL`` and reshaped without data
        movement: the one gather of :func:`_load_b` (every warp a whole copy) and :func:`_b_spread` (one copy spread
        over the program). Tokens ``n >= M``, and everything when the scalar ``ok`` is false, are 0 (not loaded)."""
        sb = gl.arange(0, NS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
        n = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, XL))))
        c = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, XL))))
        off3 = n[None, :, None] * row_stride + sb[:, None, None] * 128 + t[None, None, :] * 32
        msk3 = (n[None, :, None] < M) & (sb[:, None, None] >= 0) & (t[None, None, :] >= 0) & ok
        x = gl.load(src_ptr + off3[:, :, :, None] + c[None, None, None, :],
                    mask=msk3[:, :, :, None] & (c[None, None, None, :] >= 0), other=0.0)   # [NS, 8, 4, 32]
        x = gl.reshape(x, [NS, 8, 4, 4, 2, 2, 2])
        if DQ == 1:
            x = gl.permute(x, [0, 3, 5, 6, 2, 4, 1])         # c = 8tau + 4j + 2p + h -> [s, tau, p, h, t, j, n]
        else:
            x = gl.permute(x, [0, 3, 4, 5, 2, 6, 1])         # c = 8tau + 4p + 2h + j -> [s, tau, p, h, t, j, n]
        return gl.reshape(x, [NS * 128, 8])

    @gluon.jit
    def _stage_b(src_ptr, row_stride, M: gl.constexpr, NS: gl.constexpr, NW: gl.constexpr, DQ: gl.constexpr):
        """The B operand of :func:`_load_b` (``[128*NS, 8]`` BF16, logical k order, tokens padded to 8 with zeros)
        staged once in shared memory (config key ``XS``): every thread loads a distinct part of x (no per-warp
        copies, no B registers held across the weight loads), and each chunk's fragments are read from shared
        memory (:func:`_gateup_routed`) after the barrier this ends with. Returns the shared-memory descriptor."""
        x_s = gl.allocate_shared_memory(gl.bfloat16, [NS * 128, 8], XS_LAYOUT)
        x_s.store(_b_spread(src_ptr, row_stride, M, NS, NW, DQ))
        gl.thread_barrier()
        return x_s

    @gluon.jit
    def _b_spread(src_ptr, row_stride, M: gl.constexpr, NS: gl.constexpr, NW: gl.constexpr, DQ: gl.constexpr):
        """:func:`_load_b`'s operand (``[128*NS, 8]`` BF16, logical k order) loaded once per program, spread over
        all of its threads (no per-warp copies): the value to store into shared memory (:data:`XS_LAYOUT`)."""
        W3: gl.constexpr = 4 if NW >= 4 else NW
        XL: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [1, 8, 4, 1], [NW // W3, 1, 1, W3], [3, 2, 1, 0])
        return _b_logical(src_ptr, row_stride, M, NS, XL, True, DQ)

    @gluon.jit
    def _gdc(ASM: gl.constexpr, NW: gl.constexpr):
        """``griddepcontrol.wait`` / ``.launch_dependents`` (PDL, sm_90+), issued by every thread."""
        FL: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        gl.inline_asm_elementwise(ASM, "=r,r", [gl.arange(0, 32 * NW, layout=FL)], gl.int32, False, 1)

    @gluon.jit
    def _slot_expert(ids_ptr, s, S: gl.constexpr, SP: gl.constexpr, RL: gl.constexpr):
        """Routing slot ``s``: ``(ids [SP] (-1 past S), its expert e, owner)``; ``owner`` is false when an
        earlier slot chose the same expert (that slot does the expert's work, for every token that chose it)."""
        t = gl.arange(0, SP, layout=gl.SliceLayout(0, RL))
        ids = gl.load(ids_ptr + t, mask=t < S, other=-1)
        e = gl.load(ids_ptr + s)
        return ids, e, gl.sum(gl.where((ids == e) & (t < s), 1, 0), axis=0) == 0

    @gluon.jit
    def _token_weights(ids, e, tw_ptr, S: gl.constexpr, SP: gl.constexpr, TOPK: gl.constexpr, RL: gl.constexpr):
        """float32 ``[8]`` (layout ``SliceLayout(1, RL)``): the routing weight each token ``m`` gave expert ``e`` (0 if
        it did not pick it, and for the padding tokens ``m >= M``), from the slots' ``ids`` (``[SP]``, -1 past ``S``)
        and their weights ``tw [S]``."""
        t = gl.arange(0, SP, layout=gl.SliceLayout(0, RL))
        tw = gl.load(tw_ptr + t, mask=t < S, other=0.0)
        mcol = gl.arange(0, 8, layout=gl.SliceLayout(1, RL))
        sel = (ids[None, :] == e) & ((t // TOPK)[None, :] == mcol[:, None])
        return gl.sum(gl.where(sel, tw[None, :], 0.0), axis=1)

    @gluon.jit
    def mxfp4_index(row, cb, K: gl.constexpr, WD: gl.constexpr):
        """The index maths of :func:`mxfp4_tile` (also the benchmark probe's, ``bench.moe_probe``, which replaces
        the loads): for rows ``row`` (``[R]``, layout ``SliceLayout(1, SliceLayout(2, SliceLayout(3, WD)))``) and
        the ``NS`` 128-column super-blocks from ``cb`` of a ``[*, K]`` matrix, ``(w3, q, sb, tb)``: ``w3`` int32
        ``[R, NS, 4]`` (layout ``SliceLayout(3, WD)``), the offset of the first of the 4 int32 words of each row,
        super-block and lane column group in the expert's words ``[*, K/8]``; ``q`` ``[4]`` the word within it;
        ``sb`` ``[NS]`` and ``tb`` ``[4]``, the super-block and the lane column group."""
        NS: gl.constexpr = WD.shape[1]
        SD: gl.constexpr = gl.SliceLayout(3, WD)
        sb = gl.arange(0, NS, layout=gl.SliceLayout(0, gl.SliceLayout(2, SD)))
        tb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, SD)))
        q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WD))))
        w3 = row[:, None, None] * (K // 8) + cb * 16 + sb[None, :, None] * 16 + tb[None, None, :] * 4
        return w3, q, sb, tb

    @gluon.jit
    def mxfp4_tile(w_ptr, s_ptr, row, cb, K: gl.constexpr, WD: gl.constexpr):
        """One expert's MXFP4 tile for :func:`frag_dequant`: int32 words ``[R, NS, 4, 4]`` (layout ``WD``) and E8M0
        bytes ``[R, NS, 4]`` of rows ``row`` (``[R]``, layout ``SliceLayout(1, SliceLayout(2, SliceLayout(3,
        WD)))``) and the ``NS`` 128-column super-blocks from ``cb`` of a ``[*, K]`` matrix (indices:
        :func:`mxfp4_index`); ``w_ptr`` / ``s_ptr`` point at the expert's words / scales."""
        w3, q, sb, tb = mxfp4_index(row, cb, K, WD)
        wv = gl.load(w_ptr + (w3[:, :, :, None] + q[None, None, None, :]))
        sv = gl.load(s_ptr + row[:, None, None] * (K // 32) + cb * 4 + sb[None, :, None] * 4 + tb[None, None, :])
        return wv, sv

    @gluon.jit
    def mxfp4_tile_if(w_ptr, s_ptr, row, cb, K: gl.constexpr, WD: gl.constexpr, ok):
        """:func:`mxfp4_tile` loaded only where the scalar ``ok`` holds (zero words and scales otherwise, no bytes
        read): kernel B's slot loop skips duplicate and padding slots without a branch."""
        w3, q, sb, tb = mxfp4_index(row, cb, K, WD)
        wo = w3[:, :, :, None] + q[None, None, None, :]
        wv = gl.load(w_ptr + wo, mask=(wo >= 0) & ok, other=0)
        so = row[:, None, None] * (K // 32) + cb * 4 + sb[None, :, None] * 4 + tb[None, None, :]
        sv = gl.load(s_ptr + so, mask=(so >= 0) & ok, other=0)
        return wv, sv

    @gluon.jit
    def fp8_index(row, cb, K: gl.constexpr, WD8: gl.constexpr):
        """The index maths of :func:`_fp8_tile` (also ``gluon_fp8_gemv``'s chunk loads): for rows ``row`` (``[R]``,
        layout ``SliceLayout(1, SliceLayout(2, SliceLayout(3, WD8)))``) and the ``NC`` 128-column super-blocks from
        ``cb`` of a ``[*, K]`` E4M3 matrix viewed as int32 ``[*, K/4]``, ``(off, sb, t, q)``: ``off`` int32 ``[R, NC,
        4, 8]`` (layout ``WD8``) the word offsets; ``sb`` ``[NC]``, ``t`` ``[4]`` and ``q`` ``[8]`` the super-block,
        the lane column group and the word."""
        NC: gl.constexpr = WD8.shape[1]
        SD8: gl.constexpr = gl.SliceLayout(3, WD8)
        sb = gl.arange(0, NC, layout=gl.SliceLayout(0, gl.SliceLayout(2, SD8)))
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, SD8)))
        q = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WD8))))
        w3 = row[:, None, None] * (K // 4) + (cb + sb[None, :, None]) * 32 + t[None, None, :] * 8
        return w3[:, :, :, None] + q[None, None, None, :], sb, t, q

    @gluon.jit
    def _fp8_tile(w_ptr, s_ptr, row, cb, K: gl.constexpr, WD8: gl.constexpr):
        """An FP8 tile for :func:`_frag_fp8`: int32 words ``[R, NC, 4, 8]`` (layout ``WD8``) and BF16x2 scale
        factors ``[R, NC]`` of rows ``row`` (``[R]``, layout ``SliceLayout(1, SliceLayout(2, SliceLayout(3,
        WD8)))``) and the ``NC`` 128-column super-blocks from ``cb`` of a ``[*, K]`` matrix with 128x128 block
        scales ``[*, K/128]`` (indices: :func:`fp8_index`)."""
        off, sb, t, q = fp8_index(row, cb, K, WD8)
        wv = gl.load(w_ptr + off)
        sv = gl.load(s_ptr + (row // 128)[:, None] * (K // 128) + cb + sb[None, :])
        return wv, sv

    @gluon.jit
    def _moe_gateup_split(x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, act_ptr, part_ptr, cnt_ptr, lut_ptr, limit,
                          sw13_ptr, ss13_ptr, slimit,
                          H: gl.constexpr, I: gl.constexpr, TOPK: gl.constexpr, M: gl.constexpr,
                          SP: gl.constexpr, BI: gl.constexpr, KP: gl.constexpr, HAS_LIMIT: gl.constexpr,
                          WD: gl.constexpr, PDL: gl.constexpr, SHARED: gl.constexpr = False,
                          WD8: gl.constexpr = None, PDL_IN: gl.constexpr = 0, KC: gl.constexpr = 1,
                          DQ: gl.constexpr = 0, RK: gl.constexpr = 0, XS: gl.constexpr = 0):
        NW: gl.constexpr = gl.num_warps()
        S: gl.constexpr = M * TOPK
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        RL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NW], [1, 0])
        j = gl.program_id(0)
        s = gl.program_id(1)
        p = gl.program_id(2)
        if PDL and PDL_IN == 0:     # kernel B may launch now: its weight prologue does not depend on this kernel
            _gdc("griddepcontrol.launch_dependents; mov.u32 $0, 0;", NW)

        if SHARED:
            if s == S:
                _gateup_shared(x_ptr, sw13_ptr, ss13_ptr, act_ptr, part_ptr, cnt_ptr, slimit, s, j, p, H, I, M, BI,
                               KP, HAS_LIMIT, WD8, PDL_IN, MMA, DA, DB, RL, KC, RK, XS)
            else:
                _pdl_in(PDL_IN, PDL, NW)
                _gateup_routed(x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, act_ptr, part_ptr, cnt_ptr, lut_ptr, limit,
                               s, j, p, H, I, TOPK, M, SP, BI, KP, HAS_LIMIT, WD, MMA, DA, DB, RL, KC, DQ, RK, XS)
        else:
            _pdl_in(PDL_IN, PDL, NW)
            _gateup_routed(x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, act_ptr, part_ptr, cnt_ptr, lut_ptr, limit,
                           s, j, p, H, I, TOPK, M, SP, BI, KP, HAS_LIMIT, WD, MMA, DA, DB, RL, KC, DQ, RK, XS)

    @gluon.jit
    def _pdl_in(PDL_IN: gl.constexpr, PDL: gl.constexpr, NW: gl.constexpr):
        """Kernel A launched as a PDL dependent (``pdl_in``): wait for the kernel before it (the router, which
        wrote ``ids`` and the routing weights, or whatever ran before, which may still use the scratch), and only
        then let kernel B launch: B reads ``ids`` before its own wait, so every A program must have passed this
        wait before B starts. Without ``PDL_IN`` a no-op."""
        if PDL_IN > 0:
            _gdc("griddepcontrol.wait; mov.u32 $0, 0;", NW)
            if PDL:
                _gdc("griddepcontrol.launch_dependents; mov.u32 $0, 0;", NW)

    @gluon.jit
    def _gateup_shared(x_ptr, sw13_ptr, ss13_ptr, act_ptr, part_ptr, cnt_ptr, slimit, s, j, p, H: gl.constexpr,
                       I: gl.constexpr, M: gl.constexpr, BI: gl.constexpr, KP: gl.constexpr,
                       HAS_LIMIT: gl.constexpr, WD8: gl.constexpr, PDL_IN: gl.constexpr, MMA: gl.constexpr,
                       DA: gl.constexpr, DB: gl.constexpr, RL: gl.constexpr, KC: gl.constexpr = 1,
                       RK: gl.constexpr = 0, XS: gl.constexpr = 0):
        """Kernel A, the shared expert's slot: FP8 E4M3 rows ``gate[j-slice] | up[j-slice]`` (128x128 block
        scales, ``ss13`` as BF16x2 factors) times x over H slice ``p``; routing weight 1 for every token. With
        ``PDL_IN`` the first chunk's weights (read-only, known before routing) are loaded *before* the PDL wait,
        so they stream while the router still runs (``PDL_IN == 2``; 1 waits first); x and the scratch are touched
        only after the wait. With ``KC > 1`` (a wider H slice in several chunks) the chunks go through a two-deep
        register pipeline, as in :func:`_gateup_routed`."""
        NW: gl.constexpr = gl.num_warps()
        NPC: gl.constexpr = 8
        R1: gl.constexpr = 2 * BI
        HK: gl.constexpr = H // KP
        NS: gl.constexpr = HK // 128
        # FP8 takes twice E2M1's bytes per column: the program's columns go in chunks of NC super-blocks (half of
        # them when it can), so this slot holds no more weight registers than a routed slot, whose register count
        # the whole kernel gets
        NC: gl.constexpr = WD8.shape[1]
        r8 = gl.arange(0, R1, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WD8))))
        row8 = gl.where(r8 < BI, j * BI + r8, I + j * BI + (r8 - BI))               # row of [gate; up]
        NCH: gl.constexpr = NS // NC
        acc = gl.zeros([R1, NPC], gl.float32, MMA)
        if PDL_IN == 2:     # read-only weights: may precede the wait
            wv, sv = _fp8_tile(sw13_ptr, ss13_ptr, row8, p * NS, H, WD8)
        _pdl_in(PDL_IN, True, NW)       # (a launch_dependents trigger with no PDL dependent does nothing)
        if KC == 1:
            if XS:
                if PDL_IN != 2:
                    wv, sv = _fp8_tile(sw13_ptr, ss13_ptr, row8, p * NS, H, WD8)
                x_s = _stage_b(x_ptr + p * HK, H, M, NS, NW, 0)
            for c in gl.static_range(NCH):
                if (PDL_IN != 2 and not XS) or c > 0:
                    wv, sv = _fp8_tile(sw13_ptr, ss13_ptr, row8, p * NS + c * NC, H, WD8)
                if XS:
                    b = x_s.slice(c * (NC * 128), NC * 128, 0).load(DB)
                else:
                    b = _load_b(x_ptr + p * HK + c * (NC * 128), H, M, NC, NW, DB)
                acc = mma_v2(_frag_fp8(wv, sv, DA), b, acc)
        else:
            # two chunks in flight while one is multiplied
            if PDL_IN != 2:
                wv, sv = _fp8_tile(sw13_ptr, ss13_ptr, row8, p * NS, H, WD8)
            b = _load_b(x_ptr + p * HK, H, M, NC, NW, DB)
            if NCH > 1:
                wv1, sv1 = _fp8_tile(sw13_ptr, ss13_ptr, row8, p * NS + NC, H, WD8)
                b1 = _load_b(x_ptr + p * HK + NC * 128, H, M, NC, NW, DB)
            for c in gl.static_range(NCH):
                if c + 2 < NCH:
                    wv2, sv2 = _fp8_tile(sw13_ptr, ss13_ptr, row8, p * NS + (c + 2) * NC, H, WD8)
                    b2 = _load_b(x_ptr + p * HK + (c + 2) * (NC * 128), H, M, NC, NW, DB)
                acc = mma_v2(_frag_fp8(wv, sv, DA), b, acc)
                if c + 1 < NCH:
                    wv, sv, b = wv1, sv1, b1
                if c + 2 < NCH:
                    wv1, sv1, b1 = wv2, sv2, b2
        mcol = gl.arange(0, NPC, layout=gl.SliceLayout(1, RL))
        wtok = gl.where(mcol < M, 1.0, 0.0)
        _gateup_epilogue(acc, wtok, act_ptr, part_ptr, cnt_ptr, s, j, p, slimit, I, M, BI, KP, HAS_LIMIT, NW, RK)

    @gluon.jit
    def _gateup_routed(x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, act_ptr, part_ptr, cnt_ptr, lut_ptr, limit,
                       s, j, p, H: gl.constexpr, I: gl.constexpr, TOPK: gl.constexpr, M: gl.constexpr,
                       SP: gl.constexpr, BI: gl.constexpr, KP: gl.constexpr, HAS_LIMIT: gl.constexpr,
                       WD: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr,
                       DB: gl.constexpr, RL: gl.constexpr, KC: gl.constexpr = 1, DQ: gl.constexpr = 0,
                       RK: gl.constexpr = 0, XS: gl.constexpr = 0):
        """Kernel A, routed slot ``s``: its expert's MXFP4 rows (unless an earlier slot owns the expert).

        ``KC == 1``: every weight byte of the program in one go. ``KC > 1``: the program's H slice in ``KC`` chunks
        (``WD`` is one chunk's layout) through a two-deep register pipeline: chunks ``c + 1`` and ``c + 2`` are in
        flight while chunk ``c`` is decoded and multiplied, so a program keeps loading for its whole life and one
        wave of long programs replaces several waves of short ones, each of which paid the ids -> weights ->
        partial -> ticket chain (docs/perf/moe-kernels-h200.md, fourteenth session, where the sweep measured it
        level with KC 1: the pipeline's registers cost resident programs). The chunks accumulate into one float32
        accumulator in the order c = 0..KC-1."""
        NW: gl.constexpr = gl.num_warps()
        NPC: gl.constexpr = 8
        S: gl.constexpr = M * TOPK
        R1: gl.constexpr = 2 * BI
        HK: gl.constexpr = H // KP
        NS: gl.constexpr = HK // (128 * KC)         # super-blocks per chunk
        CW: gl.constexpr = NS * 128                 # columns per chunk
        SD: gl.constexpr = gl.SliceLayout(3, WD)
        ids, e, owner = _slot_expert(ids_ptr, s, S, SP, RL)
        if owner:
            # ---- a 16-byte vector per (row, super-block, lane), all of a chunk's loads issued at once ----
            r = gl.arange(0, R1, layout=gl.SliceLayout(1, gl.SliceLayout(2, SD)))
            row = gl.where(r < BI, j * BI + r, I + j * BI + (r - BI))
            wp = w13_ptr + e * (2 * I * (H // 8))
            sp = s13_ptr + e * (2 * I * (H // 32))
            c0 = p * (HK // 128)
            wv, sv = mxfp4_tile(wp, sp, row, c0, H, WD)
            if XS:
                x_s = _stage_b(x_ptr + p * HK, H, M, HK // 128, NW, DQ)
            else:
                b = _load_b(x_ptr + p * HK, H, M, NS, NW, DB, DQ=DQ)
            if KC > 1:
                wv1, sv1 = mxfp4_tile(wp, sp, row, c0 + NS, H, WD)
                if not XS:
                    b1 = _load_b(x_ptr + p * HK + CW, H, M, NS, NW, DB, DQ=DQ)
            wtok = _token_weights(ids, e, tw_ptr, S, SP, TOPK, RL)
            l0 = gl.load(lut_ptr)
            l1 = gl.load(lut_ptr + 1)
            l2 = gl.load(lut_ptr + 2)
            l3 = gl.load(lut_ptr + 3)
            l4 = gl.load(lut_ptr + 4)
            acc = gl.zeros([R1, NPC], gl.float32, MMA)
            for c in gl.static_range(KC):
                if c + 2 < KC:
                    wv2, sv2 = mxfp4_tile(wp, sp, row, c0 + (c + 2) * NS, H, WD)
                    if not XS:
                        b2 = _load_b(x_ptr + p * HK + (c + 2) * CW, H, M, NS, NW, DB, DQ=DQ)
                if XS:
                    b = x_s.slice(c * CW, CW, 0).load(DB)
                acc = mma_v2(frag_dequant(wv, sv, l0, l1, l2, l3, l4, DA, DQ), b, acc)
                if c + 1 < KC:
                    wv, sv = wv1, sv1
                    if not XS:
                        b = b1
                if c + 2 < KC:
                    wv1, sv1 = wv2, sv2
                    if not XS:
                        b1 = b2
            _gateup_epilogue(acc, wtok, act_ptr, part_ptr, cnt_ptr, s, j, p, limit, I, M, BI, KP, HAS_LIMIT, NW, RK)

    @gluon.jit
    def _gateup_epilogue(acc, wtok, act_ptr, part_ptr, cnt_ptr, s, j, p, limit, I: gl.constexpr,
                         M: gl.constexpr, BI: gl.constexpr, KP: gl.constexpr, HAS_LIMIT: gl.constexpr,
                         NW: gl.constexpr, RK: gl.constexpr = 0):
        """Kernel A's end for slot ``s``: with ``KP == 1`` SwiGLU and the store of ``act[s]``; else the partial
        ``acc`` (float32 ``[2*BI, 8]``, gate rows then up rows) into its own slot, and the last of the ``KP``
        programs (acq_rel ticket) sums the partials in the order ``p = 0..KP-1`` and applies SwiGLU. With ``RK``
        (config key) the program ends after its partial's store: :func:`_moe_reduce_swiglu`, launched between the two
        kernels, sums them and applies SwiGLU (no fence, ticket or last-program tail in kernel A)."""
        NPC: gl.constexpr = 8
        R1: gl.constexpr = 2 * BI
        NJ: gl.constexpr = I // BI
        MV: gl.constexpr = 1 if M == 1 else 4
        EL: gl.constexpr = gl.BlockedLayout([1, NPC], [32, 1], [NW, 1], [1, 0])
        HSL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        gc = gl.arange(0, NPC, layout=gl.SliceLayout(0, EL))
        if KP == 1:
            h_s = gl.allocate_shared_memory(gl.float32, [R1, NPC], HSL)
            h_s.store(acc)
            _swiglu_store(h_s.slice(0, BI, 0).load(EL), h_s.slice(BI, BI, 0).load(EL), wtok, act_ptr, s, j,
                          limit, I, M, BI, HAS_LIMIT, EL)
        else:
            # partial [R1, MV] -> own slot; the last of the KP programs sums them in order p = 0..KP-1
            base = part_ptr + (s * NJ + j) * (KP * R1 * MV)
            pr = gl.arange(0, R1, layout=gl.SliceLayout(1, EL))
            pm = (gl.zeros([R1, NPC], gl.int32, EL) + gc[None, :]) < MV
            gl.store(base + p * (R1 * MV) + pr[:, None] * MV + gc[None, :], gl.convert_layout(acc, EL), mask=pm)
            if RK == 0:
                _fence_all(NW)
                ticket = gl.atomic_add(cnt_ptr + s * NJ + j, 1, sem="acq_rel", scope="gpu")
                if ticket == KP - 1:
                    _sum_partials_swiglu(base, wtok, act_ptr, s, j, limit, I, M, BI, KP, HAS_LIMIT, EL)
                    gl.store(cnt_ptr + s * NJ + j, 0)

    @gluon.jit
    def _sum_partials_swiglu(base, wtok, act_ptr, s, j, limit, I: gl.constexpr, M: gl.constexpr, BI: gl.constexpr,
                             KP: gl.constexpr, HAS_LIMIT: gl.constexpr, EL: gl.constexpr):
        """Kernel A's ``KP`` partials of slot ``s``, row block ``j`` (float32 ``[KP, 2*BI, MV]`` from ``base``, gate rows
        then up rows) summed in the order ``p = 0..KP-1``, then SwiGLU and the store of ``act`` (:func:`_swiglu_store`).
        The one code for kernel A's last program and for :func:`_moe_reduce_swiglu` (config ``RK``): the same sums in
        the same order, so the same bits."""
        NPC: gl.constexpr = 8
        R1: gl.constexpr = 2 * BI
        MV: gl.constexpr = 1 if M == 1 else 4
        gr = gl.arange(0, BI, layout=gl.SliceLayout(1, EL))
        gc = gl.arange(0, NPC, layout=gl.SliceLayout(0, EL))
        gm = (gl.zeros([BI, NPC], gl.int32, EL) + gc[None, :]) < MV
        g = gl.zeros([BI, NPC], gl.float32, EL)
        u = gl.zeros([BI, NPC], gl.float32, EL)
        for pp in gl.static_range(KP):
            # .cg: the partials come from L2, never from a line this SM's L1 kept from an earlier layer's call
            g += gl.load(base + pp * (R1 * MV) + gr[:, None] * MV + gc[None, :], mask=gm, other=0.0,
                         cache_modifier=".cg")
            u += gl.load(base + pp * (R1 * MV) + (BI + gr[:, None]) * MV + gc[None, :], mask=gm, other=0.0,
                         cache_modifier=".cg")
        _swiglu_store(g, u, wtok, act_ptr, s, j, limit, I, M, BI, HAS_LIMIT, EL)

    @gluon.jit
    def _swiglu_store(g, u, wtok, act_ptr, s, j, limit, I: gl.constexpr, M: gl.constexpr, BI: gl.constexpr,
                      HAS_LIMIT: gl.constexpr, EL: gl.constexpr):
        """``act[s, m, j*BI + i] = w_tok[m] * silu(g[i, m]) * u[i, m]`` (clamped as the checkpoint's
        ``swiglu_limit`` asks) in BF16, for tokens ``m < M``; ``g``, ``u`` float32 ``[BI, 8]``."""
        v = _swiglu(g, u, gl.convert_layout(wtok, gl.SliceLayout(0, EL))[None, :], limit, HAS_LIMIT)
        gr = gl.arange(0, BI, layout=gl.SliceLayout(1, EL))
        gc = gl.arange(0, 8, layout=gl.SliceLayout(0, EL))
        gl.store(act_ptr + (s * M + gc[None, :]) * I + j * BI + gr[:, None], v,
                 mask=(gl.zeros([BI, 8], gl.int32, EL) + gc[None, :]) < M)

    @gluon.jit
    def _b_from_partials(pa_ptr, slot, kq, wtok, limit, I: gl.constexpr, M: gl.constexpr, NS: gl.constexpr,
                         BIA: gl.constexpr, KPA: gl.constexpr, HAS_LIMIT: gl.constexpr, NW: gl.constexpr,
                         DB: gl.constexpr, ok=True, DQ: gl.constexpr = 0):
        """Config ``RB``: kernel B's B operand for slot ``slot``, I slice ``kq`` (``[128*NS, 8]`` BF16 in the mma layout
        ``DB``, the logical k order of :func:`_load_b`) formed from kernel A's ``KPA`` float32 partials instead of read
        from ``act``: for each act column the gate and up partials summed in the order ``p = 0..KPA-1``, then SwiGLU
        and the token's routing weight ``wtok`` (float32 ``[8]``, layout ``SliceLayout(1, RL)``), rounded to BF16:
        :func:`_sum_partials_swiglu`'s sums and :func:`_swiglu_store`'s arithmetic in the same order, so the operand
        holds ``act``'s bits. Column ``kappa`` of the logical order holds physical column ``phys(kappa)``
        (:func:`_b_logical`); tokens ``n >= M``, and everything when the scalar ``ok`` is false, are 0 (not loaded).
        Each thread forms whole rows (8 tokens), then one layout conversion (through shared memory) gives ``DB``."""
        MV: gl.constexpr = 1 if M == 1 else 4
        R1: gl.constexpr = 2 * BIA
        NJ: gl.constexpr = I // BIA
        IK: gl.constexpr = NS * 128
        PL: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NW, 1], [1, 0])
        kap = gl.arange(0, IK, layout=gl.SliceLayout(1, PL))
        n = gl.arange(0, 8, layout=gl.SliceLayout(0, PL))
        r = kap % 128
        tau = r // 32
        pp_ = (r // 16) % 2
        hh = (r // 8) % 2
        t = (r // 2) % 4
        jj = r % 2
        if DQ == 1:
            c = 8 * tau + 4 * jj + 2 * pp_ + hh
        else:
            c = 8 * tau + 4 * pp_ + 2 * hh + jj
        col = kq * IK + (kap // 128) * 128 + 32 * t + c           # the act column (within I) of row kappa
        off = (slot * NJ + col // BIA) * (KPA * R1 * MV) + (col % BIA) * MV
        ptr = pa_ptr + off[:, None] + n[None, :]
        msk = (n[None, :] < M) & (kap[:, None] >= 0) & ok
        g = gl.zeros([IK, 8], gl.float32, PL)
        u = gl.zeros([IK, 8], gl.float32, PL)
        for q in gl.static_range(KPA):
            # .cg: the partials come from L2, never from a line this SM's L1 kept from an earlier layer's call
            g += gl.load(ptr + q * (R1 * MV), mask=msk, other=0.0, cache_modifier=".cg")
            u += gl.load(ptr + q * (R1 * MV) + BIA * MV, mask=msk, other=0.0, cache_modifier=".cg")
        v = _swiglu(g, u, gl.convert_layout(wtok, gl.SliceLayout(0, PL))[None, :], limit, HAS_LIMIT)
        return gl.convert_layout(v, DB)

    @gluon.jit
    def _swiglu(g, u, wt, limit, HAS_LIMIT: gl.constexpr):
        """``wt * silu(g) * u`` rounded to BF16 (``g``, ``u`` float32, ``wt`` the routing weights broadcast against
        them), with ``silu(g)`` clamped above and ``u`` to ``[-limit, limit]`` under ``HAS_LIMIT``: the one arithmetic
        of ``act``, in kernel A's epilogue, the ``RK`` launch (:func:`_swiglu_store`) and kernel B's ``RB`` operand
        (:func:`_b_from_partials`), so the three give the same bits."""
        a = g / (1.0 + gl.exp(-g))
        if HAS_LIMIT:
            a = gl.minimum(a, limit)
            u = gl.minimum(gl.maximum(u, -limit), limit)
        return (a * u * wt).to(gl.bfloat16)

    @gluon.jit
    def _moe_reduce_swiglu(ids_ptr, tw_ptr, act_ptr, part_ptr, limit, slimit, I: gl.constexpr, TOPK: gl.constexpr,
                           M: gl.constexpr, SP: gl.constexpr, BI: gl.constexpr, KP: gl.constexpr,
                           HAS_LIMIT: gl.constexpr, SHARED: gl.constexpr, PDL: gl.constexpr):
        """Config ``RK``: program ``(j, s)`` sums kernel A's ``KP`` partials of slot ``s``, row block ``j`` in the order
        ``p = 0..KP-1`` (the same sums, in the same order, as kernel A's last program would) and stores
        ``act[s, :, j*BI:(j+1)*BI]`` with SwiGLU and the token's routing weight (1 for the shared slot ``s == M*TOPK``);
        a slot whose expert an earlier slot owns has no partials and is skipped (kernel B skips it too). A PDL
        dependent of kernel A: it lets kernel B launch, then waits for A."""
        NW: gl.constexpr = gl.num_warps()
        NPC: gl.constexpr = 8
        S: gl.constexpr = M * TOPK
        R1: gl.constexpr = 2 * BI
        NJ: gl.constexpr = I // BI
        MV: gl.constexpr = 1 if M == 1 else 4
        EL: gl.constexpr = gl.BlockedLayout([1, NPC], [32, 1], [NW, 1], [1, 0])
        RL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NW], [1, 0])
        j = gl.program_id(0)
        s = gl.program_id(1)
        if PDL:
            _gdc("griddepcontrol.launch_dependents; mov.u32 $0, 0;", NW)
            _gdc("griddepcontrol.wait; mov.u32 $0, 0;", NW)
        mcol = gl.arange(0, NPC, layout=gl.SliceLayout(1, RL))
        if SHARED and s == S:
            owner = s == S
            wtok = gl.where(mcol < M, 1.0, 0.0)
            lim = slimit
        else:
            ids, e, owner = _slot_expert(ids_ptr, s, S, SP, RL)
            wtok = _token_weights(ids, e, tw_ptr, S, SP, TOPK, RL)
            lim = limit
        if owner:
            _sum_partials_swiglu(part_ptr + (s * NJ + j) * (KP * R1 * MV), wtok, act_ptr, s, j, lim, I, M, BI, KP,
                                 HAS_LIMIT, EL)

    @gluon.jit
    def _moe_down_split(act_ptr, ids_ptr, w2_ptr, s2_ptr, out_ptr, part_ptr, cnt_ptr, lut_ptr, sw2_ptr, ss2_ptr,
                        tw_ptr, pa_ptr, limit, slimit,
                        H: gl.constexpr, I: gl.constexpr, M: gl.constexpr, S: gl.constexpr, SP: gl.constexpr,
                        BH: gl.constexpr, KP2: gl.constexpr, WD: gl.constexpr, PDL: gl.constexpr,
                        SHARED: gl.constexpr = False, WD8: gl.constexpr = None, SG: gl.constexpr = 1,
                        DQ: gl.constexpr = 0, RB: gl.constexpr = 0, BIA: gl.constexpr = 1, KPA: gl.constexpr = 1,
                        HAS_LIMIT: gl.constexpr = False):
        # RB (config key): the activations come from kernel A's partials (pa_ptr; :func:`_b_from_partials`), summed
        # and put through SwiGLU here with the routing weights (tw_ptr) and clamps (limit, slimit), not from act_ptr
        NW: gl.constexpr = gl.num_warps()
        NPC: gl.constexpr = 8
        GR: gl.constexpr = (S + SG - 1) // SG   # groups of SG routed slots (SG 1: one slot per program)
        ST: gl.constexpr = GR + SHARED      # slot groups: routed, then the shared expert's own
        NSLOT: gl.constexpr = ST * KP2
        MV: gl.constexpr = 1 if M == 1 else 4
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        RL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NW], [1, 0])
        OL: gl.constexpr = gl.BlockedLayout([1, NPC], [32, 1], [NW, 1], [1, 0])

        hb = gl.program_id(0)
        s = gl.program_id(1)
        kq = gl.program_id(2)
        orow = gl.arange(0, BH, layout=gl.SliceLayout(1, OL))
        ocol = gl.arange(0, NPC, layout=gl.SliceLayout(0, OL))
        omask = (gl.zeros([BH, NPC], gl.int32, OL) + ocol[None, :]) < MV
        slot = part_ptr + ((hb * ST + s) * KP2 + kq) * (BH * MV) + orow[:, None] * MV + ocol[None, :]

        if SHARED:
            if s == GR:
                _down_shared(act_ptr, sw2_ptr, ss2_ptr, slot, omask, S, hb, kq, H, I, M, BH, KP2, WD8, PDL, MMA, DA,
                             DB, OL, pa_ptr, slimit, RB, BIA, KPA, HAS_LIMIT, RL)
            elif SG == 1:
                _down_routed(act_ptr, ids_ptr, w2_ptr, s2_ptr, lut_ptr, slot, omask, s, hb, kq, H, I, M, S,
                             SP, BH, KP2, WD, PDL, MMA, DA, DB, RL, OL, DQ, tw_ptr, pa_ptr, limit, RB, BIA, KPA,
                             HAS_LIMIT)
            else:
                _down_routed_group(act_ptr, ids_ptr, w2_ptr, s2_ptr, lut_ptr, slot, omask, s, hb, kq, H, I, M, S,
                                   SP, BH, KP2, SG, WD, PDL, MMA, DA, DB, RL, OL, DQ, tw_ptr, pa_ptr, limit, RB, BIA,
                                   KPA, HAS_LIMIT)
        elif SG == 1:
            _down_routed(act_ptr, ids_ptr, w2_ptr, s2_ptr, lut_ptr, slot, omask, s, hb, kq, H, I, M, S,
                         SP, BH, KP2, WD, PDL, MMA, DA, DB, RL, OL, DQ, tw_ptr, pa_ptr, limit, RB, BIA, KPA, HAS_LIMIT)
        else:
            _down_routed_group(act_ptr, ids_ptr, w2_ptr, s2_ptr, lut_ptr, slot, omask, s, hb, kq, H, I, M, S,
                               SP, BH, KP2, SG, WD, PDL, MMA, DA, DB, RL, OL, DQ, tw_ptr, pa_ptr, limit, RB, BIA, KPA,
                               HAS_LIMIT)

        _fence_all(NW)
        ticket = gl.atomic_add(cnt_ptr + hb, 1, sem="acq_rel", scope="gpu")
        if ticket == NSLOT - 1:
            # sum the ST*KP2 slots in order (slot group, then q), 8 at a time (in-thread along the slot axis)
            L3: gl.constexpr = gl.BlockedLayout([8, 1, MV], [1, 32, 1], [1, NW, 1], [2, 1, 0])
            s8 = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
            h3 = gl.arange(0, BH, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
            n3 = gl.arange(0, MV, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
            tot = gl.zeros([BH, MV], gl.float32, gl.SliceLayout(0, L3))
            for s0 in gl.static_range(0, NSLOT, 8):
                ss = s0 + s8
                ptr = part_ptr + (hb * NSLOT + ss[:, None, None]) * (BH * MV) + h3[None, :, None] * MV + n3[None, None, :]
                v = gl.load(ptr, mask=(ss[:, None, None] < NSLOT) & (h3[None, :, None] >= 0) & (n3[None, None, :] >= 0),
                            other=0.0, cache_modifier=".cg")
                tot += gl.sum(v, axis=0)
            h2 = gl.arange(0, BH, layout=gl.SliceLayout(1, gl.SliceLayout(0, L3)))
            n2 = gl.arange(0, MV, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3)))
            gl.store(out_ptr + n2[None, :] * H + hb * BH + h2[:, None], tot.to(gl.bfloat16),
                     mask=(n2[None, :] < M) & (h2[:, None] >= 0))
            gl.store(cnt_ptr + hb, 0)

    @gluon.jit
    def _down_shared(act_ptr, sw2_ptr, ss2_ptr, slot, omask, s, hb, kq, H: gl.constexpr, I: gl.constexpr,
                     M: gl.constexpr, BH: gl.constexpr, KP2: gl.constexpr, WD8: gl.constexpr, PDL: gl.constexpr,
                     MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr, OL: gl.constexpr, pa_ptr=None,
                     slimit=None, RB: gl.constexpr = 0, BIA: gl.constexpr = 1, KPA: gl.constexpr = 1,
                     HAS_LIMIT: gl.constexpr = False, RL: gl.constexpr = None):
        """Kernel B, the shared expert's slot: FP8 E4M3 ``W2s [H, I]`` rows of block ``hb``, I slice ``kq``, times
        ``act[s]`` (with ``RB``: formed from kernel A's partials, routing weight 1), into this program's partial
        slot."""
        NW: gl.constexpr = gl.num_warps()
        NPC: gl.constexpr = 8
        IK: gl.constexpr = I // KP2
        NS: gl.constexpr = IK // 128
        h8 = gl.arange(0, BH, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WD8))))
        wv, sv = _fp8_tile(sw2_ptr, ss2_ptr, hb * BH + h8, kq * NS, I, WD8)
        frag = _frag_fp8(wv, sv, DA)
        if PDL:
            _gdc("griddepcontrol.wait; mov.u32 $0, 0;", NW)
        if RB:
            mcol = gl.arange(0, NPC, layout=gl.SliceLayout(1, RL))
            b = _b_from_partials(pa_ptr, s, kq, gl.where(mcol < M, 1.0, 0.0), slimit, I, M, NS, BIA, KPA, HAS_LIMIT,
                                 NW, DB)
        else:
            b = _load_b(act_ptr + s * M * I + kq * IK, I, M, NS, NW, DB)
        acc = mma_v2(frag, b, gl.zeros([BH, NPC], gl.float32, MMA))
        gl.store(slot, gl.convert_layout(acc, OL), mask=omask)

    @gluon.jit
    def _down_routed(act_ptr, ids_ptr, w2_ptr, s2_ptr, lut_ptr, slot, omask, s, hb, kq, H: gl.constexpr,
                     I: gl.constexpr, M: gl.constexpr, S: gl.constexpr, SP: gl.constexpr, BH: gl.constexpr,
                     KP2: gl.constexpr, WD: gl.constexpr, PDL: gl.constexpr,
                     MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr, RL: gl.constexpr, OL: gl.constexpr,
                     DQ: gl.constexpr = 0, tw_ptr=None, pa_ptr=None, limit=None, RB: gl.constexpr = 0,
                     BIA: gl.constexpr = 1, KPA: gl.constexpr = 1, HAS_LIMIT: gl.constexpr = False):
        """Kernel B, routed slot ``s``: its expert's MXFP4 ``W2`` rows into the partial slot, or a zero partial
        when an earlier slot owns the expert. With ``RB`` the activations are formed from kernel A's partials
        (:func:`_b_from_partials`) with the weight each token gave the expert."""
        NW: gl.constexpr = gl.num_warps()
        NPC: gl.constexpr = 8
        IK: gl.constexpr = I // KP2
        NS: gl.constexpr = IK // 128
        SD: gl.constexpr = gl.SliceLayout(3, WD)
        # ids are the router's, complete before any A program triggered this launch (module docstring, "The PDL
        # invariant B relies on"): safe to read before the dependency wait
        ids, e, owner = _slot_expert(ids_ptr, s, S, SP, RL)
        if owner:
            # ---- weights in and decoded while kernel A still runs ----
            h = gl.arange(0, BH, layout=gl.SliceLayout(1, gl.SliceLayout(2, SD)))
            wv, sv = mxfp4_tile(w2_ptr + e * (H * (I // 8)), s2_ptr + e * (H * (I // 32)), hb * BH + h, kq * NS,
                                 I, WD)
            frag = frag_dequant(wv, sv, gl.load(lut_ptr), gl.load(lut_ptr + 1), gl.load(lut_ptr + 2),
                                 gl.load(lut_ptr + 3), gl.load(lut_ptr + 4), DA, DQ)
            if PDL:
                _gdc("griddepcontrol.wait; mov.u32 $0, 0;", NW)
            if RB:
                b = _b_from_partials(pa_ptr, s, kq, _token_weights(ids, e, tw_ptr, S, SP, S // M, RL), limit, I, M,
                                     NS, BIA, KPA, HAS_LIMIT, NW, DB, DQ=DQ)
            else:
                b = _load_b(act_ptr + s * M * I + kq * IK, I, M, NS, NW, DB, DQ=DQ)
            acc = mma_v2(frag, b, gl.zeros([BH, NPC], gl.float32, MMA))
            gl.store(slot, gl.convert_layout(acc, OL), mask=omask)
        else:       # a duplicate slot: its expert's share is in the owner's partial
            gl.store(slot, gl.zeros([BH, NPC], gl.float32, OL), mask=omask)


if gluon is not None:
    @gluon.jit
    def _down_routed_group(act_ptr, ids_ptr, w2_ptr, s2_ptr, lut_ptr, slot, omask, g, hb, kq, H: gl.constexpr,
                           I: gl.constexpr, M: gl.constexpr, S: gl.constexpr, SP: gl.constexpr, BH: gl.constexpr,
                           KP2: gl.constexpr, SG: gl.constexpr, WD: gl.constexpr, PDL: gl.constexpr,
                           MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr, RL: gl.constexpr,
                           OL: gl.constexpr, DQ: gl.constexpr = 0, tw_ptr=None, pa_ptr=None, limit=None,
                           RB: gl.constexpr = 0, BIA: gl.constexpr = 1, KPA: gl.constexpr = 1,
                           HAS_LIMIT: gl.constexpr = False):
        """Kernel B, routed slots ``g*SG .. g*SG + SG - 1`` (``SG > 1``): their experts' ``W2`` rows of block
        ``hb``, I slice ``kq``, summed in slot order into one float32 accumulator and one partial slot, so the
        last program of the row block sums ``SG`` times fewer partials. A slot past ``S``, or whose expert an
        earlier slot owns, loads nothing (masked loads give zero weights and a zero B operand: no branch in the
        pipeline). Slots ``i + 1`` and ``i + 2`` are in flight while slot ``i`` is multiplied; the first two
        slots' weights are loaded before the PDL wait (they do not depend on kernel A), the activations after."""
        NW: gl.constexpr = gl.num_warps()
        NPC: gl.constexpr = 8
        IK: gl.constexpr = I // KP2
        NS: gl.constexpr = IK // 128
        SD: gl.constexpr = gl.SliceLayout(3, WD)
        # ids are the router's, complete before any A program triggered this launch (module docstring, "The PDL
        # invariant B relies on"): safe to read before the dependency wait
        t = gl.arange(0, SP, layout=gl.SliceLayout(0, RL))
        ids = gl.load(ids_ptr + t, mask=t < S, other=-1)
        h = gl.arange(0, BH, layout=gl.SliceLayout(1, gl.SliceLayout(2, SD)))
        rows = hb * BH + h
        s0 = g * SG
        e0, ok0 = _group_slot(ids, t, s0, S)
        wv, sv = mxfp4_tile_if(w2_ptr + e0 * (H * (I // 8)), s2_ptr + e0 * (H * (I // 32)), rows, kq * NS, I, WD,
                               ok0)
        e1, ok1 = _group_slot(ids, t, s0 + 1, S)
        wv1, sv1 = mxfp4_tile_if(w2_ptr + e1 * (H * (I // 8)), s2_ptr + e1 * (H * (I // 32)), rows, kq * NS, I, WD,
                                 ok1)
        l0 = gl.load(lut_ptr)
        l1 = gl.load(lut_ptr + 1)
        l2 = gl.load(lut_ptr + 2)
        l3 = gl.load(lut_ptr + 3)
        l4 = gl.load(lut_ptr + 4)
        if PDL:
            _gdc("griddepcontrol.wait; mov.u32 $0, 0;", NW)
        if RB:
            b = _b_from_partials(pa_ptr, s0, kq, _token_weights(ids, e0, tw_ptr, S, SP, S // M, RL), limit, I, M, NS,
                                 BIA, KPA, HAS_LIMIT, NW, DB, ok0, DQ)
        else:
            b = _load_b(act_ptr + s0 * M * I + kq * IK, I, M, NS, NW, DB, ok0, DQ)
        acc = gl.zeros([BH, NPC], gl.float32, MMA)
        for i in gl.static_range(SG):
            if i + 2 < SG:
                e2, ok2 = _group_slot(ids, t, s0 + i + 2, S)
                wv2, sv2 = mxfp4_tile_if(w2_ptr + e2 * (H * (I // 8)), s2_ptr + e2 * (H * (I // 32)), rows, kq * NS,
                                         I, WD, ok2)
            if i + 1 < SG:
                if RB:
                    b1 = _b_from_partials(pa_ptr, s0 + i + 1, kq, _token_weights(ids, e1, tw_ptr, S, SP, S // M, RL),
                                          limit, I, M, NS, BIA, KPA, HAS_LIMIT, NW, DB, ok1, DQ)
                else:
                    b1 = _load_b(act_ptr + (s0 + i + 1) * M * I + kq * IK, I, M, NS, NW, DB, ok1, DQ)
            acc = mma_v2(frag_dequant(wv, sv, l0, l1, l2, l3, l4, DA, DQ), b, acc)
            if i + 1 < SG:
                wv, sv, b = wv1, sv1, b1
            if i + 2 < SG:
                wv1, sv1, ok1, e1 = wv2, sv2, ok2, e2
        gl.store(slot, gl.convert_layout(acc, OL), mask=omask)

    @gluon.jit
    def _group_slot(ids, t, s, S: gl.constexpr):
        """Routed slot ``s`` in kernel B's slot loop: ``(e, ok)``, its expert (0 when there is none, so the masked
        addresses stay in the buffer) and whether it does the work: ``s < S`` and no earlier slot chose ``e``."""
        e = gl.sum(gl.where(t == s, ids, 0), axis=0)
        ok = (s < S) & (gl.sum(gl.where((ids == e) & (t < s), 1, 0), axis=0) == 0)
        return gl.where(ok, e, 0), ok


@functools.lru_cache(maxsize=None)
def word_layout(rows: int, ns: int, num_warps: int, words: int = 4):
    """The register layout of the weight words for :func:`frag_dequant` (E2M1, ``words`` 4) and :func:`_frag_fp8`
    (FP8, ``words`` 8): tensor ``[rows, ns, 4, words]`` (row, 128-column super-block, lane column group t, int32
    word). Lane ``4g + t`` of warp ``w`` holds rows ``16w + g`` and ``16w + g + 8`` (+ ``16 * num_warps`` per
    further row tile), all ``ns`` super-blocks and its ``words`` words as 16-byte vectors: exactly the
    mma.m16n8k16 A-fragment rows of that lane (FP8 takes twice E2M1's bytes for the same 32 columns). Needs
    ``rows`` a multiple of ``16 * num_warps`` (powers of two)."""
    reg = [[0, 0, 0, 1 << b] for b in range(words.bit_length() - 1)] + [[8, 0, 0, 0]]
    reg += [[0, 1 << b, 0, 0] for b in range(ns.bit_length() - 1)]
    r = 16 * num_warps
    while r < rows:
        reg.append([r, 0, 0, 0])
        r *= 2
    lane = [[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
    warp = [[16 << b, 0, 0, 0] for b in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [rows, ns, 4, words])


def fp8_word_layout(rows: int, ns: int, num_warps: int):
    """:func:`word_layout` for FP8 words (8 per lane, row and super-block)."""
    return word_layout(rows, ns, num_warps, 8)


def _slices(n: int, want: int, max_cols: int) -> int:
    """The number of slices of ``n`` columns nearest to ``want`` (ties: more slices) for which each slice is 128
    times a power of two (the fragment layout's super-blocks) and at most ``max_cols`` wide (registers), or 0."""
    ok = [d for d in range(1, n // 128 + 1) if n % d == 0 and (n // d) % 128 == 0 and n // d <= max_cols
          and ((n // d // 128) & (n // d // 128 - 1)) == 0]
    return min(ok, key=lambda d: (abs(d - want), -d)) if ok else 0


def fit_split_config(cfg: dict, h: int, i: int) -> dict:
    """Fit a ``split`` config to this model's H and I: KP x KC (kernel A's H slices x chunks per slice) and KP2 to
    the nearest valid slice counts (a kernel-A chunk at most 512 columns of H, kernel B at most 256 of I: they
    hold them in registers), KC to the largest divisor of that count not above the one asked for, SG (kernel
    B's slots per program) to at least 1, BI and BH to power-of-two divisors, and the warp counts to powers of
    two with each warp on its own mma row tile.

    Raises:
        BackendError: H or I cannot be cut into slices of 128 x 2^n columns (e.g. not a multiple of 128), or
            no power-of-two BI / BH divides I / H."""
    cfg = dict(SPLIT_DEFAULT, **cfg)
    kc_want = max(1, int(cfg.get("KC", 1)))
    chunks, kp2 = _slices(h, cfg["KP"] * kc_want, 512), _slices(i, cfg["KP2"], 256)
    if not (chunks and kp2):
        raise BackendError(f"moe[triton] variant 'split' needs H and I in slices of 128 x 2^n columns, got H={h}, "
                           f"I={i}; use variant 'gluon'")
    kc = max(d for d in range(1, min(kc_want, chunks) + 1) if chunks % d == 0)
    cfg["KP"], cfg["KC"], cfg["KP2"] = chunks // kc, kc, kp2
    cfg["SG"] = max(1, int(cfg.get("SG", 1)))
    if cfg.get("RK", 0) not in (0, 1):
        raise BackendError(f"moe[triton] variant 'split': RK (kernel A's partials summed by a launch of their own) "
                           f"must be 0 or 1, got {cfg.get('RK')!r}")
    if cfg.get("RB", 0) not in (0, 1):
        raise BackendError(f"moe[triton] variant 'split': RB (kernel A's partials summed by kernel B) must be 0 or 1, "
                           f"got {cfg.get('RB')!r}")
    if cfg.get("RB", 0) and (cfg.get("RK", 0) or cfg.get("TR", 0)):
        raise BackendError("moe[triton] variant 'split': RB (kernel B sums kernel A's partials) excludes RK and TR "
                           "(a launch of its own sums them)")
    if cfg.get("DQ") not in (0, 1):
        raise BackendError(f"moe[triton] variant 'split': DQ (the E2M1 decode) must be 0 (table) or 1 (shift), "
                           f"got {cfg.get('DQ')!r}")
    if cfg.get("TR", 0) not in (0, 1, 2):
        raise BackendError(f"moe[triton] variant 'split': TR (kernel A as a TMA ring; 2: warp-specialised) must be "
                           f"0, 1 or 2, got {cfg.get('TR')!r}")
    if cfg.get("TR", 0):
        # the ring's items are TR_NS super-blocks wide: kernel A's partition is KP = H / (128 TR_NS) slices of one
        # chunk each, summed by the RK launch (kernels.triton_moe_ring); an H of one item (KP 1) has no RK launch
        # to sum them, so such a model runs without the ring
        ns = int(cfg.get("TR_NS", 2))
        if ns < 1 or ns & (ns - 1):
            raise BackendError(f"moe[triton] variant 'split': TR_NS must be a power of two, got {ns}")
        cw = 128 * ns
        if h % cw:
            raise BackendError(f"moe[triton] variant 'split': TR needs H a multiple of {cw}, got H={h}")
        if h // cw < 2:
            cfg["TR"] = 0
        else:
            cfg["KP"], cfg["KC"], cfg["RK"] = h // cw, 1, 1
    if cfg.get("TR_XS", 1) not in (0, 1):
        raise BackendError(f"moe[triton] variant 'split': TR_XS (the ring's x staged in shared memory) must be 0 or "
                           f"1, got {cfg.get('TR_XS')!r}")
    nr = check_register_cap(cfg.get("NR"), "moe[triton] variant 'split': NR (kernel A's register cap per thread)")
    check_register_cap(cfg.get("NR2"), "moe[triton] variant 'split': NR2 (kernel B's register cap per thread)")
    if nr is not None and cfg.get("TR", 0):
        raise BackendError("moe[triton] variant 'split': NR caps the split kernel A's registers; with TR the ring "
                           "runs instead (its cap is TR_REGS, TR 2 only), so NR would be ignored (set \"NR\": null "
                           "beside TR to turn an entry's cap off)")
    if cfg.get("XS", 0) not in (0, 1):
        raise BackendError(f"moe[triton] variant 'split': XS (kernel A's x staged in shared memory) must be 0 or 1, "
                           f"got {cfg.get('XS')!r}")
    ns = h // cfg["KP"] // 128          # x is staged for the program's whole H slice: a power-of-two tensor
    if cfg.get("XS", 0) and ns & (ns - 1):
        cfg["XS"] = 0
    cfg["BI"] = fit_pow2(cfg["BI"], i, 8)
    cfg["BH"] = fit_pow2(cfg["BH"], h, 16)
    if not (cfg["BI"] and cfg["BH"]):
        raise BackendError(f"moe[triton]: no 'split' tiling of H={h}, I={i} for config {cfg}")
    cfg["num_warps"] = fit_pow2(min(cfg["num_warps"], 2 * cfg["BI"] // 16), 1 << 10, 1)
    cfg["down_warps"] = fit_pow2(min(cfg["down_warps"], cfg["BH"] // 16), 1 << 10, 1)
    return cfg


@dataclass
class SharedFP8:
    """A shared expert in the form the ``split`` kernels read: ``w13w int32 [2I, H/4]`` (FP8 E4M3 bytes of
    ``[gate; up]``), ``s13 int32 [2I/128, H/128]`` and ``s2 int32 [H/128, I/128]`` (BF16x2 factors ``scale x
    2^120``, both halves equal), ``w2w int32 [H, I/4]`` (``down``'s bytes, a view), ``limit`` (its SwiGLU clamp)."""
    w13w: torch.Tensor
    s13: torch.Tensor
    w2w: torch.Tensor
    s2: torch.Tensor
    limit: float | None


def _bf16x2_factor(scale: torch.Tensor, what: str) -> torch.Tensor:
    """float32 block scales -> int32 BF16x2 of ``scale x 2^120``; BackendError unless exact (see bind_shared)."""
    f = scale.float() * 2.0 ** 120
    b = f.to(torch.bfloat16)
    v = b.view(torch.int16).to(torch.int32) & 0xFFFF
    # a power of two: exact, positive, finite, a normal BF16 with a zero mantissa (scale <= 2^7)
    if not (torch.equal(b.float(), f) and (f > 0).all() and torch.isfinite(b).all() and ((v & 0x7F) == 0).all()
            and ((v >> 7) > 0).all()):
        raise BackendError(f"moe[triton] shared expert: {what} block scales are not powers of two of at most 2^7 "
                           "(scale_fmt ue8m0); it stays a separate dense MLP")
    return (v | (v << 16)).contiguous()


def shared_fp8(mlp, h: int, i: int) -> SharedFP8:
    """Build :class:`SharedFP8` from a ``layers.moe.DenseMLP`` (see ``MoEKernel.bind_shared``).

    Raises:
        BackendError: not FP8 with 128x128 blocks, the intermediate size is not ``i`` (the routed experts'), or the
            scales are not exact powers of two."""
    g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    for lin in (g, u, d):
        if lin.fmt != "fp8" or tuple(lin.block) != (128, 128):
            raise BackendError(f"moe[triton] shared expert: needs FP8 128x128-block projections, got fmt={lin.fmt!r} "
                               f"block={tuple(lin.block)}")
    if g.out_features != i or d.in_features != i or g.in_features != h or d.out_features != h:
        raise BackendError(f"moe[triton] shared expert: intermediate {g.out_features} x hidden {g.in_features} does "
                           f"not match the routed experts' {i} x {h} (the kernels share one tiling)")
    if h % 128 or i % 128:
        raise BackendError(f"moe[triton] shared expert: H={h} and I={i} must be multiples of 128")
    w13 = torch.cat([g.weight.data.view(torch.uint8), u.weight.data.view(torch.uint8)]).contiguous()
    s13 = _bf16x2_factor(torch.cat([g.weight_scale_inv.data, u.weight_scale_inv.data]), "gate/up")
    return SharedFP8(w13w=w13.view(torch.int32), s13=s13,
                     w2w=d.weight.data.contiguous().view(torch.uint8).view(torch.int32),
                     s2=_bf16x2_factor(d.weight_scale_inv.data, "down"), limit=mlp.limit)


def table_decode_forced() -> bool:
    """True when ``BYTEBOUND_MOE_DQ=0``: the ``split`` kernels decode E2M1 through the PRMT tables (``DQ`` 0) whatever
    the config says. An A/B switch (``scripts/profile_decode.py --ab BYTEBOUND_MOE_DQ=0``), read at each launch, so
    a graph captured after setting it runs the table decode."""
    return os.environ.get("BYTEBOUND_MOE_DQ", "1") == "0"


def launch_dq(kern, cfg: dict) -> tuple[int, str]:
    """The E2M1 decode a launch of ``kern`` (a ``MoEKernel``) with the fitted ``cfg`` runs, and why: ``(1, "")``
    when the config asks for the shift decode and the binding's scales allow it, else ``(0, reason)`` (``""`` when
    the config asked for the table)."""
    if int(cfg.get("DQ", 0)) != 1:
        return 0, ""
    if table_decode_forced():
        return 0, "BYTEBOUND_MOE_DQ=0"
    if not kern.shift_decode:
        return 0, f"an E8M0 scale byte {kern.scale_max} > {SHIFT_DECODE_MAX_E8M0}"
    return 1, ""


def split_constexprs(m: int, k: int, h: int, i: int, cfg: dict, shared: bool, has_limit: bool, pdl: bool,
                     pdl_in: int, dq: int | None = None) -> tuple[dict, dict]:
    """The compile-time arguments of kernel A (``_moe_gateup_split``) and kernel B (``_moe_down_split``) for ``m``
    tokens of top ``k`` at hidden ``h`` and intermediate ``i`` under a fitted ``cfg`` (:func:`fit_split_config`):
    the one derivation :func:`launch_split` launches with and ``scripts/split_ptxas.py`` compiles offline, so the
    two cannot drift. ``shared``: the shared expert is one more slot; ``has_limit``: a SwiGLU clamp in the launch;
    ``pdl`` / ``pdl_in``: as the config's ``pdl`` / ``pdl_in`` on an sm_90 device (0 / False elsewhere); ``dq``: the
    E2M1 decode of both kernels' routed slots (:func:`frag_dequant`; default the config's ``DQ``, which
    :func:`launch_split` lowers to 0 for scales the shift decode cannot take)."""
    dq = int(cfg.get("DQ", 0)) if dq is None else int(dq)
    s = m * k
    sp = max(32, 1 << (s - 1).bit_length())
    bi, kp, bh, kp2 = cfg["BI"], cfg["KP"], cfg["BH"], cfg["KP2"]
    kc = int(cfg.get("KC", 1))
    nw, dw = cfg["num_warps"], cfg["down_warps"]
    rb = int(cfg.get("RB", 0)) if kp > 1 else 0     # (KP 1: kernel A applies SwiGLU itself, there are no partials)
    a = dict(H=h, I=i, TOPK=k, M=m, SP=sp, BI=bi, KP=kp, HAS_LIMIT=has_limit,
             WD=word_layout(2 * bi, h // kp // kc // 128, nw), PDL=pdl, SHARED=shared,
             WD8=fp8_word_layout(2 * bi, max(1, h // kp // kc // 256), nw) if shared else None,
             PDL_IN=pdl_in, KC=kc, DQ=dq, RK=int(bool(cfg.get("RK", 0)) or rb) if kp > 1 else 0,
             XS=int(cfg.get("XS", 0)))
    b = dict(H=h, I=i, M=m, S=s, SP=sp, BH=bh, KP2=kp2, SG=max(1, min(int(cfg.get("SG", 1)), s)),
             WD=word_layout(bh, i // kp2 // 128, dw), PDL=pdl, SHARED=shared,
             WD8=fp8_word_layout(bh, i // kp2 // 128, dw) if shared else None, DQ=dq, RB=rb,
             # (kernel A's tiling and the clamp switch only where RB reads them: otherwise one binary, one cache key)
             BIA=bi if rb else 1, KPA=kp if rb else 1, HAS_LIMIT=bool(has_limit and rb))
    return a, b


def launch_split(kern, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: dict,
                 sh: SharedFP8 | None = None) -> None:
    """Run the two kernels for one call of :class:`~bytebound.kernels.moe_host.MoEKernel` ``kern``.

    ``x bf16 [M, H]``, ``ids int32/int64 [M, k]``, ``w float32 [M, k]`` (contiguous), ``out bf16 [M, H]``. With a
    shared expert ``sh`` (``MoEKernel.bind_shared``) it is one more slot of both kernels and ``out`` is routed +
    shared.

    Raises:
        BackendError: Gluon is not importable."""
    if gluon is None:
        raise BackendError(f"moe[triton] variant 'split': {GLUON_ERR}")
    m, k = ids.shape
    s = m * k
    st = s + (sh is not None)           # slots: routed, then the shared expert
    h, i = kern.h, kern.i
    bi, kp, bh, kp2 = cfg["BI"], cfg["KP"], cfg["BH"], cfg["KP2"]
    sg = max(1, min(int(cfg.get("SG", 1)), s))
    gt = -(-s // sg) + (sh is not None)     # kernel B's slot groups: routed, then the shared expert's
    nj, mv = i // bi, (1 if m == 1 else 4)
    dev = x.device
    act = scratch(dev, "act", st * m * i, torch.bfloat16)
    part_a = scratch(dev, "part_a", st * nj * kp * 2 * bi * mv) if kp > 1 else act
    part_b = scratch(dev, "part_b", (h // bh) * gt * kp2 * bh * mv)
    cnt_a = scratch(dev, "cnt_a", st * nj, torch.int32)
    cnt_b = scratch(dev, "cnt_b", h // bh, torch.int32)
    inf = float("inf")                  # min(x, inf) = x: a slot without a clamp in a launch with one
    limit = float(kern.limit) if kern.limit is not None else inf
    slimit = float(sh.limit) if sh is not None and sh.limit is not None else inf
    has_limit = kern.limit is not None or (sh is not None and sh.limit is not None)
    pdl = bool(cfg.get("pdl", True)) and kern.sm90
    pdl_in = int(cfg.get("pdl_in", 0)) if kern.sm90 else 0
    sw13, ss13, sw2, ss2 = (sh.w13w, sh.s13, sh.w2w, sh.s2) if sh is not None else (kern.w13w, kern.lut) * 2
    ca, cb = split_constexprs(m, k, h, i, cfg, sh is not None, has_limit, pdl, pdl_in, launch_dq(kern, cfg)[0])
    if cfg.get("TR", 0) and kern.sm90:
        from bytebound.kernels import triton_moe_ring
        triton_moe_ring.launch_ring_gateup(kern, x, ids, part_a, cfg, ca["DQ"], pdl, pdl_in, sh, act, cnt_a, slimit,
                                           has_limit)
    else:
        _moe_gateup_split[(nj, st, kp)](x, ids, w, kern.w13w, kern.s13, act, part_a, cnt_a, kern.lut, limit,
                                        sw13, ss13, slimit, **ca, num_warps=cfg["num_warps"], launch_pdl=pdl_in > 0,
                                        **maxnreg(cfg.get("NR")))
    if ca["RK"] and not cb["RB"]:
        _moe_reduce_swiglu[(nj, st)](ids, w, act, part_a, limit, slimit, I=i, TOPK=k, M=m, SP=ca["SP"], BI=bi, KP=kp,
                                     HAS_LIMIT=has_limit, SHARED=sh is not None, PDL=pdl,
                                     num_warps=max(1, min(4, bi // 32)), launch_pdl=pdl)
    _moe_down_split[(h // bh, gt, kp2)](act, ids, kern.w2w, kern.s2, out, part_b, cnt_b, kern.lut, sw2, ss2,
                                        w, part_a, limit, slimit, **cb, num_warps=cfg["down_warps"], launch_pdl=pdl,
                                        **maxnreg(cfg.get("NR2")))
