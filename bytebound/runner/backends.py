"""Bind every op of a loaded model to its backend, once, and record what was resolved (for the manifest)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from bytebound.errors import BackendError, ConfigError
from bytebound.kernels.limits import MAX_VERIFY_M, verify_width
from bytebound.kernels.registry import Resolution, resolve
from bytebound.layers.kda import KimiDeltaAttention
from bytebound.layers.linear import QLinear, fuse_layout, fuse_rows
from bytebound.layers.mla import ABSORB_MAX_T, GatedMLA
from bytebound.layers.moe import DenseMLP, MoE, RoutedExperts
from bytebound.layers.norm import RMSNorm, RMSNormGated

# The plan (entries, defaults, validation, aliases) lives in runner.plan; re-exported here for the callers.
from bytebound.runner.plan import (DEFAULTS_CPU, DEFAULTS_CUDA, BackendPlan, PlanEntry,  # noqa: F401
                                   parse_backend_specs)


def parse_overrides(spec: str) -> dict[str, str]:
    """``"moe=torch,router=torch"`` -> ``{"moe": "torch", "router": "torch"}`` (the scripts' ``--backends``; the
    same items as ``--backend``, :func:`runner.plan.parse_backend_specs`).

    Raises:
        ConfigError: an item without ``=`` or naming no plan entry."""
    return parse_backend_specs(spec)


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


def _fold_norm(plan, proj_fn) -> bool:
    """Whether a KDA/MLA layer's input add + RMSNorm runs inside its fused projection (``proj_fn.add_norm``, the
    FP8 MMA GEMV: ``kernels.triton_fp8.fp8_block_gemv_add_norm``): with the fused norms requested, a projection
    backend that offers it, and the opt-in ``BYTEBOUND_NORM_FOLD=1`` (``triton_fp8.norm_fold_enabled``: off by
    default, measured slower). Recorded once in the norm lever's ``fused`` note."""
    ok = plan.requested["norm"] == "triton" and getattr(proj_fn, "add_norm", None) is not None
    if ok:
        from bytebound.kernels.triton_fp8 import norm_fold_enabled
        ok = norm_fold_enabled()
    if ok and plan.resolutions["norm"].fused is None:
        plan.resolutions["norm"].fused = ("input add + RMSNorm inside the attention's fused FP8 projection (MMA GEMV, "
                                          "M <= 4; other calls: the norm kernel)")
    return ok


