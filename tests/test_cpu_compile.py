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


# --- the demo's default (cpu_compile="auto") and its fallbacks: fast, the compile itself is mocked ---------------

def test_demo_defaults_to_auto_and_other_commands_stay_eager(monkeypatch, tmp_path):
    """``bytebound demo`` asks for the compiled step where it can be built, ``--no-cpu-compile`` /
    ``--cpu-compile`` override it, other commands keep the eager default; a compiling command line points
    inductor's cache at a directory that survives reboots unless TORCHINDUCTOR_CACHE_DIR is set."""
    import os

    import bytebound.cli as cli
    got = []
    monkeypatch.setattr(cli, "cmd_demo", lambda a: got.append(cli.engine_config(a)) or 0)
    monkeypatch.setattr(cli, "cmd_generate", lambda a: got.append(cli.engine_config(a)) or 0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "restored-after-the-test")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert cli.main(["generate", "--prompt", "x"]) == 0 and got[-1].cpu_compile is False
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert cli.main(["demo", "--no-cpu-compile"]) == 0 and got[-1].cpu_compile is False
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert cli.main(["demo"]) == 0 and got[-1].cpu_compile == "auto" and not got[-1].enforce_eager
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "bytebound" / "torchinductor")
    assert cli.main(["demo", "--cpu-compile"]) == 0 and got[-1].cpu_compile is True
    assert cli.main(["generate", "--prompt", "x", "--cpu-compile"]) == 0 and got[-1].cpu_compile is True
    assert cli.main(["demo", "--enforce-eager"]) == 0 and got[-1].enforce_eager
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert cli.main(["demo"]) == 0 and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.parametrize("fmt", ["chat", "5shot"])
def test_demo_compiles_only_the_spans_its_answer_reaches(monkeypatch, tmp_path, capsys, fmt):
    """``bytebound demo`` compiles the attention spans its prompt + --max-tokens steps reach and no other: the
    5-shot prompt (over 1000 tokens) starts past the first 512-slot span, which is not compiled at start-up. The
    compile is a spy (torch.compile returns the eager step), so the test is cheap; the spans are those the compile
    notices name."""
    import re

    import bytebound.cli as cli
    from bytebound.runner import cpu_compile
    from bytebound.runner.runner import pow2_buckets
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(cpu_compile, "compile_unavailable_reason", lambda: None)
    traced = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: traced.append(kw) or fn)     # no inductor
    max_tokens = 3
    assert cli.main(["demo", "--format", fmt, "--max-tokens", str(max_tokens)]) == 0
    out, err = capsys.readouterr()
    assert len(traced) == 1 and "answer:" in out
    n = int(re.search(r"prompt (\d+) tokens", out).group(1))
    spans = [int(s) for s in re.findall(r"compiling the CPU decode step \((\d+) cache slots\)", err)]
    buckets = pow2_buckets(4096, cpu_compile.CPU_SMALLEST_SPAN)          # the demo's default max_model_len
    want = sorted({min(b for b in buckets if b >= p + 1) for p in range(n, n + max_tokens)})
    assert spans == want, (n, spans)
    if fmt == "5shot":
        assert n > 1024 and 512 not in spans


def _engine(ckpt, **kw):
    from bytebound.engine.engine import Engine, EngineConfig
    return Engine(EngineConfig(model=str(ckpt), max_model_len=128, **kw))


def _broken_compile(*a, **k):
    raise BackendError("torch.compile could not compile the CPU decode step (128 slots): CppCompileError: boom")


def test_auto_falls_back_to_eager_with_the_reason(quant_ckpt, monkeypatch, capsys):
    """cpu_compile="auto": a failed compile leaves the eager step (same tokens as an eager engine), prints one
    FALLBACK line with the compiler's reason and records it in the manifest; cpu_compile=True raises instead."""
    from bytebound.runner import cpu_compile
    from bytebound.sampling import SamplingParams
    from bytebound.verify.manifest import build_manifest
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = [5, 9, 17, 33]
    want = _engine(quant_ckpt).generate(prompt, p)[0].token_ids
    monkeypatch.setattr(cpu_compile, "compile_unavailable_reason", lambda: None)
    monkeypatch.setattr(cpu_compile, "compile_decode", _broken_compile)
    eng = _engine(quant_ckpt, cpu_compile="auto")
    err = capsys.readouterr().err
    assert "FALLBACK cpu_compile: running the eager CPU decode step" in err and "CppCompileError: boom" in err
    assert eng.runner.graph is None and "CppCompileError: boom" in eng.cpu_compile_fallback
    lever = build_manifest(eng)["levers"]["cuda_graphs"]
    assert lever["resolved"] == "eager" and lever["ok"] and "boom" in lever["fallback_reason"], lever
    assert eng.generate(prompt, p)[0].token_ids == want
    with pytest.raises(BackendError, match="boom"):
        _engine(quant_ckpt, cpu_compile=True)


