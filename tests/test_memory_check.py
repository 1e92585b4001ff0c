"""The weights' memory check before materialising a model (``bytebound.checkpoint.memory``): the full-scale
``--load-format dummy`` config on a machine without its ~70 GB was killed by the kernel's out-of-memory killer
after minutes, with no message; now it is a named error at once, from the engine and from the command line."""

from __future__ import annotations

import pytest
import torch

from bytebound.checkpoint import memory
from bytebound.errors import ResourceError
from conftest import ROOT

FULL = ROOT / "bytebound" / "assets" / "configs" / "ling-3.0-flash.json"


def test_meminfo_and_cgroup_parsing(tmp_path):
    mi = tmp_path / "meminfo"
    mi.write_text("MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    assert memory._meminfo_available(mi) == 20000000 * 1024
    mi.write_text("MemTotal: 1 kB\n")
    assert memory._meminfo_available(mi) is None
    assert memory._meminfo_available(tmp_path / "absent") is None
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("5000\n")
    assert memory._cgroup_available(cg) is None                     # no limit
    (cg / "memory.max").write_text("8000\n")
    assert memory._cgroup_available(cg) == 3000
    (cg / "memory.current").write_text("9000\n")
    assert memory._cgroup_available(cg) == 0                        # over the limit already
    assert memory._cgroup_available(tmp_path / "none") is None
    # the CPU's free memory: the smaller of the two, or None where neither is known
    mi.write_text("MemAvailable:   1 kB\n")
    assert memory.free_bytes("cpu", mi, cg) == 0
    (cg / "memory.current").write_text("0\n")
    assert memory.free_bytes("cpu", mi, cg) == 1024
    assert memory.free_bytes("cpu", tmp_path / "absent", tmp_path / "none") is None


def test_ensure_fits(monkeypatch):
    lin = torch.nn.Linear(1000, 1000, device="meta")                # 4,004,000 bytes of float32
    assert memory.module_bytes(lin) == 4 * (1000 * 1000 + 1000)
    memory.ensure_fits(lin, "cpu", "x", free=4_004_000)             # exactly fits
    with pytest.raises(ResourceError, match=r"x: its weights need 0\.0 GB on cpu, which has 0\.0 GB free"):
        memory.ensure_fits(lin, "cpu", "x", free=4_003_999)
    monkeypatch.setenv(memory.SKIP_ENV, "1")
    memory.ensure_fits(lin, "cpu", "x", free=0)                     # the way around it, named in the message


def test_dummy_full_scale_is_a_named_error_before_allocating(monkeypatch):
    """The full config's dummy weights against 8 GB free: ResourceError naming both sizes, from the engine and
    from ``bytebound generate`` (exit 2, one line), before any of the ~70 GB is touched."""
    from bytebound.cli import main
    from bytebound.engine.engine import Engine
    monkeypatch.setattr(memory, "free_bytes", lambda device, *a, **k: 8 * 10**9)
    with pytest.raises(ResourceError, match=r"need [0-9.]+ GB on cpu, which has 8\.0 GB free"):
        Engine(model=str(FULL), load_format="dummy", device="cpu")
    assert main(["generate", "--load-format", "dummy", "--model", str(FULL), "--prompt-ids", "1,2,3",
                 "--max-tokens", "2"]) == 2


def test_checkpoint_load_is_checked(monkeypatch, nano_ckpt):
    from bytebound.checkpoint.loader import load_model
    monkeypatch.setattr(memory, "free_bytes", lambda device, *a, **k: 1000)
    with pytest.raises(ResourceError, match=f"checkpoint {nano_ckpt}"):
        load_model(nano_ckpt)
    monkeypatch.setattr(memory, "free_bytes", lambda device, *a, **k: 10**12)
    assert load_model(nano_ckpt) is not None