def bind_model(model, plan: BackendPlan, device, lm_head_mode: str = "bf16") -> BackendPlan:
    """Resolve each entry of ``plan`` once and bind every module of that op to it; then record per entry and
    regime what serves it and why (``plan.entries``, ``plan.resolutions``, ``plan.fast_paths``).

    The registry ops bind through ``kernels.registry.resolve``. The switches: ``router`` (``gemv``:
    ``kernels.triton_router.gemv_route``, ``triton``: ``fused_route`` after the GEMV; both for M up to
    ``kernels.limits.MAX_VERIFY_M``, the layer's ``route_m``), ``norm`` (``triton``: ``kernels.triton_norm``,
    the residual add before a decoder norm included: ``RMSNorm.add_norm``),
    ``moe_shared`` (``fused``: ``MoEKernel.bind_shared``, the triton backend's ``split`` variant, FP8 shared
    experts). ``kv``, ``round`` and ``graphs`` are recorded here and applied by the engine (runner, MTP round,
    capture). A device default that cannot serve this model falls back, recorded; an entry the user named
    (``plan.explicit``) raises instead unless ``plan.allow_fallback``. Projections of one input are bound as one
    ``linear`` call (``layers.linear.fuse_rows``, the parts become row views): a KDA layer's q|k|v|f|g
    (``proj_fn``), an MLA layer's q|kv_a|g (``proj_fn`` and ``proj_spans``; FP8 parts padded to scale-block edges;
    ``plan.resolutions["mla"].fused`` says which, or why not), on CPU a dense MLP's gate|up.

    Raises:
        BackendError: a named backend or switch is unusable here (CUDA-only on another device, a shape the kernel
            does not take) and ``plan.allow_fallback`` is False."""
    dtype = model.dtype
    cuda = torch.device(device).type == "cuda"
    plan.device_type = torch.device(device).type
    impl = {}
    for op in ("moe", "linear", "lm_head", "kda", "mla"):
        impl[op], plan.resolutions[op] = resolve(op, plan.requested[op], device, plan.allow_fallback)
    plan.resolutions["sampling"] = Resolution("sampling", plan.requested.get("sampling", "torch"), "torch")
    for name in ("router", "norm", "moe_shared", "kv", "round", "graphs"):
        plan.resolutions[name] = Resolution(name, plan.requested[name], plan.requested[name])
    if getattr(impl["kda"], "prefill", None):       # kda 'triton': the fused kernel's M limit and who runs prefill
        plan.resolutions["kda"].prefill = impl["kda"].prefill
    model.lm_head.configure(lm_head_mode)
    for name, value in (("router", "gemv"), ("router", "triton"), ("norm", "triton"), ("kv", "buckets"),
                        ("graphs", "captured")):
        if plan.requested[name] == value and not cuda:   # a plan built for another device (runner.plan checks too)
            raise BackendError(f"--backend {name}={value} needs a CUDA device")
    route_fn = gemv_fn = None
    router = plan.requested["router"]
    if router != "torch":
        from bytebound.kernels import triton_router
        moe0 = next((m for m in model.modules() if isinstance(m, MoE)), None)
        why = triton_router.shape_error(moe0.gate.weight.shape[0], moe0.n_group) if moe0 is not None else None
        if why:
            _refuse_or_fall_back(plan, "router", "torch", f"router[{router}]: {why}")
        elif router == "gemv":
            gemv_fn = triton_router.gemv_route
        else:
            route_fn = triton_router.fused_route
    # with the fused norms too, the post-attention residual add + RMSNorm run in the router's launch
    gemv_norm_fn = None
    if gemv_fn is not None and plan.requested["norm"] == "triton":
        from bytebound.kernels.triton_router import gemv_route_add_norm as gemv_norm_fn
    plan.resolutions["moe"].router = ("triton (post-attention add + norm, GEMV + routing, one launch)"
                                      if gemv_norm_fn is not None else
                                      "triton (GEMV + routing, one launch)" if gemv_fn is not None else
                                      "triton" if route_fn is not None else "torch")
    norm_fn = gated_fn = add_fn = None
    if plan.requested["norm"] == "triton":
        from bytebound.kernels.triton_norm import add_rmsnorm as add_fn
        from bytebound.kernels.triton_norm import rmsnorm as norm_fn, rmsnorm_gated as gated_fn
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
            if m.fused_fn is not None and plan.resolutions["kda"].fused is None:
                plan.resolutions["kda"].fused = m.fused_fn.beta       # the first layer's (they share a format)
            # q|k|v|f|g read the same input: one launch instead of five, and no concat for the conv
            parts = [m.q_proj, m.k_proj, m.v_proj, m.f_proj, m.g_proj]
            fused = fuse_rows(parts)
            m.proj_fn = impl["linear"].bind(fused, dtype) if fused is not None else None
            m.fold_input_norm = _fold_norm(plan, m.proj_fn)
            if fused is not None:       # modules() yields the layer before its projections
                fused_parts.update(id(x) for x in parts)
        elif isinstance(m, DenseMLP) and not cuda:
            # CPU: gate|up read the same input, one product instead of two (on CUDA the MoE kernels or the GEMV
            # backend take the shared expert as it is)
            fused = fuse_rows([m.gate_proj, m.up_proj])
            m.gate_up_fn = impl["linear"].bind(fused, dtype) if fused is not None else None
            if fused is not None:
                fused_parts.update((id(m.gate_proj), id(m.up_proj)))
        elif isinstance(m, MoE):
            # the plan's decision per regime: the router kernel for M <= route_m (decode, verify), torch above
            m.route_fn, m.gemv_route_fn, m.gemv_add_norm_fn = route_fn, gemv_fn, gemv_norm_fn
            m.route_m = MAX_VERIFY_M if (route_fn or gemv_fn) is not None else 0
        elif isinstance(m, GatedMLA):
            # decode/verify (T <= ABSORB_MAX_T with a cache); the torch backend binds None (the layer's own code)
            m.attn_fn = _bind_or_fall_back(plan, "mla", "torch", lambda: impl["mla"].bind(m, dtype))
            # q|kv_a|g read the same input: one launch instead of three (prefill: one GEMM); zero rows pad a part
            # that ends inside an FP8 scale block (Ling: kv_a's 576 rows to 640), so each keeps its own scale rows
            parts = [m.q_proj, m.kv_a_proj_with_mqa, m.g_proj]
            fused = fuse_rows(parts, pad=True)
            m.proj_fn = impl["linear"].bind(fused, dtype) if fused is not None else None
            m.proj_spans = fused.row_spans if fused is not None else None
            m.fold_input_norm = _fold_norm(plan, m.proj_fn)
            if fused is not None:       # modules() yields the layer before its projections
                fused_parts.update(id(x) for x in parts)
            if plan.resolutions["mla"].fused is None:          # the first layer's (they share a format)
                plan.resolutions["mla"].fused = _mla_proj_note(parts, fused)
        elif isinstance(m, RMSNormGated):
            m.fn = gated_fn
        elif isinstance(m, RMSNorm):
            m.fn, m.add_fn = norm_fn, add_fn
    if plan.resolutions["mla"].resolved != "torch":
        plan.resolutions["mla"].prefill = f"torch (T > {ABSORB_MAX_T} tokens: expanded form, SDPA)"
    plan.resolutions["moe"].shared = "dense"
    if plan.requested["moe_shared"] == "fused":
        _bind_shared(model, plan, strict="moe_shared" in plan.explicit and not plan.allow_fallback)
        if not plan.resolutions["moe"].shared.startswith("fused"):
            r = plan.resolutions["moe_shared"]
            r.fallback_from, r.resolved, r.reason = "fused", "separate", plan.resolutions["moe"].shared
    model.lm_head.fn = impl["lm_head"].bind(model.lm_head, dtype)
    model.lm_head.backend = plan.resolutions["lm_head"].resolved
    # both router kernels are Triton ones: one key, "router[triton]", whichever the plan's router entry chose
    plan.fast_paths = _fast_paths(model, plan, "triton" if (route_fn or gemv_fn) else None)
    plan.resolutions["moe"].tuning = _moe_tuning(model)
    plan.resolutions["linear"].gemv = _linear_gemv(model)
    if plan.resolutions["kda"].resolved in ("fla", "triton"):       # triton's prefill is fla-core's chunk_kda
        from bytebound.kernels import fla_kda
        if fla_kda.CONFIGS:
            plan.resolutions["kda"].tuning = {"fla_autotune": fla_kda.CONFIGS}
    record_regimes(model, plan, impl)
    return plan


