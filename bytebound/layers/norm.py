"""RMSNorm and the gated RMSNorm of KDA outputs (float32 statistics, as transformers and fla do)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``y = w * x / sqrt(mean(x^2) + eps)`` over the last dim; stats in float32, result in x's dtype.

    Shapes: ``x [..., D]``, ``weight [D]``. eps from ``rms_norm_eps`` (1e-6 for Ling-3.0).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fn = None      # a fused kernel bound at load (kernels.triton_norm), same rounding
        self.add_fn = None  # the residual add + this norm as one kernel (kernels.triton_norm.add_rmsnorm)

    def add_norm(self, delta: torch.Tensor | None, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before this norm, and the norm: ``(x, h')`` with ``h' = h + delta`` and
        ``x = RMSNorm(h')`` (vLLM's ``RMSNorm(x, residual)``, SGLang/vLLM ``fused_add_rms_norm``).

        ``delta [..., D]``: the previous sublayer's output, or None (nothing to add: ``h' = h``); ``h [..., D]``:
        the residual stream. Both results in h's dtype. Unbound, or for a delta the bound kernel does not take
        (another dtype), it is torch's ``h + delta`` then :meth:`forward`, the same ops in the same order as an
        unfused block; the bound kernel (``add_fn``) does both in one launch with the same roundings (the sum
        bit-equal, the norm as ``fn``)."""
        if delta is None:
            return self(h), h
        if self.add_fn is not None and delta.dtype == h.dtype and delta.shape == h.shape:
            return self.add_fn(delta, h, self.weight, self.eps)
        h = h + delta
        return self(h), h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fn is not None:
            return self.fn(x, self.weight, self.eps)
        w = self.weight
        if x.dtype == torch.float32 and w.dtype == torch.float32:
            # float32 throughout (CPU): torch's fused RMSNorm, the same maths in one op (no casts to do)
            return F.rms_norm(x, w.shape, w, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # The weight may be stored in another dtype (float32 norms in a bf16 model): the result keeps x's dtype.
        return (self.weight * xf.to(x.dtype)).to(x.dtype)


class RMSNormGated(nn.Module):
    """KDA output norm: ``RMSNorm_D(o) * w * sigmoid(gate)``, all in float32 (fla ``FusedRMSNormGated``).

    Shapes: ``o, gate [..., D]`` (D = head_dim, applied per head); returns o's dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fn = None      # a fused kernel bound at load (kernels.triton_norm), same rounding

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.fn is not None:
            return self.fn(o, gate, self.weight, self.eps)
        w = self.weight
        if o.dtype == torch.float32 and w.dtype == torch.float32 and gate.dtype == torch.float32:
            return F.rms_norm(o, w.shape, w, self.eps) * torch.sigmoid(gate)      # as below, in fewer ops
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (of * torch.sigmoid(gate.float())).to(o.dtype)
