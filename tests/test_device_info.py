"""kernels.device.sm_count: the multiprocessor count read once per CUDA device index, a named error elsewhere."""

from __future__ import annotations

import types

import pytest
import torch

from bytebound.kernels import device


def test_sm_count_rejects_a_cpu_device():
    with pytest.raises(ValueError, match="not a CUDA device"):
        device.sm_count("cpu")
    with pytest.raises(ValueError, match="not a CUDA device"):
        device.sm_count(torch.device("cpu"))


def test_sm_count_reads_each_device_once(monkeypatch):
    """Every spelling of a device (index, "cuda:i", torch.device, None = the current one) maps to its index, and
    the properties are read once per index, not once per call."""
    reads = []

    def props(index):
        reads.append(index)
        return types.SimpleNamespace(multi_processor_count=100 + index)

    device._sm_count_of.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    try:
        assert device.sm_count(0) == 100
        assert device.sm_count("cuda:0") == 100
        assert device.sm_count(torch.device("cuda", 2)) == 102
        assert device.sm_count(None) == 101
        assert device.sm_count("cuda") == 101
        assert device.sm_count(torch.device("cuda", 1)) == 101
        assert sorted(reads) == [0, 1, 2]
    finally:
        device._sm_count_of.cache_clear()


def test_register_cap_checked_and_turned_into_a_launch_option():
    """One check for every config's register cap (MoE NR / NR2, GEMV NR): None or an integer in 24..255 passes
    through; anything else is a BackendError that names the key; the launch option is maxnreg or nothing."""
    from bytebound.errors import BackendError
    assert device.check_register_cap(None, "X") is None
    assert device.check_register_cap(24, "X") == 24 and device.check_register_cap(255, "X") == 255
    for bad in (23, 256, 80.0, True, "80"):
        with pytest.raises(BackendError, match=r"^NR2 \(kernel B\) must be an integer in 24\.\.255, got"):
            device.check_register_cap(bad, "NR2 (kernel B)")
    assert device.maxnreg(80) == {"maxnreg": 80}
    assert device.maxnreg(None) == {}