def _mla_proj_note(parts: list[QLinear], fused: QLinear | None) -> str:
    """``Resolution.fused`` of ``mla``: the one q|kv_a|g projection (rows, padding) or, ``fused`` None, why the
    three stay separate (``fuse_layout``'s reason)."""
    names = "q_proj | kv_a_proj_with_mqa | g_proj"
    if fused is None:
        return f"{names}: three projections, not fused: {fuse_layout(parts, pad=True)}"
    rows = fused.out_features
    pad = rows - sum(b - a for a, b in fused.row_spans)
    return (f"{names}: one {parts[0].fmt} projection of {rows} rows"
            + (f" ({pad} zero rows keep the parts on {parts[0].block[0]}-row scale-block edges)" if pad else ""))


def _refuse_or_fall_back(plan: BackendPlan, name: str, instead: str, why: str) -> None:
    """A switch that cannot serve this model: raise for a user-named one (unless ``allow_fallback``), else
    record the fallback to ``instead``.

    Raises:
        BackendError: ``name`` is in ``plan.explicit`` and ``plan.allow_fallback`` is False."""
    if name in plan.explicit and not plan.allow_fallback:
        raise BackendError(why)
    r = plan.resolutions[name]
    r.fallback_from, r.resolved, r.reason = r.resolved, instead, why + (
        "" if name in plan.explicit else " (the default, not requested)")


