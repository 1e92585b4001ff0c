"""The ``persist`` MoE variant's host side on CPU (``kernels.triton_moe_persist``): config fitting and refusals,
phase B's slot groups, the occupancy arithmetic, the ``BYTEBOUND_MOE_VARIANT`` override and the dispatch; and (slow,
needs Triton with its bundled ptxas) the offline sm_90 compile with its register / spill / shared-memory budget.
The kernel itself runs in tests/gpu/test_moe_persist_gpu.py."""

import importlib

import pytest
from conftest import triton_kernels

from bytebound.errors import BackendError

with triton_kernels("bytebound.kernels.moe_host") as tm:
    tp = importlib.reload(importlib.import_module("bytebound.kernels.triton_moe_persist"))
    tm = importlib.reload(tm)          # it holds the reloaded persist module


@pytest.mark.parametrize("h,i", [(2560, 768), (256, 128), (1152, 384)])
@pytest.mark.parametrize("cfg", [{}, {"num_warps": 8}, {"num_warps": 2, "HC": 512, "IC": 128}, {"HC": 1000},
                                 {"num_warps": 16}])
def test_persist_fit_divides_the_shape(h, i, cfg):
    c = tm.fit_config(dict(cfg, variant="persist"), h, i)
    assert c["variant"] == "persist"
    for n, ch, want in ((h, c["HC"], cfg.get("HC", tp.PERSIST_DEFAULT["HC"])),
                        (i, c["IC"], cfg.get("IC", tp.PERSIST_DEFAULT["IC"]))):
        assert n % ch == 0 and ch % 128 == 0 and ch <= max(128, want)
        assert (ch // 128) & (ch // 128 - 1) == 0, f"{ch} columns is not 128 x a power of two"
    assert 2 * c["BI"] == 16 * c["num_warps"] and i % c["BI"] == 0 and 2 <= c["num_warps"] <= 8


def test_persist_fit_keeps_the_given_tiling():
    c = tp.fit_persist_config({"num_warps": 8, "HC": 512, "IC": 256, "per_sm": 2}, 2560, 768)
    assert (c["num_warps"], c["BI"], c["HC"], c["IC"], c["per_sm"]) == (8, 64, 512, 256, 2)
    assert tp.fit_persist_config({"HC": 1024}, 2560, 768)["HC"] == 512          # 2560 / 1024 is not whole


def test_persist_refuses_shapes_it_cannot_tile():
    with pytest.raises(BackendError, match="chunks of 128"):
        tp.fit_persist_config({}, 96, 128)
    with pytest.raises(BackendError, match="chunks of 128"):
        tm.fit_config({"variant": "persist"}, 256, 200)


@pytest.mark.parametrize("nw", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [8, 6, 5])
def test_slot_group(nw, m, k):
    g, mp = tp.slot_group(nw, m, k), tp.token_pad(m)
    assert mp >= m and mp & (mp - 1) == 0 and mp < 2 * m
    assert g & (g - 1) == 0 and g <= nw and g * mp <= 8 and (m * k) % g == 0
    assert (16 * nw // g) % 16 == 0
    assert tp.slot_group(4, 1, 8) == 4 and tp.slot_group(8, 1, 8) == 8 and tp.slot_group(4, 4, 8) == 2
    assert tp.slot_group(4, 1, 5) == 1      # 5 slots: no group of 2 or 4 divides them


def test_programs_per_sm():
    assert tp.programs_per_sm(72, 2048, 4) == 7         # 72 x 32 = 2304 regs per warp: 28 warps
    assert tp.programs_per_sm(255, 2048, 4) == 2        # 256 x 32 per warp: 8 warps
    assert tp.programs_per_sm(32, 0, 4) == 16           # the 64-warp limit
    assert tp.programs_per_sm(32, 200 * 1024, 4) == 1   # shared memory
    assert tp.programs_per_sm(32, 240 * 1024, 4) == 0


def test_variant_override(monkeypatch):
    monkeypatch.setenv("BYTEBOUND_MOE_VARIANT", "persist")
    cfg = tm.lookup_config(32, 256, 128, 4, 1)
    assert cfg == tp.PERSIST_DEFAULT
    assert "persist" in tm.SHARED_VARIANTS


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 4])
def test_persist_compiles_for_sm90(m):
    """The Gluon kernel compiles for sm_90 at Ling shapes with the shared expert and the clamp at the default tiling
    (scripts/persist_ptxas.py, in a fresh interpreter: the CPU tests load the Triton modules in interpreter mode);
    no spills and at least 2 programs fit on an SM (registers, shared memory)."""
    import re
    from conftest import run_offline_script
    pytest.importorskip("triton")
    if tp.gluon is None:
        pytest.skip(tp.GLUON_ERR)
    d = tp.PERSIST_DEFAULT
    out = run_offline_script("persist_ptxas", "--m", str(m), "--warps", str(d["num_warps"]), "--hc", str(d["HC"]),
                             "--ic", str(d["IC"]), "--check-ptx")
    stack = int(re.search(r"STACK:(\d+)", out).group(1))
    per_sm = int(re.search(r"-> (\d+) programs/SM", out).group(1))
    assert stack == 0, out
    assert per_sm >= 2, out
