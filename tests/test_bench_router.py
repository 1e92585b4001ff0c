"""``scripts/bench_router.py``'s setting parser and environment guard (the timing itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("bench_router",
                                              Path(__file__).resolve().parents[1] / "scripts" / "bench_router.py")
br = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(br)


def test_parse_setting():
    assert br.parse_setting("") == {}
    assert br.parse_setting("A=1  B=x=y") == {"A": "1", "B": "x=y"}
    with pytest.raises(ValueError, match="VAR=VALUE"):
        br.parse_setting("A=1 B")


def test_env_set_restores(monkeypatch):
    monkeypatch.setenv("BB_TEST_KEEP", "old")
    monkeypatch.delenv("BB_TEST_NEW", raising=False)
    with br.env_set({"BB_TEST_KEEP": "new", "BB_TEST_NEW": "1"}):
        assert os.environ["BB_TEST_KEEP"] == "new" and os.environ["BB_TEST_NEW"] == "1"
    assert os.environ["BB_TEST_KEEP"] == "old" and "BB_TEST_NEW" not in os.environ
