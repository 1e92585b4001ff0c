"""The decode/verify FP8 block GEMV (``kernels.triton_fp8.fp8_block_gemv``, M <= 4) against a float64 dequantised
reference, in Triton's interpreter on a CPU machine (CI without Triton skips): the FMA and tensor-core (``DOT``)
paths, split-K with its ticketed fixed-order reduction, ragged N and K, the one-chunk-ahead loads (``PRE``), M =
1..4; and the host side (config fitting, the table, the decode shapes). GPU runs at every Ling decode shape, graph
replay == eager and repeat bit-equality: ``tests/gpu/test_gemv_gpu.py``.

The bound is elementwise: the output's BF16 rounding (half a step, <= 2^-8 of the value) plus a float32
summation allowance of K * 2^-24 of the sum of |terms| (the weight, its scale and x are exact in float32, and the
tensor-core path's BF16 operands are exact too: E4M3 -> BF16 loses nothing)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from bytebound.quant import dequantize_fp8_block, quantize_fp8_block
from conftest import ROOT, needs_triton, triton_module_fixture

DEV = "cuda" if torch.cuda.is_available() else "cpu"
fp8k = triton_module_fixture("fp8k", "bytebound.kernels.triton_fp8", bf16_round_nearest=True)


def case(n, k, m, block=(128, 128), seed=0):
    """E4M3 weight with block scales that differ by 2^-3..2^3 between neighbouring blocks, and BF16 x with a few
    large channels; returns x, w, s and the float64 reference with its elementwise bound."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-3, 4, (math.ceil(n / block[0]),), generator=g).float())
    cols = torch.exp2(torch.randint(-3, 4, (math.ceil(k / block[1]),), generator=g).float())
    w = (torch.randn(n, k, generator=g) * 0.05 * rows.repeat_interleave(block[0])[:n, None]
         * cols.repeat_interleave(block[1])[None, :k])
    wq, sw = quantize_fp8_block(w, block)
    x = torch.randn(m, k, generator=g) * 2
    x[:, torch.randperm(k, generator=g)[:3]] *= 30
    x = x.to(torch.bfloat16)
    wd = dequantize_fp8_block(wq, sw, block, torch.float64)
    ref = x.double() @ wd.t()
    bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ wd.abs().t()) * k * 2.0 ** -24
    return x.to(DEV), wq.to(DEV), sw.to(DEV), ref, bound


def check(y, ref, bound):
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    err = (y.double().cpu() - ref).abs()
    assert torch.isfinite(y.float()).all()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3e}"


CFGS = {
    "fma": {"BN": 16, "BK": 64, "SPLIT": 1, "num_warps": 4},
    "fma-split3": {"BN": 16, "BK": 64, "SPLIT": 3, "num_warps": 4},
    "fma-pre-split2": {"BN": 32, "BK": 64, "SPLIT": 2, "num_warps": 4, "PRE": True},
    "dot-split2": {"BN": 16, "BK": 64, "SPLIT": 2, "num_warps": 4, "DOT": True},
    "dot-pre": {"BN": 32, "BK": 128, "SPLIT": 1, "num_warps": 4, "DOT": True, "PRE": True},
}


@needs_triton
@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("n,k", [(48, 320), (64, 384)])         # ragged N (48 % 32) and K (320 % 128, % 64 * 3)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_matches_float64(fp8k, name, n, k, m):
    x, w, s, ref, bound = case(n, k, m, seed=n + k + m)
    cfg = fp8k.fit_gemv_config(CFGS[name], n, k, m)
    y = fp8k.fp8_block_gemv(x, w, s, cfg=cfg)
    check(y, ref, bound)
    if cfg["SPLIT"] > 1:
        # the last program of each row tile re-armed its ticket: the next launch starts from zero
        assert int(fp8k.gemv_scratch(x.device, "ticket", 1, torch.int32).abs().sum()) == 0
        assert torch.equal(fp8k.fp8_block_gemv(x, w, s, cfg=cfg), y)


