"""RMSNorm and KDA's gated RMSNorm as single Triton kernels (one program per row).

In torch each norm is 7-10 launches (up-cast, square, mean, add, rsqrt, multiplies, casts). The decode step runs
about 134 of them per token: 42 input and 42 post-attention norms, the final norm, the MLA latent norms and
35 KDA output norms. At batch 1 each launch costs microseconds while moving a few KB. These kernels do one
launch per norm and round exactly where ``layers.norm`` rounds:

* ``rmsnorm``: ``y = dtype(w * dtype(x * rsqrt(mean(x^2) + eps)))``. The normalised value is rounded to x's
  dtype before the weight multiply, as ``RMSNorm.forward`` does.
* ``rmsnorm_gated``: ``y = dtype(x * rsqrt(mean(x^2) + eps) * w * sigmoid(gate))``, all in float32
  (``RMSNormGated``, fla ``FusedRMSNormGated``).
* ``add_rmsnorm``: the residual add of the block before it fused in (vLLM/SGLang ``fused_add_rms_norm``):
  ``h = dtype(h + delta)`` (written out, bit-equal to torch's add), then ``rmsnorm(h)``. Every sublayer boundary
  of the decoder (``RMSNorm.add_norm``) uses it, so the residual adds cost no launch of their own.

Statistics are float32. Rows are the flattened leading dims; D <= 8192. Tested against ``layers.norm`` in the
Triton interpreter on CPU and on the H200 (tests/test_triton_norm.py). At full scale the 42 input norms went from
0.65 to 0.075 ms per token (docs/perf/decode-h200.md). On with CUDA by default (``EngineConfig.fused_norm`` /
``--no-fused-norm``); the full-scale spec_vs_plain failure once blamed on the fast paths was a routing near-tie
that the committed defaults hit too (docs/perf/gpu-tests-h200.md).
"""

from __future__ import annotations

import torch

from bytebound.errors import BackendError
from bytebound.kernels.pdl import enabled as pdl_enabled
from bytebound.kernels.registry import optional_triton

MAX_D = 8192

triton, tl, _TRITON_ERR = optional_triton()      # None, None, reason on machines without Triton


if tl is not None:
    from bytebound.kernels.pdl import enter as pdl_enter

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, g_ptr, y_ptr, r_ptr, ro_ptr, eps, D: tl.constexpr, BD: tl.constexpr,
                        GATED: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr = False,
                        NTH: tl.constexpr = 128):
        pdl_enter(PDL, NTH)         # kernels.pdl: nothing is read before the previous kernel completed
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BD)
        mask = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD:
            # the residual add, rounded to the stream's dtype as torch's ``h + delta`` rounds it (float32 sum of
            # the two values, one rounding); the norm then reads that rounded sum, as the unfused path does
            x = x + tl.load(r_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            x = x.to(ro_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(ro_ptr + row * D + cols, x, mask=mask)
            x = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            g = tl.load(g_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            y = x * r * w * tl.sigmoid(g)
        else:
            y = w * (x * r).to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
        tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _check(x: torch.Tensor, w: torch.Tensor) -> int:
    if _TRITON_ERR:
        raise BackendError(f"norm[triton]: {_TRITON_ERR}")
    d = x.shape[-1]
    if d > MAX_D or w.numel() != d:
        raise BackendError(f"norm[triton]: needs D <= {MAX_D} and a weight of D elements (D={d}, w={w.numel()})")
    return d


def _grid_launch(x2, w, g2, y, r2, ro, eps, gated: bool, add: bool) -> None:
    d = x2.shape[-1]
    if x2.shape[0]:
        nw = 4 if d <= 2048 else 8
        pdl = pdl_enabled(x2.device)
        _rmsnorm_kernel[(x2.shape[0],)](x2, w, g2, y, r2, ro, float(eps), D=d, BD=triton.next_power_of_2(d),
                                        GATED=gated, ADD=add, PDL=pdl, NTH=32 * nw, num_warps=nw,
                                        **({"launch_pdl": True} if pdl else {}))


def _launch(x: torch.Tensor, w: torch.Tensor, eps: float, gate: torch.Tensor | None) -> torch.Tensor:
    d = _check(x, w)
    x2 = x.reshape(-1, d).contiguous()
    y = torch.empty_like(x2)
    g2 = gate.reshape(-1, d).contiguous() if gate is not None else x2
    _grid_launch(x2, w, g2, y, x2, y, eps, gate is not None, False)
    return y.view(x.shape)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]`` (any float dtype), ``w [D]`` -> ``[..., D]`` in x's dtype, as ``layers.norm.RMSNorm``."""
    return _launch(x, w, eps, None)


def rmsnorm_gated(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x, gate [..., D]``, ``w [D]`` -> ``[..., D]`` in x's dtype, as ``layers.norm.RMSNormGated``."""
    if gate.shape != x.shape:
        raise BackendError(f"norm[triton]: gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
    return _launch(x, w, eps, gate)


def add_rmsnorm(delta: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused into the next RMSNorm (vLLM/SGLang ``fused_add_rms_norm``), one launch, out of place.

    Args:
        delta: ``[..., D]`` a sublayer's output; h: the residual stream, same shape and dtype; w: ``[D]``.

    Returns:
        ``(x, h_new)``, both ``[..., D]`` in h's dtype: ``h_new = h + delta`` rounded once, bit-equal to torch's
        add, and ``x = RMSNorm(h_new)`` rounded as :func:`rmsnorm` (``layers.norm.RMSNorm.add_norm``).

    Raises:
        BackendError: Triton missing, D above ``MAX_D``, a weight not of D elements, or ``delta`` of another shape
            or dtype than ``h`` (torch would broadcast or promote; the fused kernel does neither).
    """
    d = _check(h, w)
    if delta.shape != h.shape or delta.dtype != h.dtype:
        raise BackendError(f"norm[triton]: add_rmsnorm needs delta of h's shape and dtype, got {tuple(delta.shape)} "
                           f"{delta.dtype} and {tuple(h.shape)} {h.dtype}")
    h2, r2 = h.reshape(-1, d).contiguous(), delta.reshape(-1, d).contiguous()
    x, ho = torch.empty_like(h2), torch.empty_like(h2)
    _grid_launch(h2, w, h2, x, r2, ho, eps, False, True)
    return x.view(h.shape), ho.view(h.shape)
