"""ModelRunner attention spans: the CUDA path attends over a static number of cache slots masked by position
(graph-capturable, no host sync); with ``kv_buckets`` the span is the smallest bucket holding the sequence.
Every span must give the logits of the sliced (exact-length) CPU path."""

from __future__ import annotations

import pytest
import torch

from bytebound.runner.graphs import DecodeGraph
from bytebound.runner.runner import ModelRunner, pow2_buckets
from conftest import make_model


def test_span_past_the_cache_is_a_named_error():
    r = ModelRunner(make_model(), 300, "cpu", kv_buckets=(64,))
    with pytest.raises(ValueError, match="exceeds the cache"):
        r.kv_span(301)


def test_pow2_buckets_and_span_choice():
    assert pow2_buckets(4096) == (1024, 2048, 4096)
    assert pow2_buckets(5000) == (1024, 2048, 4096, 5000)
    assert pow2_buckets(512) == (512,)
    model = make_model()
    r = ModelRunner(model, 300, "cpu", kv_buckets=(64, 128, 1000))
    assert r.kv_buckets == (64, 128, 300)                     # spans past max_len are dropped; max_len is kept
    assert [r.kv_span(n) for n in (1, 64, 65, 128, 129, 300)] == [64, 64, 128, 128, 300, 300]


@torch.inference_mode()
def test_static_spans_match_sliced_attention_across_bucket_edges():
    model = make_model()
    prompt = torch.randint(4, model.cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(0))

    spans = set()

    def run(static: bool, buckets):
        r = ModelRunner(model, 200, "cpu", kv_buckets=buckets)
        r.static_kv = static
        span = r.kv_span
        r.kv_span = lambda end: spans.add(span(end)) or span(end)
        h = r.prefill(prompt)
        tok = model.logits(h[-1:]).argmax(-1)
        out = []
        for _ in range(40):                                  # 50 + 40 tokens: crosses the 64 edge
            lg = model.logits(r.forward(tok.view(1)))
            out.append(lg)
            tok = lg.argmax(-1)
        return torch.cat(out)

    sliced = run(False, None)
    one_span = run(True, None)                               # all 200 slots every step (the CUDA default)
    spans.clear()
    buckets = run(True, (64, 128))                           # 64 slots, then 128 after the 64th token
    assert spans == {64, 128}
    torch.testing.assert_close(one_span, sliced, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buckets, sliced, rtol=1e-5, atol=1e-5)


