"""Per-token logprobs (``SamplingParams.logprobs``) from the engine: the tokens are plain decoding's (with MTP too:
a logprobs request does not speculate), and every record is the log-softmax of the raw logits the token was
chosen from, checked against a float64 log-softmax of an independent from-scratch forward of the unbound fp32
model over prompt + output. The server's formats are tested in tests/test_server.py."""

from __future__ import annotations

import random

import pytest
import torch

from bytebound.engine.engine import Engine
from bytebound.sampling import SamplingParams

K = 5
N = 12
# float32 forward through the bound CPU kernels vs the unbound model: logprobs of size ~5 agree to ~1e-5
TOL = 1e-3


def prompts(vocab: int) -> list[list[int]]:
    r = random.Random(1)
    return [[r.randrange(4, vocab) for _ in range(n)] for n in (1, 7, 40)]


@pytest.fixture(scope="module")
def engines(plain_ckpt):
    return Engine(model=str(plain_ckpt), max_model_len=128), \
        Engine(model=str(plain_ckpt), max_model_len=128, speculative_steps=2)


def reference_logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """float64 ``log_softmax`` ``[len(out), V]`` of the logits that predict each of ``out``: one causal forward
    of ``model`` over the whole sequence, no cache."""
    with torch.no_grad():
        h = model(torch.tensor([prompt + out]))[0, len(prompt) - 1:len(prompt) + len(out) - 1]
        return torch.log_softmax(model.logits(h).double(), -1)


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.8, top_p=0.9, seed=7)], ids=["greedy", "sampled"])
def test_records_match_a_float64_recomputation(engines, tiny_model, params):
    plain, _ = engines
    for prompt in prompts(plain.model.cfg.vocab_size):
        base = SamplingParams(max_tokens=N, ignore_eos=True, **params)
        want = plain.generate(prompt, base)[0]
        assert want.logprobs is None
        out = plain.generate(prompt, SamplingParams(max_tokens=N, ignore_eos=True, logprobs=K, **params))[0]
        assert out.token_ids == want.token_ids and len(out.logprobs) == N
        ref = reference_logprobs(tiny_model, prompt, out.token_ids)
        for i, (tok, rec) in enumerate(zip(out.token_ids, out.logprobs)):
            assert rec.token_id == tok and isinstance(rec.logprob, float) and rec.logprob <= 0
            assert abs(rec.logprob - ref[i, tok].item()) < TOL, (i, rec.logprob, ref[i, tok].item())
            ids, lps = zip(*rec.top)
            assert len(rec.top) == K and list(lps) == sorted(lps, reverse=True)
            # raw logprobs: the top list is the float64 reference's top K whatever the temperature / top-p
            assert list(ids) == ref[i].topk(K).indices.tolist()
            assert max(abs(a - b) for a, b in zip(lps, ref[i].topk(K).values.tolist())) < TOL
            if not params:                          # greedy: the chosen token is the most likely one
                assert rec.top[0] == (tok, rec.logprob)


def test_zero_gives_the_chosen_token_only(engines):
    plain, _ = engines
    out = plain.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0))[0]
    assert [r.top for r in out.logprobs] == [()] * 4 and [r.token_id for r in out.logprobs] == out.token_ids


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.8, seed=3)], ids=["greedy", "sampled"])
def test_mtp_engine_does_not_speculate_for_logprobs(engines, params):
    """With a drafter, a logprobs request decodes plainly: plain decoding's tokens (sampled too: the same
    generator draws), plain decoding's records, and no speculation statistics."""
    plain, spec = engines
    for prompt in prompts(plain.model.cfg.vocab_size):
        p = SamplingParams(max_tokens=N, ignore_eos=True, logprobs=2, **params)
        want = plain.generate(prompt, p)[0]
        got = spec.generate(prompt, p)[0]
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs and got.spec is None
        assert spec.generate(prompt, SamplingParams(max_tokens=N, ignore_eos=True, **params))[0].spec["rounds"] > 0


def test_stream_chunks_carry_the_records_of_their_tokens(engines):
    """Each chunk's records are those of its token ids (the final chunk's too); concatenated they are the output's.
    A stop string cuts records with the tokens; an EOS / stop id (never emitted) has none."""
    plain, _ = engines
    prompt = prompts(plain.model.cfg.vocab_size)[1]
    full = plain.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1))[0]
    text = full.text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 2) if text[i:i + 2].strip())
    cases = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1),
             SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1, stop=(stop,)),
             SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1, stop_token_ids=(full.token_ids[9],))]
    for p in cases:
        chunks = list(plain.stream(prompt, p))
        out = chunks[-1].output
        assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
        assert [r for c in chunks for r in c.logprobs] == out.logprobs == full.logprobs[:len(out.token_ids)]
        assert [r.token_id for r in out.logprobs] == out.token_ids
    assert out.finish_reason == "stop" and len(out.token_ids) <= 9
    cut = plain.generate(prompt, cases[1])[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and len(cut.token_ids) < 24
