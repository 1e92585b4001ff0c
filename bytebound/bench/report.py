"""Benchmark metadata, latency statistics and the report files (JSON, markdown, PNG).

Every report embeds: the start-up manifest (``bytebound.verify.manifest.build_manifest`` when present, else a
local record of the resolved backends, LM-head mode, speculative steps and device), the device name, the UTC
date, the git commit (``git rev-parse --short HEAD``; ``BYTEBOUND_GIT_COMMIT`` when the tree has no ``.git``)
and what the weights are.

Units in every JSON: seconds for raw times (``*_s``), milliseconds in the summaries (``*_ms``), tokens/s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
WEIGHTS_SYNTHETIC = "synthetic (random, real shapes)"
WEIGHTS_TRAINED = "trained (ling-nano)"


# ---- metadata -------------------------------------------------------------------------------------------
def git_commit() -> str:
    """Short commit of the checkout (``+dirty`` when tracked files differ). The environment wins
    (``BYTEBOUND_COMMIT``, or the older name ``BYTEBOUND_GIT_COMMIT``): a copied tree's ``.git`` can be stale."""
    env = os.environ.get("BYTEBOUND_COMMIT") or os.environ.get("BYTEBOUND_GIT_COMMIT")
    if env:
        return env
    try:
        run = dict(cwd=REPO, capture_output=True, text=True, timeout=10, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run)
        return sha.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device) -> str:
    import torch
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {cpu} ({os.cpu_count()} logical cores, torch threads {torch.get_num_threads()})"


def weights_label(config, override: str | None = None) -> str:
    """``--weights-label`` if given; dummy load format -> synthetic; the bundled ling-nano -> trained; else the dir."""
    if override:
        return override
    if config.load_format == "dummy":
        return WEIGHTS_SYNTHETIC
    from bytebound.engine.engine import DEFAULT_MODEL
    if Path(config.model).resolve() == DEFAULT_MODEL.resolve():
        return WEIGHTS_TRAINED
    return f"checkpoint {Path(config.model).name} (origin not recorded; pass --weights-label)"


def _jsonable(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if hasattr(x, "to_dict") and callable(x.to_dict):
        return _jsonable(x.to_dict())
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    return str(x)


def fallback_manifest(engine) -> dict:
    """What the start-up manifest must at least say: resolved backend per op, head mode, MTP steps, device."""
    cfg = engine.config
    return {
        "source": "bytebound.bench.report.fallback_manifest (bytebound.verify.manifest not available)",
        "model": cfg.model, "load_format": cfg.load_format, "device": str(engine.device),
        "dtype": str(engine.model.dtype) if hasattr(engine.model, "dtype") else cfg.dtype,
        "lm_head": getattr(engine.model.lm_head, "mode", cfg.lm_head),
        "speculative_steps": cfg.speculative_steps, "max_model_len": cfg.max_model_len,
        "allow_fallback": cfg.allow_fallback,
        "resolutions": {op: r.to_dict() for op, r in engine.plan.resolutions.items()},
    }


def engine_manifest(engine) -> dict:
    """The real manifest (``bytebound.verify.manifest.build_manifest``) when that module exists, else the fallback."""
    try:
        from bytebound.verify.manifest import build_manifest
    except ImportError:
        return fallback_manifest(engine)
    return _jsonable(build_manifest(engine))


def run_meta(engine, argv: list[str] | None = None, weights: str | None = None, note: str | None = None) -> dict:
    import torch
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": device_name(engine.device),
        "weights": weights_label(engine.config, weights),
        "model": engine.config.model,
        "command": "bytebound " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__, "python": platform.python_version(),
        "manifest": engine_manifest(engine),
    }
    return {"note": note, **meta} if note else meta


# ---- statistics -----------------------------------------------------------------------------------------
def dist(values, scale: float = 1.0) -> dict:
    """mean / p50 / p95 / min / max of ``values`` times ``scale`` (empty -> all None)."""
    v = np.asarray([x for x in values if x is not None], dtype=float) * scale
    if v.size == 0:
        return {"n": 0, "mean": None, "p50": None, "p95": None, "min": None, "max": None}
    return {"n": int(v.size), "mean": float(v.mean()), "p50": float(np.percentile(v, 50)),
            "p95": float(np.percentile(v, 95)), "min": float(v.min()), "max": float(v.max())}