def test_auto_skips_the_compile_when_it_cannot_work(quant_ckpt, monkeypatch, capsys):
    """No C++ compiler (or Python headers): "auto" does not try (no trace, no wait) and says why; True raises the
    same reason; --enforce-eager (graphs=eager) and a bad value are handled before any compile."""
    from bytebound.errors import ConfigError
    from bytebound.runner import cpu_compile
    calls = []
    monkeypatch.setattr(cpu_compile, "compile_decode", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(cpu_compile, "compile_unavailable_reason", lambda: "no C++ compiler for torch.compile")
    eng = _engine(quant_ckpt, cpu_compile="auto")
    assert eng.runner.graph is None and eng.cpu_compile_fallback == "no C++ compiler for torch.compile"
    assert "FALLBACK cpu_compile" in capsys.readouterr().err
    with pytest.raises(BackendError, match="--cpu-compile: no C\\+\\+ compiler"):
        _engine(quant_ckpt, cpu_compile=True)
    monkeypatch.setattr(cpu_compile, "compile_unavailable_reason", lambda: None)
    eng = _engine(quant_ckpt, cpu_compile="auto", enforce_eager=True)
    assert not calls and eng.cpu_compile_fallback is None and "cpu_compile" not in capsys.readouterr().err
    with pytest.raises(ConfigError, match="cpu_compile must be False, True or 'auto'"):
        _engine(quant_ckpt, cpu_compile="yes")


def test_compile_notice_names_the_cache(quant_ckpt, monkeypatch, capsys, tmp_path):
    """Around each compile the engine prints a one-line notice (one-time cost, where it is cached, the way out)
    and the seconds it took."""
    from bytebound.runner import cpu_compile
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_compile, "compile_unavailable_reason", lambda: None)
    seen = []

    def fake(runner, warmup=True, notice=None, eager_on_error=False):
        seen.append((eager_on_error, notice))
        notice(512, None)
        notice(512, 41.5)
    monkeypatch.setattr(cpu_compile, "compile_decode", fake)
    eng = _engine(quant_ckpt, cpu_compile="auto")
    err = capsys.readouterr().err
    assert [s[0] for s in seen] == [True] and eng.cpu_compile_fallback is None
    assert "compiling the CPU decode step (512 cache slots): 30-60 s on 2 cores the first time" in err and str(tmp_path) in err
    assert "--no-cpu-compile" in err and "ready in 41.5 s" in err
    seen[0][1](1024, None, "torch.compile could not compile the CPU decode step (1024 slots): boom")   # mid-request
    err = capsys.readouterr().err
    assert "FALLBACK cpu_compile: running the eager CPU decode step from here on" in err and "boom" in err
    assert "1024 slots" in eng.cpu_compile_fallback


def test_unavailable_reason_names_compiler_and_headers(monkeypatch, tmp_path):
    import sysconfig

    import torch._inductor.cpp_builder as cb
    from bytebound.runner.cpu_compile import compile_unavailable_reason

    def no_cxx():
        raise FileNotFoundError("g++")
    monkeypatch.setattr(cb, "get_cpp_compiler", no_cxx)
    assert "no C++ compiler" in compile_unavailable_reason()
    monkeypatch.setattr(cb, "get_cpp_compiler", lambda: "g++")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert "no Python.h" in compile_unavailable_reason()
    (tmp_path / "Python.h").write_text("")
    assert compile_unavailable_reason() is None


