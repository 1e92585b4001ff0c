"""W4A8 gate/up for the ``split`` MoE's routed slots (config key ``A8``, opt-in): MXFP4 weights decoded to FP8 E4M3
and multiplied by E4M3 activations on Hopper's FP8 tensor cores (``wgmma`` m64n8k32), instead of decoding E2M1 to
BF16 for ``mma.sync`` m16n8k16.

Why: at M = 4 kernel A issues ~16.5 M instructions for ~69 MB, most of them the E2M1 -> BF16 decode (about 23 per
32-bit word of 8 codes), and neither more bytes in flight nor a loop over work items moved it
(docs/perf/moe-kernels-h200.md). An E2M1 code is an E4M3 pattern after a shift: code ``(s, e1 e0, m)`` ->
byte ``s<<7 | e1 e0<<3 | m<<2`` reads the code's value times 2^-6 exactly (e >= 1: ``2^(e-7) (1 + m/2)``; the
subnormal code 0.5 -> E4M3 subnormal ``2^-6 * 0.5``). That is 7 instructions per word for 8 values, and one
``wgmma`` covers 64 rows x 32 k per warpgroup. ``mma.sync`` with E4M3 operands compiles on sm_90 but ptxas lowers
it to BF16 conversions and HMMA (no native FP8 ``mma.sync`` on Hopper), hence ``wgmma``.

**The scale per k32 tile.** One ``wgmma`` k32 tile must hold one E8M0 block per row (32 columns of one scale), so
the tile's per-row result can be scaled after the multiply: ``acc += 2^(E + 6 - 127) * wgmma(A_tile, B_tile)``.
In the ``mma`` fragment lane ``4g + t`` holds 8 of the tile's 32 k per row; here they are word ``t`` (8 codes) of
the block, loaded as one 32-bit word per row (``_tile_words``), not the 16-byte vector of one block per lane the
BF16 path loads. The 8 codes of word ``t`` become logical k ``16 h + 4 t + i`` of the tile from physical column
``8 t + 2 i + h`` of the block (``h`` 0: the low nibbles of the word's bytes, 1: the high ones), which is the
order the B operand is stored in (:func:`_x_tile_smem`).

**Activations.** Each program quantises its slice of x to E4M3 with one power-of-two scale per token, ``sx =
2^(ea - 7)`` where ``2^ea <= amax < 2^(ea+1)`` over the token's whole row (so ``|x| / sx < 256 <= 448``: no
saturation), rounds to nearest even, and stores the slice in shared memory in the logical order above (the
``wgmma`` B operand, K-major); ``sx`` multiplies the gate/up results before SwiGLU. Every program recomputes its
tokens' amax from x (L2-resident, 5 KB a token at Ling's width) while its first weights are in flight. The
quantisation's cost on the trained nano: ``docs/perf/w4a8-act-quant-nano-cpu.md`` (KL 6.6e-4 nats/token with a
scale per token row).

Exactness (tested on the GPU against float64, tests/gpu/test_moe_a8_gpu.py): products of E4M3 values are exact in
float32 and each tile's 32 products are summed by the tensor core in float32 (no ``max_num_imprecise_acc``
split: a tile is one ``wgmma``); the tiles, the scale products and the partials are float32 sums in a fixed
order, so outputs are bit-identical run to run.
"""

from __future__ import annotations

import torch

from bytebound.kernels.pdl import enabled as pdl_enabled
from bytebound.kernels.registry import optional_triton
from bytebound.kernels.scratch import scratch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except Exception:  # pragma: no cover
    gluon = gl = None

triton, tl, _TRITON_ERR = optional_triton()      # None, None, reason on machines without Triton

