"""``bytebound.bench.ab``: the environment around an A/B capture is set, then restored exactly (the timing itself
needs a GPU; the settings' parser is tested through ``scripts/profile_decode.py`` in test_profile_decode_ab.py)."""

from __future__ import annotations

import os

import pytest

from bytebound.bench.ab import ab_settings, env_applied


def test_env_applied_restores(monkeypatch):
    monkeypatch.setenv("BB_TEST_KEEP", "old")
    monkeypatch.delenv("BB_TEST_NEW", raising=False)
    with env_applied({"BB_TEST_KEEP": "new", "BB_TEST_NEW": "1"}):
        assert os.environ["BB_TEST_KEEP"] == "new" and os.environ["BB_TEST_NEW"] == "1"
    assert os.environ["BB_TEST_KEEP"] == "old" and "BB_TEST_NEW" not in os.environ


def test_env_applied_restores_after_an_error(monkeypatch):
    monkeypatch.delenv("BB_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError, match="boom"):
        with env_applied({"BB_TEST_NEW": "1"}):
            raise RuntimeError("boom")
    assert "BB_TEST_NEW" not in os.environ


def test_router_settings_parse():
    """bench_router's settings: ';' between variables, '' the defaults."""
    assert ab_settings("BYTEBOUND_ROUTER_SPLIT_TAIL=0;BYTEBOUND_ROUTER_BATCH_ROWS=0") == {
        "BYTEBOUND_ROUTER_SPLIT_TAIL": "0", "BYTEBOUND_ROUTER_BATCH_ROWS": "0"}
    assert ab_settings("") == {}
