"""Sigmoid router with expert bias and group-limited top-k (DeepSeek-V3 noaux_tc, as Ling-3.0 routes): the bias
only selects; the weights are the unbiased sigmoid scores renormalised x routed_scaling_factor."""

from __future__ import annotations

import itertools

import pytest
import torch

from bytebound.config import tiny_config
from bytebound.layers.moe import MoE, route, swiglu
from conftest import make_model

E, G, TOPK_GROUP, K, SCALE = 16, 4, 2, 4, 2.5


def route_ref(logits, bias, k=K, n_group=G, topk_group=TOPK_GROUP, norm=True, scale=SCALE):
    """float64 brute force: try every allowed set of groups, score groups by their top-2 biased scores."""
    s = torch.sigmoid(logits.double())
    sb = s + (bias.double() if bias is not None else 0)
    per = s.shape[-1] // n_group
    ids_all, w_all = [], []
    for row_s, row_sb in zip(s, sb):
        gscore = [sorted(row_sb[g * per:(g + 1) * per].tolist(), reverse=True)[:2] for g in range(n_group)]
        gscore = [sum(x) for x in gscore]
        groups = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
        allowed = [e for g in groups for e in range(g * per, (g + 1) * per)]
        ids = sorted(allowed, key=lambda e: -row_sb[e].item())[:k]
        w = row_s[ids]
        if norm:
            w = w / w.sum()
        ids_all.append(ids)
        w_all.append((w * scale).tolist())
    return ids_all, w_all


def as_sets(ids, w):
    """{expert: weight} per row (top-k order is unspecified: sorted=False)."""
    return [dict(zip(i, x)) for i, x in zip(ids.tolist(), w.tolist())]


def test_large_bias_selects_biased_experts_with_unbiased_weights():
    # tiny sigmoid scores everywhere (logits ~ -9: s ~ 1e-4); bias 12 on experts 1, 2 (group 0) and 13, 14 (group 3)
    g = torch.Generator().manual_seed(0)
    logits = -9.0 + 0.5 * torch.randn(6, E, generator=g)
    logits[:, 5:12] = -2.0                                 # the best *raw* scores are in groups 1 and 2
    bias = torch.zeros(E)
    biased = [1, 2, 13, 14]
    bias[biased] = 12.0
    ids, w = route(logits, bias, K, G, TOPK_GROUP, True, SCALE)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (6, K)
    s = torch.sigmoid(logits.double())
    for r in range(6):
        assert sorted(ids[r].tolist()) == biased
        want = s[r, ids[r]] / s[r, ids[r]].sum() * SCALE        # unbiased scores, renormalised, scaled
        assert torch.allclose(w[r].double(), want, rtol=1e-6, atol=0)
        assert (w[r] > 0.1).all()                              # not ~1e-4, and not bias-dominated
        assert abs(w[r].sum().item() - SCALE) < 1e-5
    ref_ids, ref_w = route_ref(logits, bias)
    for got, ri, rw in zip(as_sets(ids, w), ref_ids, ref_w):
        assert set(got) == set(ri)
        for e, x in zip(ri, rw):
            assert abs(got[e] - x) < 1e-6


def test_without_norm_weights_are_raw_scores_times_scale():
    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(1))
    ids, w = route(logits, None, K, G, TOPK_GROUP, False, SCALE)
    assert torch.allclose(w, torch.sigmoid(logits).gather(1, ids) * SCALE)


