"""``scripts/bench_head.py`` and ``scripts/bench_router.py`` on a machine without a GPU: a named refusal (exit 2),
not a traceback; the timing itself runs on the device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("script", ["bench_head.py", "bench_router.py"])
def test_refuses_without_a_gpu(script, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr
