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
