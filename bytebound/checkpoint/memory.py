"""Whether a model's weights fit the device's free memory, asked before they are materialised.

Why: a model built on the meta device and then ``to_empty`` on the CPU gets its pages only as they are written,
so a model larger than the machine's memory (the full Ling-3.0-flash config's ~70 GB of ``--load-format dummy``
weights on a 24 GB machine) is killed by the kernel's out-of-memory killer minutes later, with no message. The
check turns that into a named error at once. On CUDA the allocation itself would fail, but only after the slow
part of the start; the same check names the sizes first.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from bytebound.errors import ResourceError

SKIP_ENV = "BYTEBOUND_SKIP_MEMORY_CHECK"


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (also on the meta device, where nothing is allocated)."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _meminfo_available(path: Path) -> int | None:
    """``MemAvailable`` of a ``/proc/meminfo``-format file in bytes, or None where it is missing."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available(root: Path) -> int | None:
    """``memory.max - memory.current`` of a cgroup v2 directory in bytes (a container's limit), or None where
    there is no limit or no such files."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def free_bytes(device, meminfo: Path = Path("/proc/meminfo"),
               cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Memory that ``device`` can still give, in bytes, or None where it cannot be told.

    CUDA: ``torch.cuda.mem_get_info``'s free bytes. CPU: the smaller of the kernel's ``MemAvailable`` (free plus
    reclaimable page cache, Linux) and the cgroup v2 limit left (``memory.max - memory.current``, a container's);
    None on systems without either (the check is then skipped)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    got = [v for v in (_meminfo_available(meminfo), _cgroup_available(cgroup)) if v is not None]
    return min(got) if got else None


def ensure_fits(module: torch.nn.Module, device, what: str, free: int | None = None) -> None:
    """Raise before ``module`` (built on the meta device) is materialised on ``device`` if its weights alone exceed
    the device's free memory (:func:`free_bytes`, or ``free`` when given). The engine needs more than the weights
    (caches, activations), so passing this check is necessary, not sufficient. Skipped when the environment
    variable ``BYTEBOUND_SKIP_MEMORY_CHECK`` is ``1`` (e.g. on a machine with swap).

    Raises:
        ResourceError: the weights do not fit; the message gives both sizes and the way around it."""
    if os.environ.get(SKIP_ENV) == "1":
        return
    need = module_bytes(module)
    have = free_bytes(device) if free is None else free
    if have is None or need <= have:
        return
    raise ResourceError(f"{what}: its weights need {need / 1e9:.1f} GB on {torch.device(device)}, which has "
                        f"{have / 1e9:.1f} GB free; use a device with more memory (--device cuda) or a smaller "
                        f"model (e.g. models/ling-nano), or set {SKIP_ENV}=1 to try anyway")
