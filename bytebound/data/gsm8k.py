"""GSM8K (Cobbe et al. 2021, MIT; copy in ``bytebound/assets/gsm8k/``): splits, prompt formats, answer checks.

Text conventions (one place, shared by tokenizer training, model training and the benchmark):

* Calculator annotations ``<<48/2=24>>`` are **removed** from every solution (``"48/2 = <<48/2=24>>24"`` becomes
  ``"48/2 = 24"``), and blank lines inside a solution are collapsed, so a solution never contains ``"\\n\\n"``.
  The final ``#### N`` line is kept as written (``#### 1,600`` keeps its comma).
* One exemplar (``format_shot``) is ``"Question: {q}\\nAnswer: {solution}"``; exemplars are joined by ``"\\n\\n"``
  and the prompt ends with ``"Question: {question}\\nAnswer:"``. The model's completion starts with a space and
  ends after its ``#### N`` line; stop at ``FEW_SHOT_STOP``.
* The chat form is one user turn holding the bare question; the assistant turn is the cleaned solution.
* Exemplars always come from the train split.
"""

from __future__ import annotations

import json
import random
import re
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "gsm8k"
SPLITS = ("train", "test")
FEW_SHOT_SEP = "\n\n"
FEW_SHOT_STOP = ("\n\n", "Question:")  # stop strings for a few-shot completion

_ANNOTATION = re.compile(r"<<[^<>]*>>")
_BLANK_LINES = re.compile(r"\n\s*\n")
# A number: optional sign and "$", then either comma-grouped thousands or plain digits, then an optional fraction.
# A trailing "." (end of sentence) is not part of it, since a fraction needs digits after the dot.
_NUMBER = re.compile(r"(?<![\d.])(-)?\$?(-)?(\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)(\.\d+)?")
_MARKERS = (re.compile(r"####"), re.compile(r"[Tt]he (?:final )?answer is"))


@lru_cache(maxsize=None)
def _read(name: str) -> tuple[tuple[str, str], ...]:
    path = ASSET_DIR / f"{name}.jsonl"
    with open(path, encoding="utf-8") as f:
        return tuple((r["question"], r["answer"]) for r in map(json.loads, f))


def load_split(name: str) -> list[dict]:
    """Load a GSM8K split (``"train"`` or ``"test"``) in file order.

    Each record is ``{"idx", "question", "answer", "final"}``: ``answer`` is the raw reference solution
    (annotations included, see :func:`clean_solution`), ``final`` the text after ``####`` with commas stripped
    (e.g. ``"1600"``). A fresh list is returned on every call, so callers may mutate it.
    """
    if name not in SPLITS:
        raise ValueError(f"unknown GSM8K split {name!r} (expected one of {SPLITS})")
    return [
        {"idx": i, "question": q, "answer": a, "final": a.rsplit("####", 1)[1].strip().replace(",", "")}
        for i, (q, a) in enumerate(_read(name))
    ]


def clean_solution(answer: str) -> str:
    """Remove ``<<expr=result>>`` calculator annotations and blank lines from a reference solution."""
    text = _ANNOTATION.sub("", answer)
    text = _BLANK_LINES.sub("\n", text)
    return text.strip()


def _canonical(sign: str | None, sign2: str | None, digits: str, frac: str | None) -> str:
    frac = (frac or "").rstrip("0").rstrip(".")
    neg = bool(sign) != bool(sign2)  # "-$-5" would be positive; harmless
    out = digits.replace(",", "").lstrip("0") or "0"
    out += frac
    return "-" + out if neg and out.strip("0.") else out


def _numbers(text: str) -> list[str]:
    out = []
    for m in _NUMBER.finditer(text):
        sign = m.group(1)
        # "3-4" is a range or a subtraction, not a negative four.
        if sign and m.start() > 0 and (text[m.start() - 1].isalnum() or text[m.start() - 1] in ")"):
            sign = None
        out.append(_canonical(sign, m.group(2), m.group(3), m.group(4)))
    return out


def extract_answer(text: str) -> str | None:
    """The final numeric answer of a model completion, as a canonical string (``"-1234.5"``), or ``None``.

    The first number after the first ``####`` wins, else the first number after ``The answer is``, else the
    last number anywhere in the text. Commas in thousands groups and ``$`` are dropped, a sentence-final ``.``
    is ignored, trailing fraction zeros are dropped (``"5.00"`` -> ``"5"``), ``-`` directly after a word or
    digit is not read as a sign (``"3-4"`` -> ``"4"``).
    """
    for marker in _MARKERS:
        m = marker.search(text)
        if m:
            nums = _numbers(text[m.end():])
            if nums:
                return nums[0]
    nums = _numbers(text)
    return nums[-1] if nums else None


def _to_decimal(x: str | int | float | None) -> Decimal | None:
    if x is None:
        return None
    s = str(x).strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    return d if d.is_finite() else None


def answers_match(pred: str | None, gold: str | int | float) -> bool:
    """Whether a predicted answer equals the gold answer numerically (``"1,600"`` == ``"1600.0"``); ``None`` never matches."""
    p, g = _to_decimal(pred), _to_decimal(gold)
    return p is not None and g is not None and p == g


def format_shot(question: str, answer: str) -> str:
    """One exemplar, ``"Question: {question}\\nAnswer: {clean solution}"`` (``answer`` may be raw or already clean)."""
    return f"Question: {question.strip()}\nAnswer: {clean_solution(answer)}"


def few_shot_prompt(question: str, k: int = 5, seed: int = 0, shots: list[dict] | None = None) -> str:
    """The plain-text k-shot prompt for ``question``; the completion is ``" " + clean solution``.

    Exemplars are ``shots`` (records with ``question``/``answer``) if given, else ``k`` records drawn from the
    train split by ``random.Random(seed)``, skipping ``question`` itself so a train example never sees its own
    solution. Same arguments, same prompt. Layout: ``shot_1 + "\\n\\n" + ... + shot_k + "\\n\\n" +
    "Question: {question}\\nAnswer:"``.
    """
    if shots is None:
        train = _read("train")
        order = random.Random(seed).sample(range(len(train)), min(k + 1, len(train)))
        target = question.strip()
        shots = [{"question": train[i][0], "answer": train[i][1]} for i in order if train[i][0].strip() != target][:k]
    parts = [format_shot(s["question"], s["answer"]) for s in shots]
    parts.append(f"Question: {question.strip()}\nAnswer:")
    return FEW_SHOT_SEP.join(parts)


def chat_messages(question: str, answer: str | None = None, system: str | None = None) -> list[dict]:
    """Messages for the chat form: an optional system turn, the question as the user turn, and, when ``answer``
    is given (training text), the clean solution as the assistant turn."""
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": question.strip()})
    if answer is not None:
        msgs.append({"role": "assistant", "content": clean_solution(answer)})
    return msgs
