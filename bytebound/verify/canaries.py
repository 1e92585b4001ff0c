"""Start-up canaries: prove, on the loaded weights, that every optimisation lever really works (seconds).

Each canary is ``fn(engine, ctx) -> CanaryResult`` (name, lever, passed True/False/None = not applicable,
measured values, message, seconds). ``run_canaries(engine, strict)`` runs them all, in this order:

* ``levers_resolved``     every requested lever resolved as requested (backends, head path, MTP, sharing, graphs)
* ``draft_params_loaded`` every NEXTN tensor ``model.layers.{L}.*`` of the layout is in memory as in the files
                          (first and last row of each, byte-exact) and every draft parameter has a source
* ``draft_sharing``       the draft's embedding, NEXTN layer and LM head ARE the target's objects (``is``)
* ``expert_scale_layout`` MXFP4 weight/scale tensors have the dtype, shape, strides, alignment the kernel expects
* ``moe_vs_reference``    the bound routed-MoE backend vs the dequantised reference on the loaded bytes (plus the
                          shared expert where the kernels run it: MoEKernel.bind_shared), a few
                          random tokens (router-chosen and random experts) in the first/last MoE and NEXTN layers
* ``logits_finite``       no NaN/Inf in target logits (prompt + one decode step) and in draft logits
* ``lm_head_path``        fp8: FP8 vs BF16 head on real hidden states of a short prompt plus large-norm rows
                          (top-1 agreement outside near-ties, relative error bound, and not bit-equal = really
                          FP8); fp32: matches a float32 reference; bf16: matches the BF16 reference
* ``draft_head_bitwise``  the draft's head path vs the target's on the same hidden states: bit-identical
* ``draft_hot_rows``      hot-vocabulary draft head only: it is derived from the target's LM-head module (same
                          object, mode and backend), its rows (FP8 + per-channel scales, or BF16) equal the full
                          head's rows at its ids bit for bit, and its logits equal the full head's at those ids
* ``graph_replay``        graph replay vs eager on one decode step from the same state (``runner.graph``)
* ``spec_vs_plain``       speculative vs plain greedy on a short prompt: same tokens, or a divergence that starts at
                          a logit near-tie or a routing near-tie (``verify.routing``)

Canaries run inference on ``engine.runner`` and reset it afterwards; they never feed the watchdog or the
engine's speculative totals. With ``strict`` any failure raises :class:`~bytebound.errors.VerificationError`
naming the lever(s) and measured values; otherwise every failure is logged as a loud warning.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bytebound.errors import VerificationError
from bytebound.verify.manifest import build_levers, draft_sharing_facts, lever_problems, scale_granularity
from bytebound.verify.routing import first_route_flip, position_routes

log = logging.getLogger("bytebound.verify")

CANARY_PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?")
SPEC_TOKENS = 8              # greedy tokens compared by spec_vs_plain
FP8_REL_ERR_MAX = 0.10       # per-row ||fp8 - bf16|| / ||bf16|| bound of the FP8 head
LARGE_NORM_FACTORS = (32.0, 1024.0)
PROMPT_MAX = 24             # canary prompt tokens (prefill cost at full scale)
MOE_ROWS = 4                 # random tokens per checked MoE layer (plus one router-chosen decode row)


@dataclass
class CanaryResult:
    """One canary's outcome. ``passed``: True, False, or None (not applicable here, with the reason)."""
    name: str
    lever: str
    passed: bool | None
    message: str
    measured: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def status(self) -> str:
        return {True: "pass", False: "fail", None: "skip"}[self.passed]

    def to_dict(self) -> dict:
        return {"name": self.name, "lever": self.lever, "status": self.status, "passed": self.passed,
                "message": self.message, "measured": _jsonable(self.measured), "seconds": round(self.seconds, 5)}


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, torch.Tensor):
        return _jsonable(v.tolist())
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if v is None or isinstance(v, (int, str, bool)):
        return v
    return str(v)


def _ok(name, lever, msg, **m):
    return CanaryResult(name, lever, True, msg, m)


def _bad(name, lever, msg, **m):
    return CanaryResult(name, lever, False, msg, m)


def _na(name, lever, msg, **m):
    return CanaryResult(name, lever, None, msg, m)


# ---- shared context: one short prompt's prefill, computed once ---------------------------------------
class _Ctx:
    def __init__(self, engine):
        self.engine = engine
        self._hidden = self._snap = None
        self.ids = self._prompt_ids()

    def _prompt_ids(self) -> list[int]:
        e = self.engine
        v = e.model.cfg.vocab_size
        ids = e.tokenizer.encode(CANARY_PROMPT) if e.tokenizer is not None else []
        ids = [i for i in ids if 0 <= i < v]
        if len(ids) < 8:      # dummy weights (no tokenizer): a fixed spread of ids
            g = torch.Generator().manual_seed(1234)
            ids = torch.randint(0, v, (PROMPT_MAX,), generator=g).tolist()
        return ids[:PROMPT_MAX]

    def _prefill(self) -> None:
        r = self.engine.runner
        r.reset()
        with torch.inference_mode():
            self._hidden = r.prefill(torch.tensor(self.ids)).clone()
        self._snap = r.snapshot()
        r.reset()

    @property
    def hidden(self) -> torch.Tensor:
        """Final-normed target hidden states ``[P, H]`` of the canary prompt."""
        if self._hidden is None:
            self._prefill()
        return self._hidden

    def after_prefill(self) -> torch.Tensor:
        """Put the runner in its state right after the prompt's prefill (one prefill for all canaries);
        returns the prompt's hidden states."""
        if self._snap is None:
            self._prefill()
        self.engine.runner.restore(self._snap)
        return self._hidden

    def head_rows(self) -> tuple[torch.Tensor, list[str]]:
        """Real rows plus the largest-norm real row scaled up (large-norm rows); with labels."""
        h = self.hidden
        i = int(h.float().norm(dim=-1).argmax())
        big = [h[i:i + 1] * f for f in LARGE_NORM_FACTORS]
        labels = [f"prompt[{j}]" for j in range(h.shape[0])] + [f"prompt[{i}]x{f:g}" for f in LARGE_NORM_FACTORS]
        return torch.cat([h] + big, 0), labels


