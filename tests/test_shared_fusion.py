"""The shared expert inside the ``split`` MoE kernels (``MoEKernel.bind_shared``), host side, on CPU.

The kernels themselves are GPU-only (tests/gpu/test_kernels_gpu.py::test_split_shared_expert*). Here: the form
the kernels read (``triton_moe_split.shared_fp8``: FP8 bytes of [gate; up] and down, block scales as exact BF16x2
factors scale x 2^120) and its refusals, the MoE layer adding its dense shared expert exactly when the bound
backend's output does not include it, and the engine/binding switches refusing what they cannot do."""

import pytest
import torch

from bytebound.errors import BackendError, ConfigError
from bytebound.layers.moe import DenseMLP, MoE
from bytebound.quant import quantize_fp8_block


def _mlp(h=256, i=128, pow2=True, seed=0, fmt="fp8"):
    g = torch.Generator().manual_seed(seed)
    mlp = DenseMLP(h, i, lambda name: fmt, (128, 128), torch.float32, "cpu", 0.5)
    if fmt == "fp8":
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            w = torch.randn(lin.out_features, lin.in_features, generator=g) * 0.03
            lin.weight.data, lin.weight_scale_inv.data = quantize_fp8_block(w, (128, 128), pow2=pow2)
    return mlp


def test_shared_fp8_layout():
    from bytebound.kernels.triton_moe_split import shared_fp8
    mlp = _mlp()
    sh = shared_fp8(mlp, 256, 128)
    b13 = sh.w13w.view(torch.uint8)
    assert b13.shape == (256, 256)
    assert torch.equal(b13[:128], mlp.gate_proj.weight.view(torch.uint8))
    assert torch.equal(b13[128:], mlp.up_proj.weight.view(torch.uint8))
    assert torch.equal(sh.w2w.view(torch.uint8), mlp.down_proj.weight.view(torch.uint8))
    assert sh.s13.shape == (2, 2) and sh.s2.shape == (2, 1) and sh.limit == 0.5
    # each int32 holds the same BF16 twice: scale x 2^120, exactly
    for fac, scale in ((sh.s13, torch.cat([mlp.gate_proj.weight_scale_inv, mlp.up_proj.weight_scale_inv])),
                       (sh.s2, mlp.down_proj.weight_scale_inv)):
        lo, hi = fac & 0xFFFF, (fac >> 16) & 0xFFFF
        assert torch.equal(lo, hi)
        val = lo.to(torch.int16).view(torch.bfloat16).float()
        assert torch.equal(val, scale * 2.0 ** 120)


def test_shared_fp8_refusals():
    from bytebound.kernels.triton_moe_split import shared_fp8
    with pytest.raises(BackendError, match="powers of two"):
        shared_fp8(_mlp(pow2=False), 256, 128)
    with pytest.raises(BackendError, match="does not match"):
        shared_fp8(_mlp(i=256), 256, 128)
    with pytest.raises(BackendError, match="FP8"):
        shared_fp8(_mlp(fmt="plain"), 256, 128)


def _tiny_layer(dtype=torch.float32):
    """A Ling MoE layer at a small shape (H 256, I 128, 16 experts, top-4), plain weights, random router and
    shared expert."""
    import dataclasses

    from bytebound.config import LingConfig
    base = LingConfig.from_file("bytebound/assets/configs/ling-3.0-flash.json")
    cfg = dataclasses.replace(base, hidden_size=256, moe_intermediate_size=128,
                              moe_shared_expert_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2)
    layer = MoE(cfg, 5, lambda name: "plain", dtype, "cpu")
    torch.nn.init.normal_(layer.gate.weight, std=0.05)
    for lin in (layer.shared_experts.gate_proj, layer.shared_experts.up_proj, layer.shared_experts.down_proj):
        torch.nn.init.normal_(lin.weight, std=0.05)
    return layer


class _Routed:
    """A bound routed-MoE backend stand-in: returns zeros and claims the shared expert for up to 4 tokens."""

    def __init__(self, claims):
        self.claims = claims

    def __call__(self, x, ids, w):
        return torch.zeros_like(x)

    def shared_for(self, m, k):
        return self.claims and m <= 4


