"""Bind every op of a loaded model to its backend, once, and record what was resolved (for the manifest)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from bytebound.errors import BackendError, ConfigError
from bytebound.kernels.registry import Resolution, resolve
from bytebound.layers.kda import KimiDeltaAttention
from bytebound.layers.linear import QLinear, fuse_rows
from bytebound.layers.moe import DenseMLP, MoE, RoutedExperts
from bytebound.layers.norm import RMSNorm, RMSNormGated

DEFAULTS_CPU = {"moe": "torch", "linear": "torch", "lm_head": "torch", "kda": "torch", "mla": "torch",
                "sampling": "torch"}
DEFAULTS_CUDA = {"moe": "triton", "linear": "triton", "lm_head": "triton", "kda": "fla", "mla": "torch",
                 "sampling": "torch"}


@dataclass
class BackendPlan:
    """Requested backend per op plus the resolved records (``resolutions``) after :func:`bind_model`."""
    requested: dict[str, str]
    allow_fallback: bool = False
    resolutions: dict[str, Resolution] = field(default_factory=dict)

    @classmethod
    def default(cls, device, **overrides) -> "BackendPlan":
        base = dict(DEFAULTS_CUDA if torch.device(device).type == "cuda" else DEFAULTS_CPU)
        base.update({k: v for k, v in overrides.items() if v})
        return cls(base)

    def fallbacks(self) -> list[Resolution]:
        return [r for r in self.resolutions.values() if r.fallback_from]


def parse_overrides(spec: str) -> dict[str, str]:
    """``"moe=torch,linear=torch"`` -> ``{"moe": "torch", "linear": "torch"}`` (the scripts' ``--backends``).
    Raises ConfigError for an item without ``=`` or an op other than moe, linear, lm_head, kda, mla."""
    out = {}
    for item in filter(None, spec.split(",")):
        op, sep, name = item.partition("=")
        if not sep or op not in ("moe", "linear", "lm_head", "kda", "mla"):
            raise ConfigError(f"backend override {item!r} in {spec!r}: expected op=backend with op one of moe, "
                              "linear, lm_head, kda, mla")
        out[op] = name
    return out


def token_slices(fn, n: int):
    """``fn(x [M, H], ids [M, k], w [M, k]) -> [M, H]`` for any M, calling ``fn`` (which takes at most ``n``
    tokens) on consecutive slices of ``n`` tokens. Tokens are independent in a routed MoE, so this is exact."""
    def run(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.cat([fn(x[i:i + n], ids[i:i + n], w[i:i + n]) for i in range(0, x.shape[0], n)])
    return run


def prefill_slices(fn):
    """The prefill delegate of a decode kernel that takes at most ``fn.max_tokens`` tokens: the kernel over
    slices of that size, called with ``shared=False``: for more tokens than that the MoE layer adds its dense
    shared expert itself (``RoutedExperts.shared_in`` is false there), so the slices must not run it as well."""
    return token_slices(functools.partial(fn, shared=False), fn.max_tokens)


def bind_model(model, plan: BackendPlan, device, lm_head_mode: str = "bf16", fused_router: bool = False,
               fused_norm: bool = False, fused_shared: bool | None = False, router_gemv: bool = False) -> BackendPlan:
    """Resolve each op once and bind every module of that op to it. Raises BackendError (named) when a
    requested backend is unusable and ``plan.allow_fallback`` is False. ``fused_router``: the MoE routing for
    M <= 4 runs as one Triton kernel (``kernels.triton_router``; CUDA only, else BackendError). ``fused_norm``: every
    RMSNorm and gated RMSNorm is one Triton kernel (``kernels.triton_norm``; CUDA only). ``fused_shared``: each
    MoE layer's shared expert runs inside the routed MoE kernels (``MoEKernel.bind_shared``; the ``triton`` MoE
    backend's ``split`` variant, FP8 shared experts); a layer where that does not apply keeps its dense shared
    expert and ``plan.resolutions["moe"].shared`` says why (with True: BackendError instead unless
    ``allow_fallback``; with None, the engine's CUDA default: wherever the backend can, no error).
    ``router_gemv``: the router GEMV and the routing for M <= 4 as one Triton kernel
    (``kernels.triton_router.gemv_route``; CUDA only)."""
    dtype = model.dtype
    impl = {}
    for op in ("moe", "linear", "lm_head", "kda", "mla"):
        impl[op], plan.resolutions[op] = resolve(op, plan.requested[op], device, plan.allow_fallback)
    plan.resolutions["sampling"] = Resolution("sampling", plan.requested.get("sampling", "torch"), "torch")
    model.lm_head.configure(lm_head_mode)
    for flag, on in (("--fused-router", fused_router), ("--fused-router-gemv", router_gemv),
                     ("--fused-norm", fused_norm)):
        if on and torch.device(device).type != "cuda":
            raise BackendError(f"{flag} needs a CUDA device (a Triton kernel)")
    route_fn = gemv_fn = None
    if fused_router:
        from bytebound.kernels.triton_router import fused_route as route_fn
    if router_gemv:
        from bytebound.kernels.triton_router import gemv_route as gemv_fn
    plan.resolutions["moe"].router = ("triton (GEMV + routing, one launch)" if gemv_fn is not None else
                                      "triton" if route_fn is not None else "torch")
    norm_fn = gated_fn = None
    if fused_norm:
        from bytebound.kernels.triton_norm import rmsnorm as norm_fn, rmsnorm_gated as gated_fn
    plan.resolutions["norm"] = Resolution("norm", "triton" if fused_norm else "torch",
                                          "triton" if fused_norm else "torch")
    fused_parts = set()         # projections that run inside a fused QLinear: no binding (no dequantised copy)
    for m in model.modules():
        if isinstance(m, QLinear):
            if id(m) in fused_parts:
                m.fn, m.backend = None, f"{plan.resolutions['linear'].resolved} (fused)"
            else:
                m.fn, m.backend = impl["linear"].bind(m, dtype), plan.resolutions["linear"].resolved
        elif isinstance(m, RoutedExperts):
            m.fn, m.backend = impl["moe"].bind(m, dtype), plan.resolutions["moe"].resolved
            if getattr(m.fn, "prefill", False) is None:
                # The decode/verify kernel takes at most ``max_tokens`` tokens: prefill feeds it the prompt in
                # slices of that size (recorded). On the H200 the triton kernel costs ~39 us per token per layer at
                # M = 4; the torch reference's loop made a 32K prefill cost 183 us per token per layer in all
                # (docs/perf/decode-h200.md, TTFT).
                n = m.fn.max_tokens
                m.fn.prefill = prefill_slices(m.fn)
                plan.resolutions["moe"].prefill = f"{plan.resolutions['moe'].resolved} ({n}-token slices)"
        elif isinstance(m, KimiDeltaAttention):
            m.kda_fn = impl["kda"].bind(m, dtype)
            # q|k|v|f|g read the same input: one launch instead of five, and no concat for the conv
            parts = [m.q_proj, m.k_proj, m.v_proj, m.f_proj, m.g_proj]
            fused = fuse_rows(parts)
            m.proj_fn = impl["linear"].bind(fused, dtype) if fused is not None else None
            if fused is not None:       # modules() yields the layer before its projections
                fused_parts.update(id(x) for x in parts)
        elif isinstance(m, DenseMLP) and torch.device(device).type == "cpu":
            # CPU: gate|up read the same input, one product instead of two (on CUDA the MoE kernels or the GEMV
            # backend take the shared expert as it is)
            fused = fuse_rows([m.gate_proj, m.up_proj])
            m.gate_up_fn = impl["linear"].bind(fused, dtype) if fused is not None else None
            if fused is not None:
                fused_parts.update((id(m.gate_proj), id(m.up_proj)))
        elif isinstance(m, MoE):
            m.route_fn, m.gemv_route_fn = route_fn, gemv_fn
        elif isinstance(m, RMSNormGated):
            m.fn = gated_fn
        elif isinstance(m, RMSNorm):
            m.fn = norm_fn
    plan.resolutions["moe"].shared = "dense"
    if fused_shared is None and torch.device(device).type == "cuda":
        _bind_shared(model, plan, strict=False)
    elif fused_shared:
        _bind_shared(model, plan, strict=not plan.allow_fallback)
    model.lm_head.fn = impl["lm_head"].bind(model.lm_head, dtype)
    model.lm_head.backend = plan.resolutions["lm_head"].resolved
    return plan


def _bind_shared(model, plan: BackendPlan, strict: bool) -> None:
    """``fused_shared`` of :func:`bind_model`: every MoE layer's shared expert into its routed kernels; ``strict``
    re-raises the first layer's BackendError, else that layer stays dense and the resolution records why."""
    why = None
    n = 0
    for m in model.modules():
        if isinstance(m, MoE) and m.shared_experts is not None:
            fn = m.experts.fn
            bind = getattr(fn, "bind_shared", None)
            try:
                if bind is None:
                    raise BackendError(f"moe backend {plan.resolutions['moe'].resolved!r} cannot run the shared "
                                       "expert (the triton backend can)")
                # only the 'split' variant runs it: without a 'split' config for some M <= 4 (the table has them
                # for the GPUs it was tuned on) a bound shared expert would never run, and cost a weight copy
                if not any(fn.config(mm, m.top_k).get("variant") == "split" for mm in range(1, 5)):
                    raise BackendError("the triton MoE configs for this GPU and shape have no 'split' variant at "
                                       "M <= 4 (configs/triton_moe.json), and only 'split' runs the shared expert")
                bind(m.shared_experts)
                n += 1
            except BackendError as e:
                if strict:
                    raise
                why = why or str(e)
    plan.resolutions["moe"].shared = (f"fused into the routed kernels ({n} layers)" if n else "dense") + (
        f"; not fused: {why}" if why else "")
