"""The engine's context bound is exact: the longest request it accepts runs to the end, one token more is refused
with a named error before anything runs (plain decoding and MTP; the bundled ling-nano on CPU)."""

import pytest

from bytebound.engine.engine import Engine
from bytebound.errors import RequestError
from bytebound.sampling import SamplingParams

from tests.conftest import NANO_TOKENIZER as NANO

PROMPT = list(range(100, 120))          # 20 tokens
MAX_LEN = 40


@pytest.mark.parametrize("steps,static", [(0, False), (1, False), (3, False), (3, True)],
                         ids=["plain", "mtp1", "mtp3", "mtp3-static-round"])
def test_longest_accepted_request_fits_and_one_more_is_refused(steps, static):
    e = Engine(model=str(NANO), max_model_len=MAX_LEN, speculative_steps=steps,
               **({"spec_static_round": True} if static else {}))
    n = e.max_new_tokens(len(PROMPT))
    assert n == MAX_LEN - len(PROMPT) + 1 - steps
    full = list(range(100, 100 + MAX_LEN))     # a prompt that fills the cache may still ask for the prefill's token
    assert e.max_new_tokens(len(full)) == 1 and e.max_new_tokens(len(full) + 1) <= 0
    assert len(e.generate(full, SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids) == 1
    params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    out = [i for c in e.stream(PROMPT, params) for i in c.token_ids]
    assert len(out) == n                                        # ran to the end: no cache overflow on the way
    with pytest.raises(RequestError, match="exceeds the engine's max length"):
        next(iter(e.stream(PROMPT, SamplingParams(max_tokens=n + 1, ignore_eos=True, temperature=0.0))))


@pytest.mark.parametrize("steps", [0, 3])
@pytest.mark.parametrize("stop", [(), ("the",), ("\n\n", "=")])
def test_stream_chunks_add_up_to_the_output(steps, stop):
    """Concatenated chunk texts and token ids equal the final output, also while text is held back for stop
    strings and when the request ends on max_tokens (the final chunk carries the last ids); every chunk carries the
    request's time to first token."""
    e = Engine(model=str(NANO), max_model_len=256, speculative_steps=steps)
    for prompt in ("Natalia sold clips to 48 of her friends.", "Question: what is 6 x 7?\nAnswer:"):
        chunks = list(e.stream(prompt, SamplingParams(max_tokens=40, temperature=0.0, stop=stop)))
        out = chunks[-1].output
        assert "".join(c.text for c in chunks) == out.text
        assert [i for c in chunks for i in c.token_ids] == out.token_ids
        assert out.completion_tokens == len(out.token_ids)
        # every chunk after the first token carries the request's TTFT, the final output's own figure (the
        # server counts a cancelled request's TTFT from it)
        assert all(c.ttft_s == out.ttft_s for c in chunks if c.ttft_s is not None) and chunks[-1].ttft_s == out.ttft_s
        assert all(c.ttft_s is not None for c in chunks[:-1])


def _scripted(e, seq):
    """Make ``e`` generate exactly ``seq`` (token ids) whatever the prompt: the stream logic under test."""
    e._tokens = lambda ids, p, gen, stats, records=None: ((t, 0) for t in seq)


@pytest.fixture(scope="module")
def plain():
    return Engine(model=str(NANO), max_model_len=256)


def test_stop_string_completed_by_the_final_flush_is_cut(plain):
    """The output ends inside a UTF-8 character (its text is flushed as U+FFFD at the end): a stop string that
    the flushed text completes still cuts the output."""
    tok = plain.tokenizer
    unfinished = next(i for i in range(tok.vocab_size) if tok.decode([i]).endswith("\ufffd") and tok.decode([i])[0] == " ")
    seq = tok.encode("The answer is") + [unfinished]
    for params in (SamplingParams(max_tokens=len(seq), stop=("is ",), temperature=0.0),
                   SamplingParams(max_tokens=50, stop=("is ",), temperature=0.0, stop_token_ids=[7]),):
        _scripted(plain, seq + [7])
        chunks = list(plain.stream([5], params))
        out = chunks[-1].output
        assert "is " not in out.text and out.text == "The answer ", out
        assert out.finish_reason == "stop"
        assert [i for c in chunks for i in c.token_ids] == out.token_ids
        # the ids are the shortest prefix that covers the text (the stop starts inside the last one's text)
        assert tok.decode(out.token_ids).startswith(out.text)
        assert not tok.decode(out.token_ids[:-1]).startswith(out.text)


def test_ids_never_run_ahead_of_the_text(plain):
    """A token whose bytes end inside a character goes out with the chunk that completes its text, not before;
    and after a stop-string cut the ids still decode to the returned text (a character split over two tokens)."""
    tok = plain.tokenizer
    e2, rest = tok.tok.token_to_id(chr(0xE2)), None
    rest = next(i for i in range(tok.vocab_size) if tok.decode([e2, i]) == "\u20ac")          # E2 + 82 AC = the euro sign
    seq = tok.encode("Cost ") + [e2, rest] + tok.encode("5 END")
    _scripted(plain, seq)
    chunks = list(plain.stream([5], SamplingParams(max_tokens=20, stop=("5",), temperature=0.0)))
    out = chunks[-1].output
    assert out.text == "Cost \u20ac" and tok.decode(out.token_ids) == out.text, out
    ids, text = [], ""
    for c in chunks:
        ids += c.token_ids
        text += c.text
        assert text.startswith(tok.decode(ids)), (ids, text)
