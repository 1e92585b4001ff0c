"""scripts/eval_nano.py's W4A8 ablation: the E4M3 fake quantisation against a float64 rounding to the E4M3 grid
built from the format's definition, and the W4A8 expert sum reducing to the W4A16 reference when nothing is rounded
(the ablation's control)."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import load_script


@pytest.fixture(scope="module")
def ev():
    return load_script("eval_nano")


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative E4M3 (OCP FP8, 'fn': no infinities, S.1111.111 is NaN) value, float64, from the
    bit layout: exponent bias 7, subnormals 2^-6 * m/8."""
    vals = [m / 8 * 2.0 ** -6 for m in range(8)]
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e, m in itertools.product(range(1, 16), range(8)) if (e, m) != (15, 7)]
    return torch.tensor(sorted(vals), dtype=torch.float64)


def round_to_grid(y: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Nearest grid value to |y| (ties to the even code: the grid index is the code), with y's sign; float64."""
    a = y.abs()[..., None]
    d = (grid - a).abs()
    best = d.min(-1, keepdim=True).values
    idx = torch.arange(grid.numel())
    cand = torch.where(d == best, idx, grid.numel() + 1)          # tied candidates' codes
    even = torch.where(cand % 2 == 0, cand, grid.numel() + 1).min(-1).values
    code = torch.where(even <= grid.numel(), even, cand.min(-1).values)
    return torch.sign(y) * grid[code]


@pytest.mark.parametrize("group", [0, 16])
def test_fake_quant_e4m3_is_a_rounding_to_the_grid(ev, group):
    gen = torch.Generator().manual_seed(group)
    x = torch.randn(3, 64, generator=gen, dtype=torch.float64) * torch.logspace(-3, 2, 64, dtype=torch.float64)
    x[1, :16] = 0.0                                               # an all-zero group stays zero
    got = ev.fake_quant_e4m3(x.float(), group).double()
    g = group or 64
    xs = x.reshape(3, 64 // g, g)
    scale = (xs.float().abs().amax(-1, keepdim=True) / 448.0).double()      # the float32 scale, as the code forms it
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    want = (round_to_grid((xs.float().double() / scale.float().double()).float().double(), e4m3_grid())
            * scale).float().double().reshape(3, 64)
    assert torch.equal(got, want)
    amax, qmax = xs.float().abs().amax(-1).double(), got.reshape(3, 64 // g, g).abs().amax(-1)
    assert ((qmax - amax).abs() <= amax * 2.0 ** -22).all()      # a group's amax maps to 448: float32 steps only
    assert torch.equal(ev.fake_quant_e4m3(x.float(), -1), x.float())                 # the control: unchanged
    with pytest.raises(ValueError, match="does not divide"):
        ev.fake_quant_e4m3(x.float(), 48)


def test_w4a8_experts_without_rounding_is_the_w4a16_reference(ev):
    from bytebound.kernels.torch_ref import moe_reference
    from bytebound.layers.moe import RoutedExperts
    gen = torch.Generator().manual_seed(5)
    ex = RoutedExperts(8, 64, 32, "mxfp4", torch.float32, "cpu", None)
    with torch.no_grad():
        for n in ("w13", "w2"):
            p, s = getattr(ex, n), getattr(ex, n + "_scale")
            p.copy_(torch.randint(0, 256, p.shape, generator=gen, dtype=torch.uint8))
            s.copy_(torch.randint(120, 130, s.shape, generator=gen, dtype=torch.uint8))
    x = torch.randn(5, 64, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(5)])
    w = torch.rand(5, 3, generator=gen)
    ref = moe_reference(ex, x, ids, w)
    got = ev.w4a8_experts(ex, x, ids, w, -1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    q = ev.w4a8_experts(ex, x, ids, w, 0)                       # rounded: close, not equal
    assert not torch.equal(q, ref) and (q - ref).norm() < 0.1 * ref.norm()
