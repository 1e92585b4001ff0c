"""The bundled trained ling-nano checkpoint: loads strictly, fits the size limit, MTP keeps greedy parity on
GSM8K test prompts (the CI subset of scripts/mtp_accept.py) and actually accepts drafts."""

from pathlib import Path

import pytest

NANO = Path(__file__).resolve().parents[1] / "models" / "ling-nano"
pytestmark = pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano not present")


@pytest.fixture(scope="module")
def engines():
    from bytebound.engine.engine import Engine
    return Engine(model=str(NANO)), Engine(model=str(NANO), speculative_steps=3)


def test_size_and_format():
    from bytebound.config import LingConfig
    total = sum(f.stat().st_size for f in NANO.iterdir() if f.is_file())
    assert total <= 30e6, total
    cfg = LingConfig.from_file(NANO)
    assert cfg.quant.method == "fp8" and cfg.quant.routed_experts == "mxfp4"
    assert "lm_head" in cfg.quant.modules_to_not_convert
    assert cfg.num_experts >= 32 and cfg.num_nextn_predict_layers == 1 and cfg.first_k_dense_replace >= 1
    assert len(cfg.mla_layers) >= 2 and len(cfg.kda_layers) >= 2


def test_mtp_greedy_parity_on_gsm8k(engines):
    from bytebound.data.gsm8k import load_split
    from bytebound.sampling import SamplingParams
    plain, spec = engines
    p = SamplingParams(max_tokens=48)
    committed = rounds = 0
    for rec in load_split("test")[:4]:
        a = plain.generate(rec["question"], p, chat=True)[0]
        b = spec.generate(rec["question"], p, chat=True)[0]
        assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
        assert b.completion_tokens == len(b.token_ids)
        committed += b.spec["committed"]
        rounds += b.spec["rounds"]
    assert committed / rounds > 1.5, "a trained NEXTN layer must accept drafts (random weights give ~1.0)"


def test_streamed_text_equals_decoded_ids(engines):
    """The incremental decoder's text equals a full decode of the returned ids; stop strings cut the text."""
    from bytebound.data.gsm8k import load_split
    from bytebound.sampling import SamplingParams
    plain, _ = engines
    tok = plain.tokenizer
    for rec in load_split("test")[:3]:
        o = plain.generate(rec["question"], SamplingParams(max_tokens=60, temperature=0.9, seed=5), chat=True)[0]
        assert o.text == tok.decode(o.token_ids)
        chunks = "".join(c.text for c in plain.stream(rec["question"], SamplingParams(max_tokens=60, temperature=0.9,
                                                                                       seed=5), chat=True))
        assert chunks == o.text
        s = plain.generate(rec["question"], SamplingParams(max_tokens=60, stop=("=",)), chat=True)[0]
        assert "=" not in s.text and tok.decode(s.token_ids).startswith(s.text)


def test_stops_inside_a_speculative_block(engines):
    """Issue 6, stops inside a block: a round commits up to 4 tokens at once, and max_tokens, a stop token id or a
    stop string falling inside it must end the speculative output exactly where plain decoding ends: same ids,
    text, finish reason and usage; the speculative stats count only the tokens kept after the prefill's first."""
    from bytebound.data.gsm8k import load_split
    from bytebound.sampling import SamplingParams
    plain, spec = engines
    q = load_split("test")[1]["question"]
    full = plain.generate(q, SamplingParams(max_tokens=16, ignore_eos=True), chat=True)[0]
    whole = spec.generate(q, SamplingParams(max_tokens=16, ignore_eos=True), chat=True)[0]
    assert whole.token_ids == full.token_ids
    # 16 tokens in at most 11 rounds (+ the prefill's token): rounds commit several tokens, so at least 4 of the
    # 16 cut points below fall strictly inside a round's block
    assert whole.spec["rounds"] <= 11, whole.spec

    def same(p):
        a = plain.generate(q, p, chat=True)[0]
        b = spec.generate(q, p, chat=True)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), p
        assert b.completion_tokens == len(b.token_ids) == a.completion_tokens
        kept_after_prefill = len(b.token_ids) - 1 if b.token_ids else 0
        assert b.spec["committed"] == kept_after_prefill, (p, b.spec)
        return a

    for n in range(1, 17):
        a = same(SamplingParams(max_tokens=n, ignore_eos=True))
        assert a.token_ids == full.token_ids[:n] and a.finish_reason == "length"
    for t in range(2, 14, 3):           # the token at t as an extra stop id: output ends before its first occurrence
        stop_id = full.token_ids[t]
        a = same(SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(stop_id,)))
        assert a.finish_reason == "stop" and a.token_ids == full.token_ids[:full.token_ids.index(stop_id)]
    for c in (3, 9, 20):                # a stop string taken from the text: output cut right before it
        s = full.text[c:c + 3]
        if s.strip():
            a = same(SamplingParams(max_tokens=16, ignore_eos=True, stop=(s,)))
            assert a.finish_reason == "stop" and a.text == full.text[:full.text.find(s)]
