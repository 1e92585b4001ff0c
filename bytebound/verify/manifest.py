"""The start-up manifest: for every optimisation lever, what was requested and what really resolved.

``build_manifest(engine) -> dict`` (JSON-serialisable; printed at start, by ``bytebound verify``, served by the
server and stored with bench results). Levers:

* ``moe`` / ``linear`` / ``kda`` / ``mla`` / ``sampling``: backend requested vs resolved (``runner.backends``),
  plus for the routed MoE its storage format, tensor shapes and strides and the JIT cache state when the
  backend reports it (``module.jit_info = {"cache": "hit"|"miss", ...}`` set at bind; otherwise "unknown").
* ``linear``: with the FP8 GEMV bound (``linear[triton]``), ``gemv``: per weight shape ``"NxK"`` how many
  bindings have it and per decode/verify token count ``"M=<m>"`` the kernel (mma | dot | fma), where its config
  came from (the architecture's table entry or the untuned default) and why an MMA config was refused.
* ``lm_head``: path (bf16 | fp32 | fp8), bound backend, weight dtype, logits dtype and, for FP8, the weight
  scale granularity (per output channel / per tensor / block) and the activation quantisation.
* ``mtp``: on/off, steps, draft tokens per verify, and adaptive speculation's state (mode, accept length a, round
  cost c, a / c, switches, the reason of the last decision; ``fell_back``: decoding plainly because MTP did not pay).
* ``draft_sharing``: whether the draft's embedding and LM head are the target's *objects* (identity, ``is``),
  and whether the head's weight tensor is merely aliased (the seed's silent failure).
* ``cuda_graphs``: ``runner.graph`` and its captured shapes (CUDA graphs, or the compiled CPU step of
  ``--cpu-compile``), or eager.
* ``decode_loop``: decoding pipelined (each plain step launched before the host reads the token it follows, each
  MTP round before the host reads the round before it) or plain, as ``EngineConfig.pipeline_decode`` asked and
  the engine resolved it.

``plan``: the engine's execution plan (``runner.plan.BackendPlan.to_dict``): per entry (the kernel ops and the
switches router, norm, moe_shared, kv, round, graphs) and per regime (decode M = 1, verify M = k + 1, prefill) the
implementation and why it was chosen (user override, device default, tuned table, fallback, width).

``switches``: the environment's A/B switches set away from their defaults (``bytebound.switches.overrides``),
e.g. ``BYTEBOUND_ROUTER_SEG=0``; empty for a run with the defaults. They are measurement levers, not failures, so
they do not change ``status``; they are printed so a run under one is never read as the defaults.

Each lever carries ``ok`` (resolved as requested) and ``verified`` (pass | fail | not checked, from the
canaries). ``status``: healthy | degraded (a problem, not strict) | unverified (canaries not run).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from bytebound.switches import overrides as switch_overrides

SCHEMA = 1

# Which canaries vouch for which lever (canaries.py records carry the same names).
LEVER_CANARIES = {
    "moe": ("expert_scale_layout", "moe_vs_reference"),
    "lm_head": ("lm_head_path", "logits_finite"),
    "mtp": ("draft_params_loaded", "spec_vs_plain"),
    "draft_sharing": ("draft_sharing", "draft_head_bitwise", "draft_hot_rows"),
    "cuda_graphs": ("graph_replay",),
}
# Canaries of an opt-in part of a lever (the hot-vocabulary draft head): not applicable = nothing to vouch for, not
# a lever "partly" checked.
OPTIONAL_CANARIES = ("draft_hot_rows",)


def _dt(t) -> str | None:
    return None if t is None else str(t.dtype).replace("torch.", "")


def _tensor_info(t: torch.Tensor | None) -> dict | None:
    if t is None:
        return None
    return {"shape": list(t.shape), "dtype": _dt(t), "stride": list(t.stride()), "contiguous": t.is_contiguous()}


def scale_granularity(w: torch.Tensor, scale: torch.Tensor | None) -> str:
    """Name the FP8 scale granularity of ``scale`` for weight ``w [N, K]``."""
    if scale is None:
        return "missing"
    n = w.shape[0]
    if scale.numel() == 1:
        return "per-tensor"
    if scale.dim() == 1 and scale.shape[0] == n or scale.dim() == 2 and tuple(scale.shape) == (n, 1):
        return "per-output-channel"
    if scale.dim() == 2:
        return f"block {tuple(scale.shape)}"
    return f"unknown {tuple(scale.shape)}"


# ---- levers -----------------------------------------------------------------------------------------
def _routed_experts(model):
    from bytebound.layers.moe import RoutedExperts
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]


def _moe_lever(engine) -> dict:
    r = engine.plan.resolutions.get("moe")
    mods = _routed_experts(engine.model)
    shapes: dict[str, dict] = {}
    jit: list[dict] = []
    for _, ex in mods:
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            t = getattr(ex, name, None)
            if t is not None:
                shapes.setdefault(name, _tensor_info(t))
        info = getattr(ex, "jit_info", None) or getattr(ex.fn, "jit_info", None)
        if info:
            jit.append(dict(info))
    backend = getattr(mods[0][1], "backend", None) if mods else None
    if backend == "torch" or (r and r.resolved == "torch"):
        cache = "n/a (torch backend, no JIT)"
    elif jit:
        caches = sorted({j.get("cache", "unknown") for j in jit})
        cache = caches[0] if len(caches) == 1 else "mixed: " + ",".join(caches)
    else:
        cache = "unknown (backend does not report jit_info)"
    cfg = engine.model.cfg
    steps = engine.config.speculative_steps
    d = _resolution(r)
    d.update({"format": mods[0][1].fmt if mods else None, "layers": len(mods),
              "bound_backends": sorted({str(ex.backend) for _, ex in mods}),
              "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok, "hidden": cfg.hidden_size,
              "moe_intermediate": cfg.moe_intermediate_size, "tensors": shapes,
              "call_rows": sorted({1, steps + 1}) if steps else [1], "jit_cache": cache, "jit_info": jit[:4],
              "router": getattr(r, "router", None), "prefill": getattr(r, "prefill", None),
              "shared_expert": getattr(r, "shared", None), "tuning": getattr(r, "tuning", None)})
    return d


def _resolution(r) -> dict:
    if r is None:
        return {"requested": None, "resolved": None, "ok": False, "note": "no resolution recorded"}
    d = {"requested": r.requested, "resolved": r.resolved, "ok": r.fallback_from is None and r.requested == r.resolved}
    if r.fallback_from:
        d["fallback_from"], d["reason"] = r.fallback_from, r.reason
    for extra in ("prefill", "tuning", "fused", "gemv"):
        if getattr(r, extra, None):
            d[extra] = getattr(r, extra)
    return d


def _head_resolved(head) -> str:
    if head.mode == "fp8":
        ok = (head.w_fp8 is not None and head.w_fp8.dtype == torch.float8_e4m3fn and head.w_scale is not None)
        return "fp8" if ok else "fp8 (incomplete: no FP8 weight or scale)"
    return head.mode


def _lm_head_lever(engine) -> dict:
    head = engine.model.lm_head
    want = engine.config.lm_head
    got = _head_resolved(head)
    wdt = head.weight.dtype
    d = {"requested": want, "resolved": got, "ok": want == got, "backend": head.backend,
         "weight": _tensor_info(head.weight), "logits_dtype": "float32", "bytes_per_call": head.bytes_per_call()}
    if head.mode == "bf16":
        d["math"] = ("BF16 product, float32 logits" if wdt == torch.bfloat16 else
                     f"weight is {_dt(head.weight)} on this device: the 'bf16' path computes in {_dt(head.weight)}")
    elif head.mode == "fp32":
        d["math"] = "float32 accumulation and logits (--enable-fp32-lm-head)"
    else:
        d["math"] = "E4M3 weight x E4M3 activation, float32 accumulation and logits"
        d["fp8"] = {"weight": _tensor_info(head.w_fp8), "scale": _tensor_info(head.w_scale),
                    "scale_granularity": scale_granularity(head.weight, head.w_scale),
                    "activation": "per-token dynamic E4M3 scale"}
    return d


def _mtp_lever(engine) -> dict:
    steps = engine.config.speculative_steps
    dr = engine.drafter
    got = dr.steps if dr is not None else 0
    cfg = engine.model.cfg
    plan = getattr(engine, "plan", None)
    return {"requested": {"on": steps > 0, "steps": steps}, "resolved": {"on": dr is not None, "steps": got},
            "ok": (steps > 0) == (dr is not None) and got == steps, "algorithm": "NEXTN chain, top-k 1",
            "steps": got, "draft_tokens": got + 1 if got else 0,
            "nextn_layer": cfg.num_hidden_layers if cfg.num_nextn_predict_layers else None,
            # the widest verify the bound fast paths serve (None: any) and the paths that set it
            "max_verify_m": getattr(plan, "max_verify_m", None), "fast_paths": dict(getattr(plan, "fast_paths", {})),
            # adaptive speculation (speculative.adaptive): its mode, a, c, a/c, switches and why, at build time
            "adaptive": ({**ad.state(), "catchup_warmup": getattr(engine, "catchup_warmup", None)}
                         if (ad := getattr(engine, "adaptive", None)) is not None else {"on": False}),
            # the hot-vocabulary draft head (None: the draft steps score the full head)
            "draft_vocab": (dr.hot.facts() if getattr(dr, "hot", None) is not None else None)}


def draft_sharing_facts(engine) -> dict:
    """Identity facts about the draft's embedding / LM head vs the target's (``is``, not equal values)."""
    dr, m = engine.drafter, engine.model
    if dr is None:
        return {}
    head, dhead = m.lm_head, dr.lm_head
    tgt_w = {t.data_ptr() for t in (head.weight, head.w_fp8) if t is not None}
    aliased = any(getattr(dhead, n, None) is not None and getattr(dhead, n).data_ptr() in tgt_w
                  for n in ("weight", "w_fp8"))
    return {"embedding_same_object": dr.embedding is m.model.word_embeddings,
            "lm_head_same_object": dhead is head,
            "nextn_same_object": dr.layer is m.nextn,
            "lm_head_weight_aliased": aliased and dhead is not head,
            "target_head_mode": head.mode, "draft_head_mode": getattr(dhead, "mode", None),
            "target_head_type": type(head).__name__, "draft_head_type": type(dhead).__name__,
            "configured": getattr(dr, "share", None)}


def _sharing_lever(engine) -> dict:
    if engine.drafter is None:
        return {"requested": "module", "resolved": "n/a (MTP off)", "ok": True}
    f = draft_sharing_facts(engine)
    if f["lm_head_same_object"] and f["embedding_same_object"] and f["nextn_same_object"]:
        got = "module"
    elif f["lm_head_weight_aliased"] and not f["lm_head_same_object"]:
        got = "weight-only (draft has its own LM-head module aliasing the target's weight tensor)"
    else:
        got = "not shared" if not f["lm_head_same_object"] else "partial (embedding or NEXTN not the target's)"
    return {"requested": "module", "resolved": got, "ok": got == "module", **f}


def _graph_lever(engine) -> dict:
    cfg = engine.config
    g = getattr(engine.runner, "graph", None)
    shapes = list(getattr(g, "captured_shapes", [])) if g is not None else []
    for name in ("spec_round", "spec_round_sampled"):      # the captured MTP rounds, greedy and sampled
        rnd = getattr(engine, name, None)
        if rnd is not None and rnd.graphs:
            shapes += rnd.captured_shapes
    got = "captured" if g is not None else "eager"
    plan = getattr(engine, "plan", None)
    named = plan is not None and "graphs" in plan.explicit          # --backend graphs=... / --enforce-eager win
    if engine.device.type != "cuda" and getattr(cfg, "cpu_compile", False) == "auto" and not named:
        # the demo's default: compiled where torch.compile can build the step, else eager with the reason
        requested, got = "compiled where available (torch.compile, inductor C++; else eager)", (
            "compiled" if g else "eager")
        why = getattr(engine, "cpu_compile_fallback", None) or getattr(g, "failed", None)
        return {"requested": requested, "resolved": got, "ok": g is None or bool(shapes), "captured_shapes": shapes,
                **({"fallback_reason": why} if why else {})}
    if engine.device.type != "cuda" and getattr(cfg, "cpu_compile", False) and not named:
        requested, got = "compiled (--cpu-compile: torch.compile, inductor C++)", ("compiled" if g else "eager")
        ok = g is not None and bool(shapes)
    elif engine.device.type != "cuda":
        requested = "eager (CPU: no CUDA graphs)"
        ok = g is None or bool(shapes)
    else:
        plan = getattr(engine, "plan", None)
        want = plan.requested.get("graphs", "captured") if plan is not None else "captured"
        requested = "captured" if want == "captured" else "eager (--backend graphs=eager / --enforce-eager)"
        ok = requested.startswith("eager") == (g is None)
    return {"requested": requested, "resolved": got, "ok": ok, "captured_shapes": shapes}


def _decode_loop_lever(engine) -> dict:
    want = getattr(engine.config, "pipeline_decode", None)
    on = bool(getattr(engine, "pipelined", False))
    requested = {None: "default (pipelined with CUDA and one process, else plain)", True: "pipelined",
                 False: "plain"}.get(want, repr(want))
    d = {"requested": requested, "resolved": "pipelined" if on else "plain", "ok": want is None or bool(want) == on,
         "applies_to": "plain decoding and MTP rounds (each round launched before the host reads the one "
                       "before it, where the next round is certain)"}
    if want and not on:
        d["reason"] = "tensor parallelism: the ranks exchange every token, so the plain loop runs"
    return d


def build_levers(engine) -> dict:
    levers = {"moe": _moe_lever(engine)}
    for op in ("linear", "kda", "mla", "norm", "sampling"):
        levers[op] = _resolution(engine.plan.resolutions.get(op))
    levers["lm_head"] = _lm_head_lever(engine)
    levers["mtp"] = _mtp_lever(engine)
    levers["draft_sharing"] = _sharing_lever(engine)
    levers["cuda_graphs"] = _graph_lever(engine)
    levers["decode_loop"] = _decode_loop_lever(engine)
    return levers


def lever_problems(levers: dict) -> list[tuple[str, str]]:
    """``(lever, message)`` for every lever that did not resolve as requested."""
    out = []
    for name, d in levers.items():
        if d.get("ok", True):
            continue
        msg = f"requested {d.get('requested')!r}, resolved {d.get('resolved')!r}"
        if d.get("reason"):
            msg += f" ({d['reason']})"
        if name == "draft_sharing":
            msg += (f"; embedding same object: {d.get('embedding_same_object')}, LM head same object: "
                    f"{d.get('lm_head_same_object')}, head weight aliased: {d.get('lm_head_weight_aliased')}, "
                    f"target head mode {d.get('target_head_mode')!r} vs draft {d.get('draft_head_mode')!r}")
        out.append((name, msg))
    return out


# ---- manifest -----------------------------------------------------------------------------------------
def build_manifest(engine) -> dict:
    """The manifest of a started engine (see module docstring). Reads ``engine.canaries`` (list of canary
    records, or None when not run) and ``engine.watchdog`` when present."""
    cfg, m = engine.config, engine.model
    mc = m.cfg
    levers = build_levers(engine)
    canaries = getattr(engine, "canaries", None)
    recs = [c.to_dict() for c in canaries] if canaries is not None else None
    by_name = {r["name"]: r for r in recs or []}
    for lever, names in LEVER_CANARIES.items():
        st = [by_name[n]["status"] for n in names if n in by_name
              and not (n in OPTIONAL_CANARIES and by_name[n]["status"] == "skip")]
        if "fail" in st:
            v = "fail"
        elif "pass" in st:
            v = "pass" if all(s == "pass" for s in st) else "pass (partly not applicable)"
        else:
            v = "not checked"
        levers[lever]["verified"] = v
        levers[lever]["canaries"] = list(names)
    problems = lever_problems(levers)
    plan = getattr(engine, "plan", None)
    plan_d = plan.to_dict() if hasattr(plan, "to_dict") else None
    for name in sorted(getattr(plan, "explicit", ())):       # a switch the user named that did not resolve
        r = plan.resolutions.get(name)
        if name not in levers and r is not None and r.fallback_from:
            problems.append((name, f"requested {r.fallback_from!r}, resolved {r.resolved!r} ({r.reason})"))
    failed = [r for r in recs or [] if r["status"] == "fail"]
    not_checked = [f"{r['name']}: {r['message']}" for r in recs or [] if r["status"] == "skip"]
    if recs is None:
        not_checked.append("start-up canaries were not run (--no-canaries / verify off)")
    if "unknown" in str(levers["moe"].get("jit_cache")):
        not_checked.append("MoE JIT cache state: the backend does not report it")
    wd = getattr(engine, "watchdog", None)
    wstate = wd.state() if wd is not None else None
    if failed or problems or (wstate and wstate["alarm"]):
        status = "degraded"
    elif recs is None:
        status = "unverified"
    else:
        status = "healthy"
    loaded = getattr(m, "loaded_tensors", None)
    expected = None
    if cfg.load_format != "dummy":
        from bytebound.checkpoint.layout import expected_tensors
        expected = len(expected_tensors(mc))
    return {
        "schema": SCHEMA,
        "status": status,
        "strict": bool(getattr(cfg, "strict", False)),
        "model": {"path": str(cfg.model), "name": Path(str(cfg.model)).name, "load_format": cfg.load_format,
                  "device": str(engine.device), "dtype": _dt(m.lm_head.weight), "vocab_size": mc.vocab_size,
                  "hidden_size": mc.hidden_size, "num_hidden_layers": mc.num_hidden_layers,
                  "num_experts": mc.num_experts, "nextn_layers": mc.num_nextn_predict_layers,
                  "loaded_tensors": loaded, "expected_tensors": expected},
        "levers": levers,
        # every binding decision per entry and regime: what serves decode / verify / prefill and why (runner.plan)
        "plan": plan_d,
        "problems": [{"lever": lv, "message": msg} for lv, msg in problems],
        "canaries": recs,
        "canary_seconds": round(sum(r["seconds"] for r in recs), 4) if recs else None,
        "failed": [{"lever": r["lever"], "canary": r["name"], "message": r["message"]} for r in failed],
        "watchdog": wstate,
        "not_checked": not_checked,
        "startup": getattr(engine, "startup", None),
        # tensor parallelism (bytebound.parallel.shard_model's description; this rank's view)
        "tensor_parallel": getattr(engine, "sharding", None),
        # environment A/B switches away from their defaults (bytebound.switches), read now: they act per launch
        "switches": switch_overrides(),
    }


def format_manifest(man: dict) -> str:
    """Human-readable summary: one line per lever, then the canaries."""
    lines = [f"bytebound manifest  status={man['status'].upper()}  model={man['model']['name']} "
             f"device={man['model']['device']} dtype={man['model']['dtype']} strict={man['strict']}"]
    for name, d in man["levers"].items():
        mark = "ok " if d.get("ok", True) and d.get("verified") != "fail" else "BAD"
        extra = ""
        if name == "moe":
            extra = f" fmt={d.get('format')} layers={d.get('layers')} jit={d.get('jit_cache')}"
        elif name == "lm_head" and d.get("fp8"):
            extra = f" scale={d['fp8']['scale_granularity']} backend={d.get('backend')}"
        elif name == "lm_head":
            extra = f" backend={d.get('backend')}"
        elif name == "mtp":
            extra = f" steps={d.get('steps')} draft_tokens={d.get('draft_tokens')}"
        elif name == "draft_sharing" and "lm_head_same_object" in d:
            extra = (f" embed_is={d['embedding_same_object']} head_is={d['lm_head_same_object']}"
                     f" weight_aliased={d['lm_head_weight_aliased']}")
        elif name == "cuda_graphs":
            extra = f" shapes={d.get('captured_shapes')}"
        ver = f" [{d['verified']}]" if "verified" in d else ""
        lines.append(f"  {mark} {name:<13} requested={_short(d.get('requested'))} "
                     f"resolved={_short(d.get('resolved'))}{extra}{ver}")
        if name == "moe" and d.get("tuning"):
            lines.append("      launch configs: " + "; ".join(f"{k}: {v}" for k, v in d["tuning"].items()))
        if name == "linear" and d.get("gemv"):
            lines.extend(_gemv_lines(d["gemv"]))
    pl = man.get("plan")
    if pl:
        w = pl["regimes"]
        lines.append(f"  plan (decode {w['decode']} | verify {w['verify']} | prefill {w['prefill']}):")
        for name, e in pl["entries"].items():
            cells = []
            for regime in ("decode", "verify", "prefill"):
                c = e["regimes"].get(regime)
                if c is None or c["impl"] == "not used":
                    cells.append("-")
                else:
                    cells.append(f"{c['impl']} [{c['why']}]")
            same = cells[0] if len(set(cells) - {"-"}) == 1 and cells[0] != "-" else None
            lines.append(f"    {name:<11} " + (f"all regimes: {same}" if same else " | ".join(cells)))
    if man["canaries"] is not None:
        lines.append(f"  canaries ({man['canary_seconds']:.3f} s):")
        for r in man["canaries"]:
            lines.append(f"    {r['status'].upper():<4} {r['name']:<20} {r['seconds'] * 1e3:8.1f} ms  {r['message']}")
    tp = man.get("tensor_parallel")
    if tp and tp.get("size", 1) > 1:
        lines.append(f"  tensor parallel: N={tp['size']} ({tp.get('backend')}; rank {tp['rank']} shown): "
                     f"{tp['attention']}; {tp['moe']}; {tp['mlp']}; {tp['lm_head']}; "
                     f"{tp['allreduces_per_step']} all-reduces per decode step")
    st = man.get("startup")
    if st:
        phases = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in st.items() if k.endswith("_s") and k != "total_s")
        jit = ("" if "triton_compiled" not in st else f"; Triton kernels compiled: {st['triton_compiled']} "
               f"({'warm cache' if st['triton_compiled'] == 0 else 'cold'})")
        lines.append(f"  start-up {st['total_s']:.1f} s ({phases}){jit}")
    for p in man["problems"]:
        lines.append(f"  PROBLEM {p['lever']}: {p['message']}")
    if man["watchdog"]:
        w = man["watchdog"]
        lines.append(f"  watchdog: window={w['window']} threshold={w['threshold']} rounds={w['rounds']} "
                     f"rolling={w['rolling_accept_length']} alarm={w['alarm']}")
    ad = man["levers"].get("mtp", {}).get("adaptive") or {}
    if ad.get("on"):
        dec = ad.get("last_decision") or {}
        back = " (FELL BACK to plain decoding)" if ad["fell_back"] else ""
        lines.append(f"  adaptive speculation: mode={ad['mode']}{back} a={dec.get('accept_length')}"
                     f" c={dec.get('round_cost')} a/c={dec.get('speedup')}"
                     f" to_plain={ad['to_plain']} to_mtp={ad['to_mtp']} probes={ad['probes']}: {ad['reason']}")
    for name, d in (man.get("switches") or {}).items():
        lines.append(f"  switch set: {name}={d['value']} (default {d['default'] or 'unset'}): {d['what']}")
    for s in man["not_checked"]:
        lines.append(f"  not checked: {s}")
    return "\n".join(lines)


def _gemv_lines(gemv: dict) -> list[str]:
    """The linear lever's GEMV paths, one line per weight shape; M = 1..4 merged where they agree."""
    lines = []
    for shape, d in gemv.items():
        per = [(kk, v) for kk, v in d.items() if kk.startswith("M=")]
        if len({v for _, v in per}) == 1:
            body = f"{per[0][0]}..{per[-1][0][2:]}: {per[0][1]}" if len(per) > 1 else f"{per[0][0]}: {per[0][1]}"
        else:
            body = " | ".join(f"{kk}: {v}" for kk, v in per)
        lines.append(f"      gemv {shape} ({d['layers']} layers) {body}")
    return lines


def _short(v) -> str:
    if isinstance(v, dict):
        return ",".join(f"{k}={x}" for k, x in v.items())
    return str(v)


def print_manifest(man: dict, file=None) -> None:
    print(format_manifest(man), file=file or sys.stdout)
