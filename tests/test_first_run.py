"""What a fresh user's first run (CPU, bundled ling-nano) met: the demo's answer line without context, flags that
did nothing without a word, the help text, ``analyze`` into a file, the CPU ablation's exit status and the
message of a prompt longer than ``--max-model-len``. The runs are short (a few tokens, no compile)."""

from __future__ import annotations

import argparse
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
    assert "answer:" in out and "not the model's quality" not in out


# ---- README: "Things a first run may not expect" -----------------------------------------------------------
def first_run_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("Things a first run may not expect")
    return text[start:text.index("\n## ", start)]


def test_readme_example_prompt_has_a_real_newline_in_bash():
    """The section shows the prompt in bash's ``$'...'`` quoting (a real newline) and says that a plain
    double-quoted ``"\\n"`` stays a backslash and an ``n``: both as bash really does it."""
    import subprocess
    sec = " ".join(first_run_section().split())
    m = re.search(r"--prompt (\$'Question: \.\.\.\\nAnswer:')", sec)
    assert m, sec
    dollar = subprocess.run(["bash", "-c", f"printf %s {m.group(1)}"], capture_output=True, text=True).stdout
    plain = subprocess.run(["bash", "-c", 'printf %s "Question: ...\\nAnswer:"'], capture_output=True, text=True)
    assert dollar == "Question: ...\nAnswer:" and plain.stdout == "Question: ...\\nAnswer:"
    assert '`"\\n"` stays a backslash and an `n`' in sec


def test_readme_says_serve_samples_and_generate_is_greedy_by_default(monkeypatch):
    """The section's defaults are the code's: a request without ``temperature`` samples at 1.0, ``generate``
    without ``--temperature`` is greedy."""
    from types import SimpleNamespace

    from bytebound.server.app import _sampling
    sec = " ".join(first_run_section().split())
    assert "`serve` samples at temperature 1.0 when a request gives none" in sec
    assert "`generate` is greedy unless given `--temperature`" in sec
    eng = SimpleNamespace(max_new_tokens=lambda n: 100, model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=10)),
                          runner=SimpleNamespace(max_len=128), config=SimpleNamespace(speculative_steps=0))
    assert _sampling({"prompt": "x"}, False, 4, eng).temperature == 1.0
    assert _sampling({"messages": []}, True, 4, eng).temperature == 1.0
    import bytebound.cli as cli
    seen = []
    monkeypatch.setattr(cli, "cmd_generate", lambda a: seen.append(a.temperature) or 0)
    assert main(["generate", "--prompt", "x"]) == 0 and seen == [0.0]


# ---- MTP flags without --speculative-algorithm ---------------------------------------------------------------
def _engine_config(*argv, **kw):
    import argparse

    from bytebound.cli import add_engine_args, engine_config
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config(p.parse_args(list(argv)), **kw)


@pytest.mark.parametrize("flags", [["--speculative-num-steps", "2"], ["--speculative-num-draft-tokens", "5"],
                                   ["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"]])
def test_mtp_sizes_without_nextn_get_a_note(capsys, flags):
    """As ``--top-p`` at temperature 0: the run goes on (MTP off) and stderr names the flags that did nothing."""
    cfg = _engine_config(*flags)
    assert cfg.speculative_steps == 0
    err = capsys.readouterr().err
    note = [ln for ln in err.splitlines() if "note:" in ln]
    assert len(note) == 1 and "without --speculative-algorithm NEXTN" in note[0], err
    assert all(f in note[0] for f in flags if f.startswith("--")), note


