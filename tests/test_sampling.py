"""SamplingParams validation, the target distribution ``probs`` (temperature -> top-k -> top-p) against hand
computations, the sampler, and the engine's request handling (stop ids, max_tokens, streaming)."""

from __future__ import annotations

import math

import pytest
import torch

from bytebound.errors import RequestError
from bytebound.sampling import (MAX_TOKENS_LIMIT, SamplingBuffers, SamplingParams, draw, inverse_cdf, make_generator,
                                probs, probs_device, sample)

P5 = [0.4, 0.3, 0.15, 0.1, 0.05]
LOGITS5 = torch.tensor(P5).log()


# ---- validation ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"), (dict(max_tokens=MAX_TOKENS_LIMIT + 1), "max_tokens"),
    (dict(max_tokens="8"), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=100.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_p=-0.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.0), "top_k"),
    (dict(stop=[""]), "stop"), (dict(stop=[1]), "stop"), (dict(stop=[f"s{i}" for i in range(17)]), "16 stop"),
    (dict(logprobs=-1), "logprobs"), (dict(logprobs=21), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(logprobs=False), "logprobs"), (dict(logprobs=2.0), "logprobs"), (dict(logprobs="5"), "logprobs"),
])
def test_invalid_params_raise_request_error(kw, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kw)


def test_request_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(top_p=2)


def test_valid_params_and_normalisation():
    p = SamplingParams(max_tokens=MAX_TOKENS_LIMIT, temperature=100, top_p=1.0, top_k=-1, stop="###",
                       stop_token_ids=[5, 6])
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6)
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams().greedy and SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert [SamplingParams(logprobs=k).logprobs for k in (None, 0, 20)] == [None, 0, 20]


# ---- probs: temperature -> softmax -> top-k renorm -> top-p renorm -----------------------------------------
def hand(p):
    return torch.tensor(p, dtype=torch.float32)


@pytest.mark.parametrize("kw, want", [
    (dict(temperature=1.0), P5),
    (dict(temperature=1.0, top_k=2), [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]),
    (dict(temperature=1.0, top_k=5), P5),                       # k == V: no filter
    (dict(temperature=1.0, top_k=9), P5),                       # k > V: no filter
    (dict(temperature=1.0, top_k=-1), P5),
    # top-p keeps tokens while the mass *before* them is below top_p: 0, .4, .7 < .75 -> three tokens
    (dict(temperature=1.0, top_p=0.75), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]),
    (dict(temperature=1.0, top_p=0.6), [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]),
    (dict(temperature=1.0, top_p=0.3), [1.0, 0, 0, 0, 0]),     # the top token always stays
    (dict(temperature=1.0, top_p=0.96), [0.4, 0.3, 0.15, 0.1, 0.05]),
    # top-k first (renormalised: .4/.85, .3/.85, .15/.85 = .47, .35, .18), then top-p .5 on that: two tokens
    (dict(temperature=1.0, top_k=3, top_p=0.5), [4 / 7, 3 / 7, 0, 0, 0]),
])
def test_probs_hand_computed(kw, want):
    got = probs(LOGITS5, SamplingParams(**kw))
    assert got.dtype == torch.float32
    assert torch.allclose(got, hand(want), atol=1e-6), got


def test_probs_temperature():
    for t in (0.5, 2.0):
        w = torch.tensor(P5, dtype=torch.float64) ** (1 / t)
        got = probs(LOGITS5, SamplingParams(temperature=t))
        assert torch.allclose(got.double(), w / w.sum(), atol=1e-6)
    # temperature is applied before top-p: at T=2 the distribution is flatter, so top_p .75 keeps more tokens
    assert (probs(LOGITS5, SamplingParams(temperature=2.0, top_p=0.75)) > 0).sum() == 4
    assert (probs(LOGITS5, SamplingParams(temperature=1.0, top_p=0.75)) > 0).sum() == 3


