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
    step = StaticRound.step

    def counting_step(self):
        out = step(self)
        seen_j[out[-1]] += 1
        return out
    monkeypatch.setattr(StaticRound, "step", counting_step)
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


def test_static_round_sampling_runs_eagerly(engines):
    _, spec = engines
    out = spec.generate([5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=20, temperature=0.8, seed=3,
                                                                 ignore_eos=True))[0]
    assert len(out.token_ids) == 20
    again = spec.generate([5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=20, temperature=0.8, seed=3,
                                                                   ignore_eos=True))[0]
    assert again.token_ids == out.token_ids                 # seeded: reproducible


def test_capture_needs_cuda_and_greedy(engines):
    _, spec = engines
    with pytest.raises(RuntimeError, match="CUDA"):
        StaticRound(spec.runner, spec.drafter, SamplingParams(), capture=True)


def test_round_body_has_no_host_sync(quant_ckpt, monkeypatch):
    """The round body must never read device data on the host (that is a sync on CUDA, and breaks graph capture):
    run it with the model, state and buffers on the ``meta`` device, where any such read (``.item()``, ``int(t)``,
    indexing with a 0-d tensor, data-dependent shapes) raises. With the CUDA runner's static attention span."""
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
    rnd = StaticRound(runner, MTPDrafter(model, STEPS), SamplingParams())
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
