"""The fused routing kernel (``kernels.triton_router``) against ``layers.moe.route``: same experts, same weights.
On a CPU machine it runs in Triton's interpreter (TRITON_INTERPRET=1) when Triton is installed; CI has no Triton
and skips with that reason. On a GPU it compiles for real (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from bytebound.errors import BackendError
from bytebound.layers.moe import route
from conftest import needs_triton, triton_module_fixture

try:
    import triton.language as tl        # _v0_route_kernel's body (its annotations are strings)
except ImportError:                     # CI: no Triton, and every test here skips
    tl = None

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
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 64, generator=gen).to(dev)
    b = (torch.randn(64, generator=gen) * 0.5).to(dev)
    ids, w = router.fused_route(logits, b, 4, 4, 2, True, 2.5)
    rid, rw = route(logits, b, 4, 4, 2, True, 2.5)
    for a, b_ in zip(as_sets(ids.cpu(), w.cpu()), as_sets(rid.cpu(), rw.cpu())):
        assert a.keys() == b_.keys()
        for key in a:
            assert abs(a[key] - b_[key]) <= 1e-5 * max(1.0, abs(b_[key]))


@pytest.mark.parametrize("e,g,tg,k,m,h", [(512, 8, 4, 8, 1, 2560), (512, 8, 4, 8, 4, 2560), (64, 4, 2, 4, 3, 300),
                                          (64, 1, 1, 6, 2, 256), (8, 1, 1, 2, 4, 256)])
@pytest.mark.parametrize("be,nw", [(2, 4), (1, 4), (4, 8)])
def test_gemv_route_matches_linear_then_route(router, e, g, tg, k, m, h, be, nw):
    """Router GEMV + routing in one launch (``gemv_route``) == ``route(F.linear(x.float(), W))``: same experts,
    weights to 1e-5, over repeated calls (the ticket re-arms itself) and an H that is not a multiple of the
    kernel's 256-column chunk; E = 8 at M = 4 has fewer programs than rows at be 4 (E/be = 2: the routing tail
    must not split there)."""
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


@pytest.mark.parametrize("m", [1, 4])
def test_gemv_route_probe_without_routing_rearms_the_ticket(router, m):
    """The benchmark's probe (``_gemv_route(..., route=False)``, ``scripts/bench_moe.py --router``) writes the same
    logits as the full launch and re-arms the shared ticket: the next real call routes
    correctly (a probe that left the ticket taken would make every later router launch in the process skip its
    routing)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    e, g, tg, k, h = 64, 4, 2, 4, 256
    gen = torch.Generator(device="cpu").manual_seed(31 + m)
    wg = (torch.randn(e, h, generator=gen) * 0.05).to(dev)
    b = (torch.randn(e, generator=gen) * 0.5).to(dev)
    x = torch.randn(m, h, generator=gen).to(dev).to(torch.bfloat16)
    router._gemv_route(x, None, None, 0.0, wg, b, k, g, tg, True, 2.5, 4, 4, route=False)
    from bytebound.kernels.scratch import scratch
    assert int(scratch(x.device, "router_ticket", 1, torch.int32)[0]) == 0
    logits = scratch(x.device, "router_logits", router.MAX_M * e)[:m * e].view(m, e)
    torch.testing.assert_close(logits.cpu(), torch.nn.functional.linear(x.float(), wg).cpu(), rtol=1e-5, atol=1e-5)
    for _ in range(2):
        ids, w = router.gemv_route(x, wg, b, k, g, tg, True, 2.5, be=4, num_warps=4)
        rid, rw = route(torch.nn.functional.linear(x.float(), wg), b, k, g, tg, True, 2.5)
        assert [set(r) for r in ids.cpu().tolist()] == [set(r) for r in rid.cpu().tolist()]


# ---- the post-attention residual add + RMSNorm folded into the router launch (gemv_route_add_norm) ----

# the interpreter's float32 -> bf16 cast rounds to nearest even here, as the GPU does (the folded add rounds to bf16)
router_rne = triton_module_fixture("router_rne", "bytebound.kernels.triton_router", bf16_round_nearest=True)


