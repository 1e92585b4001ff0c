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


# ---- the post-attention residual add + RMSNorm folded into the router launch (gemv_route_add_norm) ----

# the interpreter's float32 -> bf16 cast rounds to nearest even here, as the GPU does (the folded add rounds to bf16)
router_rne = triton_module_fixture("router_rne", "bytebound.kernels.triton_router", bf16_round_nearest=True)


@pytest.mark.parametrize("fold", ["1", "0"])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("wdt,be", [(torch.bfloat16, 2), (torch.float32, 4), (torch.float32, 1)])
def test_gemv_route_add_norm_matches_add_norm_then_route(router_rne, m, wdt, be, fold, monkeypatch):
    """``gemv_route_add_norm(delta, h)`` == torch's ``h + delta`` (bit-equal), ``RMSNorm`` of it (the norm kernels'
    tolerance: two bf16 steps, nearly all equal) and ``route(F.linear(x.float(), W))`` of the returned x (same
    experts, weights to 1e-5); H 300 is not a power of two (masked tail). ``fold`` 0
    (``BYTEBOUND_ROUTER_NORM_FOLD=0``): the add + norm as the norm kernel's launch, then ``gemv_route``."""
    from bytebound.layers.norm import RMSNorm
    monkeypatch.setenv("BYTEBOUND_ROUTER_NORM_FOLD", fold)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    e, g, tg, k, hid = 64, 4, 2, 4, 300
    gen = torch.Generator().manual_seed(m * 3 + be)
    norm = RMSNorm(hid, 1e-6)
    norm.weight.data = (torch.rand(hid, generator=gen) + 0.5).to(wdt)
    norm = norm.to(dev)
    wg = (torch.randn(e, hid, generator=gen) * 0.05).to(dev)
    b = (torch.randn(e, generator=gen) * 0.5).to(dev)
    for trial in range(2):
        h = (torch.randn(m, hid, generator=gen) * 3).to(torch.bfloat16).to(dev)
        delta = (torch.randn(m, hid, generator=gen) * 0.4).to(torch.bfloat16).to(dev)
        ids, w, x, h2 = router_rne.gemv_route_add_norm(delta, h, norm.weight, norm.eps, wg, b, k, g, tg, True, 2.5,
                                                       be=be)
        want_h = h + delta
        assert h2.dtype == x.dtype == torch.bfloat16 and x.shape == h2.shape == (m, hid)
        assert torch.equal(h2, want_h)
        want_x = norm(want_h)
        ulp = torch.exp2(torch.floor(torch.log2(want_x.float().abs().clamp(min=1e-30))) - 7)
        assert ((x.float() - want_x.float()).abs() <= 2 * ulp).all()
        assert (x != want_x).float().mean() < 0.01
        rid, rw = route(torch.nn.functional.linear(x.float(), wg), b, k, g, tg, True, 2.5)
        for a, b_ in zip(as_sets(ids.cpu(), w.cpu()), as_sets(rid.cpu(), rw.cpu())):
            assert a.keys() == b_.keys()
            for key in a:
                assert abs(a[key] - b_[key]) <= 1e-5 * max(1.0, abs(b_[key]))
    with pytest.raises(BackendError, match="delta of h's shape and dtype"):
        router_rne.gemv_route_add_norm(delta.float(), h, norm.weight, norm.eps, wg, b, k, g, tg, True, 2.5)
    with pytest.raises(BackendError, match="M <= 4"):
        z = torch.zeros(5, hid, dtype=torch.bfloat16, device=dev)
        router_rne.gemv_route_add_norm(z, z, norm.weight, norm.eps, wg, b, k, g, tg, True, 2.5)


def test_model_post_attention_norms_fold_into_the_router(router_rne):
    """The tiny model bound as on CUDA with the fused norms and the router GEMV: every MoE layer's post-attention add
    + norm runs in its router launch (``MoE.add_norm_forward``), the other boundaries in the norm kernel; the hidden
    states (target and NEXTN) equal the torch path's to float32 rounding."""
    from conftest import make_model, triton_kernels
    from bytebound.layers.moe import MoE
    from bytebound.layers.norm import RMSNorm
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model().to(dev)
    cfg = model.cfg
    ids = torch.randint(4, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1)).to(dev)
    pos = torch.arange(3, device=dev)
    with torch.no_grad():
        want = model(ids)
        want_n = model.nextn_forward(ids[:, 1:], want[:, :-1], pos)
    calls = {"router": 0, "norm": 0}

    def counted(key, fn):
        def run(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)
        return run
    norms = [m for m in model.modules() if type(m) is RMSNorm]
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    with triton_kernels("bytebound.kernels.triton_norm", bf16_round_nearest=True) as tn:
        try:
            for m in norms:
                m.fn, m.add_fn = tn.rmsnorm, counted("norm", tn.add_rmsnorm)
            for m in moes:
                m.gemv_route_fn, m.route_m = router_rne.gemv_route, 4         # as bind_model binds router=gemv
                m.gemv_add_norm_fn = counted("router", router_rne.gemv_route_add_norm)
            with torch.no_grad():
                got = model(ids)
                got_n = model.nextn_forward(ids[:, 1:], got[:, :-1], pos)
        finally:
            for m in norms:
                m.fn = m.add_fn = None
            for m in moes:
                m.gemv_route_fn = m.gemv_add_norm_fn = None
                m.route_m = 0
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers)) + 1          # + the NEXTN layer's
    assert calls["router"] == n_moe == len(moes)
    assert calls["router"] + calls["norm"] == 2 * cfg.num_hidden_layers + 2      # every add, once
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_n, want_n, rtol=1e-5, atol=1e-5)