def _why(plan: BackendPlan, name: str) -> tuple[str, str | None]:
    """``(why, detail)`` of an entry's decode/verify choice: fallback, user override or device default."""
    r = plan.resolutions.get(name)
    if r is not None and r.fallback_from:
        return "fallback", f"{r.fallback_from} -> {r.resolved}: {r.reason}"
    return ("user override", None) if name in plan.explicit else ("device default", plan.notes.get(name))


def record_regimes(model, plan: BackendPlan, impl: dict | None = None) -> None:
    """Fill ``plan.entries``: per entry and regime (``decode`` M = 1, ``verify`` M = k + 1, ``prefill`` M above
    the fast paths' width) the implementation bound for it and why (``runner.plan.PlanEntry``). Reads what
    :func:`bind_model` bound (``impl``: its resolved registry instances, for their descriptions); binds nothing."""
    impl = impl or {}
    res = plan.resolutions
    k1 = verify_width(plan.steps) if plan.steps else None
    unused = PlanEntry("not used", "not used", "no MTP (--speculative-algorithm NEXTN)")
    out: dict[str, dict[str, PlanEntry]] = {}

    def three(name, small, wide=None, wide_why="width", wide_detail=None, small_verify=None):
        why, detail = _why(plan, name)
        d = {"decode": PlanEntry(small, why, detail)}
        d["verify"] = PlanEntry(small_verify or small, why, detail) if k1 else unused
        d["prefill"] = (PlanEntry(wide, wide_why, wide_detail) if wide is not None
                        else PlanEntry(small, why, detail))
        out[name] = d

    # routed MoE: the launch config per M comes from the tuning table (MoEKernel.config_source)
    fn = next((m.fn for m in model.modules() if isinstance(m, RoutedExperts)), None)
    moe = res["moe"].resolved
    tuning = res["moe"].tuning or {}
    why, detail = _why(plan, "moe")
    d = {}
    for regime, mm in (("decode", 1), ("verify", k1)):
        if mm is None:
            d[regime] = unused
            continue
        src = tuning.get(f"M={mm}")
        if src is None:
            d[regime] = PlanEntry(moe, why, detail)
            continue
        variant, _, key = src.partition(", ")
        tuned = why == "device default" and not key.startswith("untuned") and "no entry" not in key
        d[regime] = PlanEntry(f"{moe} ({variant}, M={mm})", "tuned table" if tuned else why,
                              f"launch config: {src}" + (f"; {detail}" if detail and not tuned else ""))
    n = getattr(fn, "max_tokens", None)
    d["prefill"] = (PlanEntry(res["moe"].prefill or f"{moe} (M > {n})", "width", f"M > {n}: the decode kernel's "
                              "limit") if isinstance(n, int) else PlanEntry(moe, why, detail))
    out["moe"] = d
    shared = res["moe"].shared or "dense"
    why, detail = _why(plan, "moe_shared")
    small = "fused (one more slot of the routed kernels)" if shared.startswith("fused") else "separate (dense MLP)"
    out["moe_shared"] = {"decode": PlanEntry(small, why, detail or shared),
                         "verify": PlanEntry(small, why, detail or shared) if k1 else unused,
                         "prefill": PlanEntry("separate (dense MLP)", "width" if small.startswith("fused") else why,
                                              f"M > {n}: the layer adds its dense shared expert"
                                              if small.startswith("fused") else detail)}
    r = plan.choice("router")
    rm = next((m.route_m for m in model.modules() if isinstance(m, MoE)), 0)
    three("router", {"gemv": "triton (router GEMV + routing, one launch)", "triton": "torch GEMV + triton routing",
                     "torch": "torch"}[r], "torch" if rm else None, wide_detail=f"M > {rm}: the router kernels' rows")
    lin = res["linear"].resolved
    ln = plan.fast_paths.get(f"linear[{lin}]")
    three("linear", lin, f"{lin} (prefill path {getattr(impl.get('linear'), 'prefill', '?')})" if ln else None,
          wide_detail=f"M > {ln}: the GEMV's width")
    head = res["lm_head"].resolved
    hn = next((v for kk, v in plan.fast_paths.items() if kk.startswith("lm_head[")), None)
    mode = model.lm_head.mode
    three("lm_head", f"{head} ({mode})", f"torch reference ({mode})" if hn else None,
          wide_detail=f"M > {hn}: the FP8 head GEMV's width")
    kda = res["kda"].resolved
    kf = next((m.fused_fn for m in model.modules() if isinstance(m, KimiDeltaAttention)), None)
    kn = getattr(kf, "max_tokens", None)
    three("kda", f"{kda} (fused decode/verify kernel)" if kf is not None else kda,
          (res["kda"].prefill or kda) if kf is not None else None, wide_detail=f"M > {kn}: the fused kernel's limit")
    mla = res["mla"].resolved
    three("mla", mla, res["mla"].prefill if mla != "torch" else None,
          wide_detail=f"T > {ABSORB_MAX_T}: the absorbed decode form's limit")
    three("norm", plan.choice("norm"))
    three("sampling", res["sampling"].resolved)
    kv = plan.choice("kv")
    three("kv", "power-of-two spans from 1024" if kv == "buckets" else "every max_model_len slot",
          "exact (the prompt's length)", wide_why="regime", wide_detail="prefill attends over the tokens it has")
    why, detail = _why(plan, "round")
    out["round"] = {"decode": PlanEntry("not used", "not used", "plain decoding has no round"),
                    "verify": PlanEntry(plan.choice("round"), why, detail) if k1 else unused,
                    "prefill": PlanEntry("not used", "not used", None)}
    why, detail = _why(plan, "graphs")
    g = plan.choice("graphs")
    out["graphs"] = {"decode": PlanEntry(g, why, detail),
                     "verify": PlanEntry(g if plan.choice("round") == "static" else "eager",
                                         why if plan.choice("round") == "static" else "regime",
                                         ("one round graph per attention span for greedy requests and one for "
                                          "sampling requests" if g == "captured" else None)
                                         if plan.choice("round") == "static" else "eager MTP rounds")
                     if k1 else unused,
                     "prefill": PlanEntry("eager", "regime", "prefill shapes vary per prompt")}
    plan.entries = out