def _rtol(dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def logit_tie_tolerance(logits: torch.Tensor, dtype) -> float:
    """Two logits of ``logits [V]`` closer than this are a near-tie that the model dtype's rounding may flip:
    1e-4 (float32) or 2e-2 (bf16) times the largest |logit|."""
    return (1e-4 if dtype == torch.float32 else 2e-2) * float(logits.abs().max())


@torch.inference_mode()
def replay_plain_logits(engine, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """The plain decode's logits for the token after ``prompt_ids`` + ``tokens``, made as ``Engine.generate`` makes
    them (a prefill of the prompt, then one decode step per token): float32 ``[V]``, for judging a speculative vs
    plain greedy mismatch against :func:`logit_tie_tolerance`. The runner is reset before and after."""
    r = engine.runner
    r.reset()
    try:
        lg = r.logits(r.prefill(torch.tensor(prompt_ids))[-1:])
        for t in tokens:
            lg = r.logits(r.forward(torch.tensor([t], device=engine.device)))
        return lg[0].float()
    finally:
        r.reset()


# ---- the canaries -------------------------------------------------------------------------------------
def canary_levers(engine, ctx) -> CanaryResult:
    levers = build_levers(engine)
    probs = lever_problems(levers)
    resolved = {k: d.get("resolved") for k, d in levers.items()}
    if probs:
        return _bad("levers_resolved", ",".join(p[0] for p in probs),
                    "; ".join(f"{lv}: {msg}" for lv, msg in probs), resolved=resolved)
    return _ok("levers_resolved", "all", f"{len(levers)} levers resolved as requested", resolved=resolved)


def _file_index(path: Path) -> dict[str, str]:
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        return dict(json.loads(idx.read_text())["weight_map"])
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def _same(file_t: torch.Tensor, p: torch.Tensor) -> bool:
    p = p.detach().cpu()
    if p.dtype in (torch.uint8, torch.float8_e4m3fn):
        return torch.equal(file_t.contiguous().view(torch.uint8), p.contiguous().view(torch.uint8))
    return torch.equal(file_t.to(p.dtype), p)


def canary_draft_params_loaded(engine, ctx) -> CanaryResult:
    name, lever = "draft_params_loaded", "mtp"
    m = engine.model
    cfg = m.cfg
    if not cfg.num_nextn_predict_layers:
        return _na(name, lever, "not applicable (no NEXTN layer in the checkpoint)")
    if engine.config.load_format == "dummy":
        return _na(name, lever, "not applicable (dummy weights: no checkpoint files to compare)")
    if getattr(engine, "tp", None) is not None:
        # the rank holds slices (bytebound.parallel.shard_model), not the files' rows; draft_sharing and
        # draft_head_bitwise still check the draft's identity with the target on this rank
        return _na(name, lever, f"not applicable (tensor parallel rank {engine.tp.rank}: the rank holds slices "
                   "of the NEXTN tensors, not whole rows of the files)")
    from safetensors import safe_open
    from bytebound.checkpoint.layout import expected_tensors
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    specs = expected_tensors(cfg)
    draft = [s for s in specs if s.name.startswith(prefix)]
    params = dict(m.named_parameters())
    problems: list[str] = []
    # 1. every draft parameter of the module has a checkpoint source in the layout
    targets = {s.target for s in draft}
    for pn in params:
        if pn.startswith(prefix) and pn not in targets:
            problems.append(f"{pn}: draft parameter with no checkpoint tensor (never loaded)")
    # 2. the loader's own record
    names = getattr(m, "loaded_names", None)
    if names is not None:
        problems += [f"{s.name}: not in the loader's loaded set" for s in draft if s.name not in names]
    count = getattr(m, "loaded_tensors", None)
    if count is not None and count != len(specs):
        problems.append(f"loader filled {count} tensors, layout expects {len(specs)}")
    # 3. byte-exact spot check of every draft tensor (first and last row) against the files
    path = Path(engine.config.model)
    wmap = _file_index(path)
    checked = 0
    by_file: dict[str, list] = {}
    for s in draft:
        if s.name not in wmap:
            problems.append(f"{s.name}: not in the checkpoint index")
        else:
            by_file.setdefault(wmap[s.name], []).append(s)
    for fname, group in by_file.items():
        with safe_open(str(path / fname), framework="pt") as f:
            for s in group:
                sl = f.get_slice(s.name)
                n = sl.get_shape()[0]
                p = params[s.target]
                for row in sorted({0, n - 1}):
                    ft = sl[row:row + 1]
                    pr = p[row:row + 1] if s.expert is None else p[s.expert, s.rows[0] + row:s.rows[0] + row + 1]
                    if not _same(ft, pr):
                        problems.append(f"{s.name}: row {row} in memory differs from {fname} (not loaded?)")
                        break
                checked += 1
    meas = {"draft_tensors": len(draft), "checked": checked, "problems": problems[:8]}
    if problems:
        return _bad(name, lever, f"{len(problems)} draft parameter problem(s): " + "; ".join(problems[:4]), **meas)
    return _ok(name, lever, f"all {len(draft)} NEXTN tensors loaded (rows match the files byte for byte)", **meas)


def canary_draft_sharing(engine, ctx) -> CanaryResult:
    name, lever = "draft_sharing", "draft_sharing"
    if engine.drafter is None:
        return _na(name, lever, "not applicable (MTP off)")
    f = draft_sharing_facts(engine)
    bad = []
    if not f["lm_head_same_object"]:
        # What the alias reads depends on the head: with the FP8 head, FP8 bytes without their scales (the seed's
        # failure); with a BF16/FP32 head the same BF16 weight, but not through the target head's path.
        harm = ("FP8 bytes read without their scales" if f["target_head_mode"] == "fp8" else
                f"with this {f['target_head_mode']!r} head it reads the same BF16 weight, but not through the target "
                f"head's path: with the FP8 head it would read FP8 bytes without their scales")
        what = (f"a different module that aliases the target's weight tensor - the seed's silent fallback ({harm})"
                if f["lm_head_weight_aliased"] else "a different module")
        bad.append(f"draft LM head is not the target's LM-head module: it is {what} "
                   f"(target {f['target_head_type']} mode {f['target_head_mode']!r}, draft {f['draft_head_type']} "
                   f"mode {f['draft_head_mode']!r})")
    if not f["embedding_same_object"]:
        bad.append("draft embedding is not the target's embedding module")
    if not f["nextn_same_object"]:
        bad.append("draft NEXTN layer is not the model's model.layers.{L}")
    if bad:
        return _bad(name, lever, "; ".join(bad), **f)
    return _ok(name, lever, "draft embedding, NEXTN layer and LM head are the target's objects (identity)", **f)


def expected_scale_layout(ex) -> dict[str, tuple[tuple, tuple]]:
    """``{tensor: (shape, strides)}`` the bound MoE kernel reads. A backend with its own layout sets
    ``ex.kernel_layout`` (same form) at bind; the default is row-major ``[E, N, K/2]`` / ``[E, N, K/32]``."""
    own = getattr(ex, "kernel_layout", None)
    if own:
        return dict(own)

    def rm(*shape):
        st, acc = [], 1
        for d in reversed(shape):
            st.append(acc)
            acc *= d
        return tuple(shape), tuple(reversed(st))
    e, i2, h, i = ex.n, 2 * ex.inter, ex.hidden, ex.inter
    if ex.fmt == "mxfp4":
        return {"w13": rm(e, i2, h // 2), "w13_scale": rm(e, i2, h // 32), "w2": rm(e, h, i // 2),
                "w2_scale": rm(e, h, i // 32)}
    return {"w13": rm(e, i2, h), "w2": rm(e, h, i)}


def canary_expert_scale_layout(engine, ctx) -> CanaryResult:
    from bytebound.verify.manifest import _routed_experts
    name, lever = "expert_scale_layout", "moe"
    mods = _routed_experts(engine.model)
    if not mods:
        return _na(name, lever, "not applicable (no routed experts)")
    problems = []
    for mn, ex in mods:
        for tn, (shape, strides) in expected_scale_layout(ex).items():
            t = getattr(ex, tn)
            full = f"{mn}.{tn}"
            want_dt = (torch.uint8, torch.float8_e8m0fnu) if tn.endswith("_scale") else \
                ((torch.uint8,) if ex.fmt == "mxfp4" else (engine.model.dtype,))
            if t.dtype not in want_dt:
                problems.append(f"{full}: dtype {t.dtype}, kernel expects {[str(d) for d in want_dt]}")
            if tuple(t.shape) != shape:
                problems.append(f"{full}: shape {tuple(t.shape)}, kernel expects {shape}")
            elif tuple(t.stride()) != strides:
                problems.append(f"{full}: strides {tuple(t.stride())}, kernel expects {strides} "
                                f"(layout {'row-major' if t.is_contiguous() else 'non-contiguous'})")
            if t.data_ptr() % 16:
                problems.append(f"{full}: data pointer not 16-byte aligned")
            if tn.endswith("_scale") and t.dtype == torch.uint8 and bool((t == 255).any()):
                problems.append(f"{full}: E8M0 byte 255 (NaN)")
    want = expected_scale_layout(mods[0][1])
    meas = {"layers": len(mods), "format": mods[0][1].fmt, "problems": problems[:8],
            "expected": {k: {"shape": list(v[0]), "stride": list(v[1])} for k, v in want.items()}}
    if problems:
        return _bad(name, lever, f"{len(problems)} expert tensor layout problem(s): " + "; ".join(problems[:3]),
                    **meas)
    return _ok(name, lever, f"{len(mods)} layers: {mods[0][1].fmt} weights/scales in the layout the kernel reads",
               **meas)


class _RawExperts:
    """The loaded expert bytes seen by ``moe_reference`` without any backend-prepared copy."""

    def __init__(self, ex):
        self.fmt, self.n, self.inter, self.limit, self._deq = ex.fmt, ex.n, ex.inter, ex.limit, None
        self.w13, self.w2 = ex.w13, ex.w2
        self.w13_scale, self.w2_scale = getattr(ex, "w13_scale", None), getattr(ex, "w2_scale", None)


def _checked_moe_layers(model):
    from bytebound.layers.moe import MoE
    layers = [(i, l.mlp) for i, l in enumerate(model.model.layers) if isinstance(l.mlp, MoE)]
    if len(layers) <= 3:
        return layers
    dec = [x for x in layers if x[0] < model.cfg.num_hidden_layers]
    keep = {dec[0][0], dec[-1][0], layers[-1][0]}
    return [x for x in layers if x[0] in keep]


@torch.inference_mode()
def canary_moe_vs_reference(engine, ctx) -> CanaryResult:
    from bytebound.kernels.torch_ref import moe_reference, shared_expert_reference
    name, lever = "moe_vs_reference", "moe"
    layers = _checked_moe_layers(engine.model)
    if not layers:
        return _na(name, lever, "not applicable (no MoE layers)")
    dev, dt = engine.device, engine.model.dtype
    tol = _rtol(dt)
    g = torch.Generator(device="cpu").manual_seed(7)
    worst, per = 0.0, {}
    for li, moe in layers:
        ex = moe.experts
        h = ex.hidden
        x = torch.randn(MOE_ROWS + 1, h, generator=g).to(dev, dt)
        ids_r, w_r = moe.router(x[:1])                                        # a router-chosen decode row
        # expert parallel (bytebound.parallel): the rank holds ex.n experts from ex.first; check its own experts
        # through the unwrapped call (local ids), router-chosen ids folded into its range
        ids_r = ids_r % ex.n
        call = getattr(ex, "local_forward", ex)
        k = ids_r.shape[1]
        ids = torch.stack([torch.randperm(ex.n, generator=g)[:k] for _ in range(MOE_ROWS)]).to(dev)
        w = torch.rand(MOE_ROWS, k, generator=g).to(dev)
        w = w / w.sum(-1, keepdim=True)
        errs = []
        for xs, i_, w_ in ((x[:1], ids_r, w_r), (x[1:], ids, w)):
            y = call(xs, i_, w_).float()
            ref = moe_reference(_RawExperts(ex), xs.float(), i_, w_.float())
            if ex.shared_in(xs.shape[0], k):        # the kernels ran the shared expert too (MoEKernel.bind_shared)
                ref = ref + shared_expert_reference(moe.shared_experts, xs.float())
            errs.append(float((y - ref).norm() / ref.norm().clamp(min=1e-30)) if torch.isfinite(y).all()
                        else float("inf"))
        per[f"layer{li}"] = [round(e, 6) for e in errs]
        worst = max(worst, *errs)
    meas = {"rel_err": per, "max_rel_err": worst, "tolerance": tol, "backend": layers[0][1].experts.backend,
            "shared_expert": (engine.plan.resolutions["moe"].shared if "moe" in engine.plan.resolutions else None),
            "rows": {"router": 1, "random_experts": MOE_ROWS}}
    if not worst <= tol:
        return _bad(name, lever, f"routed MoE ({meas['backend']}) differs from the dequantised reference on the "
                    f"loaded weights: max rel err {worst:.3g} > {tol:g} ({per})", **meas)
    return _ok(name, lever, f"{len(layers)} layers, max rel err {worst:.2e} <= {tol:g}", **meas)


@torch.inference_mode()
def canary_logits_finite(engine, ctx) -> CanaryResult:
    name, lever = "logits_finite", "lm_head"
    r = engine.runner
    bad = {}
    lg = r.logits(ctx.hidden)
    bad["prompt"] = int((~torch.isfinite(lg)).sum())
    h = ctx.after_prefill()
    tok = int(r.logits(h[-1:]).argmax(-1)[0])
    step = r.logits(r.forward(torch.tensor([tok], device=engine.device)))
    bad["decode_step"] = int((~torch.isfinite(step)).sum())
    if engine.drafter is not None:
        dr = engine.drafter
        ids = torch.tensor(ctx.ids[1:] + [tok], device=engine.device)
        dh = dr.hidden(ids, h, torch.arange(0, len(ctx.ids), device=engine.device), r.state)
        bad["draft"] = int((~torch.isfinite(dr.logits(dh))).sum())
    r.reset()
    if any(bad.values()):
        return _bad(name, lever, f"non-finite logits (NaN/Inf counts): {bad}", nonfinite=bad)
    return _ok(name, lever, f"all logits finite ({', '.join(bad)})", nonfinite=bad)


class _RankHead:
    """A vocabulary-parallel head seen through this rank's columns ``[v0, v1)`` of its gathered logits."""

    def __init__(self, head, v0: int, v1: int):
        self._head, self._v = head, (v0, v1)

    def __getattr__(self, k):
        return getattr(self._head, k)

    def __call__(self, x):
        return self._head(x)[..., self._v[0]:self._v[1]]


@torch.inference_mode()
def canary_lm_head(engine, ctx) -> CanaryResult:
    from bytebound.layers.lm_head import bf16_logits
    name, lever = "lm_head_path", "lm_head"
    head = engine.model.lm_head
    x, labels = ctx.head_rows()
    tp = getattr(engine, "tp", None)
    if tp is not None:      # vocabulary-parallel head: compare this rank's rows of the gathered logits
        v = head.weight.shape[0]
        head = _RankHead(head, tp.rank * v, (tp.rank + 1) * v)
    if head.mode == "fp8":
        meas = {"mode": "fp8", "rows": len(labels), "large_norm_rows": labels[-len(LARGE_NORM_FACTORS):],
                "scale_granularity": scale_granularity(head.weight, head.w_scale),
                "w_fp8_dtype": str(head.w_fp8.dtype) if head.w_fp8 is not None else None,
                "rel_err_bound": FP8_REL_ERR_MAX}
        if head.w_fp8 is None or head.w_fp8.dtype != torch.float8_e4m3fn:
            return _bad(name, lever, "FP8 LM head requested but the head holds no E4M3 weight", **meas)
        if head.w_scale is None or meas["scale_granularity"] != "per-output-channel":
            return _bad(name, lever, f"FP8 LM head scale is {meas['scale_granularity']} (expected per-output-channel "
                        f"float32 [V]): the scales were dropped or mis-shaped", **meas)
        l8 = head(x).float()
        lb = bf16_logits(head.weight, x).float()
        diff = l8 - lb
        rel = (diff.norm(dim=-1) / lb.norm(dim=-1).clamp(min=1e-30))
        rel = torch.where(torch.isfinite(rel), rel, torch.full_like(rel, float("inf")))
        a8, ab = l8.argmax(-1), lb.argmax(-1)
        tie = 3 * diff.pow(2).mean(-1).sqrt()                           # near-tie band per row
        gap = lb.gather(1, ab[:, None])[:, 0] - lb.gather(1, a8[:, None])[:, 0]
        agree = (a8 == ab)
        real_flip = (~agree) & (gap > tie)
        meas.update({"max_rel_err": float(rel.max()), "mean_rel_err": float(rel.mean()),
                     "rel_err_large_norm": [float(v) for v in rel[-len(LARGE_NORM_FACTORS):]],
                     "top1_agreement": float(agree.float().mean()), "top1_flips_outside_ties": int(real_flip.sum())})
        if float(rel.max()) == 0.0:
            return _bad(name, lever, "FP8 head logits are bit-identical to the BF16 head: the FP8 path is not in use",
                        **meas)
        if not float(rel.max()) <= FP8_REL_ERR_MAX or real_flip.any():
            worst = labels[int(rel.argmax())]
            return _bad(name, lever, f"FP8 head vs BF16 head: max rel err {float(rel.max()):.3g} (row {worst}) "
                        f"bound {FP8_REL_ERR_MAX}, top-1 agreement {meas['top1_agreement']:.3f}, "
                        f"{meas['top1_flips_outside_ties']} top-1 flip(s) outside near-ties (scale dropped or wrong?)",
                        **meas)
        return _ok(name, lever, f"FP8 vs BF16 head on {len(labels)} rows (incl. x{LARGE_NORM_FACTORS} norms): "
                   f"max rel err {float(rel.max()):.3g} <= {FP8_REL_ERR_MAX}, top-1 agreement "
                   f"{meas['top1_agreement']:.3f} (flips only at near-ties)", **meas)
    out = head(x).float()
    if head.mode == "fp32":
        ref = torch.nn.functional.linear(x.double(), head.weight.double()).float()
        tol = 1e-5
    else:
        ref = bf16_logits(head.weight, x)
        tol = _rtol(head.weight.dtype)
    err = float((out - ref).norm() / ref.norm().clamp(min=1e-30))
    meas = {"mode": head.mode, "rows": len(labels), "rel_err": err, "tolerance": tol, "logits_dtype": str(out.dtype)}
    if head.mode == "fp32":
        meas["bf16_path_rel_err"] = float((bf16_logits(head.weight.bfloat16(), x).float() - ref).norm()
                                          / ref.norm().clamp(min=1e-30))
    if not err <= tol:
        return _bad(name, lever, f"{head.mode} head ({head.backend}) vs its reference: rel err {err:.3g} > {tol:g}",
                    **meas)
    return _ok(name, lever, f"{head.mode} head matches its reference (rel err {err:.2e} <= {tol:g})", **meas)


@torch.inference_mode()
def canary_draft_head(engine, ctx) -> CanaryResult:
    name, lever = "draft_head_bitwise", "draft_sharing"
    dr = engine.drafter
    if dr is None:
        return _na(name, lever, "not applicable (MTP off)")
    x, labels = ctx.head_rows()
    t = engine.model.logits(x)
    d = dr.logits(x)
    same = t.shape == d.shape and t.dtype == d.dtype and torch.equal(t, d)
    meas = {"rows": len(labels), "bit_identical": same, "head_mode": engine.model.lm_head.mode}
    if not same:
        if t.shape == d.shape:
            meas["max_abs_diff"] = float((t.float() - d.float()).abs().max())
            meas["top1_agreement"] = float((t.argmax(-1) == d.argmax(-1)).float().mean())
        return _bad(name, lever, f"draft head path differs from the target's on the same hidden states "
                    f"(max abs diff {meas.get('max_abs_diff', 'shape/dtype mismatch')}, top-1 agreement "
                    f"{meas.get('top1_agreement', 0):.3f}): the draft does not use the target's LM-head module", **meas)
    return _ok(name, lever, f"draft and target head logits bit-identical on {len(labels)} rows", **meas)


HOT_LOGIT_RTOL = {"float32": 1e-5, "fp8": 1e-4, "bf16": 1e-2}   # x max |logit|: summation order / BF16 output


@torch.inference_mode()
def canary_draft_hot_rows(engine, ctx) -> CanaryResult:
    """The hot-vocabulary draft head (``speculative.hot_vocab.HotHead``) is a row subset of the target's LM-head
    module: same object, mode and backend; ``w_fp8[ids]`` / ``w_scale[ids]`` (fp8) or ``weight[ids]`` equal the
    head's rows byte for byte; on real hidden states its logits equal the full head's columns ``ids`` within the
    product's rounding (``HOT_LOGIT_RTOL`` x max |logit|: a different GEMM shape may sum in another order)."""
    name, lever = "draft_hot_rows", "draft_sharing"
    dr = engine.drafter
    hot = getattr(dr, "hot", None)
    if hot is None:
        return _na(name, lever, "not applicable (MTP off)" if dr is None else
                   "not applicable (full draft head: no --speculative-draft-vocab)")
    head = engine.model.lm_head
    v = head.weight.shape[0]
    ids = hot.ids
    bad = []
    if hot.head is not head or dr.lm_head is not head:
        bad.append("the hot head is not derived from the target's LM-head module")
    if hot.mode != head.mode or hot.backend != head.backend:
        bad.append(f"hot head path {hot.mode}/{hot.backend} differs from the head's {head.mode}/{head.backend}")
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= v or (ids.numel() > 1 and
                                                                      not bool((ids[1:] > ids[:-1]).all())):
        bad.append("hot ids are not sorted, unique ids in [0, V)")
        return _bad(name, lever, "; ".join(bad), n=ids.numel())

    def rows_equal(sub, full) -> bool:
        if sub is None or full is None:
            return False
        want = full.detach().index_select(0, ids)
        return (sub.shape == want.shape and sub.dtype == want.dtype
                and torch.equal(sub.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)))
    if head.mode == "fp8":
        checks = {"w_fp8_rows_equal": rows_equal(hot.w_fp8, head.w_fp8),
                  "w_scale_rows_equal": rows_equal(hot.w_scale.view(-1, 1), head.w_scale.view(-1, 1))}
    else:
        checks = {"weight_rows_equal": rows_equal(hot.weight, head.weight)}
    bad += [f"{k.replace('_rows_equal', '')} rows differ from the head's rows at the hot ids"
            for k, ok in checks.items() if not ok]
    x, labels = ctx.head_rows()
    full = engine.model.logits(x).index_select(-1, ids)
    got = hot.logits(x)
    kind = "fp8" if head.mode == "fp8" else "float32" if (head.mode == "fp32" or head.weight.dtype == torch.float32) \
        else "bf16"
    err = float((got.float() - full.float()).abs().max() / full.float().abs().max().clamp_min(1e-30))
    if got.shape != full.shape or not err <= HOT_LOGIT_RTOL[kind]:
        bad.append(f"hot logits vs the full head's at the hot ids: rel err {err:.3g} > {HOT_LOGIT_RTOL[kind]:g}")
    meas = {"n": hot.n, "vocab_size": v, "share": hot.n / v, "head_mode": head.mode, "backend": head.backend,
            **checks, "logit_rel_err": err, "rows": len(labels), "bytes_per_draft_step": hot.bytes_per_call(),
            "full_head_bytes": head.bytes_per_call()}
    if bad:
        return _bad(name, lever, "; ".join(bad), **meas)
    return _ok(name, lever, f"hot draft head: {hot.n} of {v} rows of the target's {head.mode} head, rows"
               f"{' and scales' if head.mode == 'fp8' else ''} bit-identical, logits within {err:.1e}", **meas)


@torch.inference_mode()
def decode_vs_verify(runner, tok: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP verify's correctness property, from the runner's current state: ``n`` greedy decode steps from
    ``tok [1]``, then the same ``n`` tokens (``tok`` and the first ``n - 1`` decoded ones) as one verify forward
    from the same state. Returns float32 logits ``(decode [n, V], verify [n, V])``, which must agree up to the
    dtype's rounding; the state is restored afterwards."""
    model, snap = runner.model, runner.snapshot()
    toks, seq = [tok.view(1)], []
    for _ in range(n):
        lg = model.logits(runner.forward(toks[-1])).float()
        seq.append(lg[0])
        toks.append(lg.argmax(-1).view(1))
    runner.restore(snap)
    ver = model.logits(runner.verify(torch.cat(toks[:n]))).float()
    runner.restore(snap)
    return torch.stack(seq), ver


def graph_step_fns(runner, g):
    """``(replay, eager)``: one decode step ``token -> logits [1, V]`` through the captured graph and eagerly.

    A graph object may provide ``replay_decode(token)`` / ``eager_decode(token)`` itself; otherwise (the
    runner's ``DecodeGraph``: ``replay(token, pos)`` used by ``runner.forward`` for one token) the replay goes
    through ``runner.forward`` (the production dispatch) and the eager step runs the same call with
    ``runner.graph`` detached."""
    if hasattr(g, "replay_decode") and hasattr(g, "eager_decode"):
        return g.replay_decode, g.eager_decode
    dev = runner.device

    def replay(tok: int) -> torch.Tensor:
        return runner.logits(runner.forward(torch.tensor([tok], device=dev)))

    def eager(tok: int) -> torch.Tensor:
        saved, runner.graph = runner.graph, None
        try:
            return runner.logits(runner.forward(torch.tensor([tok], device=dev)))
        finally:
            runner.graph = saved
    return replay, eager


@torch.inference_mode()
def canary_graph_replay(engine, ctx) -> CanaryResult:
    name, lever = "graph_replay", "cuda_graphs"
    r = engine.runner
    g = getattr(r, "graph", None)
    if g is None:
        return _na(name, lever, "not applicable (eager: no CUDA graph captured)")
    shapes = list(getattr(g, "captured_shapes", []))
    if not shapes:
        return _bad(name, lever, "runner.graph is set but reports no captured shapes", captured_shapes=shapes)
    replay, eager = graph_step_fns(r, g)
    h = ctx.after_prefill()
    tok = int(r.logits(h[-1:]).argmax(-1)[0])
    snap = r.snapshot()
    pos = r.pos
    le = eager(tok).float().clone()
    r.restore(snap)
    lg = replay(tok).float().clone()
    # against the replayed step's logits: the token graphs read the replayed hidden state, and a replay within
    # tolerance but not bit-identical to eager could flip a sampled token without any fault of the token graphs
    tokens = _token_graphs_vs_eager(r, g, snap, tok, lg)
    r.reset()
    tol = _rtol(engine.model.dtype)
    err = float((lg - le).norm() / le.norm().clamp(min=1e-30)) if torch.isfinite(lg).all() else float("inf")
    same_top1 = bool((lg.argmax(-1) == le.argmax(-1)).all())
    meas = {"position": pos, "token": tok, "rel_err": err, "tolerance": tol, "top1_equal": same_top1,
            "bit_identical": bool(torch.equal(lg, le)), "captured_shapes": shapes, "token_graphs": tokens}
    if not (err <= tol and same_top1):
        return _bad(name, lever, f"graph replay differs from eager at position {pos}: rel err {err:.3g} > {tol:g} "
                    f"or top-1 differs (top-1 equal: {same_top1}) - stale static inputs (positions / kv length) "
                    f"in the captured graph?", **meas)
    if tokens and not all(t["equal"] for t in tokens.values()):
        return _bad(name, lever, f"the captured next-token graphs differ from the eager head + sampling at position "
                    f"{pos}: {tokens}", **meas)
    return _ok(name, lever, f"replay == eager at position {pos} (rel err {err:.2e}, bit-identical "
               f"{meas['bit_identical']}), next-token graphs {sorted(tokens) or 'not captured'}, shapes {shapes}",
               **meas)


def _token_graphs_vs_eager(r, g, snap, tok: int, le: torch.Tensor) -> dict:
    """The captured next-token graphs (``DecodeGraph.replay_token``: greedy, and sampling at fixed settings and
    seed) from ``snap`` against the eager choice on the logits ``le`` of the same step (the replayed step's):
    ``{kind: {"graph", "eager", "equal"}}``, empty for a graph without token graphs. Leaves the runner restored to
    ``snap``."""
    from bytebound.sampling import SamplingParams, sample
    if not getattr(g, "token_graphs", None):
        return {}
    out = {}
    for kind, p in (("greedy", SamplingParams(temperature=0.0)),
                    ("sampled", SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1234))):
        r.restore(snap)
        gen_g = torch.Generator(device=r.device).manual_seed(1234)
        gen_e = torch.Generator(device=r.device).manual_seed(1234)
        got = int(r.decode_token(torch.tensor([tok], device=r.device), p, gen_g)[0][0])
        want = int(sample(le, p, gen_e).view(-1)[0])
        out[kind] = {"graph": got, "eager": want, "equal": got == want}
    r.restore(snap)
    return out


@torch.inference_mode()
def canary_spec_vs_plain(engine, ctx) -> CanaryResult:
    from bytebound.sampling import SamplingParams
    from bytebound.speculative.mtp import SpecStats
    from bytebound.speculative.round import mtp_tokens
    name, lever = "spec_vs_plain", "mtp"
    dr = engine.drafter
    if dr is None:
        return _na(name, lever, "not applicable (MTP off)")
    r, dev = engine.runner, engine.device
    ids = torch.tensor(ctx.ids)
    n = SPEC_TOKENS
    plain, plain_logits = [], []
    # both runs record their routed experts by position (eager decode: the graph is detached meanwhile)
    with position_routes(r) as plain_routes:
        lg = r.logits(ctx.after_prefill()[-1:])
        for i in range(n):
            plain_logits.append(lg[0].float())
            plain.append(int(lg.argmax(-1)[0]))
            if i + 1 < n:
                lg = r.logits(r.forward(torch.tensor([plain[-1]], device=dev)))
    r.reset()
    stats = SpecStats(dr.steps)
    spec = []
    with position_routes(r) as spec_routes:
        # an uncaptured round (the captured one runs the same body, but a replay runs no Python: the routes the
        # diagnosis below compares would not be recorded)
        src = mtp_tokens(r, dr, ids, SamplingParams(max_tokens=n, ignore_eos=True), None, stats)
        try:
            for tok, _ in src:
                spec.append(tok)
                if len(spec) >= n:
                    break
        finally:
            src.close()
    r.reset()
    meas = {"tokens": n, "plain": plain, "spec": spec, "rounds": stats.rounds,
            "canary_accept_length": round(stats.accept_length, 3)}
    if spec == plain:
        return _ok(name, lever, f"speculative greedy == plain greedy over {n} tokens "
                   f"({stats.rounds} verify rounds)", **meas)
    i = next(j for j in range(n) if spec[j] != plain[j])
    l = plain_logits[i]
    margin = float(l[plain[i]] - l[spec[i]])
    # Diagnosis: the verify forward (M = steps + 1 tokens at once, as a round runs it, KDA states recorded per
    # token) fed the *plain* tokens must give the plain decode's logits up to rounding, position by position; a
    # large error points at the M > 1 path (verify), not the draft.
    k = min(dr.steps + 1, n - 1)
    if k > 0:
        try:
            r.logits(ctx.after_prefill()[-1:])
            vl = r.logits(r.verify(torch.tensor(plain[:k], device=dev))).float()
            pl = torch.stack(plain_logits[1:k + 1])
            meas["verify_vs_decode_rel_err"] = [float((vl[j] - pl[j]).norm() / pl[j].norm()) for j in range(k)]
            meas["verify_vs_decode_argmax_equal"] = [bool(vl[j].argmax() == pl[j].argmax()) for j in range(k)]
        except Exception as e:  # the diagnosis must never mask the verdict below
            meas["verify_vs_decode_error"] = f"{type(e).__name__}: {e}"
        finally:
            r.reset()
    tie = logit_tie_tolerance(l, engine.model.dtype)
    meas.update({"first_mismatch": i, "logit_margin": margin, "tie_tolerance": tie})
    if margin <= tie:
        return _ok(name, lever, f"speculative greedy == plain for {i} tokens, then a logit near-tie "
                   f"(margin {margin:.3g} <= {tie:.3g})", **meas)
    # A routing near-tie: token i comes from position P + i - 1 in both runs. If the first position/layer where the
    # runs chose different experts saw router inputs equal up to the dtype's rounding, the divergence is that
    # rounding meeting two near-equal expert scores (verify and decode kernels round differently), not a bug.
    p0 = len(ctx.ids)
    flip = first_route_flip(plain_routes, spec_routes, range(p0, p0 + i))
    rtol = _rtol(engine.model.dtype)
    meas.update({"route_flip": flip, "route_input_tolerance": rtol})
    if flip is not None and flip["input_rel_err"] <= rtol:
        return _ok(name, lever, f"speculative greedy == plain for {i} tokens, then a routing near-tie: at position "
                   f"{flip['position']} layer {flip['layer']} the router inputs agree to {flip['input_rel_err']:.2g} "
                   f"(<= {rtol:g}) yet pick different experts", **meas)
    why = ("no route differs before it" if flip is None else
           f"the first route flip (position {flip['position']}, layer {flip['layer']}) saw router inputs "
           f"{flip['input_rel_err']:.2g} apart (> {rtol:g})")
    return _bad(name, lever, f"speculative greedy diverges from plain greedy at token {i}: plain {plain[i]} vs "
                f"spec {spec[i]}, plain logit margin {margin:.3g} > near-tie {tie:.3g}, and {why}", **meas)


CANARIES = (canary_levers, canary_draft_params_loaded, canary_draft_sharing, canary_expert_scale_layout,
            canary_moe_vs_reference, canary_logits_finite, canary_lm_head, canary_draft_head,
            canary_draft_hot_rows, canary_graph_replay, canary_spec_vs_plain)
_NAMES = {canary_levers: ("levers_resolved", "all"),
          canary_draft_params_loaded: ("draft_params_loaded", "mtp"),
          canary_draft_sharing: ("draft_sharing", "draft_sharing"),
          canary_expert_scale_layout: ("expert_scale_layout", "moe"),
          canary_moe_vs_reference: ("moe_vs_reference", "moe"),
          canary_logits_finite: ("logits_finite", "lm_head"),
          canary_lm_head: ("lm_head_path", "lm_head"),
          canary_draft_head: ("draft_head_bitwise", "draft_sharing"),
          canary_draft_hot_rows: ("draft_hot_rows", "draft_sharing"),
          canary_graph_replay: ("graph_replay", "cuda_graphs"),
          canary_spec_vs_plain: ("spec_vs_plain", "mtp")}


def _sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


def run_one(fn, engine, ctx) -> CanaryResult:
    """Run one canary; an exception is a failure whose message names it."""
    t0 = time.perf_counter()
    try:
        res = fn(engine, ctx)
    except Exception as e:  # a canary that crashes is a failed canary, never a silent skip
        nm, lv = _NAMES.get(fn, (fn.__name__, "?"))
        res = _bad(nm, lv, f"canary raised {type(e).__name__}: {e}")
        try:
            engine.runner.reset()
        except Exception:
            pass
    _sync(engine.device)
    res.seconds = time.perf_counter() - t0
    return res


def failure_message(failed: list[CanaryResult]) -> str:
    levers = []
    for f in failed:
        for lv in f.lever.split(","):
            if lv not in levers:
                levers.append(lv)
    body = "\n".join(f"  [{f.lever}] {f.name}: {f.message}\n    measured: {json.dumps(_jsonable(f.measured))[:600]}"
                     for f in failed)
    return f"start-up verification FAILED for lever(s) {', '.join(levers)}:\n{body}"


def run_canaries(engine, strict: bool = False, canaries=CANARIES, warn: bool = True) -> list[CanaryResult]:
    """Run the start-up canaries on a started engine; returns the records (also kept as ``engine.canaries``).

    Raises:
        VerificationError: ``strict`` and a canary failed (message names levers and measured values; the
            records are attached as ``.results``).
    """
    ctx = _Ctx(engine)
    results = [run_one(fn, engine, ctx) for fn in canaries]
    engine.runner.reset()
    engine.canaries = results
    failed = [r for r in results if r.passed is False]
    if failed:
        msg = failure_message(failed)
        if strict:
            err = VerificationError(msg + "\n(--strict: refusing to start)")
            err.results = results
            raise err
        log.warning("%s", msg)
        if warn:
            print(f"[bytebound] WARNING: {msg}\n[bytebound] continuing without --strict; the manifest marks the "
                  f"engine 'degraded'", file=sys.stderr)
    return results
