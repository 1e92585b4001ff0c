"""The lean CPU decode/verify paths (issue 22 item 8) against independent float64 references: the routed-expert
rows on views of the resident weights, the KDA short conv as window products, the fused float32 RMSNorms and
the dense MLP's gate|up projection bound as one product. Speed is not asserted (docs/perf/cpu-decode-nano.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bytebound.kernels import torch_ref
from bytebound.kernels.torch_ref import moe_reference
from bytebound.layers.kda import CONV_WINDOW_MAX_T, KimiDeltaAttention
from bytebound.layers.moe import DenseMLP, RoutedExperts
from bytebound.layers.norm import RMSNorm, RMSNormGated
from bytebound.quant import dequantize_mxfp4


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def routed_float64(ex, x, ids, w):
    """``sum_j w_j W2_e (silu(G_e x) * U_e x)`` (clamped by the layer's limit) per row, float64, explicit loops."""
    if ex.fmt == "mxfp4":
        w13 = dequantize_mxfp4(ex.w13, ex.w13_scale, torch.float64)
        w2 = dequantize_mxfp4(ex.w2, ex.w2_scale, torch.float64)
    else:
        w13, w2 = ex.w13.double(), ex.w2.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, we in zip(ids[t].tolist(), w[t].double()):
            h = w13[e] @ x[t].double()
            g, u = h[:ex.inter], h[ex.inter:]
            a = F.silu(g)
            if ex.limit is not None:
                a, u = a.clamp(max=ex.limit), u.clamp(-ex.limit, ex.limit)
            out[t] += we * (w2[e] @ (a * u))
    return out


@pytest.fixture(scope="module")
def bound_quant_model(quant_ckpt):
    from bytebound.checkpoint.loader import load_model
    from bytebound.runner.backends import BackendPlan, bind_model
    model = load_model(quant_ckpt, "cpu")
    bind_model(model, BackendPlan.default("cpu"), "cpu")
    return model


@pytest.mark.parametrize("fmt, limit", [("mxfp4", None), ("mxfp4", 0.7), ("plain", None)])
@torch.inference_mode()
def test_routed_rows_match_float64(bound_quant_model, fmt, limit):
    """The CPU row form (one GEMV pair per token and slot on views of the resident weights, no gather copy) gives
    the routed sum of a float64 reference for decode (M = 1) and verify (M = 4) shapes, and it is the path taken."""
    src = next(m for m in bound_quant_model.modules() if isinstance(m, RoutedExperts))
    if fmt == "mxfp4":
        ex = src
    else:
        ex = RoutedExperts(src.n, src.hidden, src.inter, "plain", torch.float32, "cpu", None)
        ex.w13.data = dequantize_mxfp4(src.w13, src.w13_scale)
        ex.w2.data = dequantize_mxfp4(src.w2, src.w2_scale)
    saved = ex.limit
    ex.limit = limit
    try:
        g = torch.Generator().manual_seed(3)
        for m in (1, 4):
            x = torch.randn(m, ex.hidden, generator=g)
            ids = torch.stack([torch.randperm(ex.n, generator=g)[:4] for _ in range(m)])
            w = torch.rand(m, 4, generator=g)
            calls = []
            orig = torch_ref._moe_rows_cpu
            torch_ref._moe_rows_cpu = lambda *a: calls.append(1) or orig(*a)
            try:
                y = moe_reference(ex, x, ids, w)
            finally:
                torch_ref._moe_rows_cpu = orig
            assert calls, "the CPU row form was not taken"
            ref = routed_float64(ex, x, ids, w)
            assert y.dtype == torch.float32 and y.shape == x.shape
            assert rel(y, ref) < 2e-6, (fmt, limit, m)
            # every row is computed alone: a verify row equals the decode step of that row
            for t in range(m):
                assert torch.equal(moe_reference(ex, x[t:t + 1], ids[t:t + 1], w[t:t + 1])[0], y[t])
    finally:
        ex.limit = saved


def test_routed_rows_reference_sensitivity(bound_quant_model):
    """The float64 reference tells one wrong slot weight from rounding (so the tolerance above can fail)."""
    ex = next(m for m in bound_quant_model.modules() if isinstance(m, RoutedExperts))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, ex.hidden, generator=g)
    ids, w = torch.tensor([[0, 3, 5, 9]]), torch.rand(1, 4, generator=g)
    bad = w.clone()
    bad[0, 2] *= 1.01
    with torch.inference_mode():
        assert rel(moe_reference(ex, x, ids, bad), routed_float64(ex, x, ids, w)) > 1e-4


