"""GPU kernels against the torch / float64 references at Ling-3.0-flash shapes (run by scripts/gpu_check.sh).

* moe: ``triton`` (the fused kernel in both implementations, ``gluon`` and ``tl``, with atomics and with
  partials; the two-kernel ``split`` variant at its default and at the committed H200 M = 1 tiling, and with one
  H slice) and ``humming`` vs a float64 reference of the routed sum, rel error <= 1e-2, M = 1-4 (with experts
  shared between the verify tokens), clamp on/off, Ling shape (E 512, H 2560, I 768, top-8) and a tiny shape
  (E 16, H 256, I 128, top-4); the triton kernels also repeated (workspace and tickets re-armed, bit-identical),
  under CUDA-graph replay, and their M > 4 refusal.
* moe, shared expert fused into the ``split`` kernels (``MoEKernel.bind_shared``): routed + shared vs the float64
  routed sum + float64 shared expert, rel <= 1e-2, at the default, the committed H200 tilings and KP = 1, M = 1-4
  with duplicates, clamps on either part; a whole MoE layer fused == unfused, under graph replay too.
* linear: FP8 128x128-block GEMV (M 1..4) and the M > 4 dequantise path vs the dequantised reference.
* lm_head: FP8 head top-1 agreement with the BF16 head >= 0.99 (including rows of large norm) and closeness to
  the FP8 reference ``quant.fp8_channel_matmul_ref``.
* kda: fla ``fused_recurrent`` (T = 1, in place) and ``chunk`` (T = 101) vs ``kda_ref.kda_recurrent``.

Weights are synthetic: uniformly random E2M1 codes with E8M0 scale bytes in a realistic band.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")]

LING = dict(e=512, h=2560, i=768, k=8)
TINY = dict(e=16, h=256, i=128, k=4)
DEV = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_experts(e, h, i, k=None, limit=None, seed=0):
    """RoutedExperts with random MXFP4 bytes (scale bytes 118..122 -> weights ~1e-2)."""
    from bytebound.layers.moe import RoutedExperts
    g = torch.Generator(device=DEV).manual_seed(seed)
    ex = RoutedExperts(e, h, i, "mxfp4", torch.bfloat16, DEV, limit)
    ex.w13.data = torch.randint(0, 256, (e, 2 * i, h // 2), generator=g, device=DEV, dtype=torch.uint8)
    ex.w13_scale.data = torch.randint(118, 123, (e, 2 * i, h // 32), generator=g, device=DEV, dtype=torch.uint8)
    ex.w2.data = torch.randint(0, 256, (e, h, i // 2), generator=g, device=DEV, dtype=torch.uint8)
    ex.w2_scale.data = torch.randint(118, 123, (e, h, i // 32), generator=g, device=DEV, dtype=torch.uint8)
    return ex


def make_routing(m, e, k, shared=0, seed=0):
    """ids [m, k] distinct per row; with ``shared`` > 0 every token reuses the first ``shared`` experts of token 0."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    if shared and m > 1:
        for r in range(1, m):
            rest = [x for x in ids[r].tolist() if x not in ids[0, :shared].tolist()]
            extra = [x for x in torch.randperm(e, generator=g).tolist() if x not in ids[0, :shared].tolist()]
            row = ids[0, :shared].tolist() + (rest + extra)[: k - shared]
            ids[r] = torch.tensor(row)[torch.randperm(k, generator=g)]
    w = torch.rand(m, k, generator=g) + 0.1
    w = w / w.sum(-1, keepdim=True) * 2.5
    return ids.to(DEV), w.float().to(DEV)


def moe_ref64(ex, x, ids, w):
    """float64 routed sum from the dequantised experts that were hit."""
    from bytebound.layers.moe import swiglu
    from bytebound.quant import dequantize_mxfp4
    m, k = ids.shape
    y = torch.zeros(m, ex.hidden, dtype=torch.float64, device=DEV)
    uniq = ids.unique()
    w13 = {int(e): dequantize_mxfp4(ex.w13[e], ex.w13_scale[e], torch.float64) for e in uniq}
    w2 = {int(e): dequantize_mxfp4(ex.w2[e], ex.w2_scale[e], torch.float64) for e in uniq}
    for r in range(m):
        for j in range(k):
            e = int(ids[r, j])
            hh = w13[e] @ x[r].double()
            a = swiglu(hh[: ex.inter], hh[ex.inter:], ex.limit)
            y[r] += float(w[r, j]) * (w2[e] @ a)
    return y


# triton MoE configurations under test: (variant, partials); "split" is the two-kernel variant
# (split: the ``partials`` slot carries a tiling override: the committed H200 M = 1 entry; kernel A's H slice in
# KC pipelined chunks with kernel B summing SG slots per program (SG 3 leaves a partial last group at M = 1 and 4,
# SG 8 one group per token at M = 4; on the tiny shape KC and KP are fitted down); or one H slice, which the tiny
# shape can run and Ling's H = 2560 cannot)
MOE_MODES = [("gluon", False), ("gluon", True), ("tl", False), ("tl", True), ("split", False),
             ("split", {"BI": 32, "KP": 5, "num_warps": 4, "BH": 64, "KP2": 3, "down_warps": 4}),
             ("split", {"BI": 64, "KP": 2, "KC": 5, "num_warps": 8, "SG": 3}),
             ("split", {"BI": 32, "KP": 1, "KC": 4, "num_warps": 4, "SG": 8, "BH": 128, "down_warps": 8}),
             ("split", {"DQ": 0}), ("split", {"BI": 64, "KP": 2, "KC": 5, "num_warps": 8, "SG": 3, "DQ": 0}),
             ("split", {"BI": 64, "KP": 2, "KC": 5, "num_warps": 8, "SG": 4, "RK": 1}),
             ("split", {"KP": 1})]
