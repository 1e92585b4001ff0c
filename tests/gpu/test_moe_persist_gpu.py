"""The persistent one-launch MoE (``moe[triton]`` variant ``persist``, ``kernels.triton_moe_persist``) on the GPU.

* vs the float64 reference the ``split`` tests use (routed sum, + the float64 shared expert), rel <= 1e-2, at Ling
  shapes (E 512, H 2560, I 768, top-8) and a tiny shape, M = 1..4 with duplicate experts at M > 1, with and
  without the shared expert, with the SwiGLU clamp on either part;
* == ``split`` to the summation-order tolerance (both round the activations to BF16; the H sums run in a different
  order), two calls bit-equal;
* CUDA-graph replay == eager over 3 replays of a graph holding 2 launches (the grid barrier re-arms), and new
  routing through the same graph;
* a phase-B tiling with every warp on its own slot (G = num_warps) and with fewer (G < num_warps), HC/IC variants.
"""

from __future__ import annotations

import pytest
import torch

from test_kernels_gpu import DEV, LING, TINY, make_experts, make_routing, make_shared, moe_ref64, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")]


@pytest.fixture(scope="module")
def ling_experts():
    return make_experts(**{k: v for k, v in LING.items() if k != "k"})


def _persist(ex, h, i, tiling=None):
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    cfg = fit_config(dict({"variant": "persist"}, **(tiling or {})), h, i)
    return MoEKernel(ex, {mm: cfg for mm in range(1, 5)})


def _split(ex, h, i):
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    from bytebound.kernels.triton_moe_split import SPLIT_DEFAULT
    cfg = fit_config(dict(SPLIT_DEFAULT), h, i)
    return MoEKernel(ex, {mm: cfg for mm in range(1, 5)})


def _poisoned(fn, x, ids, w):
    """Call with the caching allocator's next block pre-filled with NaN, so unwritten outputs show up."""
    torch.full((x.shape[0], x.shape[1]), float("nan"), dtype=torch.bfloat16, device=DEV)
    return fn(x, ids, w)


@pytest.mark.parametrize("m,dup", [(1, 0), (2, 3), (3, 8), (4, 0), (4, 5)])
@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "routed+shared"])
@pytest.mark.parametrize("limits", [(None, None), (1.0, None), (None, 0.75)], ids=["noclamp", "routed", "shared"])
def test_persist_ling(ling_experts, m, dup, with_shared, limits):
    """persist vs float64 (rel <= 1e-2) and vs split (the same maths; rel <= 2e-3: BF16 activations whose float32
    H sums ran in another order), two calls bit-equal. ``dup`` experts of token 0 are shared by every token
    (``dup = 8``: every token picks the same 8 experts, the dedup's extreme)."""
    from bytebound.kernels.torch_ref import shared_expert_reference
    if limits[1] is not None and not with_shared:
        pytest.skip("the shared expert's clamp needs the shared expert")
    ex, h, i, k, e = ling_experts, LING["h"], LING["i"], LING["k"], LING["e"]
    ex.limit = limits[0]
    try:
        fn, ref_fn = _persist(ex, h, i), _split(ex, h, i)
        ids, w = make_routing(m, e, k, shared=dup, seed=10 * m + dup)
        x = torch.randn(m, h, device=DEV).to(torch.bfloat16)
        ref = moe_ref64(ex, x, ids, w)
        if with_shared:
            mlp = make_shared(h, i, limit=limits[1], seed=m + dup)
            fn.bind_shared(mlp)
            ref_fn.bind_shared(mlp)
            assert fn.shared_for(m, k)
            ref = ref + shared_expert_reference(mlp, x, torch.float64)
            share = rel(ref - shared_expert_reference(mlp, x, torch.float64), ref)
            assert share > 3e-2, f"test data: the shared expert is only {share:.2e} of the sum, too small to detect"
        out = _poisoned(fn, x, ids, w)
        assert torch.isfinite(out.float()).all(), "unwritten or non-finite output"
        assert rel(out, ref) <= 1e-2, f"persist M={m} dup={dup} limits={limits}: rel {rel(out, ref):.3e}"
        sp = ref_fn(x, ids, w)
        assert rel(out, sp) <= 2e-3, f"persist vs split M={m} dup={dup}: rel {rel(out, sp):.3e}"
        for _ in range(3):
            assert torch.equal(_poisoned(fn, x, ids, w), out), "repeated call differs"
    finally:
        ex.limit = None