@pytest.mark.parametrize("claims", [True, False])
def test_layer_adds_the_shared_expert_only_when_the_backend_does_not(claims):
    layer = _tiny_layer()
    layer.experts.fn = _Routed(claims)
    for m in (1, 4, 5):
        x = torch.randn(m, 256)
        y = layer(x)
        if claims and m <= 4:           # the backend said its output has the shared expert: not added again
            assert torch.equal(y, torch.zeros_like(x))
        else:
            torch.testing.assert_close(y, layer.shared_experts(x))


def test_moe_shared_entry_needs_the_triton_backend(tmp_path):
    """``moe_shared=fused``: named, a backend that cannot run the shared expert raises (recorded instead with
    allow_fallback); as a default it falls back to ``separate`` with the reason recorded; on a CPU device the plan
    refuses it (and its deprecated alias) by name."""
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LingConfig
    from bytebound.runner.backends import BackendPlan, bind_model
    model = dummy_model(LingConfig.from_file("models/ling-nano/config.json"), torch.device("cpu"), torch.float32)
    with pytest.raises(ConfigError, match=r"^--backend moe_shared=fused needs a CUDA device"):
        BackendPlan.default("cpu", moe_shared="fused")
    with pytest.raises(ConfigError, match=r"^--fused-shared-expert needs a CUDA device"):
        BackendPlan.build("cpu", aliases={"fused_shared": True})

    def fused_plan(named: bool, allow: bool = False):
        plan = BackendPlan.default("cpu")
        plan.requested["moe_shared"] = "fused"      # as a CUDA plan asks, bound on CPU (the torch MoE backend)
        plan.explicit = {"moe_shared"} if named else set()
        plan.allow_fallback = allow
        return plan
    with pytest.raises(BackendError, match="cannot run the shared expert"):
        bind_model(model, fused_plan(named=True), "cpu")
    for plan in (fused_plan(named=True, allow=True), fused_plan(named=False)):
        bind_model(model, plan, "cpu")
        r = plan.resolutions["moe_shared"]
        assert (r.fallback_from, r.resolved) == ("fused", "separate") and "cannot run the shared expert" in r.reason
        assert plan.resolutions["moe"].shared.startswith("dense; not fused:")
        assert plan.entries["moe_shared"]["decode"].why == "fallback"
    plan = bind_model(model, BackendPlan.default("cpu"), "cpu")
    assert plan.resolutions["moe"].shared == "dense" and plan.choice("moe_shared") == "separate"
    assert plan.resolutions["moe_shared"].fallback_from is None


def test_default_shared_fusion_keeps_dense_where_the_backend_cannot():
    """The CUDA default (fused_shared None) binds where it can and never raises: a backend without
    ``bind_shared`` leaves every layer dense and the resolution names why (here on CPU, through _bind_shared)."""
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LingConfig
    from bytebound.runner.backends import BackendPlan, _bind_shared, bind_model
    model = dummy_model(LingConfig.from_file("models/ling-nano/config.json"), torch.device("cpu"), torch.float32)
    plan = bind_model(model, BackendPlan.default("cpu"), "cpu")
    _bind_shared(model, plan, strict=False)
    assert plan.resolutions["moe"].shared.startswith("dense; not fused: moe backend 'torch' cannot run")
    with pytest.raises(BackendError, match="cannot run the shared expert"):
        _bind_shared(model, plan, strict=True)


def test_engine_refuses_fused_shared_on_cpu():
    from bytebound.engine.engine import Engine, EngineConfig
    with pytest.raises(ConfigError, match="fused-shared-expert"):
        Engine(EngineConfig(model="models/ling-nano", device="cpu", fused_shared=True))


