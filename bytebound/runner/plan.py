"""The execution plan: every binding decision of one engine, per op and regime, resolved once at load.

One object (:class:`BackendPlan`) holds every decision the engine makes about *how* the model runs:

* the registry ops (``kernels.registry.OPS``): ``moe``, ``linear``, ``lm_head``, ``kda``, ``mla``, ``sampling``,
  each a named backend (``torch`` | ``triton`` | ``humming`` | ``fla``);
* the named switches (:data:`SWITCHES`), plan entries that are not registry backends: ``router`` (``gemv``: the
  router GEMV and the group-limited top-k in one Triton kernel, ``triton``: the top-k as one Triton kernel after a
  cuBLAS GEMV, ``torch``), ``norm`` (``triton`` | ``torch``), ``moe_shared`` (``fused``: the shared expert as one
  more slot of the routed MoE kernels, ``separate``: a dense MLP of its own), ``kv`` (``buckets``: attention spans
  in powers of two from 1024, one decode graph each; ``exact``: every ``max_model_len`` slot), ``round``
  (``static``: MTP rounds with static shapes, one graph replay per round on CUDA, greedy and sampling requests
  alike; ``eager``) and
  ``graphs`` (``captured`` | ``eager``: CUDA-graph capture of the decode step and the MTP round).

Each entry is chosen from (device capability, the tuning tables, the user's overrides) by :meth:`BackendPlan.build`
- the one place where overrides are validated (named :class:`~bytebound.errors.ConfigError`) - and
``runner.backends.bind_model`` then records, per entry and per regime (:data:`REGIMES`: ``decode`` M = 1, ``verify``
M = k + 1, ``prefill`` M above the fast paths' width), the implementation that serves it and why
(:class:`PlanEntry`; :attr:`BackendPlan.entries`), which the manifest prints.

The user has one override mechanism: ``--backend ENTRY=NAME`` (``EngineConfig.backends``), e.g.
``--backend moe=torch --backend router=torch,kv=exact``. The older flags (``--moe-backend``, ``--fused-router``,
``--no-fused-norm``, ...) are deprecated aliases of plan entries, listed in :data:`ALIASES` (one line each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bytebound.errors import ConfigError
from bytebound.kernels.limits import verify_width
from bytebound.kernels.registry import OPS, Resolution

REGIMES = ("decode", "verify", "prefill")

# Plan entries that are not registry ops: name -> the choices, fastest first.
SWITCHES = {
    "router": ("gemv", "triton", "torch"),
    "norm": ("triton", "torch"),
    "moe_shared": ("fused", "separate"),
    "kv": ("buckets", "exact"),
    "round": ("static", "eager"),
    "graphs": ("captured", "eager"),
}
ENTRIES = OPS + tuple(SWITCHES)

# Device defaults. CPU: the torch reference everywhere (the Triton kernels and CUDA graphs do not run there).
# CUDA: each fast path is a default because it made the full-scale decode step faster on the H200 with no canary
# failing on its account (docs/perf/decode-h200.md, docs/perf/history.md).
DEFAULTS_CPU = {"moe": "torch", "linear": "torch", "lm_head": "torch", "kda": "torch", "mla": "torch",
                "sampling": "torch", "router": "torch", "norm": "torch", "moe_shared": "separate", "kv": "exact",
                "round": "eager", "graphs": "eager"}
DEFAULTS_CUDA = {"moe": "triton", "linear": "triton", "lm_head": "triton", "kda": "triton", "mla": "triton",
                 "sampling": "torch", "router": "gemv", "norm": "triton", "moe_shared": "fused", "kv": "buckets",
                 "round": "static", "graphs": "captured"}

# Switch values that need a CUDA device, and why.
CUDA_ONLY = {("router", "gemv"): "a Triton kernel", ("router", "triton"): "a Triton kernel",
             ("norm", "triton"): "a Triton kernel", ("moe_shared", "fused"): "the triton MoE kernels",
             ("kv", "buckets"): "the CPU path attends over exactly the sequence already",
             ("graphs", "captured"): "CUDA graphs"}

# The registry backends alone, without the fused switches: what a bare ``bind_model`` call bound before the switches
# were plan entries (the GPU tests' and scripts' yardsticks name it to keep their comparisons as they were).
PLAIN_SWITCHES = {"router": "torch", "norm": "torch", "moe_shared": "separate"}

# Deprecated aliases: (EngineConfig field, command-line flag, plan entry, value when on, value when off).
ALIASES = (
    ("fused_router", "--fused-router", "router", "triton", "torch"),
    ("fused_router_gemv", "--fused-router-gemv", "router", "gemv", "triton"),
    ("fused_norm", "--fused-norm", "norm", "triton", "torch"),
    ("fused_shared", "--fused-shared-expert", "moe_shared", "fused", "separate"),
    ("kv_buckets", "--decode-kv-buckets", "kv", "buckets", "exact"),
    ("spec_static_round", "--spec-static-round", "round", "static", "eager"),
    ("enforce_eager", "--enforce-eager", "graphs", "eager", None),
)


@dataclass
class PlanEntry:
    """One decision of the plan for one regime: ``impl`` (what runs, e.g. ``"triton (split, M=1)"``), ``why``
    (``"user override"`` | ``"device default"`` | ``"tuned table"`` | ``"fallback"`` | ``"width"``: past the fast
    path's token limit | ``"not used"``) and ``detail`` (the table key, the fallback's reason, the limit)."""
    impl: str
    why: str
    detail: str | None = None

    def to_dict(self) -> dict:
        d = {"impl": self.impl, "why": self.why}
        if self.detail:
            d["detail"] = self.detail
        return d


@dataclass
class BackendPlan:
    """Every binding decision of one engine (module docstring).

    ``requested``: entry -> name (registry ops and switches), after defaults and overrides. ``explicit``: the
    entries the user named (a named entry that cannot be served raises; a default falls back, recorded).
    ``resolutions``: entry -> :class:`~bytebound.kernels.registry.Resolution` after ``bind_model``.
    ``fast_paths``: each bound fast path whose kernels serve a limited number of tokens per call -> that number
    (e.g. ``{"moe[triton]": 4, "linear[triton]": 4, "router[triton]": 4}``; empty with the torch backends, which
    serve any M); :attr:`max_verify_m` is their minimum. ``entries``: ``{entry: {regime: PlanEntry}}``, filled by
    ``bind_model``. ``steps``: NEXTN drafts per round (the verify regime's M is ``steps + 1``; 0 = no verify)."""
    requested: dict[str, str]
    allow_fallback: bool = False
    resolutions: dict[str, Resolution] = field(default_factory=dict)
    fast_paths: dict[str, int] = field(default_factory=dict)
    explicit: set = field(default_factory=set)
    entries: dict[str, dict[str, PlanEntry]] = field(default_factory=dict)
    steps: int = 0
    device_type: str = "cpu"
    notes: dict[str, str] = field(default_factory=dict)     # entry -> why the default differs from the table above

    def __post_init__(self):
        # a plan made directly (``BackendPlan({"moe": "torch"})``) runs the CPU defaults for what it leaves out
        for k, v in DEFAULTS_CPU.items():
            self.requested.setdefault(k, v)

    @property
    def max_verify_m(self) -> int | None:
        """Tokens per call that every bound fast path serves (None: no bound path has a limit)."""
        return min(self.fast_paths.values()) if self.fast_paths else None

    def choice(self, entry: str) -> str:
        """What ``entry`` resolved to (after ``bind_model``: fallbacks included), else what was requested."""
        r = self.resolutions.get(entry)
        return r.resolved if r is not None else self.requested[entry]

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
                              "limit (slow): --backend moe=torch (or humming), --backend linear=torch, --lm-head "
                              "bf16, --backend router=torch")

    def fallbacks(self) -> list[Resolution]:
        return [r for r in self.resolutions.values() if r.fallback_from]

    @classmethod
    def default(cls, device, **overrides) -> "BackendPlan":
        """:meth:`build` with ``overrides`` as keywords (``None`` / ``""`` values are ignored)."""
        return cls.build(device, overrides)

    @classmethod
    def build(cls, device, overrides: dict | None = None, aliases: dict | None = None, *,
              allow_fallback: bool = False, steps: int = 0, tensor_parallel: bool = False) -> "BackendPlan":
        """The plan for ``device``: its defaults (:data:`DEFAULTS_CUDA` / :data:`DEFAULTS_CPU`), then the
        deprecated ``aliases`` (``{EngineConfig field: bool | None}``, :data:`ALIASES`), then ``overrides``
        (``{entry: name}``, e.g. ``EngineConfig.backends``). The one place where overrides are validated.

        Where two aliases set one entry, a flag turned off beats one turned on (among those off the slower
        value wins, among those on the faster): ``--no-fused-router --no-fused-router-gemv`` is ``router=torch``,
        ``--fused-router --fused-router-gemv`` is ``router=gemv``.

        Raises:
            ConfigError: an unknown entry, a switch value that is not one of its choices, a backend name the
                registry does not have, a CUDA-only value on another device, an alias that contradicts an
                override of the same entry, ``round=static`` with tensor parallelism (the round takes rank 0's
                verdict, a collective a CUDA graph cannot hold)."""
        from bytebound.kernels.registry import backends as registered
        dev = torch.device(device)
        cuda = dev.type == "cuda"
        req = dict(DEFAULTS_CUDA if cuda else DEFAULTS_CPU)
        notes: dict[str, str] = {}
        if tensor_parallel:
            req["round"] = "eager"
            notes["round"] = "tensor parallel: the ranks take rank 0's verdict (uncaptured rounds)"
        given: dict[str, tuple[str, str]] = {}       # entry -> (value, how the user said it)
        for entry, (value, flag) in _from_aliases(aliases or {}).items():
            given[entry] = (value, flag)
        for entry, value in (overrides or {}).items():
            if value in (None, ""):
                continue
            if entry not in ENTRIES:
                raise ConfigError(f"--backend {entry}={value}: no plan entry {entry!r}; the entries are "
                                  + ", ".join(ENTRIES))
            value = str(value)
            if entry in given and given[entry][0] != value:
                raise ConfigError(f"--backend {entry}={value} contradicts {given[entry][1]} "
                                  f"({entry}={given[entry][0]}); give one of them")
            given[entry] = (value, f"--backend {entry}={value}")
        for entry, (value, how) in given.items():
            if entry in SWITCHES:
                if value not in SWITCHES[entry]:
                    raise ConfigError(f"{how}: {entry} is one of {', '.join(SWITCHES[entry])}")
            elif value not in registered(entry):
                raise ConfigError(f"{how}: op {entry!r} has no backend {value!r} (have {', '.join(registered(entry))})")
            need = CUDA_ONLY.get((entry, value))
            if need and not cuda:
                raise ConfigError(f"{how} needs a CUDA device ({need})")
            if tensor_parallel and (entry, value) == ("round", "static"):
                raise ConfigError(f"{how} is not available with --tensor-parallel-size > 1 (the round takes "
                                  "rank 0's verdict, a collective a CUDA graph cannot hold); MTP rounds run "
                                  "uncaptured")
            req[entry] = value
            notes.pop(entry, None)
        return cls(req, allow_fallback=allow_fallback, explicit=set(given), steps=int(steps or 0),
                   device_type=dev.type, notes=notes)

    def source(self, entry: str) -> str:
        """Why ``entry`` was requested as it is: ``"user override"`` or ``"device default"`` (plus a note)."""
        if entry in self.explicit:
            return "user override"
        note = self.notes.get(entry)
        return f"device default ({self.device_type}; {note})" if note else f"device default ({self.device_type})"

    def regime_widths(self) -> dict[str, str]:
        """Regime -> the token count M it runs at: ``decode`` 1, ``verify`` ``steps + 1`` (None without MTP),
        ``prefill`` above the fast paths' width."""
        w = self.max_verify_m
        return {"decode": "M=1", "verify": f"M={verify_width(self.steps)}" if self.steps else "not used (no MTP)",
                "prefill": f"M>{w}" if w else "M>1"}

    def to_dict(self) -> dict:
        """JSON form for the manifest: per entry the request, its source and per regime ``{impl, why,
        detail}``."""
        out = {}
        for name in ENTRIES:
            r = self.resolutions.get(name)
            d = {"requested": self.requested.get(name), "source": self.source(name),
                 "resolved": r.resolved if r is not None else self.requested.get(name)}
            if r is not None and r.fallback_from:
                d["fallback_from"], d["reason"] = r.fallback_from, r.reason
            d["regimes"] = {g: e.to_dict() for g, e in self.entries.get(name, {}).items()}
            out[name] = d
        return {"regimes": self.regime_widths(), "max_verify_m": self.max_verify_m, "entries": out}


