"""Facts about the CUDA device that the kernels' launch configs depend on, each read once per device.

The launch grids of the FP8 GEMV/GEMM, the KDA and MLA decode kernels and the MoE's persistent and ring kernels
size themselves to the multiprocessor count; reading it through ``torch.cuda.get_device_properties`` on every call
costs host time inside the decode step, so it is cached here per device index, in one place.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device | str | int | None = None) -> int:
    """Streaming multiprocessors on CUDA ``device`` (an index, a ``torch.device``, a string such as ``"cuda:1"``,
    or None for the current device), cached per device index.

    Raises:
        ValueError: ``device`` names a device that is not CUDA.
        RuntimeError / AssertionError: from torch, when CUDA is absent or the index does not exist."""
    if isinstance(device, int):
        return _sm_count_of(device)
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        raise ValueError(f"sm_count: {dev} is not a CUDA device")
    return _sm_count_of(dev.index if dev.index is not None else torch.cuda.current_device())
