"""The ablation ladder: one lever at a time on the same workload, each lever proven active before it is timed.

Steps (each a fresh engine; everything not named stays as the command line set it):

1. ``baseline``   generic routed-MoE path (``--baseline-moe``, default ``torch``; the seed's ladder used
                  ``humming``), BF16 head with FP32 logits (``lm_head="fp32"``), no MTP;
2. ``+kernel``    the shape-specialised MoE kernel (``--kernel-moe``, default ``triton``; ``humming`` also works);
3. ``+fp8-head``  online FP8 LM head (``lm_head="fp8"``);
4. ``+mtp``       NEXTN speculative decoding (``--speculative-num-steps``, default 3; fixed, not adaptive).

A step may run several **cases** on its one engine (the synthetic workload's input lengths, e.g. 2K and 32K):
each case is compared with the same case of the previous step. The first case's figures are also the step's
top-level ``summary`` / ``tpot_ms`` / ``change_pct``.

Rules:

* **Lever check.** After start-up each step checks that its lever is really on: the MoE modules run the
  requested backend with no recorded fallback; the head is in FP8 with its E4M3 weight; the drafter exists,
  holds the target's LM-head *module* and ran verify rounds. A lever that is not active stops the ladder with
  a message naming the step, unless ``--allow-fallback`` is given: then the step runs with the lever off
  (the engine's recorded fallback, or the previous step's config when the engine cannot start with it),
  is marked ``inactive`` and is not compared. A step that fails while running its workload stops the ladder;
  with ``--allow-fallback`` a failing *case* (e.g. out of memory at the longest prompt) is a failed row and the
  step's other cases and the later steps go on.
* **TPOT check.** An active step whose mean TPOT (in any case) is worse than the previous step's by more than
  ``--tpot-tolerance`` (default 1 %) stops the ladder, naming the step, the case and the change in percent and
  ms. ``tpot_rule="record"`` (``--tpot-rule record``) records such a rise in the row and in ``regressions``
  and goes on instead.
* **MTP round cost.** The ``+mtp`` step measures what one speculative round costs: ``round_ms`` = the rounds'
  own time (``SpecStats`` draft + verify + rollback: a static round's graph replay with its one host read; pipelined,
  from read to read) per round, ``round_ms_wall`` = the decode window per round (adds the per-round Python loop; the
  request's NEXTN pass over the prompt runs before its first token, in TTFT), and ``c = round_ms / plain TPOT`` with
  the plain TPOT of the previous step in the same case (:func:`round_cost`).
* **Synthetic weights accept nothing.** With ``load_format="dummy"`` the drafts are (almost) never accepted, so
  the ``+mtp`` step's measured TPOT is one round per token: the round's cost, not the lever's effect. Its TPOT
  change is recorded, never enforced. What MTP would give is **priced**: ``priced TPOT = round_ms / A`` for
  each accept length ``A`` measured on a trained model and passed in with its source (``pricing``,
  :func:`accept_from_file`); ``A / c`` is the priced speed-up. No accept length is ever assumed: without
  ``pricing`` the row has the measured round cost only. The static round has fixed shapes whatever is accepted
  (``speculative/round.py``), so its measured cost carries over to a model that accepts; the accept length of
  the bundled ling-nano standing in for the full model's is the model's assumption, said in the report.
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
import json
from dataclasses import asdict, replace
from pathlib import Path

from bytebound.errors import BackendError, ByteboundError, ConfigError

STEPS = ("baseline", "+kernel", "+fp8-head", "+mtp")


def levers(baseline_moe: str = "torch", kernel_moe: str = "triton", mtp_steps: int = 3,
           draft_vocab=None) -> list[tuple]:
    """``[(step, lever description, apply(config) -> config)]``: each ``apply`` turns on one lever. ``draft_vocab``
    (``--speculative-draft-vocab``): the ``+mtp`` step's hot-vocabulary draft head; the steps before it run without
    one (the engine refuses a draft vocabulary without MTP)."""
    hot = f", hot-vocabulary draft head ({draft_vocab})" if draft_vocab not in (None, 0, "", "0") else ""
    return [("baseline", f"moe={baseline_moe}, lm_head=fp32 (BF16 weight, FP32 logits), no MTP",
             lambda c: replace(c, backends={**c.backends, "moe": baseline_moe}, lm_head="fp32", speculative_steps=0,
                               draft_vocab=None)),
            ("+kernel", f"routed-MoE backend {baseline_moe} -> {kernel_moe}",
             lambda c: replace(c, backends={**c.backends, "moe": kernel_moe})),
            ("+fp8-head", "LM head fp32 -> online FP8 (per-channel E4M3)", lambda c: replace(c, lm_head="fp8")),
            ("+mtp", f"NEXTN MTP, {mtp_steps} draft steps{hot}",
             lambda c: replace(c, speculative_steps=mtp_steps, speculative_adaptive=False,
                               draft_vocab=draft_vocab if hot else None))]


def ladder(base, baseline_moe: str = "torch", kernel_moe: str = "triton", mtp_steps: int = 3) -> list[tuple]:
    """``[(step, lever description, EngineConfig)]`` when every lever turns on: each config differs from the
    previous one in one lever (``base.draft_vocab``, if any, belongs to the ``+mtp`` step)."""
    out, cfg = [], base
    for name, desc, apply in levers(baseline_moe, kernel_moe, mtp_steps, getattr(base, "draft_vocab", None)):
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



# ---- MTP round cost and pricing ------------------------------------------------------------------------------
def round_cost(outputs, plain_tpot_ms: float | None) -> dict | None:
    """What one MTP round cost in ``outputs`` (the ``+mtp`` step's ``RequestOutput``s), against a plain decode
    step of ``plain_tpot_ms`` [ms] (the previous step's mean TPOT in the same case).

    Returns None without verify rounds, else ``{"rounds", "committed", "accept_length", "round_ms",
    "round_ms_wall", "plain_tpot_ms", "c", "c_wall"}``: ``round_ms`` = the rounds' own time (``SpecStats``
    draft + verify + rollback seconds: with static rounds the whole round, graph replay and its one host read)
    per round; ``round_ms_wall`` = the decode window (first to last token) per round, which adds the per-round
    Python loop (the NEXTN pass over the prompt runs before the first token: TTFT); ``c = round_ms / plain_tpot_ms`` (None without a
    plain TPOT). Units: ms.
    """
    specs = [(o, o.spec) for o in outputs if o.spec]
    rounds = sum(sp.get("rounds", 0) for _, sp in specs)
    if not rounds:
        return None
    timed = sum(sp.get("draft_s", 0.0) + sp.get("verify_s", 0.0) + sp.get("rollback_s", 0.0) for _, sp in specs)
    wall = sum(o.tpot_s * (o.completion_tokens - 1) for o, _ in specs if o.completion_tokens > 1)
    committed = sum(sp.get("committed", 0) for _, sp in specs)
    rec = {"rounds": rounds, "committed": committed, "accept_length": committed / rounds,
           "round_ms": 1e3 * timed / rounds if timed > 0 else 1e3 * wall / rounds,
           "round_ms_source": "SpecStats draft+verify+rollback per round" if timed > 0 else "decode window per round",
           "round_ms_wall": 1e3 * wall / rounds, "plain_tpot_ms": plain_tpot_ms, "c": None, "c_wall": None}
    if plain_tpot_ms:
        rec["c"] = rec["round_ms"] / plain_tpot_ms
        rec["c_wall"] = rec["round_ms_wall"] / plain_tpot_ms
    return rec


def price(rnd: dict, pricing: list[dict]) -> list[dict]:
    """Priced MTP TPOT of a measured round ``rnd`` (:func:`round_cost`) at each accept length of ``pricing``
    (``[{"accept_length": A, "source": str}, ...]``, A in tokens per round, measured on a trained model):
    ``tpot_ms = round_ms / A`` (and ``tpot_ms_wall`` from ``round_ms_wall``), ``speedup = A / c`` (plain TPOT /
    priced TPOT), ``change_pct`` vs the plain TPOT. A model, not a measurement: labelled ``priced``."""
    out = []
    for p in pricing:
        a = float(p["accept_length"])
        row = {"priced": True, "accept_length": a, "source": p["source"], "tpot_ms": rnd["round_ms"] / a,
               "tpot_ms_wall": rnd["round_ms_wall"] / a, "speedup": None, "change_pct": None}
        if rnd.get("plain_tpot_ms"):
            row["speedup"] = rnd["plain_tpot_ms"] / row["tpot_ms"]
            row["change_pct"] = 100 * (row["tpot_ms"] - rnd["plain_tpot_ms"]) / rnd["plain_tpot_ms"]
        out.append(row)
    return out


def _is_synthetic(weights) -> bool:
    return isinstance(weights, str) and weights.lower().startswith("synthetic")


def accept_from_file(path, max_accept: float | None = None) -> list[dict]:
    """Accept lengths measured on a trained model, read from a JSON report, each with its source:
    ``[{"accept_length", "source", "weights", "sampling"}]``.

    Reads ``bytebound bench ablation`` records (the ``+mtp`` step, any workload on trained weights), ``bench gsm8k``
    / ``bench synthetic`` records with MTP (``summary.accept_length``) and ``scripts/mtp_accept.py`` records
    (greedy, and the sampled run when present).

    Raises:
        ConfigError: the file is missing or not JSON, holds no accept length, its weights are synthetic (random
            weights accept nothing: that cannot price anything), or an accept length is outside
            ``[1, max_accept]`` (``max_accept`` = draft steps + 1).
    """
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--price-accept-from {path}: cannot read a JSON report ({type(e).__name__}: {e})") from None
    meta = d.get("meta") or {}
    found = []
    if d.get("benchmark") == "ablation":
        w = d.get("workload") or {}
        for st in d.get("steps", []):
            acc = (st.get("summary") or {}).get("accept_length")
            if st.get("step") == "+mtp" and acc:
                samp = (f"T {w.get('temperature')}, top-p {w.get('top_p')}, top-k {w.get('top_k')}"
                        if w.get("workload") == "gsm8k" else "greedy")
                found.append((acc["aggregate"], f"bench ablation ({w.get('workload')}) +mtp step", meta.get("weights"),
                              samp, acc.get("rounds")))
    elif d.get("benchmark") in ("gsm8k", "synthetic"):
        acc = (d.get("summary") or {}).get("accept_length")
        if acc:
            sp = d.get("sampling") or {}
            samp = (f"T {sp.get('temperature')}, top-p {sp.get('top_p')}, top-k {sp.get('top_k')}"
                    if d["benchmark"] == "gsm8k" else "greedy")
            found.append((acc["aggregate"], f"bench {d['benchmark']}", meta.get("weights"), samp, acc.get("rounds")))
    elif "greedy_parity" in d and d.get("greedy"):
        meta = {"device": d.get("device"), "commit": d.get("commit")}
        dv = d.get("draft_vocab")
        what = f"mtp_accept.py, {d.get('prompts')} GSM8K prompts" + (f", draft vocab {dv}" if dv else "")
        found.append((d["greedy"]["accept_length"], what, d.get("weights"), "greedy", d["greedy"].get("rounds")))
        samp = d.get("sampled_T0.6_p0.95_k29")
        if samp:
            found.append((samp["accept_length"], what, d.get("weights"), "T 0.6, top-p 0.95, top-k 29",
                          samp.get("rounds")))
    if not found:
        raise ConfigError(f"--price-accept-from {path}: no measured accept length in it (an ablation +mtp step, a "
                          "gsm8k/synthetic bench with MTP, or a scripts/mtp_accept.py record)")
    out = []
    for a, what, weights, samp, rounds in found:
        if _is_synthetic(weights) or not weights:
            raise ConfigError(f"--price-accept-from {path}: the accept length there was measured on weights "
                              f"{weights!r}; pricing needs one measured on a trained model")
        if not (1.0 <= a <= (max_accept or float("inf"))):
            raise ConfigError(f"--price-accept-from {path}: accept length {a} outside [1, {max_accept}]")
        src = (f"{path.name}: {what}, {samp}, {weights}, {meta.get('device', '?')}, commit {meta.get('commit', '?')}"
               + (f", {rounds} rounds" if rounds else ""))
        out.append({"accept_length": float(a), "source": src, "weights": weights, "sampling": samp})
    return out


def check_pricing(pricing: list[dict], max_accept: float) -> list[dict]:
    """Validate explicit pricing inputs: each needs an accept length in ``[1, max_accept]`` and a non-empty
    source. Raises ConfigError naming the bad one."""
    for p in pricing:
        a, src = p.get("accept_length"), str(p.get("source") or "").strip()
        if not isinstance(a, (int, float)) or not 1.0 <= a <= max_accept:
            raise ConfigError(f"--price-accept-length must be a measured accept length in [1, {max_accept}] "
                              f"(tokens per verify round with {max_accept - 1:g} draft steps), got {a!r}")
        if not src:
            raise ConfigError("--price-accept-length needs --price-accept-source: where that accept length was "
                              "measured (file, model, device, commit); an accept length is never assumed")
    return pricing


# ---- the ladder ----------------------------------------------------------------------------------------------
def run_ablation(base, workload, baseline_moe: str = "torch", kernel_moe: str = "triton", mtp_steps: int = 3,
                 tolerance: float = 0.01, allow_fallback: bool = False, make_engine=None, log=print,
                 manifest=None, cases=None, pricing=None, tpot_rule: str = "enforce", on_step=None) -> dict:
    """Climb the ladder. ``make_engine(config) -> engine``.

    ``workload``: ``workload(engine) -> (outputs, extra dict)`` when ``cases`` is None, else
    ``workload(engine, case) -> (outputs, extra)`` once per case of ``cases`` (labels, e.g. input lengths) on
    each step's engine. ``pricing``: measured accept lengths with their sources for the ``+mtp`` step on
    synthetic weights (:func:`price`). ``tpot_rule``: ``"enforce"`` (a TPOT rise beyond ``tolerance`` stops the
    ladder) or ``"record"``; on a CPU device always recorded. ``on_step(result)`` is called with the result so
    far after every step (to write partial reports: a run cut short keeps its finished steps).

    Returns ``{"status": "complete"|"stopped", "stop": {...}|None, "steps": [...], "cases": [...],
    "regressions": [...], ...}``; each step: name, lever, active, check detail, ``cases`` (per case: summary,
    tpot_ms, change vs previous/baseline, for ``+mtp`` the measured ``round`` and the ``priced`` rows), the first
    case's figures at top level, manifest.

    A step whose engine cannot start with its lever on stops the ladder, or with ``allow_fallback`` runs with the
    lever off. The baseline has no lever to turn off: with ``allow_fallback`` a baseline whose backend cannot run
    here (:class:`BackendError`, e.g. humming's repack out of GPU memory) is recorded as a failed row and the
    ladder goes on; no later step then has a "vs baseline" figure.

    Raises:
        ValueError: ``tpot_rule`` is neither "enforce" nor "record".
        ByteboundError: the baseline engine cannot start (without ``allow_fallback``, or for any reason other than
            a backend that cannot run here).
    """
    from bytebound.bench.report import engine_manifest, summarize
    if tpot_rule not in ("enforce", "record"):
        raise ValueError(f"tpot_rule must be 'enforce' or 'record', got {tpot_rule!r}")
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
    synthetic = getattr(base, "load_format", "auto") == "dummy"
    pricing = list(pricing or [])
    labels = list(cases) if cases is not None else [None]
    enforce = tpot_rule == "enforce" and not cpu
    if cpu and tpot_rule == "enforce":     # said once, here, where the rule is set aside (bench --help: exit 3)
        log("[ablation] CPU device: a TPOT rise is recorded, not enforced (it neither stops the ladder nor exits 3): "
            "the levers cut bytes per token, and a CPU decode of a small model is bound by per-op overhead, not "
            "memory bandwidth; --tpot-rule enforce applies on CUDA")
    steps, regressions, prev_cfg, stop, started = [], [], None, None, False
    prev_tpot: dict = {}                  # case -> TPOT of the previous step that ran
    base_tpot: dict = {}

    def result(status: str) -> dict:
        return {"status": status, "stop": stop, "steps": steps,
                "cases": [str(c) for c in labels] if cases is not None else [],
                "device": "cpu" if cpu else str(base.device),
                "tpot_rule": "recorded, not enforced (CPU)" if cpu else
                ("enforced" if enforce else "recorded, not enforced (--tpot-rule record)"),
                "regressions": regressions, "synthetic_weights": synthetic, "pricing": pricing,
                "ladder": [{"step": n, "lever": lv, "config": _cfg_dict(c)} for n, lv, c in
                           ladder(base, baseline_moe, kernel_moe, mtp_steps)],
                "tolerance": tolerance, "allow_fallback": allow_fallback}

    def done_step(rec) -> None:
        steps.append(rec)
        if on_step is not None:
            on_step(result("running"))

    for name, lever, apply in levers(baseline_moe, kernel_moe, mtp_steps, getattr(base, "draft_vocab", None)):
        cfg = apply(prev_cfg or base)     # on top of what really ran: an inactive lever stays off afterwards
        rec = {"step": name, "lever": lever, "active": None, "check": "", "note": ""}
        log(f"[ablation] step {name}: {lever}")
        why = unusable_reason("moe", kernel_moe, base.device) if cpu and name == "+kernel" else None
        if why:                           # a CUDA-only kernel on CPU: nothing to measure, say so and go on
            rec.update(active=False, skipped=True, check=f"skipped on CPU: moe backend {kernel_moe!r} {why}",
                       note=f"skipped (needs CUDA); later steps keep moe={baseline_moe}")
            log(f"[ablation] {name}: {rec['check']}")
            done_step(rec)
            continue
        eng, err = None, None
        try:
            eng = make_engine(cfg)
        except (ByteboundError, ValueError) as e:
            if name == "baseline" and not (allow_fallback and isinstance(e, BackendError)):
                raise
            err = str(e)          # leave the except block first: its traceback still holds the half-built model
        if err is not None and not started and allow_fallback:
            # the baseline (or a step after a baseline that could not start): no engine ran before it to fall back
            # to, so the row is a failure; the next step turns its lever on over this step's configuration
            log(f"[ablation] step '{name}' could not start: {err}; --allow-fallback: recorded, going on")
            rec.update(active=False, check=err, note="could not start: no row to compare with")
            _free()
            done_step(rec)
            prev_cfg = cfg
            continue
        started = True
        if err is not None:
            msg = f"step '{name}' could not start with its lever on: {err}"
            if not allow_fallback:
                stop = {"step": name, "reason": "lever not active", "message":
                        msg + ". Stopping; pass --allow-fallback to run it with the lever off and continue."}
                rec.update(active=False, check=err)
                done_step(rec)
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
            eng = None
            _free()
            done_step(rec)
            break
        rec["cases"], all_outputs, by_case, failed = [], [], {}, None
        for case in labels:
            err = None
            try:
                outputs, extra = workload(eng) if case is None else workload(eng, case)
            except Exception as e:   # a kernel that binds but fails at run time: report it, do not lose the ladder
                err = f"{type(e).__name__}: {e}"
            if err is not None and allow_fallback and case is not None:
                # --allow-fallback: this case is a failed row (e.g. out of memory at the longest prompt); the
                # step's other cases still count and the ladder goes on
                log(f"[ablation] {name} [{case}]: FAILED ({err}); --allow-fallback: recorded, going on")
                rec["cases"].append({"case": str(case), "summary": {}, "tpot_ms": None, "error": err,
                                     "note": f"FAILED: {err}"})
                _free()                      # what the failed request held (the exception is gone by now)
                continue
            if err is not None:
                failed = (case, err)
                break
            all_outputs += outputs
            by_case[None if case is None else str(case)] = outputs
            s = summarize(outputs)
            crec = {"case": None if case is None else str(case), "summary": s, "tpot_ms": s["tpot_ms"]["mean"],
                    "note": "", **extra}
            rec["cases"].append(crec)
        if failed is None and rec["cases"] and all("error" in c for c in rec["cases"]):
            failed = (rec["cases"][0]["case"], rec["cases"][0]["error"])      # no case ran: nothing to go on with
        if failed is not None:
            where = "" if failed[0] is None else f" (case {failed[0]})"
            rec.update(active=False, check=f"{failed[1]}{where}", manifest=manifest(eng))
            stop = {"step": name, "reason": "step failed", "message": f"step '{name}' failed while running its "
                    f"workload{where}: {failed[1]}. Stopping."}
            eng = None
            _free()
            _top(rec)
            done_step(rec)
            break
        if rec["active"] and name == "+mtp":
            ok, detail = check_lever(name, eng, all_outputs)
            rec.update(active=ok, check=detail)
        rec["manifest"] = manifest(eng)
        rec["config"] = _cfg_dict(cfg)
        eng = None
        _free()
        worse = []
        for crec in rec["cases"]:
            key, tpot, s = crec["case"], crec["tpot_ms"], crec["summary"]
            if "accept_length" in s and s["accept_length"]["aggregate"] <= 1.05:
                _note(crec, f"accept length {s['accept_length']['aggregate']:.2f}: drafts almost never accepted")
            if prev_tpot.get(key) and tpot:
                crec["change_pct"] = 100 * (tpot - prev_tpot[key]) / prev_tpot[key]
                crec["change_ms"] = tpot - prev_tpot[key]
            if base_tpot.get(key) and tpot:
                crec["change_vs_baseline_pct"] = 100 * (tpot - base_tpot[key]) / base_tpot[key]
            if name == "+mtp" and rec["active"]:
                rnd = round_cost(by_case.get(key, []), prev_tpot.get(key))
                if rnd:
                    crec["round"] = rnd
                    if synthetic:
                        crec["priced"] = price(rnd, pricing)
                        if not pricing:
                            _note(crec, "not priced: no measured accept length given (--price-accept-length / "
                                        "--price-accept-from)")
            rising = rec["active"] and "change_pct" in crec and crec["change_pct"] > 100 * tolerance
            label = f"[ablation] {name}" + (f" [{key}]" if key is not None else "")
            if rising and name == "+mtp" and synthetic:
                why = (f"measured TPOT {crec['change_pct']:+.2f}% is one round per token (synthetic weights accept "
                       "nothing): recorded, not enforced; see the priced TPOT")
                _note(crec, why)
                log(f"{label}: {why}")
            elif rising and not enforce:
                _note(crec, f"TPOT {crec['change_pct']:+.2f}%: recorded, not enforced"
                      + (" on CPU" if cpu else " (--tpot-rule record)"))
                log(f"{label}: TPOT {crec['change_pct']:+.2f}% vs previous (tolerance {100 * tolerance:.1f}%): "
                    "recorded, not enforced" + (" (CPU device, above)" if cpu else " (--tpot-rule record)"))
                if not cpu:
                    regressions.append({"step": name, "case": key, "change_pct": crec["change_pct"],
                                        "change_ms": crec["change_ms"]})
            elif rising:
                worse.append((key, prev_tpot[key], crec))
        _top(rec)
        for crec in rec["cases"]:
            log(f"[ablation] {name}" + (f" [{crec['case']}]" if crec["case"] is not None else "")
                + f": lever {'active' if rec['active'] else 'INACTIVE'} ({rec['check']}); TPOT "
                + (f"{crec['tpot_ms']:.3f} ms" if crec["tpot_ms"] else "-")
                + (f" ({crec['change_pct']:+.2f}% vs previous)" if "change_pct" in crec else "")
                + "".join(f"; round {r['round_ms']:.3f} ms, c = {_f(r['c'])}" for r in [crec.get("round")] if r)
                + "".join(f"; PRICED at accept length {p['accept_length']:.3f}: {p['tpot_ms']:.3f} ms "
                          f"({_f(p['speedup'])}x)" for p in crec.get("priced", [])))
        if rec["active"] is False and not allow_fallback:
            stop = {"step": name, "reason": "lever not active", "message": f"step '{name}': lever not active "
                    f"({rec['check']}). Stopping; pass --allow-fallback to record it as inactive and continue."}
            done_step(rec)
            break
        if worse:
            key, before, crec = worse[0]
            case = "" if key is None else f" at {key}"
            stop = {"step": name, "reason": "TPOT worse", "change_pct": crec["change_pct"], "case": key,
                    "message": f"step '{name}' made TPOT worse{case} by {crec['change_pct']:+.2f}% "
                               f"({before:.3f} -> {crec['tpot_ms']:.3f} ms, {crec['change_ms']:+.3f} ms; tolerance "
                               f"{100 * tolerance:.1f}%). Stopping."}
            done_step(rec)
            break
        done_step(rec)
        prev_cfg = cfg
        for crec in rec["cases"]:         # the next step changes one lever of what this one ran
            if crec["tpot_ms"]:
                prev_tpot[crec["case"]] = crec["tpot_ms"]
                if name == "baseline":    # "vs baseline" is against the baseline alone, never a later stand-in
                    base_tpot[crec["case"]] = crec["tpot_ms"]
    if stop:
        log(f"[ablation] STOPPED: {stop['message']}")
    return result("stopped" if stop else "complete")


def _note(rec: dict, text: str) -> None:
    rec["note"] = (rec["note"] + "; " if rec.get("note") else "") + text


def _top(rec: dict) -> None:
    """The first case's figures at the step's top level (one-case ladders read them there)."""
    if rec.get("cases"):
        c0 = next((c for c in rec["cases"] if "error" not in c), rec["cases"][0])
        for k in ("summary", "tpot_ms", "change_pct", "change_ms", "change_vs_baseline_pct", "accuracy"):
            if k in c0:
                rec[k] = c0[k]
        notes = [f"{c['case']}: {c['note']}" if c["case"] is not None else c["note"] for c in rec["cases"] if c["note"]]
        if notes:
            rec["note"] = "; ".join(([rec["note"]] if rec["note"] else []) + notes)


def _f(x, d: int = 2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def reprice(data: dict, pricing: list[dict]) -> dict:
    """Add priced rows for ``pricing`` to an ablation record's ``+mtp`` step (from its stored measured round
    costs; entries whose source is already there are replaced). Raises ConfigError when the record is not a
    synthetic-weights ablation with a measured ``+mtp`` round."""
    if data.get("benchmark") != "ablation":
        raise ConfigError("--reprice needs a bench ablation JSON record")
    if not data.get("synthetic_weights"):
        raise ConfigError("--reprice: the record is not a synthetic-weights ladder; its +mtp row is measured, "
                          "not priced")
    mtp = [s for s in data.get("steps", []) if s.get("step") == "+mtp"]
    rounds = [c for s in mtp for c in s.get("cases", []) if c.get("round")]
    if not rounds:
        raise ConfigError("--reprice: the record has no measured +mtp round to price")
    srcs = {p["source"] for p in pricing}
    data["pricing"] = [p for p in data.get("pricing", []) if p["source"] not in srcs] + list(pricing)
    for c in rounds:
        c["priced"] = price(c["round"], data["pricing"])
        c["note"] = "; ".join(n for n in c.get("note", "").split("; ") if not n.startswith("not priced"))
    for s in mtp:
        s["note"] = "; ".join(n for n in s.get("note", "").split("; ") if "not priced" not in n)
    return data


def _cfg_dict(cfg) -> dict:
    d = asdict(cfg)
    return {k: d[k] for k in ("backends", "lm_head", "speculative_steps", "draft_vocab", "allow_fallback",
                              "load_format", "device", "max_model_len") if k in d}


def draw_ladder(result: dict):
    """Mean TPOT per step, one panel per case (inactive steps grey, the stopping step red); on synthetic weights
    the ``+mtp`` step's priced TPOTs as hatched bars beside its measured one."""
    def draw(fig):
        stop = (result.get("stop") or {}).get("step")
        keys = []
        for s in result["steps"]:
            for c in s.get("cases", []):
                if c["case"] not in keys:
                    keys.append(c["case"])
        keys = keys or [None]
        axes = fig.subplots(1, len(keys), squeeze=False)[0]
        for ax, key in zip(axes, keys):
            names, vals, colors, hatches, texts = [], [], [], [], []
            for s in result["steps"]:
                c = next((c for c in s.get("cases", []) if c["case"] == key and c.get("tpot_ms")), None)
                if c is None:
                    continue
                names.append(s["step"] + (" (measured)" if c.get("priced") else ""))
                vals.append(c["tpot_ms"])
                colors.append("tab:red" if s["step"] == stop else ("lightgray" if not s["active"] else "tab:blue"))
                hatches.append("")
                t = f"{c['tpot_ms']:.2f} ms" + (f"\n{c['change_pct']:+.1f}%" if "change_pct" in c else "")
                if c.get("round") and c["round"].get("c"):
                    t += f"\nc = {c['round']['c']:.2f}"
                texts.append(t + ("" if s["active"] else "\n(inactive)"))
                for p in c.get("priced", []):
                    names.append(f"+mtp priced\nA = {p['accept_length']:.2f}")
                    vals.append(p["tpot_ms"])
                    colors.append("white")
                    hatches.append("//")
                    texts.append(f"{p['tpot_ms']:.2f} ms\n{_f(p['speedup'])}x (priced)")
            bars = ax.bar(range(len(vals)), vals, color=colors, edgecolor="tab:blue", hatch=None)
            for b, h, t in zip(bars, hatches, texts):
                if h:
                    b.set_hatch(h)
                ax.annotate(t, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(vals)))
            ax.set_xticklabels(names, fontsize=7, rotation=20)
            ax.set_ylabel("mean TPOT [ms]")
            title = "ladder" if key is None else (f"{key} tokens in" if str(key).isdigit() else str(key))
            ax.set_title(title + (f" (stopped at {stop})" if stop else ""),
                         fontsize=9)
            ax.margins(y=0.3)
        fig.suptitle("ablation ladder: one lever at a time" + (" (synthetic weights: +mtp priced)"
                                                               if result.get("synthetic_weights") else ""))
    return draw
