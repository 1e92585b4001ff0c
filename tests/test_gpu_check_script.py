"""``scripts/gpu_check.sh`` runs only on the device machine, where a bash error costs a call of scarce device time
(the twenty-ninth session's first call lost its ``table_checks`` to an unbound variable). Here every section runs
with ``python3``, ``ncu`` and ``nvidia-smi`` replaced by stubs that log their arguments and succeed, so what is
checked is the script's own bash: no unbound variable, syntax error or missing command, and the steps a section
promises are the ones it runs. What the stubbed programs would have measured is not checked (that is the GPU's)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BASH_ERRORS = ("unbound variable", "syntax error", "command not found", "bad substitution", "bad array subscript")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _stub_env(tmp_path: Path) -> dict:
    """An environment whose PATH puts logging stubs of python3, ncu and nvidia-smi first; OUT in tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3", "ncu", "nvidia-smi"):
        stub = bin_dir / name
        stub.write_text(f'#!/usr/bin/env bash\necho "STUB {name} $*" >> "$STUB_LOG"\nexit 0\n')
        stub.chmod(0o755)
    (tmp_path / "out").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BYTEBOUND_", "AB_", "MOE_TABLE"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", OUT=str(tmp_path / "out"),
               STUB_LOG=str(tmp_path / "calls.txt"), SECTION_TIMEOUT="30",
               MOE_TABLE=str(ROOT / "bytebound" / "kernels" / "configs" / "triton_moe.json"))
    return env


def _sections() -> list[str]:
    out = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    return out.split()


def test_list_names_the_default_and_on_demand_sections():
    names = _sections()
    assert names[:5] == ["kernels", "engine", "bench_moe", "decode", "verify"]
    assert {"moetable", "nr", "regcap", "gemvcap", "ladder"} <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("section", _sections())
def test_section_bash_runs_clean_with_stubbed_programs(section, tmp_path):
    """Each section, run with stubs, ends (exit 0, or 1 for a step the stubs fail, such as a pytest selection that
    collects nothing) and its bash reports no error."""
    r = subprocess.run(["bash", str(SCRIPT), section], cwd=ROOT, env=_stub_env(tmp_path), capture_output=True,
                       text=True, timeout=120)
    text = r.stdout + r.stderr
    bad = [line for line in text.splitlines() if any(e in line for e in BASH_ERRORS)]
    assert not bad, f"section {section}: bash errors:\n" + "\n".join(bad)
    assert r.returncode in (0, 1), text[-2000:]
    assert f"gpu_check: sections {section};" in text, text[-2000:]


def test_table_checks_runs_both_arms_in_abba_order(tmp_path):
    """``moetable`` ends in ``table_checks``: the engine tests and canaries with the candidate table, a discarded
    warm-up round, then AB_PAIRS pairs, base first in odd pairs and candidate first in even ones, the base arm with
    the table variable unset."""
    env = _stub_env(tmp_path)
    env["AB_PAIRS"] = "2"
    r = subprocess.run(["bash", str(SCRIPT), "moetable"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    started = [line for line in r.stdout.splitlines() if line.startswith("=== [moetable] ") and ": rc=" not in line]
    steps = [line.split(":")[0].split("] ")[1] for line in started]       # run_step's label
    lines = dict(zip(steps, started))
    tail = steps[steps.index("engine"):]
    assert tail == ["engine", "canaries", "round_warmup", "round_base_1", "round_moetable_1", "round_moetable_2",
                    "round_base_2"], steps
    assert "env -u BYTEBOUND_MOE_CONFIG" in lines["round_base_1"]
    assert f"BYTEBOUND_MOE_CONFIG={env['MOE_TABLE']}" in lines["round_moetable_1"]