def _fast_paths(model, plan: BackendPlan, router: str | None) -> dict[str, int]:
    """The bound fast paths with a token limit per call (``BackendPlan.fast_paths``): a bound callable declares
    its limit as ``max_tokens`` (``MoEKernel``, the triton FP8 linear and head); the router kernels (``router``:
    the bound one's name, None for torch) serve ``kernels.limits.MAX_VERIFY_M`` rows."""
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
        elif isinstance(m, (KimiDeltaAttention, GatedMLA)):
            note(f"linear[{plan.resolutions['linear'].resolved}]", m.proj_fn)
    note(f"lm_head[{plan.resolutions['lm_head'].resolved}] ({model.lm_head.mode})", model.lm_head.fn)
    if router:
        out[f"router[{router}]"] = MAX_VERIFY_M
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


def _linear_bindings(model):
    """``(bound fn, shared-expert MoE or None)`` for every ``linear`` binding :func:`bind_model` made: the unfused
    QLinears, the fused KDA / MLA projections (``proj_fn``) and a dense MLP's gate|up (``gate_up_fn``). The MoE is
    given for the projections of its shared expert, which decode/verify skip where the routed kernels run it."""
    shared = {}
    for m in model.modules():
        if isinstance(m, MoE) and m.shared_experts is not None:
            shared.update({id(q): m for q in m.shared_experts.modules() if isinstance(q, QLinear)})
    for m in model.modules():
        if isinstance(m, QLinear) and m.fn is not None:
            yield m.fn, shared.get(id(m))
        elif isinstance(m, (KimiDeltaAttention, GatedMLA)) and getattr(m, "proj_fn", None) is not None:
            yield m.proj_fn, None
        elif isinstance(m, DenseMLP) and getattr(m, "gate_up_fn", None) is not None:
            yield m.gate_up_fn, shared.get(id(m.gate_proj))


