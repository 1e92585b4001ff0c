"""The execution plan (``runner.plan``): one entry per binding decision, validated in one place, the deprecated
flags as aliases of entries, and the manifest's per-op, per-regime record of what runs and why."""

from __future__ import annotations

import pytest

from bytebound.errors import ConfigError
from bytebound.runner.plan import ENTRIES, REGIMES, BackendPlan, parse_backend_specs


def _cli(*argv):
    import argparse

    from bytebound.cli import add_engine_args, engine_config
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config(p.parse_args(list(argv)))


def test_backend_flag_is_the_one_override_and_old_flags_are_aliases():
    cfg = _cli("--backend", "router=torch", "--backend", "kv=exact,moe=torch", "--kda-backend", "fla")
    assert cfg.backends == {"router": "torch", "kv": "exact", "moe": "torch", "kda": "fla"}
    with pytest.raises(ConfigError, match="--moe-backend torch contradicts --backend moe=triton"):
        _cli("--backend", "moe=triton", "--moe-backend", "torch")
    with pytest.raises(ConfigError, match="needs --speculative-algorithm NEXTN"):
        _cli("--backend", "round=static")
    # the old switches reach the plan as entries (CUDA plan, built without a GPU: nothing is bound here)
    cfg = _cli("--no-fused-router", "--no-fused-shared-expert", "--no-decode-kv-buckets", "--enforce-eager")
    from bytebound.runner.plan import alias_values
    plan = BackendPlan.build("cuda", cfg.backends, alias_values(cfg))
    assert {k: plan.requested[k] for k in ("router", "moe_shared", "kv", "graphs", "norm")} == {
        "router": "torch", "moe_shared": "separate", "kv": "exact", "graphs": "eager", "norm": "triton"}
    assert plan.explicit == {"router", "moe_shared", "kv", "graphs"}
    assert plan.source("norm") == "device default (cuda)" and plan.source("router") == "user override"


@pytest.mark.parametrize("aliases,want", [({"fused_router": False}, "torch"), ({"fused_router_gemv": False}, "triton"),
                                          ({"fused_router": False, "fused_router_gemv": False}, "torch"),
                                          ({"fused_router": True, "fused_router_gemv": True}, "gemv"),
                                          ({"fused_router": True}, "triton"), ({}, "gemv")])
def test_router_aliases(aliases, want):
    assert BackendPlan.build("cuda", aliases=aliases).requested["router"] == want


@pytest.mark.parametrize("over,msg", [({"nope": "x"}, "no plan entry 'nope'"),
                                      ({"router": "fast"}, "router is one of gemv, triton, torch"),
                                      ({"moe": "tritonn"}, "op 'moe' has no backend 'tritonn'"),
                                      ({"norm": "triton"}, "--backend norm=triton needs a CUDA device")])
def test_plan_validation_names_the_culprit(over, msg):
    with pytest.raises(ConfigError, match=msg):
        BackendPlan.build("cpu", over)
    with pytest.raises(ConfigError, match="expected ENTRY=NAME"):
        parse_backend_specs("router")


def test_round_static_is_refused_under_tensor_parallelism():
    assert BackendPlan.build("cuda", tensor_parallel=True).requested["round"] == "eager"
    with pytest.raises(ConfigError, match="tensor-parallel-size > 1"):
        BackendPlan.build("cuda", {"round": "static"}, tensor_parallel=True)


@pytest.fixture(scope="module")
def spec_engine():
    from bytebound.engine.engine import Engine
    return Engine(speculative_steps=2, backends={"round": "static"}, max_model_len=256)


def test_manifest_lists_every_entry_per_regime_and_why(spec_engine):
    from bytebound.verify import build_manifest, format_manifest
    man = build_manifest(spec_engine)
    pl = man["plan"]
    assert set(pl["entries"]) == set(ENTRIES)
    assert pl["regimes"]["verify"] == "M=3"
    for name, e in pl["entries"].items():
        assert set(e["regimes"]) == set(REGIMES), name
        for cell in e["regimes"].values():
            assert cell["impl"] and cell["why"] in ("user override", "device default", "tuned table", "fallback",
                                                    "width", "regime", "not used"), (name, cell)
    assert pl["entries"]["round"]["regimes"]["verify"] == {"impl": "static", "why": "user override"}
    assert pl["entries"]["moe"]["regimes"]["decode"]["why"] == "device default"
    assert spec_engine.static_round
    text = format_manifest(man)
    assert "plan (decode M=1 | verify M=3" in text and "round       - | static [user override] | -" in text


def test_rebind_frees_the_previous_runner_and_its_graph(spec_engine):
    """``Engine.rebind`` lets the previous runner (its caches) and the graph installed on it go before the new ones
    are made, although a runner and its graph hold each other (``DecodeGraph.runner``, ``CompiledDecode.runner``):
    a cycle that only the cyclic collector frees, whenever it next runs a full collection (here: never)."""
    import gc
    import weakref

    class Graph:                      # holds its runner, as DecodeGraph and CompiledDecode do
        def __init__(self, runner):
            self.runner = runner
    spec_engine.runner.graph = Graph(spec_engine.runner)
    old = weakref.ref(spec_engine.runner)
    enabled = gc.isenabled()
    gc.disable()
    try:
        spec_engine.rebind(backends={"round": "static"})
        assert old() is None, "the previous runner outlived rebind"
    finally:
        if enabled:
            gc.enable()


def test_rebind_replans_the_loaded_model(spec_engine):
    model = spec_engine.model
    spec_engine.rebind(backends={"round": "eager"})
    try:
        assert spec_engine.model is model and not spec_engine.static_round
        assert spec_engine.plan.entries["round"]["verify"].impl == "eager"
        from bytebound.sampling import SamplingParams
        out = spec_engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        assert out.spec["rounds"] > 0
        with pytest.raises(ConfigError, match="cannot change without a new Engine"):
            spec_engine.rebind(model="elsewhere")
    finally:
        spec_engine.rebind(backends={"round": "static"})
