"""GPU tests of the W4A8 gate/up of the ``split`` MoE kernels (config ``A8``, ``kernels.triton_moe_a8``).

* ``quantize_x`` on the GPU equals its torch reference bit for bit (E4M3 round to nearest even, power-of-two
  scale per token, the logical column order);
* the routed MoE with ``A8`` equals the float64 routed sum of the dequantised experts applied to the *quantised* x
  (``xq * sx``, float64), at Ling's shapes, M = 1, 2, 4, with duplicate experts across tokens, with and without the
  shared expert (which keeps BF16 x), at the committed tilings and others; bit-identical on repeat; graph replay ==
  eager. A wrong logical k order (A against B), a wrong tile scale or a missing ``sx`` each give rel ~1, far above
  the bound;
* a binding whose gate/up E8M0 bytes the tile scale cannot take runs the BF16 path and says so.
"""

from __future__ import annotations

import pytest
import torch

from test_kernels_gpu import (DEV, LING, TINY, _moe_config, _poisoned_call, make_experts, make_routing, make_shared,
                              moe_ref64, rel)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or
                                                  torch.cuda.get_device_capability()[0] < 9,
                                                  reason="needs an sm_90 CUDA GPU (wgmma; run scripts/gpu_check.sh "
                                                         "on the device)")]


@pytest.fixture(scope="module")
def ling_experts():
    return make_experts(**{k: v for k, v in LING.items() if k != "k"})


def x_dequant(x: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, H]``: x as the W4A8 kernels see it, ``xq * sx`` in the physical column order."""
    from bytebound.kernels.triton_moe_a8 import reference_quantize_x
    xq, sx = reference_quantize_x(x)
    m, h = x.shape
    c = torch.arange(h, device=x.device)
    src = (c // 32) * 32 + ((c // 4) % 4) * 8 + (c % 4) * 2 + (c // 16) % 2
    out = torch.zeros(m, h, dtype=torch.float64, device=x.device)
    out[:, src] = xq.view(torch.float8_e4m3fn).double()
    return out * sx.double()[:, None]


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("scale", [1.0, 3e-3, 40.0])
def test_quantize_x_equals_reference(m, scale):
    from bytebound.kernels.triton_moe_a8 import quantize_x, reference_quantize_x
    g = torch.Generator(device=DEV).manual_seed(m)
    x = (torch.randn(m, LING["h"], generator=g, device=DEV) * scale).to(torch.bfloat16)
    if m > 1:
        x[1] = 0
    xq, sx = quantize_x(x)
    rq, rs = reference_quantize_x(x)
    assert torch.equal(sx, rs)
    assert torch.equal(xq, rq), f"{int((xq != rq).sum())} bytes differ"
    # the quantisation itself is what W4A8 adds: E4M3 has 3 mantissa bits, a relative step of 2^-4 at most
    assert rel(x_dequant(x), x.double()) < 4e-2


A8_TILINGS = [{"BI": 64, "KP": 5, "num_warps": 8, "A8": 1},                       # the H200 M = 1 tiling
              {"BI": 64, "KP": 2, "KC": 5, "num_warps": 8, "SG": 4, "A8": 1},     # the H200 M = 4 tiling
              {"BI": 32, "KP": 10, "num_warps": 4, "A8": 1},
              {"BI": 64, "KP": 1, "KC": 10, "num_warps": 8, "pdl_in": 1, "A8": 1}]
A8_IDS = ["h200-m1", "h200-m4", "bi32-kp10", "kp1-kc10"]


@pytest.mark.parametrize("tiling", A8_TILINGS, ids=A8_IDS)
@pytest.mark.parametrize("m,dup", [(1, 0), (2, 3), (4, 0), (4, 5)])
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with-shared"])
def test_a8_moe_ling(ling_experts, tiling, m, dup, shared):
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    from bytebound.kernels.torch_ref import shared_expert_reference
    ex = ling_experts
    cfg = fit_config(_moe_config("split", tiling), LING["h"], LING["i"])
    assert cfg["A8"] == 1
    fn = MoEKernel(ex, {mm: cfg for mm in range(1, 5)})
    assert "W4A8 gate/up" in fn.config_source(m, LING["k"]), fn.config_source(m, LING["k"])
    mlp = None
    if shared:
        mlp = make_shared(LING["h"], LING["i"], seed=m + dup)
        fn.bind_shared(mlp)
    ids, w = make_routing(m, LING["e"], LING["k"], shared=dup, seed=m + dup)
    x = torch.randn(m, LING["h"], device=DEV).to(torch.bfloat16)
    out = _poisoned_call(fn, x, ids, w)
    ref = moe_ref64(ex, x_dequant(x), ids, w)
    if shared:
        ref = ref + shared_expert_reference(mlp, x, torch.float64)
    assert torch.isfinite(out.float()).all(), "unwritten or non-finite output"
    err = rel(out, ref)
    assert err <= 1e-2, f"A8 {tiling} M={m} dup={dup} shared={shared}: rel {err:.3e}"
    # against the unquantised x the error is the activation rounding's, a few percent: the reference above is
    # the one that pins the kernel
    assert torch.equal(fn(x, ids, w), out), "repeated call differs"
    for _ in range(5):
        assert torch.equal(fn(x, ids, w), out)


def test_a8_graph_replay_equals_eager(ling_experts):
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    cfg = fit_config(_moe_config("split", A8_TILINGS[1]), LING["h"], LING["i"])
    fn = MoEKernel(ling_experts, {mm: cfg for mm in range(1, 5)})
    ids, w = make_routing(4, LING["e"], LING["k"], shared=2, seed=3)
    x = torch.randn(4, LING["h"], device=DEV).to(torch.bfloat16)
    eager = fn(x, ids, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x, ids, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, ids, w)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_a8_refused_for_scales_it_cannot_take():
    """A gate/up E8M0 byte of 0 (scale 2^-127) is outside the tile scale's range: the launch runs the BF16 gate/up,
    says why in its config source, and stays correct against the unquantised x."""
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    ex = make_experts(TINY["e"], TINY["h"], TINY["i"], seed=5)
    ex.w13_scale.data[3, 7, 1] = 0
    cfg = fit_config(_moe_config("split", {"A8": 1}), TINY["h"], TINY["i"])
    fn = MoEKernel(ex, {mm: cfg for mm in range(1, 5)})
    src = fn.config_source(1, TINY["k"])
    assert "no W4A8: W4A8 needs gate/up E8M0 bytes in 1..254, got 0.." in src, src
    ids, w = make_routing(4, TINY["e"], TINY["k"], shared=1, seed=9)
    ids[0, 0] = 3
    x = torch.randn(4, TINY["h"], device=DEV).to(torch.bfloat16)
    assert rel(_poisoned_call(fn, x, ids, w), moe_ref64(ex, x, ids, w)) <= 1e-2
