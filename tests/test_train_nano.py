"""scripts/train_nano.py on CPU, a few steps: the quantisation-consistency term (``--consistency-weight``) and the
proximal step toward the export grid (``--prox-quant``, run in the same few steps).

The term is KL(float forward || quantised forward) of the main head, added while QAT is on. It must be logged for
the QAT steps only, be positive there (the export formats do move the logits), and leave the plain losses as they
were defined."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_consistency_term_logged_on_qat_steps(tmp_path):
    cmd = [sys.executable, "scripts/train_nano.py", "--out", str(tmp_path), "--no-export",
           "--train-log-dir", str(tmp_path / "log"), "--device", "cpu", "--steps", "4", "--batch-rows", "2",
           "--seq-len", "256", "--limit-train", "64", "--val-examples", "8", "--calib-steps", "1",
           "--qat-frac", "0.5", "--consistency-weight", "0.5", "--prox-quant", "1.0", "--prox-from", "0.75"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    rows = json.loads((tmp_path / "log" / "loss.json").read_text())["train"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        if r["qat"]:
            assert r["consistency_kl"] > 0.0, r
            assert abs(r["loss"] - (r["ce"] + 0.3 * r["nextn_ce"] + 0.5 * r["consistency_kl"])) < 1e-4 * r["loss"]
        else:
            assert "consistency_kl" not in r, r
    assert any(r["qat"] for r in rows) and not all(r["qat"] for r in rows)


def _train_nano():
    from conftest import load_script
    return load_script("train_nano", "train_nano")


def test_prox_step_moves_master_weights_toward_the_export_grid():
    """``--prox-quant``: ``W <- (W + lam Q(W)) / (1 + lam)``. With lam = 1 each weight goes half way to its grid
    point (FP8 128x128 blocks, MXFP4 groups of 32), so the distance to the grid halves (up to grid points that
    move because a block's scale moved), and lam = 0 leaves the weights alone."""
    import torch

    from bytebound.layers.linear import QLinear
    from bytebound.layers.moe import RoutedExperts

    tn = _train_nano()
    torch.manual_seed(0)
    lin = QLinear(256, 256, "plain", (128, 128), torch.float32, "cpu")     # training keeps float masters
    with torch.no_grad():
        lin.weight.copy_(torch.randn(256, 256) * 0.02)
    ex = RoutedExperts(4, 64, 32, "plain", torch.float32, "cpu", None)
    with torch.no_grad():
        ex.w13.copy_(torch.randn_like(ex.w13) * 0.05)
        ex.w2.copy_(torch.randn_like(ex.w2) * 0.05)
    parts = [tn.QATLinear(lin, tn.EXPORT_QUANT), tn.DenseExperts(ex, "mse")]

    def dist():
        out = []
        for p in parts:
            p.refresh_qat()
            d = p.delta if isinstance(p.delta, tuple) else (p.delta,)
            out.append(sum(float(x.pow(2).sum()) for x in d) ** 0.5)
        return out

    before = dist()
    w0 = lin.weight.detach().clone()
    for p in parts:
        p.prox(0.0)
    assert torch.equal(lin.weight, w0)
    for p in parts:
        p.prox(0.5)                        # lam = 1
    after = dist()
    for b, a in zip(before, after):
        assert 0.0 < b and a < 0.6 * b, (before, after)


def test_reproduce_line_has_every_argument_that_changes_the_run(tmp_path):
    """The printed ``reproduce:`` command carries every non-default argument (data limits, device, QAT and prox
    flags, ...) and no output folder (the defaults are the bundled model's folders)."""
    cmd = [sys.executable, "scripts/train_nano.py", "--out", str(tmp_path), "--no-export",
           "--train-log-dir", str(tmp_path / "log"), "--device", "cpu", "--steps", "2", "--batch-rows", "2",
           "--seq-len", "256", "--limit-train", "64", "--val-examples", "8", "--calib-steps", "1",
           "--qat-frac", "0.5", "--prox-quant", "1.0", "--prox-from", "0.75", "--lr", "0.001"]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    line = [ln for ln in out.splitlines() if "reproduce:" in ln][-1]
    for flag in ("--steps 2", "--seed 1234", "--batch-rows 2", "--seq-len 256", "--limit-train 64",
                 "--val-examples 8", "--calib-steps 1", "--qat-frac 0.5", "--prox-quant 1.0", "--prox-from 0.75",
                 "--lr 0.001", "--device cpu", "--no-export"):
        assert flag in line, (flag, line)
    assert str(tmp_path) not in line and "--out " not in line