# E8M0 bytes the tile scale takes: 2^(E - 127) as a normal float32 (E = 0, a scale of 2^-127, is refused; E = 255 is
# NaN in E8M0)
A8_MIN_E8M0, A8_MAX_E8M0 = 1, 254

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    # One int32 word (8 E2M1 codes, code c in bits 4c..4c+3) -> 4 E4M3 bytes (pack 4: the asm sees the word in
    # each of $1..$4 and writes the 4 bytes packed in $0). LO: the low nibble of each byte (codes 0, 2, 4, 6);
    # HI: the high nibble (codes 1, 3, 5, 7). Magnitude bits (e1 e0 m) go to bits 4..2 of the byte, the sign to 7.
    ASM_E4M3_LO = gl.constexpr("""
{
.reg .b32 a<2>;
shl.b32 a0, $1, 2;
and.b32 a0, a0, 0x1C1C1C1C;
shl.b32 a1, $1, 4;
and.b32 a1, a1, 0x80808080;
or.b32  $0, a0, a1;
}
""")
    ASM_E4M3_HI = gl.constexpr("""
{
.reg .b32 a<2>;
shr.b32 a0, $1, 2;
and.b32 a0, a0, 0x1C1C1C1C;
and.b32 a1, $1, 0x80808080;
or.b32  $0, a0, a1;
}
""")

    @gluon.jit
    def _frag_e4m3(w, W3: gl.constexpr, DA8: gl.constexpr):
        """E2M1 words ``w`` int32 ``[R, 4]`` (row, word t of one 32-column block; layout ``SliceLayout(2, W3)``)
        -> the ``wgmma`` A operand FP8 E4M3 ``[R, 32]`` (layout ``DA8``) holding the codes' values x 2^-6, logical k
        ``16 h + 4 t + i`` = physical column ``8 t + 2 i + h`` of the block (module docstring)."""
        R: gl.constexpr = w.shape[0]
        w3 = gl.broadcast(gl.expand_dims(w, 2), gl.full([R, 4, 4], 0, gl.int32, W3))[0]      # [R, t, i]
        lo = gl.inline_asm_elementwise(ASM_E4M3_LO, "=r,r,r,r,r", [w3], gl.int8, True, 4)
        hi = gl.inline_asm_elementwise(ASM_E4M3_HI, "=r,r,r,r,r", [w3], gl.int8, True, 4)
        a = gl.permute(gl.join(lo, hi), [0, 3, 1, 2])         # [R, t, i, h] -> [R, h, t, i]
        a = gl.reshape(a, [R, 32]).to(gl.float8e4nv, bitcast=True)
        return gl.convert_layout(a, DA8, assert_trivial=True)

    @gluon.jit
    def _word_ptrs(wp, row, blk0, K: gl.constexpr, W3: gl.constexpr):
        """Pointers ``[R, 4]`` (layout ``SliceLayout(2, W3)``) to word ``t`` of block ``blk0`` of rows ``row``
        (``SliceLayout(1, SliceLayout(2, W3))``) of a ``[*, K]`` MXFP4 matrix of int32 words ``wp``; block
        ``blk0 + j`` is at ``+ 4 j`` (a constant offset of the load)."""
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, W3)))
        return wp + (row[:, None] * (K // 8) + blk0 * 4 + t[None, :])

    @gluon.jit
    def _scale_f32(s4, TAU: gl.constexpr):
        """Byte ``TAU`` of ``s4`` (int32: the 4 E8M0 bytes of a 128-column super-block) -> float32 ``2^(E - 127)``
        (E >= 1: a normal float; the decode's 2^-6 is taken back once, at the end)."""
        if TAU == 0:
            v = s4 << 23
        elif TAU == 1:
            v = s4 << 15
        elif TAU == 2:
            v = s4 << 7
        else:
            v = s4 >> 1
        return (v & 0x7F800000).to(gl.float32, bitcast=True)

    @gluon.jit
    def _xq_smem(xq_ptr, c0, M: gl.constexpr, H: gl.constexpr, HK: gl.constexpr, KC: gl.constexpr,
                 NW: gl.constexpr):
        """Columns ``c0 .. c0 + HK`` of the quantised x (:func:`quantize_x`: E4M3 bytes ``[M, H]`` in the logical
        order) as the ``wgmma`` B operand: shared memory ``[KC, HK / KC, 8]`` (K-major, tokens padded to 8 with
        zeros), one ``[HK / KC, 8]`` piece per chunk of the pipeline."""
        CW: gl.constexpr = HK // KC
        BL: gl.constexpr = gl.BlockedLayout([16, 1], [CW // 16 if CW < 512 else 32, 32 // (CW // 16) if CW < 512 else 1],
                                            [1, NW], [0, 1])
        L = gl.arange(0, CW, layout=gl.SliceLayout(1, BL))
        nb = gl.arange(0, 8, layout=gl.SliceLayout(0, BL))
        SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2, transposed=True)
        b_s = gl.allocate_shared_memory(gl.float8e4nv, [KC, CW, 8], SL)
        for c in gl.static_range(KC):
            q = gl.load(xq_ptr + nb[None, :] * H + (c0 + c * CW + L)[:, None],
                        mask=(nb[None, :] < M) & (L[:, None] >= 0), other=0)
            b_s.index(c).store(q.to(gl.float8e4nv, bitcast=True))
        fence_async_shared()
        gl.thread_barrier()
        return b_s

    @gluon.jit
    def gateup_routed_a8(xq_ptr, sx_ptr, wp, sp, row, row_s, p, H: gl.constexpr, M: gl.constexpr, HK: gl.constexpr,
                         KC: gl.constexpr, W3: gl.constexpr, MMA3: gl.constexpr):
        """Kernel A's routed slot in W4A8: rows ``row`` (``[R]``, layout ``SliceLayout(1, SliceLayout(2, W3))``;
        ``row_s`` the same in the accumulator's ``SliceLayout(1, MMA3)``) of one expert's ``[gate; up]`` MXFP4
        words ``wp`` / E8M0 ``sp``, times x over H slice ``p`` (``HK`` columns) -> float32 ``[R, 8]`` (layout
        ``MMA3``), already times each token's ``sx``. The slice's ``HK / 32`` k32 tiles go in ``KC`` chunks, two
        chunks in flight while one is multiplied (as the BF16 path's ``KC``)."""
        NW: gl.constexpr = gl.num_warps()
        R: gl.constexpr = row.shape[0]
        DA8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=4)
        NT: gl.constexpr = HK // 32
        CT: gl.constexpr = NT // KC
        b0 = p * NT                                     # the slice's first block along H
        wq = _word_ptrs(wp, row, b0, H, W3)
        sq = sp.to(gl.pointer_type(gl.int32)) + row_s * (H // 128) + b0 // 4     # 4 E8M0 bytes a super-block
        w0 = ()
        for jj in gl.static_range(CT):
            w0 = w0 + (gl.load(wq + 4 * jj),)
        if KC > 1:
            w1 = ()
            for jj in gl.static_range(CT):
                w1 = w1 + (gl.load(wq + 4 * (CT + jj)),)
        b_s = _xq_smem(xq_ptr, p * HK, M, H, HK, KC, NW)
        acc = gl.zeros([R, 8], gl.float32, MMA3)
        zero = gl.zeros([R, 8], gl.float32, MMA3)
        for c in gl.static_range(KC):
            if c + 2 < KC:
                w2 = ()
                for jj in gl.static_range(CT):
                    w2 = w2 + (gl.load(wq + 4 * ((c + 2) * CT + jj)),)
            for jj in gl.static_range(CT):
                if jj % 4 == 0:
                    s4 = gl.load(sq + (c * CT + jj) // 4)
                sc = _scale_f32(s4, jj % 4)
                part = warpgroup_mma(_frag_e4m3(w0[jj], W3, DA8), b_s.index(c).slice(jj * 32, 32, 0), zero,
                                     use_acc=False)
                acc += part * sc[:, None]
            if c + 1 < KC:
                w0 = w1
            if c + 2 < KC:
                w1 = w2
        n = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA3))
        sx = gl.load(sx_ptr + n, mask=n < M, other=0.0)
        return acc * (sx * 64.0)[None, :]            # x 2^6: the decode's 2^-6


def a8_word_layout(rows: int, num_warps: int):
    """The register layout ``W3`` of one k32 tile's words for :func:`_frag_e4m3`: tensor ``[rows, 4 (t), 4 (i)]``,
    lane ``4g + t`` of warp ``w`` holding rows ``16w + g`` and ``16w + g + 8`` (the ``wgmma`` A-fragment rows of
    that lane) and word ``t`` of the block, broadcast over the 4 bytes ``i`` it decodes to. Needs ``rows == 16 *
    num_warps`` (one m64 warpgroup tile per 4 warps)."""
    assert rows == 16 * num_warps, (rows, num_warps)
    reg = [[0, 0, 1], [0, 0, 2], [8, 0, 0]]
    lane = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warp = [[16 << b, 0, 0] for b in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [rows, 4, 4])


def a8_mma_layout(num_warps: int):
    """The ``wgmma`` accumulator layout of kernel A's W4A8 slots: ``[16 * num_warps, 8]`` float32."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8, 32])


if tl is not None:
    from bytebound.kernels.pdl import enter as pdl_enter

    @triton.jit
    def _e4m3_rne(v):
        """float32 ``|v| < 256`` -> its E4M3 byte (uint8), rounded to nearest even, in integer and exact float32
        steps (the same bits on the GPU and in Triton's interpreter, whose float8 cast does not round this way):
        the E4M3 step of ``v`` is ``2^(max(e, -6) - 3)`` (``2^e <= |v|``), ``v / step`` is exact, and adding and
        subtracting 1.5 x 2^23 rounds it to an integer, half to even."""
        a = tl.abs(v)
        e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        es = tl.maximum(e, -6) - 3                                   # log2 of the step
        up = ((127 - es) << 23).to(tl.float32, bitcast=True)
        dn = ((127 + es) << 23).to(tl.float32, bitcast=True)
        n = (a * up + 12582912.0) - 12582912.0                       # round(|v| / step), ties to even
        r = n * dn                                                   # |v| rounded, exactly an E4M3 value
        rb = r.to(tl.int32, bitcast=True)
        er = ((rb >> 23) & 0xFF) - 127
        normal = ((er + 7) << 3) | ((rb >> 20) & 7)
        sub = (r * 512.0).to(tl.int32)                               # r = j 2^-9, j < 8
        mag = tl.where(r >= 0.015625, normal, sub)
        return (mag | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)).to(tl.uint8)     # the sign bit (-0 too)

    @triton.jit
    def _quantize_x_kernel(x_ptr, xq_ptr, sx_ptr, H: tl.constexpr, HP: tl.constexpr, PDL: tl.constexpr,
                           NT: tl.constexpr):
        """Row ``pid`` of x (bf16 ``[M, H]``) -> E4M3 bytes in the logical order (module docstring) and its scale
        ``sx = 2^(ea - 7)``, ``ea`` the exponent of the row's amax (1 for an all-zero row)."""
        pdl_enter(PDL, NT)
        m = tl.program_id(0)
        c = tl.arange(0, HP)
        # destination column d = 32 b + 16 h + 4 t + i takes source column 32 b + 8 t + 2 i + h
        src = (c // 32) * 32 + ((c // 4) % 4) * 8 + (c % 4) * 2 + (c // 16) % 2
        v = tl.load(x_ptr + m * H + src, mask=c < H, other=0.0).to(tl.float32)
        am = tl.max(tl.abs(v), axis=0)
        ea = ((am.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        k = tl.where(am > 0.0, ea - 7, 0)
        k = tl.minimum(tl.maximum(k, -120), 120)
        inv = ((127 - k) << 23).to(tl.float32, bitcast=True)       # 2^-k: the scaling is exact
        tl.store(xq_ptr + m * H + c, _e4m3_rne(v * inv), mask=c < H)
        tl.store(sx_ptr + m, ((127 + k) << 23).to(tl.float32, bitcast=True))


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 ``[M, H]`` (H a multiple of 32) -> ``(xq uint8 [M, H], sx float32 [M])``: each row scaled by the power
    of two ``1 / sx`` and rounded to E4M3 (nearest even), stored in the logical k order of :func:`_frag_e4m3`
    (destination column ``32 b + 16 h + 4 t + i`` holds ``x[32 b + 8 t + 2 i + h] / sx``). One launch, a PDL
    dependent of the kernel before it on sm_90 (``kernels.pdl``); the outputs live in ``kernels.scratch``
    (``a8_xq``, ``a8_sx``): valid until the next call on the device. Tested against a float64 / torch reference
    (tests/gpu/test_moe_a8_gpu.py, tests/test_moe_a8.py)."""
    m, h = x.shape
    xq = scratch(x.device, "a8_xq", m * h, torch.uint8).view(m, h)
    sx = scratch(x.device, "a8_sx", m)[:m]
    pdl = pdl_enabled(x.device)
    _quantize_x_kernel[(m,)](x, xq, sx, H=h, HP=triton.next_power_of_2(h), PDL=pdl, NT=128, num_warps=4,
                             launch_pdl=pdl)
    return xq, sx


def reference_quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_x` in torch (the tests' reference, any device): ``(xq uint8 [M, H] in the logical order, sx
    float32 [M])``."""
    xf = x.float()
    am = xf.abs().amax(dim=1)
    _, e = torch.frexp(am)                       # am = f 2^e, f in [0.5, 1): ea = e - 1
    k = torch.where(am > 0, e - 1 - 7, torch.zeros_like(e)).clamp(-120, 120)
    sx = torch.ldexp(torch.ones_like(am), k)
    q = (xf / sx[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    m, h = x.shape
    c = torch.arange(h, device=x.device)
    src = (c // 32) * 32 + ((c // 4) % 4) * 8 + (c % 4) * 2 + (c // 16) % 2
    return q[:, src].contiguous(), sx
