"""The ablation ladder: one lever at a time on the same workload, each lever proven active before it is timed.

Steps (each a fresh engine; everything not named stays as the command line set it):

1. ``baseline``   generic routed-MoE path (``--baseline-moe``, default ``torch``), BF16 head with FP32 logits
                  (``lm_head="fp32"``), no MTP;
2. ``+kernel``    the shape-specialised MoE kernel (``--kernel-moe``, default ``triton``; ``humming`` also works);
3. ``+fp8-head``  online FP8 LM head (``lm_head="fp8"``);
4. ``+mtp``       NEXTN speculative decoding (``--speculative-num-steps``, default 3).

Rules:

* **Lever check.** After start-up each step checks that its lever is really on: the MoE modules run the
  requested backend with no recorded fallback; the head is in FP8 with its E4M3 weight; the drafter exists,
  holds the target's LM-head *module* and ran verify rounds. A lever that is not active stops the ladder with
  a message naming the step, unless ``--allow-fallback`` is given: then the step runs with the lever off
  (the engine's recorded fallback, or the previous step's config when the engine cannot start with it),
  is marked ``inactive`` and is not compared.
* **TPOT check.** An active step whose mean TPOT is worse than the previous step's by more than
  ``--tpot-tolerance`` (default 1 %) stops the ladder, naming the step and the change in percent and ms.
* **On a CPU device** the ladder shows what a CPU can: ``+kernel`` is a skipped row with the reason (the
  shape-specialised MoE kernels need CUDA) and later steps keep the baseline MoE backend; ``+fp8-head`` and
  ``+mtp`` are still started, lever-checked and timed, but their TPOT change is recorded, not enforced: the
  levers cut bytes per token, and a CPU decode of a small model is bound by per-op overhead, not memory
  bandwidth (the FP8 head is emulated there, and a 4-token verify costs more than a step). The speed ladder
  proper is a CUDA measurement.

The result is complete (exit 0) or stopped (exit 3, report still written).
"""

from __future__ import annotations

import gc
from dataclasses import asdict, replace

from bytebound.errors import ByteboundError

STEPS = ("baseline", "+kernel", "+fp8-head", "+mtp")


def levers(baseline_moe: str = "torch", kernel_moe: str = "triton", mtp_steps: int = 3) -> list[tuple]:
    """``[(step, lever description, apply(config) -> config)]``: each ``apply`` turns on one lever."""
    return [("baseline", f"moe={baseline_moe}, lm_head=fp32 (BF16 weight, FP32 logits), no MTP",
             lambda c: replace(c, backends={**c.backends, "moe": baseline_moe}, lm_head="fp32", speculative_steps=0)),
            ("+kernel", f"routed-MoE backend {baseline_moe} -> {kernel_moe}",
             lambda c: replace(c, backends={**c.backends, "moe": kernel_moe})),
            ("+fp8-head", "LM head fp32 -> online FP8 (per-channel E4M3)", lambda c: replace(c, lm_head="fp8")),
            ("+mtp", f"NEXTN MTP, {mtp_steps} draft steps", lambda c: replace(c, speculative_steps=mtp_steps))]


def ladder(base, baseline_moe: str = "torch", kernel_moe: str = "triton", mtp_steps: int = 3) -> list[tuple]:
    """``[(step, lever description, EngineConfig)]`` when every lever turns on: each config differs from the
    previous one in one lever."""
    out, cfg = [], base
    for name, desc, apply in levers(baseline_moe, kernel_moe, mtp_steps):
        cfg = apply(cfg)
        out.append((name, desc, cfg))
    return out