@pytest.mark.parametrize("fold,batch", [("1", "1"), ("0", "1"), ("1", "0")])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("wdt,be", [(torch.bfloat16, 2), (torch.float32, 4), (torch.float32, 1)])
def test_gemv_route_add_norm_matches_add_norm_then_route(router_rne, m, wdt, be, fold, batch, monkeypatch):
    """``gemv_route_add_norm(delta, h)`` == torch's ``h + delta`` (bit-equal), ``RMSNorm`` of it (the norm kernels'
    tolerance: two bf16 steps, nearly all equal) and ``route(F.linear(x.float(), W))`` of the returned x (same
    experts, weights to 1e-5); H 300 is not a power of two (masked tail). ``fold`` 0
    (``BYTEBOUND_ROUTER_NORM_FOLD=0``): the add + norm as the norm kernel's launch, then ``gemv_route``; ``batch``
    0 (``BYTEBOUND_ROUTER_BATCH_ROWS=0``): M > 1 rows loaded and normalised one after another."""
    from bytebound.layers.norm import RMSNorm
    monkeypatch.setenv("BYTEBOUND_ROUTER_NORM_FOLD", fold)
    monkeypatch.setenv("BYTEBOUND_ROUTER_BATCH_ROWS", batch)
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


# ---- bit-exact equality with the previous routing code on ties, signs, magnitudes and -inf ----

