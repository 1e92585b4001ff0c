"""Facts about the CUDA device that the kernels' launch configs depend on, each read once per device, and the
register cap per thread a launch config may set.

The launch grids of the FP8 GEMV/GEMM, the KDA and MLA decode kernels and the MoE's persistent and ring kernels
size themselves to the multiprocessor count; reading it through ``torch.cuda.get_device_properties`` on every call
costs host time inside the decode step, so it is cached here per device index, in one place. The register caps
(config keys ``NR`` / ``NR2`` of the ``split`` MoE kernels, ``NR`` of the MMA FP8 GEMV: ptxas ``maxnreg``) are
checked and turned into launch options by :func:`check_register_cap` and :func:`maxnreg`.
"""

from __future__ import annotations

import functools

import torch

from bytebound.errors import BackendError

# ptxas' maxnreg range on sm_90: below 24 a kernel cannot hold its fixed registers, above 255 there are none
REGISTER_CAP_RANGE = (24, 255)


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


def check_register_cap(value, what: str):
    """``value`` (a config's register cap, or None for none) if it is an integer in :data:`REGISTER_CAP_RANGE`.

    Raises:
        BackendError: anything else, named by ``what`` (e.g. ``"moe[triton] variant 'split': NR (kernel A's
            register cap per thread)"``); a bool is not an integer here."""
    lo, hi = REGISTER_CAP_RANGE
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi):
        raise BackendError(f"{what} must be an integer in {lo}..{hi}, got {value!r}")
    return value


def maxnreg(value) -> dict:
    """The launch option of a checked register cap: ``{"maxnreg": value}``, or ``{}`` for None (no cap)."""
    return {"maxnreg": int(value)} if value else {}
