"""The FP8 block GEMV (``linear[triton]``, M <= 4) at every Ling-3.0-flash decode shape on the GPU: against the
float64 dequantised reference (elementwise bound: half a BF16 step plus a float32 summation allowance), CUDA-graph
replay equal to eager bit for bit, two calls bit-equal, through ``TritonLinear`` with the table's configs
(split-K, PDL on sm_90). The shapes come from the model (``scripts/bench_gemv.decode_shapes``).

The MMA path (``kernels.gluon_fp8_gemv``, ``"MMA": true`` configs) the same way at every decode shape (and the MLA
parts 576 x 2560, 32 x 2560), under several configs, with power-of-two and arbitrary positive float32 block scales;
plus: under one config the M = 4 result rows equal four M = 1 calls bit for bit (decode and verify agree)."""

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
MMA_SHAPES = sorted(set(SHAPES) | {(576, 2560)})


def _linear(n, k, g, scales="pow2"):
    """An FP8 ``QLinear [n, k]`` with random E4M3 weights (subnormals included) and block scales: powers of two
    2^-11..2^-6 (``"pow2"``), or arbitrary positive float32 values in [1e-4, 1e-2) (``"any"``)."""
    from bytebound.layers.linear import QLinear
    lin = QLinear(k, n, "fp8", (128, 128), torch.bfloat16, DEV)
    lin.weight.data = (torch.randn(n, k, device=DEV, generator=g) * 8).to(torch.float8_e4m3fn)
    shape = (math.ceil(n / 128), math.ceil(k / 128))
    if scales == "pow2":
        s = torch.exp2(-torch.randint(6, 12, shape, device=DEV, generator=g).float())
    else:
        s = 1e-4 + torch.rand(shape, device=DEV, generator=g) * (1e-2 - 1e-4)
        assert (torch.frexp(s).mantissa != 0.5).any()           # not all powers of two
    lin.weight_scale_inv.data = s
    return lin


def _check_calls(fn, lin, n, k, g):
    """For M = 1..4: ``fn(x)`` within the float64 bound, two calls bit-equal, graph replay == eager. Returns the
    inputs and outputs ``[(x, y)]``."""
    from bytebound.quant import dequantize_fp8_block
    wd = dequantize_fp8_block(lin.weight, lin.weight_scale_inv, (128, 128), torch.float64)
    seen = []
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
        seen.append((x, y))
    return seen


@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_decode_shape(n, k):
    from bytebound.kernels.triton_fp8 import TritonLinear
    g = torch.Generator(device=DEV).manual_seed(n + k)
    lin = _linear(n, k, g)
    _check_calls(TritonLinear().bind(lin, torch.bfloat16), lin, n, k, g)


@pytest.mark.parametrize("n,k", [(2560, 4096), (6816, 2560)])
def test_gemv_table_any_scales(n, k):
    """The table's kernels with arbitrary positive float32 block scales (not only powers of two)."""
    from bytebound.kernels.triton_fp8 import TritonLinear
    g = torch.Generator(device=DEV).manual_seed(3 * n + k)
    lin = _linear(n, k, g, "any")
    _check_calls(TritonLinear().bind(lin, torch.bfloat16), lin, n, k, g)


MMA_CFGS = {
    "r64-nc2": {"MMA": True, "BN": 64, "NC": 2, "num_warps": 4, "SPLIT": 0},
    "r128-nc4-w8": {"MMA": True, "BN": 128, "NC": 4, "num_warps": 8, "SPLIT": 0},
    "r32-nc1-w2-split1": {"MMA": True, "BN": 32, "NC": 1, "num_warps": 2, "SPLIT": 1},
}


# arbitrary scales change no compiled kernel: two of the configs take them
MMA_CASES = [("r64-nc2", "pow2"), ("r64-nc2", "any"), ("r128-nc4-w8", "any"), ("r32-nc1-w2-split1", "pow2")]


