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


def fuse_layout(parts: list[QLinear], pad: bool = False) -> tuple[list[tuple[int, int]], int] | str:
    """Where each of ``parts`` sits in the rows of one fused weight (:func:`fuse_rows`), or why they cannot share one.

    Returns ``([(start, stop), ...], rows)``: part ``i``'s output is rows ``start:stop`` of the fused output,
    ``rows`` the fused weight's row count. Plain weights are stacked as they are. An FP8 part's rows must begin on
    a scale-block edge (``block[0]`` rows) so that its ``weight_scale_inv`` rows stay its own; every part but the
    last must therefore end on one too (the last one's tail is its own partial block). With ``pad`` a part that
    does not is followed by zero rows up to the next edge (their scale is the part's last block row, which they
    share), else the parts are refused. Returns a reason string (for the plan's record) when the parts differ in
    format, block, input size, dtype or device, or (without ``pad``) an FP8 part ends inside a scale block.
    """
    if not parts:
        return "no projections to fuse"
    p0 = parts[0]
    for p in parts[1:]:
        for what, a, b in (("format", p.fmt, p0.fmt), ("scale block", tuple(p.block), tuple(p0.block)),
                           ("input size", p.in_features, p0.in_features), ("dtype", p.weight.dtype, p0.weight.dtype),
                           ("device", p.weight.device, p0.weight.device)):
            if a != b:
                return f"{what} differs ({b} vs {a})"
    edge = p0.block[0] if p0.fmt == "fp8" else 1
    spans, r = [], 0
    for i, p in enumerate(parts):
        spans.append((r, r + p.out_features))
        r += p.out_features
        if i < len(parts) - 1 and r % edge:
            if not pad:
                return (f"FP8 rows of a part end inside a {edge}-row scale block ({p.out_features} rows); "
                        "fuse_rows(pad=True) pads them")
            r += edge - r % edge
    return spans, r


def fuse_rows(parts: list[QLinear], pad: bool = False) -> QLinear | None:
    """One QLinear whose output holds ``parts``' outputs side by side (same input, format and block), so several
    projections of one input cost one launch. The layout is :func:`fuse_layout`'s, recorded on the result as
    ``row_spans`` (``[(start, stop)]`` per part: slice the fused output with them); with ``pad`` FP8 parts that end
    inside a scale block are followed by zero rows (their outputs are zeros, never read), so each part keeps its
    own scale rows. The parts' parameters become row views of the fused tensors (no extra memory beyond the
    padding rows; checkpoint names and the state dict are unchanged). Returns None when :func:`fuse_layout` refuses
    the parts (different format, block, input size or device; FP8 rows off block edges without ``pad``).
    """
    layout = fuse_layout(parts, pad)
    if isinstance(layout, str):
        return None
    spans, rows = layout
    p0 = parts[0]
    fused = QLinear(p0.in_features, rows, p0.fmt, p0.block, p0.weight.dtype, p0.weight.device)
    fp8 = p0.fmt == "fp8"
    with torch.no_grad():
        # as bytes (the parts share one dtype): no fill or copy kernel of the E4M3 dtype is needed on any device
        w = fused.weight.data.view(torch.uint8)
        w.zero_()                                           # the padding rows (the parts' rows are copied over)
        for p, (a, b) in zip(parts, spans):
            w[a:b].copy_(p.weight.data.contiguous().view(torch.uint8))
        if fp8:
            fused.weight_scale_inv.data = torch.cat([p.weight_scale_inv.data for p in parts])
    s = 0
    for p, (a, b) in zip(parts, spans):                     # re-point the parts at their rows of the fused tensors
        p.weight.data = fused.weight.data[a:b]
        if fp8:
            n = p.weight_scale_inv.shape[0]
            p.weight_scale_inv.data = fused.weight_scale_inv.data[s:s + n]
            s += n
    fused.row_spans = spans
    return fused