def check_lever(step: str, engine, outputs=None) -> tuple[bool, str]:
    """Whether ``step``'s lever is really on in ``engine`` (``outputs``: the step's results, for MTP)."""
    cfg = engine.config
    if step in ("baseline", "+kernel"):
        r = engine.plan.resolutions["moe"]
        want = cfg.backends.get("moe", r.requested)
        mods = [m for m in engine.model.modules() if type(m).__name__ == "RoutedExperts"]
        wrong = sorted({str(getattr(m, "backend", None)) for m in mods} - {want})
        if r.resolved != want or r.fallback_from:
            return False, f"moe resolved to {r.resolved!r} (requested {r.requested!r}; {r.reason or 'no reason'})"
        if wrong:
            return False, f"routed-MoE modules run {wrong}, not {want!r}"
        if step == "baseline":
            head = engine.model.lm_head.mode
            if head != "fp32" or engine.drafter is not None:
                return False, f"baseline is not baseline: lm_head={head}, MTP={engine.drafter is not None}"
        return True, f"moe={want} on {len(mods)} routed-MoE modules"
    if step == "+fp8-head":
        h = engine.model.lm_head
        import torch
        if h.mode != "fp8" or h.w_fp8 is None or h.w_fp8.dtype != torch.float8_e4m3fn:
            return False, f"LM head mode {h.mode!r}, FP8 weight {'present' if h.w_fp8 is not None else 'absent'}"
        return True, f"lm_head fp8 ({tuple(h.w_fp8.shape)} E4M3 + per-channel scale)"
    if step == "+mtp":
        d = engine.drafter
        if d is None:
            return False, "no drafter"
        if d.lm_head is not engine.model.lm_head:
            return False, "the drafter does not hold the target's LM-head module (weight-only sharing)"
        rounds = sum((o.spec or {}).get("rounds", 0) for o in (outputs or []))
        if outputs is not None and rounds == 0:
            return False, "no verify round ran"
        return True, f"NEXTN drafter, {d.steps} steps, shares the LM-head module; {rounds} verify rounds"
    raise ValueError(f"unknown step {step!r}")


