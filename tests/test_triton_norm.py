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


def _assert_norm_close(got, want):
    """As test_rmsnorm_matches_module: float32 to float32 rounding; bf16 within two bf16 steps, nearly all equal."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp(min=1e-30))) - 7)
    assert ((got.float() - want.float()).abs() <= 2 * ulp).all()
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("xdt,wdt", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float32, torch.float32)])
def test_add_rmsnorm_matches_torch_add_then_module(norm, rows, xdt, wdt):
    """``add_rmsnorm(delta, h)`` against the unfused block (torch's ``h + delta``, then ``RMSNorm``): the new residual
    bit-equal to torch's add (one rounding of the float32 sum), the normed value as :func:`rmsnorm` is. The delta is
    of the residual's magnitude and below it, so the bf16 sum rounds in most elements (a missing rounding shows)."""
    d = 320
    g = torch.Generator().manual_seed(rows * 7 + (xdt == torch.float32))
    m = RMSNorm(d, 1e-6)
    m.weight.data = (torch.rand(d, generator=g) + 0.5).to(wdt)
    m = m.to(DEV)
    h = (torch.randn(1, rows, d, generator=g) * 3).to(xdt).to(DEV)
    delta = (torch.randn(1, rows, d, generator=g) * 0.37).to(xdt).to(DEV)
    h_in, delta_in = h.clone(), delta.clone()
    want_h = h + delta
    want_x = m(want_h)
    x, h2 = norm.add_rmsnorm(delta, h, m.weight, m.eps)
    assert h2.dtype == x.dtype == xdt and h2.shape == x.shape == h.shape
    assert torch.equal(h2, want_h)
    if xdt == torch.bfloat16:       # the add rounds: the float32 sum differs from the stored one somewhere
        assert not torch.equal(h.float() + delta.float(), h2.float())
    _assert_norm_close(x, want_x)
    # the fused norm reads the rounded sum: the same as the plain kernel on it
    assert torch.equal(x, norm.rmsnorm(want_h, m.weight, m.eps))
    assert torch.equal(h, h_in) and torch.equal(delta, delta_in), "the inputs are not written (out of place)"


def test_add_norm_module_binds_the_kernel(norm):
    """``RMSNorm.add_norm``: unbound it is torch's add then the norm (the values of an unfused block); with
    ``add_fn`` bound the same values through one kernel; delta None passes the residual through untouched; a delta of
    another dtype takes the torch path rather than the kernel (which refuses it with a named error)."""
    from bytebound.errors import BackendError
    g = torch.Generator().manual_seed(3)
    m = RMSNorm(64, 1e-6).to(DEV)
    m.weight.data = (torch.rand(64, generator=g) + 0.5).to(DEV)
    h = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16).to(DEV)
    delta = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16).to(DEV)
    x0, h0 = m.add_norm(delta, h)
    assert torch.equal(h0, h + delta) and torch.equal(x0, m(h + delta))
    xn, hn = m.add_norm(None, h)
    assert hn is h and torch.equal(xn, m(h))
    m.fn, m.add_fn = norm.rmsnorm, norm.add_rmsnorm
    x1, h1 = m.add_norm(delta, h)
    assert torch.equal(h1, h0)
    _assert_norm_close(x1, x0)
    x2, h2 = m.add_norm(delta.float(), h)                       # promoted by torch, as an unfused block would
    assert h2.dtype == torch.float32 and torch.equal(h2, h.float() + delta.float())
    with pytest.raises(BackendError, match="delta of h's shape and dtype"):
        norm.add_rmsnorm(delta.float(), h, m.weight, m.eps)
    with pytest.raises(BackendError, match="delta of h's shape and dtype"):
        norm.add_rmsnorm(delta[:, :1], h, m.weight, m.eps)


def test_model_residual_adds_run_inside_the_norms(norm):
    """The tiny model with every RMSNorm bound to the kernels (as ``bind_model(fused_norm=True)`` binds them): each
    residual add runs inside the norm after it (2 per decoder layer, the first layer's input norm having nothing to
    add, plus the final norm's; 2 in the NEXTN layer), and the hidden states equal the torch path's to float32
    rounding."""
    from conftest import make_model
    model = make_model().to(DEV)
    cfg = model.cfg
    ids = torch.randint(4, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.no_grad():
        want = model(ids)
        want_n = model.nextn_forward(ids[:, 1:], want[:, :-1], torch.arange(4, device=DEV))
    calls = []

    def counted(*a):
        calls.append(1)
        return norm.add_rmsnorm(*a)
    norms = [m for m in model.modules() if type(m) is RMSNorm]
    try:
        for m in norms:
            m.fn, m.add_fn = norm.rmsnorm, counted
        with torch.no_grad():
            got = model(ids)
            n_target = len(calls)
            got_n = model.nextn_forward(ids[:, 1:], got[:, :-1], torch.arange(4, device=DEV))
    finally:
        for m in norms:
            m.fn = m.add_fn = None
    assert n_target == 2 * cfg.num_hidden_layers and len(calls) - n_target == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_n, want_n, rtol=1e-5, atol=1e-5)
