"""scripts/eval_nano.py's quantisation ablation: the hybrid that takes every weight class from the checkpoint must
reproduce the quant-vs-float figures exactly (so the per-class hybrids are built from the right tensors). Uses a
4-step CPU run of scripts/train_nano.py for a float / checkpoint pair (~15 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_all_from_checkpoint_hybrid_reproduces_quant_vs_float(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=ROOT, check=True, capture_output=True, text=True)  # noqa: E731
    run("scripts/train_nano.py", "--out", str(tmp_path), "--export-dir", str(tmp_path / "export"),
        "--train-log-dir", str(tmp_path / "log"), "--device", "cpu", "--steps", "4", "--batch-rows", "2",
        "--seq-len", "256", "--limit-train", "64", "--val-examples", "8", "--calib-steps", "1")
    out = tmp_path / "eval.json"
    run("scripts/eval_nano.py", "--ckpt", str(tmp_path / "export"), "--float-weights", str(tmp_path / "nano_float.pt"),
        "--tf-n", "5", "--tf5-n", "0", "--greedy-n", "0", "--quant-ablation", "3", "--out", str(out))
    rep = json.loads(out.read_text())
    qf, abl = rep["quant_ablation"]["checkpoint"], rep["quant_ablation"]     # same 3 records
    assert qf["positions"] < rep["teacher_forced"]["chat"]["quant_vs_float"]["positions"]     # not the 5
    allq = abl["all_from_checkpoint"]
    assert allq["top1_agreement_main"] == qf["top1_agreement_main"]
    assert allq["top1_agreement_nextn"] == qf["top1_agreement_nextn"]
    # The KL of two near-equal distributions is a difference of nearly equal float32 log-probabilities, so a
    # different BLAS summation order (another CPU's kernels; 2.8e-6 relative on an AVX-512 Zen 4 VM) moves it far
    # more than the logits themselves; a hybrid built from a wrong tensor moves it by orders of magnitude.
    assert allq["kl_main_nats_per_token"] == pytest.approx(qf["kl_main_nats_per_token"], rel=1e-4, abs=1e-9)
    for label in ("fp8_linears_only", "mxfp4_experts_only", "bf16_storage_only"):
        assert 0.0 <= abl[label]["top1_agreement_main"] <= 1.0 and abl[label]["positions"] == qf["positions"]