MOE_IDS = ["gluon-atomics", "gluon-partials", "tl-atomics", "tl-partials", "split", "split-kp5", "split-kc5-sg3",
           "split-kc4-sg8", "split-table", "split-kc5-sg3-table", "split-kc5-sg4-rk", "split-kp1"]


def _moe_config(variant, partials):
    from bytebound.kernels.moe_host import DEFAULT_CONFIG, TL_DEFAULT_CONFIG
    if variant == "split":
        from bytebound.kernels.triton_moe_split import SPLIT_DEFAULT
        return dict(SPLIT_DEFAULT, **(partials or {}))
    cfg = dict(DEFAULT_CONFIG if variant == "gluon" else TL_DEFAULT_CONFIG, partials=partials)
    if partials:        # the reduce tiling of the committed H200 M=4 entry
        cfg.update(reduce_bh=4, reduce_warps=1)
    return cfg


def _bind(backend, ex, variant=None, partials=False):
    if backend == "triton":
        from bytebound.kernels.moe_host import MoEKernel
        cfg = _moe_config(variant, partials)
        return MoEKernel(ex, {m: cfg for m in range(1, 5)})
    from bytebound.kernels.humming_moe import HummingMoE
    return HummingMoE(ex)


@pytest.fixture(scope="module")
def ling_experts():
    return make_experts(**{k: v for k, v in LING.items() if k != "k"})


def _poisoned_call(fn, x, ids, w, act=False):
    """Call with the caching allocator's next block pre-filled with NaN, so unwritten outputs show up; ``act``: the
    split kernels' shared ``act`` scratch (``kernels.scratch``) NaN too, so a read of an activation no kernel wrote in
    this call shows up."""
    if act:
        from bytebound.kernels.scratch import scratch
        scratch(DEV, "act", 1, torch.bfloat16).fill_(float("nan"))
    torch.full((x.shape[0], x.shape[1]), float("nan"), dtype=torch.bfloat16, device=DEV)
    return fn(x, ids, w)


@pytest.mark.parametrize("variant,partials", MOE_MODES[:-1], ids=MOE_IDS[:-1])    # (Ling's H cannot be one slice)
@pytest.mark.parametrize("m,shared", [(1, 0), (2, 3), (4, 0), (4, 5)])
@pytest.mark.parametrize("limit", [None, 1.0])
def test_triton_moe_ling(ling_experts, variant, m, shared, limit, partials):
    ex = ling_experts
    ex.limit = limit
    try:
        fn = _bind("triton", ex, variant, partials)
        ids, w = make_routing(m, LING["e"], LING["k"], shared=shared, seed=m + shared)
        x = torch.randn(m, LING["h"], device=DEV).to(torch.bfloat16)
        out = _poisoned_call(fn, x, ids, w)
        ref = moe_ref64(ex, x, ids, w)
        assert torch.isfinite(out.float()).all(), "unwritten or non-finite output"
        assert rel(out, ref) <= 1e-2, f"{variant} M={m} shared={shared} limit={limit}: rel {rel(out, ref):.3e}"
        out2 = _poisoned_call(fn, x, ids, w)      # workspace and ticket re-armed by the last program
        assert rel(out2, ref) <= 1e-2
        assert torch.equal(out2, out), "second call differs (workspace not re-armed, or order-dependent sums)"
        for _ in range(10):     # fixed-point accumulation: bit-identical whatever order the programs finish in
            assert torch.equal(fn(x, ids, w), out), "repeated call differs: accumulation is order-dependent"
    finally:
        ex.limit = None


@pytest.mark.parametrize("variant,partials", MOE_MODES, ids=MOE_IDS)
@pytest.mark.parametrize("m", [1, 3, 4])
def test_triton_moe_tiny(variant, m, partials):
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    ex = make_experts(TINY["e"], TINY["h"], TINY["i"], limit=0.5, seed=3)
    fn = MoEKernel(ex)
    fn.configs = {mm: fit_config(_moe_config(variant, partials), TINY["h"], TINY["i"]) for mm in range(1, 5)}
    ids, w = make_routing(m, TINY["e"], TINY["k"], shared=2, seed=7)
    x = torch.randn(m, TINY["h"], device=DEV).to(torch.bfloat16)
    out = _poisoned_call(fn, x, ids, w)
    assert rel(out, moe_ref64(ex, x, ids, w)) <= 1e-2


def _graph_replay(fn, *args, replays: int = 3) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn(*args)`` captured in a CUDA graph (after a warm-up call on a side stream) and replayed ``replays`` times:
    ``(graph, the output tensor the graph writes)``, so a test can change the captured inputs in place and replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args)
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return g, out


def _graph_replay_out(fn, *args, replays: int = 3) -> torch.Tensor:
    """:func:`_graph_replay`'s output tensor."""
    return _graph_replay(fn, *args, replays=replays)[1]


@pytest.mark.parametrize("variant,partials", [("gluon", False), ("gluon", True), ("split", False)],
                         ids=["atomics", "partials", "split"])
def test_triton_moe_graph_replay(ling_experts, variant, partials):
    ex = ling_experts
    fn = _bind("triton", ex, variant, partials)
    ids, w = make_routing(4, LING["e"], LING["k"], shared=3, seed=11)
    x = torch.randn(4, LING["h"], device=DEV).to(torch.bfloat16)
    eager = fn(x, ids, w)
    g, out = _graph_replay(fn, x, ids, w)
    assert torch.equal(out, eager), "graph replay differs from eager"
    ids2, w2 = make_routing(4, LING["e"], LING["k"], seed=12)      # new routing through the same graph
    ids.copy_(ids2)
    w.copy_(w2)
    g.replay()
    torch.cuda.synchronize()
    assert rel(out, moe_ref64(ex, x, ids2, w2)) <= 1e-2


