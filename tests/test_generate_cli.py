"""``bytebound generate`` end to end through the real CLI (``python -m bytebound.cli``) on a writer-made
quantised checkpoint with the ling-nano tokenizer: determinism with a seed, stop strings, max_tokens, EOS."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from bytebound.sampling import SamplingParams
from conftest import ROOT

PROMPT = "Janet's ducks lay 16 eggs per day."
SAMPLED = ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "20"]


def cli(model, *args, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONIOENCODING="utf-8", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "bytebound.cli", "generate", "--model", str(model), "--prompt", PROMPT, *args]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, encoding="utf-8", timeout=timeout)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def summary(r) -> tuple[int, str]:
    """``[N tokens, finish=REASON, ...]`` from stderr."""
    m = re.search(r"\[(\d+) tokens, finish=(\w+)", r.stderr)
    assert m, r.stderr
    return int(m.group(1)), m.group(2)


@pytest.fixture(scope="module")
def engine(nano_ckpt):
    from bytebound.engine.engine import Engine
    return Engine(model=str(nano_ckpt))


@pytest.fixture(scope="module")
def greedy(engine):
    out = engine.generate(PROMPT, SamplingParams(max_tokens=16))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 16
    return out


def test_greedy_max_tokens_matches_engine(nano_ckpt, greedy):
    r = cli(nano_ckpt, "--max-tokens", "16")
    assert r.stdout == greedy.text + "\n"
    assert summary(r) == (16, "length")
    r5 = cli(nano_ckpt, "--max-tokens", "5")
    assert summary(r5) == (5, "length")
    assert greedy.text.startswith(r5.stdout[:-1]) and len(r5.stdout) < len(r.stdout)


def test_sampling_flags_at_temperature_0_are_named_as_ignored(nano_ckpt, greedy):
    """--top-k / --seed without --temperature: greedy output, and a note says the flags do nothing (a user who
    forgot --temperature otherwise sees the greedy text and no hint); no note for plain greedy."""
    r = cli(nano_ckpt, "--max-tokens", "16", "--top-k", "5", "--seed", "3")
    assert r.stdout == greedy.text + "\n"
    assert "--temperature 0 is greedy decoding" in r.stderr
    assert "greedy decoding" not in cli(nano_ckpt, "--max-tokens", "16").stderr


def test_sampling_same_seed_same_output(nano_ckpt, engine, greedy):
    a = cli(nano_ckpt, "--max-tokens", "16", "--seed", "7", *SAMPLED)
    b = cli(nano_ckpt, "--max-tokens", "16", "--seed", "7", *SAMPLED)
    assert a.stdout == b.stdout and summary(a) == summary(b) == (16, "length")
    # the same request in this process gives the same text (seeded generator, same kernels)
    p = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=20, seed=7)
    assert engine.generate(PROMPT, p)[0].text + "\n" == a.stdout
    # and it really samples: another seed and greedy decoding give other text
    other = engine.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=20, seed=8))[0]
    assert other.text + "\n" != a.stdout and greedy.text + "\n" != a.stdout


def test_stop_string_truncates(nano_ckpt, greedy):
    text = greedy.text
    # a 3-character stop string that first occurs at position >= 3 (the output must be cut right before it)
    cand = [(i, text[i:i + 3]) for i in range(3, len(text) - 3)
            if text.find(text[i:i + 3]) == i and text[i:i + 3].isprintable()]
    assert cand, f"no usable stop string in {text!r}"
    i, stop = cand[len(cand) // 2]
    r = cli(nano_ckpt, "--max-tokens", "16", f"--stop={stop}")
    assert r.stdout == text[:i] + "\n"
    n, finish = summary(r)
    assert finish == "stop" and n < 16


def test_eos_stops(nano_ckpt, greedy, tmp_path):
    """Make a token of the greedy continuation the checkpoint's EOS (config.json ``eos_token_id``): the output
    ends right before its first occurrence, EOS not emitted, finish=stop."""
    ids = greedy.token_ids
    i = next(i for i in range(2, 16) if ids[i] not in ids[:i])
    d = tmp_path / "eos_ckpt"
    shutil.copytree(nano_ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = ids[i]
    (d / "config.json").write_text(json.dumps(cfg))
    r = cli(d, "--max-tokens", "16")
    assert summary(r) == (i, "stop")
    from bytebound.engine.tokenizer import Tokenizer
    assert r.stdout == Tokenizer.from_dir(d).decode(ids[:i]) + "\n"


def test_bad_checkpoint_fails_cleanly(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "bytebound.cli", "generate", "--model", str(tmp_path), "--prompt", "x"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode != 0 and "config.json" in r.stderr


def test_prompt_ids_with_dummy_weights(nano_ckpt):
    """Random (dummy) weights have no tokenizer: ``--prompt-ids`` feeds token ids, the ids come back on stdout and
    equal the engine's; bad ids are a named error (exit 2)."""
    from bytebound.engine.engine import Engine
    env = dict(os.environ, PYTHONIOENCODING="utf-8", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    base = [sys.executable, "-m", "bytebound.cli", "generate", "--model", str(nano_ckpt), "--load-format", "dummy",
            "--max-tokens", "4"]
    r = subprocess.run(base + ["--prompt-ids", "5, 6 7"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr
    ids = [int(t) for t in r.stdout.split("token ids:")[1].split()]
    want = Engine(model=str(nano_ckpt), load_format="dummy").generate([5, 6, 7], SamplingParams(max_tokens=4))[0]
    assert ids == want.token_ids and len(ids) == 4
    bad = subprocess.run(base + ["--prompt-ids", "5,x"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and "--prompt-ids must be integers" in bad.stderr
    no_ids = subprocess.run(base + ["--prompt", "hello"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=240)
    assert no_ids.returncode == 2 and "--prompt-ids" in no_ids.stderr