def test_prefill_slices_leave_the_shared_expert_to_the_layer(monkeypatch):
    """M > 4 (prefill): the kernel runs on 4-token slices (``backends.prefill_slices``) and the layer adds its
    dense shared expert, since ``shared_in`` is false there; the slices must not run it too. A ``MoEKernel``'s
    host logic on CPU, its launch replaced by a stand-in whose output is the shared expert when asked for it."""
    from bytebound.kernels import moe_host as tm
    from bytebound.kernels import triton_moe_split as ts
    from bytebound.runner.backends import prefill_slices
    layer = _tiny_layer(torch.bfloat16)
    k = tm.MoEKernel.__new__(tm.MoEKernel)              # no CUDA here: only the host logic is under test
    k.e, k.h, k.i, k.limit, k._fitted = 16, 256, 128, None, {}
    k.configs = {m: dict(ts.SPLIT_DEFAULT) for m in range(1, 5)}
    k.shared = object()

    def launch(kern, x, ids, w, out, cfg, sh=None):     # routed part 0; the shared expert when the kernels run it
        out.copy_(layer.shared_experts(x) if sh is not None else torch.zeros_like(out))
    monkeypatch.setattr(ts, "launch_split", launch)
    k.prefill = prefill_slices(k)
    layer.experts.fn = k
    for m in (1, 4, 6, 9):
        x = torch.randn(m, 256).to(torch.bfloat16)
        assert layer.experts.shared_in(m, 4) == (m <= 4)
        torch.testing.assert_close(layer(x).float(), layer.shared_experts(x).float())     # exactly once


def test_router_gemv_plumbing():
    """``MoE.router`` hands x, the router weight and the routing parameters to ``gemv_route_fn`` (the one-launch
    router GEMV + routing, ``kernels.triton_router.gemv_route``) for up to 4 rows, and uses GEMV + ``route_fn`` /
    ``route`` beyond. The kernel itself is checked in tests/test_triton_router.py."""
    import torch.nn.functional as F

    from bytebound.layers.moe import route
    layer = _tiny_layer()
    calls = []

    def stub(x, weight, bias, k, n_group, topk_group, norm, scale):
        calls.append(x.shape[0])
        return route(F.linear(x.float(), weight.float()), bias, k, n_group, topk_group, norm, scale)
    layer.gemv_route_fn, layer.route_m = stub, 4        # route_m: the width bind_model gives the router kernels
    for m in (1, 4, 6):
        x = torch.randn(m, 256)
        ids, w = layer.router(x)
        rid, rw = route(F.linear(x.float(), layer.gate.weight.float()), layer.gate.expert_bias, 4, 4, 2, True, 2.5)
        assert torch.equal(ids, rid) and torch.equal(w, rw)
    assert calls == [1, 4]
    from bytebound.engine.engine import Engine, EngineConfig
    with pytest.raises(ConfigError, match="fused-router-gemv"):
        Engine(EngineConfig(model="models/ling-nano", device="cpu", fused_router_gemv=True))


@pytest.mark.parametrize("entry,alias,flag", [({"router": "triton"}, {"fused_router": True}, "--fused-router"),
                                              ({"router": "gemv"}, {"fused_router_gemv": True}, "--fused-router-gemv"),
                                              ({"norm": "triton"}, {"fused_norm": True}, "--fused-norm"),
                                              ({"kv": "buckets"}, {"kv_buckets": True}, "--decode-kv-buckets"),
                                              ({"graphs": "captured"}, None, None)])
def test_plan_refuses_triton_paths_on_cpu(entry, alias, flag):
    """The plan names a CUDA-only entry on a CPU device (ConfigError, the entry or the deprecated flag in the
    message); a plan made for CUDA, bound on a CPU device, is refused by the binding (BackendError)."""
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LingConfig
    from bytebound.runner.backends import BackendPlan, bind_model
    (name, value), = entry.items()
    with pytest.raises(ConfigError, match=f"^--backend {name}={value} needs a CUDA device"):
        BackendPlan.default("cpu", **entry)
    if alias:
        with pytest.raises(ConfigError, match=f"^{flag} needs a CUDA device"):
            BackendPlan.build("cpu", aliases=alias)
    model = dummy_model(LingConfig.from_file("models/ling-nano/config.json"), torch.device("cpu"), torch.float32)
    plan = BackendPlan.default("cpu")
    plan.requested.update(entry)
    with pytest.raises(BackendError, match=f"^--backend {name}={value} needs a CUDA device"):
        bind_model(model, plan, "cpu")