@pytest.mark.parametrize("name,scales", MMA_CASES)
@pytest.mark.parametrize("n,k", MMA_SHAPES)
def test_gemv_mma_decode_shape(n, k, name, scales):
    """The MMA kernel at a decode shape: the float64 bound, repeat and graph bit-equality at M = 1..4 (split-K
    tickets and PDL included), and each of the M = 4 result rows equal to an M = 1 call on that token, bit for
    bit (each mma column is one token; one config for decode and verify)."""
    from bytebound.kernels.triton_fp8 import fit_gemv_config, fp8_block_gemv, gemv_reserve
    g = torch.Generator(device=DEV).manual_seed(n + 7 * k + len(name))
    lin = _linear(n, k, g, scales)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    cfg = fit_gemv_config(MMA_CFGS[name], n, k, 1, (128, 128), sms)
    assert cfg["MMA"], cfg.get("MMA_WHY")
    assert all(fit_gemv_config(MMA_CFGS[name], n, k, m, (128, 128), sms) == cfg for m in (2, 3, 4))
    gemv_reserve(DEV, n, k, (128, 128), {m: cfg for m in (1, 2, 3, 4)})
    w, s = lin.weight.data, lin.weight_scale_inv.data

    def fn(x):
        return fp8_block_gemv(x, w, s, (128, 128), cfg)
    seen = _check_calls(fn, lin, n, k, g)
    x4, y4 = seen[-1]
    for i in range(4):
        assert torch.equal(fn(x4[i:i + 1].clone())[0], y4[i]), f"token {i}: M=4 row differs from the M=1 call"
    for (x, y) in seen[:-1]:                     # M = 2, 3 rows as well, against the M = 1 calls
        for i in range(x.shape[0]):
            assert torch.equal(fn(x[i:i + 1].clone())[0], y[i])


@pytest.mark.parametrize("nr", [96, 128, 168])
@pytest.mark.parametrize("n,k", [(20480, 2560), (2560, 4096), (6144, 2560), (6816, 2560)])
def test_gemv_mma_register_cap_keeps_the_bits(n, k, nr):
    """``NR`` (the MMA GEMV's register cap, ptxas ``maxnreg``) changes the register allocation and schedule (and
    spills under ptxas' own count: 106-164 registers at these shapes), not the arithmetic: the capped kernel's
    output equals the committed tiling's without a cap bit for bit at M = 1..4, within the float64 bound, repeat
    and graph replay bit-equal; and a binary was compiled with the cap and uses at most that many registers."""
    from bytebound.kernels.triton_fp8 import GEMV_KEYS, fit_gemv_config, fp8_block_gemv, gemv_config, gemv_reserve
    from conftest import register_caps
    from bytebound.kernels.gluon_fp8_gemv import _fp8_gemv_mma
    g = torch.Generator(device=DEV).manual_seed(n + k + nr)
    lin = _linear(n, k, g)
    committed = gemv_config(n, k, 1, torch.device(DEV))
    assert committed["MMA"], f"the committed config of {n}x{k} is not an MMA config: {committed}"
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    raw = {kk: committed[kk] for kk in GEMV_KEYS if kk in committed and kk != "NR"}
    base = fit_gemv_config(raw, n, k, 1, (128, 128), sms)           # the committed tiling without any cap
    cap = fit_gemv_config(dict(raw, NR=nr), n, k, 1, (128, 128), sms)
    assert "NR" not in base and cap["NR"] == nr and {kk: v for kk, v in cap.items() if kk != "NR"} == base
    gemv_reserve(DEV, n, k, (128, 128), {m: cap for m in (1, 2, 3, 4)})
    w, s = lin.weight.data, lin.weight_scale_inv.data
    seen = _check_calls(lambda x: fp8_block_gemv(x, w, s, (128, 128), cap), lin, n, k, g)
    for x, y in seen:
        assert torch.equal(fp8_block_gemv(x, w, s, (128, 128), base), y), f"M={x.shape[0]}: NR {nr} changed the bits"
    caps = register_caps(_fp8_gemv_mma)          # the cap reached ptxas: a binary compiled with it, within it
    assert any(c == nr and 0 < r <= nr for c, r in caps), caps


def test_gemv_mma_through_linear(tmp_path, monkeypatch):
    """``TritonLinear`` with a table whose entries for one shape are MMA (``BYTEBOUND_GEMV_CONFIG``): the binding
    fits them, grows the scratch at bind and runs the MMA kernel; its result equals the direct call bit for bit."""
    import json
    from bytebound.kernels import triton_fp8 as tf
    n, k = 2560, 4096
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    cfg = MMA_CFGS["r64-nc2"]
    path = tmp_path / "gemv_table.json"
    path.write_text(json.dumps({arch: {tf.gemv_key(n, k, m): cfg for m in (1, 2, 3, 4)}}))
    monkeypatch.setenv("BYTEBOUND_GEMV_CONFIG", str(path))
    g = torch.Generator(device=DEV).manual_seed(11)
    lin = _linear(n, k, g, "any")
    assert tf.gemv_config(n, k, 4, DEV)["MMA"]
    fn = tf.TritonLinear().bind(lin, torch.bfloat16)
    seen = _check_calls(fn, lin, n, k, g)
    fitted = tf.gemv_config(n, k, 1, DEV)
    for x, y in seen:
        assert torch.equal(tf.fp8_block_gemv(x, lin.weight.data, lin.weight_scale_inv.data, (128, 128), fitted), y)


