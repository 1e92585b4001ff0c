"""Issue 22, items 2-4: what a fresh user's first commands hit. Each bad input is one named line and a non-zero
exit (never a traceback), ``analyze --checkpoint`` prices a checkpoint against its own config, and the bench and
verify texts say what really happens (the max-length message names the flags the user passed; a CPU ablation
records the CUDA-only kernel step as skipped and goes on; the weight-only refusal says what the alias reads)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bytebound.checkpoint.synthetic import random_model
from bytebound.checkpoint.writer import save_pretrained
from bytebound.cli import main
from bytebound.config import LING3_FLASH_CONFIG, tiny_config
from bytebound.engine.engine import Engine
from bytebound.errors import ConfigError, RequestError
from bytebound.sampling import SamplingParams
from bytebound.speculative.mtp import MTPDrafter
from conftest import NANO_TOKENIZER, ROOT

NANO = ROOT / "models" / "ling-nano"
VOCAB = 6144


def tiny_cfg(**kw):
    return tiny_config(vocab_size=VOCAB, eos_token_id=3, pad_token_id=0, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Random tiny checkpoint with a NEXTN layer and the ling-nano tokenizer."""
    return save_pretrained(random_model(tiny_cfg()), tmp_path_factory.mktemp("with-nextn"),
                           tokenizer_dir=NANO_TOKENIZER)


@pytest.fixture(scope="module")
def no_nextn(tmp_path_factory):
    """The same without a NEXTN layer (``num_nextn_predict_layers = 0``)."""
    return save_pretrained(random_model(tiny_cfg(num_nextn_predict_layers=0)),
                           tmp_path_factory.mktemp("no-nextn"), tokenizer_dir=NANO_TOKENIZER)


def one_line_error(capsys, name: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if name in ln]
    assert len(lines) == 1, err
    return lines[0]


# ---- item 2: named errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("ids", ["99999", "-1", "5,6144", "1,2,-7"])
@pytest.mark.parametrize("dummy", [False, True])
def test_generate_out_of_vocab_prompt_ids_named_error(ckpt, capsys, ids, dummy):
    args = ["generate", "--model", str(ckpt), "--prompt-ids=" + ids, "--max-tokens", "2"]
    assert main(args + (["--load-format", "dummy"] if dummy else [])) == 2
    line = one_line_error(capsys, "RequestError")
    assert f"[0, {VOCAB})" in line and "vocab_size" in line


def test_engine_refuses_out_of_vocab_ids_and_keeps_working(ckpt):
    eng = Engine(model=str(ckpt))
    for bad in ([VOCAB], [-1], [4, 5, VOCAB + 3], [True, 5], [4.0]):
        with pytest.raises(RequestError, match=r"prompt token ids must be integers in \[0, 6144\)") as e:
            list(eng.stream(list(bad), SamplingParams(max_tokens=2)))
        assert e.value.param == "prompt"
    ok = eng.generate([4, VOCAB - 1], SamplingParams(max_tokens=2))[0]        # the edges of the range are fine
    assert len(ok.token_ids) == 2


def test_nextn_on_checkpoint_without_nextn_python_api(no_nextn, ckpt):
    with pytest.raises(ConfigError, match="NEXTN layer") as e:
        Engine(model=str(no_nextn), speculative_steps=3)
    assert str(no_nextn) in str(e.value)
    plain = Engine(model=str(no_nextn))                       # without MTP the checkpoint is fine
    assert len(plain.generate([4, 5, 6], SamplingParams(max_tokens=3))[0].token_ids) == 3
    with pytest.raises(ConfigError, match="no NEXTN layer"):
        MTPDrafter(plain.model, 3)
    with pytest.raises(ConfigError, match="draft_share"):
        MTPDrafter(Engine(model=str(ckpt)).model, 3, share="bogus")


@pytest.mark.parametrize("cmd", [["generate", "--prompt-ids", "4,5,6", "--max-tokens", "2"], ["verify"]])
def test_nextn_on_checkpoint_without_nextn_cli(no_nextn, capsys, cmd):
    rc = main([cmd[0], "--model", str(no_nextn), "--speculative-algorithm", "NEXTN", *cmd[1:]])
    assert rc == 2
    line = one_line_error(capsys, "ConfigError")
    assert "NEXTN layer" in line and "num_nextn_predict_layers = 0" in line


