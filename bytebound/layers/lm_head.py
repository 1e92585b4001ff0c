"""The untied LM head and its three paths (``docs/references.md`` §3).

* ``bf16``: the checkpoint's BF16 weight, BF16 product, logits cast to float32 afterwards.
* ``fp32``: BF16 weight, float32 accumulation and output (SGLang ``--enable-fp32-lm-head``, the seed's baseline).
* ``fp8``: *online* FP8 - at load the BF16 weight ``[V, H]`` is quantised to E4M3 per output channel
  (``scale [V]`` float32, SGLang ``Fp8LinearMethod`` channelwise); per call the hidden state is quantised per
  token (dynamic scale), the product accumulates in float32 and the logits are float32.

The module *is* the head: the MTP draft must call this same object (issue 6/7), never its weight tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bytebound.quant import quantize_fp8_channel

HEAD_MODES = ("bf16", "fp32", "fp8")


class LMHead(nn.Module):
    """``logits [.., V] float32 = head(hidden [.., H])``. ``weight [V, H]`` as loaded (BF16 in the checkpoint)."""

    def __init__(self, vocab: int, hidden: int, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype, device=device))
        self.mode = "bf16"
        self.fn = None          # bound backend callable (x [M, H]) -> float32 [M, V]
        self.backend: str | None = None
        self.w_fp8: torch.Tensor | None = None
        self.w_scale: torch.Tensor | None = None

    def quantize_fp8(self) -> None:
        """Online FP8: E4M3 per output channel from the loaded weight (done once, at load)."""
        self.w_fp8, self.w_scale = quantize_fp8_channel(self.weight.detach())

    def configure(self, mode: str) -> None:
        """Select the path (``bf16``/``fp32``/``fp8``); ``fp8`` quantises now. Raises ValueError on others."""
        if mode not in HEAD_MODES:
            raise ValueError(f"LM head mode must be one of {HEAD_MODES}, got {mode!r}")
        self.mode = mode
        if mode == "fp8" and self.w_fp8 is None:
            self.quantize_fp8()

    def bytes_per_call(self) -> int:
        """Weight bytes one call reads: V*H*2 (BF16) or V*H + 4V (FP8 + per-channel scales)."""
        v, h = self.weight.shape
        return v * h + 4 * v if self.mode == "fp8" else v * h * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head_logits(self, x)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Greedy tokens ``[..]`` int64 for ``x [.., H]``: :func:`head_argmax` of this module, or, when forward hooks
        change what the module returns (tensor parallelism all-gathers the vocabulary shards' logits), the argmax
        of its forward."""
        from torch.nn.modules import module as _m
        if (self._forward_hooks or self._forward_pre_hooks or getattr(_m, "_global_forward_hooks", None)
                or getattr(_m, "_global_forward_pre_hooks", None)):
            return self(x).argmax(-1)
        return head_argmax(self, x)


def head_logits(head, x: torch.Tensor) -> torch.Tensor:
    """Logits ``[.., N]`` float32 of ``x [.., H]`` through ``head``'s bound backend (``head.fn``), else the torch
    reference of its mode: :class:`LMHead` and the hot-vocabulary draft head (``speculative.hot_vocab.HotHead``)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if head.fn is not None:
        out = head.fn(x2)
    else:
        from bytebound.kernels.torch_ref import lm_head_reference
        out = lm_head_reference(head, x2)
    return out.view(*shape[:-1], out.shape[-1])


def head_argmax(head, x: torch.Tensor, index_map: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids ``[..]`` int64: the argmax over ``head_logits(head, x)``'s last axis (torch's tie rule, the lowest
    id). Where the bound backend reduces it inside the head kernel (``head.fn.argmax``, the FP8 head at M <= 4 on
    CUDA: ``kernels.triton_fp8.fp8_head_argmax``) the logits are never written; it returns None for calls it does
    not take, which then run the logits and torch's argmax. Either way the values compared are the same float32
    logits. ``index_map [N]`` int64 (optional): return ``index_map[argmax]``, e.g. the vocabulary ids of a row
    subset of the head (gathered inside the kernel on the fused path)."""
    fused = getattr(head.fn, "argmax", None) if head.fn is not None else None
    if fused is not None:
        x2 = x.reshape(-1, x.shape[-1])
        ids = fused(x2) if index_map is None else fused(x2, index_map)
        if ids is not None:
            return ids.view(x.shape[:-1])
    i = head_logits(head, x).argmax(-1)
    if index_map is None:
        return i
    # index_select, not index_map[i]: never a 0-d index (a host sync, which would break graph capture)
    return index_map.index_select(0, i.reshape(-1)).view(i.shape)


def bf16_logits(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """BF16 path: ``(x.to(w) @ w^T).float()``."""
    return F.linear(x.to(weight.dtype), weight).float()