# ---- the shared expert inside the 'split' kernels (MoEKernel.bind_shared) -----------------------------------
def make_shared(h, i, limit=None, seed=0, pow2=True):
    """DenseMLP with FP8 128x128-block projections quantised from random weights (power-of-two scales, as
    ``scale_fmt: ue8m0`` checkpoints; ``pow2=False`` gives scales the fused path must refuse)."""
    from bytebound.layers.moe import DenseMLP
    from bytebound.quant import quantize_fp8_block
    g = torch.Generator(device=DEV).manual_seed(seed)
    mlp = DenseMLP(h, i, lambda name: "fp8", (128, 128), torch.bfloat16, DEV, limit)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        w = torch.randn(lin.out_features, lin.in_features, generator=g, device=DEV) * 0.03
        lin.weight.data, lin.weight_scale_inv.data = quantize_fp8_block(w, (128, 128), pow2=pow2)
    return mlp


@pytest.mark.parametrize("tiling", [None, {"BI": 64, "KP": 5, "num_warps": 8}, {"BI": 64, "KP": 10, "num_warps": 4},
                                    {"BI": 64, "KP": 2, "KC": 5, "num_warps": 8, "SG": 3},
                                    {"BI": 64, "KP": 1, "KC": 10, "num_warps": 8, "SG": 4, "pdl_in": 2},
                                    {"KP": 1, "BI": 32, "KP2": 6, "BH": 128, "down_warps": 8},
                                    {"BI": 64, "KP": 2, "KC": 5, "num_warps": 8, "SG": 4, "pdl_in": 1, "RK": 1},
                                    {"BI": 64, "KP": 5, "num_warps": 8, "pdl_in": 1, "DQ": 0, "RK": 1},
                                    {"BI": 64, "KP": 2, "KC": 5, "num_warps": 8, "SG": 4, "pdl_in": 1, "RB": 1},
                                    {"BI": 64, "KP": 5, "num_warps": 8, "pdl_in": 1, "DQ": 0, "RB": 1}],
                         ids=["default", "h200-m1", "h200-m4", "kc5-sg3", "kc10-sg4-pdl2", "kp1", "h200-m4-rk",
                              "h200-m1-rk", "h200-m4-rb", "h200-m1-rb"])
@pytest.mark.parametrize("m,dup", [(1, 0), (2, 3), (4, 0), (4, 5)])
@pytest.mark.parametrize("limits", [(None, None), (1.0, None), (None, 0.75)], ids=["noclamp", "routed", "shared"])
def test_split_shared_expert(ling_experts, tiling, m, dup, limits):
    """routed + shared from one pair of launches == float64 routed sum + float64 shared expert (rel <= 1e-2),
    bit-identical on repeat. ``kp1`` is KP = 1 (the epilogue without partials), which only the tiny shape can
    run (Ling's H = 2560 is too wide for one slice): it runs there."""
    from bytebound.kernels.torch_ref import shared_expert_reference
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    if tiling is not None and tiling.get("KP") == 1:
        ex = make_experts(TINY["e"], TINY["h"], TINY["i"], seed=5)
        k, e, h, i = TINY["k"], TINY["e"], TINY["h"], TINY["i"]
    else:
        ex, k, e, h, i = ling_experts, LING["k"], LING["e"], LING["h"], LING["i"]
    ex.limit = limits[0]
    try:
        mlp = make_shared(h, i, limit=limits[1], seed=m + dup)
        cfg = fit_config(_moe_config("split", tiling), h, i)
        fn = MoEKernel(ex, {mm: cfg for mm in range(1, 5)})
        fn.bind_shared(mlp)
        assert fn.shared_for(m, k)
        ids, w = make_routing(m, e, k, shared=dup, seed=m + dup)
        x = torch.randn(m, h, device=DEV).to(torch.bfloat16)
        out = _poisoned_call(fn, x, ids, w)
        ref = moe_ref64(ex, x, ids, w) + shared_expert_reference(mlp, x, torch.float64)
        assert torch.isfinite(out.float()).all(), "unwritten or non-finite output"
        assert rel(out, ref) <= 1e-2, f"M={m} dup={dup} limits={limits} tiling={tiling}: rel {rel(out, ref):.3e}"
        # the check above can only see a missing shared expert if the shared part is well above its tolerance:
        # with these weights it is ~4.5 % of the sum (measured on the H200), so an output without it fails by ~4x
        share = rel(ref - shared_expert_reference(mlp, x, torch.float64), ref)
        assert share > 3e-2, f"test data: the shared expert is only {share:.2e} of the sum, too small to detect"
        for _ in range(5):
            assert torch.equal(fn(x, ids, w), out), "repeated call differs"
    finally:
        ex.limit = None


# Each key's "on" value below; NR: the register cap of the committed M = 4 entry (kernels/configs/triton_moe.json),
# NR2: a kernel-B cap under ptxas' own count at M = 4 (124), which spills there
KEY_ON = {"RK": 1, "RB": 1, "XS": 1, "NR": 80, "NR2": 96}


@pytest.mark.parametrize("tiling", [{"BI": 64, "KP": 2, "KC": 5, "num_warps": 8, "SG": 4, "pdl_in": 1, "DQ": 1},
                                    {"BI": 64, "KP": 5, "num_warps": 8, "pdl_in": 1, "DQ": 0},
                                    {"BI": 32, "KP": 10, "num_warps": 4},
                                    {"BI": 64, "KP": 10, "num_warps": 8, "DQ": 1, "RK": 1}],
                         ids=["h200-m4", "h200-m1", "kp10", "kp10-w8"])
