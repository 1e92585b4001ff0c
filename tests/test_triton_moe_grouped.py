"""The prefill MoE grouped GEMM (``kernels.triton_moe_grouped``) against a float64 routed sum from the dequantised
MXFP4 experts. On a CPU machine it runs in Triton's interpreter when Triton is installed (CI has none and skips with
that reason); on the GPU ``tests/gpu/test_kernels_gpu.py`` runs it at Ling-3.0-flash shapes."""

from __future__ import annotations

import pytest
import torch

from bytebound.layers.moe import RoutedExperts, swiglu
from bytebound.quant import dequantize_mxfp4
from conftest import needs_triton, triton_module_fixture

pytestmark = needs_triton
grouped = triton_module_fixture("grouped", "bytebound.kernels.triton_moe_grouped", bf16_round_nearest=True)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_experts(e, h, i, limit=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = RoutedExperts(e, h, i, "mxfp4", torch.bfloat16, DEV, limit)
    ex.w13.data = torch.randint(0, 256, (e, 2 * i, h // 2), generator=g, dtype=torch.uint8).to(DEV)
    ex.w13_scale.data = torch.randint(118, 123, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8).to(DEV)
    ex.w2.data = torch.randint(0, 256, (e, h, i // 2), generator=g, dtype=torch.uint8).to(DEV)
    ex.w2_scale.data = torch.randint(118, 123, (e, h, i // 32), generator=g, dtype=torch.uint8).to(DEV)
    return ex


def ref64(ex, x, ids, w):
    """float64 ``sum_j w[m, j] * down_e(SwiGLU(gate_e x, up_e x))`` over the dequantised experts."""
    y = torch.zeros(x.shape[0], ex.hidden, dtype=torch.float64)
    xd = x.double().cpu()
    for e in ids.unique().tolist():
        w13 = dequantize_mxfp4(ex.w13[e].cpu(), ex.w13_scale[e].cpu(), torch.float64)
        w2 = dequantize_mxfp4(ex.w2[e].cpu(), ex.w2_scale[e].cpu(), torch.float64)
        rows, cols = (ids.cpu() == e).nonzero(as_tuple=True)
        hh = xd[rows] @ w13.t()
        a = swiglu(hh[:, :ex.inter], hh[:, ex.inter:], ex.limit)
        y.index_add_(0, rows, (a @ w2.t()) * w.cpu().double()[rows, cols, None])
    return y


def routing(m, e, k, skew=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if skew:        # most tokens pick from the first few experts; many experts get no token at all
        pool = torch.arange(min(e, k + 3))
        ids = torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:k]] for _ in range(m)])
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    w = torch.rand(m, k, generator=g) + 0.1
    return ids.to(DEV), (w / w.sum(-1, keepdim=True) * 2.5).float().to(DEV)


def rel(a, b):
    return float((a.double().cpu() - b).norm() / b.norm())


@pytest.mark.parametrize("deq", ["int", "float"])
@pytest.mark.parametrize("m,skew,limit", [(5, False, None), (37, False, 0.02), (37, True, None), (1, False, None)])
def test_grouped_matches_float64(grouped, m, skew, limit, deq):
    """Both MXFP4 decoders (BF16 bits built in integers, or float32 arithmetic) give the float64 routed sum."""
    e, h, i, k = 16, 256, 128, 4
    ex = make_experts(e, h, i, limit=limit, seed=m)
    g = torch.Generator().manual_seed(100 + m)
    x = (torch.randn(m, h, generator=g) * 2).to(torch.bfloat16).to(DEV)
    ids, w = routing(m, e, k, skew=skew, seed=m)
    fn = grouped.GroupedMoE(ex, dict(grouped.prefill_config(m, k, e), deq=deq))
    out = fn(x, ids, w)
    assert out.shape == (m, h) and out.dtype == torch.bfloat16
    ref = ref64(ex, x, ids, w)
    assert torch.isfinite(out.float()).all()
    assert rel(out, ref) <= 1e-2
    if limit is not None:   # the clamp really bites at this scale: without it the result is far off
        ex.limit = None
        assert rel(out, ref64(ex, x, ids, w)) > 5e-2


def test_expert_blocks_layout(grouped):
    """Blocks cover every slot exactly once, each block holds one expert's slots, empty experts own no block."""
    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [5, 3]], device=DEV)
    order, counts, tstart, bstart, bexp = grouped.expert_blocks(ids, 8, 2)
    assert counts.tolist() == [2, 1, 0, 4, 0, 1, 0, 0]
    assert tstart.tolist() == [0, 2, 3, 3, 7, 7, 8, 8]
    # expert 0: 1 block, 1: 1, 3: 2, 5: 1 -> 5 blocks; bound ceil(8/2) + min(8, 8) = 12, the rest idle (= E)
    assert bexp.tolist() == [0, 1, 3, 3, 5] + [8] * 7
    assert bstart.tolist()[:6] == [0, 1, 2, 2, 4, 4]
    flat = ids.reshape(-1)
    assert flat[order.long()].tolist() == sorted(flat.tolist())
    assert sorted(order.tolist()) == list(range(8))


def test_tiles_fit_small_shapes(grouped):
    """H = 96 (a multiple of 32 but not of 64): the tiles shrink to divide it and the result stays right."""
    e, h, i, k, m = 8, 96, 64, 2, 9
    ex = make_experts(e, h, i, seed=3)
    x = torch.randn(m, h, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEV)
    ids, w = routing(m, e, k, seed=5)
    fn = grouped.GroupedMoE(ex)
    assert fn.config(m, k)["BK"] == 32
    assert rel(fn(x, ids, w), ref64(ex, x, ids, w)) <= 1e-2
