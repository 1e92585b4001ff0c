"""Backend registry: each op has named implementations, resolved once at load, never swapped silently.

Ops (names are the keys of :data:`OPS`): ``moe`` (routed MXFP4/plain experts), ``linear`` (dense
projections, FP8 block or plain), ``lm_head``, ``kda`` (KDA prefill + decode), ``mla`` (MLA attention),
``sampling``. Backends: ``torch`` (reference, everywhere), ``triton`` (ours, CUDA), ``humming``
(humming-kernels MXFP4 GEMM, CUDA), ``fla`` (fla-core KDA, CUDA).

A backend registers an ``available(device) -> str | None`` probe (``None`` = usable, else the reason) and
a factory. :func:`resolve` returns the implementation plus a :class:`Resolution` record for the manifest.
An unusable request raises :class:`~bytebound.errors.BackendError` unless ``allow_fallback`` is set, in
which case the substitution is recorded (``fallback_from``/``reason``) and printed by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, asdict
from typing import Callable

import torch

from bytebound.errors import BackendError

OPS = ("moe", "linear", "lm_head", "kda", "mla", "sampling")


@dataclass
class Resolution:
    """What one op resolved to: requested vs resolved backend, and why if they differ."""
    op: str
    requested: str
    resolved: str
    fallback_from: str | None = None
    reason: str | None = None
    prefill: str | None = None      # how M > the decode kernel's limit runs (e.g. "triton (4-token slices)")
    router: str | None = None       # moe only: who computes the group-limited top-k for M <= 4 ("torch" | "triton")
    shared: str | None = None       # moe only: where the shared expert runs ("dense" | "fused into the routed kernels")
    tuning: dict | None = None      # moe only: per token count "M=<m>" the launch config and which table key matched
    fused: str | None = None        # kda: what the fused decode kernel takes in (beta's b_proj inside, or why not);
    #                                 mla: the q|kv_a|g projection (one fused, or why three); norm: the input
    #                                 add + norm folded into the attention projection (or None)
    gemv: dict | None = None        # linear only: per FP8 weight shape "NxK" its bindings and per "M=<m>" the
    #                                 decode/verify GEMV path and its source (runner.backends._linear_gemv)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Entry:
    factory: Callable[..., object]
    available: Callable[[torch.device], str | None]


_REGISTRY: dict[str, dict[str, _Entry]] = {op: {} for op in OPS}


def register(op: str, name: str, available: Callable[[torch.device], str | None] | None = None):
    """Decorator: register ``factory`` as backend ``name`` of ``op``."""
    if op not in _REGISTRY:
        raise KeyError(f"unknown op {op!r}; known: {OPS}")

    def deco(factory):
        _REGISTRY[op][name] = _Entry(factory, available or (lambda dev: None))
        return factory
    return deco


def backends(op: str) -> list[str]:
    """Registered backend names for ``op`` (importing the optional backend modules first)."""
    _load_optional()
    return sorted(_REGISTRY[op])


def cuda_only(dev: torch.device) -> str | None:
    """Probe shared by the CUDA backends: None when ``dev`` is a usable CUDA device, else the reason."""
    if torch.device(dev).type != "cuda":
        return "needs a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def needs_capability(dev: torch.device, major: int, what: str) -> str | None:
    """None when CUDA device ``dev`` has compute capability >= ``major``.0, else the reason (``what`` needs it)."""
    got, _ = torch.cuda.get_device_capability(torch.device(dev))
    return None if got >= major else f"needs compute capability >= {major}.0 ({what}), got {got}.x"


def pinned_package(dist: str, pinned: str) -> str | None:
    """None when distribution ``dist`` is installed at exactly ``pinned``, else the reason."""
    try:
        from importlib.metadata import version
        ver = version(dist)
    except Exception:
        return f"{dist} is not installed (pip install {dist}=={pinned})"
    return None if ver == pinned else f"{dist} {ver} installed, {pinned} pinned"


def unusable_reason(op: str, name: str, device) -> str | None:
    """Why backend ``name`` of ``op`` cannot run on ``device`` (its availability probe, e.g. "needs a CUDA
    device"), or None when it can - or when op/name is unknown (:func:`resolve` names that). Instantiates nothing."""
    _load_optional()
    entry = _REGISTRY.get(op, {}).get(name)
    return None if entry is None else entry.available(torch.device(device))


def resolve(op: str, requested: str, device: torch.device, allow_fallback: bool = False,
            fallback: str = "torch", **kw) -> tuple[object, Resolution]:
    """Instantiate backend ``requested`` of ``op`` for ``device``.

    Raises:
        BackendError: unknown op/backend, or the backend is unusable here and ``allow_fallback`` is False.
    """
    _load_optional()
    if op not in _REGISTRY:
        raise BackendError(f"unknown op {op!r}; known: {OPS}")
    table = _REGISTRY[op]
    entry = table.get(requested)
    if entry is None:     # a typo is never "unusable here": it fails even with allow_fallback
        raise BackendError(f"op {op!r}: no backend named {requested!r} (have {sorted(table)})")
    reason = entry.available(torch.device(device))
    if reason is None:
        return entry.factory(**kw), Resolution(op, requested, requested)
    if not allow_fallback:
        raise BackendError(f"op {op!r}: backend {requested!r} unusable: {reason} "
                           f"(pass --allow-fallback to substitute {fallback!r}, recorded in the manifest)")
    fb = table[fallback]
    why = fb.available(torch.device(device))
    if why is not None:
        raise BackendError(f"op {op!r}: fallback {fallback!r} also unusable: {why}")
    return fb.factory(**kw), Resolution(op, requested, fallback, fallback_from=requested, reason=reason)


_loaded = False


def _load_optional() -> None:
    """Import backend modules so their ``@register`` lines run. Missing libraries are fine here: each
    backend's ``available`` probe reports them at resolve time."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib
    for mod in ("bytebound.kernels.torch_ref", "bytebound.kernels.moe_host", "bytebound.kernels.triton_fp8",
                "bytebound.kernels.humming_moe", "bytebound.kernels.fla_kda",
                "bytebound.kernels.triton_kda", "bytebound.kernels.triton_mla"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:  # only our own optional modules may be absent
            if e.name != mod:
                raise


def optional_triton():
    """``(triton, triton.language, None)``, or ``(None, None, reason)`` on machines without Triton (CPU CI): the
    kernel modules import everywhere and say why they cannot run."""
    try:
        import triton
        import triton.language as tl
        return triton, tl, None
    except Exception as exc:  # pragma: no cover - depends on the machine
        return None, None, f"triton is not importable: {exc}"