@pytest.mark.parametrize("m,dup", [(1, 0), (2, 3), (4, 0), (4, 5)])
@pytest.mark.parametrize("limits", [(None, None), (1.0, 0.75)], ids=["noclamp", "clamps"])
@pytest.mark.parametrize("key", sorted(KEY_ON))
def test_split_key_keeps_the_bits(ling_experts, key, tiling, m, dup, limits):
    """Config keys that change how, not what, the kernels compute: the output with the key on equals the output
    with it off (absent from the config) bit for bit, with and without the shared expert, and in a CUDA graph.
    ``RK`` (kernel A's partials summed and SwiGLU applied by a launch between the two kernels) computes the same sums in
    the same order as kernel A's last program; ``RB`` (kernel B forms its operand from kernel A's partials; it excludes
    ``RK``, so a tiling's ``RK`` is dropped in both arms) the same sums and SwiGLU arithmetic; ``XS`` (x staged in
    shared memory) reads the same B values into the same mma order; ``NR`` / ``NR2`` (kernel A's / B's register cap,
    :data:`KEY_ON`) change only ptxas' register allocation and schedule (and spills), not the arithmetic. (The
    twenty-fourth session's ``PF``, an L2 prefetch of each program's tile, passed here too before it was reverted as
    slower.)"""
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    ex = ling_experts
    ex.limit = limits[0]
    try:
        mlp = make_shared(LING["h"], LING["i"], limit=limits[1], seed=m + dup)
        ids, w = make_routing(m, LING["e"], LING["k"], shared=dup, seed=m + dup)
        x = torch.randn(m, LING["h"], device=DEV).to(torch.bfloat16)
        outs = {}
        for on in (0, 1):
            tile = {k: v for k, v in tiling.items() if k != key and not (key == "RB" and k == "RK")}
            if on:
                tile[key] = KEY_ON[key]
            cfg = fit_config(_moe_config("split", tile), LING["h"], LING["i"])
            fn = MoEKernel(ex, {mm: cfg for mm in range(1, 5)})
            # the on arm runs over a NaN act scratch: a kernel B that read act where the key says it must not (RB)
            # would otherwise find the off arm's values for the same inputs there and pass; every other key
            # rewrites act before B reads it
            outs[on, False] = _poisoned_call(fn, x, ids, w, act=bool(on))
            fn.bind_shared(mlp)
            outs[on, True] = _poisoned_call(fn, x, ids, w, act=bool(on))
            if on:
                assert torch.equal(_graph_replay_out(fn, x, ids, w, replays=1), outs[1, True]), \
                    "graph replay differs from eager"
        for sh in (False, True):
            assert torch.isfinite(outs[1, sh].float()).all()
            assert torch.equal(outs[1, sh], outs[0, sh]), f"{key} 1 differs from {key} 0 (shared={sh})"
        if key in ("NR", "NR2"):            # the cap reached ptxas: a binary compiled with it, within it
            from conftest import register_caps
            from bytebound.kernels import triton_moe_split as ts
            caps = register_caps(ts._moe_gateup_split if key == "NR" else ts._moe_down_split)
            assert any(c == KEY_ON[key] and 0 < r <= c for c, r in caps), caps
    finally:
        ex.limit = None


@pytest.mark.parametrize("tiling", [{"BI": 64, "num_warps": 8, "DQ": 1},
                                    {"BI": 32, "num_warps": 4, "DQ": 0, "TR_ST": 2},
                                    {"BI": 64, "num_warps": 8, "DQ": 1, "TR": 2},
                                    {"BI": 32, "num_warps": 4, "DQ": 1, "TR_XS": 0},
                                    {"BI": 64, "num_warps": 8, "DQ": 1, "TR": 2, "TR_XS": 0, "TR_G": 3}],
                         ids=["w8-st4", "w4-st2", "ws-w8", "w4-xs0", "ws-xs0-g3"])
