"""The FP8 block GEMV (``linear[triton]``, M <= 4) at every Ling-3.0-flash decode shape on the GPU: against the
float64 dequantised reference (elementwise bound: half a BF16 step plus a float32 summation allowance), CUDA-graph
replay equal to eager bit for bit, two calls bit-equal, through ``TritonLinear`` with the table's configs
(split-K, PDL on sm_90). The shapes come from the model (``scripts/bench_gemv.decode_shapes``)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from conftest import ROOT

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _shapes():
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_gemv import decode_shapes
    return [(e["n"], e["k"]) for e in decode_shapes()] + [(32, 2560)]


SHAPES = sorted(set(_shapes())) if torch.cuda.is_available() else [(20480, 2560), (2560, 4096)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_decode_shape(n, k):
    from bytebound.kernels.triton_fp8 import TritonLinear
    from bytebound.layers.linear import QLinear
    from bytebound.quant import dequantize_fp8_block
    g = torch.Generator(device=DEV).manual_seed(n + k)
    lin = QLinear(k, n, "fp8", (128, 128), torch.bfloat16, DEV)
    lin.weight.data = (torch.randn(n, k, device=DEV, generator=g) * 8).to(torch.float8_e4m3fn)
    lin.weight_scale_inv.data = torch.exp2(-torch.randint(6, 12, (math.ceil(n / 128), math.ceil(k / 128)),
                                                          device=DEV, generator=g).float())
    fn = TritonLinear().bind(lin, torch.bfloat16)
    wd = dequantize_fp8_block(lin.weight, lin.weight_scale_inv, (128, 128), torch.float64)
    for m in (1, 2, 3, 4):
        x = (torch.randn(m, k, device=DEV, generator=g) * 2).to(torch.bfloat16)
        ref = x.double() @ wd.t()
        bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ wd.abs().t()) * k * 2.0 ** -24
        y = fn(x)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        err = (y.double() - ref).abs()
        assert torch.isfinite(y.float()).all() and (err <= bound).all(), \
            f"M={m}: max excess {(err - bound).max().item():.3e}"
        assert torch.equal(fn(x), y), f"M={m}: two calls differ"
        # graph replay == eager, bit for bit (the split-K tickets re-arm themselves between replays)
        xs = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(xs)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yg = fn(xs)
            yg2 = fn(xs)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, y) and torch.equal(yg2, y), f"M={m}: graph replay differs from eager"
