"""The compiled CPU decode step (``--cpu-compile``, ``runner.cpu_compile``) against the eager torch modules, and
the traced routed-expert form it relies on against a float64 reference. Speed is not asserted
(docs/perf/cpu-decode-nano.md). The compiling tests are ``slow``: inductor compiles C++ (minutes on 2 cores with a
cold cache)."""

from __future__ import annotations

import types

import pytest
import torch

from bytebound.errors import BackendError
from bytebound.kernels import torch_ref
from bytebound.kernels.torch_ref import moe_reference
from bytebound.layers.moe import RoutedExperts
from bytebound.runner.cpu_compile import CompiledDecode, _bf16_exact, compile_decode
from bytebound.runner.runner import ModelRunner
from test_cpu_decode import rel, routed_float64


@pytest.fixture(scope="module")
def bound_quant_model(quant_ckpt):
    from bytebound.checkpoint.loader import load_model
    from bytebound.runner.backends import BackendPlan, bind_model
    model = load_model(quant_ckpt, "cpu")
    bind_model(model, BackendPlan.default("cpu"), "cpu")
    return model


@pytest.mark.parametrize("limit", [None, 0.7])
@torch.inference_mode()
def test_traced_routed_rows_match_float64(bound_quant_model, monkeypatch, limit):
    """The routed sum as torch.compile traces it (expert rows indexed inside reductions, no host sync) equals a
    float64 reference for decode and verify shapes, and ``moe_reference`` takes it while compiling."""
    ex = next(m for m in bound_quant_model.modules() if isinstance(m, RoutedExperts))
    monkeypatch.setattr(ex, "limit", limit)
    g = torch.Generator().manual_seed(11)
    for m in (1, 4):
        x = torch.randn(m, ex.hidden, generator=g)
        ids = torch.stack([torch.randperm(ex.n, generator=g)[:4] for _ in range(m)])
        w = torch.rand(m, 4, generator=g)
        ref = routed_float64(ex, x, ids, w)
        y = torch_ref._moe_rows_traced(ex, x, ids, w)
        assert y.dtype == torch.float32 and y.shape == x.shape
        assert rel(y, ref) < 2e-6, (limit, m)
        bad = w.clone()
        bad[0, 1] *= 1.01                                  # the tolerance can fail: one slot weight 1 % off
        assert rel(torch_ref._moe_rows_traced(ex, x, ids, bad), ref) > 1e-4
    calls = []
    orig = torch_ref._moe_rows_traced
    monkeypatch.setattr(torch_ref, "_moe_rows_traced", lambda *a: calls.append(1) or orig(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    moe_reference(ex, x, ids, w)
    assert calls, "moe_reference did not take the traced form while compiling"


def test_traced_linear_and_exact_bf16_copies():
    """The compiled step's projection form (bf16 weight, float32 products) equals a float64 product of the same
    values, and a weight gets a bfloat16 copy only when every value converts exactly."""
    g = torch.Generator().manual_seed(12)
    w = torch.randn(40, 24, generator=g).to(torch.bfloat16).float() * 2.0 ** -3     # bf16-exact float32 values
    x = torch.randn(3, 24, generator=g)
    b = _bf16_exact(w)
    assert b is not None and b.dtype == torch.bfloat16 and torch.equal(b.float(), w)
    ref = x.double() @ w.double().t()
    assert rel(torch_ref.traced_linear(x, b), ref) < 1e-6
    assert rel(torch_ref.traced_linear(x, b) * 1.001, ref) > 5e-4          # the tolerance can fail
    w2 = w.clone()
    w2[3, 5] += 2.0 ** -20                                                     # one value bf16 cannot hold
    assert _bf16_exact(w2) is None and _bf16_exact(w.double()) is None


def test_compiled_step_needs_a_cpu():
    fake = types.SimpleNamespace(device=torch.device("meta"))
    with pytest.raises(BackendError, match="needs device cpu"):
        CompiledDecode(fake, warmup=False)


def _greedy(runner, prompt, n):
    runner.reset()
    lg = runner.logits(runner.prefill(prompt)[-1:])
    toks, logits = [], []
    for _ in range(n):
        tok = lg.argmax(-1)
        toks.append(int(tok[0]))
        lg = runner.logits(runner.forward(tok.view(1)))
        logits.append(lg)
    return toks, torch.cat(logits)


@pytest.mark.slow
@torch.inference_mode()
def test_compiled_step_equals_eager_across_spans(bound_quant_model):
    """Greedy decoding through the compiled step gives the eager step's tokens and logits (float32 rounding:
    another summation order) across an attention-span edge (two compiled graphs), with the state advanced in place
    exactly as eager advances it."""
    model = bound_quant_model
    prompt = torch.randint(4, model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    eager = ModelRunner(model, 64, "cpu")
    toks_e, lg_e = _greedy(eager, prompt, 24)                 # positions 20..43: crosses the 32-slot span
    comp = ModelRunner(model, 64, "cpu", kv_buckets=(32,))
    g = compile_decode(comp)
    assert comp.graph is g and comp.kv_buckets == (32, 64)
    # dequantised FP8 / MXFP4 weights are bf16-exact and get their copy; plain float32 ones (random values) keep
    # float32: the count is that of the bound projections whose values bfloat16 holds exactly
    bound = [f for m in model.modules() for f in (getattr(m, a, None) for a in ("fn", "proj_fn", "gate_up_fn"))
             if isinstance(f, torch_ref.BoundLinear)]
    exact = sum(torch.equal(f.weight.to(torch.bfloat16).float(), f.weight) for f in bound)
    assert g.bf16_weights["linear"] == [exact, len(bound)] and exact > 0
    assert all((f.traced is not None) == torch.equal(f.weight.to(torch.bfloat16).float(), f.weight) for f in bound)
    n_moe = sum(isinstance(m, RoutedExperts) for m in model.modules())
    assert g.bf16_weights["experts"] == [n_moe, n_moe]
    toks_c, lg_c = _greedy(comp, prompt, 24)
    assert sorted(s["kv_slots"] for s in g.captured_shapes) == [32, 64]
    assert toks_c == toks_e
    torch.testing.assert_close(lg_c, lg_e, rtol=1e-5, atol=1e-5)
    # the KDA states and MLA caches the compiled step wrote are the eager ones
    for a, b in zip(comp.state, eager.state):
        if hasattr(a, "kv"):
            torch.testing.assert_close(a.kv[:, :44], b.kv[:, :44], rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(a.rec, b.rec, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.conv, b.conv, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_engine_cpu_compile_manifest_and_tokens(quant_ckpt):
    """``EngineConfig(cpu_compile=True)``: the manifest records the compiled step, the graph_replay canary checks it
    against eager, and greedy generation gives the eager engine's tokens."""
    from bytebound.engine.engine import Engine, EngineConfig
    from bytebound.sampling import SamplingParams
    from bytebound.verify.manifest import build_manifest
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = [5, 9, 17, 33, 2, 8]
    eager = Engine(EngineConfig(model=str(quant_ckpt), max_model_len=128)).generate(prompt, p)[0]
    eng = Engine(EngineConfig(model=str(quant_ckpt), max_model_len=128, cpu_compile=True, verify=True))
    lever = build_manifest(eng)["levers"]["cuda_graphs"]
    assert lever["resolved"] == "compiled" and lever["ok"], lever
    assert lever["captured_shapes"][0]["kv_slots"] == 128
    canary = next(c for c in eng.canaries if c.name == "graph_replay")
    assert canary.status == "pass", canary
    assert eng.generate(prompt, p)[0].token_ids == eager.token_ids
