"""The prefill FP8 block GEMM of ``kernels.triton_fp8`` (DeepSeek-V3 recipe: 1x128 E4M3 activations x 128x128
E4M3 weights, per-block float32 scales) and its activation quantiser, against float64 references.

* ``quant.quantize_fp8_group`` (the torch reference of the quantiser) is checked against the E4M3 format itself:
  amax lands on 448, every element within half an E4M3 step, power-of-two scales the smallest that fit.
* ``quantize_fp8_groups`` (Triton) equals that reference bit for bit (codes and scales: elementwise IEEE maths,
  no summation order involved).
* ``fp8_block_gemm`` (Triton, ``tl.dot`` on float8e4nv) against ``quant.fp8_block_matmul_ref``: the float64
  product of the *quantised* operands dequantised exactly, so the only differences are float32 accumulation
  order and the BF16 output rounding; the bound is elementwise: half a BF16 step plus a float32 accumulation
  allowance.

On a CPU machine the kernels run in Triton's interpreter (TRITON_INTERPRET=1) when Triton is installed; CI has no
Triton and skips them with that reason. The interpreter converts float32 to E4M3 with a bug (a rounding carry out
of the mantissa is dropped: 124.3 becomes 64, not 128), so these tests give it torch's conversion, which is
what the hardware's ``cvt.rn.satfinite.e4m3x2.f32`` computes for clamped inputs. GPU runs at Ling-3.0-flash
shapes: ``tests/gpu/test_fp8_gemm_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from bytebound.errors import BackendError
from bytebound.quant import (FP8, dequantize_fp8_block, fp8_block_matmul_ref, quantize_fp8_block,
                             quantize_fp8_group, round_up_pow2)
from conftest import needs_triton, triton_kernels

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def fp8k():
    """``bytebound.kernels.triton_fp8`` under the interpreter (on CPU), with RNE float32 -> BF16 and a correct
    float32 -> E4M3 conversion (see the module docstring)."""
    with triton_kernels("bytebound.kernels.triton_fp8", bf16_round_nearest=True) as mod:
        if torch.cuda.is_available():
            yield mod
            return
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp
        prev = interp._convert_float

        def convert(data, src, dst, rounding):
            if src == tl.float32 and dst == tl.float8e4nv:
                t = torch.from_numpy(np.frombuffer(data.tobytes(), dtype=np.float32).copy())
                return t.to(FP8).view(torch.uint8).numpy().reshape(data.shape)
            return prev(data, src, dst, rounding)
        interp._convert_float = convert
        try:
            yield mod
        finally:
            interp._convert_float = prev


def activations(m, k, seed=0, outliers=True):
    """BF16 ``[m, k]`` with a spread of magnitudes: a few large channels (as real hidden states have), one row
    of zeros (the 1e-12 scale floor) when m > 2, and tiny values that quantise to E4M3 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    if outliers:
        x[:, torch.randperm(k, generator=g)[:3]] *= 40
    x[:, -7:] *= 1e-4                                           # subnormal after scaling in most groups
    if m > 2:
        x[1] = 0
    return x.to(torch.bfloat16).to(DEV)


