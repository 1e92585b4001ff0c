"""GSM8K data helpers and the ling-nano tokenizer (models/ling-nano, written by scripts/train_tokenizer.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bytebound.data.gsm8k import (
    answers_match, chat_messages, clean_solution, extract_answer, few_shot_prompt, format_shot, load_split,
)
from bytebound.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "ling-nano"
SPECIALS = {"<|endoftext|>": 0, "<role>": 1, "</role>": 2, "<|role_end|>": 3}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def splits():
    return load_split("train"), load_split("test")


# ---- answers ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("#### 1,234", "1234"),
    ("She pays 3 * 6 = 18 dollars.\n#### 18", "18"),
    ("The answer is $1,250.", "1250"),
    ("so it costs $18.50.", "18.5"),
    ("The answer is -5.", "-5"),
    ("#### -3", "-3"),
    ("Temperature drops to -12 degrees", "-12"),
    ("He ran 3.75 miles", "3.75"),
    ("5.00", "5"),
    ("0.5 of 1,000,000 people", "1000000"),
    ("#### 72\n\nQuestion: x has 5 #### 9", "72"),
    ("He paid 20 then 30. The answer is 50. Then 7 more", "50"),
    ("ages 3-4", "4"),
    ("10 - 5", "5"),
    ("1, 2, 3", "3"),
    ("no number here", None),
    ("####", None),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_answers_match():
    assert answers_match("1234", "1,234")
    assert answers_match("18.0", "18")
    assert answers_match("-5", "-5")
    assert answers_match("$7", 7)
    assert not answers_match("17", "18")
    assert not answers_match(None, "18")
    assert not answers_match("abc", "18")


def test_load_split(splits):
    train, test = splits
    assert (len(train), len(test)) == (7473, 1319)
    assert train[0]["final"] == "72" and train[0]["question"].startswith("Natalia sold clips")
    assert all("," not in r["final"] and answers_match(r["final"], r["final"]) for r in train + test)
    assert any("," in r["answer"].rsplit("####", 1)[1] for r in train)  # the raw text keeps its commas
    # the reference solutions themselves extract to their own final answer
    assert all(extract_answer(clean_solution(r["answer"])) == r["final"] for r in train + test)
    with pytest.raises(ValueError):
        load_split("validation")


def test_clean_solution_removes_annotations(splits):
    train, _ = splits
    assert clean_solution("Natalia sold 48/2 = <<48/2=24>>24 clips.\n\n#### 24") == "Natalia sold 48/2 = 24 clips.\n#### 24"
    assert all("<<" not in (c := clean_solution(r["answer"])) and "\n\n" not in c for r in train)


# ---- prompts ---------------------------------------------------------------------------------------------------

def test_format_shot_and_explicit_shots():
    shots = [{"question": "Q1?", "answer": "1+1 = <<1+1=2>>2\n#### 2"}, {"question": "Q2?", "answer": "#### 3"}]
    assert format_shot("Q1?", shots[0]["answer"]) == "Question: Q1?\nAnswer: 1+1 = 2\n#### 2"
    assert few_shot_prompt("Q3?", shots=shots) == (
        "Question: Q1?\nAnswer: 1+1 = 2\n#### 2\n\nQuestion: Q2?\nAnswer: #### 3\n\nQuestion: Q3?\nAnswer:"
    )


def test_few_shot_uses_train_only_and_is_deterministic(splits):
    train, test = splits
    train_q = {r["question"] for r in train}
    test_q = {r["question"] for r in test}
    q = test[0]["question"]
    p = few_shot_prompt(q, k=5, seed=0)
    assert p == few_shot_prompt(q, k=5, seed=0)
    assert p != few_shot_prompt(q, k=5, seed=1)
    blocks = p.split("\n\n")
    assert len(blocks) == 6 and blocks[-1] == f"Question: {q}\nAnswer:"
    shot_q = [b.split("\n", 1)[0].removeprefix("Question: ") for b in blocks[:-1]]
    assert all(s in train_q and s not in test_q for s in shot_q)
    # same exemplars for every test question at a fixed seed
    assert few_shot_prompt(test[1]["question"], seed=0).split("\n\n")[:5] == blocks[:5]
    # a train question never gets its own solution as an exemplar
    for seed in range(50):
        own = train[seed]["question"]
        exemplars = few_shot_prompt(own, seed=seed).split("\n\n")[:-1]
        assert len(exemplars) == 5 and all(not e.startswith(f"Question: {own}\n") for e in exemplars)


def test_chat_messages():
    assert chat_messages(" Q? ") == [{"role": "user", "content": "Q?"}]
    assert chat_messages("Q?", "a <<1+1=2>>2\n#### 2", system="S") == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "a 2\n#### 2"},
    ]


# ---- tokenizer -------------------------------------------------------------------------------------------------

def test_tokenizer_metadata(tok):
    assert tok.vocab_size == 6144
    assert {t: tok.token_id(t) for t in SPECIALS} == SPECIALS
    assert tok.eos_token_ids == (3, 0) and tok.eos_token_id == 3
    assert tok.pad_token_id == 0


def test_special_tokens_single_ids(tok):
    for t, i in SPECIALS.items():
        assert tok.encode(t) == [i]
        assert tok.decode([i], skip_special_tokens=False) == t
        assert tok.decode([i]) == ""
    s = "<role>HUMAN</role>Hi there<|role_end|><role>ASSISTANT</role>"
    ids = tok.encode(s)
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(3) == 1
    assert tok.decode(ids, skip_special_tokens=False) == s
    assert tok.decode(ids) == "HUMANHi thereASSISTANT"


def test_round_trip_gsm8k_test_questions(tok, splits):
    _, test = splits
    for r in test:
        for text in (r["question"], r["answer"]):
            assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", [
    "", " ", "\n\n\n", "  two spaces  ", "tab\tcr\r\nlf", "-1,234.50 + 0.001 = 3/4", "x" * 300,
    "naïve café — “quotes” 日本語 😀👍🏽 Ωμέγα", "\u00a0\u200b\ufeff", "\ufffd literal replacement char",
])
def test_round_trip_arbitrary(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_single_tokens(tok):
    pieces = [tok.decode([i]) for i in tok.encode("He has 12345 apples")]
    assert pieces[2:7] == [" 1", "2", "3", "4", "5"]


def test_chat_template_exact(tok):
    msgs = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2+3 = 5\n#### 5"}]
    want = "<role>HUMAN</role>What is 2+3?<|role_end|><role>ASSISTANT</role>2+3 = 5\n#### 5<|role_end|>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == want
    assert tok.apply_chat_template(msgs[:1]) == "<role>HUMAN</role>What is 2+3?<|role_end|><role>ASSISTANT</role>"
    sys_msgs = [{"role": "system", "content": "Be brief."}] + msgs[:1]
    assert tok.apply_chat_template(sys_msgs).startswith("<role>SYSTEM</role>Be brief.<|role_end|><role>HUMAN</role>")
    with pytest.raises(ValueError, match="unsupported role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_streaming_decode_never_splits_characters(tok):
    text = "Ça coûte 5 € — 日本語 😀👍🏽 done\n#### 5"
    ids = tok.encode(text)
    dec = tok.incremental_decoder()
    deltas = [dec.decode_stream(i) for i in ids] + [dec.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    dec = tok.incremental_decoder()
    assert dec.decode_stream(ids[:3]) + dec.decode_stream(ids[3:]) + dec.flush() == text
    # special tokens are skipped by default
    dec = tok.incremental_decoder()
    assert "".join(dec.decode_stream(i) for i in tok.encode("hi<|role_end|>")) == "hi"


def test_from_dir_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(MODEL_DIR / "tokenizer.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(MODEL_DIR / "tokenizer_config.json", tmp_path)
    t = Tokenizer.from_dir(tmp_path)  # generation_config.json is optional
    assert t.eos_token_ids == (3,) and t.pad_token_id == 0


def test_generation_config():
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert gen == {"eos_token_id": [3, 0], "pad_token_id": 0}


def test_matches_transformers(tok, splits):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(MODEL_DIR))
    _, test = splits
    msgs = chat_messages(test[0]["question"])
    strings = [
        test[0]["question"], test[1]["answer"], few_shot_prompt(test[2]["question"]),
        tok.apply_chat_template(msgs), "naïve 日本語 😀 -1,234.50\n\n  x", "<role>HUMAN</role>a<|role_end|>",
    ]
    for s in strings:
        ids = tok.encode(s)
        assert hf.encode(s, add_special_tokens=False) == ids
        assert hf.encode(s) == ids  # no BOS/EOS added
        assert hf.decode(ids, skip_special_tokens=False) == s
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(msgs)
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token, len(hf)) == (3, 0, None, 6144)
    assert hf.model_max_length == 4096


@pytest.mark.slow
def test_train_tokenizer_reproduces_checked_in_files(tmp_path):
    from conftest import load_script
    mod = load_script("train_tokenizer", "train_tokenizer")
    mod.write(mod.build(6144), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (MODEL_DIR / name).read_bytes(), name
