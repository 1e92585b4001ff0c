"""The fused routing kernel (``kernels.triton_router``) against ``layers.moe.route``: same experts, same weights.
On a CPU machine it runs in Triton's interpreter (TRITON_INTERPRET=1) when Triton is installed; CI has no Triton
and skips with that reason. On a GPU it compiles for real (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from bytebound.errors import BackendError
from bytebound.layers.moe import route
from conftest import needs_triton, triton_module_fixture

pytestmark = needs_triton
router = triton_module_fixture("router", "bytebound.kernels.triton_router")


def as_sets(ids, w):
    return [dict(zip(i.tolist(), x.tolist())) for i, x in zip(ids, w)]


@pytest.mark.parametrize("e,g,tg,k,m,bias,norm", [(512, 8, 4, 8, 1, True, True), (512, 8, 4, 8, 4, True, True),
                                                  (512, 8, 4, 8, 3, False, True), (64, 4, 2, 4, 2, True, False),
                                                  (64, 1, 1, 6, 1, True, True)])
@pytest.mark.parametrize("nw", [1, 4])
def test_fused_route_matches_reference(router, e, g, tg, k, m, bias, norm, nw):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(e + m + k)
    for trial in range(3):
        logits = (torch.randn(m, e, generator=gen) * 2).to(dev)
        b = (torch.randn(e, generator=gen) * 0.5).to(dev) if bias else None
        ids, w = router.fused_route(logits, b, k, g, tg, norm, 2.5, num_warps=nw)
        rid, rw = route(logits, b, k, g, tg, norm, 2.5)
        assert ids.shape == (m, k) and ids.dtype == torch.int64 and w.dtype == torch.float32
        got, want = as_sets(ids.cpu(), w.cpu()), as_sets(rid.cpu(), rw.cpu())
        for a, b_ in zip(got, want):
            assert a.keys() == b_.keys()
            for key in a:
                assert abs(a[key] - b_[key]) <= 1e-5 * max(1.0, abs(b_[key]))


def test_router_shape_is_checked_once_at_bind(router):
    """The routing kernels' shape constraints are a bind-time check (``shape_error``, read by ``bind_model``), not
    a per-call one; which M reach ``fused_route`` is the binding's decision (one program per row, so a wider call
    is still exact)."""
    assert router.shape_error(512, 8) is None and router.shape_error(64, 1) is None
    assert "power of two" in router.shape_error(96, 8) and "divisible" in router.shape_error(64, 3)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 64, generator=gen)
    b = torch.randn(64, generator=gen) * 0.5
    ids, w = router.fused_route(logits, b, 4, 4, 2, True, 2.5)
    rid, rw = route(logits, b, 4, 4, 2, True, 2.5)
    for a, b_ in zip(as_sets(ids, w), as_sets(rid, rw)):
        assert a.keys() == b_.keys()
        for key in a:
            assert abs(a[key] - b_[key]) <= 1e-5 * max(1.0, abs(b_[key]))


@pytest.mark.parametrize("e,g,tg,k,m,h", [(512, 8, 4, 8, 1, 2560), (512, 8, 4, 8, 4, 2560), (64, 4, 2, 4, 3, 300),
                                          (64, 1, 1, 6, 2, 256)])
@pytest.mark.parametrize("be,nw", [(2, 4), (1, 4), (4, 8)])
def test_gemv_route_matches_linear_then_route(router, e, g, tg, k, m, h, be, nw):
    """Router GEMV + routing in one launch (``gemv_route``) == ``route(F.linear(x.float(), W))``: same experts,
    weights to 1e-5, over repeated calls (the ticket re-arms itself) and an H that is not a multiple of the
    kernel's 256-column chunk."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(e + m + k + h)
    wg = (torch.randn(e, h, generator=gen) * 0.05).to(dev)
    b = (torch.randn(e, generator=gen) * 0.5).to(dev)
    for trial in range(3):
        x = torch.randn(m, h, generator=gen).to(dev).to(torch.bfloat16)
        ids, w = router.gemv_route(x, wg, b, k, g, tg, True, 2.5, be=be, num_warps=nw)
        rid, rw = route(torch.nn.functional.linear(x.float(), wg), b, k, g, tg, True, 2.5)
        assert ids.shape == (m, k) and ids.dtype == torch.int64 and w.dtype == torch.float32
        for a, b_ in zip(as_sets(ids.cpu(), w.cpu()), as_sets(rid.cpu(), rw.cpu())):
            assert a.keys() == b_.keys()
            for key in a:
                assert abs(a[key] - b_[key]) <= 1e-5 * max(1.0, abs(b_[key]))
    with pytest.raises(BackendError):
        router.gemv_route(torch.randn(5, h).to(dev), wg, b, k, g, tg, True, 2.5)
    ids0, w0 = router.gemv_route(torch.randn(0, h).to(dev), wg, b, k, g, tg, True, 2.5)
    assert ids0.shape == (0, k) and w0.shape == (0, k)