def weights(n, k, block=(128, 128), seed=0):
    """E4M3 block weight ``[n, k]`` whose scales differ between every pair of neighbouring blocks (a factor
    2^-3..2^3 per block row and per block column on top of per-row magnitudes), so a scale read from the wrong
    block is a visible error. Returns ``(wq, sw)`` on DEV."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-3, 4, (math.ceil(n / block[0]),), generator=g).float())
    cols = torch.exp2(torch.randint(-3, 4, (math.ceil(k / block[1]),), generator=g).float())
    w = (torch.randn(n, k, generator=g) * 0.05 * (torch.rand(n, 1, generator=g) + 0.5)
         * rows.repeat_interleave(block[0])[:n, None] * cols.repeat_interleave(block[1])[None, :k])
    wq, sw = quantize_fp8_block(w, block)
    return wq.to(DEV), sw.to(DEV)


def ref_bound(xq, sx, wq, sw, block):
    """Elementwise tolerance of a BF16 kernel output against the float64 product: half a BF16 step (RNE:
    <= 2^-8 of the value) plus the accumulation error, as a fraction of the sum of |terms|: float32 (<= ~K * 2^-24)
    in the interpreter; on a GPU the FP8 MMA's own accumulator, which keeps ~14 bits within a K block (DeepSeek-V3
    report sec. 3.3.2), so 2^-12 there."""
    k = xq.shape[1]
    xd = (xq.double() * sx.double().repeat_interleave(block[1], 1)[:, :k]).abs()
    mag = xd @ dequantize_fp8_block(wq, sw, block, torch.float64).abs().t()
    ref = fp8_block_matmul_ref(xq, sx, wq, sw, block)
    acc = 2.0 ** -12 if torch.cuda.is_available() else k * 2.0 ** -24
    return ref, ref.abs() * 2.0 ** -8 + mag * acc


# ---- the torch reference of the activation quantiser, against the format ------------------------------------
@pytest.mark.parametrize("group,pow2", [(128, False), (128, True), (32, False)])
def test_group_quant_reference_meets_e4m3(group, pow2):
    x = activations(9, 300).float().cpu()                    # 300: a partial last group
    q, s = quantize_fp8_group(x, group, pow2)
    assert q.dtype == FP8 and q.shape == x.shape and s.shape == (9, math.ceil(300 / group))
    pad = torch.zeros(9, s.shape[1] * group)
    pad[:, :300] = x
    amax = pad.view(9, -1, group).abs().amax(-1)
    if pow2:
        e = torch.log2(s)
        assert torch.equal(e, e.round()), "ue8m0 scales must be powers of two"
        live = amax > 0
        assert (amax[live] <= 448 * s[live]).all() and (amax[live] > 224 * s[live]).all()   # the smallest 2^e
    else:
        live = amax > 0
        torch.testing.assert_close(s[live], amax[live] / 448, rtol=0, atol=0)
    floor = 2.0 ** -39 if pow2 else torch.tensor(1e-12).item()          # 1e-12, rounded up when pow2
    assert (s[~live] == floor).all() and (q.float()[1] == 0).all()
    xs = x / s.repeat_interleave(group, 1)[:, :300]
    err = (q.float() - xs).abs()
    normal = xs.abs() >= 2.0 ** -6
    # half an E4M3 step: 2^-4 of the value's binade in the normal range, 2^-10 (half the subnormal step) below it
    assert (err[normal] <= xs.abs()[normal] * 2.0 ** -4).all()
    assert (err[~normal] <= 2.0 ** -10 + 1e-12).all()
    assert (q.float().abs() <= 448).all()
    if not pow2:                                              # each group's largest element maps onto 448 exactly
        hit = (q.float().abs() == 448).float()
        assert (torch.nn.functional.pad(hit, (0, s.shape[1] * group - 300)).view(9, -1, group).amax(-1)[live]
                == 1).all()


def test_round_up_pow2_is_exact():
    vals = [1.0, 1.5, 0.75, 2.0 ** -100, 2.0 ** 100 * 1.0000001, 3e-12, 448.0, 1.0 + 2.0 ** -23]
    got = round_up_pow2(torch.tensor(vals, dtype=torch.float32))
    for v, g in zip(vals, got.tolist()):
        v32 = float(torch.tensor(v, dtype=torch.float32))
        want = 2.0 ** math.ceil(math.log2(v32)) if not math.log2(v32).is_integer() else v32
        assert g == want, (v, g, want)


def test_group_quant_bad_input_is_named_error():
    from bytebound.errors import QuantFormatError
    with pytest.raises(QuantFormatError):
        quantize_fp8_group(torch.zeros(2, 3, 4))


# ---- Triton kernels -----------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("m,k,group,pow2", [(37, 320, 128, False), (37, 320, 128, True), (5, 256, 32, False),
                                            (3, 64, 64, True)])
def test_quantize_groups_matches_reference(fp8k, m, k, group, pow2):
    x = activations(m, k, seed=m + k)
    q, s = fp8k.quantize_fp8_groups(x, group, pow2)
    qr, sr = quantize_fp8_group(x, group, pow2)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == sr.shape
    assert s.stride() == (1, m), "scales are stored group-major ([K/group, M]), read as [M, K/group]"
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s, sr)


@needs_triton
@pytest.mark.parametrize("m,n,k,block,cfg", [
    (5, 96, 256, (128, 128), None),                  # smallest tile (BM 16), N tail inside one tile
    (37, 200, 320, (128, 128), None),                # tails in M, N and K (K = 2.5 scale blocks)
    (9, 64, 96, (32, 32), None),                     # small scale blocks: BK = 32, 2 weight scale rows per tile
    (150, 200, 256, (128, 128), dict(BM=64, BN=64, BK=128, GROUP_M=2, num_warps=4, num_stages=2)),  # grouped order
])
def test_fp8_block_gemm_vs_float64(fp8k, m, n, k, block, cfg):
    wq, sw = weights(n, k, block, seed=n + k)
    x = activations(m, k, seed=m)
    y = fp8k.fp8_block_gemm(x, wq, sw, block, cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    xq, sx = quantize_fp8_group(x, block[1])
    ref, tol = ref_bound(xq, sx, wq, sw, block)
    err = (y.double() - ref).abs()
    assert (err <= tol).all(), f"worst err/tol {(err / tol).max():.3f}"
    assert float(err.norm() / ref.norm()) <= 4e-3
    # Against the unquantised activations the error is E4M3's rounding of x (3 mantissa bits: ~2-3 % per
    # element, RMS), not more: a scale applied to the wrong block or token would be far larger.
    exact = x.double() @ dequantize_fp8_block(wq, sw, block, torch.float64).t()
    assert float((y.double() - exact).norm() / exact.norm()) <= 0.05


@needs_triton
def test_fp8_block_gemm_pow2_activation_scales(fp8k):
    wq, sw = weights(64, 256, seed=1)
    x = activations(17, 256, seed=3)
    y = fp8k.fp8_block_gemm(x, wq, sw, pow2=True)
    xq, sx = quantize_fp8_group(x, 128, pow2=True)
    ref, tol = ref_bound(xq, sx, wq, sw, (128, 128))
    assert ((y.double() - ref).abs() <= tol).all()


@needs_triton
def test_block_linear_prefill_paths(fp8k):
    """``fp8_block_linear`` routes M > 4 by ``prefill``: ``fp8`` is the block GEMM; an unknown name is an error."""
    wq, sw = weights(96, 256, seed=2)
    x = activations(6, 256, seed=6)
    y = fp8k.fp8_block_linear(x, wq, sw, (128, 128), prefill="fp8")
    xq, sx = quantize_fp8_group(x)
    ref, tol = ref_bound(xq, sx, wq, sw, (128, 128))
    assert y.shape == (6, 96) and ((y.double() - ref).abs() <= tol).all()
    with pytest.raises(BackendError, match="prefill"):
        fp8k.fp8_block_linear(x, wq, sw, (128, 128), prefill="int4")


@needs_triton
def test_fp8_block_gemm_bad_input_is_named_error(fp8k):
    wq, sw = quantize_fp8_block(torch.randn(64, 256) * 0.05)
    wq, sw = wq.to(DEV), sw.to(DEV)
    x = activations(8, 256)
    with pytest.raises(BackendError, match="do not multiply"):
        fp8k.fp8_block_gemm(x[:, :128], wq, sw)
    with pytest.raises(BackendError, match="grid"):
        fp8k.fp8_block_gemm(x, wq, sw[:, :1].contiguous())
    with pytest.raises(BackendError, match="E4M3"):
        fp8k.fp8_block_gemm(x, wq.float(), sw)
    wq16, sw16 = quantize_fp8_block(torch.randn(64, 256) * 0.05, (16, 16))
    with pytest.raises(BackendError, match=">= 32"):
        fp8k.fp8_block_gemm(x, wq16.to(DEV), sw16.to(DEV), (16, 16))
    with pytest.raises(BackendError, match="power-of-two group"):
        fp8k.quantize_fp8_groups(x, 96)


def test_triton_linear_prefill_switch():
    from bytebound.kernels.triton_fp8 import PREFILL_PATHS, TritonLinear
    assert TritonLinear().prefill == "dequant"              # the default until measured on the GPU
    assert TritonLinear(prefill="fp8").prefill == "fp8" and "scaled_mm" in PREFILL_PATHS
    with pytest.raises(BackendError, match="prefill must be one of"):
        TritonLinear(prefill="int4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour of the probe")
def test_scaled_mm_probe_says_why_on_cpu():
    from bytebound.kernels.triton_fp8 import scaled_mm_available
    assert "CUDA" in scaled_mm_available(torch.device("cpu"))
    assert "128x128" in scaled_mm_available(torch.device("cpu"), (32, 32))