def test_probs_top_k_ties_kept():
    # ties at the k-th value are all kept (threshold semantics, as flashinfer's top_k_renorm_probs)
    got = probs(torch.tensor([2.0, 1.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))
    e = torch.tensor([math.e ** 2, math.e, math.e, 0.0])
    assert torch.allclose(got, e / e.sum(), atol=1e-6)


def test_probs_batched_rows_independent():
    x = torch.stack([LOGITS5, LOGITS5.flip(0)])
    got = probs(x, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(got[0], hand([4 / 7, 3 / 7, 0, 0, 0]), atol=1e-6)
    assert torch.allclose(got[1], hand([0, 0, 0, 3 / 7, 4 / 7]), atol=1e-6)


# ---- sample ----------------------------------------------------------------------------------------------
def test_greedy_is_argmax():
    x = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(x, SamplingParams(), None), x.argmax(-1))
    assert torch.equal(sample(x, SamplingParams(temperature=0.8, top_k=1), None), x.argmax(-1))
    assert make_generator(SamplingParams(), "cpu") is None


def test_seeded_sampling_reproducible_and_filtered():
    p = SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=123)
    x = LOGITS5.expand(4000, 5)
    a = sample(x, p, make_generator(p, "cpu"))
    b = sample(x, p, make_generator(p, "cpu"))
    c = sample(x, p, make_generator(SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=124), "cpu"))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert set(a.tolist()) == {0, 1, 2}                          # top-k 3 then top-p .9: tokens 3, 4 never
    freq = torch.bincount(a, minlength=5).double() / 4000
    want = probs(LOGITS5, p).double()
    assert (freq - want).abs().max() < 0.03                      # ~4 sigma at n=4000


# ---- engine request handling -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(nano_ckpt):
    from bytebound.engine.engine import Engine
    return Engine(model=str(nano_ckpt), max_model_len=64)


PROMPT = "Natalia sold clips to 48 of her friends"


def test_engine_request_errors(engine):
    with pytest.raises(RequestError, match="empty prompt"):
        engine.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="exceeds"):
        engine.generate(PROMPT, SamplingParams(max_tokens=60))


def test_engine_stop_ids(engine):
    assert engine.stop_ids(SamplingParams()) == {3, 0}            # config eos 3 + generation_config [3, 0]
    assert engine.stop_ids(SamplingParams(stop_token_ids=[7])) == {3, 0, 7}
    assert engine.stop_ids(SamplingParams(ignore_eos=True, stop_token_ids=[7])) == {7}


def test_engine_max_tokens_and_stop_token(engine):
    out = engine.generate(PROMPT, SamplingParams(max_tokens=12))[0]
    assert out.finish_reason == "length" and out.completion_tokens == 12 == len(out.token_ids)
    assert out.prompt_tokens == len(engine.tokenizer.encode(PROMPT))
    assert out.text == engine.tokenizer.decode(out.token_ids)
    # pick a token whose first occurrence is at index >= 2 and stop on it: output ends right before it
    i = next(i for i in range(2, 12) if out.token_ids[i] not in out.token_ids[:i])
    stop = engine.generate(PROMPT, SamplingParams(max_tokens=12, stop_token_ids=[out.token_ids[i]]))[0]
    assert stop.finish_reason == "stop" and stop.token_ids == out.token_ids[:i]


def test_engine_stream_concatenates_to_output(engine):
    chunks = list(engine.stream(PROMPT, SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=3)))
    final = chunks[-1]
    assert final.output is not None and final.finish_reason == "length"
    assert "".join(c.text for c in chunks) == final.output.text
    assert all(c.output is None for c in chunks[:-1])
    again = engine.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=3))[0]
    assert again.token_ids == final.output.token_ids


def test_engine_token_id_prompt(engine):
    ids = engine.tokenizer.encode(PROMPT)
    a = engine.generate(ids, SamplingParams(max_tokens=5))[0]
    b = engine.generate(PROMPT, SamplingParams(max_tokens=5))[0]
    assert a.token_ids == b.token_ids


