"""A probe kernel for tests/gpu/test_kernels_gpu.py: the ``split`` kernels' E2M1 decode (``frag_dequant``) and B
operand gather (``_load_b``) of one tile, stored back to memory in the logical k order they produce, so the test
can check both against the float64 dequantisation and the documented physical order (``DQ`` 0 and 1)."""

from __future__ import annotations

from bytebound.kernels.triton_moe_split import _load_b, frag_dequant, gl, gluon, mxfp4_tile, word_layout

R, NS, NW = 64, 2, 4          # one tile: 64 rows (16 per warp), two 128-column super-blocks
K = 128 * NS


@gluon.jit
def _probe(w_ptr, s_ptr, lut_ptr, x_ptr, a_ptr, b_ptr, K: gl.constexpr, R: gl.constexpr,
           WD: gl.constexpr, DQ: gl.constexpr):
    NW: gl.constexpr = gl.num_warps()
    NS: gl.constexpr = K // 128
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    SD: gl.constexpr = gl.SliceLayout(3, WD)
    row = gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, SD)))
    wv, sv = mxfp4_tile(w_ptr, s_ptr, row, 0, K, WD)
    a = frag_dequant(wv, sv, gl.load(lut_ptr), gl.load(lut_ptr + 1), gl.load(lut_ptr + 2), gl.load(lut_ptr + 3),
                     gl.load(lut_ptr + 4), DA, DQ)                                  # [R, K] logical k order
    b = _load_b(x_ptr, K, 8, NS, NW, DB, DQ=DQ)                                     # [K, 8] logical k order
    ac = gl.convert_layout(a, BL)
    r = gl.arange(0, R, layout=gl.SliceLayout(1, BL))
    c = gl.arange(0, K, layout=gl.SliceLayout(0, BL))
    gl.store(a_ptr + r[:, None] * K + c[None, :], ac)
    BL2: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NW, 1], [1, 0])
    bc = gl.convert_layout(b, BL2)
    k2 = gl.arange(0, K, layout=gl.SliceLayout(1, BL2))
    n2 = gl.arange(0, 8, layout=gl.SliceLayout(0, BL2))
    gl.store(b_ptr + k2[:, None] * 8 + n2[None, :], bc)


def run(words, scales, lut, x, dq: int):
    """``words`` int32 ``[R, K/8]``, ``scales`` uint8 ``[R, K/32]``, ``lut`` (``lut_tensor``), ``x`` bf16 ``[8, K]``
    -> ``(A bf16 [R, K], B bf16 [K, 8])``, the decoded weights and the gathered operand in the logical k order of
    ``dq``."""
    import torch
    a = torch.empty(R, K, dtype=torch.bfloat16, device=words.device)
    b = torch.empty(K, 8, dtype=torch.bfloat16, device=words.device)
    _probe[(1,)](words, scales, lut, x, a, b, K=K, R=R, WD=word_layout(R, NS, NW), DQ=dq, num_warps=NW)
    return a, b