def test_group_limited_selection():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(400, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.5
    ids, w = route(logits, bias, K, G, TOPK_GROUP, True, SCALE)
    sb = torch.sigmoid(logits) + bias
    gscore = sb.view(-1, G, E // G).topk(2, -1).values.sum(-1)
    kept = gscore.topk(TOPK_GROUP, -1).indices                          # [M, 2]
    groups_used = ids // (E // G)
    for r in range(400):
        assert set(groups_used[r].tolist()) <= set(kept[r].tolist())     # nothing from a dropped group
    # and this matters: for many rows the global (ungrouped) top-4 would use a dropped group
    glob = sb.topk(K, -1).indices // (E // G)
    violates = [(not set(glob[r].tolist()) <= set(kept[r].tolist())) for r in range(400)]
    assert sum(violates) > 40
    ref_ids, ref_w = route_ref(logits, bias)
    for got, ri, rw in zip(as_sets(ids, w), ref_ids, ref_w):
        assert set(got) == set(ri)
        assert max(abs(got[e] - x) for e, x in zip(ri, rw)) < 1e-5


def test_group_score_uses_top2_not_max():
    # group 0: one very high expert; group 1: two medium ones -> group 1 wins on top-2 sum with topk_group 1
    logits = torch.full((1, 8), -10.0)
    logits[0, 0] = 10.0                      # s ~ 1.0, second best in group 0 ~ 0
    logits[0, 4] = logits[0, 5] = 1.0        # s ~ 0.73 each -> 1.46 > 1.0
    ids, _ = route(logits, None, 2, 2, 1, True, 1.0)
    assert sorted(ids[0].tolist()) == [4, 5]


@pytest.mark.parametrize("n_group, topk_group, k", [(1, 1, 4), (4, 4, 4), (8, 3, 6), (2, 1, 2)])
def test_matches_brute_force_reference(n_group, topk_group, k):
    g = torch.Generator().manual_seed(n_group * 10 + k)
    logits = torch.randn(64, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.2
    ids, w = route(logits, bias, k, n_group, topk_group, True, 1.7)
    ref_ids, ref_w = route_ref(logits, bias, k, n_group, topk_group, True, 1.7)
    for got, ri, rw in zip(as_sets(ids, w), ref_ids, ref_w):
        assert set(got) == set(ri)
        assert max(abs(got[e] - x) for e, x in zip(ri, rw)) < 1e-5


def test_moe_module_routes_in_float32_and_sums_experts():
    """MoE.forward == sum_k w_k SwiGLU_{e_k}(x) + shared(x), computed here by hand in float64."""
    model = make_model(tiny_config(), seed=3, expert_bias_std=0.3)
    moe: MoE = model.decoder_layers[1].mlp
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        y = moe(x)
        logits = x[0].double() @ moe.gate.weight.double().t()
        ids, w = route_ref(logits, moe.gate.expert_bias)
        w13, w2 = moe.experts.w13.double(), moe.experts.w2.double()
        inter = moe.experts.inter
        ref = []
        for t in range(5):
            acc = torch.zeros(64, dtype=torch.float64)
            for e, we in zip(ids[t], w[t]):
                h = w13[e] @ x[0, t].double()
                acc += we * (w2[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
            sh = moe.shared_experts
            hs_g, hs_u = sh.gate_proj.weight.double() @ x[0, t].double(), sh.up_proj.weight.double() @ x[0, t].double()
            acc += sh.down_proj.weight.double() @ (torch.nn.functional.silu(hs_g) * hs_u)
            ref.append(acc)
    assert torch.allclose(y[0].double(), torch.stack(ref), rtol=1e-5, atol=1e-5)


def test_swiglu_limit():
    gate = torch.tensor([-20.0, 0.0, 3.0, 30.0])
    up = torch.tensor([5.0, -30.0, 30.0, -30.0])
    out = swiglu(gate, up, 7.0)
    ref = torch.nn.functional.silu(gate).clamp(max=7.0) * up.clamp(-7.0, 7.0)
    assert torch.equal(out, ref) and out[3].item() == -49.0
    assert torch.equal(swiglu(gate, up), torch.nn.functional.silu(gate) * up)


def test_every_group_pair_reachable():
    """Bias can steer selection to any topk_group groups: all 6 pairs of 4 groups are reachable."""
    seen = set()
    for pair in itertools.combinations(range(G), 2):
        bias = torch.zeros(E)
        for gi in pair:
            bias[gi * 4:gi * 4 + 2] = 5.0
        ids, _ = route(torch.zeros(1, E), bias, K, G, TOPK_GROUP, True, 1.0)
        seen.add(tuple(sorted(set((ids[0] // 4).tolist()))))
    assert seen == set(itertools.combinations(range(G), 2))


def test_prefill_through_a_4_token_kernel_in_slices_is_exact():
    """bind_model gives an M <= 4 MoE kernel (triton) a prefill that feeds it 4-token slices: the result must equal
    one call over all tokens, and the kernel must never see more than 4 tokens."""
    from bytebound.kernels.torch_ref import TorchMoE
    from bytebound.layers.moe import RoutedExperts
    from bytebound.runner.backends import token_slices
    torch.manual_seed(0)
    ex = RoutedExperts(16, 64, 32, "plain", torch.float32, "cpu", None)
    with torch.no_grad():
        ex.w13.normal_(0, 0.1)
        ex.w2.normal_(0, 0.1)
    ref_fn = TorchMoE().bind(ex, torch.float32)
    seen = []

    def kernel(x, ids, w):              # stands in for MoEKernel: refuses more than 4 tokens
        assert x.shape[0] <= 4 and ids.shape[0] == x.shape[0] == w.shape[0]
        seen.append(x.shape[0])
        return ref_fn(x, ids, w)
    for m in (1, 4, 5, 11):
        x = torch.randn(m, 64)
        ids = torch.stack([torch.randperm(16)[:4] for _ in range(m)])
        w = torch.rand(m, 4)
        seen.clear()
        out = token_slices(kernel, 4)(x, ids, w)
        torch.testing.assert_close(out, ref_fn(x, ids, w), rtol=1e-6, atol=1e-6)
        assert sum(seen) == m and max(seen) <= 4


def test_position_routes_sees_routing_folded_into_the_add_norm_launch():
    """With the post-attention add + RMSNorm folded into the router launch (``MoE.gemv_add_norm_fn``, CUDA),
    routing never calls ``MoE.router``: the recorder must still see every token's routes, else the canaries and
    the verify == decode test cannot tell a route flip from a bug. A torch stand-in for the fused kernel, which
    bypasses the instance's router, checks it on CPU."""
    from bytebound.runner.runner import ModelRunner
    from bytebound.verify.routing import position_routes
    model = make_model()
    moes = [layer.mlp for layer in model.decoder_layers if isinstance(layer.mlp, MoE)]
    assert moes
    for m in moes:
        def fold(delta, h, w, eps, *_, m=m):
            h2 = h + delta
            xf = h2.float()
            x = (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(h2.dtype)).to(h2.dtype)
            ids, wt = type(m).router(m, x)        # the class's routing: no instance wrapper sees it
            return ids, wt, x, h2
        m.gemv_add_norm_fn, m.route_m = fold, 8
    r = ModelRunner(model, 32)
    r.prefill(torch.tensor([3, 5, 7]))
    with position_routes(r) as routes:
        r.forward(torch.tensor([11]))
    assert set(routes) == {3} and len(routes[3]) == len(moes)
    assert all(m.gemv_add_norm_fn.__name__ == "fold" for m in moes)     # restored afterwards
