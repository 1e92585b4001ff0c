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
    params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    out = [i for c in e.stream(PROMPT, params) for i in c.token_ids]
    assert len(out) == n                                        # ran to the end: no cache overflow on the way
    with pytest.raises(RequestError, match="exceeds the engine's max length"):
        next(iter(e.stream(PROMPT, SamplingParams(max_tokens=n + 1, ignore_eos=True, temperature=0.0))))


@pytest.mark.parametrize("steps", [0, 3])
@pytest.mark.parametrize("stop", [(), ("the",), ("\n\n", "=")])
def test_stream_chunks_add_up_to_the_output(steps, stop):
    """Concatenated chunk texts and token ids equal the final output, also while text is held back for stop
    strings and when the request ends on max_tokens (the final chunk carries the last ids)."""
    e = Engine(model=str(NANO), max_model_len=256, speculative_steps=steps)
    for prompt in ("Natalia sold clips to 48 of her friends.", "Question: what is 6 x 7?\nAnswer:"):
        chunks = list(e.stream(prompt, SamplingParams(max_tokens=40, temperature=0.0, stop=stop)))
        out = chunks[-1].output
        assert "".join(c.text for c in chunks) == out.text
        assert [i for c in chunks for i in c.token_ids] == out.token_ids
        assert out.completion_tokens == len(out.token_ids)