def test_bind_records_gemv_paths():
    """``TritonLinear.bind`` on this GPU records, per M = 1..4, the kernel its fixed config runs and where the config
    came from (read into the manifest's ``levers.linear.gemv``): on sm_90 with Gluon the committed table's MMA entries
    say mma, its FMA entries fma; a shape the table lacks says the untuned default. The bound call runs the config
    it reports (its result equals ``fp8_block_gemv`` with that config, bit for bit)."""
    from bytebound.kernels import gluon_fp8_gemv as gk
    from bytebound.kernels import triton_fp8 as tf
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    g = torch.Generator(device=DEV).manual_seed(5)
    for n, k in [(20480, 2560), (2560, 768), (256, 320)]:
        lin = _linear(n, k, g)
        fn = tf.TritonLinear().bind(lin, torch.bfloat16)
        cfgs, paths = tf.gemv_bind_configs(n, k, DEV)
        assert fn.gemv_shape == (n, k) and fn.gemv_paths == paths
        entry = tf.gemv_table().get(arch, {}).get(tf.gemv_key(n, k, 1))
        for m, info in paths.items():
            if entry is None:
                assert info["path"] == "fma" and info["source"].startswith("untuned default"), info
            else:
                assert info["source"] == f"{arch} table"
                want = "mma" if entry.get("MMA") and gk.GLUON_ERR is None else "fma"
                assert info["path"] == want and (info["refused"] is None) == (want == "mma" or not entry.get("MMA"))
            x = (torch.randn(m, k, device=DEV, generator=g) * 2).to(torch.bfloat16)
            assert torch.equal(fn(x), tf.fp8_block_gemv(x, lin.weight.data, lin.weight_scale_inv.data, (128, 128),
                                                        cfgs[m]))
    if arch == "sm_90":
        assert gk.GLUON_ERR is None, gk.GLUON_ERR
        assert tf.gemv_bind_configs(20480, 2560, DEV)[1][1] == {"path": "mma", "source": "sm_90 table",
                                                                 "refused": None}


NORM_SHAPES = [(20480, 2560, "r64-nc4-w4"), (6816, 2560, "r128-nc4-w8-split"), (6816, 2560, "r32-nc1-w2-split1")]
NORM_CFGS = {"r64-nc4-w4": {"MMA": True, "BN": 64, "NC": 4, "num_warps": 4, "SPLIT": 0},
             "r128-nc4-w8-split": {"MMA": True, "BN": 128, "NC": 4, "num_warps": 8, "SPLIT": 3},
             "r32-nc1-w2-split1": {"MMA": True, "BN": 32, "NC": 1, "num_warps": 2, "SPLIT": 1}}


