"""Launch-config plumbing of the triton MoE backend (pure Python: runs on CPU without Triton).

The kernels themselves are tested on the GPU (tests/gpu/test_kernels_gpu.py); here: the committed table parses,
the ``split`` variant's tiling is shrunk to small models' shapes or refused with a named error, the
``BYTEBOUND_MOE_VARIANT`` override picks the variant's defaults, and configs resolve by capability (exact GPU name,
then the architecture's default: an "NVIDIA H100 80GB HBM3" (sm_90, mocked) resolves like the H200, an sm_80 GPU
gets the class default; the matched key is recorded)."""

import importlib

import pytest
import torch
from conftest import triton_kernels

from bytebound.errors import BackendError

# Through conftest.triton_kernels, like the other Triton modules' CPU tests: where Triton is installed and there is
# no GPU, it must first load in interpreter mode, or the interpreter tests collected after this file fail.
with triton_kernels("bytebound.kernels.moe_host") as tm:
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
@pytest.mark.parametrize("cfg", [{}, {"KP": 4, "KP2": 2}, {"BI": 32, "num_warps": 8, "BH": 16}, {"KP": 40},
                                 {"KP": 2, "KC": 5, "SG": 4}, {"KP": 1, "KC": 64, "SG": 0}])
def test_split_fit_divides_the_shape(h, i, cfg):
    c = ts.fit_split_config(cfg, h, i)
    assert c["variant"] == "split"
    assert i % c["BI"] == 0 and h % c["BH"] == 0
    # kernel A's unit is one chunk of an H slice (KP slices x KC chunks), kernel B's one I slice
    for n, parts, widest in ((h, c["KP"] * c["KC"], 512), (i, c["KP2"], 256)):
        assert n % parts == 0 and (n // parts) % 128 == 0 and n // parts <= widest
        ns = n // parts // 128
        assert ns & (ns - 1) == 0, f"{n}/{parts}: {ns} super-blocks is not a power of two"
    assert c["KC"] >= 1 and c["KC"] <= max(1, cfg.get("KC", 1)) and c["SG"] >= 1
    assert 2 * c["BI"] >= 16 * c["num_warps"] and c["BH"] >= 16 * c["down_warps"]


def test_split_fit_chunks():
    """KP x KC is fitted as one count of H chunks, KC the largest divisor of it not above the one asked for."""
    c = ts.fit_split_config({"KP": 2, "KC": 5}, 2560, 768)
    assert (c["KP"], c["KC"]) == (2, 5)                                      # 10 chunks of 256 columns
    c = ts.fit_split_config({"KP": 5, "KC": 4}, 2560, 768)
    assert (c["KP"], c["KC"]) == (5, 4)                                      # 20 chunks of 128
    c = ts.fit_split_config({"KP": 1, "KC": 3}, 2560, 768)
    assert (c["KP"], c["KC"]) == (5, 1)                                      # 3 -> 5 chunks; 3 does not divide 5
    assert ts.fit_split_config({}, 2560, 768)["KC"] == 1 and ts.fit_split_config({}, 2560, 768)["SG"] == 1


def test_split_fit_ring_and_staging_keys():
    """``TR`` (kernel A as a TMA ring) fits kernel A's partition to its items (KP = H / (128 TR_NS), KC 1, and RK 1,
    whose launch sums the partials), leaves a model whose H is one item without the ring (no RK launch there to sum
    them: the partials would land in the activations), and refuses a TR_NS that is not a power of two; ``XS`` is
    fitted to 0 where the program's H slice is not 128 x 2^n columns; both refuse values other than their own; ``TR_XS``
    and ``NR`` pass through to the launch, and out-of-range values are named errors."""
    c = ts.fit_split_config({"KP": 2, "KC": 5, "RK": 0, "TR": 1}, 2560, 768)
    assert (c["TR"], c["KP"], c["KC"], c["RK"]) == (1, 10, 1, 1)
    c = ts.fit_split_config({"KP": 2, "KC": 5, "TR": 2, "TR_NS": 4}, 2560, 768)
    assert (c["TR"], c["KP"], c["KC"], c["RK"]) == (2, 5, 1, 1)
    c = ts.fit_split_config({"KP": 1, "TR": 1}, 256, 128)
    assert c["TR"] == 0 and c["KP"] == 1
    with pytest.raises(BackendError, match="TR_NS"):
        ts.fit_split_config({"TR": 1, "TR_NS": 3}, 2560, 768)
    with pytest.raises(BackendError, match="TR"):
        ts.fit_split_config({"TR": 3}, 2560, 768)
    assert ts.fit_split_config({"KP": 2, "KC": 5, "XS": 1}, 2560, 768)["XS"] == 0       # 1,280 columns
    assert ts.fit_split_config({"KP": 10, "KC": 1, "XS": 1}, 2560, 768)["XS"] == 1      # 256
    with pytest.raises(BackendError, match="XS"):
        ts.fit_split_config({"XS": 2}, 2560, 768)
    assert ts.fit_split_config({"KP": 2, "KC": 5, "TR": 1, "TR_XS": 0}, 2560, 768)["TR_XS"] == 0   # to the launch
    assert ts.fit_split_config({"KP": 2, "KC": 5, "NR": 64}, 2560, 768)["NR"] == 64
    with pytest.raises(BackendError, match="TR_REGS"):          # the ring would ignore it: never silently
        ts.fit_split_config({"KP": 2, "KC": 5, "TR": 1, "NR": 64}, 2560, 768)
    # a ring candidate over an entry with a cap turns the cap off explicitly (the sweeps' "NR": null)
    assert ts.fit_split_config({"KP": 2, "KC": 5, "NR": 80, **{"TR": 1, "NR": None}}, 2560, 768)["TR"] == 1
    with pytest.raises(BackendError, match="TR_XS"):
        ts.fit_split_config({"TR": 1, "TR_XS": 2}, 2560, 768)
    for bad in (16, 300, 64.0):
        with pytest.raises(BackendError, match="NR"):
            ts.fit_split_config({"NR": bad}, 2560, 768)
        with pytest.raises(BackendError, match="NR2 .kernel B"):
            ts.fit_split_config({"NR2": bad}, 2560, 768)
    assert ts.fit_split_config({"KP": 2, "KC": 5, "NR2": 96}, 2560, 768)["NR2"] == 96


@pytest.mark.skipif(ts.gl is None, reason="needs Gluon (triton >= 3.5) for the word layouts")
@pytest.mark.parametrize("m,shared", [(1, True), (4, True), (4, False)])
def test_split_constexprs_follow_the_fitted_config(m, shared):
    """``split_constexprs`` (what ``launch_split`` launches with and ``scripts/split_ptxas.py`` compiles): kernel A's
    word layout spans one H chunk of ``2*BI`` rows, kernel B's one I slice of ``BH`` rows, ``SG`` is cut to the routed
    slot count, the shared expert's FP8 layouts exist only with it, and the PDL switches pass through."""
    c = ts.fit_split_config({"BI": 64, "KP": 2, "KC": 5, "num_warps": 8, "SG": 64}, 2560, 768)
    a, b = ts.split_constexprs(m, 8, 2560, 768, c, shared, False, True, 1)
    assert (a["M"], a["TOPK"], a["BI"], a["KP"], a["KC"], a["PDL"], a["PDL_IN"], a["SHARED"]) == \
        (m, 8, 64, 2, 5, True, 1, shared)
    assert a["WD"] == ts.word_layout(128, 2560 // 2 // 5 // 128, 8)
    assert a["SP"] == max(32, 1 << (8 * m - 1).bit_length())
    assert b["SG"] == min(c["SG"], 8 * m) and b["S"] == 8 * m
    assert b["WD"] == ts.word_layout(c["BH"], 768 // c["KP2"] // 128, c["down_warps"])
    assert (a["WD8"] is not None, b["WD8"] is not None) == (shared, shared)


@pytest.mark.skipif(ts.gl is None, reason="needs Gluon (triton >= 3.5) for the word layouts")
def test_split_reduce_kernel_key():
    """``RK``: kernel A's partials summed by a launch of their own; 0 by default, on only where there are partials
    (KP > 1), anything but 0/1 a named error."""
    c = ts.fit_split_config({"BI": 64, "KP": 2, "KC": 5, "num_warps": 8, "RK": 1}, 2560, 768)
    assert ts.split_constexprs(4, 8, 2560, 768, c, True, False, True, 1)[0]["RK"] == 1
    c0 = ts.fit_split_config({"BI": 64, "KP": 2, "KC": 5, "num_warps": 8}, 2560, 768)
    assert ts.split_constexprs(4, 8, 2560, 768, c0, True, False, True, 1)[0]["RK"] == 0
    one = ts.fit_split_config({"KP": 1, "KC": 2, "RK": 1}, 256, 128)       # one H slice: nothing to sum
    assert one["KP"] == 1 and ts.split_constexprs(1, 4, 256, 128, one, False, False, True, 0)[0]["RK"] == 0
    with pytest.raises(BackendError, match="RK"):
        ts.fit_split_config({"RK": 2}, 2560, 768)


@pytest.mark.skipif(ts.gl is None, reason="needs Gluon (triton >= 3.5) for the word layouts")
def test_split_reduce_in_b_key():
    """``RB``: kernel B sums kernel A's partials; kernel A then ends after its partials as under ``RK`` (its constexpr
    ``RK`` 1) while no third launch runs (``launch_split`` skips the reduce launch where kernel B has ``RB``), and B
    gets A's tiling (``BIA``, ``KPA``) and the clamp switch. Off where there are no partials (KP 1); with ``RK`` or
    ``TR``, or anything but 0/1, a named error."""
    c = ts.fit_split_config({"BI": 64, "KP": 5, "num_warps": 8, "RB": 1}, 2560, 768)
    a, b = ts.split_constexprs(1, 8, 2560, 768, c, True, True, True, 1)
    assert (a["RK"], b["RB"], b["BIA"], b["KPA"], b["HAS_LIMIT"]) == (1, 1, 64, 5, True)
    a0, b0 = ts.split_constexprs(1, 8, 2560, 768, ts.fit_split_config({"BI": 64, "KP": 5}, 2560, 768), True, True,
                                 True, 1)
    # without RB kernel B gets none of what only RB reads: one binary (and cache key) whatever A's tiling and clamps
    assert (a0["RK"], b0["RB"], b0["BIA"], b0["KPA"], b0["HAS_LIMIT"]) == (0, 0, 1, 1, False)
    one = ts.fit_split_config({"KP": 1, "KC": 2, "RB": 1}, 256, 128)
    assert ts.split_constexprs(1, 4, 256, 128, one, False, False, True, 0)[1]["RB"] == 0
    for bad in ({"RB": 2}, {"RB": 1, "RK": 1}, {"RB": 1, "TR": 1}):
        with pytest.raises(BackendError, match="RB"):
            ts.fit_split_config(bad, 2560, 768)


def test_split_decode_key(monkeypatch):
    """``DQ``: the shift decode (1) by default, the table (0) on request, anything else a named error; the constexprs
    carry it to both kernels unless the launch lowers it (scales the shift decode cannot take, or the A/B switch
    ``BYTEBOUND_MOE_DQ=0``), and the config source says which decode runs and why."""
    kern = _host_kernel(512, 2560, 768)
    cfg = ts.fit_split_config({}, 2560, 768)
    assert ts.launch_dq(kern, cfg) == (1, "") and ts.launch_dq(kern, dict(cfg, DQ=0)) == (0, "")
    kern.configs = {1: cfg}
    assert kern.config_source(1, 8) == "split, given by the caller, shift decode"
    monkeypatch.setenv("BYTEBOUND_MOE_DQ", "0")
    assert ts.launch_dq(kern, cfg) == (0, "BYTEBOUND_MOE_DQ=0")
    monkeypatch.delenv("BYTEBOUND_MOE_DQ")
    kern.scale_max, kern.shift_decode = 130, False
    assert ts.launch_dq(kern, cfg) == (0, "an E8M0 scale byte 130 > 128")
    assert kern.config_source(1, 8) == "split, given by the caller, table decode (an E8M0 scale byte 130 > 128)"
    assert ts.fit_split_config({}, 2560, 768)["DQ"] == 1
    c = ts.fit_split_config({"DQ": 0}, 2560, 768)
    assert c["DQ"] == 0
    with pytest.raises(BackendError, match="DQ"):
        ts.fit_split_config({"DQ": 2}, 2560, 768)
    if ts.gl is not None:
        a, b = ts.split_constexprs(1, 8, 2560, 768, ts.fit_split_config({}, 2560, 768), True, False, True, 1)
        assert a["DQ"] == b["DQ"] == 1
        a, b = ts.split_constexprs(1, 8, 2560, 768, ts.fit_split_config({}, 2560, 768), True, False, True, 1, dq=0)
        assert a["DQ"] == b["DQ"] == 0


def _shift_decode(word: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """``triton_moe_split.ASM_DEQ8_SHIFT`` in torch (int64 for the bit maths, BF16 for the product): int32 words
    ``[N]`` and E8M0 bytes ``[N]`` -> BF16 ``[N, 8]``, value ``i`` of register ``i // 2`` half ``i % 2`` (code
    ``i // 2 + 4 (i % 2)`` of the word)."""
    w = word.to(torch.int64) & 0xFFFFFFFF
    m = 0xFFFFFFFF
    regs = [(((w << 6) & 0x01C001C0) | ((w << 12) & 0x80008000)) & m,
            (((w << 2) & 0x01C001C0) | ((w << 8) & 0x80008000)) & m,
            (((w >> 2) & 0x01C001C0) | ((w << 4) & 0x80008000)) & m,
            (((w >> 6) & 0x01C001C0) | (w & 0x80008000)) & m]
    f = ((e8m0.to(torch.int64) + 126) << 7).to(torch.int16).view(torch.bfloat16)     # 2^(E-1), one half
    out = []
    for r in regs:
        for half in (r & 0xFFFF, r >> 16):
            v = torch.where(half >= 1 << 15, half - (1 << 16), half).to(torch.int16).view(torch.bfloat16)
            out.append(v * f)
    return torch.stack(out, -1)


def test_shift_decode_maths_equals_e2m1():
    """The shift decode's bit maths (the 2^126 factor folded into the E8M0 scale, BF16 subnormals for the 0.5
    code) gives the float64 MXFP4 value of every code at every E8M0 byte 0..128, in the documented code order;
    and byte 129 is where it would stop being exact (its factor 2^128 is not a finite BF16)."""
    from bytebound.quant import dequantize_mxfp4
    g = torch.Generator().manual_seed(0)
    blocks = 129 * 16                                   # 32-value E8M0 blocks: 4 words each, 16 blocks per byte
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (blocks * 4,), generator=g, dtype=torch.int32)
    words[:2] = torch.tensor([0x76543210, 0xFEDCBA98 - (1 << 32)], dtype=torch.int32)             # every code
    e = torch.arange(129, dtype=torch.uint8).repeat_interleave(16)                               # [blocks]
    got = _shift_decode(words, e.repeat_interleave(4)).double().view(blocks, 4, 8)               # register order
    ref = dequantize_mxfp4(words.view(torch.uint8).view(blocks, 16), e.view(blocks, 1), torch.float64)
    ref = ref.view(blocks, 4, 8)                                                  # [block, word, code]
    order = [0, 4, 1, 5, 2, 6, 3, 7]                                              # register r: codes r, r + 4
    assert torch.equal(got, ref[:, :, order])
    assert ts.SHIFT_DECODE_MAX_E8M0 == 128
    f129 = torch.tensor([(129 + 126) << 7], dtype=torch.int64).to(torch.int16).view(torch.bfloat16)
    assert not torch.isfinite(f129.float()).all()


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


# ---- defaults by capability (issue 18, scope 2): exact name, then architecture, then the class default --------
LING = (512, 2560, 768, 8)      # E, H, I, top_k of Ling-3.0-flash: the shape the committed table is tuned for


def _device(monkeypatch, name: str | None, cap: tuple[int, int] | None = None):
    """Pretend to run on the CUDA device ``name`` of compute capability ``cap`` (None: no CUDA), with the
    committed table and no variant override."""
    monkeypatch.delenv("BYTEBOUND_MOE_CONFIG", raising=False)
    monkeypatch.delenv("BYTEBOUND_MOE_VARIANT", raising=False)
    monkeypatch.setattr(tm.torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(tm.torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(tm.torch.cuda, "get_device_capability", lambda device=None: cap)


def _h200_entry(m: int) -> dict:
    """The committed H200 entry as the lookup must return it: the class default's keys overlaid by the entry's
    (read from the JSON file itself, not through the code under test)."""
    import json
    raw = json.loads(tm.CONFIG_PATH.read_text())["NVIDIA H200"][tm.shape_key(*LING, m)]
    return {**tm.DEFAULT_CONFIG, **raw}


@pytest.mark.parametrize("m", [1, 4])
def test_h100_resolves_like_the_h200(monkeypatch, m):
    _device(monkeypatch, "NVIDIA H200", (9, 0))
    h200 = tm.resolve_config(*LING, m)
    assert h200 == (_h200_entry(m), "tuned for NVIDIA H200")
    _device(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    cfg, source = tm.resolve_config(*LING, m)
    assert cfg == h200[0] and cfg["variant"] == "split"
    assert source == "sm_90 default (tuned on NVIDIA H200)"
    assert tm.fit_config(cfg, 2560, 768) == tm.fit_config(h200[0], 2560, 768)


def test_sm80_gets_the_class_default_and_says_why(monkeypatch):
    _device(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    cfg, source = tm.resolve_config(*LING, 1)
    assert cfg == tm.DEFAULT_CONFIG and cfg["variant"] == "gluon"
    assert source == ("untuned class default (no entry for NVIDIA A100-SXM4-80GB or sm_80 at "
                      "E512_H2560_I768_k8_M1)")
    _device(monkeypatch, None)
    assert tm.resolve_config(*LING, 1) == (tm.DEFAULT_CONFIG, "untuned class default (no entry for cpu at "
                                                             "E512_H2560_I768_k8_M1)")


def test_untuned_shape_on_sm90_gets_the_class_default(monkeypatch):
    """The architecture default holds the H200's entries, i.e. its shapes: another shape (here M = 2, which the
    committed table has no entry for) falls through to the class default, and the record says so."""
    _device(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    cfg, source = tm.resolve_config(*LING, 2)
    assert cfg == tm.DEFAULT_CONFIG and source.startswith("untuned class default (no entry for NVIDIA H100 80GB "
                                                          "HBM3 or sm_90 at E512_H2560_I768_k8_M2")


def test_exact_name_wins_and_the_env_table_is_named(monkeypatch, tmp_path):
    import json
    own = {"variant": "split", "BI": 32, "KP": 5, "num_warps": 4, "BH": 64, "KP2": 3, "down_warps": 4}
    table = {"_arch_defaults": {"sm_90": "NVIDIA H200"}, "NVIDIA H200": {tm.shape_key(*LING, 1): {"variant": "tl"}},
             "NVIDIA H100 80GB HBM3": {tm.shape_key(*LING, 1): own}}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(table))
    _device(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setenv("BYTEBOUND_MOE_CONFIG", str(path))
    cfg, source = tm.resolve_config(*LING, 1)
    assert cfg == {**tm.DEFAULT_CONFIG, **own} and source == f"tuned for NVIDIA H100 80GB HBM3, table {path}"
    _device(monkeypatch, "NVIDIA H800", (9, 0))
    monkeypatch.setenv("BYTEBOUND_MOE_CONFIG", str(path))
    assert tm.resolve_config(*LING, 1) == ({**tm.DEFAULT_CONFIG, "variant": "tl"},
                                           f"sm_90 default (tuned on NVIDIA H200), table {path}")
    monkeypatch.setenv("BYTEBOUND_MOE_VARIANT", "gluon")
    cfg, source = tm.resolve_config(*LING, 1)
    assert cfg["variant"] == "gluon" and source.endswith("; variant forced by BYTEBOUND_MOE_VARIANT=gluon")


def _host_kernel(e, h, i):
    """A ``MoEKernel`` with only its host-side config state (no CUDA tensors: the kernels never launch here)."""
    kern = object.__new__(tm.MoEKernel)
    kern.e, kern.h, kern.i, kern.configs, kern._fitted = e, h, i, {}, {}
    kern.cnt = torch.zeros(1, dtype=torch.int32)
    kern.scale_max, kern.shift_decode = 122, True      # E8M0 bytes of real weights' size: the shift decode
    return kern


@pytest.mark.parametrize("name,cap,fused", [("NVIDIA H100 80GB HBM3", (9, 0), True),
                                            ("NVIDIA H20", (9, 0), True),
                                            ("NVIDIA A100-SXM4-80GB", (8, 0), False)])
def test_shared_expert_fusion_and_manifest_record_by_capability(monkeypatch, name, cap, fused):
    """Shared-expert fusion follows the resolved configs: on every sm_90 GPU the H200's 'split' entries apply and
    the shared expert is fused; on sm_80 the class default (gluon) runs it dense and the resolution says why.
    The moe resolution records, per M, the variant and the key that matched."""
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LingConfig
    from bytebound.layers.moe import MoE
    from bytebound.runner.backends import BackendPlan, _bind_shared, _moe_tuning, bind_model

    class HostKernel:
        """The MoEKernel's config methods at Ling's shape, bound to a nano layer (only the host logic runs)."""
        def __init__(self):
            self.kern, self.bound = _host_kernel(*LING[:3]), 0

        def config(self, m, k):
            return self.kern.config(m, LING[3])

        def config_source(self, m, k):
            return self.kern.config_source(m, LING[3])

        def bind_shared(self, mlp):
            self.bound += 1

    model = dummy_model(LingConfig.from_file("models/ling-nano/config.json"), torch.device("cpu"), torch.float32)
    plan = bind_model(model, BackendPlan.default("cpu"), "cpu")
    _device(monkeypatch, name, cap)
    moes = [m for m in model.modules() if isinstance(m, MoE) and m.shared_experts is not None]
    for m in moes:
        m.experts.fn = HostKernel()
    _bind_shared(model, plan, strict=False)
    assert [m.experts.fn.bound for m in moes] == [int(fused)] * len(moes)
    tuning = _moe_tuning(model)
    if fused:
        assert plan.resolutions["moe"].shared == f"fused into the routed kernels ({len(moes)} layers)"
        # the committed entries: the table decode at M = 1, the shift decode at M = 4 (docs/perf/history.md)
        assert tuning["M=1"] == "split, sm_90 default (tuned on NVIDIA H200), table decode"
        assert tuning["M=4"] == "split, sm_90 default (tuned on NVIDIA H200), shift decode"
    else:
        assert plan.resolutions["moe"].shared.startswith("dense; not fused: the triton MoE configs")
        assert tuning["M=1"].startswith("gluon, untuned class default (no entry for NVIDIA A100-SXM4-80GB or sm_80")
    assert sorted(tuning) == [f"M={m}" for m in range(1, 5)]
    assert tuning["M=2"].startswith("gluon, untuned class default")    # the table has no M = 2 entry anywhere


@pytest.mark.slow
def test_ring_compiles_for_sm90():
    """``TR`` 1 and 2 (kernels.triton_moe_ring; 2 also with ``TR_XS 0``) compile for sm_90 at Ling's shape with the
    shared expert, M = 1 and 4
    (scripts/ring_ptxas.py, in a fresh interpreter: the CPU tests load Triton in interpreter mode), with no spills, in
    the shared memory of one H100/H200 SM, and with the item metadata read from the program's slot row: the only
    warp reductions (``REDUX``) left are the ones that build the row once (at most four), not two per item lookup."""
    import re
    from conftest import run_offline_script
    pytest.importorskip("triton")
    if ts.gluon is None:
        pytest.skip(ts.GLUON_ERR)
    out = run_offline_script("ring_ptxas", "--m", "1,4", "--config", '{"BI": 64, "num_warps": 8}',
                             "--config", '{"BI": 64, "num_warps": 8, "TR": 2}',
                             "--config", '{"BI": 64, "num_warps": 8, "TR": 2, "TR_XS": 0}', timeout=900)
    rows = [ln for ln in out.splitlines() if ln.startswith("M=")]
    assert len(rows) == 6, out
    for ln in rows:
        assert int(re.search(r"STACK:(\d+)", ln).group(1)) == 0, ln
        assert int(re.search(r"shared (\d+) B", ln).group(1)) <= 227 * 1024, ln
        assert int(re.search(r"(\d+) UTMALDG", ln).group(1)) >= 2, ln
        assert int(re.search(r"(\d+) REDUX", ln).group(1)) <= 4, ln
