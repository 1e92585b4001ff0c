"""scripts/train_nano.py on CPU, a few steps: the quantisation-consistency term (``--consistency-weight``).

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
           "--qat-frac", "0.5", "--consistency-weight", "0.5"]
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
