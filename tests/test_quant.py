"""MXFP4 / FP8-block / FP8-channel quantise-dequantise against float64 references written here from the specs
(OCP Microscaling v1.0: E2M1 elements + E8M0 shared scale 2^(e-127); E4M3FN: bias 7, max 448, no inf)."""

from __future__ import annotations

import math

import pytest
import torch

from bytebound.errors import QuantFormatError
from bytebound.quant import (FP8, dequantize_fp8_block, dequantize_mxfp4, fp8_channel_matmul_ref,
                             quantize_fp8_block, quantize_fp8_channel, quantize_mxfp4)

# ---- float64 references ---------------------------------------------------------------------------------
E2M1_MAG = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]       # code & 7 -> magnitude (1 sign bit, 2 exp, 1 mantissa)


def e2m1_decode_ref(code: int) -> float:
    """E2M1 by its bit fields: s eem; e == 0 is subnormal (m * 0.5), else 2^(e-1) * (1 + m/2)."""
    s, e, m = (code >> 3) & 1, (code >> 1) & 3, code & 1
    v = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -v if s else v


def mxfp4_dequant_ref(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 decode: byte b holds column 2i in its low nibble and 2i+1 in its high nibble."""
    p = packed.view(torch.uint8).to(torch.int64)
    n, kh = p.shape
    out = torch.empty(n, 2 * kh, dtype=torch.float64)
    lut = torch.tensor([e2m1_decode_ref(c) for c in range(16)], dtype=torch.float64)
    out[:, 0::2] = lut[p & 0xF]
    out[:, 1::2] = lut[p >> 4]
    sc = torch.pow(torch.tensor(2.0, dtype=torch.float64), scales.to(torch.float64) - 127.0)
    return out * sc.repeat_interleave(32, 1)


def e2m1_round_ref(x: float) -> int:
    """Nearest E2M1 code of a value already divided by the block scale: saturate at 6, ties to the even code
    (even mantissa bit); values rounding to zero get +0 (code 0)."""
    a = min(abs(x), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1_MAG[i] - a), i % 2))
    return best | (8 if x < 0 and best else 0)


def mxfp4_quant_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` and E8M0 bytes ``[N, K/32]``: shared exponent floor(log2(amax)) - 2 (OCP MX 6.3)."""
    w = w.double()
    n, k = w.shape
    codes = torch.zeros(n, k, dtype=torch.int64)
    sbytes = torch.zeros(n, k // 32, dtype=torch.int64)
    for r in range(n):
        for b in range(k // 32):
            blk = w[r, 32 * b:32 * b + 32].tolist()
            amax = max(abs(v) for v in blk)
            e = -127 if amax == 0 else max(-127, min(127, math.floor(math.log2(amax)) - 2))
            # math.log2 of a float64 can round up to an integer too; settle it exactly
            if amax and 2.0 ** (e + 2) > amax:
                e -= 1
            sbytes[r, b] = e + 127
            codes[r, 32 * b:32 * b + 32] = torch.tensor([e2m1_round_ref(v / 2.0 ** e) for v in blk])
    return codes, sbytes


def e4m3_grid() -> torch.Tensor:
    """All finite E4M3FN values (float64, ascending, +0 once): bias 7, subnormals m/8 * 2^-6, max 448."""
    vals = set()
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue                                   # NaN
            v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            vals.update((v, -v))
    return torch.tensor(sorted(vals), dtype=torch.float64)


GRID = e4m3_grid()


def e4m3_round_ref(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values (|x| <= 448) to the nearest E4M3 value, ties to even mantissa."""
    x = x.double().flatten()
    idx = torch.searchsorted(GRID, x).clamp(1, len(GRID) - 1)
    lo, hi = GRID[idx - 1], GRID[idx]
    out = torch.where((x - lo) < (hi - x), lo, hi)
    tie = (x - lo) == (hi - x)
    if tie.any():
        # even mantissa: the candidate whose E4M3 code is even
        lo_code = lo[tie].to(torch.float32).to(FP8).view(torch.uint8) & 1
        out[tie] = torch.where(lo_code == 0, lo[tie], hi[tie])
    return out


# ---- MXFP4 ----------------------------------------------------------------------------------------------
def test_e2m1_table_matches_bit_fields():
    assert [e2m1_decode_ref(c) for c in range(8)] == E2M1_MAG
    packed = torch.arange(256, dtype=torch.uint8).view(1, 256)
    scales = torch.full((1, 16), 127, dtype=torch.uint8)
    assert torch.equal(dequantize_mxfp4(packed, scales, torch.float64), mxfp4_dequant_ref(packed, scales))


def test_nibble_order_low_is_even_column():
    # byte 0x21: low nibble 1 (0.5) -> column 0, high nibble 2 (1.0) -> column 1; 0xF7: 6.0 then -6.0
    packed = torch.tensor([[0x21, 0xF7] + [0] * 14], dtype=torch.uint8)
    out = dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert out[0, :4].tolist() == [0.5, 1.0, 6.0, -6.0]
    q, s = quantize_mxfp4(out)
    assert q[0, :2].tolist() == [0x21, 0xF7] and s.tolist() == [[127]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_mxfp4_dequant_matches_float64(dtype):
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (8, 4), dtype=torch.uint8, generator=g)
    scales[0, 0], scales[0, 1] = 0, 127                       # 2^-127 (float32 subnormal) and 1
    ref = mxfp4_dequant_ref(packed, scales)
    out = dequantize_mxfp4(packed, scales, dtype)
    assert out.dtype == dtype
    assert torch.equal(out.double(), ref.to(dtype).double())   # every value is exactly representable
    # int8 storage (as the checkpoint stores it) and float8_e8m0fnu scales read the same bytes
    assert torch.equal(dequantize_mxfp4(packed.view(torch.int8), scales.view(torch.float8_e8m0fnu), dtype), out)


def test_mxfp4_dequant_stacked_experts():
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (3, 4, 32), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 4, 2), dtype=torch.uint8, generator=g)
    out = dequantize_mxfp4(packed, scales)
    for e in range(3):
        assert torch.equal(out[e].double(), mxfp4_dequant_ref(packed[e], scales[e]))


def test_mxfp4_quant_matches_float64_reference():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 128, generator=g) * torch.logspace(-3, 2, 16)[:, None]
    w[0, :32] = 0.0                                           # all-zero block -> exponent byte 0, codes 0
    w[1, :32] = torch.linspace(-1, 1, 32)
    w[2, 0] = torch.tensor(2.0 ** 20).nextafter(torch.tensor(0.0))   # amax just below a power of two
    packed, scales = quantize_mxfp4(w)
    codes, sref = mxfp4_quant_ref(w)
    assert packed.dtype == torch.uint8 and packed.shape == (16, 64)
    assert scales.dtype == torch.uint8 and scales.shape == (16, 4)
    assert torch.equal(scales.long(), sref)
    got = torch.stack((packed & 0xF, packed >> 4), -1).flatten(-2).long()
    assert torch.equal(got, codes)
    assert scales[0, 0] == 0 and (got[0, :32] == 0).all()


def test_mxfp4_round_ties_to_even_and_saturation():
    # block scale 1 (amax 6 -> exponent 0): midpoints go to the even code
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 6.0] + [0.0] * 22).view(1, 32)
    packed, scales = quantize_mxfp4(x)
    assert scales.item() == 127
    out = dequantize_mxfp4(packed, scales)[0, :10].tolist()
    assert out == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -4.0, 6.0]
    # amax 7.5 -> exponent floor(log2 7.5) - 2 = 0, 7.5 saturates to 6
    y = torch.zeros(1, 32)
    y[0, 0] = 7.5
    p2, s2 = quantize_mxfp4(y)
    assert s2.item() == 127 and dequantize_mxfp4(p2, s2)[0, 0] == 6.0


def test_mxfp4_exact_values_round_trip_exactly():
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (12, 96), generator=g)
    codes[codes == 8] = 0                                     # -0 re-encodes as +0
    codes[:, ::32] = torch.tensor([6, 7, 14, 15])[torch.randint(0, 4, (12, 3), generator=g)]  # |max| in {4, 6}
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = torch.randint(90, 160, (12, 3), dtype=torch.uint8, generator=g)
    w = dequantize_mxfp4(packed, scales)
    assert torch.equal(w.double(), mxfp4_dequant_ref(packed, scales))
    p2, s2 = quantize_mxfp4(w)
    assert torch.equal(p2, packed) and torch.equal(s2, scales)
    assert torch.equal(dequantize_mxfp4(p2, s2), w)


def test_mxfp4_quant_error_bound():
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(5))
    packed, scales = quantize_mxfp4(w)
    deq = dequantize_mxfp4(packed, scales, torch.float64)
    scale = torch.pow(2.0, scales.double() - 127).repeat_interleave(32, 1)
    # within the grid (|x/scale| <= 6) the error is at most half the E2M1 spacing (<= 1 at magnitudes 4..6);
    # above it (6 < |x/scale| < 8, the block's largest elements) the value saturates to 6
    bound = scale * 1.0 + (w.double().abs() - 6 * scale).clamp(min=0)
    assert ((deq - w.double()).abs() <= bound + 1e-12).all()
    small = w.double().abs() <= 6 * scale
    assert ((deq - w.double()).abs()[small] <= (scale * 1.0)[small]).all()
    assert (deq - w.double()).abs().max() > 0                # quantisation happened


def test_mxfp4_errors():
    scales = torch.full((2, 2), 127, dtype=torch.uint8)
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    bad = scales.clone()
    bad[1, 1] = 255
    with pytest.raises(QuantFormatError, match="255"):
        dequantize_mxfp4(packed, bad)
    with pytest.raises(QuantFormatError, match="scale shape"):
        dequantize_mxfp4(packed, torch.full((2, 4), 127, dtype=torch.uint8))     # one per 16 inputs
    with pytest.raises(QuantFormatError, match="scale shape"):
        dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.full((1, 4), 127, dtype=torch.uint8))
    with pytest.raises(QuantFormatError, match="scale shape"):
        dequantize_mxfp4(packed, scales.t().contiguous()[:1])
    with pytest.raises(QuantFormatError, match="uint8"):
        dequantize_mxfp4(packed.float(), scales)
    with pytest.raises(QuantFormatError, match="scale must be uint8"):
        dequantize_mxfp4(packed, scales.float())
    with pytest.raises(QuantFormatError, match="K % 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(QuantFormatError, match="non-finite"):
        quantize_mxfp4(torch.full((1, 32), float("nan")))


# ---- FP8 E4M3, blocks -----------------------------------------------------------------------------------
def test_e4m3_grid_matches_torch():
    every = torch.arange(256, dtype=torch.uint8).view(FP8).double()
    finite = every[~every.isnan()]
    assert torch.equal(torch.unique(finite), GRID)            # 253 distinct finite values (+0 == -0)
    assert GRID.max() == 448.0 and GRID[GRID > 0].min() == 2.0 ** -9


@pytest.mark.parametrize("shape, block", [((96, 64), (32, 32)), ((130, 200), (128, 128)), ((5, 7), (4, 4))])
def test_fp8_block_matches_float64_reference(shape, block):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(shape, generator=g) * torch.logspace(-4, 1, shape[0])[:, None]
    q, s = quantize_fp8_block(w, block)
    nb, kb = math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])
    assert q.dtype == FP8 and q.shape == shape and s.dtype == torch.float32 and s.shape == (nb, kb)
    wd = w.double()
    for i in range(nb):
        for j in range(kb):
            tile = wd[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            amax = tile.abs().max().item()
            want = 2.0 ** math.ceil(math.log2(amax / 448))
            assert s[i, j].item() == want, (i, j)
            qt = q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].double()
            assert torch.equal(qt.flatten(), e4m3_round_ref(tile / want))
    deq = dequantize_fp8_block(q, s, block, torch.float64)
    ref = q.double() * s.double().repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]
    assert torch.equal(deq, ref)


def test_fp8_block_power_of_two_scale_edges():
    # amax just above / at / just below 448 * 2^k: the scale is the smallest power of two keeping |w/s| <= 448
    for k in (-20, -7, 0, 5):
        base = torch.tensor(448.0 * 2.0 ** k)
        for amax in (base.nextafter(torch.tensor(1e30)), base, base.nextafter(torch.tensor(0.0))):
            w = torch.zeros(4, 4)
            w[1, 2] = -amax
            q, s = quantize_fp8_block(w, (4, 4))
            assert s.item() == 2.0 ** math.ceil(math.log2(amax.double().item() / 448)), (k, amax.item())
            assert (q.float().abs() <= 448).all()


def test_fp8_block_not_pow2():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(7))
    q, s = quantize_fp8_block(w, (32, 32), pow2=False)
    amax = w.view(2, 32, 2, 32).abs().amax(dim=(1, 3))
    assert torch.allclose(s, amax / 448, rtol=1e-7, atol=0)
    assert (q.float().abs().amax() == 448)


def test_fp8_block_exact_values_round_trip_exactly():
    g = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 256, (64, 96), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0                         # no NaN
    q = codes.view(FP8)
    q_f = q.float()
    q_f[0::32, 0::32] = 448.0                                 # every 32x32 tile reaches 448
    q = q_f.to(FP8)
    s = torch.pow(2.0, torch.randint(-12, 4, (2, 3), generator=g).float())
    w = dequantize_fp8_block(q, s, (32, 32))
    q2, s2 = quantize_fp8_block(w, (32, 32))
    assert torch.equal(s2, s)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) or torch.equal(q2.float(), q.float())
    assert torch.equal(dequantize_fp8_block(q2, s2, (32, 32)), w)


def test_fp8_block_errors():
    q = torch.zeros(96, 64).to(FP8)
    with pytest.raises(QuantFormatError, match="weight_scale_inv shape"):
        dequantize_fp8_block(q, torch.ones(2, 3), (32, 32))        # transposed grid of (3, 2)
    with pytest.raises(QuantFormatError, match="weight_scale_inv shape"):
        dequantize_fp8_block(q, torch.ones(1, 1), (32, 32))
    with pytest.raises(QuantFormatError, match="float32"):
        dequantize_fp8_block(q, torch.ones(3, 2, dtype=torch.bfloat16), (32, 32))
    with pytest.raises(QuantFormatError, match="float8_e4m3fn"):
        dequantize_fp8_block(torch.zeros(96, 64), torch.ones(3, 2), (32, 32))
    with pytest.raises(QuantFormatError, match="2-D"):
        quantize_fp8_block(torch.zeros(4))
    with pytest.raises(QuantFormatError, match="non-finite"):
        quantize_fp8_block(torch.tensor([[1.0, float("inf")]]))


# ---- FP8 per output channel (online LM head) --------------------------------------------------------------
def test_fp8_channel_round_trip():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(50, 64, generator=g) * torch.logspace(-3, 1, 50)[:, None]
    q, s = quantize_fp8_channel(w)
    assert q.dtype == FP8 and s.shape == (50,)
    assert torch.allclose(s.double(), w.double().abs().amax(-1) / 448, rtol=1e-6, atol=0)
    deq = q.double() * s.double()[:, None]
    # E4M3 has 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10 * s in the subnormal range
    err = (deq - w.double()).abs()
    assert (err <= w.double().abs() * 2.0 ** -4 + s.double()[:, None] * 2.0 ** -10).all()
    # float64 reference of the same rounding (scaled values computed in float32, as the quantiser does)
    assert torch.equal(q.double().flatten(), e4m3_round_ref((w / s[:, None]).clamp(-448, 448)))
    # exact values: rows whose max is 448 * c with a power-of-two c come back bit for bit
    c = torch.pow(2.0, torch.arange(-5, 5).float())
    wexact = (GRID[torch.randint(0, len(GRID), (10, 64), generator=g)].float() * c[:, None])
    wexact[:, 0] = 448.0 * c
    q2, s2 = quantize_fp8_channel(wexact)
    assert torch.equal(s2, c) and torch.equal(q2.float() * s2[:, None], wexact)


def test_fp8_channel_matmul_reference():
    g = torch.Generator().manual_seed(10)
    x, w = torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g)
    q, s = quantize_fp8_channel(w)
    out = fp8_channel_matmul_ref(x, q, s)
    sx = x.double().abs().amax(-1) / 448
    xq = e4m3_round_ref((x / (x.abs().amax(-1, keepdim=True) / 448)).clamp(-448, 448)).view(3, 64)
    ref = (xq @ q.double().t()) * sx[:, None] * s.double()[None, :]
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    exact = x.double() @ w.double().t()                       # and it approximates x W^T (~3% of |x||w|)
    scale = x.double().norm(dim=-1)[:, None] * w.double().norm(dim=-1)[None, :]
    assert ((out.double() - exact).abs() <= 0.03 * scale).all()


def test_mxfp4_mse_scale_rule_never_worse_per_block():
    """scale_rule="mse" picks, per 32-block, the OCP exponent or the next one up, whichever has the smaller squared
    error (float64 reference): never worse than OCP, and it does pick the other one for some blocks."""
    g = torch.Generator().manual_seed(3)
    w = torch.cat([torch.randn(64, 256, generator=g) * 0.02, torch.randn(64, 256, generator=g).pow(3)])
    q0, s0 = quantize_mxfp4(w)
    q1, s1 = quantize_mxfp4(w, scale_rule="mse")
    d0 = (mxfp4_dequant_ref(q0, s0) - w.double()).pow(2).view(128, 8, 32).sum(-1)
    d1 = (mxfp4_dequant_ref(q1, s1) - w.double()).pow(2).view(128, 8, 32).sum(-1)
    assert (d1 <= d0 + 1e-18).all()
    up = s1.int() - s0.int()
    assert set(up.unique().tolist()) <= {0, 1} and (up == 1).any()
    assert d1.sum() < d0.sum()
    with pytest.raises(QuantFormatError, match="scale_rule"):
        quantize_mxfp4(w, scale_rule="max")
