"""What a fresh user's first run (CPU, bundled ling-nano) met: the demo's answer line without context, flags that
did nothing without a word, the help text, ``analyze`` into a file, the CPU ablation's exit status and the
message of a prompt longer than ``--max-model-len``. The runs are short (a few tokens, no compile)."""

from __future__ import annotations

import re

import pytest

from bytebound.cli import main
from conftest import ROOT

NANO = ROOT / "models" / "ling-nano"


# ---- the demo says what its answer line means --------------------------------------------------------------
def test_demo_says_the_bundled_model_is_not_a_maths_model(capsys):
    assert main(["demo", "--no-cpu-compile", "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("answer:"))
    note = lines[i + 1]
    assert "about 2 % of GSM8K" in note and "21 MB" in note and "not the model's quality" in note, note


def test_demo_note_figures_are_the_model_cards():
    """The note quotes the card: 2 % greedy exact match and a 21 MB directory."""
    from bytebound.cli import DEMO_MODEL_NOTE
    card = (NANO / "README.md").read_text()
    assert "**8 / 400 = 2.0 %**" in card and "21.3 MB" in card
    assert "about 2 %" in DEMO_MODEL_NOTE and "21 MB" in DEMO_MODEL_NOTE


def test_demo_of_another_model_has_no_note(nano_ckpt, capsys):
    assert main(["demo", "--model", str(nano_ckpt), "--no-cpu-compile", "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "answer:" in out and "GSM8K test questions correctly" not in out