@pytest.mark.parametrize("tiling", [None, {"num_warps": 2}, {"num_warps": 8}, {"HC": 256, "IC": 128},
                                    {"per_sm": 1}, {"prefetch": False}],
                         ids=["default", "warps2", "warps8", "hc256-ic128", "one-per-sm", "no-prefetch"])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_persist_tilings(ling_experts, tiling, m):
    """Other tilings of the same maths: warp counts (phase B's slot group G = min(warps, 8 / MP): 8 warps at M = 1
    take 8 slots per step, 2 warps at M = 4 one row group), chunk widths, one program per SM (several items per
    program in both phases), no L2 prefetch; with the shared expert."""
    from bytebound.kernels.torch_ref import shared_expert_reference
    ex, h, i, k, e = ling_experts, LING["h"], LING["i"], LING["k"], LING["e"]
    fn = _persist(ex, h, i, tiling)
    mlp = make_shared(h, i, seed=40 + m)
    fn.bind_shared(mlp)
    ids, w = make_routing(m, e, k, shared=2, seed=50 + m)
    x = torch.randn(m, h, device=DEV).to(torch.bfloat16)
    ref = moe_ref64(ex, x, ids, w) + shared_expert_reference(mlp, x, torch.float64)
    out = _poisoned(fn, x, ids, w)
    assert rel(out, ref) <= 1e-2, f"{tiling} M={m}: rel {rel(out, ref):.3e}"
    assert torch.equal(fn(x, ids, w), out)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_persist_tiny(m):
    """A small shape (E 16, H 256, I 128, top-4): one H chunk in phase A, I = one 128-column chunk in phase B."""
    from bytebound.kernels.torch_ref import shared_expert_reference
    ex = make_experts(TINY["e"], TINY["h"], TINY["i"], limit=0.5, seed=3)
    fn = _persist(ex, TINY["h"], TINY["i"])
    mlp = make_shared(TINY["h"], TINY["i"], seed=9)
    ids, w = make_routing(m, TINY["e"], TINY["k"], shared=2, seed=7)
    x = torch.randn(m, TINY["h"], device=DEV).to(torch.bfloat16)
    out = _poisoned(fn, x, ids, w)
    assert rel(out, moe_ref64(ex, x, ids, w)) <= 1e-2
    fn.bind_shared(mlp)
    out = _poisoned(fn, x, ids, w)
    assert rel(out, moe_ref64(ex, x, ids, w) + shared_expert_reference(mlp, x, torch.float64)) <= 1e-2


@pytest.mark.parametrize("m", [1, 4])
def test_persist_graph_replay(ling_experts, m):
    """A graph holding two persist launches (two layers' worth: the same barrier words, re-armed by each launch),
    replayed 3 times: every replay == eager; then new routing through the same graph == the float64 reference."""
    from bytebound.kernels.torch_ref import shared_expert_reference
    ex, h, i, k, e = ling_experts, LING["h"], LING["i"], LING["k"], LING["e"]
    fn = _persist(ex, h, i)
    mlp = make_shared(h, i, seed=61)
    fn.bind_shared(mlp)
    ids, w = make_routing(m, e, k, shared=3, seed=11)
    ids2, w2 = make_routing(m, e, k, shared=1, seed=13)
    x = torch.randn(m, h, device=DEV).to(torch.bfloat16)
    x2 = torch.randn(m, h, device=DEV).to(torch.bfloat16)
    eager, eager2 = fn(x, ids, w), fn(x2, ids2, w2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x, ids, w)
        fn(x2, ids2, w2)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(x, ids, w)
        out2 = fn(x2, ids2, w2)
    for r in range(3):
        out.zero_()
        out2.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {r}: first launch differs from eager"
        assert torch.equal(out2, eager2), f"replay {r}: second launch differs from eager"
    assert torch.equal(fn(x, ids, w), eager), "eager after the replays differs (barrier not re-armed)"
    ids3, w3 = make_routing(m, e, k, seed=12)
    ids.copy_(ids3)
    w.copy_(w3)
    g.replay()
    torch.cuda.synchronize()
    ref = moe_ref64(ex, x, ids3, w3) + shared_expert_reference(mlp, x, torch.float64)
    assert rel(out, ref) <= 1e-2, f"new routing through the graph: rel {rel(out, ref):.3e}"


def test_persist_pdl_in_after_the_router(ling_experts):
    """``pdl_in`` 1: the kernel is a PDL dependent of the router (every program waits before touching ids, x or the
    scratch): router + persist == the float64 reference for the router's ids, repeated bit-identically."""
    from bytebound.kernels.torch_ref import shared_expert_reference
    from bytebound.kernels.triton_router import gemv_route
    ex, h, i, k, e = ling_experts, LING["h"], LING["i"], LING["k"], LING["e"]
    g = torch.Generator(device=DEV).manual_seed(93)
    wg = torch.randn(e, h, generator=g, device=DEV) * 0.02
    bias = torch.randn(e, generator=g, device=DEV) * 0.01
    fn = _persist(ex, h, i, {"pdl_in": 1})
    mlp = make_shared(h, i, seed=7)
    fn.bind_shared(mlp)
    x = torch.randn(1, h, device=DEV).to(torch.bfloat16)

    def layer():
        ids, w = gemv_route(x, wg, bias, k, 8, 4, True, 2.5)
        return fn(x, ids, w), ids, w
    out, ids, w = layer()
    ref = moe_ref64(ex, x, ids, w) + shared_expert_reference(mlp, x, torch.float64)
    assert rel(out, ref) <= 1e-2, f"rel {rel(out, ref):.3e}"
    for _ in range(5):
        assert torch.equal(layer()[0], out)


def test_persist_grid_is_co_resident(ling_experts):
    """The grid ``launch_persist`` chose fits the GPU at once (what the barrier needs): P <= SMs x the compiled
    kernel's programs per SM, read from the loaded binary."""
    from bytebound.kernels import triton_moe_persist as tp
    ex = ling_experts
    fn = _persist(ex, LING["h"], LING["i"])
    ids, w = make_routing(1, LING["e"], LING["k"], seed=1)
    fn(torch.randn(1, LING["h"], device=DEV).to(torch.bfloat16), ids, w)
    assert tp._GRID, "no grid was computed"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for key, p in tp._GRID.items():
        per_sm = dict(key[-1])["per_sm"]           # the key ends with the fitted config's items
        assert 1 <= p <= sms * per_sm, f"{key}: P={p}"