def summarize(outputs) -> dict:
    """Latency, throughput, length and speculation summary over finished ``RequestOutput``s.

    TPOT per request = (last token time - first token time) / (n - 1); requests with one token have none.
    ``decode_tok_s``: mean of per-request 1/TPOT and the aggregate (all decode tokens / all decode time).
    Accept length: all committed tokens / all verify rounds (SGLang's ``accept len``), and per-request values.
    """
    tp = [o.tpot_s for o in outputs if o.completion_tokens > 1 and o.tpot_s > 0]
    dec_tokens = sum(o.completion_tokens - 1 for o in outputs if o.completion_tokens > 1 and o.tpot_s > 0)
    dec_time = sum(o.tpot_s * (o.completion_tokens - 1) for o in outputs if o.completion_tokens > 1 and o.tpot_s > 0)
    lens = [o.completion_tokens for o in outputs]
    s = {
        "requests": len(outputs),
        "tpot_ms": dist(tp, 1e3),
        "ttft_ms": dist([o.ttft_s for o in outputs], 1e3),
        "e2e_ms": dist([o.e2e_s for o in outputs], 1e3),
        "decode_tok_s": {"mean_of_requests": float(np.mean([1 / t for t in tp])) if tp else None,
                         "aggregate": dec_tokens / dec_time if dec_time > 0 else None},
        "output_len": {**dist(lens), "total": int(sum(lens)), "histogram": histogram(lens)},
        "prompt_len": dist([o.prompt_tokens for o in outputs]),
        "finish_reasons": {r: sum(o.finish_reason == r for o in outputs) for r in sorted({o.finish_reason for o in outputs})},
    }
    specs = [o.spec for o in outputs if o.spec]
    if specs:
        rounds = sum(sp["rounds"] for sp in specs)
        s["accept_length"] = {"aggregate": sum(sp["committed"] for sp in specs) / rounds if rounds else 0.0,
                              "per_request": dist([sp["accept_length"] for sp in specs]), "rounds": rounds}
        ads = [sp["adaptive"] for sp in specs if sp.get("adaptive")]
        if ads:      # adaptive speculation: how the tokens were made and where it ended
            s["adaptive"] = {k: sum(a.get(k, 0) for a in ads) for k in ("plain_steps", "rounds", "to_plain",
                                                                         "to_mtp", "probes", "catchups")}
            s["adaptive"]["catchup_ms"] = round(sum(a.get("catchup_ms", 0.0) for a in ads), 3)
            s["adaptive"].update(final_mode=ads[-1]["mode"], reason=ads[-1]["reason"],
                                 last_decision=ads[-1].get("last_decision"))
    return s


