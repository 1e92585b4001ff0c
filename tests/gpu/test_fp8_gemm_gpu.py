"""Prefill FP8 block GEMMs of ``kernels.triton_fp8`` on the GPU at Ling-3.0-flash shapes, M = 5, 64, 2048.

For each dense projection shape (N x K) of the model and M:

* ``fp8`` (Triton, FP8 tensor cores) and ``scaled_mm`` (cuBLASLt block scaling, where the probe passes) against
  ``quant.fp8_block_matmul_ref``, the float64 product of the quantised operands (1x128 E4M3 activations, 128x128
  E4M3 weights) dequantised exactly: rel err <= 1e-2, the bound the BF16 ``dequant`` path meets against its own
  float64 reference (asserted in the same test). Both errors are printed.
* Against the unquantised BF16 activations the FP8 paths also carry E4M3's rounding of x (~2-3 % per element):
  rel err <= 0.05.
* The activation quantiser equals ``quant.quantize_fp8_group`` bit for bit (hardware E4M3 conversion).
* ``TritonLinear(prefill=...)`` binds each path and gives the kernel's result for a QLinear.

Weights are synthetic (random, power-of-two 128x128 scales as the checkpoint's ``ue8m0``); activations have a few
outlier channels as real hidden states do.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")]

DEV = "cuda"
# (N, K) of the FP8 dense projections of Ling-3.0-flash (hidden 2560)
LING_SHAPES = {
    "kda_qkvfg": (20480, 2560), "kda_o": (2560, 4096), "mla_q": (6144, 2560), "mla_kv_a": (576, 2560),
    "mla_kv_b": (8192, 512), "mla_o_dense": (2560, 4096), "mlp_gate_up": (6144, 2560), "mlp_down": (2560, 6144),
    "shared_gate_up": (768, 2560), "shared_down": (2560, 768),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_weight(n, k, seed=0):
    from bytebound.quant import quantize_fp8_block
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, device=DEV, generator=g) * 0.02 * (torch.rand(n, 1, device=DEV, generator=g) + 0.5)
    return quantize_fp8_block(w, (128, 128), pow2=True)


def make_x(m, k, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    x = torch.randn(m, k, device=DEV, generator=g)
    x[:, torch.randperm(k, device=DEV, generator=g)[:4]] *= 30
    return x.to(torch.bfloat16)


@pytest.fixture(scope="module")
def fp8k():
    import bytebound.kernels.triton_fp8 as mod
    why = mod.available(torch.device(DEV))
    if why:
        pytest.skip(why)
    return mod


@pytest.mark.parametrize("m", [5, 64, 2048])
@pytest.mark.parametrize("name", list(LING_SHAPES))
def test_fp8_prefill_gemm_ling_shapes(fp8k, name, m):
    from bytebound.quant import dequantize_fp8_block, fp8_block_matmul_ref, quantize_fp8_group
    n, k = LING_SHAPES[name]
    wq, ws = make_weight(n, k, seed=n + k)
    x = make_x(m, k, seed=m)
    wd = dequantize_fp8_block(wq, ws, (128, 128), torch.float64)
    exact = x.double() @ wd.t()
    xq, sx = quantize_fp8_group(x, 128)
    ref_q = fp8_block_matmul_ref(xq, sx, wq, ws)

    y_deq = fp8k.fp8_block_linear(x, wq, ws, (128, 128), prefill="dequant")
    e_deq = rel(y_deq, exact)
    y = fp8k.fp8_block_gemm(x, wq, ws)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    e_fp8, e_fp8_x = rel(y, ref_q), rel(y, exact)
    line = f"{name} M={m}: dequant {e_deq:.2e} | fp8 {e_fp8:.2e} (vs bf16 x {e_fp8_x:.2e})"
    why = fp8k.scaled_mm_available(DEV)
    if why is None:
        y_s = fp8k.scaled_mm_block_gemm(x, wq, fp8k.scaled_mm_weight_scale(ws))
        e_s, e_s_x = rel(y_s, ref_q), rel(y_s, exact)
        line += f" | scaled_mm {e_s:.2e} (vs bf16 x {e_s_x:.2e})"
    print(line)
    assert e_deq <= 1e-2
    assert e_fp8 <= 1e-2
    assert e_fp8_x <= 0.05
    if why is None:
        assert e_s <= 1e-2 and e_s_x <= 0.05


@pytest.mark.parametrize("m,k", [(2048, 2560), (5, 768), (64, 6144)])
def test_group_quant_bit_exact_on_gpu(fp8k, m, k):
    from bytebound.quant import quantize_fp8_group
    x = make_x(m, k)
    x[0] = 0
    for pow2 in (False, True):
        q, s = fp8k.quantize_fp8_groups(x, 128, pow2)
        qr, sr = quantize_fp8_group(x, 128, pow2)
        assert s.stride() == (1, m)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


def test_scaled_mm_probe_reports(fp8k):
    """The probe either passes (and names the API/layout it chose) or says why; it must not raise."""
    why = fp8k.scaled_mm_available(DEV)
    print("scaled_mm:", fp8k.scaled_mm_variant(DEV) or why)
    assert why is None or isinstance(why, str) and why
    if torch.cuda.get_device_capability() != (9, 0):
        assert why is not None


@pytest.mark.parametrize("prefill", ["dequant", "fp8", "scaled_mm"])
def test_triton_linear_prefill_switch(fp8k, prefill):
    from bytebound.errors import BackendError
    from bytebound.layers.linear import QLinear
    from bytebound.quant import fp8_block_matmul_ref, quantize_fp8_group
    n, k = LING_SHAPES["mla_kv_a"]                          # N = 576: a partial weight block row
    lin = QLinear(k, n, "fp8", (128, 128), torch.bfloat16, DEV)
    lin.weight.data, lin.weight_scale_inv.data = make_weight(n, k, seed=3)
    if prefill == "scaled_mm" and fp8k.scaled_mm_available(DEV):
        with pytest.raises(BackendError, match="scaled_mm"):
            fp8k.TritonLinear(prefill=prefill).bind(lin, torch.bfloat16)
        return
    fn = fp8k.TritonLinear(prefill=prefill).bind(lin, torch.bfloat16)
    x = make_x(2 * 37, k).view(2, 37, k)
    y = fn(x)
    assert y.shape == (2, 37, n) and y.dtype == torch.bfloat16
    if prefill == "dequant":
        ref = x.double() @ lin.dequantized(torch.float64).t()
    else:
        xq, sx = quantize_fp8_group(x.reshape(-1, k), 128)
        ref = fp8_block_matmul_ref(xq, sx, lin.weight, lin.weight_scale_inv).view(2, 37, n)
    assert rel(y, ref) <= 1e-2
    y4 = fn(x[:, :2])                                        # M = 4 still takes the GEMV, whatever ``prefill``
    assert rel(y4, x[:, :2].double() @ lin.dequantized(torch.float64).t()) <= 1e-2
