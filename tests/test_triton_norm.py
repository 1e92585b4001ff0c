"""The fused RMSNorm kernels (``kernels.triton_norm``) against ``layers.norm``: same values, same rounding.
On a CPU machine they run in Triton's interpreter (TRITON_INTERPRET=1) when Triton is installed; CI has no Triton
and skips with that reason. On a GPU they compile for real (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from bytebound.layers.norm import RMSNorm, RMSNormGated
from conftest import needs_triton, triton_module_fixture

pytestmark = needs_triton
norm = triton_module_fixture("norm", "bytebound.kernels.triton_norm", bf16_round_nearest=True)


DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("d,rows,xdt,wdt", [(2560, 1, torch.bfloat16, torch.float32),
                                            (2560, 4, torch.bfloat16, torch.bfloat16),
                                            (512, 3, torch.float32, torch.float32), (1536, 2, torch.bfloat16,
                                                                                      torch.float32)])
def test_rmsnorm_matches_module(norm, d, rows, xdt, wdt):
    g = torch.Generator().manual_seed(d + rows)
    m = RMSNorm(d, 1e-6)
    m.weight.data = (torch.rand(d, generator=g) + 0.5).to(wdt)
    m = m.to(DEV)
    x = (torch.randn(1, rows, d, generator=g) * 3).to(xdt).to(DEV)
    want = m(x)
    got = norm.rmsnorm(x, m.weight, m.eps)
    assert got.dtype == want.dtype and got.shape == want.shape
    if xdt == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    # Same rounding points (normalised value to bf16, then the weight). The float32 statistics may differ in their
    # last bits (reduction order), which flips the first bf16 rounding of a few elements: each such element is
    # then off by one bf16 step, at most two after the second rounding. Nothing else may differ.
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp(min=1e-30))) - 7)
    assert ((got.float() - want.float()).abs() <= 2 * ulp).all()
    assert (got != want).float().mean() < 0.01


def test_rmsnorm_gated_matches_module(norm):
    g = torch.Generator().manual_seed(0)
    m = RMSNormGated(128, 1e-6)
    m.weight.data = torch.rand(128, generator=g) + 0.5
    m = m.to(DEV)
    o = torch.randn(1, 2, 32, 128, generator=g).to(DEV)                    # KDA output: float32, per head
    gate = torch.randn(1, 2, 32, 128, generator=g).to(torch.bfloat16).to(DEV)
    torch.testing.assert_close(norm.rmsnorm_gated(o, gate, m.weight, m.eps), m(o, gate), rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_named_errors(norm):
    from bytebound.errors import BackendError
    with pytest.raises(BackendError, match="weight"):
        norm.rmsnorm(torch.zeros(1, 64), torch.ones(32), 1e-6)
    with pytest.raises(BackendError, match="gate shape"):
        norm.rmsnorm_gated(torch.zeros(2, 64), torch.zeros(1, 64), torch.ones(64), 1e-6)