def test_tiny_top_p_keeps_the_most_likely_token():
    """top_p below float32's range (1e-300 rounds to 0) still keeps the top-1 token instead of a NaN distribution."""
    from bytebound.sampling import probs, sample
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0]])
    for tp in (1e-300, 5e-324, 1e-46, 1e-3):
        p = SamplingParams(temperature=1.0, top_p=tp)
        pr = probs(logits, p)
        assert torch.isfinite(pr).all() and pr[0, 1] == 1.0, (tp, pr)
        assert int(sample(logits, p, torch.Generator().manual_seed(0))[0]) == 1


# ---- probs_device: probs with the settings in device tensors (the captured sampled MTP round) ---------------
V_DEV = 257


def _logit_sets():
    g = torch.Generator().manual_seed(0)
    return {"normal": torch.randn(4, V_DEV, generator=g) * 3,
            # quarter-steps: many exactly tied probabilities, at the k-th value and at the top-p cut
            "ties": (torch.randn(4, V_DEV, generator=g) * 4).round() / 4,
            "flat": torch.zeros(4, V_DEV),
            "peaked": torch.randn(4, V_DEV, generator=g) * 40}


@pytest.mark.parametrize("name", ["normal", "ties", "flat", "peaked"])
def test_probs_device_equals_probs_bit_for_bit(name):
    """Every setting through one buffer set, rewritten per setting as a captured round's is per request: the same
    float32 bits as ``probs``, filters off (top_k 0 / -1 / >= V, top_p 1), on, at their edges (top_k 1 and V - 1,
    top_p below float32's range or one ulp under 1 in float64), temperature 0 (clamped), tiny and large."""
    x = _logit_sets()[name]
    b = SamplingBuffers("cpu")
    n_on = 0
    for t in (0.0, 1e-7, 0.05, 0.6, 1.0, 3.0, 100.0):
        for k in (0, -1, 1, 2, 29, V_DEV - 1, V_DEV, V_DEV + 5):
            for tp in (1.0, 0.95, 0.5, 0.3, 1e-300, 1 - 2 ** -40):
                p = SamplingParams(temperature=t, top_k=k, top_p=tp)
                b.write(p)
                want = probs(x, p)
                got = probs_device(x, b)
                assert got.dtype == torch.float32 and torch.equal(got, want), (name, t, k, tp)
                n_on += int((want == 0).any())
    assert n_on > 0, "the settings must actually filter"


def test_probs_device_one_row_and_fresh_buffers():
    x = _logit_sets()["ties"][0]                                       # [V]: no batch dimension
    for p in (SamplingParams(temperature=0.6, top_p=0.95, top_k=29), SamplingParams(temperature=2.0, top_k=3)):
        assert torch.equal(probs_device(x, SamplingBuffers("cpu", p)), probs(x, p))


def test_probs_device_differs_when_a_filter_differs():
    """The buffers are read: the same logits under a different top-k / top-p / temperature give other bits."""
    x = _logit_sets()["normal"]
    base = SamplingParams(temperature=0.6, top_p=0.95, top_k=29)
    ref = probs_device(x, SamplingBuffers("cpu", base))
    for kw in (dict(top_k=28), dict(top_p=0.9), dict(temperature=0.7)):
        other = SamplingParams(**{**dict(temperature=0.6, top_p=0.95, top_k=29), **kw})
        assert not torch.equal(probs_device(x, SamplingBuffers("cpu", other)), ref), kw


def test_inverse_cdf_is_draw_with_its_uniforms():
    """``draw`` = ``inverse_cdf`` on the one float64 uniform per row it draws; and the inverse CDF picks the first
    index whose cumulative mass reaches u * total (hand-checked rows, unnormalised)."""
    pr = probs(_logit_sets()["normal"], SamplingParams(temperature=1.0, top_k=40))
    a = draw(pr, torch.Generator().manual_seed(9))
    u = torch.rand(4, 1, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    assert torch.equal(inverse_cdf(pr, u), a)
    row = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0])                     # cdf 0, 2, 2, 3, 4
    got = [int(inverse_cdf(row, torch.tensor([[v]], dtype=torch.float64))) for v in (0.1, 0.49, 0.5, 0.51, 0.76, 0.999)]
    assert got == [1, 1, 1, 3, 4, 4]