def _from_aliases(aliases: dict) -> dict[str, tuple[str, str]]:
    """``{EngineConfig field: bool | None}`` -> ``{entry: (value, the flag that set it)}`` by :data:`ALIASES`
    (the precedence of :meth:`BackendPlan.build`)."""
    said: dict[str, list] = {}
    for fld, flag, entry, on, off in ALIASES:
        v = aliases.get(fld)
        if v is None or (off if not v else on) is None:
            continue
        said.setdefault(entry, []).append((bool(v), on if v else off, flag if v else flag.replace("--", "--no-", 1)))
    out = {}
    for entry, items in said.items():
        rank = SWITCHES[entry].index
        offs = [i for i in items if not i[0]]
        pick = max(offs, key=lambda i: rank(i[1])) if offs else min(items, key=lambda i: rank(i[1]))
        out[entry] = (pick[1], pick[2])
    return out


def alias_values(cfg) -> dict:
    """The deprecated alias fields of an ``EngineConfig`` (or any object with them): ``{field: value}``."""
    return {fld: getattr(cfg, fld, None) for fld, *_ in ALIASES}


def parse_backend_specs(specs) -> dict[str, str]:
    """``--backend`` values -> ``{entry: name}``. Each item is ``ENTRY=NAME`` and one value may hold several,
    comma-separated (``"moe=torch,router=torch"``); ``specs`` is one string or a list of them (the repeatable
    flag). A later item for the same entry replaces an earlier one.

    Raises:
        ConfigError: an item without ``=`` or naming no plan entry (:data:`ENTRIES`)."""
    if isinstance(specs, str):
        specs = [specs]
    out: dict[str, str] = {}
    for spec in specs or ():
        for item in filter(None, (s.strip() for s in spec.split(","))):
            entry, sep, name = item.partition("=")
            if not sep or not name or entry not in ENTRIES:
                raise ConfigError(f"--backend {item!r}: expected ENTRY=NAME with ENTRY one of {', '.join(ENTRIES)}")
            out[entry] = name
    return out