def conv_float64(full, weight, t):
    """Causal depthwise conv + SiLU over ``full [B, C, k-1+T]`` with ``weight [C, 1, k]``, float64 loops."""
    k = weight.shape[-1]
    fd, wd = full.double(), weight.double()[:, 0]
    y = torch.stack([(fd[..., i:i + k] * wd).sum(-1) for i in range(t)], -1)
    return F.silu(y).transpose(1, 2)


@torch.inference_mode()
def test_short_conv_window_form(bound_quant_model):
    """KDA's short conv in the CPU window form (T <= CONV_WINDOW_MAX_T) matches a float64 depthwise conv, updates
    the conv state to the last k-1 inputs, and gives each token of a multi-token forward exactly the output a
    one-token step gives it from the same window; past the limit F.conv1d runs and agrees too."""
    layer = next(m for m in bound_quant_model.modules() if isinstance(m, KimiDeltaAttention))
    c = 3 * layer.dim
    g = torch.Generator().manual_seed(5)
    for t in (1, 4, CONV_WINDOW_MAX_T, CONV_WINDOW_MAX_T + 3):
        st = layer.new_state(1, "cpu")
        st.conv.copy_(torch.randn(st.conv.shape, generator=g))
        before = st.conv.clone()
        x = torch.randn(1, t, c, generator=g)
        y = layer.short_conv(x, st)
        full = torch.cat([before, x.transpose(1, 2)], -1)
        assert rel(y, conv_float64(full, layer.conv_weight(), t)) < 1e-6, t
        assert torch.equal(st.conv, full[..., -(layer.kernel - 1):])
        if t <= CONV_WINDOW_MAX_T:
            for i in range(t):
                one = layer.new_state(1, "cpu")
                one.conv.copy_(full[..., i:i + layer.kernel - 1])
                assert torch.equal(layer.short_conv(x[:, i:i + 1], one)[0, 0], y[0, i]), (t, i)


def test_fp32_norms_match_float64():
    """The float32 RMSNorm and gated RMSNorm (one fused op on CPU) against the float64 formulas."""
    g = torch.Generator().manual_seed(6)
    n, gn = RMSNorm(96, 1e-6), RMSNormGated(32, 1e-6)
    with torch.no_grad():
        n.weight.copy_(torch.randn(96, generator=g))
        gn.weight.copy_(torch.randn(32, generator=g))
    x = torch.randn(3, 96, generator=g) * 4
    o, z = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    xd, od = x.double(), o.double()
    ref = n.weight.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    gref = gn.weight.double() * od / torch.sqrt(od.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.sigmoid(z.double())
    assert rel(n(x), ref) < 1e-6 and n(x).dtype == torch.float32
    assert rel(gn(o, z), gref) < 1e-6
    assert rel(n(x), ref * 1.001) > 5e-4 and rel(gn(o, z), gref * 1.001) > 5e-4     # the tolerance can fail


@torch.inference_mode()
def test_dense_mlp_gate_up_bound_as_one_product(bound_quant_model):
    """On CPU bind_model binds each dense MLP / shared expert's gate|up as one product (linear.fuse_rows): the
    parts become row views of one tensor and are not bound on their own, and the MLP output equals a float64
    SwiGLU of the dequantised weights."""
    mlps = [m for m in bound_quant_model.modules() if isinstance(m, DenseMLP)]
    assert mlps and all(m.gate_up_fn is not None for m in mlps)
    for m in mlps:
        assert m.gate_proj.fn is None and m.up_proj.fn is None and m.gate_proj.backend.endswith("(fused)")
        w = m.gate_proj.weight
        assert w.data_ptr() + w.numel() * w.element_size() == m.up_proj.weight.data_ptr()
    m = mlps[0]
    x = torch.randn(3, m.gate_proj.in_features, generator=torch.Generator().manual_seed(7))
    gw, uw, dw = (p.dequantized(torch.float64) for p in (m.gate_proj, m.up_proj, m.down_proj))
    xd = x.double()
    a = F.silu(xd @ gw.t())
    u = xd @ uw.t()
    if m.limit is not None:
        a, u = a.clamp(max=m.limit), u.clamp(-m.limit, m.limit)
    assert rel(m(x), (a * u) @ dw.t()) < 2e-6
