"""scripts/bench_decode.py on CPU with the bundled nano config (dummy weights): it builds its engine through
``Engine`` (the plan ``bytebound generate`` runs), expresses its variants as plan overrides, and still writes
every output the perf docs read (TPOT, per-op table, MTP round cost, TTFT, the plan that ran)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NANO_CONFIG = ROOT / "models" / "ling-nano" / "config.json"


def _run(*args, tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_decode.py"), "--device", "cpu", "--config",
           str(NANO_CONFIG), "--out", str(tmp_path), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_bench_decode_cpu_smoke_through_the_engine(tmp_path):
    p = _run("--moe-backends", "torch,torch+dense", "--heads", "fp8", "--contexts", "48", "--ttft-len", "16",
             "--verify-ops", "--backend", "kv=exact", tmp_path=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads((tmp_path / "bench_decode.json").read_text())
    assert d["info"]["plan_overrides"] == {"kv": "exact"}
    rows = [r for r in d["results"] if "tpot_ms" in r]
    assert [r["moe"] for r in rows] == ["torch", "torch+dense"] and all(r["tpot_ms"] > 0 for r in rows)
    for r in rows:      # what ran: the engine's plan, per entry and regime
        assert r["resolved"]["moe"] == "torch" and r["plan"]["moe_shared"]["decode"] == "separate (dense MLP)"
        assert r["plan"]["kv"]["decode"] == "every max_model_len slot"
    assert {"torch/fp8", "torch/fp8/verify4", "torch+dense/fp8"} <= set(d["per_op"])
    rc = d["per_op"]["mtp_round/torch"]
    assert rc["round_ms"] > 0 and rc["c"] > 0 and "static_round_ms" in rc
    assert d["info"]["ttft_s"]["s"] > 0 and d["info"]["ttft_s"]["resolved"]["moe"] == "torch"


def test_bench_decode_names_a_bad_plan_override(tmp_path):
    p = _run("--moe-backends", "torch+gemv", "--heads", "bf16", "--contexts", "48", "--ttft-len", "0",
             tmp_path=tmp_path)
    assert p.returncode == 2 and "router=gemv needs a CUDA device" in p.stderr, p.stderr[-2000:]
    p = _run("--backend", "nope=1", "--heads", "bf16", "--contexts", "48", "--ttft-len", "0", tmp_path=tmp_path)
    assert p.returncode == 2 and "expected ENTRY=NAME" in p.stderr, p.stderr[-2000:]