def _v0_route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, scale, E: tl.constexpr, G: tl.constexpr,
                     TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
                     NORM: tl.constexpr):
    """The routing as the kernels computed it before the int64-key selection (iterative float argmax, a where-sum
    per pick; one row per program), kept as the reference for the tie rule: ids must equal it bit for bit,
    weights to float32 rounding (:func:`assert_same_route`). (Jitted by the ``v0`` fixture, under the interpreter on CPU.)"""
    EG: tl.constexpr = E // G
    NEG: tl.constexpr = float("-inf")
    row = tl.program_id(0)
    offs = tl.arange(0, E)
    s = tl.sigmoid(tl.load(logits_ptr + row * E + offs).to(tl.float32))
    if HAS_BIAS:
        sb = s + tl.load(bias_ptr + offs).to(tl.float32)
    else:
        sb = s
    sb3 = tl.reshape(sb, (G, EG))
    col = tl.arange(0, EG)
    a1 = tl.argmax(sb3, axis=1)
    top2 = tl.max(tl.where(col[None, :] == a1[:, None], NEG, sb3), axis=1)
    gs = tl.max(sb3, axis=1) + top2
    gidx = tl.arange(0, G)
    keep = tl.zeros([G], tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        hit = gidx == tl.argmax(gs, axis=0)
        keep = tl.where(hit, 1, keep)
        gs = tl.where(hit, NEG, gs)
    keep_e = tl.reshape(tl.broadcast_to(keep[:, None], (G, EG)), (E,))
    sel = tl.where(keep_e != 0, sb, NEG)
    kk = tl.arange(0, KP)
    out_ids = tl.zeros([KP], tl.int64)
    out_w = tl.zeros([KP], tl.float32)
    for i in tl.static_range(K):
        a = tl.argmax(sel, axis=0)
        hit = offs == a
        out_ids = tl.where(kk == i, a.to(tl.int64), out_ids)
        out_w = tl.where(kk == i, tl.sum(tl.where(hit, s, 0.0), axis=0), out_w)
        sel = tl.where(hit, NEG, sel)
    if NORM:
        out_w = out_w / (tl.sum(out_w, axis=0) + 1e-20)
    tl.store(ids_ptr + row * K + kk, out_ids, mask=kk < K)
    tl.store(w_ptr + row * K + kk, out_w * scale, mask=kk < K)


@pytest.fixture(scope="module")
def v0(router):
    """``_v0_route_kernel`` jitted while ``router``'s fixture has the interpreter on (on a CPU machine)."""
    import triton
    return triton.jit(_v0_route_kernel)


def v0_route(v0, logits, bias, k, g, tg, norm, scale):
    import triton
    m, e = logits.shape
    ids = torch.empty(m, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(m, k, dtype=torch.float32, device=logits.device)
    v0[(m,)](logits.contiguous(), bias if bias is not None else logits, ids, w, float(scale), E=e, G=g,
             TOPK_GROUP=tg if g > 1 else 1, K=k, KP=triton.next_power_of_2(k), HAS_BIAS=bias is not None,
             NORM=bool(norm))
    return ids, w


# The routing weights are s / sum(s) over the K picks: two kernels that sum in different reduction trees (the 1-D
# reference vs the [MP, KP] layout of the routing kernels; on a GPU the tree follows the layout, in the interpreter
# numpy's order) may round that sum differently: each order is within K - 1 roundings of the exact sum. The ids come
# from int64 keys and must be equal: the tie rule is what these tests pin down.
WEIGHT_RTOL = 16 * 2.0 ** -24      # 2 x (K - 1) additions' rounding at K = 8, + 2 for the division and the scale


def assert_same_route(ids, w, rid, rw, ctx):
    """``ids == rid`` exactly and ``w`` equal to ``rw`` within :data:`WEIGHT_RTOL` (relative; zeros exact)."""
    assert torch.equal(ids, rid), (ctx, ids, rid)
    err = ((w - rw).abs() / rw.abs().clamp_min(torch.finfo(torch.float32).tiny)).max().item() if w.numel() else 0.0
    assert err <= WEIGHT_RTOL and torch.equal(w == 0, rw == 0), (ctx, err, w, rw)


TIE_KINDS = ["ties", "negative_ties", "mixed_sign", "magnitudes", "equal", "neg_inf", "neg_inf_groups"]


def tie_case(kind, m, e, g, gen):
    """``(logits [m, e], bias [e] or None)``, float32 with bf16-exact logits (a router GEMV against the identity
    reproduces them): exact ties between experts and between groups (``ties``, ``negative_ties``: every sb < 0),
    both signs of sb, sigmoid saturated to 0 and 1 with biases of 1e30 and subnormals (``magnitudes``), every
    score equal and no bias (``equal``), and -inf biases that leave fewer than K finite experts (``neg_inf``) or
    fewer than topk_group finite groups (``neg_inf_groups``)."""
    def pick(values, shape):
        return torch.tensor(values, dtype=torch.float32)[torch.randint(len(values), shape, generator=gen)]
    eg = e // g
    if kind == "ties":
        return torch.randint(-2, 3, (m, e), generator=gen) * 0.5, torch.randint(-2, 3, (e,), generator=gen) * 0.125
    if kind == "negative_ties":
        return (torch.randint(-2, 3, (m, e), generator=gen) * 0.5,
                -2.0 - torch.randint(0, 3, (e,), generator=gen) * 0.25)
    logits = (torch.randn(m, e, generator=gen) * 2).bfloat16().float()
    if kind == "mixed_sign":
        return logits, torch.randn(e, generator=gen) * 0.5 - 0.5
    if kind == "magnitudes":
        return (pick([-120.0, -60.0, 0.0, 60.0, 2.0 ** -100], (m, e)),
                pick([0.0, 1e30, -1e30, 1e-40, -1e-40, 2.0 ** -126, -3.0], (e,)))
    if kind == "equal":
        return torch.zeros(m, e), None
    bias = torch.full((e,), float("-inf"))
    if kind == "neg_inf":               # 3 finite experts: fewer than K
        bias[torch.randperm(e, generator=gen)[:3]] = torch.randn(3, generator=gen)
    else:                               # 2 finite experts, both in one group: one finite group score
        grp = int(torch.randint(g, (1,), generator=gen))
        bias[grp * eg + torch.randperm(eg, generator=gen)[:2]] = torch.randn(2, generator=gen)
    return logits, bias


ROUTE_SHAPES = [(512, 8, 4, 8), (64, 4, 2, 4), (64, 1, 1, 6)]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")       # sigmoid(-120) in numpy: 0, as meant
@pytest.mark.parametrize("e,g,tg,k", ROUTE_SHAPES)
@pytest.mark.parametrize("kind", TIE_KINDS)
def test_fused_route_equals_previous_code_exactly(router, v0, e, g, tg, k, kind):
    """``fused_route`` == the previous routing code (``_v0_route_kernel``): ids bit for bit, weights to float32
    rounding (:func:`assert_same_route`; one program per row, so rows of different draws in one call)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(e + g + k + TIE_KINDS.index(kind))
    for m in (1, 3):
        logits, b = tie_case(kind, m, e, g, gen)
        logits, b = logits.to(dev), (b.to(dev) if b is not None else None)
        for norm in (True, False):
            ids, w = router.fused_route(logits, b, k, g, tg, norm, 2.5)
            rid, rw = v0_route(v0, logits, b, k, g, tg, norm, 2.5)
            assert_same_route(ids, w, rid, rw, (m, norm))
        if kind.startswith("neg_inf"):      # out of finite scores, argmax picks expert 0 (again)
            assert (ids == 0).any(1).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("e,g,tg,k,h", [(512, 8, 4, 8, 600), (64, 4, 2, 4, 100)])
@pytest.mark.parametrize("kind", TIE_KINDS)
def test_gemv_route_equals_previous_code_exactly(router_rne, v0, e, g, tg, k, h, kind):
    """``gemv_route`` (M rows routed by the last program, or one row each by the last M: the split tail) == the
    previous routing code, ids bit for bit and weights to float32 rounding (:func:`assert_same_route`), M
    1..4 (on a GPU at the default ``be``/warps; the interpreter gets 16 experts a program, fewer programs to
    run): the identity router weight makes the logits x's values exactly. And
    ``gemv_route_add_norm`` (delta 0; at M 3, the interpreter being slow) routes the logits it computed (read back
    from the scratch) as the previous code routes them."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(e + h + TIE_KINDS.index(kind))
    wg = torch.eye(e, h).to(dev)
    nw = torch.ones(h, dtype=torch.bfloat16, device=dev)
    be = None if torch.cuda.is_available() else 16
    for m in range(1, 5):
        logits, b = tie_case(kind, m, e, g, gen)
        b = b.to(dev) if b is not None else None
        x = torch.zeros(m, h, dtype=torch.bfloat16)
        x[:, :e] = logits.bfloat16()
        x = x.to(dev)
        ids, w = router_rne.gemv_route(x, wg, b, k, g, tg, True, 2.5, be=be)
        rid, rw = v0_route(v0, x[:, :e].float(), b, k, g, tg, True, 2.5)
        assert_same_route(ids, w, rid, rw, m)
        if m != 3:
            continue
        ids, w, _, _ = router_rne.gemv_route_add_norm(torch.zeros_like(x), x, nw, 1e-6, wg, b, k, g, tg, True, 2.5,
                                                      be=be)
        used = router_rne.scratch(dev, "router_logits", router_rne.MAX_M * e)[:m * e].view(m, e)
        rid, rw = v0_route(v0, used, b, k, g, tg, True, 2.5)
        assert_same_route(ids, w, rid, rw, ("add_norm", m))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("e,g,tg,k,nw", [(512, 8, 4, 8, 4), (64, 4, 2, 4, 8), (64, 1, 1, 6, 4)])
@pytest.mark.parametrize("kind", TIE_KINDS)
def test_segmented_routing_equals_one_segment(router, e, g, tg, k, nw, kind, monkeypatch):
    """The segmented routing tail (``_route_rows_seg``, the default: per-segment picks inside a warp, then the
    candidates placed by rank) == the one-segment tail (``BYTEBOUND_ROUTER_SEG=0``), ids bit for bit and weights to
    float32 rounding, on the tie, sign, magnitude and -inf cases (fewer finite experts than K, or finite groups than
    topk_group: iterative argmax's expert 0 / group 0), M = 1 and 4 rows in one program."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7 * e + g + k + TIE_KINDS.index(kind))
    monkeypatch.setenv("BYTEBOUND_ROUTER_SEG", "1")
    assert router.route_segments(e, g, k, nw) > 1
    wg = torch.eye(e).to(dev)
    for m in (1, 4):
        logits, b = tie_case(kind, m, e, g, gen)
        b = b.to(dev) if b is not None else None
        x = logits.bfloat16().to(dev)
        out = {}
        for seg in ("1", "0"):
            monkeypatch.setenv("BYTEBOUND_ROUTER_SEG", seg)
            monkeypatch.setenv("BYTEBOUND_ROUTER_SPLIT_TAIL", "0")     # one program routes every row
            out[seg] = router.gemv_route(x, wg, b, k, g, tg, True, 2.5, be=16, num_warps=nw)
        assert_same_route(*out["1"], *out["0"], (m, kind))


@pytest.mark.parametrize("tail", ["fused_route", "gemv_route"])
def test_route_tie_rule_and_negative_scores(router, tail, monkeypatch):
    """The tie rule and the sign handling, spelled out: equal scores go lowest index first (groups too), ids
    come out in decreasing sb, and all-negative sb (bias < -1) orders as the floats do; for the one-row routing
    kernel and for ``gemv_route``'s segmented tail (an identity router weight: the logits are x)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    e, g, tg, k = 64, 4, 2, 4
    z = torch.zeros(1, e, device=dev)
    if tail == "fused_route":
        fn = router.fused_route
    else:
        eye = torch.eye(e, device=dev)
        monkeypatch.setenv("BYTEBOUND_ROUTER_SEG", "1")          # the segmented tail (the default)

        def fn(logits, bias, *a):
            return router.gemv_route(logits.bfloat16(), eye, bias, *a, be=16, num_warps=4)
    ids, w = fn(z, None, k, g, tg, True, 2.0)          # all equal: groups 0, 1; experts 0..3
    assert ids.tolist() == [[0, 1, 2, 3]] and torch.equal(w.cpu(), torch.full((1, k), 0.5))
    b = torch.zeros(e, device=dev)
    b[40] = b[20] = 1.0                     # groups 1 and 2 tie for first; 20 and 40 tie, then 16, 17 (sb 0.5)
    ids, _ = fn(z, b, k, g, tg, True, 1.0)
    assert ids.tolist() == [[20, 40, 16, 17]]
    down = -1.0 - torch.arange(e, device=dev) / 1024    # sb < 0, falling with the index: experts 0.. of groups 0, 1
    ids, _ = fn(z, down, k, g, tg, True, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3]]
    up = -1.0 + torch.arange(e, device=dev) / 1024 - 0.5    # sb < 0, rising: the last experts, largest first
    ids, w = fn(z, up, k, g, tg, True, 1.0)
    assert ids.tolist() == [[63, 62, 61, 60]]
    rid, rw = route(z, up, k, g, tg, True, 1.0)
    assert set(rid[0].tolist()) == set(ids[0].tolist()) and torch.allclose(w, rw)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU: the split routing tail's programs wait for each other, which Triton's "
                           "interpreter (one program after another) cannot run; the interpreter takes the one-program "
                           "tail, tested above")
