"""CPU tests of the W4A8 gate/up's host side and activation quantiser (``kernels.triton_moe_a8``; the kernels
themselves run only on sm_90: tests/gpu/test_moe_a8_gpu.py).

* ``quantize_x`` in Triton's interpreter equals torch's float32 -> float8_e4m3fn rounding (nearest even) applied to
  ``x / sx`` bit for bit, ties and the subnormal range included, and the documented logical column order;
* the config fit forces one wgmma row tile per warp (``num_warps = 2 BI / 16``) and rejects a bad ``A8``;
* ``launch_a8`` names why it runs the BF16 gate/up (no sm_90, scale bytes out of range).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bytebound.errors import BackendError



@pytest.mark.parametrize("scale", [1.0, 2.0 ** -12, 300.0])
def test_quantize_x_matches_torch_e4m3(monkeypatch, scale):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from bytebound.kernels.triton_moe_a8 import quantize_x, reference_quantize_x
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 512, generator=g) * scale).to(torch.bfloat16)
    x[0, :64] = torch.tensor([1.0625, 1.1875, -1.0625, 0.0, -0.0] + [2.0 ** -e for e in range(1, 60)]) * scale
    x[2] = 0
    xq, sx = quantize_x(x)
    rq, rs = reference_quantize_x(x)
    assert torch.equal(sx, rs)
    assert torch.equal(xq, rq), f"{int((xq != rq).sum())} bytes differ"
    # independent of the reference's own order: byte d holds x[src(d)] / sx rounded (float64 check of one row)
    c = torch.arange(512)
    src = (c // 32) * 32 + ((c // 4) % 4) * 8 + (c % 4) * 2 + (c // 16) % 2
    assert sorted(src.tolist()) == list(range(512))
    v = xq[1].view(torch.float8_e4m3fn).double() * float(sx[1])
    want = x[1, src].double()
    assert ((v - want).abs() <= want.abs() * 2.0 ** -4 + float(sx[1]) * 2.0 ** -10).all()
    # a power of two with the row's amax in [128, 256) x sx
    am = x[1].float().abs().max()
    assert 128.0 <= float(am / sx[1]) < 256.0


def test_fit_forces_one_wgmma_tile_per_warp():
    from bytebound.kernels.triton_moe_split import SPLIT_DEFAULT, fit_split_config
    c = fit_split_config(dict(SPLIT_DEFAULT, BI=64, num_warps=4, A8=1), 2560, 768)
    assert (c["BI"], c["num_warps"]) == (64, 8)
    c = fit_split_config(dict(SPLIT_DEFAULT, BI=16, A8=1), 2560, 768)
    assert (c["BI"], c["num_warps"]) == (32, 4)
    c = fit_split_config(dict(SPLIT_DEFAULT, BI=64, num_warps=4), 2560, 768)
    assert c["num_warps"] == 4                   # without A8 the warp count is the config's
    with pytest.raises(BackendError, match="A8"):
        fit_split_config(dict(SPLIT_DEFAULT, A8=2), 2560, 768)


def test_launch_a8_reasons():
    from bytebound.kernels import triton_moe_split as ts
    kern = SimpleNamespace(sm90=True, s13_range=(118, 122))
    assert ts.launch_a8(kern, {"A8": 0}) == (0, "")
    if ts.gateup_routed_a8 is None:
        pytest.skip(f"no Gluon here: {ts.GLUON_ERR}")
    assert ts.launch_a8(kern, {"A8": 1}) == (1, "")
    assert ts.launch_a8(SimpleNamespace(sm90=False, s13_range=(118, 122)), {"A8": 1})[1] == "W4A8 needs sm_90 (wgmma)"
    why = ts.launch_a8(SimpleNamespace(sm90=True, s13_range=(0, 122)), {"A8": 1})
    assert why == (0, "W4A8 needs gate/up E8M0 bytes in 1..254, got 0..122")
    assert ts.launch_a8(SimpleNamespace(sm90=True, s13_range=(1, 255)), {"A8": 1})[0] == 0
