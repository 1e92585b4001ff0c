"""RMSNorm and KDA's gated RMSNorm as single Triton kernels (one program per row).

In torch each norm is 7-10 launches (up-cast, square, mean, add, rsqrt, multiplies, casts). The decode step runs
about 134 of them per token: 42 input and 42 post-attention norms, the final norm, the MLA latent norms and
35 KDA output norms. At batch 1 each launch costs microseconds while moving a few KB. These kernels do one
launch per norm and round exactly where ``layers.norm`` rounds:

* ``rmsnorm``: ``y = dtype(w * dtype(x * rsqrt(mean(x^2) + eps)))``. The normalised value is rounded to x's
  dtype before the weight multiply, as ``RMSNorm.forward`` does.
* ``rmsnorm_gated``: ``y = dtype(x * rsqrt(mean(x^2) + eps) * w * sigmoid(gate))``, all in float32
  (``RMSNormGated``, fla ``FusedRMSNormGated``).

Statistics are float32. Rows are the flattened leading dims; D <= 8192. Tested against ``layers.norm`` in the
Triton interpreter on CPU and on the H200 (tests/test_triton_norm.py). At full scale the 42 input norms went from
0.65 to 0.075 ms per token (docs/perf/decode-h200.md). On with CUDA by default (``EngineConfig.fused_norm`` /
``--no-fused-norm``); the full-scale spec_vs_plain failure once blamed on the fast paths was a routing near-tie
that the committed defaults hit too (docs/perf/gpu-tests-h200.md).
"""

from __future__ import annotations

import torch

from bytebound.errors import BackendError
from bytebound.kernels.registry import optional_triton

MAX_D = 8192

triton, tl, _TRITON_ERR = optional_triton()      # None, None, reason on machines without Triton


if tl is not None:
    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, g_ptr, y_ptr, eps, D: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BD)
        mask = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            g = tl.load(g_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            y = x * r * w * tl.sigmoid(g)
        else:
            y = w * (x * r).to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
        tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _launch(x: torch.Tensor, w: torch.Tensor, eps: float, gate: torch.Tensor | None) -> torch.Tensor:
    if _TRITON_ERR:
        raise BackendError(f"norm[triton]: {_TRITON_ERR}")
    d = x.shape[-1]
    if d > MAX_D or w.numel() != d:
        raise BackendError(f"norm[triton]: needs D <= {MAX_D} and a weight of D elements (D={d}, w={w.numel()})")
    x2 = x.reshape(-1, d).contiguous()
    y = torch.empty_like(x2)
    g2 = gate.reshape(-1, d).contiguous() if gate is not None else x2
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](x2, w, g2, y, float(eps), D=d, BD=triton.next_power_of_2(d),
                                        GATED=gate is not None, num_warps=4 if d <= 2048 else 8)
    return y.view(x.shape)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]`` (any float dtype), ``w [D]`` -> ``[..., D]`` in x's dtype, as ``layers.norm.RMSNorm``."""
    return _launch(x, w, eps, None)


def rmsnorm_gated(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x, gate [..., D]``, ``w [D]`` -> ``[..., D]`` in x's dtype, as ``layers.norm.RMSNormGated``."""
    if gate.shape != x.shape:
        raise BackendError(f"norm[triton]: gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
    return _launch(x, w, eps, gate)
