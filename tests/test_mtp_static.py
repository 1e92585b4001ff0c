"""The MTP round (``bytebound.speculative.round``, static shapes), run uncaptured on CPU: the padded draft-extend
(also after a prompt shorter than k + 1), the on-device KDA rollback and the in-place next-round inputs must give
exactly plain greedy decoding, for every accepted count j = 0..3. On CUDA the same body is replayed from a graph
(tests/gpu)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bytebound.engine.engine import Engine
from bytebound.sampling import SamplingParams
from bytebound.speculative.round import StaticRound
from test_mtp_cpu import STEPS, OracleDrafter, prompts

MAX_NEW = 40
NANO = Path(__file__).resolve().parents[1] / "models" / "ling-nano"
G = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(quant_ckpt):
    plain = Engine(model=str(quant_ckpt), max_model_len=256)
    spec = Engine(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS, spec_static_round=True)
    return plain, spec


@pytest.fixture(scope="module")
def reference(engines):
    plain, _ = engines
    return {tuple(p): plain.generate(p, G)[0].token_ids for p in prompts(plain.model.cfg.vocab_size)}


def test_static_rounds_equal_plain_greedy(engines, reference):
    _, spec = engines
    for p, want in reference.items():
        out = spec.generate(list(p), G)[0]
        assert out.token_ids == want, f"prompt of {len(p)} tokens diverged"
        assert out.spec["committed"] == MAX_NEW - 1 and 1 <= out.spec["rounds"] <= MAX_NEW - 1


@pytest.mark.parametrize("p_wrong", [0.0, 0.25])
def test_static_rounds_commit_every_accepted_count(engines, reference, p_wrong, monkeypatch):
    _, spec = engines
    real = spec.drafter
    vocab = spec.model.cfg.vocab_size
    seen_j = [0] * (STEPS + 1)
    finish = StaticRound._finish        # every round's verdict passes here (step and the pipelined loop alike)

    def counting_finish(self, handle):
        out = finish(self, handle)
        seen_j[out[-1]] += 1
        return out
    monkeypatch.setattr(StaticRound, "_finish", counting_finish)
    try:
        for n, (p, want) in enumerate(reference.items()):
            spec.drafter = OracleDrafter(spec.runner, real, list(p) + want, vocab, p_wrong, seed=n)
            out = spec.generate(list(p), G)[0]
            assert out.token_ids == want, f"prompt of {len(p)} tokens diverged"
            if p_wrong == 0.0:                  # also the 1-token prompt: its first extend is padded
                assert out.spec["accept_length"] > 3.0, f"prompt of {len(p)} tokens"
    finally:
        spec.drafter = real
    if p_wrong == 0.0:
        assert seen_j[STEPS] > 0
    else:
        assert all(c > 0 for c in seen_j), seen_j


@pytest.mark.skipif(not (NANO / "config.json").exists(), reason="bundled ling-nano not present")
def test_rounds_on_the_trained_model_equal_plain_greedy():
    """With the trained NEXTN head drafts are often accepted: the rounds must commit plain greedy's tokens."""
    from bytebound.data.gsm8k import load_split
    qs = [r["question"] for r in load_split("test")[:3]]
    p = SamplingParams(max_tokens=48)
    plain = Engine()
    spec = Engine(speculative_steps=STEPS)
    for q in qs:
        want = plain.generate(q, p, chat=True)[0].token_ids
        b = spec.generate(q, p, chat=True)[0]
        assert b.token_ids == want
        assert b.spec["accept_length"] > 1.2