def histogram(values, bins: int = 10) -> dict:
    if not values:
        return {"edges": [], "counts": []}
    counts, edges = np.histogram(np.asarray(values, dtype=float), bins=bins)
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion k/n."""
    if n == 0:
        return 0.0, 0.0
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


# ---- writing --------------------------------------------------------------------------------------------
def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def latency_table(s: dict) -> list[str]:
    rows = ["| metric | mean | P50 | P95 | min | max |", "|---|---|---|---|---|---|"]
    for key, label in (("tpot_ms", "TPOT [ms]"), ("ttft_ms", "TTFT [ms]"), ("e2e_ms", "end-to-end [ms]"),
                       ("output_len", "output tokens"), ("prompt_len", "prompt tokens")):
        d = s[key]
        rows.append(f"| {label} | " + " | ".join(fmt(d[k]) for k in ("mean", "p50", "p95", "min", "max")) + " |")
    dt = s["decode_tok_s"]
    rows += ["", f"Decode throughput: **{fmt(dt['aggregate'])} tok/s** aggregate "
                 f"(mean of per-request 1/TPOT: {fmt(dt['mean_of_requests'])} tok/s). "
                 f"Finish reasons: {s['finish_reasons']}."]
    if "accept_length" in s:
        a = s["accept_length"]
        rows.append(f"Accept length (MTP): **{fmt(a['aggregate'])}** tokens per verify round over {a['rounds']} rounds "
                    f"(per-request mean {fmt(a['per_request']['mean'])}).")
    if "adaptive" in s:
        ad = s["adaptive"]
        rows.append(f"Adaptive speculation: {ad['plain_steps']} plain decode steps and {ad['rounds']} MTP rounds, "
                    f"{ad['to_plain']} fallbacks to plain, {ad['to_mtp']} switches back, {ad['probes']} probes; "
                    f"{ad.get('catchups', 0)} NEXTN catch-ups between tokens, {fmt(ad.get('catchup_ms', 0.0))} ms "
                    f"of host time; ended in mode **{ad['final_mode']}** ({ad['reason']}).")
    return rows


def meta_section(meta: dict) -> list[str]:
    m = meta["manifest"]
    rows = ["| | |", "|---|---|"]
    for k in ("note", "date", "commit", "device", "weights", "model", "command", "torch"):
        if k == "note" and not meta.get(k):
            continue
        rows.append(f"| {k} | `{meta.get(k)}` |" if k in ("command", "commit") else f"| {k} | {meta.get(k)} |")
    res = m.get("resolutions") or {}
    levers = m.get("levers") or {}
    if levers:   # bytebound.verify.manifest schema
        rows += ["", f"Start-up manifest: status **{m.get('status')}**.", "",
                 "| lever | requested | resolved | ok | verified |", "|---|---|---|---|---|"]
        for name, d in levers.items():
            short = lambda v: ", ".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else v  # noqa: E731
            rows.append(f"| {name} | {short(d.get('requested'))} | {short(d.get('resolved'))} | "
                        f"{'yes' if d.get('ok', True) else 'NO'} | {d.get('verified', '')} |")
        for p in m.get("problems") or []:
            rows.append(f"\nProblem: {p.get('lever')}: {p.get('message')}")
    elif res:
        rows += ["", "Resolved backends (start-up manifest):", "", "| op | requested | resolved | fallback reason |",
                 "|---|---|---|---|"]
        for op, r in res.items():
            r = r if isinstance(r, dict) else {"requested": r, "resolved": r}
            rows.append(f"| {op} | {r.get('requested')} | {r.get('resolved')} | {r.get('reason') or ''} |")
    rows += ["", "<details><summary>start-up manifest (JSON)</summary>", "", "```json",
             json.dumps(m, indent=2), "```", "", "</details>"]
    return rows


def write_report(out_dir, name: str, data: dict, markdown: list[str], figures: dict | None = None) -> dict:
    """Write ``NAME.json`` (``data``), ``NAME.md`` (``markdown`` lines + figure links) and the PNGs.

    ``figures``: ``{suffix: fn(ax_or_fig)}``; each ``fn(fig)`` draws on a fresh matplotlib figure (Agg),
    saved as ``NAME_suffix.png``. Returns ``{"json", "markdown", "png": [...]}`` paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / f"{name}.json"), "markdown": str(out / f"{name}.md"), "png": []}
    md = list(markdown)
    if figures:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:   # the device image may lack matplotlib: report still written
            md += ["", f"_(no plots: matplotlib unavailable: {e})_"]
        else:
            md += ["", "## Plots", ""]
            for suffix, draw in figures.items():
                fig = plt.figure(figsize=(10, 4.5))
                try:
                    draw(fig)
                    fig.tight_layout()
                    p = out / f"{name}_{suffix}.png"
                    fig.savefig(p, dpi=110)
                    paths["png"].append(str(p))
                    md.append(f"![{suffix}]({p.name})")
                finally:
                    plt.close(fig)
    data = {**data, "files": {"json": Path(paths["json"]).name, "markdown": Path(paths["markdown"]).name,
                              "png": [Path(p).name for p in paths["png"]]}}
    Path(paths["json"]).write_text(json.dumps(_jsonable(data), indent=2) + "\n")
    Path(paths["markdown"]).write_text("\n".join(md) + "\n")
    return paths


def draw_latency(outputs, title: str):
    """A two-panel figure: output-length histogram and TPOT / end-to-end latency histograms."""
    def draw(fig):
        a1, a2, a3 = fig.subplots(1, 3)
        a1.hist([o.completion_tokens for o in outputs], bins=20, color="tab:blue")
        a1.set_xlabel("output tokens"), a1.set_ylabel("requests"), a1.set_title("output length")
        a2.hist([o.tpot_s * 1e3 for o in outputs if o.completion_tokens > 1], bins=20, color="tab:orange")
        a2.set_xlabel("TPOT [ms]"), a2.set_title("time per output token")
        a3.hist([o.e2e_s for o in outputs], bins=20, color="tab:green")
        a3.set_xlabel("end-to-end [s]"), a3.set_title("request latency")
        fig.suptitle(title)
    return draw
