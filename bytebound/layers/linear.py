"""Dense projections stored as the checkpoint stores them: plain (BF16/FP32) or FP8 E4M3 with 128x128 scales.

A :class:`QLinear` is *bound* once at load to a ``linear`` backend (``bytebound.kernels``): the backend's
``prepare`` turns the stored tensors into whatever it reads per call (the torch reference dequantises once
to the compute dtype; the Triton GEMV reads FP8 bytes). Unbound (training, tests) it dequantises per call.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bytebound.quant import FP8, dequantize_fp8_block


class QLinear(nn.Module):
    """``y = x W^T`` with ``W [out, in]``; no bias (Ling has none).

    Args:
        fmt: ``"plain"`` (``weight`` in ``dtype``) or ``"fp8"`` (``weight`` float8_e4m3fn ``[out, in]`` and
            ``weight_scale_inv`` float32 ``[ceil(out/bn), ceil(in/bk)]``).
    """

    def __init__(self, in_features: int, out_features: int, fmt: str = "plain",
                 block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.block = in_features, out_features, fmt, block
        if fmt == "fp8":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device),
                                       requires_grad=False)
            nb, kb = -(-out_features // block[0]), -(-in_features // block[1])
            self.weight_scale_inv = nn.Parameter(torch.ones(nb, kb, dtype=torch.float32, device=device),
                                                 requires_grad=False)
        elif fmt == "plain":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        else:
            raise ValueError(f"QLinear fmt must be 'plain' or 'fp8', got {fmt!r}")
        self.fn: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.backend: str | None = None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as ``[out, in]`` in ``dtype`` (FP8: ``q * scale_inv`` per block)."""
        if self.fmt == "fp8":
            return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fn is not None:
            return self.fn(x)
        return F.linear(x, self.dequantized(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, fmt={self.fmt}, backend={self.backend}"


def fuse_rows(parts: list[QLinear]) -> QLinear | None:
    """One QLinear whose output is the concatenation of ``parts``' outputs (same input, format and block), so
    several projections of one input cost one launch. The parts' parameters become row views of the fused
    tensors (no extra memory; checkpoint names and the state dict are unchanged). Returns None when the parts
    cannot share one weight (different format, block or input size, or FP8 rows not on scale-block edges).
    """
    p0 = parts[0]
    if any(p.fmt != p0.fmt or tuple(p.block) != tuple(p0.block) or p.in_features != p0.in_features
           or p.weight.device != p0.weight.device for p in parts):
        return None
    if p0.fmt == "fp8" and any(p.out_features % p0.block[0] for p in parts):
        return None
    out = sum(p.out_features for p in parts)
    fused = QLinear(p0.in_features, out, p0.fmt, p0.block, p0.weight.dtype, p0.weight.device)
    with torch.no_grad():
        fused.weight.data = torch.cat([p.weight.data for p in parts])
        if p0.fmt == "fp8":
            fused.weight_scale_inv.data = torch.cat([p.weight_scale_inv.data for p in parts])
    r = s = 0
    for p in parts:                                         # re-point the parts at their rows of the fused tensors
        p.weight.data = fused.weight.data[r:r + p.out_features]
        r += p.out_features
        if p0.fmt == "fp8":
            n = p.weight_scale_inv.shape[0]
            p.weight_scale_inv.data = fused.weight_scale_inv.data[s:s + n]
            s += n
    return fused