def test_shared_fusion_needs_a_split_config(tmp_path):
    """Only the 'split' variant runs the shared expert: on a GPU whose table has no 'split' entry for M <= 4 the
    default (None) keeps the dense shared expert and says why, instead of binding a copy that never runs; the
    required mode (True) raises. Host logic only: the bound kernels are stand-ins with the MoEKernel interface."""
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LingConfig
    from bytebound.layers.moe import MoE
    from bytebound.runner.backends import BackendPlan, _bind_shared, bind_model

    class Stub:
        def __init__(self, variant):
            self.variant, self.bound = variant, 0

        def config(self, m, k):
            return {"variant": self.variant}

        def bind_shared(self, mlp):
            self.bound += 1

    model = dummy_model(LingConfig.from_file("models/ling-nano/config.json"), torch.device("cpu"), torch.float32)
    plan = bind_model(model, BackendPlan.default("cpu"), "cpu")
    moes = [m for m in model.modules() if isinstance(m, MoE) and m.shared_experts is not None]
    for variant, want in (("gluon", 0), ("split", 1), ("persist", 1)):
        stubs = [Stub(variant) for _ in moes]
        for m, st in zip(moes, stubs):
            m.experts.fn = st
        _bind_shared(model, plan, strict=False)
        assert [st.bound for st in stubs] == [want] * len(moes)
        if want:
            assert plan.resolutions["moe"].shared == f"fused into the routed kernels ({len(moes)} layers)"
        else:
            assert plan.resolutions["moe"].shared.startswith("dense; not fused: the triton MoE configs")
            with pytest.raises(BackendError, match="no 'split' or 'persist' variant"):
                _bind_shared(model, plan, strict=True)


def test_default_backend_that_cannot_serve_a_shape_falls_back_recorded(monkeypatch):
    """A device-default backend whose bind refuses the model's shape (as the Triton MLA kernels refuse latent widths
    that are not powers of two) leaves the layer on its own torch path and records a fallback with the reason; the
    same backend named by the user raises the named error."""
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LingConfig
    from bytebound.kernels import registry
    from bytebound.layers.mla import GatedMLA
    from bytebound.runner import backends

    class Picky:
        def bind(self, layer, dtype):
            raise BackendError("mla[picky]: needs power-of-two widths")
    monkeypatch.setitem(registry._REGISTRY["mla"], "picky", registry._Entry(Picky, lambda dev: None))
    monkeypatch.setitem(backends.DEFAULTS_CPU, "mla", "picky")
    model = dummy_model(LingConfig.from_file("models/ling-nano/config.json"), torch.device("cpu"), torch.float32)
    plan = backends.bind_model(model, backends.BackendPlan.default("cpu"), "cpu")
    r = plan.resolutions["mla"]
    assert (r.requested, r.resolved, r.fallback_from) == ("picky", "torch", "picky")
    assert "power-of-two" in r.reason and "not requested" in r.reason
    assert all(m.attn_fn is None for m in model.modules() if isinstance(m, GatedMLA))
    with pytest.raises(BackendError, match="power-of-two"):
        backends.bind_model(model, backends.BackendPlan.default("cpu", mla="picky"), "cpu")


def test_triton_mla_refuses_unsupported_widths_at_bind():
    """The Triton MLA backend checks the latent widths when it binds (so the device default can fall back at load),
    with the same named error its launcher raises."""
    from bytebound.config import tiny_config
    from bytebound.kernels.triton_mla import TritonMLA
    from bytebound.layers.mla import GatedMLA
    cfg = tiny_config()            # qk_rope_head_dim 8: below the tensor-core minimum of 16
    layer = GatedMLA(cfg, lambda name: "plain", torch.bfloat16)
    with pytest.raises(BackendError, match=r"power-of-two kv_lora_rank.*rope 8"):
        TritonMLA().bind(layer, torch.bfloat16)
