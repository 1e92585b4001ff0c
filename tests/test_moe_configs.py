"""Launch-config plumbing of the triton MoE backend (pure Python: runs on CPU without Triton).

The kernels themselves are tested on the GPU (tests/gpu/test_kernels_gpu.py); here: the committed table parses,
the ``split`` variant's tiling is shrunk to small models' shapes or refused with a named error, and the
``BYTEBOUND_MOE_VARIANT`` override picks the variant's defaults."""

import importlib

import pytest
from conftest import triton_kernels

from bytebound.errors import BackendError

# Through conftest.triton_kernels, like the other Triton modules' CPU tests: where Triton is installed and there is
# no GPU, it must first load in interpreter mode, or the interpreter tests collected after this file fail.
with triton_kernels("bytebound.kernels.triton_moe") as tm:
    ts = importlib.reload(importlib.import_module("bytebound.kernels.triton_moe_split"))


def test_committed_table_entries_fit_ling_shapes():
    table = tm.load_configs()
    assert table, "configs/triton_moe.json is missing or empty"
    for gpu, entries in table.items():
        if gpu.startswith("_"):
            continue
        for key, cfg in entries.items():
            fitted = tm.fit_config(cfg, 2560, 768)
            # a committed entry is used as written at the shape it was tuned for: fitting must not change it
            assert {k: fitted[k] for k in cfg} == cfg, f"{gpu} {key}: {cfg} -> {fitted}"


@pytest.mark.parametrize("h,i", [(256, 128), (2560, 768), (512, 384)])
@pytest.mark.parametrize("cfg", [{}, {"KP": 4, "KP2": 2}, {"BI": 32, "num_warps": 8, "BH": 16}, {"KP": 40}])
def test_split_fit_divides_the_shape(h, i, cfg):
    c = ts.fit_split_config(cfg, h, i)
    assert c["variant"] == "split"
    assert i % c["BI"] == 0 and h % c["BH"] == 0
    for n, kp in ((h, c["KP"]), (i, c["KP2"])):
        assert n % kp == 0 and (n // kp) % 128 == 0
        ns = n // kp // 128
        assert ns & (ns - 1) == 0, f"{n}/{kp}: {ns} super-blocks is not a power of two"
    assert 2 * c["BI"] >= 16 * c["num_warps"] and c["BH"] >= 16 * c["down_warps"]


def test_split_fit_picks_the_nearest_slice_count():
    assert ts.fit_split_config({"KP": 4, "KP2": 3}, 2560, 768)["KP"] == 5       # 2560/4 = 640 is not 128 x 2^n
    assert ts.fit_split_config({"KP": 10, "KP2": 3}, 2560, 768)["KP2"] == 3
    assert ts.fit_split_config({"KP": 10}, 256, 128)["KP"] == 2                  # the largest that fits


def test_split_refuses_shapes_it_cannot_tile():
    with pytest.raises(BackendError, match="slices of 128"):
        ts.fit_split_config({}, 96, 128)
    with pytest.raises(BackendError, match="slices of 128"):
        tm.fit_config({"variant": "split"}, 256, 96)
    assert ts.fit_split_config({"KP": 4}, 1152, 128)["KP"] == 9              # 1152 = 9 slices of 128


def test_variant_override(monkeypatch):
    monkeypatch.setenv("BYTEBOUND_MOE_VARIANT", "split")
    cfg = tm.lookup_config(32, 256, 128, 4, 1)
    assert cfg == ts.SPLIT_DEFAULT
    monkeypatch.setenv("BYTEBOUND_MOE_VARIANT", "tl")
    assert tm.lookup_config(32, 256, 128, 4, 1)["variant"] == "tl"