@pytest.mark.parametrize("m,dup", [(1, 0), (2, 3), (4, 0), (4, 5)])
@pytest.mark.parametrize("limits", [None, 1.0], ids=["noclamp", "clamp"])
def test_ring_kernel_a_keeps_the_bits(ling_experts, tiling, m, dup, limits):
    """``TR`` (kernel A as a persistent TMA ring, kernels.triton_moe_ring; ``TR 2`` warp-specialised) at Ling's
    shape: the routed MoE equals the ``split`` kernels at the ring's partition (KP = H / 256, KC 1, RK 1) bit for
    bit, with duplicate experts (their items arrive on the ring without a copy), with and without the clamp, routed
    only and with the fused shared expert; repeated calls and a CUDA graph replay give the same bits; and the output
    is within 1e-2 of the float64 routed sum."""
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    from bytebound.kernels.scratch import scratch
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TR needs sm_90 (TMA, mbarriers); elsewhere the split kernel A runs and this would compare it "
                    "with itself")

    def poisoned(fn):
        # the partials and activations scratch is shared by every launch: NaN in it before each call, so a partial
        # the ring failed to write reaches the output instead of the value an earlier launch left there
        scratch(DEV, "part_a", 4 << 20).fill_(float("nan"))
        scratch(DEV, "act", 1 << 20, torch.bfloat16).fill_(float("nan"))
        # and the slot rows: an expert id no slot has, so a row the program failed to build reads out of range
        scratch(DEV, "ring_info", 1 << 16, torch.int32).fill_(0x7FFFFFFF)
        return _poisoned_call(fn, x, ids, w)

    ex = ling_experts
    ex.limit = limits
    try:
        ids, w = make_routing(m, LING["e"], LING["k"], shared=dup, seed=31 + m + dup)
        x = torch.randn(m, LING["h"], device=DEV).to(torch.bfloat16)
        on = fit_config(_moe_config("split", dict({"TR": 1}, **tiling)), LING["h"], LING["i"])
        assert (on["KP"], on["KC"], on["RK"]) == (LING["h"] // 256, 1, 1), on
        off = dict(on, TR=0)
        outs = {}
        mlp = make_shared(LING["h"], LING["i"], limit=limits, seed=7 + m)
        for key, cfg in (("on", on), ("off", off)):
            fn = MoEKernel(ex, {mm: cfg for mm in range(1, 5)})
            outs[key] = poisoned(fn)
            fn.bind_shared(mlp)         # the shared expert's items: first in the ring's list, plain loads
            outs[key, "shared"] = poisoned(fn)
        assert torch.isfinite(outs["on"].float()).all(), "unwritten or non-finite output"
        assert torch.equal(outs["on"], outs["off"]), "TR differs from the split kernels at its partition"
        assert torch.equal(outs["on", "shared"], outs["off", "shared"]), "TR with the shared expert differs"
        fn = MoEKernel(ex, {mm: on for mm in range(1, 5)})
        for _ in range(3):
            assert torch.equal(poisoned(fn), outs["on"]), "repeated call differs"
        assert torch.equal(_graph_replay_out(fn, x, ids, w, replays=2), outs["on"]), "graph replay differs from eager"
        ref = moe_ref64(ex, x, ids, w)
        assert rel(outs["on"], ref) <= 1e-2, f"rel {rel(outs['on'], ref):.3e} against float64"
    finally:
        ex.limit = None


def test_split_shared_expert_graph_and_layer():
    """Through a whole MoE layer (router + experts + shared) at a small shape: the fused path equals the unfused
    layer (dense shared expert added by the layer) to rounding, so the layer does not add the shared expert twice
    or drop it, and CUDA-graph replay equals eager. Scales that are not powers of two are refused (BackendError)
    and leave the kernel unfused."""
    import dataclasses

    from bytebound.config import LingConfig
    from bytebound.errors import BackendError
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    from bytebound.layers.moe import MoE
    base = LingConfig.from_file("bytebound/assets/configs/ling-3.0-flash.json")
    cfg = dataclasses.replace(base, hidden_size=TINY["h"], moe_intermediate_size=TINY["i"],
                              moe_shared_expert_intermediate_size=TINY["i"], num_experts=TINY["e"],
                              num_experts_per_tok=TINY["k"], n_group=4, topk_group=2)
    layer = MoE(cfg, 5, lambda name: "fp8", torch.bfloat16, DEV)
    g = torch.Generator(device=DEV).manual_seed(31)
    layer.gate.weight.data = torch.randn(TINY["e"], TINY["h"], generator=g, device=DEV) * 0.05
    layer.experts = ex = make_experts(TINY["e"], TINY["h"], TINY["i"], seed=32)
    layer.shared_experts = mlp = make_shared(TINY["h"], TINY["i"], seed=33)
    # the tiny shape has no table entry (the default is the fused 'gluon' kernel): ask for 'split'
    ex.fn = MoEKernel(ex, {mm: fit_config(_moe_config("split", None), TINY["h"], TINY["i"]) for mm in range(1, 5)})
    x = torch.randn(4, TINY["h"], device=DEV).to(torch.bfloat16)
    unfused = layer(x)
    ex.fn.bind_shared(mlp)
    assert ex.shared_in(4, TINY["k"]) and not ex.shared_in(5, TINY["k"])
    eager = layer(x)
    assert rel(eager, unfused) <= 1e-2, f"fused layer vs unfused: rel {rel(eager, unfused):.3e}"
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "graph replay differs from eager"
    # prefill (M > 4) as bind_model wires it: 4-token slices without the shared expert, which the layer adds
    from bytebound.runner.backends import prefill_slices
    ex.fn.prefill = prefill_slices(ex.fn)
    x6 = torch.randn(6, TINY["h"], device=DEV).to(torch.bfloat16)
    fused6 = layer(x6)
    ex.fn.shared = None
    assert rel(fused6, layer(x6)) <= 1e-2 and not torch.equal(fused6, torch.zeros_like(fused6))
    fn2 = MoEKernel(ex)
    with pytest.raises(BackendError, match="powers of two"):
        fn2.bind_shared(make_shared(TINY["h"], TINY["i"], seed=34, pow2=False))
    assert fn2.shared is None and not fn2.shared_for(1, TINY["k"])


@pytest.mark.parametrize("pdl_in", [1, 2])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("router", ["gemv_route", "fused_route"])
def test_split_pdl_in_after_the_router(ling_experts, pdl_in, m, router):
    """Kernel A launched as a PDL dependent of the router (config ``pdl_in``): the layer's result equals the
    float64 reference for the ids the router chose, eagerly and under CUDA-graph replay, and back-to-back calls
    (A right after the previous call's kernel B, which still uses the shared scratch: A must wait before touching
    it) are bit-identical. ``pdl_in`` 2 also loads the shared expert's first weights before the wait."""
    import torch.nn.functional as F

    from bytebound.kernels.torch_ref import shared_expert_reference
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    from bytebound.kernels.triton_router import fused_route, gemv_route
    ex = ling_experts
    g = torch.Generator(device=DEV).manual_seed(91 + m)
    wg = torch.randn(LING["e"], LING["h"], generator=g, device=DEV) * 0.02
    bias = torch.randn(LING["e"], generator=g, device=DEV) * 0.01
    mlp = make_shared(LING["h"], LING["i"], seed=7)
    tiling = {"BI": 64, "KP": 5, "num_warps": 8} if m == 1 else {"BI": 64, "KP": 10, "num_warps": 4}
    cfg = dict(fit_config(_moe_config("split", tiling), LING["h"], LING["i"]), pdl_in=pdl_in)
    fn = MoEKernel(ex, {mm: cfg for mm in range(1, 5)})
    fn.bind_shared(mlp)
    args = (LING["k"], 8, 4, True, 2.5)
    x = torch.randn(m, LING["h"], device=DEV).to(torch.bfloat16)

    def layer():
        ids, w = (gemv_route(x, wg, bias, *args) if router == "gemv_route"
                  else fused_route(F.linear(x.float(), wg), bias, *args))
        return fn(x, ids, w), ids, w
    out, ids, w = layer()
    ref = moe_ref64(ex, x, ids, w) + shared_expert_reference(mlp, x, torch.float64)
    assert rel(out, ref) <= 1e-2, f"pdl_in={pdl_in} M={m}: rel {rel(out, ref):.3e}"
    for _ in range(5):                      # router, A, B, router, A, B, ... and the kernels alone back to back
        assert torch.equal(layer()[0], out), "repeated layer differs"
        assert torch.equal(fn(x, ids, w), out), "back-to-back kernel call differs"
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = [layer()[0] for _ in range(3)]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, out) for o in gout), "graph replay differs from eager"


