"""scripts/profile_decode.py --ab: the parsing of its environment settings (host side, no GPU)."""

from __future__ import annotations

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def pd():
    return load_script("profile_decode")


def test_ab_settings(pd):
    """';' separates variables (a value keeps its commas and '='), '' is the baseline (nothing set)."""
    assert pd.ab_settings("") == {}
    assert pd.ab_settings("BYTEBOUND_PDL_PREFETCH=router,kda") == {"BYTEBOUND_PDL_PREFETCH": "router,kda"}
    assert pd.ab_settings('BYTEBOUND_PDL_PREFETCH=; BYTEBOUND_MLA_CFG={"BN": 64, "split": null}') == {
        "BYTEBOUND_PDL_PREFETCH": "", "BYTEBOUND_MLA_CFG": '{"BN": 64, "split": null}'}
    assert pd.ab_settings("A=x=y;") == {"A": "x=y"}


@pytest.mark.parametrize("bad", ["BYTEBOUND_PDL=0", "TRITON_INTERPRET=1", "router", "=1"])
def test_ab_settings_refused(pd, bad):
    """A part that is no assignment, or a variable read only at import (the A/B would time the same graph twice),
    stops the script before the model is built."""
    with pytest.raises(SystemExit):
        pd.ab_settings(bad)