def test_pipelined_rounds_equal_plain_greedy(quant_ckpt, reference):
    """Pipelined rounds (each launched before the host reads the one before it; the CUDA default, forced here on
    CPU): the round advances the device's committed length itself, so the chained round must emit exactly plain
    greedy's tokens, also when the cache ends right after the request (no round is chained without room), and
    leave the runner with no verify pending."""
    spec = Engine(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS, pipeline_decode=True)
    assert spec.pipelined
    ahead = 0
    for p, want in reference.items():
        out = spec.generate(list(p), G)[0]
        assert out.token_ids == want, f"prompt of {len(p)} tokens diverged"
        assert out.spec["committed"] == MAX_NEW - 1
        assert spec.runner._verify is None      # the round in flight at the end was read and committed
        ahead += out.spec["pipelined_rounds"]
        assert out.spec["pipelined_rounds"] <= out.spec["rounds"]
    assert ahead > 0
    p = list(next(k for k in reference if len(k) == 130))
    n = spec.max_new_tokens(len(p))          # the most this cache allows: the last rounds run unchained
    full = Engine(model=str(quant_ckpt), max_model_len=256)
    assert spec.generate(p, SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids == \
        full.generate(p, SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
def test_pipelined_rounds_on_the_trained_model():
    """On the trained model (drafts often accepted, so every round advances the committed length by a different
    amount): pipelined rounds equal unpipelined ones token for token, greedy and seeded sampling alike."""
    from bytebound.data.gsm8k import load_split
    qs = [r["question"] for r in load_split("test")[:2]]
    seq = Engine(model=str(NANO), max_model_len=512, speculative_steps=STEPS)
    pipe = Engine(model=str(NANO), max_model_len=512, speculative_steps=STEPS, pipeline_decode=True)
    for q in qs:
        for p in (SamplingParams(max_tokens=48), SamplingParams(max_tokens=48, temperature=0.6, top_p=0.95,
                                                                top_k=29, seed=11)):
            a, b = seq.generate(q, p, chat=True)[0], pipe.generate(q, p, chat=True)[0]
            assert b.token_ids == a.token_ids and b.spec["rounds"] == a.spec["rounds"]
            assert b.spec["accept_length"] > 1.2 and b.spec["pipelined_rounds"] > 0


def test_static_round_sampling_runs_eagerly(engines):
    _, spec = engines
    out = spec.generate([5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=20, temperature=0.8, seed=3,
                                                                 ignore_eos=True))[0]
    assert len(out.token_ids) == 20
    again = spec.generate([5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=20, temperature=0.8, seed=3,
                                                                   ignore_eos=True))[0]
    assert again.token_ids == out.token_ids                 # seeded: reproducible


def test_capture_needs_cuda(engines):
    _, spec = engines
    for p in (SamplingParams(), SamplingParams(temperature=0.6, top_p=0.95, top_k=29)):
        with pytest.raises(RuntimeError, match="CUDA"):
            StaticRound(spec.runner, spec.drafter, p, capture=True)


def test_a_round_serves_only_its_kind(engines):
    _, spec = engines
    greedy = StaticRound(spec.runner, spec.drafter, SamplingParams())
    sampled = StaticRound(spec.runner, spec.drafter, SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="greedy MTP round cannot serve a sampling request"):
        greedy.use(SamplingParams(temperature=0.6), torch.Generator())
    with pytest.raises(ValueError, match="sampled MTP round cannot serve a greedy request"):
        sampled.use(SamplingParams(temperature=0.6, top_k=1), None)      # top_k 1 is greedy
    assert greedy.use(SamplingParams(top_k=7), None) is greedy           # temperature 0: greedy
    p = SamplingParams(temperature=0.6, top_p=0.9, top_k=5)
    sampled.use(p, None)
    assert float(sampled.sp.top_p) == pytest.approx(0.9) and int(sampled.sp.top_k) == 5
    assert bool(sampled.sp.top_p_on) and float(sampled.sp.temperature) == pytest.approx(0.6)


SAMPLED = [dict(temperature=0.6, top_p=0.95, top_k=29, seed=1), dict(temperature=1.0, seed=2),
           dict(temperature=0.3, top_k=5, seed=3), dict(temperature=1.5, top_p=0.5, seed=4)]


def _inline_rule(logits, drafts, p, gen):
    """The sampled acceptance as the round ran it before its uniforms moved to buffers: ``probs`` with the
    request's settings, then ``n`` float32 uniforms and one float64 uniform drawn inline from ``gen``, written out
    here on the host (an independent reference of the rule and of its use of the generator)."""
    from bytebound.sampling import probs
    pr = probs(logits, p)
    n = drafts.shape[0]
    u = torch.rand(n, generator=gen)
    j = 0
    while j < n and float(u[j]) < float(pr[j, int(drafts[j])]):
        j += 1
    row = pr[j].clone()
    if j < n:
        row[int(drafts[j])] = 0.0
    cdf = row.double().cumsum(0)
    v = torch.rand(1, 1, generator=gen, dtype=torch.float64)[0] * cdf[-1]
    return torch.tensor(j), torch.searchsorted(cdf, v).clamp(max=row.numel() - 1)[0]


@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
def test_sampled_rounds_equal_the_inline_rule(monkeypatch):
    """The sampled round reads its settings from device buffers (``probs_device``) and its uniforms from a buffer
    that ``step`` fills before the body: for a fixed seed it must emit exactly the tokens of the rule drawing
    inline (:func:`_inline_rule`, the round as it was), on the trained model (drafts often accepted, so both the
    accept tests and the bonus draws matter), over several settings."""
    import bytebound.speculative.round as round_mod
    from bytebound.data.gsm8k import load_split
    spec = Engine(model=str(NANO), max_model_len=256, speculative_steps=STEPS)
    qs = [r["question"] for r in load_split("test")[:2]]
    reqs = [(q, SamplingParams(max_tokens=40, ignore_eos=True, **kw)) for q in qs for kw in SAMPLED]
    got = [spec.generate(q, p, chat=True)[0] for q, p in reqs]
    assert sum(o.spec["committed"] for o in got) > 1.3 * sum(o.spec["rounds"] for o in got), "drafts accepted"
    cur = {}
    launch = StaticRound._launch        # every round's body runs from here (step and the pipelined loop alike)

    def recording_launch(self, chained):
        cur["round"] = self
        return launch(self, chained)
    with monkeypatch.context() as m:
        m.setattr(StaticRound, "_launch", recording_launch)
        m.setattr(round_mod, "chain_uniforms", lambda *a: None)            # nothing drawn ahead
        m.setattr(round_mod, "probs_device", lambda logits, sp: logits)
        m.setattr(round_mod, "accept_sampled",
                  lambda logits, d, u, u_draw: _inline_rule(logits, d, cur["round"].p, cur["round"].gen))
        want = [spec.generate(q, p, chat=True)[0].token_ids for q, p in reqs]
    for (q, p), o, w in zip(reqs, got, want):
        assert o.token_ids == w, (q[:30], p)


def test_one_sampled_round_serves_every_request(engines):
    """The engine's captured sampled round is one object for every sampling request (CUDA): run on CPU uncaptured,
    a single round rewritten per request (settings, generator) gives each request exactly the tokens a fresh round
    of its own gives, in any order, with greedy requests in between."""
    _, spec = engines
    prompt = [5, 6, 7, 8, 9, 10, 11]
    reqs = [SamplingParams(max_tokens=24, ignore_eos=True, **kw) for kw in SAMPLED] + [G]
    fresh = [spec.generate(prompt, p)[0].token_ids for p in reqs]
    shared = StaticRound(spec.runner, spec.drafter, SamplingParams(temperature=1.0))
    spec.spec_round_sampled = shared
    try:
        for i in (4, 0, 3, 1, 4, 2, 0):
            assert spec.generate(prompt, reqs[i])[0].token_ids == fresh[i], reqs[i]
    finally:
        spec.spec_round_sampled = None
    assert shared.last is not None and shared.p == reqs[0]


@pytest.mark.parametrize("p", [SamplingParams(), SamplingParams(temperature=0.6, top_p=0.95, top_k=29)],
                         ids=["greedy", "sampled"])
def test_round_body_has_no_host_sync(quant_ckpt, monkeypatch, p):
    """The round body must never read device data on the host (that is a sync on CUDA, and breaks graph capture):
    run it with the model, state and buffers on the ``meta`` device, where any such read (``.item()``, ``int(t)``,
    indexing with a 0-d tensor, data-dependent shapes) raises. With the CUDA runner's static attention span; the
    greedy and the sampled body (settings and uniforms from buffers)."""
    import bytebound.kernels.torch_ref as torch_ref
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.runner import ModelRunner
    from bytebound.speculative.mtp import MTPDrafter
    monkeypatch.setattr(torch_ref, "MATERIALIZE_MAX_BYTES", 0)      # no bind-time dequantisation (reads data)
    model = Engine(model=str(quant_ckpt), max_model_len=128).model.to("meta")
    bind_model(model, BackendPlan.default("cpu"), torch.device("meta"), "bf16")
    for mod in model.modules():
        if hasattr(mod, "_absorbed"):                             # MLA's cached absorbed weights
            mod.prepare(model.dtype)
    runner = ModelRunner(model, 128, "meta")
    runner.static_kv = True                                       # as on CUDA: attend over all slots, masked
    rnd = StaticRound(runner, MTPDrafter(model, STEPS), p)
    runner.reset(1)
    runner.begin_verify(STEPS)                                    # host side of a round: room, pos_buf
    with torch.inference_mode():
        rnd._body(rnd.span())                                     # raises on any host read
    assert rnd.out.device.type == "meta"


def test_long_prompt_draft_extend_in_chunks(engines, monkeypatch):
    """Prompts longer than the prefill chunk: the NEXTN's first pass over the prompt runs in chunks and the rounds
    still equal plain greedy. The chunk is shrunk to 16 tokens to exercise it."""
    import bytebound.runner.runner as runner_mod
    plain, spec = engines
    monkeypatch.setattr(runner_mod, "PREFILL_CHUNK", 16)
    for n in (16, 17, 40, 97):
        p = list(range(4, 4 + n))
        want = plain.generate(p, G)[0].token_ids
        assert spec.generate(p, G)[0].token_ids == want, f"prompt of {n}"



def test_nextn_prompt_pass_precedes_the_first_token(engines, monkeypatch):
    """The NEXTN pass over the prompt is prefill work (as SGLang's and vLLM's draft extend): it runs before the
    first token leaves the token source, so TTFT holds it and the decode time does not. Spied on through
    ``nextn_prefix``: by the time the stream yields its first chunk, the pass over all but the last k + 1 prompt
    positions has run (and it runs once per request)."""
    import bytebound.speculative.round as round_mod
    _, spec = engines
    calls = []
    real = round_mod.nextn_prefix

    def spy(drafter, ids, hid, positions, state):
        calls.append(ids.shape[0])
        return real(drafter, ids, hid, positions, state)
    monkeypatch.setattr(round_mod, "nextn_prefix", spy)
    prompt = list(range(4, 4 + 30))
    stream = spec.stream(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    first = next(stream)
    assert first.token_ids and calls == [30 - (STEPS + 1)], calls
    rest = list(stream)
    assert calls == [30 - (STEPS + 1)] and rest[-1].output.completion_tokens == 8


@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
def test_static_rounds_with_per_span_attention(monkeypatch):
    """The CUDA path's static attention spans (runner.kv_buckets; one captured round per span on the GPU), run
    eagerly on CPU with the trained model: every round attends over the smallest bucket that holds its verify's
    last slot, and the output is plain greedy, also for rounds that cross a bucket boundary."""
    from bytebound.data.gsm8k import load_split
    from bytebound.runner.runner import ModelRunner
    plain = Engine(model=str(NANO), max_model_len=256)
    spec = Engine(model=str(NANO), max_model_len=256, speculative_steps=STEPS, spec_static_round=True)
    runner = ModelRunner(spec.model, 256, "cpu", kv_buckets=(64, 128))
    runner.static_kv = True
    seen = []
    span = StaticRound.span

    def checked(self):
        s = span(self)
        assert s >= self.r.pos + self.k + 1, f"span {s} misses the verify's last slot {self.r.pos + self.k}"
        seen.append(s)
        return s
    monkeypatch.setattr(StaticRound, "span", checked)
    monkeypatch.setattr(spec, "runner", runner)
    p = SamplingParams(max_tokens=60, ignore_eos=True)
    for r in load_split("test")[:3]:
        want = plain.generate(r["question"], p, chat=True)[0].token_ids
        assert spec.generate(r["question"], p, chat=True)[0].token_ids == want
    assert {64, 128} <= set(seen), f"spans used: {sorted(set(seen))}"