def _free() -> None:
    """Release the previous step's engine (the caller drops its reference first): two full-scale models do not
    fit on one GPU together."""
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def run_ablation(base, workload, baseline_moe: str = "torch", kernel_moe: str = "triton", mtp_steps: int = 3,
                 tolerance: float = 0.01, allow_fallback: bool = False, make_engine=None, log=print,
                 manifest=None) -> dict:
    """Climb the ladder. ``workload(engine) -> (outputs, extra dict)``; ``make_engine(config) -> engine``.

    Returns ``{"status": "complete"|"stopped", "stop": {...}|None, "steps": [...], "meta_engine": manifest}``;
    each step: name, lever, active, check detail, summary, tpot_ms, change vs previous/baseline, manifest.
    """
    from bytebound.bench.report import engine_manifest, summarize
    if make_engine is None:
        from bytebound.engine.engine import Engine
        make_engine = Engine
    manifest = manifest or engine_manifest
    base = replace(base, allow_fallback=allow_fallback)
    import torch
    from bytebound.kernels.registry import unusable_reason
    try:
        cpu = torch.device(base.device).type == "cpu"
    except RuntimeError:                  # a bad --device: the engine names it at the baseline step
        cpu = False
    steps, prev_cfg, prev_tpot, base_tpot, stop = [], None, None, None, None
    for name, lever, apply in levers(baseline_moe, kernel_moe, mtp_steps):
        cfg = apply(prev_cfg or base)     # on top of what really ran: an inactive lever stays off afterwards
        rec = {"step": name, "lever": lever, "active": None, "check": "", "note": ""}
        log(f"[ablation] step {name}: {lever}")
        why = unusable_reason("moe", kernel_moe, base.device) if cpu and name == "+kernel" else None
        if why:                           # a CUDA-only kernel on CPU: nothing to measure, say so and go on
            rec.update(active=False, skipped=True, check=f"skipped on CPU: moe backend {kernel_moe!r} {why}",
                       note=f"skipped (needs CUDA); later steps keep moe={baseline_moe}")
            log(f"[ablation] {name}: {rec['check']}")
            steps.append(rec)
            continue
        eng, err = None, None
        try:
            eng = make_engine(cfg)
        except (ByteboundError, ValueError) as e:
            if name == "baseline":
                raise
            err = str(e)          # leave the except block first: its traceback still holds the half-built model
        if err is not None:
            msg = f"step '{name}' could not start with its lever on: {err}"
            if not allow_fallback:
                stop = {"step": name, "reason": "lever not active", "message":
                        msg + ". Stopping; pass --allow-fallback to run it with the lever off and continue."}
                rec.update(active=False, check=err)
                steps.append(rec)
                break
            log(f"[ablation] {msg}; --allow-fallback: running it with the lever off")
            cfg = prev_cfg
            _free()
            eng = make_engine(cfg)
            rec.update(active=False, check=err, note="lever off (engine could not start with it)")
        if rec["active"] is None:
            ok, detail = check_lever(name, eng)
            rec.update(active=ok, check=detail)
        if rec["active"] is False and not allow_fallback:
            stop = {"step": name, "reason": "lever not active", "message":
                    f"step '{name}': lever not active ({rec['check']}). Stopping; pass --allow-fallback to "
                    "record it as inactive and continue."}
            rec["manifest"] = manifest(eng)
            steps.append(rec)
            eng = None
            _free()
            break
        try:
            outputs, extra = workload(eng)
        except Exception as e:       # a kernel that binds but fails at run time: report it, do not lose the ladder
            rec.update(active=False, check=f"{type(e).__name__}: {e}", manifest=manifest(eng))
            steps.append(rec)
            stop = {"step": name, "reason": "step failed", "message": f"step '{name}' failed while running its "
                    f"workload: {type(e).__name__}: {e}. Stopping."}
            eng = None
            _free()
            break
        if rec["active"] and name == "+mtp":
            ok, detail = check_lever(name, eng, outputs)
            rec.update(active=ok, check=detail)
        rec["manifest"] = manifest(eng)
        rec["config"] = _cfg_dict(cfg)
        s = summarize(outputs)
        tpot = s["tpot_ms"]["mean"]
        rec.update(summary=s, tpot_ms=tpot, **extra)
        if "accept_length" in s and s["accept_length"]["aggregate"] <= 1.05:
            rec["note"] = (rec["note"] + " " if rec["note"] else "") + \
                f"accept length {s['accept_length']['aggregate']:.2f}: drafts almost never accepted"
        if prev_tpot and tpot:
            rec["change_pct"] = 100 * (tpot - prev_tpot) / prev_tpot
            rec["change_ms"] = tpot - prev_tpot
        if base_tpot and tpot:
            rec["change_vs_baseline_pct"] = 100 * (tpot - base_tpot) / base_tpot
        log(f"[ablation] {name}: lever {'active' if rec['active'] else 'INACTIVE'} ({rec['check']}); "
            f"TPOT {tpot:.3f} ms" + (f" ({rec['change_pct']:+.2f}% vs previous)" if "change_pct" in rec else ""))
        steps.append(rec)
        eng = None
        _free()
        if rec["active"] is False and not allow_fallback:
            stop = {"step": name, "reason": "lever not active", "message": f"step '{name}': lever not active "
                    f"({rec['check']}). Stopping; pass --allow-fallback to record it as inactive and continue."}
            break
        if rec["active"] and "change_pct" in rec and rec["change_pct"] > 100 * tolerance and cpu:
            rec["note"] = (rec["note"] + " " if rec["note"] else "") + \
                f"TPOT {rec['change_pct']:+.2f}%: recorded, not enforced on CPU"
        elif rec["active"] and "change_pct" in rec and rec["change_pct"] > 100 * tolerance:
            stop = {"step": name, "reason": "TPOT worse", "change_pct": rec["change_pct"],
                    "message": f"step '{name}' made TPOT worse by {rec['change_pct']:+.2f}% "
                               f"({prev_tpot:.3f} -> {tpot:.3f} ms, {rec['change_ms']:+.3f} ms; tolerance "
                               f"{100 * tolerance:.1f}%). Stopping."}
            break
        prev_cfg, prev_tpot = cfg, tpot
        base_tpot = base_tpot or tpot
    if stop:
        log(f"[ablation] STOPPED: {stop['message']}")
    return {"status": "stopped" if stop else "complete", "stop": stop, "steps": steps,
            "device": "cpu" if cpu else str(base.device), "tpot_rule": "recorded, not enforced (CPU)" if cpu
            else "enforced",
            "ladder": [{"step": n, "lever": l, "config": _cfg_dict(c)} for n, l, c in
                       ladder(base, baseline_moe, kernel_moe, mtp_steps)],
            "tolerance": tolerance, "allow_fallback": allow_fallback}


def _cfg_dict(cfg) -> dict:
    d = asdict(cfg)
    return {k: d[k] for k in ("backends", "lm_head", "speculative_steps", "allow_fallback", "load_format", "device")}


def draw_ladder(result: dict):
    """Bar chart of mean TPOT per step (inactive steps hatched, the stopping step red)."""
    def draw(fig):
        ax = fig.subplots()
        steps = [s for s in result["steps"] if s.get("tpot_ms")]
        stop = (result.get("stop") or {}).get("step")
        colors = ["tab:red" if s["step"] == stop else ("lightgray" if not s["active"] else "tab:blue") for s in steps]
        bars = ax.bar([s["step"] for s in steps], [s["tpot_ms"] for s in steps], color=colors)
        for b, s in zip(bars, steps):
            txt = f"{s['tpot_ms']:.2f} ms" + (f"\n{s['change_pct']:+.1f}%" if "change_pct" in s else "")
            if not s["active"]:
                txt += "\n(inactive)"
            ax.annotate(txt, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("mean TPOT [ms]")
        ax.set_title("ablation ladder: one lever at a time" + (f" (stopped at {stop})" if stop else ""))
        ax.margins(y=0.25)
    return draw