def test_mtp_sizes_note_only_where_they_do_nothing(capsys):
    assert _engine_config().speculative_steps == 0
    assert _engine_config("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3").speculative_steps == 3
    assert _engine_config("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
                          "--speculative-num-draft-tokens", "3").speculative_steps == 2
    assert _engine_config("--speculative-algorithm", "NEXTN").speculative_steps == 3
    # --speculative-num-steps alone: the draft-token count follows it (it used to be refused against the default 4)
    assert _engine_config("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2").speculative_steps == 2
    assert _engine_config("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "7").speculative_steps == 7
    # bench ablation's +mtp step reads --speculative-num-steps without NEXTN
    assert _engine_config("--speculative-num-steps", "2", mtp_steps_used=True).speculative_steps == 0
    assert "note:" not in capsys.readouterr().err


def test_mtp_sizes_still_checked_with_nextn():
    from bytebound.errors import ConfigError
    with pytest.raises(ConfigError, match="must equal --speculative-num-steps \\+ 1"):
        _engine_config("--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "3")
    with pytest.raises(ConfigError, match="must equal --speculative-num-steps \\+ 1"):
        _engine_config("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
                       "--speculative-num-draft-tokens", "4")
    with pytest.raises(ConfigError, match=">= 1 with NEXTN"):
        _engine_config("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "0")


# ---- help text ---------------------------------------------------------------------------------------------
COMMANDS = [["generate"], ["demo"], ["verify"], ["serve"], ["bench"], ["bench", "synthetic"], ["bench", "gsm8k"],
            ["bench", "ablation"], ["analyze"], []]
DEPRECATED = ["--moe-backend", "--linear-backend", "--kda-backend", "--mla-backend", "--fused-router",
              "--fused-norm", "--fused-shared-expert", "--fused-router-gemv", "--decode-kv-buckets",
              "--spec-static-round", "--enforce-eager"]


def help_of(capsys, cmd) -> str:
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "bytebound")
def test_help_lists_no_deprecated_flags_and_no_sphinx_markup(capsys, cmd):
    text = help_of(capsys, cmd)
    assert "deprecated" not in text.lower()
    assert not [f for f in DEPRECATED if re.search(rf"{f}\b", text)], text
    assert not re.search(r":[a-z]+:`|``|\w::$", text, re.MULTILINE), text


def test_sphinx_roles_become_plain_names(capsys):
    text = help_of(capsys, ["verify"])
    assert "--draft-share weight-only is a" in text             # ``--draft-share weight-only`` in the docstring
    assert "add_verify_args" not in text                        # developers' notes stay out of the user's help
    assert "(see bytebound.server.app)" in help_of(capsys, ["serve"])
    from bytebound.helptext import plain_doc
    assert plain_doc("See :meth:`~a.B.f`, :py:class:`X` and ``--x``.\n\nUsage::\n") == "See f, X and --x.\n\nUsage:\n"
    assert plain_doc(None) is None


@pytest.mark.parametrize("flags,field,value", [
    (["--moe-backend", "torch"], "backends", {"moe": "torch"}), (["--kda-backend", "fla"], "backends", {"kda": "fla"}),
    (["--no-fused-router"], "fused_router", False), (["--fused-norm"], "fused_norm", True),
    (["--no-fused-shared-expert"], "fused_shared", False), (["--no-decode-kv-buckets"], "kv_buckets", False),
    (["--enforce-eager"], "enforce_eager", True)])
def test_hidden_deprecated_flags_still_work(flags, field, value):
    assert getattr(_engine_config(*flags), field) == value


def command_parser(monkeypatch, name: str) -> argparse.ArgumentParser:
    """The parser ``main`` builds for the subcommand ``name`` (caught at its ``parse_args``)."""
    class Built(Exception):
        pass

    def catch(self, *a, **k):
        raise Built(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(Built) as e:
        main([name])
    sub = next(a for a in e.value.args[0]._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("cmd,flags", [
    ("generate", ["--device", "--max-model-len", "--load-format", "--speculative-num-steps",
                  "--speculative-num-draft-tokens"]),
    ("demo", ["--max-tokens", "--index", "--format"]), ("serve", ["--host", "--port"])])
def test_flags_have_help_with_their_default(monkeypatch, cmd, flags):
    actions = {s: a for a in command_parser(monkeypatch, cmd)._actions for s in a.option_strings}
    for f in flags:
        h = actions[f].help
        assert h and h != argparse.SUPPRESS and "default" in h, (f, h)


def test_version(capsys):
    import tomllib
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"bytebound {want}"


# ---- analyze > file ------------------------------------------------------------------------------------------
def test_analyze_into_a_file_does_not_fold_the_tables(tmp_path, capsys, monkeypatch):
    """stdout not a terminal (here captured) and no COLUMNS: each table row is one line (rich folds at 80)."""
    import json
    monkeypatch.delenv("COLUMNS", raising=False)
    path = tmp_path / "r.json"
    assert main(["analyze", "--checkpoint", str(NANO), "--detail", "--json", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rep = json.loads(path.read_text())
    tops = [i for i, ln in enumerate(out) if ln.startswith("┏")]
    ends = [i for i, ln in enumerate(out) if ln.startswith("└")]
    want = [len(rep["rows"]), len(rep["ledger"]["bf16_head"]["groups"]) + 1,
            len(rep["ledger"]["bf16_head"]["items"])]
    assert len(tops) == len(ends) == 3
    for top, end, n in zip(tops, ends, want):
        body = out[top + 3:end]                               # after the header row and its rule
        assert len(body) == n, "\n".join(out[top:end + 1])
        assert {len(ln) for ln in out[top:end + 1]} == {len(out[top])}
    assert max(len(ln) for ln in out) > 80                    # the tables are wider than rich's default


# ---- a prompt longer than --max-model-len ----------------------------------------------------------------------
def test_generate_prompt_longer_than_max_model_len_says_the_prompt_does_not_fit(nano_ckpt, capsys):
    from bytebound.engine.engine import Engine
    from bytebound.errors import RequestError
    prompt = "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning."
    eng = Engine(model=str(nano_ckpt), max_model_len=8)
    n = len(eng.encode_prompt(prompt))
    assert n > 8
    from bytebound.sampling import SamplingParams
    with pytest.raises(RequestError, match=rf"the prompt itself \({n} tokens\) does not fit the engine's max "
                                           r"length 8 \(--max-model-len\)") as e:
        next(iter(eng.stream(prompt, SamplingParams(max_tokens=1))))
    assert e.value.param == "prompt"
    assert main(["generate", "--model", str(nano_ckpt), "--max-model-len", "8", "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"the prompt itself ({n} tokens) does not fit" in err, err
