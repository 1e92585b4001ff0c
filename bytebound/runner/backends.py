"""Bind every op of a loaded model to its backend, once, and record what was resolved (for the manifest)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from bytebound.errors import BackendError, ConfigError
from bytebound.kernels.limits import MAX_VERIFY_M, verify_width
from bytebound.kernels.registry import Resolution, resolve
from bytebound.layers.kda import KimiDeltaAttention
from bytebound.layers.linear import QLinear, fuse_rows
from bytebound.layers.mla import ABSORB_MAX_T, GatedMLA
from bytebound.layers.moe import DenseMLP, MoE, RoutedExperts
from bytebound.layers.norm import RMSNorm, RMSNormGated

DEFAULTS_CPU = {"moe": "torch", "linear": "torch", "lm_head": "torch", "kda": "torch", "mla": "torch",
                "sampling": "torch"}
# CUDA: the fused decode/verify kernels for KDA and MLA (prefill: fla-core's chunked KDA, the layer's expanded MLA)
DEFAULTS_CUDA = {"moe": "triton", "linear": "triton", "lm_head": "triton", "kda": "triton", "mla": "triton",
                 "sampling": "torch"}


@dataclass
class BackendPlan:
    """Requested backend per op plus the resolved records (``resolutions``) after :func:`bind_model`.

    ``fast_paths``: each bound fast path whose kernels serve a limited number of tokens per call -> that number
    (e.g. ``{"moe[triton]": 4, "linear[triton]": 4, "router[triton]": 4}``; empty with the torch backends, which
    serve any M). :attr:`max_verify_m` is their minimum, the widest verify the bound fast paths serve."""
    requested: dict[str, str]
    allow_fallback: bool = False
    resolutions: dict[str, Resolution] = field(default_factory=dict)
    fast_paths: dict[str, int] = field(default_factory=dict)
    # ops the user named; the others are the device's defaults, and a default backend that cannot serve a layer's
    # shape falls back to torch with the reason recorded (a named backend raises instead)
    explicit: set = field(default_factory=set)

    @property
    def max_verify_m(self) -> int | None:
        """Tokens per call that every bound fast path serves (None: no bound path has a limit)."""
        return min(self.fast_paths.values()) if self.fast_paths else None

    def check_speculative(self, steps: int) -> None:
        """Refuse ``steps`` NEXTN drafts whose verify (``kernels.limits.verify_width``: ``steps + 1`` tokens) is
        wider than :attr:`max_verify_m`: past it the bound kernels leave their fast paths on every round (the MoE
        in slices, FP8 projections dequantised per call, torch routing). ``steps`` 0 (no MTP) always passes.

        Raises:
            ConfigError: the verify width exceeds :attr:`max_verify_m`; the message names the limiting paths."""
        lim = self.max_verify_m
        if steps and lim is not None and verify_width(steps) > lim:
            paths = ", ".join(f"{k} <= {v}" for k, v in sorted(self.fast_paths.items()) if v < verify_width(steps))
            raise ConfigError(f"--speculative-num-steps {steps}: the verify runs {verify_width(steps)} tokens per "
                              f"call, but the bound fast paths serve at most {lim} ({paths}); use "
                              f"--speculative-num-steps <= {lim - 1} on this device, or bind paths without a width "
                              "limit (slow): --moe-backend torch|humming, --linear-backend torch, --lm-head bf16, "
                              "--no-fused-router, --no-fused-router-gemv")

    @classmethod
    def default(cls, device, **overrides) -> "BackendPlan":
        base = dict(DEFAULTS_CUDA if torch.device(device).type == "cuda" else DEFAULTS_CPU)
        given = {k: v for k, v in overrides.items() if v}
        base.update(given)
        plan = cls(base)
        plan.explicit = set(given)
        return plan

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
    if getattr(impl["kda"], "prefill", None):       # kda 'triton': the fused kernel's M limit and who runs prefill
        plan.resolutions["kda"].prefill = impl["kda"].prefill
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
                # The decode/verify kernel takes at most ``max_tokens`` tokens. Above that the tokens are sorted
                # by expert and run as one grouped GEMM (kernels.triton_moe_grouped), so each expert's weights
                # are decoded about once per prefill chunk instead of once per 4-token slice.
                from bytebound.kernels.triton_moe_grouped import GroupedMoE
                m.fn.prefill = GroupedMoE(m)
                plan.resolutions["moe"].prefill = (f"{plan.resolutions['moe'].resolved} (grouped GEMM, W4A16, "
                                                   f"M > {m.fn.max_tokens})")
        elif isinstance(m, KimiDeltaAttention):
            m.kda_fn = impl["kda"].bind(m, dtype)
            # decode/verify as one fused kernel where the backend has one (kda 'triton'); None keeps the layer path
            bind_fused = getattr(impl["kda"], "bind_fused", None)
            m.fused_fn = (_bind_or_fall_back(plan, "kda", "fla", lambda: bind_fused(m, dtype))
                          if bind_fused is not None else None)
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
        elif isinstance(m, GatedMLA):
            # decode/verify (T <= ABSORB_MAX_T with a cache); the torch backend binds None (the layer's own code)
            m.attn_fn = _bind_or_fall_back(plan, "mla", "torch", lambda: impl["mla"].bind(m, dtype))
        elif isinstance(m, RMSNormGated):
            m.fn = gated_fn
        elif isinstance(m, RMSNorm):
            m.fn = norm_fn
    if plan.resolutions["mla"].resolved != "torch":
        plan.resolutions["mla"].prefill = f"torch (T > {ABSORB_MAX_T} tokens: expanded form, SDPA)"
    plan.resolutions["moe"].shared = "dense"
    if fused_shared is None and torch.device(device).type == "cuda":
        _bind_shared(model, plan, strict=False)
    elif fused_shared:
        _bind_shared(model, plan, strict=not plan.allow_fallback)
    model.lm_head.fn = impl["lm_head"].bind(model.lm_head, dtype)
    model.lm_head.backend = plan.resolutions["lm_head"].resolved
    plan.fast_paths = _fast_paths(model, plan, route_fn is not None or gemv_fn is not None)
    plan.resolutions["moe"].tuning = _moe_tuning(model)
    if plan.resolutions["kda"].resolved in ("fla", "triton"):       # triton's prefill is fla-core's chunk_kda
        from bytebound.kernels import fla_kda
        if fla_kda.CONFIGS:
            plan.resolutions["kda"].tuning = {"fla_autotune": fla_kda.CONFIGS}
    return plan


def _fast_paths(model, plan: BackendPlan, router: bool) -> dict[str, int]:
    """The bound fast paths with a token limit per call (``BackendPlan.fast_paths``): a bound callable declares
    its limit as ``max_tokens`` (``MoEKernel``, the triton FP8 linear and head); the fused router kernels serve
    ``kernels.limits.MAX_VERIFY_M`` rows."""
    out: dict[str, int] = {}

    def note(key: str, fn) -> None:
        n = getattr(fn, "max_tokens", None)
        if isinstance(n, int) and not isinstance(n, bool):
            out[key] = min(n, out.get(key, n))
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            note(f"moe[{plan.resolutions['moe'].resolved}]", m.fn)
        elif isinstance(m, QLinear):
            note(f"linear[{plan.resolutions['linear'].resolved}]", m.fn)
        elif isinstance(m, KimiDeltaAttention):
            note(f"linear[{plan.resolutions['linear'].resolved}]", m.proj_fn)
    note(f"lm_head[{plan.resolutions['lm_head'].resolved}] ({model.lm_head.mode})", model.lm_head.fn)
    if router:
        out["router[triton]"] = MAX_VERIFY_M
    return out


def _moe_tuning(model) -> dict | None:
    """``{"M=<m>": "<variant>, <source>"}`` for M = 1..MAX_VERIFY_M from the first routed-MoE binding that
    reports it (``MoEKernel.config_source``: which table key matched), or None (e.g. the torch backend)."""
    for m in model.modules():
        if isinstance(m, MoE):
            src = getattr(m.experts.fn, "config_source", None)
            if src is None:
                return None
            out = {}
            for mm in range(1, MAX_VERIFY_M + 1):
                try:
                    out[f"M={mm}"] = src(mm, m.top_k)
                except BackendError as e:       # no tiling of this shape: the call would raise the same
                    out[f"M={mm}"] = f"unusable: {e}"
            return out
    return None


def _bind_or_fall_back(plan: BackendPlan, op: str, instead: str, bind):
    """``bind()``, or None (the layer's own path, ``instead``) when it raises BackendError for an op the user did not
    name (``plan.explicit``) or with ``allow_fallback``: the device default cannot serve this model's shape (e.g. the
    Triton MLA kernels need power-of-two latent widths), which the resolution records as a fallback."""
    try:
        return bind()
    except BackendError as e:
        if op in plan.explicit and not plan.allow_fallback:
            raise
        r = plan.resolutions[op]
        if r.fallback_from is None:
            r.fallback_from, r.resolved, r.reason = r.resolved, instead, f"{e} (the default backend, not requested)"
        return None


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
                # only the 'split' variant runs it: without a 'split' config for some M <= MAX_VERIFY_M (the
                # table has them for the GPUs it was tuned on and their architecture) a bound shared expert would
                # never run, and cost a weight copy
                if not any(fn.config(mm, m.top_k).get("variant") == "split" for mm in range(1, MAX_VERIFY_M + 1)):
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