@needs_triton
def test_gemv_small_scale_blocks(fp8k):
    """A 32x32 scale block: BN is cut to divide it, the tensor-core chunk to one scale block."""
    x, w, s, ref, bound = case(96, 256, 3, block=(32, 32), seed=5)
    cfg = fp8k.fit_gemv_config({"BN": 64, "BK": 128, "DOT": True, "SPLIT": 2, "num_warps": 4}, 96, 256, 3, (32, 32))
    assert cfg["BN"] == 32 and cfg["BK"] == 32
    check(fp8k.fp8_block_gemv(x, w, s, (32, 32), cfg=cfg), ref, bound)


@needs_triton
def test_linear_binding_uses_gemv(fp8k):
    """``TritonLinear``'s callable (CUDA-only bind, so the per-M configs and the GEMV call are exercised directly
    here): the default path of ``fp8_block_linear`` for M <= 4."""
    x, w, s, ref, bound = case(80, 256, 4, seed=9)
    for m in (1, 4):
        check(fp8k.fp8_block_linear(x[:m], w, s), ref[:m], bound[:m])


@needs_triton
@pytest.mark.parametrize("name", ["fma-split3", "dot-split2", "dot-pre"])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_fused_rows_gemv_equals_separate(fp8k, name, m):
    """Three projections of one input fused as an MLA layer's q|kv_a|g (``linear.fuse_rows(pad=True)``, 128-row
    scale blocks): 256 rows, 136 (ends inside a block: 120 zero rows follow) and 16. With one launch config the
    fused GEMV's columns of each part are bit-equal to that part's own GEMV (same row tiles, same K chunks and
    split), the padding columns are 0, and the whole output is within the float64 bound."""
    from bytebound.layers.linear import QLinear, fuse_rows
    k = 320
    parts = []
    for i, n in enumerate((256, 136, 16)):
        _, w, s, _, _ = case(n, k, m, seed=100 * i + m)
        lin = QLinear(k, n, "fp8", (128, 128), torch.bfloat16, DEV)
        lin.weight.data, lin.weight_scale_inv.data = w, s
        parts.append(lin)
    x = case(8, k, m, seed=7)[0]
    fused = fuse_rows(parts, pad=True)
    assert fused.row_spans == [(0, 256), (256, 392), (512, 528)] and fused.weight_scale_inv.shape == (5, 3)
    cfg = fp8k.fit_gemv_config(CFGS[name], 528, k, m)
    y = fp8k.fp8_block_gemv(x, fused.weight, fused.weight_scale_inv, cfg=cfg)
    assert not y[:, 392:512].any()
    for lin, (a, b) in zip(parts, fused.row_spans):
        one = fp8k.fp8_block_gemv(x, lin.weight, lin.weight_scale_inv, cfg=cfg)
        assert torch.equal(y[:, a:b], one)
        wd = dequantize_fp8_block(lin.weight.cpu(), lin.weight_scale_inv.cpu(), (128, 128), torch.float64)
        ref = x.double().cpu() @ wd.t()
        check(y[:, a:b], ref, ref.abs() * 2.0 ** -8 + (x.double().cpu().abs() @ wd.abs().t()) * k * 2.0 ** -24)


def test_fit_gemv_config_properties():
    from bytebound.kernels.triton_fp8 import fit_gemv_config, gemv_config
    for n, k in [(20480, 2560), (2560, 4096), (576, 2560), (32, 2560), (2560, 768), (100, 300)]:
        for m in (1, 4):
            for raw in [{"BN": 48, "BK": 200}, {"BN": 256, "BK": 512, "DOT": True}, {"BN": 16, "BK": 256, "SPLIT": 7}]:
                c = fit_gemv_config(raw, n, k, m)
                assert 128 % c["BN"] == 0 and c["BK"] & (c["BK"] - 1) == 0 and c["BK"] >= 16
                assert not c["DOT"] or 128 % c["BK"] == 0
                assert c["KS"] % c["BK"] == 0 and c["SPLIT"] * c["KS"] >= k > (c["SPLIT"] - 1) * c["KS"]
                assert c["PF"] % 16 == 0
            c = gemv_config(n, k, m)           # CPU: no architecture entry, the default, fitted
            assert c["SPLIT"] >= 1 and "KS" in c
    c = fit_gemv_config({"BN": 16, "BK": 64}, 64, 64, 1, (96, 128))       # rows of a 96-row scale block
    assert 96 % c["BN"] == 0