@pytest.mark.parametrize("m", [2, 3, 4])
@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("be,nw", [(4, 8), (2, 4), (1, 4)])
def test_gemv_route_split_tail_equals_one_program_tail(router, m, fold, be, nw, monkeypatch):
    """M > 1 on a GPU: the last M programs route one row each (``SPLIT_TAIL``) == the last program routing all rows
    (``BYTEBOUND_ROUTER_SPLIT_TAIL=0``): the same experts and x, the weights to float32 rounding (a row's
    normalising sum runs in another layout), over 20 calls in a row (the ticket, counted up to E/be + M, must re-arm
    itself every time), with and without the add + norm fold; and the same experts as ``route``."""
    e, h, k = 512, 2560, 8
    gen = torch.Generator(device="cpu").manual_seed(m * 10 + be)
    wg = (torch.randn(e, h, generator=gen) * 0.05).cuda()
    b = (torch.randn(e, generator=gen) * 0.5).cuda()
    nwt = (1 + 0.1 * torch.randn(h, generator=gen)).cuda().to(torch.bfloat16)
    for trial in range(20):
        x = torch.randn(m, h, generator=gen).cuda().to(torch.bfloat16)
        d = torch.randn(m, h, generator=gen).cuda().to(torch.bfloat16)
        out = {}
        for split in ("1", "0"):
            monkeypatch.setenv("BYTEBOUND_ROUTER_SPLIT_TAIL", split)
            if fold:
                out[split] = router.gemv_route_add_norm(d, x, nwt, 1e-6, wg, b, k, 8, 4, True, 2.5, be=be,
                                                        num_warps=nw)[:3]
            else:
                out[split] = router.gemv_route(x, wg, b, k, 8, 4, True, 2.5, be=be, num_warps=nw) + (x,)
        (i1, w1, x1), (i0, w0, x0) = out["1"], out["0"]
        assert torch.equal(i1, i0) and torch.equal(x1, x0)
        assert torch.allclose(w1, w0, rtol=1e-6, atol=0)
        rid, rw = route(torch.nn.functional.linear(x1.float(), wg), b, k, 8, 4, True, 2.5)
        for a, b_ in zip(as_sets(i1.cpu(), w1.cpu()), as_sets(rid.cpu(), rw.cpu())):
            assert a.keys() == b_.keys()


def test_split_tail_needs_a_program_per_row(router, monkeypatch):
    """``split_tail_for``: the split routing tail only for M > 1 with at least M programs (E/be >= M), never under
    the interpreter, and off with ``BYTEBOUND_ROUTER_SPLIT_TAIL=0``."""
    monkeypatch.delenv("BYTEBOUND_ROUTER_SPLIT_TAIL", raising=False)
    assert router.split_tail_for(4, 512, 4, False) and router.split_tail_for(2, 8, 4, False)
    assert not router.split_tail_for(1, 512, 4, False)
    assert not router.split_tail_for(4, 8, 4, False) and not router.split_tail_for(3, 8, 4, False)
    assert not router.split_tail_for(4, 512, 4, True)
    monkeypatch.setenv("BYTEBOUND_ROUTER_SPLIT_TAIL", "0")
    assert not router.split_tail_for(4, 512, 4, False)