@pytest.mark.parametrize("n,k,name", NORM_SHAPES)
def test_gemv_mma_add_norm_fold(n, k, name):
    """The decoder's input add + RMSNorm folded into the MMA GEMV (``fp8_block_gemv_add_norm``) at the KDA and MLA
    projection shapes (20480 / 6816 x 2560), M = 1..4, with and without split-K:

    * ``h_new`` equals torch's ``h + delta`` bit for bit;
    * ``x`` equals ``triton_norm.add_rmsnorm``'s (a reference written apart) except where the float32 sum of squares,
      summed in another order, puts ``x * r`` on the other side of a BF16 rounding edge: at most one BF16 step, on
      under 1 % of the elements; and it is within one BF16 step of the float64 RMSNorm;
    * ``y`` equals the plain MMA GEMV on that ``x`` with the same config bit for bit (the main loop is the plain
      kernel's) and lies within the float64 bound of ``_check_calls`` for that x;
    * each of the M rows equals an M = 1 call on that row (verify == decode), two calls are bit-equal, and a CUDA
      graph replay equals eager."""
    from bytebound.kernels.triton_fp8 import fit_gemv_config, fp8_block_gemv, fp8_block_gemv_add_norm, gemv_reserve
    from bytebound.kernels.triton_norm import add_rmsnorm
    from bytebound.quant import dequantize_fp8_block
    g = torch.Generator(device=DEV).manual_seed(n + k + len(name))
    lin = _linear(n, k, g, "any")
    w, s = lin.weight.data, lin.weight_scale_inv.data
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    cfg = fit_gemv_config(NORM_CFGS[name], n, k, 1, (128, 128), sms)
    assert cfg["MMA"] and (cfg["SPLIT"] > 1) == ("split" in name and "split1" not in name), cfg
    gemv_reserve(DEV, n, k, (128, 128), {m: cfg for m in (1, 2, 3, 4)})
    wd = dequantize_fp8_block(w, s, (128, 128), torch.float64)
    nw = (1 + 0.3 * torch.randn(k, device=DEV, generator=g)).float()        # float32 norm weight, not BF16 values
    eps = 1e-6

    def fn(d, h):
        return fp8_block_gemv_add_norm(d, h, nw, eps, w, s, cfg)
    for m in (1, 2, 3, 4):
        h = (torch.randn(m, k, device=DEV, generator=g) * 3).to(torch.bfloat16)
        d = (torch.randn(m, k, device=DEV, generator=g) * torch.rand(m, 1, device=DEV, generator=g) * 4
             ).to(torch.bfloat16)
        y, x, hn = fn(d, h)
        assert y.shape == (m, n) and x.shape == hn.shape == (m, k) and y.dtype == x.dtype == torch.bfloat16
        assert torch.equal(hn, h + d), f"M={m}: h_new != h + delta"
        xr, hr = add_rmsnorm(d, h, nw, eps)
        assert torch.equal(hr, hn)
        step = torch.finfo(torch.bfloat16).eps * xr.float().abs().clamp_min(2.0 ** -100)
        diff = (x.float() - xr.float()).abs()
        assert (diff <= step).all() and (diff > 0).float().mean() < 0.01, \
            f"M={m}: x vs add_rmsnorm: {(diff > 0).float().mean().item():.4f} differ, max {diff.max().item():.3e}"
        h64 = hn.double()
        x64 = nw.double() * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
        assert ((x.double() - x64).abs() <= 2 * torch.finfo(torch.bfloat16).eps * x64.abs() + 1e-30).all()
        assert torch.equal(fp8_block_gemv(x, w, s, (128, 128), cfg), y), f"M={m}: y != plain GEMV on x"
        ref = x.double() @ wd.t()
        bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ wd.abs().t()) * k * 2.0 ** -24
        assert ((y.double() - ref).abs() <= bound).all()
        again = fn(d, h)
        assert all(torch.equal(a, b) for a, b in zip(again, (y, x, hn))), f"M={m}: two calls differ"
        for i in range(m):
            one = fn(d[i:i + 1].clone(), h[i:i + 1].clone())
            assert all(torch.equal(a[0], b[i]) for a, b in zip(one, (y, x, hn))), f"M={m}: row {i} != M=1 call"
        hs, ds = h.clone(), d.clone()
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            fn(ds, hs)
        torch.cuda.current_stream().wait_stream(st)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = fn(ds, hs)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, (y, x, hn))), f"M={m}: graph replay differs from eager"


def test_linear_add_norm_binding(monkeypatch):
    """``TritonLinear.bind``'s ``add_norm`` with the opt-in fold on (``BYTEBOUND_NORM_FOLD=1``): the MMA shapes take
    M = 1..4 (the result equals the direct call), anything else (M = 5, float32 activations, a shape whose table
    entry is not MMA) returns None so the caller runs the norm kernel and the plain projection; with the fold off
    (the default) every call returns None."""
    from bytebound.kernels import triton_fp8 as tf
    monkeypatch.setenv("BYTEBOUND_NORM_FOLD", "1")
    g = torch.Generator(device=DEV).manual_seed(21)
    lin = _linear(20480, 2560, g)
    fn = tf.TritonLinear().bind(lin, torch.bfloat16)
    nw = torch.rand(2560, device=DEV, generator=g) + 0.5
    cfgs, _ = tf.gemv_bind_configs(20480, 2560, DEV)
    for m in (1, 4):
        h = torch.randn(1, m, 2560, device=DEV, generator=g).to(torch.bfloat16)
        d = torch.randn(1, m, 2560, device=DEV, generator=g).to(torch.bfloat16)
        got = fn.add_norm(d, h, nw, 1e-6)
        if not cfgs[m]["MMA"]:
            assert got is None
            continue
        y, x, hn = got
        assert y.shape == (1, m, 20480) and x.shape == hn.shape == h.shape
        ref = tf.fp8_block_gemv_add_norm(d[0], h[0], nw, 1e-6, lin.weight.data, lin.weight_scale_inv.data, cfgs[m])
        assert all(torch.equal(a[0], b) for a, b in zip((y, x, hn), ref))
    h5 = torch.randn(5, 2560, device=DEV, generator=g).to(torch.bfloat16)
    assert fn.add_norm(h5, h5, nw, 1e-6) is None
    assert fn.add_norm(h5[:1].float(), h5[:1].float(), nw, 1e-6) is None
    small = tf.TritonLinear().bind(_linear(2560, 768, g), torch.bfloat16)      # the table's FMA shape
    hs = torch.randn(1, 768, device=DEV, generator=g).to(torch.bfloat16)
    assert tf.gemv_bind_configs(2560, 768, DEV)[0][1]["MMA"] or small.add_norm(hs, hs, nw[:768], 1e-6) is None
    monkeypatch.setenv("BYTEBOUND_NORM_FOLD", "0")
    assert fn.add_norm(h5[:1], h5[:1], nw, 1e-6) is None
