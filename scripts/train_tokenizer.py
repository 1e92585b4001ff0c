"""Train the ling-nano byte-level BPE tokenizer on GSM8K train (chat form + 5-shot form) and write HF tokenizer files.

    .venv/bin/python scripts/train_tokenizer.py [--out models/ling-nano] [--vocab-size 6144]

Only the train split is read for training text (the test split is only used afterwards for the round-trip check and
the length report). The output is deterministic: rerunning writes byte-identical files.

Pre-tokenization splits every digit into its own piece (a leading space may stay attached to the first digit), so
numbers are spelled digit by digit, which is easier for a tiny model to do arithmetic with; words, punctuation runs
and whitespace are split GPT-2 style. Bytes map to the 256-symbol byte-level alphabet, all of which is in the
vocabulary, so any string round-trips exactly and there is no unknown token.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from bytebound.data.gsm8k import chat_messages, clean_solution, few_shot_prompt, load_split  # noqa: E402
from bytebound.engine.tokenizer import Tokenizer as EngineTokenizer, render_chat_template  # noqa: E402

PAD, ROLE_OPEN, ROLE_CLOSE, EOS = "<|endoftext|>", "<role>", "</role>", "<|role_end|>"
SPECIAL_TOKENS = [PAD, ROLE_OPEN, ROLE_CLOSE, EOS]  # ids 0..3, in this order
SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Ling-style chat template: <role>ROLE</role>{content}<|role_end|> per turn, roles SYSTEM / HUMAN / ASSISTANT.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<role>SYSTEM</role>"
    "{% elif message['role'] == 'user' %}<role>HUMAN</role>"
    "{% elif message['role'] == 'assistant' %}<role>ASSISTANT</role>"
    "{% else %}{{ raise_exception('unsupported role: ' ~ message['role']) }}"
    "{% endif %}"
    "{{ message['content'] }}<|role_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}"
)
MODEL_MAX_LENGTH = 4096
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def corpus(train: list[dict]):
    """Training text: each train example once in chat form and once as a 5-shot document (prompt + solution).

    Special-token strings are cut out of the chat text so BPE never spends merges on their characters.
    """
    for rec in train:
        chat = render_chat_template(CHAT_TEMPLATE, chat_messages(rec["question"], rec["answer"]), False)
        yield from (p for p in _SPECIAL_RE.split(chat) if p)
        yield few_shot_prompt(rec["question"], k=5, seed=rec["idx"]) + " " + clean_solution(rec["answer"])


def build(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE on the GSM8K train split."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    train = load_split("train")
    tok.train_from_iterator(corpus(train), trainer=trainer, length=2 * len(train))
    return tok


def added_token(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}


def write(tok: Tokenizer, out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json."""
    out.mkdir(parents=True, exist_ok=True)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert [ids[t] for t in SPECIAL_TOKENS] == [0, 1, 2, 3], ids
    tok.save(str(out / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(ids[t]): added_token(t) for t in SPECIAL_TOKENS},
        "additional_special_tokens": [ROLE_OPEN, ROLE_CLOSE],
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "additional_special_tokens": [ROLE_OPEN, ROLE_CLOSE],
        "eos_token": EOS,
        "pad_token": PAD,
    }
    gen = {"eos_token_id": [ids[EOS], ids[PAD]], "pad_token_id": ids[PAD]}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map), ("generation_config.json", gen)):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


ROUND_TRIP = [
    "", " ", "\n", "  leading and trailing  ", "a\n\nb\r\n\tc", "1,234.50 -7 0.001 3/4 48/2=24 $18",
    "naïve café — “quotes” 日本語の文章 😀👍🏽 Ωμέγα", "\u00a0nbsp\u200bzwsp", "<role>HUMAN</role>hi<|role_end|>",
]


def check(out: Path) -> None:
    """Round-trip, special-token and length checks on the written files; prints the report numbers."""
    tk = EngineTokenizer.from_dir(out)
    test, train = load_split("test"), load_split("train")
    texts = ROUND_TRIP + [r["question"] for r in test] + [r["answer"] for r in test]
    bad = [t for t in texts if tk.decode(tk.encode(t), skip_special_tokens=False) != t]
    assert not bad, f"round trip failed for {bad[:3]!r}"
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tk.encode(t) == [i] and tk.decode([i], skip_special_tokens=False) == t, t
    chat = [len(tk.encode(tk.apply_chat_template(chat_messages(r["question"], r["answer"]), False))) for r in train]
    shot_train = [len(tk.encode(few_shot_prompt(r["question"], seed=r["idx"]) + " " + clean_solution(r["answer"]))) for r in train]
    shot_test = [len(tk.encode(few_shot_prompt(r["question"]))) for r in test]
    print(f"vocab_size {tk.vocab_size}  special ids { {t: tk.token_id(t) for t in SPECIAL_TOKENS} }  eos {tk.eos_token_ids}  pad {tk.pad_token_id}")
    print(f"train chat example: mean {statistics.mean(chat):.1f} tokens, max {max(chat)}")
    print(f"train 5-shot document (seed=idx, prompt+solution): mean {statistics.mean(shot_train):.1f}, max {max(shot_train)}")
    print(f"test 5-shot prompt (seed=0): mean {statistics.mean(shot_test):.1f}, max {max(shot_test)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "ling-nano")
    ap.add_argument("--vocab-size", type=int, default=6144)
    args = ap.parse_args()
    if not 4096 <= args.vocab_size <= 8192:
        ap.error("--vocab-size must be within 4096..8192")
    tok = build(args.vocab_size)
    assert tok.get_vocab_size() == args.vocab_size, tok.get_vocab_size()
    write(tok, args.out)
    print(f"wrote {args.out}")
    check(args.out)


if __name__ == "__main__":
    main()