def _linear_gemv(model) -> dict | None:
    """``Resolution.gemv`` of ``linear``: ``{"<N>x<K>": {"layers": bindings of that FP8 weight shape, "M=<m>":
    "<path> (<source>[; mma refused: <why>])"}}`` for M = 1..MAX_VERIFY_M, from what each binding fixed
    (``fn.gemv_shape`` / ``fn.gemv_paths``: ``kernels.triton_fp8.gemv_bind_configs``), largest weight traffic
    (N * K * layers) first; None where no binding reports a GEMV (torch, plain weights). Bindings that disagree at
    one M are listed with their counts; a shared expert's projections are not counted at an M where the routed MoE
    kernels run it (``RoutedExperts.shared_in``)."""
    from bytebound.kernels.triton_fp8 import describe_gemv_path
    seen: dict[tuple[int, int], dict] = {}
    for fn, moe in _linear_bindings(model):
        paths = getattr(fn, "gemv_paths", None)
        if not paths:
            continue
        e = seen.setdefault(tuple(fn.gemv_shape), {"layers": 0, "M": {}})
        e["layers"] += 1
        for mm, info in paths.items():
            if moe is not None and moe.experts.shared_in(mm, moe.top_k):
                continue
            text = describe_gemv_path(info)
            counts = e["M"].setdefault(mm, {})
            counts[text] = counts.get(text, 0) + 1
    if not seen:
        return None
    out = {}
    for (n, k), e in sorted(seen.items(), key=lambda it: -it[0][0] * it[0][1] * it[1]["layers"]):
        d = {"layers": e["layers"]}
        for mm in range(1, MAX_VERIFY_M + 1):
            counts = e["M"].get(mm)
            if not counts:
                d[f"M={mm}"] = "not called (the shared expert runs in the routed MoE kernels)"
            elif len(counts) == 1 and next(iter(counts.values())) == e["layers"]:
                d[f"M={mm}"] = next(iter(counts))
            else:
                d[f"M={mm}"] = "; ".join(f"{c} x {t}" for t, c in counts.items())
        out[f"{n}x{k}"] = d
    return out


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
                # only the 'split' and 'persist' variants run it: without such a config for some M <=
                # MAX_VERIFY_M (the table has 'split' for the GPUs it was tuned on and their architecture) a bound
                # shared expert would never run, and cost a weight copy
                from bytebound.kernels.moe_host import SHARED_VARIANTS
                if not any(fn.config(mm, m.top_k).get("variant") in SHARED_VARIANTS
                           for mm in range(1, MAX_VERIFY_M + 1)):
                    raise BackendError("the triton MoE configs for this GPU and shape have no 'split' or 'persist' "
                                       "variant at M <= 4 (configs/triton_moe.json), and only those run the shared "
                                       "expert")
                bind(m.shared_experts)
                n += 1
            except BackendError as e:
                if strict:
                    raise
                why = why or str(e)
    plan.resolutions["moe"].shared = (f"fused into the routed kernels ({n} layers)" if n else "dense") + (
        f"; not fused: {why}" if why else "")
