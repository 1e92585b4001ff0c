"""Backend ``fla`` of op ``kda``: fla-core's Triton KDA kernels (``chunk_kda`` for T > 1, ``fused_recurrent_kda``
for T == 1).

Contract (``bytebound.kernels.torch_ref`` / ``layers.kda.torch_kda``): ``fn(q, k, v, g, beta, state) -> (o [B, T, H,
V], new_state [B, H, K, V] float32)`` with q, k **not** L2-normalised (fla's ``use_qk_l2norm_in_kernel=True``),
scale ``K**-0.5``, ``g`` the log decay (the layer already applied the safe gate), ``beta`` post-sigmoid.

Decode (T == 1) updates the recurrent state **in place** by default (``fused_recurrent_kda_fwd(...,
inplace_final_state=True)``) and returns that same tensor: the layer's ``state.rec.copy_(new)`` is then a
self-copy that PyTorch skips, so one decode step reads and writes the 2 MB state once instead of allocating and
copying another 4 MB. A caller that needs the input state unchanged (e.g. a speculative snapshot) must clone it
first - ``runner.graphs`` already snapshots by clone. ``FlaKDA(inplace=False)`` or ``BYTEBOUND_KDA_INPLACE=0``
returns a fresh state instead. With ``state=None`` a zero state is allocated.

Graph capture: T == 1 launches one Triton kernel (no host sync, no allocation in place mode except ``o``).
``chunk_kda`` (prefill) allocates and is meant for eager use.
"""

from __future__ import annotations

import os

import torch

from bytebound.errors import BackendError
from bytebound.kernels.registry import cuda_only, pinned_package, register

FLA_VERSION = "0.6.0"


CONFIGS: str | None = None     # what kernels.fla_configs.apply did (recorded in the manifest)


def available(dev) -> str | None:
    global CONFIGS
    why = cuda_only(dev) or pinned_package("fla-core", FLA_VERSION)
    if why:
        return why
    if CONFIGS is None:             # before fla-core's first import, which reads the variables apply sets
        from bytebound.kernels import fla_configs
        CONFIGS = fla_configs.apply(dev)
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: F401
    except Exception as exc:
        return f"fla.ops.kda is not importable: {exc}"
    if CONFIGS.startswith("shipped") and "plain" not in CONFIGS:
        from bytebound.kernels import fla_configs
        CONFIGS += f"; {fla_configs.restrict_plain_autotuners()} plain Triton autotuners held to the shipped config"
    return None


def _c(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def make_kda_fn(inplace: bool = True):
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    def kda(q, k, v, g, beta, state):
        b, t, h, dk = q.shape
        q, k, v, g, beta = _c(q), _c(k), _c(v), _c(g.float()), _c(beta.float())
        if state is not None and state.dtype != torch.float32:
            raise BackendError(f"kda[fla]: state must be float32, got {state.dtype}")
        if t == 1:
            if state is None:
                state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=q.device)
            elif not inplace:
                state = state.clone()
            elif not state.is_contiguous():
                raise BackendError("kda[fla]: in-place decode needs a contiguous state")
            o, new = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=state, scale=dk ** -0.5,
                                             output_final_state=True, inplace_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
            return o, new
        o, new = chunk_kda(q, k, v, g, beta, scale=dk ** -0.5,
                           initial_state=None if state is None else _c(state),
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o, new.float()
    return kda


@register("kda", "fla", available)
class FlaKDA:
    """fla-core KDA; see the module docstring (in-place decode state)."""
    name = "fla"

    def __init__(self, inplace: bool | None = None):
        if inplace is None:
            inplace = os.environ.get("BYTEBOUND_KDA_INPLACE", "1") != "0"
        self.inplace = inplace

    def bind(self, layer, dtype):
        return make_kda_fn(self.inplace)