def test_fused_kda_projections_equal_separate_ones(quant_ckpt, tmp_path):
    """bind_model fuses each KDA layer's q|k|v|f|g FP8 projections into one (linear.fuse_rows): outputs equal the
    five separate projections, no memory is added (the parts become row views), and the state dict, hence a
    re-written checkpoint, is unchanged."""
    from bytebound.checkpoint.loader import load_model
    from bytebound.checkpoint.writer import save_pretrained
    from bytebound.layers.kda import KimiDeltaAttention
    from bytebound.runner.backends import BackendPlan, bind_model
    model = load_model(quant_ckpt, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bind_model(model, BackendPlan.default("cpu"), "cpu")
    kdas = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    assert kdas and all(m.proj_fn is not None for m in kdas)
    # the parts are not bound on their own (no second dequantised copy of their weights)
    assert all(p.fn is None and p.backend.endswith("(fused)") for m in kdas
               for p in (m.q_proj, m.k_proj, m.v_proj, m.f_proj, m.g_proj))
    m0 = kdas[0]
    assert m0.q_proj.weight.data_ptr() + m0.q_proj.weight.numel() * m0.q_proj.weight.element_size() \
        == m0.k_proj.weight.data_ptr()                                          # rows of one tensor
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    ids = torch.randint(4, model.cfg.vocab_size, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        fused = model(ids)
        for m in kdas:
            m.proj_fn = None
        separate = model(ids)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)
    out = save_pretrained(model, tmp_path / "again", quant=model.cfg.quant, float_dtype=torch.float32)
    again = load_model(out, "cpu")
    assert all(torch.equal(again.state_dict()[k], before[k]) for k in before)


def test_fused_mla_projections_equal_separate_ones(quant_ckpt, tmp_path):
    """bind_model fuses each MLA layer's q_proj | kv_a_proj_with_mqa | g_proj FP8 projections into one
    (``linear.fuse_rows(pad=True)``): the tiny config's 32-row scale blocks put kv_a's 40 rows inside a block, so
    24 zero rows follow it and g_proj starts on a block edge. The parts become row views with their own scale rows,
    the state dict (hence a re-written checkpoint) is unchanged, the plan records the layout, and prefill and
    decode steps (expanded and absorbed attention) give the logits of the three separate projections."""
    from bytebound.checkpoint.loader import load_model
    from bytebound.checkpoint.writer import save_pretrained
    from bytebound.layers.mla import GatedMLA
    from bytebound.runner.backends import BackendPlan, bind_model
    model = load_model(quant_ckpt, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = bind_model(model, BackendPlan.default("cpu"), "cpu")
    mlas = [m for m in model.modules() if isinstance(m, GatedMLA)]
    assert mlas and all(m.proj_fn is not None for m in mlas)
    m0 = mlas[0]
    parts = (m0.q_proj, m0.kv_a_proj_with_mqa, m0.g_proj)
    assert [p.out_features for p in parts] == [96, 40, 4] and all(p.fmt == "fp8" for p in parts)
    assert m0.proj_spans == [(0, 96), (96, 136), (160, 164)]
    assert plan.resolutions["mla"].fused == ("q_proj | kv_a_proj_with_mqa | g_proj: one fp8 projection of 164 rows "
                                             "(24 zero rows keep the parts on 32-row scale-block edges)")
    assert all(p.fn is None and p.backend.endswith("(fused)") for m in mlas
               for p in (m.q_proj, m.kv_a_proj_with_mqa, m.g_proj))
    # rows of one weight (g_proj 24 rows after kv_a's end), and one scale grid: kv_a's 2 scale rows, then g's
    w0 = m0.q_proj.weight
    assert m0.kv_a_proj_with_mqa.weight.data_ptr() == w0.data_ptr() + 96 * w0.shape[1]
    assert m0.g_proj.weight.data_ptr() == w0.data_ptr() + 160 * w0.shape[1]
    s0 = m0.q_proj.weight_scale_inv
    assert m0.g_proj.weight_scale_inv.data_ptr() == s0.data_ptr() + (3 + 2) * s0.shape[1] * s0.element_size()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    prompt = torch.randint(4, model.cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(2))

    def run():
        r = ModelRunner(model, 64, "cpu")
        out = [model.logits(r.prefill(prompt)[-1:])]
        for t in (5, 9, 11):
            out.append(model.logits(r.forward(torch.tensor([t]))))
        out.append(model.logits(r.verify(torch.tensor([3, 7, 2]))))
        return torch.cat([o.reshape(-1, o.shape[-1]) for o in out])
    with torch.inference_mode():
        fused = run()
        saved = [(m.proj_fn, m.proj_spans) for m in mlas]
        for m in mlas:
            m.proj_fn = None
        separate = run()
    for m, (fn, spans) in zip(mlas, saved):
        m.proj_fn, m.proj_spans = fn, spans
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)
    out = save_pretrained(model, tmp_path / "again", quant=model.cfg.quant, float_dtype=torch.float32)
    again = load_model(out, "cpu")
    assert all(torch.equal(again.state_dict()[k], before[k]) for k in before)


def test_mla_projections_of_different_formats_stay_separate():
    """A g_proj kept in BF16 (``modules_to_not_convert``) next to FP8 q_proj and kv_a cannot share one weight: the
    layer keeps its three projections, and the plan records why."""
    from dataclasses import replace

    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import tiny_config
    from bytebound.layers.mla import GatedMLA
    from bytebound.runner.backends import BackendPlan, bind_model
    from conftest import quant_tiny
    quant = replace(quant_tiny(), modules_to_not_convert=("lm_head", "b_proj", "attention.g_proj"))
    model = dummy_model(tiny_config(quant=quant), "cpu", torch.float32)
    mla = next(m for m in model.modules() if isinstance(m, GatedMLA))
    assert (mla.q_proj.fmt, mla.g_proj.fmt) == ("fp8", "plain")
    plan = bind_model(model, BackendPlan.default("cpu"), "cpu")
    assert mla.proj_fn is None and mla.proj_spans is None and mla.g_proj.fn is not None
    assert plan.resolutions["mla"].fused == ("q_proj | kv_a_proj_with_mqa | g_proj: three projections, not fused: "
                                             "format differs (fp8 vs plain)")


def test_fuse_layout_rules():
    """``linear.fuse_layout``: plain parts stack as they are; FP8 parts start on scale-block edges (the last part's
    tail excepted), padded with ``pad``, else refused with the reason; parts of different formats are refused."""
    from bytebound.layers.linear import QLinear, fuse_layout
    plain = [QLinear(64, n) for n in (96, 40, 4)]
    assert fuse_layout(plain) == ([(0, 96), (96, 136), (136, 140)], 140)
    fp8 = [QLinear(64, n, "fp8", (32, 32)) for n in (96, 40, 4)]
    assert fuse_layout(fp8, pad=True) == ([(0, 96), (96, 136), (160, 164)], 164)
    why = fuse_layout(fp8)
    assert isinstance(why, str) and "inside a 32-row scale block (40 rows)" in why
    assert fuse_layout([fp8[0], fp8[1]]) == ([(0, 96), (96, 136)], 136)         # the last part's tail is its own
    assert fuse_layout([fp8[0], plain[1]], pad=True) == "format differs (fp8 vs plain)"
    assert "input size differs" in fuse_layout([fp8[0], QLinear(32, 32, "fp8", (32, 32))])


@torch.inference_mode()
def test_decode_vs_verify_agree_and_leave_the_state():
    """``verify.canaries.decode_vs_verify`` (the GPU test and scripts/verify_vs_decode.py use it): on the CPU
    float32 path a 4-token verify gives the logits of 4 decode steps, and the runner's state is restored."""
    from bytebound.verify.canaries import decode_vs_verify
    model = make_model()
    r = ModelRunner(model, 200, "cpu")
    h = r.prefill(torch.randint(4, model.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(1)))
    tok = model.logits(h[-1:]).argmax(-1)
    pos, rec = r.pos, [s.rec.clone() for s in r.state if hasattr(s, "rec")]
    seq, ver = decode_vs_verify(r, tok, 4)
    assert seq.shape == ver.shape == (4, model.cfg.vocab_size)
    assert torch.equal(seq.argmax(-1), ver.argmax(-1))
    torch.testing.assert_close(ver, seq, rtol=1e-4, atol=1e-4)
    assert r.pos == pos
    assert all(torch.equal(a, s.rec) for a, s in zip(rec, [s for s in r.state if hasattr(s, "rec")]))
    assert int(seq[0].argmax()) == int(model.logits(r.forward(tok.view(1))).argmax())   # first step == a fresh step


def test_parse_overrides():
    """The scripts' ``--backends op=name,...``: parsed into a dict; a malformed item or unknown op is named."""
    import pytest
    from bytebound.errors import ConfigError
    from bytebound.runner.backends import parse_overrides
    assert parse_overrides("moe=torch,linear=triton") == {"moe": "torch", "linear": "triton"}
    assert parse_overrides("") == {}
    assert parse_overrides("moe=torch,router=torch,kv=exact") == {"moe": "torch", "router": "torch", "kv": "exact"}
    for bad in ("moe", "moe=", "moe=torch,foo=bar"):
        with pytest.raises(ConfigError, match="expected ENTRY=NAME"):
            parse_overrides(bad)


@pytest.mark.parametrize("params", [
    dict(max_tokens=40, ignore_eos=True),                                            # greedy, to max_tokens
    dict(max_tokens=40, temperature=0.8, top_p=0.9, top_k=20, seed=3, ignore_eos=True),   # sampled
    dict(max_tokens=48, temperature=0.7, seed=11, stop=["e"]),                       # a stop string (and EOS)
])
def test_pipelined_plain_decoding_emits_the_same_tokens(tiny_random_ckpt, params):
    """``EngineConfig.pipeline_decode``: each plain step is launched before the host reads the token it follows;
    the output (text, token ids, finish reason) equals the plain loop's, greedy and sampled, at max_tokens and at a
    stop string, and a request that fills the cache exactly (prompt + max_tokens - 1 = max_model_len slots) still
    runs (the step launched ahead needs a slot the plain loop never uses, so it is skipped there)."""
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    ids = list(range(5, 21))
    outs = {}
    for pipe in (False, True):
        eng = Engine(model=str(tiny_random_ckpt), device="cpu", max_model_len=64, pipeline_decode=pipe)
        p = SamplingParams(**params)
        o = eng.generate(ids, p)[0]
        full = eng.generate(ids, SamplingParams(max_tokens=64 - len(ids) + 1, ignore_eos=True))[0]
        outs[pipe] = (o.text, o.token_ids, o.finish_reason, full.token_ids, full.finish_reason)
    assert outs[True] == outs[False]
    assert outs[True][4] == "length" and len(outs[True][3]) == 64 - len(ids) + 1
    if params.get("stop"):              # the case must really end at its stop string, before max_tokens
        assert outs[True][2] == "stop" and len(outs[True][1]) < params["max_tokens"]


def test_pipelined_decoding_default_and_manifest(tiny_random_ckpt):
    """``pipeline_decode=None`` (the default) resolves to the plain loop on CPU and True to the pipelined one; the
    manifest's ``decode_loop`` lever says what was asked and what runs, and an explicit True that cannot run (tensor
    parallelism) is a recorded fallback (ok False, with the reason), not silence."""
    from types import SimpleNamespace

    from bytebound.engine.engine import Engine
    from bytebound.verify.manifest import _decode_loop_lever, build_manifest
    eng = Engine(model=str(tiny_random_ckpt), device="cpu", max_model_len=64)
    assert eng.pipelined is False
    lv = build_manifest(eng)["levers"]["decode_loop"]
    assert (lv["resolved"], lv["ok"]) == ("plain", True) and lv["requested"].startswith("default")
    eng = Engine(model=str(tiny_random_ckpt), device="cpu", max_model_len=64, pipeline_decode=True)
    assert eng.pipelined is True
    lv = build_manifest(eng)["levers"]["decode_loop"]
    assert (lv["requested"], lv["resolved"], lv["ok"]) == ("pipelined", "pipelined", True)
    tp = SimpleNamespace(config=SimpleNamespace(pipeline_decode=True), pipelined=False)
    lv = _decode_loop_lever(tp)
    assert lv["ok"] is False and "tensor parallelism" in lv["reason"]
    lv = _decode_loop_lever(SimpleNamespace(config=SimpleNamespace(pipeline_decode=False), pipelined=False))
    assert (lv["requested"], lv["resolved"], lv["ok"]) == ("plain", "plain", True)


def test_pipeline_decode_flag_is_tristate():
    """``--pipeline-decode`` / ``--no-pipeline-decode`` / neither (None: the engine's default)."""
    import argparse

    from bytebound.cli import add_engine_args, engine_config
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    for argv, want in (([], None), (["--pipeline-decode"], True), (["--no-pipeline-decode"], False)):
        assert engine_config(ap.parse_args(argv)).pipeline_decode is want


# ---- decode_token and DecodeGraph.replay_token's host logic on CPU --------------------------------------------
class _Replay:
    """A 'captured graph' on CPU: ``replay()`` runs ``fn`` (which writes its static output buffer)."""

    def __init__(self, fn):
        self.replay = fn


class CpuTokenGraphs:
    """A CPU stand-in for ``runner.graphs.DecodeGraph`` built like its ``__init__`` (static token / position /
    hidden buffers, per span a greedy and a sampled token 'graph' reading the hidden buffer, ``sp`` / ``u`` /
    ``_written``) but replaying Python closures, so that the real ``replay`` / ``replay_token`` (borrowed below)
    and ``ModelRunner.decode_token`` run on CPU."""

    replay = DecodeGraph.replay
    replay_token = DecodeGraph.replay_token

    def __init__(self, runner):
        from bytebound.sampling import SamplingBuffers, inverse_cdf, probs_device
        self.runner, model = runner, runner.model
        self.tok = torch.zeros(1, dtype=torch.long)
        self.pos = torch.zeros(1, dtype=torch.long)
        self.sp, self.u, self._written = SamplingBuffers("cpu"), torch.zeros(1, 1, dtype=torch.float64), None
        self.graphs, self.token_graphs = {}, {}
        for span in runner.kv_buckets:
            hidden = torch.zeros(1, model.cfg.hidden_size)
            greedy, sampled = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
            self.graphs[span] = (_Replay(lambda h=hidden: h.copy_(
                model(self.tok.view(1, 1), self.pos, runner.state)[0])), hidden)
            self.token_graphs[span, "greedy"] = (_Replay(lambda h=hidden, o=greedy: o.copy_(
                model.logits(h).argmax(-1).view(1))), greedy)
            self.token_graphs[span, "sampled"] = (_Replay(lambda h=hidden, o=sampled: o.copy_(
                inverse_cdf(probs_device(model.logits(h), self.sp), self.u).view(1))), sampled)
        self.captured_shapes = [{"op": "decode", "tokens": 1, "kv_slots": s} for s in self.graphs]


@torch.inference_mode()
def test_decode_token_through_token_graphs_equals_eager_across_requests():
    """``decode_token`` through the token graphs (``DecodeGraph.replay_token``) gives eager ``forward`` +
    ``logits`` + ``sampling.sample``'s tokens and generator draws, request after request, where each sampled
    request changes one setting only (top-k, top-p, temperature: each must rewrite the settings buffers) and
    greedy requests come between (another graph of the shared pool in between)."""
    from bytebound.sampling import SamplingParams, sample
    model = make_model()
    prompt = torch.randint(4, model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    base = dict(temperature=1.5, top_p=1.0, top_k=0)
    k3 = dict(base, top_k=3)
    requests = [SamplingParams(**base), SamplingParams(**k3), SamplingParams(temperature=0.0),     # top-k only
                SamplingParams(**dict(k3, top_p=0.3)), SamplingParams(**k3),                       # top-p only
                SamplingParams(**dict(k3, temperature=0.05)), SamplingParams(**base)]             # T only, all
    graph_r = ModelRunner(model, 64, "cpu", kv_buckets=(32,))
    graph_r.graph = g = CpuTokenGraphs(graph_r)
    eager_r = ModelRunner(model, 64, "cpu", kv_buckets=(32,))
    for i, p in enumerate(requests):
        out = {}
        for name, r in (("graph", graph_r), ("eager", eager_r)):
            r.reset()
            gen = torch.Generator().manual_seed(100 + i)
            tok = sample(model.logits(r.prefill(prompt)[-1:]), p, gen).view(1)
            toks = []
            for _ in range(24):                     # 20 + 24 tokens: crosses the 32-slot span
                if name == "eager":
                    tok = sample(model.logits(r.forward(tok)), p, gen).view(1)
                else:
                    tok, _ = r.decode_token(tok, p, gen)
                    assert tok is g.token_graphs[r.kv_span(r.pos), "greedy" if p.greedy else "sampled"][1]
                toks.append(int(tok))
            out[name] = (toks, float(torch.rand(1, generator=gen)))
        assert out["graph"] == out["eager"], (i, p)
        if not p.greedy:
            assert g._written == (p.temperature, p.top_p, p.top_k)
            assert len(set(out["graph"][0])) > 1 or p.temperature < 0.1, "a constant draw could hide a stale setting"


class _FoldingProj:
    """A bound projection that also offers the input add + norm fold (``add_norm``), as ``TritonLinear.bind``'s
    does on the GPU, here in torch: the norm's own ``add_norm`` then the projection. ``takes`` decides which calls
    it accepts (None for the others, as the GPU binding does); ``calls`` counts the folded ones."""

    def __init__(self, proj, norm, takes):
        self.proj, self.norm, self.takes, self.calls, self.direct = proj, norm, takes, 0, 0

    def __call__(self, x):
        self.direct += 1
        return self.proj(x)

    def add_norm(self, delta, h, weight, eps):
        assert weight is self.norm.weight and eps == self.norm.eps
        if not self.takes(h):
            return None
        self.calls += 1
        x, h2 = self.norm.add_norm(delta, h)
        return self.proj(x), x, h2          # (self.proj: a folded call is not a direct one)


@pytest.mark.parametrize("takes", ["decode", "all"])
def test_input_norm_folds_into_the_attention_projection(quant_ckpt, takes):
    """``DecoderLayer`` with ``fold_input_norm``: the input add + norm goes to the fused projection's ``add_norm``
    (its ``(y, x, h_new)`` feed the attention and the residual stream), and a call it refuses (None) runs the norm
    then the projection. Logits of a prefill and decode steps equal the unfolded model's; the fold is used for
    every layer with a previous delta (not layer 0) on the calls it takes."""
    from bytebound.checkpoint.loader import load_model
    from bytebound.models.bailing_moe_v3 import DecoderLayer
    from bytebound.runner.backends import BackendPlan, bind_model
    model = load_model(quant_ckpt, "cpu")
    bind_model(model, BackendPlan.default("cpu"), "cpu")
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer) and m.attention.proj_fn is not None]
    assert layers and not any(m.attention.fold_input_norm for m in layers)   # CPU binding: no fold
    prompt = torch.randint(4, model.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(3))

    def run():
        r = ModelRunner(model, 64, "cpu")
        h = r.prefill(prompt)
        tok = model.logits(h[-1:]).argmax(-1)
        out = []
        for _ in range(4):
            lg = model.logits(r.forward(tok.view(1)))
            out.append(lg)
            tok = lg.argmax(-1)
        return torch.cat(out)
    with torch.inference_mode():
        plain = run()
        rule = (lambda h: h.shape[-2] <= 4) if takes == "decode" else (lambda h: True)
        folds = []
        for m in layers:
            f = _FoldingProj(m.attention.proj_fn, m.input_layernorm, rule)
            m.attention.proj_fn, m.attention.fold_input_norm = f, True
            folds.append((m, f))
        folded = run()
    torch.testing.assert_close(folded, plain, rtol=1e-5, atol=1e-5)
    for m, f in folds:
        if m.index == model.cfg.num_hidden_layers:       # the NEXTN layer: not run without MTP
            assert f.calls == f.direct == 0
            continue
        # layer 0 has no delta to add (the embedding is h); the others fold every call they take
        want = 0 if m.index == 0 else (4 if takes == "decode" else 5)
        assert f.calls == want, (m.index, f.calls, want)
        assert f.direct == 5 - want, (m.index, f.direct)     # the attention used y, it did not project again