def _phys_column(k: int, dq: int) -> torch.Tensor:
    """The physical column of each logical k of a ``k``-column tile (``triton_moe_split.frag_dequant``): logical
    ``128s + 32tau + 16p + 8h + 2t + j`` holds column ``128s + 32t + 8tau + o``, ``o = 4p + 2h + j`` (DQ 0) or
    ``4j + 2p + h`` (DQ 1)."""
    kap = torch.arange(k)
    s, r = kap // 128, kap % 128
    tau, r = r // 32, r % 32
    p, r = r // 16, r % 16
    h, r = r // 8, r % 8
    t, j = r // 2, r % 2
    o = 4 * p + 2 * h + j if dq == 0 else 4 * j + 2 * p + h
    return (128 * s + 32 * t + 8 * tau + o).to(DEV)


@pytest.mark.parametrize("dq", [0, 1])
def test_split_decode_and_operand_order(dq):
    """The ``split`` kernels' E2M1 decode of one tile equals the float64 dequantisation exactly (every code, every
    E8M0 byte the decode takes, the extremes included: DQ 1, the shift decode, 0..128 with its BF16 subnormal
    codes; DQ 0, the table, 1..250), in the logical k order its docstring states; the B operand gather follows the
    same order."""
    import _decode_probe as probe
    from bytebound.kernels.triton_moe_split import lut_tensor
    from bytebound.quant import dequantize_mxfp4
    g = torch.Generator(device=DEV).manual_seed(11 + dq)
    r, k = probe.R, probe.K
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (r, k // 8), generator=g, device=DEV, dtype=torch.int32)
    lo, hi = (0, 128) if dq else (1, 250)
    scales = torch.randint(lo, hi + 1, (r, k // 32), generator=g, device=DEV, dtype=torch.uint8)
    scales[0], scales[1] = lo, hi
    x = torch.randn(8, k, generator=g, device=DEV).to(torch.bfloat16)
    a, b = probe.run(words, scales, lut_tensor(DEV), x, dq)
    # the codes' values (scale 1) times 2^(E-127) in float64: dequantize_mxfp4's float32 exp2 is not exact at E = 0
    unit = dequantize_mxfp4(words.view(torch.uint8), torch.full_like(scales, 127), torch.float64)
    ref = unit * torch.exp2(scales.double() - 127).repeat_interleave(32, dim=1)
    ph = _phys_column(k, dq)
    bad = (a.double() != ref[:, ph]).nonzero()
    assert bad.numel() == 0, (f"DQ {dq}: {bad.shape[0]} decoded values differ, first at {bad[0].tolist()}: "
                              f"{a[tuple(bad[0])].item()} vs {ref[:, ph][tuple(bad[0])].item()}")
    assert torch.equal(b, x.t()[ph]), f"DQ {dq}: the B operand is not in the decode's order"


def test_split_shift_decode_refused_for_large_scales():
    """A binding with an E8M0 byte above 128 (a scale above 2) runs the table decode whatever the config asks, says
    so in its config source, and stays correct."""
    from bytebound.kernels.moe_host import MoEKernel, fit_config
    from bytebound.kernels.triton_moe_split import SPLIT_DEFAULT
    ex = make_experts(TINY["e"], TINY["h"], TINY["i"], seed=5)
    ex.w2_scale.data[3, 7, 1] = 131
    fn = MoEKernel(ex)
    fn.configs = {mm: fit_config(dict(SPLIT_DEFAULT), TINY["h"], TINY["i"]) for mm in range(1, 5)}
    assert fn.shift_decode is False and fn.scale_max == 131
    assert "table decode (an E8M0 scale byte 131 > 128)" in fn.config_source(1, TINY["k"])
    ids, w = make_routing(4, TINY["e"], TINY["k"], shared=1, seed=9)
    ids[0, 0] = 3
    x = torch.randn(4, TINY["h"], device=DEV).to(torch.bfloat16)
    out = _poisoned_call(fn, x, ids, w)
    assert rel(out, moe_ref64(ex, x, ids, w)) <= 1e-2
    ok = MoEKernel(make_experts(TINY["e"], TINY["h"], TINY["i"], seed=5), dict(fn.configs))
    assert ok.shift_decode and ok.config_source(1, TINY["k"]).endswith("shift decode")


def test_triton_moe_refuses_prefill(ling_experts):
    from bytebound.errors import BackendError
    fn = _bind("triton", ling_experts, "gluon")
    ids, w = make_routing(5, LING["e"], LING["k"])
    with pytest.raises(BackendError):
        fn(torch.randn(5, LING["h"], device=DEV).to(torch.bfloat16), ids, w)


def test_registry_resolves_cuda_backends():
    from bytebound.kernels.registry import resolve
    for op, name in [("moe", "triton"), ("moe", "humming"), ("linear", "triton"), ("lm_head", "triton"),
                     ("kda", "fla")]:
        impl, res = resolve(op, name, torch.device(DEV))
        assert res.resolved == name


# ---- FP8 linear ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(4096, 2560), (2560, 4096), (32, 2560), (576, 2560), (2560, 768)])
@pytest.mark.parametrize("m", [1, 2, 4, 9])
def test_fp8_linear(n, k, m):
    from bytebound.kernels.triton_fp8 import TritonLinear
    from bytebound.layers.linear import QLinear
    from bytebound.quant import quantize_fp8_block
    lin = QLinear(k, n, "fp8", (128, 128), torch.bfloat16, DEV)
    q, s = quantize_fp8_block(torch.randn(n, k, device=DEV) * 0.05)
    lin.weight.data, lin.weight_scale_inv.data = q, s
    fn = TritonLinear().bind(lin, torch.bfloat16)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    ref = x.double() @ lin.dequantized(torch.float64).t()
    out = fn(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel(out, ref) <= 1e-2


def test_fp8_linear_small_blocks():
    from bytebound.kernels.triton_fp8 import TritonLinear
    from bytebound.layers.linear import QLinear
    from bytebound.quant import quantize_fp8_block
    lin = QLinear(256, 96, "fp8", (32, 32), torch.bfloat16, DEV)
    q, s = quantize_fp8_block(torch.randn(96, 256, device=DEV), (32, 32))
    lin.weight.data, lin.weight_scale_inv.data = q, s
    fn = TritonLinear().bind(lin, torch.bfloat16)
    for m in (1, 3, 7):
        x = torch.randn(2, m, 256, device=DEV).to(torch.bfloat16)
        ref = x.double() @ lin.dequantized(torch.float64).t()
        assert rel(fn(x), ref) <= 1e-2


# ---- FP8 LM head --------------------------------------------------------------------------------------------
def test_fp8_head_top1_vs_bf16():
    from bytebound.kernels.triton_fp8 import TritonLMHead
    from bytebound.layers.lm_head import LMHead, bf16_logits
    from bytebound.quant import fp8_channel_matmul_ref
    v, h = 157184, 2560
    g = torch.Generator(device=DEV).manual_seed(5)
    head = LMHead(v, h, torch.bfloat16, DEV)
    head.weight.data = (torch.randn(v, h, generator=g, device=DEV) * 0.02).to(torch.bfloat16)
    head.configure("fp8")
    fn = TritonLMHead().bind(head, torch.bfloat16)
    # hidden states with a planted winner (as trained models have) plus noise; every 4th row 100x the norm
    n = 256
    tgt = torch.randint(0, v, (n,), generator=g, device=DEV)
    x = head.weight[tgt].float() * 6.0 + torch.randn(n, h, generator=g, device=DEV) * 0.5
    x[::4] *= 100.0
    x = x.to(torch.bfloat16)
    agree, worst = 0, 0.0
    for r0 in range(0, n, 4):
        xb = x[r0:r0 + 4]
        lg = fn(xb)
        assert lg.dtype == torch.float32 and lg.shape == (4, v)
        agree += int((lg.argmax(-1) == bf16_logits(head.weight, xb).argmax(-1)).sum())
        if r0 % 64 == 0:
            worst = max(worst, rel(lg, fp8_channel_matmul_ref(xb, head.w_fp8, head.w_scale)))
    assert agree / n >= 0.99, f"top-1 agreement {agree}/{n}"
    assert worst <= 1e-3, f"FP8 head vs FP8 reference rel {worst:.2e}"
    for m in (1, 2, 3):     # odd token counts through the same kernel
        lg = fn(x[:m])
        assert rel(lg, fp8_channel_matmul_ref(x[:m], head.w_fp8, head.w_scale)) <= 1e-3


# ---- KDA ----------------------------------------------------------------------------------------------------
def _kda_inputs(t, seed, h=32, d=128):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, t, h, d, generator=g, device=DEV)
    k = torch.randn(1, t, h, d, generator=g, device=DEV)
    v = torch.randn(1, t, h, d, generator=g, device=DEV)
    gate = -5.0 * torch.sigmoid(torch.randn(1, t, h, d, generator=g, device=DEV))      # safe gate, (-5, 0)
    beta = torch.sigmoid(torch.randn(1, t, h, generator=g, device=DEV))
    s0 = torch.randn(1, h, d, d, generator=g, device=DEV) * 0.1
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("t", [1, 101])
def test_fla_kda(t):
    from bytebound.kernels.fla_kda import FlaKDA
    from bytebound.kernels.kda_ref import kda_recurrent
    fn = FlaKDA().bind(None, torch.float32)
    q, k, v, gate, beta, s0 = _kda_inputs(t, seed=t)
    o_ref, s_ref = kda_recurrent(q.double(), k.double(), v.double(), gate.double(), beta.double(), s0.double())
    state = s0.clone()
    o, s = fn(q, k, v, gate, beta, state)
    assert s.dtype == torch.float32 and s.shape == s0.shape
    assert rel(o.float(), o_ref) <= 5e-3, rel(o.float(), o_ref)
    assert rel(s, s_ref) <= 5e-3, rel(s, s_ref)
    if t == 1:
        assert s.data_ptr() == state.data_ptr(), "decode state is updated in place"
    o0, s_none = fn(q, k, v, gate, beta, None)                     # zero initial state
    o_ref0, _ = kda_recurrent(q.double(), k.double(), v.double(), gate.double(), beta.double(), None)
    assert rel(o0.float(), o_ref0) <= 5e-3


# ---- fused router --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 4])
def test_fused_router_ling(m):
    """kernels.triton_router vs layers.moe.route at the Ling router shape (512 experts, 8 groups, keep 4, top-8)."""
    from bytebound.kernels.triton_router import fused_route
    from bytebound.layers.moe import route
    g = torch.Generator(device=DEV).manual_seed(m)
    for _ in range(20):
        logits = torch.randn(m, 512, generator=g, device=DEV) * 2
        bias = torch.randn(512, generator=g, device=DEV) * 0.5
        ids, w = fused_route(logits, bias, 8, 8, 4, True, 2.5)
        rid, rw = route(logits, bias, 8, 8, 4, True, 2.5)
        for r in range(m):
            a = dict(zip(ids[r].tolist(), w[r].tolist()))
            b = dict(zip(rid[r].tolist(), rw[r].tolist()))
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) <= 1e-5 for k in a)


# ---- humming (last: slowest to compile) --------------------------------------------------------------------
@pytest.mark.parametrize("m,shared", [(1, 0), (4, 5), (64, 0)])
def test_humming_moe(ling_experts, m, shared):
    ex = ling_experts
    ex.limit = 1.0
    fn = _bind("humming", ex)
    ids, w = make_routing(m, LING["e"], LING["k"], shared=shared, seed=20 + m)
    x = torch.randn(m, LING["h"], device=DEV).to(torch.bfloat16)
    out = fn(x, ids, w)
    if m > 8:   # float64 reference over 64 tokens is slow: compare 8 rows
        sel = torch.arange(0, m, m // 8, device=DEV)
        assert rel(out[sel], moe_ref64(ex, x[sel], ids[sel], w[sel])) <= 1e-2
    else:
        assert rel(out, moe_ref64(ex, x, ids, w)) <= 1e-2
    ex.limit = None


def moe_ref64_grouped(ex, x, ids, w):
    """float64 routed sum, one dequantised expert at a time (vectorised over its tokens: M up to 8192)."""
    from bytebound.layers.moe import swiglu
    from bytebound.quant import dequantize_mxfp4
    y = torch.zeros(x.shape[0], ex.hidden, dtype=torch.float64, device=DEV)
    xd = x.double()
    for e in ids.unique().tolist():
        rows, cols = (ids == e).nonzero(as_tuple=True)
        w13 = dequantize_mxfp4(ex.w13[e], ex.w13_scale[e], torch.float64)
        w2 = dequantize_mxfp4(ex.w2[e], ex.w2_scale[e], torch.float64)
        hh = xd[rows] @ w13.t()
        a = swiglu(hh[:, :ex.inter], hh[:, ex.inter:], ex.limit)
        y.index_add_(0, rows, (a @ w2.t()) * w.double()[rows, cols, None])
    return y


@pytest.mark.parametrize("m", [5, 64, 2048, 8192])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("limit", [None, 0.01])
def test_grouped_prefill_moe(ling_experts, m, routing, limit):
    """Prefill MoE (``kernels.triton_moe_grouped``, tokens sorted by expert, W4A16) against the float64 routed sum
    at Ling-3.0-flash shapes: uniform routing, and skewed routing where most tokens pick among 16 experts (hundreds
    of experts get no token); the SwiGLU clamp on and off; repeated calls bit-identical (no atomics)."""
    from bytebound.kernels.triton_moe_grouped import GroupedMoE
    ex = ling_experts
    ex.limit = limit
    try:
        g = torch.Generator(device="cpu").manual_seed(m)
        x = torch.randn(m, LING["h"], generator=g).to(torch.bfloat16).to(DEV)
        if routing == "uniform":
            ids = torch.rand(m, LING["e"], generator=g).argsort(-1)[:, :LING["k"]]
        else:
            ids = torch.rand(m, 16, generator=g).argsort(-1)[:, :LING["k"]] * 3
        w = torch.rand(m, LING["k"], generator=g) + 0.1
        ids, w = ids.to(DEV), (w / w.sum(-1, keepdim=True) * 2.5).float().to(DEV)
        fn = GroupedMoE(ex)
        out = fn(x, ids, w)
        ref = moe_ref64_grouped(ex, x, ids, w)
        assert torch.isfinite(out.float()).all()
        assert rel(out, ref) <= 1e-2, f"M={m} {routing} limit={limit}: rel {rel(out, ref):.3e}"
        assert torch.equal(fn(x, ids, w), out), "repeated call differs"
        if limit is not None:       # the clamp bites on this data: the unclamped result is far off
            ex.limit = None
            assert rel(out, moe_ref64_grouped(ex, x, ids, w)) > 3e-2
    finally:
        ex.limit = None


def test_moe_prefill_is_grouped_when_bound():
    """bind_model wires the triton MoE backend's prefill (M > 4) to the grouped GEMM and records it."""
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LingConfig
    from bytebound.kernels.triton_moe_grouped import GroupedMoE
    from bytebound.layers.moe import RoutedExperts
    from bytebound.runner.backends import BackendPlan, bind_model
    model = dummy_model(LingConfig.from_file("models/ling-nano/config.json"), device=DEV)
    plan = bind_model(model, BackendPlan.default(DEV), DEV)
    exs = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert exs and all(isinstance(m.fn.prefill, GroupedMoE) for m in exs)
    assert "grouped GEMM" in plan.resolutions["moe"].prefill