def test_failed_compile_leaves_the_runner_eager(bound_quant_model, monkeypatch):
    """compile_decode raising (the start-up compile failed) restores the runner's spans and drops the bfloat16
    weight copies, so the eager step runs exactly as before."""
    from bytebound.runner import cpu_compile
    runner = ModelRunner(bound_quant_model, 1024, "cpu")

    def broken(*a, **k):
        raise BackendError("no")
    monkeypatch.setattr(cpu_compile, "CompiledDecode", broken)
    with pytest.raises(BackendError):
        compile_decode(runner)
    assert runner.graph is None and runner.kv_buckets == (1024,)
    assert all(getattr(m, "_traced_deq", None) is None for m in bound_quant_model.modules())
    assert all(getattr(getattr(m, a, None), "traced", None) is None for m in bound_quant_model.modules()
               for a in ("fn", "proj_fn", "gate_up_fn"))


@torch.inference_mode()
def test_span_compile_failure_mid_request_continues_eagerly(bound_quant_model):
    """eager_on_error: a sequence reaching a span whose compile fails takes the eager step from that position on
    (same hidden as an eager runner), and the runner drops the compiled step; without it the error is raised."""
    model = bound_quant_model
    prompt = torch.randint(4, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    nxt = torch.tensor([7])
    eager = ModelRunner(model, 64, "cpu")
    eager.prefill(prompt)
    want = [eager.forward(nxt), eager.forward(nxt)]

    def broken(*a):
        raise RuntimeError("inductor fell over")
    for on_error in (True, False):
        runner = ModelRunner(model, 64, "cpu", kv_buckets=(32,))
        told = []
        g = CompiledDecode(runner, warmup=False, notice=lambda *a: told.append(a), eager_on_error=on_error)
        g.fn, g.compile_s = broken, {32: 1.0}           # as if the 32-slot span compiled at start-up
        runner.graph = g
        runner.prefill(prompt)                          # 40 tokens: the next step needs the 64-slot span
        if not on_error:
            with pytest.raises(BackendError, match="64 slots.*inductor fell over"):
                runner.forward(nxt)
            continue
        got = [runner.forward(nxt), runner.forward(nxt)]
        assert runner.graph is None and "inductor fell over" in g.failed
        assert told == [(64, None), (64, None, g.failed)]           # before the compile, then the failure
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@torch.inference_mode()
def test_first_compile_failure_without_warmup_follows_eager_on_error(bound_quant_model):
    """warmup=False (the demo): the first compile happens in precompile, after start-up, so a failure there takes
    the eager step under eager_on_error (cpu_compile "auto") as a later span's would, and raises without it."""
    def broken(*a):
        raise RuntimeError("inductor fell over")
    for on_error in (True, False):
        runner = ModelRunner(bound_quant_model, 64, "cpu", kv_buckets=(32,))
        told = []
        g = CompiledDecode(runner, warmup=False, notice=lambda *a: told.append(a), eager_on_error=on_error)
        assert g.compile_s == {}                        # nothing compiled at construction
        g.fn, runner.graph = broken, g
        if not on_error:
            with pytest.raises(BackendError, match="32 slots.*inductor fell over"):
                g.precompile(5, 40)
            continue
        assert g.precompile(5, 40) == [] and runner.graph is None and "inductor fell over" in g.failed
        assert told == [(32, None), (32, None, g.failed)] and runner.pos == 0


def test_precompile_compiles_the_spans_a_request_reaches(bound_quant_model):
    """precompile(first, last) runs one step at the last position of each span the steps first..last use that is
    not compiled yet (and only those), then resets the runner, so the request starts clean; nothing past a failure
    that uninstalled the compiled step."""
    runner = ModelRunner(bound_quant_model, 64, "cpu", kv_buckets=(16, 32))
    g = CompiledDecode(runner, warmup=False)
    runner.graph, g.compile_s = g, {16: 1.0}            # as if the 16-slot span compiled at start-up
    calls = []

    def fake_replay(tok, pos):
        calls.append(pos)
        runner.pos = pos + 1                            # a real step would leave state behind: reset must clear it
        g.compile_s[runner.kv_span(pos + 1)] = 0.5
    g.replay = fake_replay
    assert g.precompile(3, 10) == [] and calls == []    # inside the compiled span
    assert g.precompile(20, 40) == [32, 64] and calls == [31, 63] and runner.pos == 0
    assert g.precompile(20, 40) == [] and calls == [31, 63]
    g2 = CompiledDecode(runner, warmup=False)
    g2.compile_s = {16: 1.0}
    runner.graph = None                                 # uninstalled (a span failed): nothing more is compiled
    g2.replay = fake_replay
    calls.clear()
    assert g2.precompile(20, 40) == [] and calls == []
