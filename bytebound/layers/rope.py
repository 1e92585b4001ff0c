"""Rotary embedding for MLA's 64 rope dims: interleaved (GPT-J) pairs, optional DeepSeek-style YaRN.

YaRN follows transformers ``_compute_yarn_parameters`` (beta_fast 32, beta_slow 1, truncated correction
range, ``attention_factor = 0.1 ln(factor) + 1`` on cos/sin unless given; arXiv 2309.00071). Ling's recipe
sets ``factor 2, original_max_position_embeddings 131072`` (``docs/references.md`` §1.4).
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim/2]`` float32 and the cos/sin amplitude (YaRN attention factor, else 1)."""
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv = 1.0 / pos
    rt = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rt != "yarn":
        return inv.float(), 1.0
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    att = scaling.get("attention_factor")
    if att is None:
        m, mad = scaling.get("mscale"), scaling.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, mad) if (m and mad) else mscale(factor)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp
    inv = (inv / factor) * (1 - extrap) + inv * extrap
    return inv.float(), float(att)


def mla_softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` only when the config sets mscale_all_dim."""
    s = qk_head_dim ** -0.5
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        mad = scaling.get("mscale_all_dim", 0)
        if mad:
            m = 0.1 * mad * math.log(float(scaling["factor"])) + 1.0 if float(scaling["factor"]) > 1 else 1.0
            s = s * m * m
    return s


class Rope(torch.nn.Module):
    """Applies interleaved RoPE to ``x [..., T, D]`` (pairs ``(x0, x1), (x2, x3), ...``) at ``positions [T]``."""

    def __init__(self, dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.dim, self.theta, self.scaling = dim, theta, scaling
        inv, att = rope_inv_freq(dim, theta, scaling)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.attention_factor = att

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` (needed after ``Module.to_empty``, which leaves buffers uninitialised)."""
        inv, _ = rope_inv_freq(self.dim, self.theta, self.scaling)
        self.inv_freq.copy_(inv.to(self.inv_freq.device))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` int64 -> cos, sin ``[T, D/2]`` float32 (amplitude-scaled for YaRN)."""
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        return ang.cos() * self.attention_factor, ang.sin() * self.attention_factor

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate each interleaved pair; ``x [..., T, D]``, cos/sin broadcast as ``[T, D/2]``. Keeps the layout."""
        xf = x.float()
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return out.to(x.dtype)
