"""Per-device scratch buffers shared by the decode kernels that run one after another on one stream.

The ``split`` MoE kernels (``kernels.triton_moe_split``: activations, partials, tickets), the fused MoE kernels'
``partials`` mode (``kernels.triton_moe_variants``), the one-launch router (``kernels.triton_router.gemv_route``:
logits, ticket), the TMA-ring form of the split kernel A (``kernels.triton_moe_ring``: ``ring_info``, one row of
slot experts per program), the fused KDA kernel (``kernels.triton_kda``: ``kda_work``, tickets), the MLA merge
(``kernels.triton_mla``: ``mla_y``, ``mla_tickets``), the split-K FP8 GEMV and the FP8 head's fused argmax
(``kernels.triton_fp8``: ``gemv_*``, ``head_argmax_*``) each need a workspace per launch, but never two at once: the
MoE layers and their routers run in sequence on one stream and each launch has consumed its scratch before the next
one writes it. So one buffer per ``(device, name)`` serves every layer (at full scale 15.7 MB of MoE partials
instead of 0.6 GB for 40 per-layer copies). The price: such kernels must not run concurrently on two streams.
"""

from __future__ import annotations

import torch

_BUFFERS: dict = {}        # (device, name) -> [buffers, smallest first]; the last one is current


def device_key(device) -> str:
    """``device`` with its index made explicit: ``"cuda"`` names the current CUDA device, so a caller passing
    ``"cuda"`` and a kernel wrapper passing its tensor's ``cuda:0`` share one buffer."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def scratch(device, name: str, numel: int, dtype=torch.float32) -> torch.Tensor:
    """A zero-initialised buffer ``name`` of at least ``numel`` elements of ``dtype`` on ``device``, shared by
    every caller of that name on that device (module docstring).

    Ticket buffers stay zero between launches (each launch resets its own). Growing a buffer keeps the older ones
    alive, because a captured CUDA graph holds their addresses. A buffer is allocated (or grown) on the first call
    of a shape, which must therefore happen before capture.

    ``device``: a torch device or its name; ``"cuda"`` is the current CUDA device (the same buffers as its
    ``cuda:<index>``).

    Returns:
        a 1-D tensor of ``numel`` or more elements (the current buffer of that name, not a fresh one)."""
    bufs = _BUFFERS.setdefault((device_key(device), name), [])
    if not bufs or bufs[-1].numel() < numel:
        bufs.append(torch.zeros(numel, dtype=dtype, device=device))
    return bufs[-1]
