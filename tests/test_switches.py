"""The environment switch registry (bytebound/switches.py) against the code that reads the switches, and the
manifest's record of a run that sets one."""

import re
from pathlib import Path

from bytebound import switches

PKG = Path(__file__).resolve().parents[1] / "bytebound"
NAME = re.compile(r"BYTEBOUND_[A-Z0-9_]+")
# environ.get("NAME", "default") or os.environ.get(NAME_CONSTANT) as written in the readers
GET = re.compile(r"environ\.get\(\s*\"(BYTEBOUND_[A-Z0-9_]+)\"\s*(?:,\s*\"([^\"]*)\")?\s*\)")


def sources():
    return {p: p.read_text() for p in PKG.rglob("*.py") if p.name != "switches.py"}


def test_every_name_the_package_reads_is_registered():
    """A new switch read anywhere in the package must be in the registry, or the manifest would not list it."""
    seen = set()
    for text in sources().values():
        seen |= set(NAME.findall(text))
    assert seen, "the scan found no BYTEBOUND_* name at all: the pattern or the package path is wrong"
    missing = seen - set(switches.SWITCHES) - switches.NOT_SWITCHES
    assert not missing, f"read by the package but not in bytebound/switches.py: {sorted(missing)}"
    stale = set(switches.SWITCHES) - seen
    assert not stale, f"registered but read nowhere: {sorted(stale)}"


def test_registered_defaults_match_the_readers():
    """Each ``environ.get(NAME, default)`` in the package falls back to the registry's default (None where the
    reader has no default); a reader with another default would make the manifest list the wrong runs."""
    found = {}
    for text in sources().values():
        for m in GET.finditer(text):         # group 2 is None where the reader gives no default
            if m.group(1) not in switches.NOT_SWITCHES:
                found.setdefault(m.group(1), set()).add(m.group(2))
    assert len(found) >= 12, found
    for name, defaults in found.items():
        want = switches.SWITCHES[name][0]
        assert defaults == {want}, (name, defaults, want)


def test_overrides_lists_only_values_other_than_the_default():
    env = {"BYTEBOUND_ROUTER_SEG": "0", "BYTEBOUND_PDL": "1", "BYTEBOUND_MOE_CONFIG": "/tmp/t.json",
           "BYTEBOUND_PDL_PREFETCH": "", "BYTEBOUND_COMMIT": "abc", "BYTEBOUND_NOT_A_SWITCH": "1"}
    got = switches.overrides(env)
    assert list(got) == ["BYTEBOUND_MOE_CONFIG", "BYTEBOUND_ROUTER_SEG"]
    assert got["BYTEBOUND_ROUTER_SEG"]["value"] == "0" and got["BYTEBOUND_ROUTER_SEG"]["default"] == "1"
    assert switches.overrides({}) == {}


def test_manifest_records_a_switch_set_for_the_run(quant_ckpt, monkeypatch):
    """A run under an A/B switch says so in its manifest (and so in every bench report that embeds it)."""
    from bytebound.engine.engine import Engine, EngineConfig
    from bytebound.verify.manifest import build_manifest, format_manifest
    for name in switches.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    eng = Engine(EngineConfig(model=str(quant_ckpt), max_model_len=64))
    assert build_manifest(eng)["switches"] == {}
    assert "switch set" not in format_manifest(build_manifest(eng))
    monkeypatch.setenv("BYTEBOUND_ROUTER_SEG", "0")
    man = build_manifest(eng)
    assert man["switches"]["BYTEBOUND_ROUTER_SEG"]["value"] == "0"
    assert "switch set: BYTEBOUND_ROUTER_SEG=0 (default 1)" in format_manifest(man)