def test_analyze_plots_for_a_small_config(tmp_path, capsys):
    """The ledger plot of a model whose every group is small (ling-nano) used to fail with KeyError 'LM head'."""
    out = tmp_path / "plots"
    assert main(["analyze", "--config", str(NANO), "--plots", str(out)]) == 0
    for name in ("ledger.png", "roofline.png", "kv_context.png", "speculative.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- item 3: analyze --checkpoint uses the checkpoint's own config.json ---------------------------------------
def test_analyze_checkpoint_uses_its_own_config(tmp_path, capsys):
    def report(*args):
        path = tmp_path / f"r{len(list(tmp_path.glob('r*.json')))}.json"
        assert main(["analyze", *args, "--json", str(path)]) == 0
        capsys.readouterr()
        return json.loads(path.read_text())

    own = report("--checkpoint", str(NANO))
    given = report("--checkpoint", str(NANO), "--config", str(NANO))
    cfg = json.loads((NANO / "config.json").read_text())
    assert own["exact"]["lm_head_params_m"] == pytest.approx(cfg["vocab_size"] * cfg["hidden_size"] / 1e6)
    assert own["exact"] == given["exact"] and own["inputs"]["config"] == str(NANO / "config.json")
    full = report()                                            # no --checkpoint: the bundled full-scale config
    assert full["inputs"]["config"] == str(LING3_FLASH_CONFIG)
    assert own["exact"]["step_bytes_bf16_gb"] < 1e-2 * full["exact"]["step_bytes_bf16_gb"]


def test_analyze_checkpoint_config_mismatch_and_missing(tmp_path, capsys):
    assert main(["analyze", "--checkpoint", str(NANO), "--config", str(LING3_FLASH_CONFIG)]) == 2
    line = one_line_error(capsys, "ConfigError")
    assert "model.word_embeddings.weight" in line and "not this checkpoint's config" in line
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(NANO / "model.safetensors", bare / "model.safetensors")
    assert main(["analyze", "--checkpoint", str(bare)]) == 2
    assert "no config.json" in one_line_error(capsys, "ConfigError")


def test_analyze_help_tells_the_truth():
    from bytebound.analysis import cli
    doc = " ".join(cli.__doc__.split())
    assert "Without ``--config`` only the seed column is shown" not in doc
    assert "``--config none`` shows the seed column only" in doc


# ---- item 4: bench and verify texts -------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["synthetic", "ablation"])
def test_bench_too_long_for_the_model_names_the_users_flags(ckpt, tmp_path, capsys, cmd):
    assert main(["bench", cmd, "--model", str(ckpt), "--out", str(tmp_path), "--input-len", "4000",
                 "--output-len", "200", "--no-progress"]) == 2
    line = one_line_error(capsys, "ConfigError")
    assert "--input-len 4000" in line and "--output-len 200" in line and "max_position_embeddings 4096" in line
    assert "--max-model-len" not in line and "--load-format dummy" in line
    assert not list(tmp_path.glob("*.json"))                  # refused before any engine started


def test_bench_ablation_on_cpu_skips_the_kernel_step_with_reason(ckpt, tmp_path):
    rc = main(["bench", "ablation", "--model", str(ckpt), "--out", str(tmp_path), "--input-len", "24",
               "--output-len", "6", "--warmup", "0", "--no-progress"])
    data = json.loads((tmp_path / "ablation.json").read_text())
    md = (tmp_path / "ablation.md").read_text()
    assert rc == 0 and data["status"] == "complete" and data["tpot_rule"].startswith("recorded")
    steps = {s["step"]: s for s in data["steps"]}
    assert list(steps) == ["baseline", "+kernel", "+fp8-head", "+mtp"]
    k = steps["+kernel"]
    assert k["skipped"] and k["active"] is False and "needs a CUDA device" in k["check"] and "tpot_ms" not in k
    for name in ("baseline", "+fp8-head", "+mtp"):               # these ran, were checked and timed
        assert steps[name]["active"] and steps[name]["tpot_ms"] > 0, name
    assert steps["+fp8-head"]["config"]["backends"]["moe"] == "torch"   # the skipped lever stays off
    assert "| +kernel |" in md and "| skipped |" in md and "CPU run" in md


def test_weight_only_refusal_message_matches_the_head(ckpt):
    from bytebound.verify import canaries as C
    msgs = {}
    for head in ("bf16", "fp8"):
        eng = Engine(model=str(ckpt), lm_head=head, speculative_steps=3, draft_share="weight-only")
        r = C.run_one(C.canary_draft_sharing, eng, C._Ctx(eng))
        assert r.passed is False
        msgs[head] = r.message
    assert "(FP8 bytes read without their scales)" in msgs["fp8"]
    assert "FP8 bytes read without their scales)" not in msgs["bf16"]
    assert "with this 'bf16' head it reads the same BF16 weight" in msgs["bf16"]
    assert "with the FP8 head it would" in msgs["bf16"]


def test_verify_strict_readme_counts_what_cpu_runs(tmp_path, capsys):
    """The README's ``verify --lm-head fp8 --speculative-algorithm NEXTN --speculative-draft-vocab 0.99 --strict``
    line states how many canaries apply and how many a CPU runs: count them in a real run on the bundled model."""
    path = tmp_path / "m.json"
    assert main(["verify", "--model", str(NANO), "--lm-head", "fp8", "--speculative-algorithm", "NEXTN",
                 "--speculative-draft-vocab", "0.99", "--strict", "--json", str(path)]) == 0
    capsys.readouterr()
    can = json.loads(path.read_text())["canaries"]
    ran = [c["name"] for c in can if c["passed"] is not None]
    skipped = [c["name"] for c in can if c["passed"] is None]
    assert all(c["passed"] for c in can if c["passed"] is not None)
    words = {9: "nine", 10: "ten", 11: "eleven"}
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines()
                if ln.startswith("bytebound verify --lm-head fp8 --speculative-algorithm NEXTN --speculative-draft-vocab "
                                 "0.99 --strict"))
    assert f"all {words[len(can)]} apply" in line and f"CPU runs {words[len(ran)]}" in line, line
    assert all(name in line for name in skipped), (line, skipped)