def test_gemv_table_entries_are_valid():
    from bytebound.kernels.triton_fp8 import GEMV_CONFIG_PATH, GEMV_KEYS, gemv_table
    raw = json.loads(GEMV_CONFIG_PATH.read_text())
    assert "_format" in raw
    for arch, entries in gemv_table().items():
        assert arch.startswith("sm_")
        for key, cfg in entries.items():
            assert key.startswith("N") and "_K" in key and "_M" in key
            # an MMA entry's chunk width is NC scale blocks (BK = 128 * NC is derived by the fit)
            need = {"BN", "NC", "num_warps"} if cfg.get("MMA") else {"BN", "BK", "num_warps"}
            assert set(cfg) <= set(GEMV_KEYS) and need <= set(cfg), (arch, key, cfg)


def test_decode_shapes_are_the_models():
    """The benchmark's (and the GPU test's) shape list comes from the model: the fused KDA projection, the fused MLA
    q|kv_a|g projection (6144 + 576 rows, 64 zero rows, 32: 6816, in the 7 MLA decoder layers and the NEXTN
    layer) and o_proj are there with their layer counts; the MLA parts alone are not."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_gemv import decode_shapes
    shapes = {(e["n"], e["k"]): e for e in decode_shapes()}
    assert shapes[(20480, 2560)]["count"] == 35 and shapes[(2560, 4096)]["count"] == 35 + 8
    assert shapes[(6816, 2560)]["count"] == 8 and shapes[(6816, 2560)]["name"] == "mla.q|kv_a|g"
    assert (576, 2560) not in shapes and (32, 2560) not in shapes
    assert shapes[(6144, 2560)]["name"] == "mlp.gate_proj / mlp.up_proj"        # the dense MLP's, not q_proj
    assert (2560, 5120) in shapes and (2560, 6144) in shapes


# ---- the MMA path (kernels.gluon_fp8_gemv): host-side config fitting, no GPU or Triton needed -------------------
MMA_SHAPES = [(20480, 2560), (2560, 4096), (6144, 2560), (768, 2560), (2560, 768), (8192, 512), (2560, 6144),
              (2560, 5120), (576, 2560), (32, 2560), (6816, 2560)]


@pytest.mark.parametrize("raw", [{}, {"BN": 128, "NC": 4, "num_warps": 8}, {"BN": 64, "NC": 1, "SPLIT": 3},
                                 {"BN": 16, "NC": 8, "num_warps": 4}, {"BN": 200, "NC": 3, "SPLIT": 99},
                                 {"BN": 32, "NC": 2, "num_warps": 2, "SPLIT": 1}])
def test_fit_mma_tilings(monkeypatch, raw):
    """Every fitted MMA config is a tiling the kernel can run: R (BN) a power of two in 16..128 holding one mma row
    tile per warp, NC a power of two <= 4 dividing K/128, slices of whole chunks covering K exactly once with no
    empty slice, and the same config at M = 1..4 (so verify rows equal decode results bit for bit)."""
    from bytebound.kernels import gluon_fp8_gemv as gk
    from bytebound.kernels.triton_fp8 import GEMV_KEYS, fit_gemv_config
    monkeypatch.setattr(gk, "GLUON_ERR", None)
    for n, k in MMA_SHAPES:
        cfgs = [fit_gemv_config(dict(raw, MMA=True), n, k, m) for m in (1, 2, 3, 4)]
        c = cfgs[0]
        assert all(x == c for x in cfgs), (n, k, cfgs)
        assert c["MMA"] is True and "MMA_WHY" not in c
        r, nw, nc = c["BN"], c["num_warps"], c["NC"]
        assert r in (16, 32, 64, 128) and nw in (1, 2, 4, 8) and r % (16 * nw) == 0
        assert nc in (1, 2, 4) and (k // 128) % nc == 0 and c["BK"] == 128 * nc
        assert c["KS"] % (128 * nc) == 0 and c["SPLIT"] >= 1
        assert (c["SPLIT"] - 1) * c["KS"] < k <= c["SPLIT"] * c["KS"]          # no empty slice, K covered
        assert not c["DOT"] and not c["PRE"] and c["PF"] == 0
        assert set(c) <= set(GEMV_KEYS) | {"KS"}
        # a fitted config written to a table (the sweep writes its GEMV_KEYS) fits to itself
        assert fit_gemv_config({kk: c[kk] for kk in GEMV_KEYS if kk in c}, n, k, 4) == c
    # what was asked for survives where it fits
    c = fit_gemv_config({"MMA": True, "BN": 128, "NC": 4, "num_warps": 8, "SPLIT": 1}, 2560, 4096, 4)
    assert (c["BN"], c["NC"], c["num_warps"], c["SPLIT"], c["KS"]) == (128, 4, 8, 1, 4096)
    c = fit_gemv_config({"MMA": True, "BN": 64, "NC": 4, "num_warps": 4}, 2560, 768, 1)   # 6 blocks: NC 2
    assert c["NC"] == 2 and c["BK"] == 256
    c = fit_gemv_config({"MMA": True, "BN": 32, "num_warps": 8}, 20480, 2560, 1)          # one row tile per warp
    assert c["BN"] == 32 and c["num_warps"] == 2


def test_gemv_register_cap_key(monkeypatch):
    """``NR`` (the MMA GEMV's register cap) passes through the fit and back through a table entry; a value outside
    24..255 (or not an integer) and ``NR`` on the FMA/DOT path are named errors, never silently dropped."""
    from bytebound.errors import BackendError
    from bytebound.kernels import gluon_fp8_gemv as gk
    from bytebound.kernels.triton_fp8 import GEMV_KEYS, fit_gemv_config
    monkeypatch.setattr(gk, "GLUON_ERR", None)
    c = fit_gemv_config({"MMA": True, "BN": 64, "NC": 4, "num_warps": 4, "NR": 96}, 20480, 2560, 1)
    assert c["NR"] == 96
    assert fit_gemv_config({kk: c[kk] for kk in GEMV_KEYS if kk in c}, 20480, 2560, 4) == c
    for bad in (16, 256, 96.0, True, "96"):
        with pytest.raises(BackendError, match="NR"):
            fit_gemv_config({"MMA": True, "NR": bad}, 20480, 2560, 1)
    with pytest.raises(BackendError, match="MMA GEMV only"):
        fit_gemv_config({"BN": 16, "BK": 256, "NR": 96}, 20480, 2560, 1)


def test_fit_mma_split_auto(monkeypatch):
    """SPLIT 0 aims at GEMV_WAVES programs per SM like the FMA path, in whole chunks: 2560 rows / R 64 = 40 row tiles
    x 6 slices of K = 4096 (32 blocks in 6 slices of 6 and one of 2: 6 slices, 240 programs for 132 SMs)."""
    from bytebound.kernels import gluon_fp8_gemv as gk
    from bytebound.kernels.triton_fp8 import fit_gemv_config
    monkeypatch.setattr(gk, "GLUON_ERR", None)
    c = fit_gemv_config({"MMA": True, "BN": 64, "NC": 1, "num_warps": 4}, 2560, 4096, 1, sm_count=132)
    assert (c["SPLIT"], c["KS"]) == (6, 768)
    c = fit_gemv_config({"MMA": True, "BN": 64, "NC": 2, "num_warps": 4}, 20480, 2560, 1, sm_count=132)
    assert (c["SPLIT"], c["KS"]) == (1, 2560)            # 320 row tiles already fill the GPU
    c = fit_gemv_config({"MMA": True, "BN": 32, "NC": 1, "num_warps": 2}, 32, 2560, 1, sm_count=132)
    assert (c["SPLIT"], c["KS"]) == (20, 128)            # one row tile: a slice per scale block


@pytest.mark.parametrize("n,k,block,gluon_err,why", [
    (256, 320, (128, 128), None, "K a multiple of 128"),
    (256, 512, (64, 128), None, "128x128 scale blocks"),
    (256, 512, (128, 64), None, "128x128 scale blocks"),
    (256, 512, (128, 128), "triton.experimental.gluon is not importable: x", "gluon is not importable"),
])
def test_fit_mma_refusals(monkeypatch, n, k, block, gluon_err, why):
    """Where the MMA path cannot run, the fitted config is the FMA path's default (a valid FMA config) and says
    why in ``MMA_WHY``."""
    from bytebound.kernels import gluon_fp8_gemv as gk
    from bytebound.kernels.triton_fp8 import fit_gemv_config, gemv_default
    monkeypatch.setattr(gk, "GLUON_ERR", gluon_err)
    for m in (1, 4):
        c = fit_gemv_config({"MMA": True, "BN": 64, "NC": 2, "num_warps": 4}, n, k, m, block)
        assert c["MMA"] is False and why in c["MMA_WHY"], c
        assert c == dict(fit_gemv_config(gemv_default(n, k, m), n, k, m, block), MMA_WHY=c["MMA_WHY"])
        assert block[0] % c["BN"] == 0 and c["KS"] % c["BK"] == 0


def test_fit_fma_configs_are_not_mma():
    """A config without ``MMA`` stays on the Triton kernels (``MMA`` False, no ``NC``), as the committed table's do."""
    from bytebound.kernels.triton_fp8 import fit_gemv_config
    c = fit_gemv_config({"BN": 16, "BK": 256, "NC": 4, "num_warps": 4}, 2560, 4096, 4)
    assert c["MMA"] is False and "NC" not in c and "MMA_WHY" not in c


# ---- the manifest's GEMV paths (TritonLinear.bind -> runner.backends -> levers.linear.gemv), a faked sm_90 -------
def _fake_sm90(monkeypatch, gluon_err=None):
    """CPU stand-in for an H200: ``_device_info`` says sm_90 with 132 SMs, Gluon importable (or ``gluon_err``), the
    committed table (no ``BYTEBOUND_GEMV_CONFIG``)."""
    from bytebound.kernels import gluon_fp8_gemv as gk
    from bytebound.kernels import triton_fp8 as tf
    monkeypatch.setattr(tf, "_device_info", lambda dev: ("sm_90", 132))
    monkeypatch.setattr(gk, "GLUON_ERR", gluon_err)
    monkeypatch.delenv("BYTEBOUND_GEMV_CONFIG", raising=False)
    return tf


def test_gemv_bind_paths_follow_the_table(monkeypatch):
    """Every committed sm_90 entry records the kernel it asks for (mma for ``MMA`` entries) with source "sm_90
    table" and no refusal, and the configs are :func:`gemv_config`'s; a shape missing from the table, an
    architecture without a section and a device without CUDA record the untuned default and say why."""
    tf = _fake_sm90(monkeypatch)
    dev = torch.device("cuda")
    entries = tf.gemv_table()["sm_90"]
    shapes = {tuple(int(p[1:]) for p in key.split("_")[:2]) for key in entries}
    assert (20480, 2560) in shapes and len(shapes) >= 10
    for n, k in sorted(shapes):
        cfgs, paths = tf.gemv_bind_configs(n, k, dev)
        assert sorted(paths) == sorted(cfgs) == [1, 2, 3, 4]
        for m, info in paths.items():
            raw = entries[tf.gemv_key(n, k, m)]
            want = "mma" if raw.get("MMA") else "dot" if raw.get("DOT") else "fma"
            assert info == {"path": want, "source": "sm_90 table", "refused": None}, (n, k, m)
            assert cfgs[m] == tf.gemv_config(n, k, m, dev) and cfgs[m]["MMA"] == (want == "mma")
    assert tf.describe_gemv_path(tf.gemv_bind_configs(20480, 2560, dev)[1][1]) == "mma (sm_90 table)"
    assert tf.gemv_key(4096, 1024, 1) not in entries
    cfgs, paths = tf.gemv_bind_configs(4096, 1024, dev)
    for m in (1, 2, 3, 4):
        assert paths[m] == {"path": "fma", "source": "untuned default, no sm_90 entry", "refused": None}
        assert cfgs[m] == tf.fit_gemv_config(tf.gemv_default(4096, 1024, m), 4096, 1024, m)
    monkeypatch.setattr(tf, "_device_info", lambda dev: ("sm_100", 148))
    assert tf.gemv_bind_configs(20480, 2560, dev)[1][1]["source"] == "untuned default, table has no sm_100 section"
    monkeypatch.setattr(tf, "_device_info", lambda dev: (None, 132))
    assert tf.gemv_bind_configs(20480, 2560, dev)[1][4] == {"path": "fma", "refused": None,
                                                            "source": "untuned default, no CUDA architecture"}


def test_gemv_bind_paths_carry_mma_refusals(monkeypatch, tmp_path):
    """Where the table asks for MMA and the path cannot run, the record says fma and why: Gluon missing, a scale
    block other than 128x128, K % 128 (from a table named by ``BYTEBOUND_GEMV_CONFIG``, which the source names)."""
    err = "triton.experimental.gluon is not importable: ImportError: x"
    tf = _fake_sm90(monkeypatch, gluon_err=err)
    dev = torch.device("cuda")
    for m, info in tf.gemv_bind_configs(20480, 2560, dev)[1].items():
        assert info == {"path": "fma", "source": "sm_90 table", "refused": err}
        assert tf.describe_gemv_path(info) == f"fma (sm_90 table; mma refused: {err})"
    _fake_sm90(monkeypatch)
    info = tf.gemv_bind_configs(20480, 2560, dev, (64, 128))[1][2]
    assert info["path"] == "fma" and "128x128 scale blocks" in info["refused"]
    path = tmp_path / "gemv_table.json"
    path.write_text(json.dumps({"sm_90": {tf.gemv_key(256, 320, m): {"MMA": True, "BN": 64, "NC": 2}
                                          for m in (1, 2, 3, 4)}}))
    monkeypatch.setenv("BYTEBOUND_GEMV_CONFIG", str(path))
    for info in tf.gemv_bind_configs(256, 320, dev)[1].values():
        assert info["path"] == "fma" and info["source"] == f"sm_90 table {path}"
        assert info["refused"] == "MMA GEMV needs K a multiple of 128, got K=320"
    assert tf.gemv_bind_configs(20480, 2560, dev)[1][1]["source"] == f"untuned default, no sm_90 entry {path}"


class _FakeGemvLinear:
    """A ``linear`` backend for CPU that records what ``TritonLinear.bind`` records (its ``gemv_bind_configs``
    call and the ``gemv_shape`` / ``gemv_paths`` attributes) without needing the weight on a GPU."""
    name = "fakegemv"

    def bind(self, lin, dtype):
        from bytebound.kernels.triton_fp8 import MAX_M, gemv_bind_configs
        if lin.fmt != "fp8":
            return lambda x: x
        _, paths = gemv_bind_configs(lin.weight.shape[0], lin.weight.shape[1], torch.device("cuda"), tuple(lin.block))

        def fn(x):
            return x
        fn.max_tokens = MAX_M
        fn.gemv_shape, fn.gemv_paths = tuple(lin.weight.shape), paths
        return fn


def _manifest_text(levers: dict) -> str:
    from bytebound.verify.manifest import format_manifest
    return format_manifest({"status": "healthy", "strict": False, "levers": levers, "plan": None, "canaries": None,
                            "problems": [], "watchdog": None, "not_checked": [],
                            "model": {"name": "ling-3.0-flash", "device": "cuda:0", "dtype": "bfloat16"}})


def test_manifest_lists_the_gemv_path_of_every_decode_shape(monkeypatch):
    """``bind_model`` over the Ling-3.0-flash model (meta tensors) with a faked sm_90: ``levers.linear.gemv`` has
    exactly the benchmark's decode shapes with their layer counts, each M = 1..4 the table's path, printed one
    line per shape; a shared expert the routed kernels run is "not called" at those M; a Gluon refusal is printed
    with its reason."""
    from bytebound.config import LingConfig
    from bytebound.kernels import registry
    from bytebound.layers.moe import MoE
    from bytebound.models import model_class
    from bytebound.runner import backends
    from bytebound.verify.manifest import _resolution
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_gemv import DEFAULT_CONFIG, decode_shapes
    tf = _fake_sm90(monkeypatch)
    monkeypatch.setitem(registry._REGISTRY["linear"], "fakegemv", registry._Entry(_FakeGemvLinear, lambda dev: None))
    cfg = LingConfig.from_file(DEFAULT_CONFIG)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, torch.bfloat16)
    plan = backends.bind_model(model, backends.BackendPlan.default("cpu", linear="fakegemv"), "cuda")
    lever = json.loads(json.dumps(_resolution(plan.resolutions["linear"])))
    gemv = lever["gemv"]
    assert json.loads(json.dumps(plan.to_dict()))          # the plan (with the resolution) stays serialisable
    assert {k: d["layers"] for k, d in gemv.items()} == {f"{e['n']}x{e['k']}": e["count"] for e in decode_shapes()}
    table = tf.gemv_table()["sm_90"]
    for shape, d in gemv.items():
        n, k = map(int, shape.split("x"))
        assert sorted(d) == ["M=1", "M=2", "M=3", "M=4", "layers"]
        for m in (1, 2, 3, 4):
            want = "mma" if table[tf.gemv_key(n, k, m)].get("MMA") else "fma"
            assert d[f"M={m}"] == f"{want} (sm_90 table)", (shape, m)
    assert gemv["20480x2560"]["M=1"] == "mma (sm_90 table)" and gemv["20480x2560"]["layers"] == 35
    text = _manifest_text({"linear": lever})
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("gemv ")]
    assert len(lines) == len(gemv) and "gemv 20480x2560 (35 layers) M=1..4: mma (sm_90 table)" in lines

    # the routed kernels run the shared expert at M = 1, 2 (MoEKernel.bind_shared): its projections are not called
    class Shared:
        def shared_for(self, m, k):
            return m <= 2
    moes = [x for x in model.modules() if isinstance(x, MoE)]
    for x in moes:
        x.experts.fn = Shared()
    inter = cfg.shared_intermediate
    shared = backends._linear_gemv(model)[f"{inter}x{cfg.hidden_size}"]
    assert shared["layers"] == 2 * len(moes) and shared["M=3"] == shared["M=4"] == "mma (sm_90 table)"
    assert shared["M=1"] == shared["M=2"] == "not called (the shared expert runs in the routed MoE kernels)"
    text = _manifest_text({"linear": {"requested": "x", "resolved": "x", "ok": True,
                                      "gemv": backends._linear_gemv(model)}})
    assert "M=1: not called (the shared expert runs in the routed MoE kernels) | M=2: " in text

    err = "triton.experimental.gluon is not importable: ImportError: x"
    _fake_sm90(monkeypatch, gluon_err=err)
    plan = backends.bind_model(model, backends.BackendPlan.default("cpu", linear="fakegemv"), "cuda")
    gemv = plan.resolutions["linear"].gemv
    assert gemv["20480x2560"]["M=4"] == f"fma (sm_90 table; mma refused: {err})"
    assert gemv["2560x768"]["M=1"] == "fma (sm_90 table)"              # an FMA entry: nothing was refused
    assert f"gemv 20480x2560 (35 layers) M=1..4: fma (sm_90 table; mma refused: {err})" in _manifest_text(
        {"linear": _resolution(plan.resolutions["linear"])})


def test_manifest_has_no_gemv_without_the_fp8_gemv():
    """The torch backend binds no GEMV: the linear lever carries no ``gemv`` (and prints none)."""
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LingConfig
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.verify.manifest import _resolution
    model = dummy_model(LingConfig.from_file("models/ling-nano/config.json"), torch.device("cpu"), torch.float32)
    plan = bind_model(model, BackendPlan.default("cpu"), "cpu")
    lever = _resolution(plan.resolutions["linear"])
    assert plan.resolutions["linear"].resolved == "torch" and "gemv" not in lever
    assert "gemv" not in _manifest_text({"linear": lever})
