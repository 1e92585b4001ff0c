"""One verify-width limit (issue 18, scope 3): every ``--speculative-num-steps`` either runs or is refused at
start-up with a named error, never a silent fall from the fast paths to the prefill paths.

* CPU (torch backends, any M): speculative greedy == plain greedy for k = 1..5 on the bundled trained ling-nano
  (GSM8K test prompts), through both round implementations (eager ``mtp_tokens`` and the static round).
* A CUDA plan (its bound fast paths mocked: no GPU here) refuses k + 1 > ``kernels.limits.MAX_VERIFY_M`` with a
  ConfigError naming the limiting paths, at engine start-up; k + 1 <= the limit starts.
* ``bind_model`` derives the limit from what it bound: bound callables' ``max_tokens`` and the fused router.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bytebound.errors import ConfigError
from bytebound.kernels.limits import MAX_VERIFY_M, verify_width
from bytebound.sampling import SamplingParams

NANO = Path(__file__).resolve().parents[1] / "models" / "ling-nano"
needs_nano = pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano not present")
P = SamplingParams(max_tokens=20, ignore_eos=True)      # greedy; no EOS, so every run has exactly 20 tokens


@pytest.fixture(scope="module")
def questions():
    from bytebound.data.gsm8k import load_split
    return [r["question"] for r in load_split("test")[:2]]


@pytest.fixture(scope="module")
def plain_ids(questions):
    from bytebound.engine.engine import Engine
    plain = Engine(model=str(NANO))
    assert plain.plan.fast_paths == {} and plain.plan.max_verify_m is None     # CPU: no width limit
    return [plain.generate(q, P, chat=True)[0].token_ids for q in questions]


@needs_nano
@pytest.mark.parametrize("static", [False, True], ids=["eager-round", "static-round"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_cpu_speculative_equals_plain_for_every_k(questions, plain_ids, k, static):
    from bytebound.engine.engine import Engine
    spec = Engine(model=str(NANO), speculative_steps=k, spec_static_round=static)
    committed = rounds = 0
    for q, want in zip(questions, plain_ids):
        out = spec.generate(q, P, chat=True)[0]
        assert len(want) == P.max_tokens
        assert out.token_ids == want, f"k={k}: speculative output diverged from plain greedy"
        assert out.spec["committed"] == P.max_tokens - 1     # every token after the prefill's came from rounds
        committed += out.spec["committed"]
        rounds += out.spec["rounds"]
    # the parity must come from rounds that accepted drafts (a round that accepts none is a plain step)
    assert committed / rounds > 1.2, f"k={k}: accept length {committed / rounds:.2f}"


def _mock_cuda_plan(monkeypatch):
    """Make Engine's ``bind_model`` record what it records on CUDA with the default backends: the triton MoE,
    FP8 linear and FP8 head, and the fused router, each serving at most MAX_VERIFY_M tokens per call."""
    import bytebound.engine.engine as eng
    real = eng.bind_model

    def bind(*a, **kw):
        plan = real(*a, **kw)
        plan.fast_paths = {"moe[triton]": MAX_VERIFY_M, "linear[triton]": MAX_VERIFY_M,
                           "lm_head[triton] (fp8)": MAX_VERIFY_M, "router[triton]": MAX_VERIFY_M}
        return plan
    monkeypatch.setattr(eng, "bind_model", bind)


@pytest.mark.parametrize("k", [MAX_VERIFY_M, MAX_VERIFY_M + 1])
def test_cuda_plan_refuses_a_verify_wider_than_its_fast_paths(quant_ckpt, monkeypatch, k):
    from bytebound.engine.engine import Engine
    _mock_cuda_plan(monkeypatch)
    assert verify_width(k) > MAX_VERIFY_M
    with pytest.raises(ConfigError, match=rf"--speculative-num-steps {k}: the verify runs {k + 1} tokens per call, "
                                          rf"but the bound fast paths serve at most {MAX_VERIFY_M} \(linear\[triton\] "
                                          rf"<= 4, lm_head\[triton\] \(fp8\) <= 4, moe\[triton\] <= 4, "
                                          rf"router\[triton\] <= 4\); use --speculative-num-steps <= 3"):
        Engine(model=str(quant_ckpt), max_model_len=128, speculative_steps=k)


def test_cuda_plan_starts_at_the_limit_and_records_it(quant_ckpt, monkeypatch):
    from bytebound.engine.engine import Engine
    from bytebound.verify import build_manifest
    _mock_cuda_plan(monkeypatch)
    for k in (0, MAX_VERIFY_M - 1):     # no MTP, and the widest verify the fast paths serve
        e = Engine(model=str(quant_ckpt), max_model_len=128, speculative_steps=k)
        assert e.plan.max_verify_m == MAX_VERIFY_M
        mtp = build_manifest(e)["levers"]["mtp"]
        assert mtp["max_verify_m"] == MAX_VERIFY_M and mtp["fast_paths"]["moe[triton]"] == MAX_VERIFY_M


def test_check_speculative_uses_the_narrowest_path():
    from bytebound.runner.backends import BackendPlan
    plan = BackendPlan({"moe": "triton"}, fast_paths={"moe[triton]": 4, "linear[x]": 2})
    assert plan.max_verify_m == 2
    plan.check_speculative(0)
    plan.check_speculative(1)
    with pytest.raises(ConfigError, match=r"serve at most 2 \(linear\[x\] <= 2\)"):
        plan.check_speculative(2)
    BackendPlan({}).check_speculative(50)            # no limited path bound: any k


def test_bind_model_collects_the_bound_limits():
    """``bind_model`` reads ``max_tokens`` of what it bound. On CPU nothing has one; stand-ins with the triton
    callables' attribute (MoE kernel, FP8 linear, FP8 head) are collected under their op and backend."""
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LingConfig
    from bytebound.layers.linear import QLinear
    from bytebound.layers.moe import RoutedExperts
    from bytebound.runner.backends import BackendPlan, _fast_paths, bind_model
    model = dummy_model(LingConfig.from_file(NANO / "config.json"), torch.device("cpu"), torch.float32)
    plan = bind_model(model, BackendPlan.default("cpu"), "cpu")
    assert plan.fast_paths == {}

    class Limited:
        def __init__(self, n):
            self.max_tokens = n

        def __call__(self, *a):
            raise AssertionError("not called")
    exps = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    lins = [m for m in model.modules() if isinstance(m, QLinear) and m.fn is not None]
    for m in exps:
        m.fn = Limited(MAX_VERIFY_M)
    lins[0].fn = Limited(3)
    model.lm_head.fn = Limited(None)     # e.g. the triton head in bf16 mode: cuBLAS, any M
    assert _fast_paths(model, plan, router="triton") == {"moe[torch]": MAX_VERIFY_M, "linear[torch]": 3,
                                                     "router[triton]": MAX_VERIFY_M}
    assert _fast_paths(model, plan, router=False) == {"moe[torch]": MAX_VERIFY_M, "linear[torch]": 3}