def test_every_kernel_module_imports_without_triton():
    """The CPU torch wheel brings no Triton (CI, a user's fresh install): every backend and kernel module must still
    import and register, so the engine starts and the Triton backends say why they cannot run. Run in a fresh
    interpreter with ``triton`` blocked, since this process may have Triton (a developer's venv) and imported it
    already. A module that imports a Gluon device function unconditionally fails here (it broke every engine command
    on a fresh install once)."""
    import subprocess
    import sys
    code = (
        "import sys, pkgutil, importlib\n"
        "sys.modules['triton'] = None\n"
        "import bytebound.kernels as K\n"
        "from bytebound.kernels import registry\n"
        "registry._load_optional()\n"
        "for m in pkgutil.iter_modules(K.__path__):\n"
        "    importlib.import_module('bytebound.kernels.' + m.name)\n"
        "from bytebound.engine.engine import Engine\n"
        "print('ok', registry.backends('moe'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]


# ---- a fresh trial of the README (2026-12-02): flags that did nothing silently, a text-only demo, no command ----
def test_chat_with_prompt_ids_gets_a_note(ckpt, capsys):
    """``--chat`` wraps text in the chat template; with ``--prompt-ids`` the ids go in as given, so a note says
    the flag did nothing (as for ``--seed`` at temperature 0) and the output is that of the ids without --chat."""
    base = ["generate", "--model", str(ckpt), "--prompt-ids", "4,5,6", "--max-tokens", "3"]
    assert main(base) == 0
    plain = capsys.readouterr()
    assert "--chat has no effect" not in plain.err
    assert main(base + ["--chat"]) == 0
    chat = capsys.readouterr()
    notes = [ln for ln in chat.err.splitlines() if "note:" in ln]
    assert len(notes) == 1 and "--chat has no effect with --prompt-ids" in notes[0], chat.err
    assert chat.out == plain.out


def test_escaped_newline_in_stop_or_prompt_gets_a_note(ckpt, capsys):
    """``--stop '\\n'`` from a shell's plain quotes is a backslash and an n, which seldom matches: a note says so
    and how to write a newline (a fresh user's run went on past every newline to the length limit). A real
    newline gets no note; the text is used as given either way."""
    base = ["generate", "--model", str(ckpt), "--prompt-ids", "4,5,6", "--max-tokens", "2"]
    assert main(base + ["--stop", "\\n"]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "note:" in ln]
    assert len(notes) == 1 and "--stop" in notes[0] and "not a newline" in notes[0], notes
    assert main(base + ["--stop", "\n"]) == 0
    assert "not a newline" not in capsys.readouterr().err


def test_demo_without_tokenizer_is_a_demo_error_before_the_question(ckpt, capsys):
    """``demo --load-format dummy`` (random weights, no tokenizer): one named line that the demo needs the
    tokenizer, and no question printed first (it used to print the question, then advise --prompt-ids, a flag the
    demo does not have)."""
    assert main(["demo", "--model", str(ckpt), "--load-format", "dummy", "--no-cpu-compile"]) == 2
    out = capsys.readouterr()
    assert "GSM8K test #" not in out.out
    assert "Traceback" not in out.err
    line = [ln for ln in out.err.splitlines() if "RequestError" in ln]
    assert len(line) == 1 and "demo needs the checkpoint's tokenizer" in line[0] and "dummy" in line[0], out.err


def test_no_command_names_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "required: {generate,demo," in err and "required: cmd" not in err, err


def test_analyze_config_by_the_usage_lines_bare_name(tmp_path, capsys, monkeypatch):
    """``analyze --help`` and docs/analysis.md show ``--config ling-3.0-flash.json``: from any working directory
    that bare name is the bundled config (it used to fail with "no config.json at ling-3.0-flash.json"); a local
    file of that name still wins, and a missing file is named as a missing file, not a missing config.json."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["analyze", "--json", "default.json"]) == 0
    assert main(["analyze", "--config", "ling-3.0-flash.json", "--json", "named.json"]) == 0
    capsys.readouterr()
    default, named = (json.loads((tmp_path / f).read_text()) for f in ("default.json", "named.json"))
    assert named["inputs"]["config"] == str(LING3_FLASH_CONFIG) == default["inputs"]["config"]
    assert named["exact"] == default["exact"] and named["exact"]
    shutil.copy(LING3_FLASH_CONFIG, tmp_path / "ling-3.0-flash.json")
    assert main(["analyze", "--config", "ling-3.0-flash.json", "--json", "local.json"]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "local.json").read_text())["inputs"]["config"] == "ling-3.0-flash.json"
    assert main(["analyze", "--config", "nosuch.json"]) == 2
    assert "no config file at nosuch.json" in one_line_error(capsys, "ConfigError")


@pytest.mark.parametrize("dummy", [False, True])
def test_generate_model_given_as_its_config_file(ckpt, capsys, dummy):
    """``--model DIR/config.json``: with random weights the config file is enough (the README passes one to
    bench synthetic); with the real weights it is one line saying to give the folder (it said "DIR/config.json:
    no model.safetensors", true of no folder the user named)."""
    args = ["generate", "--model", str(ckpt / "config.json"), "--prompt-ids", "4,5", "--max-tokens", "2"]
    if dummy:
        assert main(args + ["--load-format", "dummy"]) == 0
        return
    assert main(args) == 2
    line = one_line_error(capsys, "CheckpointError")
    assert "is a file, not a checkpoint folder" in line and str(ckpt) in line, line


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
def test_model_given_as_a_weights_file_names_the_folder(ckpt, capsys, tmp_path, name):
    """``--model DIR/model.safetensors`` (or the index): one line saying it is a weights file and naming the folder
    to give (it said "invalid JSON ('utf-8' codec can't decode byte 0x88...)", from reading the tensors as a
    config)."""
    path = ckpt / name if (ckpt / name).exists() else tmp_path / name
    path.touch(exist_ok=True)
    assert main(["generate", "--model", str(path), "--prompt-ids", "4,5", "--max-tokens", "2"]) == 2
    line = one_line_error(capsys, "ConfigError")
    assert "is a weights file, not a model" in line and str(path.parent) in line, line


def test_sglang_and_vllm_flag_spellings(ckpt, capsys):
    """``--model-path`` (SGLang) and ``--tp`` / ``--tp-size`` are the same flags as ``--model`` and
    ``--tensor-parallel-size``: a command line copied from SGLang runs (they were "unrecognized arguments")."""
    base = ["generate", "--prompt-ids", "4,5,6", "--max-tokens", "2"]
    assert main(base + ["--model", str(ckpt)]) == 0
    want = capsys.readouterr().out
    assert main(base + ["--model-path", str(ckpt), "--tp", "1"]) == 0
    assert capsys.readouterr().out == want
    assert main(base + ["--model-path", str(ckpt), "--tp-size", "0"]) == 2
    assert "--tensor-parallel-size must be >= 1" in capsys.readouterr().err


def test_help_and_version_do_not_import_torch():
    """``bytebound --help`` / ``--version`` answer without importing torch (was ~1.2-2.5 s on a 2-core machine): the
    parser's defaults come from torch-free modules (``bytebound.paths``, ``bytebound.verify``'s lazy exports)."""
    import subprocess
    import sys
    code = ("import sys, bytebound.cli as c\n"
            "for argv in (['--help'], ['--version'], ['generate', '--help'], ['bench', '--help']):\n"
            "    try:\n        c.main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False", out[-500:]
