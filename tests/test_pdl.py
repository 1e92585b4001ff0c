"""``kernels.pdl.early``: which kernels launch early with an L2 prefetch (``BYTEBOUND_PDL_PREFETCH``, read per
launch; default none, as the H200 A/B showed no gain), and never where PDL itself is off."""

from __future__ import annotations

import torch

from bytebound.kernels import pdl


def test_early_follows_the_env_list_and_pdl(monkeypatch):
    dev = torch.device("cuda")
    monkeypatch.setattr(pdl, "enabled", lambda d: True)
    monkeypatch.delenv("BYTEBOUND_PDL_PREFETCH", raising=False)
    assert not pdl.early("router", dev) and not pdl.early("kda", dev)
    monkeypatch.setenv("BYTEBOUND_PDL_PREFETCH", "router,kda")
    assert pdl.early("router", dev) and pdl.early("kda", dev)
    monkeypatch.setenv("BYTEBOUND_PDL_PREFETCH", "kda")
    assert pdl.early("kda", dev) and not pdl.early("router", dev)
    monkeypatch.setenv("BYTEBOUND_PDL_PREFETCH", "")
    assert not pdl.early("kda", dev)
    monkeypatch.setattr(pdl, "enabled", lambda d: False)     # PDL off (CPU, interpreter, BYTEBOUND_PDL=0)
    monkeypatch.setenv("BYTEBOUND_PDL_PREFETCH", "router,kda")
    assert not pdl.early("router", dev) and not pdl.early("kda", torch.device("cpu"))
