"""``bytebound bench``: synthetic, gsm8k and ablation runs, each writing JSON + markdown + PNG.

Usage::

    bytebound bench synthetic [engine flags] --input-len 32768 --output-len 2048 [--num-requests 1]
        [--bandwidth auto|none|GBs] [--out DIR] [--name NAME]
    bytebound bench gsm8k [engine flags] [--limit N] [--shots 5] [--max-tokens 512]
        [--temperature 0.6 --top-p 0.95 --top-k 29] [--seed 0] [--out DIR]
    bytebound bench ablation [engine flags] [--workload synthetic|gsm8k] [--input-len 2048,32768 | --limit ...]
        [--baseline-moe torch] [--kernel-moe triton] [--tpot-tolerance 0.01] [--tpot-rule enforce|record]
        [--allow-fallback] [--price-accept-from FILE ... | --price-accept-length A --price-accept-source TEXT]
        [--out DIR]
    bytebound bench ablation --reprice ABLATION.json --price-accept-from FILE ...   # add priced rows, no engine

Engine flags are the shared ones (``--model``, ``--device``, ``--load-format dummy``, ``--lm-head``, backends,
``--speculative-algorithm NEXTN``...). The ablation sets the MoE backend, LM head and MTP itself, step by step.
The synthetic defaults (32768 in / 2048 out) need the full-scale config (``--model
bytebound/assets/configs/ling-3.0-flash.json --load-format dummy --device cuda``); the bundled ling-nano has
4096 positions, so give it shorter ``--input-len``/``--output-len``.
The ablation's ``--input-len`` takes several lengths (e.g. ``2048,32768``): each step's one engine runs each, and
``--max-model-len`` is raised to the longest (as for ``bench synthetic``). With synthetic weights the ``+mtp`` row
reports the measured round cost and, for each accept length passed in (``--price-accept-from`` a JSON record of
a trained-model run, or ``--price-accept-length`` with ``--price-accept-source``), the priced TPOT; no accept
length is ever assumed. The ablation report is rewritten after every step, so a run cut short keeps its rows.
Files: ``DIR/NAME.json``, ``DIR/NAME.md``, ``DIR/NAME_*.png`` (NAME defaults to the benchmark's name).
Exit codes: 0 done (an ablation with every lever active; with ``--tpot-rule record`` TPOT rises are listed, not
stopped on); 2 the engine could not start or a bad argument; 3 the ablation stopped early (a lever not active, a
step that failed, or with the default ``--tpot-rule enforce`` a TPOT rise beyond ``--tpot-tolerance``; on a CPU
device a rise is recorded, not enforced, and the console says so).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

from bytebound.bench import report as rp
from bytebound.errors import ByteboundError

# --shots ceiling: twice the usual GSM8K protocols (5 or 8 exemplars). An exemplar is ~200 tokens (bundled
# tokenizer), so 16 shots (~3000 tokens) still fit the default --max-model-len 4096; more would skip every question.
MAX_SHOTS = 16


def _common(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--out", default="bench-results", help="output folder (default: bench-results)")
    p.add_argument("--name", default=name, help=f"file stem of the report (default: {name})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights-label", default=None,
                   help=f"what the weights are, for the report (default: dummy -> '{rp.WEIGHTS_SYNTHETIC}', "
                        f"bundled ling-nano -> '{rp.WEIGHTS_TRAINED}')")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--note", default=None, help="free text recorded in the report (a workaround, a caveat)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (CPU; 1 is fastest for tiny models on a busy machine)")


def _lens(spec: str) -> tuple[int, ...]:
    """argparse type of the ablation's ``--input-len``: one or more comma-separated token counts."""
    try:
        out = tuple(int(v) for v in spec.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated token counts, got {spec!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"at least one token count, got {spec!r}")
    return out


def _synthetic_args(p, input_len: int = 32768, output_len: int = 2048, several: bool = False) -> None:
    if several:
        p.add_argument("--input-len", type=_lens, default=(input_len,),
                       help=f"prompt length(s), comma-separated, each a case of every step (default {input_len})")
    else:
        p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--num-requests", type=int, default=1, help="timed requests (distinct seeded prompts)")
    p.add_argument("--warmup", type=int, default=1, help="short untimed requests first")


def _gsm8k_args(p) -> None:
    p.add_argument("--limit", type=int, default=None, help="first N test questions (default: all 1319)")
    p.add_argument("--shots", type=int, default=5, help=f"exemplars per prompt, 0-{MAX_SHOTS} (default 5)")
    p.add_argument("--max-tokens", type=int, default=512, help="per question, clamped to the room in max_model_len")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=29)


def add_parser(subparsers) -> argparse.ArgumentParser:
    from bytebound.cli import add_engine_args
    from bytebound.helptext import plain_doc
    from bytebound.verify.cli import add_verify_args
    p = subparsers.add_parser("bench", help="benchmarks: synthetic, gsm8k, ablation", description=plain_doc(__doc__),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench", required=True)
    s = sub.add_parser("synthetic", help="fixed-length greedy decode (default 32768 in / 2048 out)")
    add_engine_args(s)
    _common(s, "synthetic")
    _synthetic_args(s)
    s.add_argument("--bandwidth", default="auto", help="auto (measure here), none, or GB/s for the byte floor")
    s.add_argument("--ttft-lens", default="", help="also time prefill-only requests of these prompt lengths "
                   "(comma-separated, e.g. 2048,8192,32768): TTFT and achieved TFLOP/s")
    s.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                   help="device time by kernel of one N-token prefill (torch.profiler), in the report")
    add_verify_args(s, strict_default=True)
    s.set_defaults(fn=cmd_synthetic)
    g = sub.add_parser("gsm8k", help="GSM8K 5-shot accuracy and latency")
    add_engine_args(g)
    _common(g, "gsm8k")
    _gsm8k_args(g)
    add_verify_args(g, strict_default=True)
    g.set_defaults(fn=cmd_gsm8k)
    a = sub.add_parser("ablation", help="baseline -> +kernel -> +fp8-head -> +mtp, one lever at a time",
                       description=plain_doc(__import__("bytebound.bench.ablation", fromlist=["x"]).__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(a)
    _common(a, "ablation")
    a.add_argument("--workload", default="synthetic", choices=["synthetic", "gsm8k"])
    _synthetic_args(a, 32768, 2048, several=True)
    _gsm8k_args(a)
    a.add_argument("--baseline-moe", default="torch",
                   help="generic routed-MoE backend of the baseline (the seed's ladder: humming)")
    a.add_argument("--kernel-moe", default="triton", help="shape-specialised routed-MoE backend (+kernel step)")
    a.add_argument("--tpot-tolerance", type=float, default=0.01,
                   help="an active step whose TPOT rises more than this fraction stops the ladder (default 0.01)")
    a.add_argument("--tpot-rule", default="enforce", choices=["enforce", "record"],
                   help="enforce: a TPOT rise beyond the tolerance stops the ladder (exit 3); record: it is listed in "
                        "the row and the report's regressions and the ladder goes on (default enforce; CPU: record)")
    a.add_argument("--price-accept-from", action="append", default=[], metavar="FILE",
                   help="synthetic weights: price the +mtp row at the accept length(s) in this JSON record of a "
                        "trained-model run (bench ablation / gsm8k with MTP, scripts/mtp_accept.py); repeatable")
    a.add_argument("--price-accept-length", type=float, default=None, metavar="A",
                   help="synthetic weights: price the +mtp row at this measured accept length (needs "
                        "--price-accept-source)")
    a.add_argument("--price-accept-source", default=None, metavar="TEXT",
                   help="where --price-accept-length was measured (file, model, device, commit)")
    a.add_argument("--reprice", default=None, metavar="ABLATION_JSON",
                   help="no engine: add priced rows for the given accept lengths to this synthetic-weights "
                        "ablation record and rewrite its JSON, markdown and plot in place")
    a.set_defaults(fn=cmd_ablation)
    return p


# ---- helpers ----------------------------------------------------------------------------------------------
def _config(a, synthetic: bool = False, min_len: int = 0):
    """EngineConfig of the command line; ``synthetic``: with ``max_model_len`` raised to what the fixed-length
    requests need (flag errors first, then the length check of :func:`_synthetic_len`), and to ``min_len``."""
    from bytebound.cli import engine_config, spec_steps
    cfg = engine_config(a, mtp_steps_used=getattr(a, "bench", None) == "ablation")   # its +mtp step reads it
    if hasattr(a, "no_canaries"):      # synthetic / gsm8k: start-up canaries, strict unless --no-strict
        from bytebound.verify.cli import apply_verify_args
        cfg = apply_verify_args(cfg, a)
    if not synthetic:
        return cfg
    return replace(cfg, max_model_len=max(cfg.max_model_len, _synthetic_len(a, spec_steps(a)), min_len))


def _start(cfg):
    from bytebound.cli import print_fallbacks
    from bytebound.engine.engine import Engine
    t = time.perf_counter()
    eng = Engine(cfg)
    print_fallbacks(eng)
    print(f"[bench] engine started in {time.perf_counter() - t:.1f} s (head path {eng.model.lm_head.mode}, "
          f"MTP steps={cfg.speculative_steps}; kernels: " + ", ".join(f"{op}={r.resolved}" for op, r in
                                                                     eng.plan.resolutions.items()) + ")", flush=True)
    return eng


def _synthetic_len(a, steps: int) -> int:
    """Cache slots a synthetic request needs; raises ConfigError naming --input-len/--output-len when the model's
    ``max_position_embeddings`` is smaller (the engine's own check would name --max-model-len, which the bench
    raised by itself)."""
    lens = a.input_len if isinstance(a.input_len, (tuple, list)) else (a.input_len,)
    need = max(lens) + a.output_len + steps + 1
    from bytebound.config import LingConfig
    from bytebound.errors import ConfigError
    limit = LingConfig.from_file(a.model).max_position_embeddings
    if need > limit:
        from bytebound.config import LING3_FLASH_CONFIG
        spec = ",".join(str(n) for n in lens)
        raise ConfigError(f"--input-len {spec} + --output-len {a.output_len} (+ {steps + 1} slots for the "
                          f"last decode/verify step) need {need} positions, but {a.model} has "
                          f"max_position_embeddings {limit}: pass shorter lengths, or run the full-scale model "
                          f"with synthetic weights (--model {LING3_FLASH_CONFIG} --load-format dummy --device cuda)")
    return need


def _print(paths: dict) -> None:
    print(f"[bench] wrote {paths['json']}, {paths['markdown']}" + "".join(f", {p}" for p in paths["png"]))


def _validate(a) -> None:
    """Reject bad numbers and an unwritable --out before any work is done (results are never lost at the end)."""
    from pathlib import Path
    from bytebound.errors import ConfigError
    for name in ("limit", "shots", "input_len", "output_len", "num_requests", "warmup", "max_tokens"):
        v = getattr(a, name, None)
        low = 1 if name in ("limit", "input_len", "output_len", "num_requests", "max_tokens") else 0
        for x in (v if isinstance(v, (tuple, list)) else [v]):
            if x is not None and x < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {x}")
    if getattr(a, "shots", None) is not None and a.shots > MAX_SHOTS:
        raise ConfigError(f"--shots must be <= {MAX_SHOTS}, got {a.shots} (an exemplar is ~200 tokens; "
                          "GSM8K protocols use 5 or 8)")
    if getattr(a, "bandwidth", None) is not None and a.bandwidth not in ("auto", "none"):
        from bytebound.analysis.cli import parse_bandwidth
        parse_bandwidth(a.bandwidth, "'auto' or 'none'")         # the same rule as analyze, before the engine loads
    tol = getattr(a, "tpot_tolerance", None)
    if tol is not None and not 0 <= tol < math.inf:
        raise ConfigError(f"--tpot-tolerance must be a fraction >= 0 (0.01 = 1 %), got {tol}")
    # the report files are OUT/NAME.json, .md and NAME_*.png: a separator would write outside --out
    if not a.name.strip() or "/" in a.name or "\\" in a.name:
        raise ConfigError(f"--name must be a plain file stem (no path separators, not empty), got {a.name!r}")
    Path(a.out).mkdir(parents=True, exist_ok=True)


def _guard(fn):
    def run(a) -> int:
        if a.torch_threads:
            import torch
            torch.set_num_threads(a.torch_threads)
        try:
            _validate(a)
            return fn(a)
        except (ByteboundError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
            print(f"[bench] error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    run.__name__ = fn.__name__
    return run


# ---- synthetic --------------------------------------------------------------------------------------------
@_guard
def cmd_synthetic(a) -> int:
    from bytebound.bench.synthetic import byte_floor, draw_token_times, floor_ratio, measure_bandwidth, run_synthetic
    ttft_lens = _int_list(a.ttft_lens, "--ttft-lens")
    eng = _start(_config(a, synthetic=True, min_len=max([n + 2 for n in ttft_lens], default=0)))
    meta = rp.run_meta(eng, weights=a.weights_label, note=a.note)
    # prefill-only requests first: they compile the long-chunk shapes, so the timed request below runs warm
    prefill = _prefill_section(eng, ttft_lens, a.profile_prefill, a.seed)
    res = run_synthetic(eng, a.input_len, a.output_len, a.num_requests, a.warmup, a.seed, not a.no_progress)
    s = rp.summarize(res["outputs"])
    bw, bw_note = measure_bandwidth(eng.device, a.bandwidth)
    acc = s.get("accept_length", {}).get("aggregate")
    floor = byte_floor(eng, bw, a.input_len + a.output_len // 2, acc)
    ratio = floor_ratio(floor, s["tpot_ms"]["mean"])
    floor.update(bandwidth_note=bw_note, tpot_over_floor=ratio)
    title = f"Synthetic benchmark: {a.input_len} in / {a.output_len} out, greedy, batch 1"
    md = [f"# {title}", ""] + rp.meta_section(meta) + ["", "## Results", ""] + rp.latency_table(s) + ["", "## Byte floor", ""]
    if "floor_ms" in floor:
        line = (f"One decode step reads {floor['step_bytes'] / 1e9:.3f} GB (weights {floor['weight_bytes'] / 1e9:.3f} GB, "
                f"LM head {floor['ledger_head']}, + KDA state and MLA cache at {floor['context']} tokens); at "
                f"{bw:.1f} GB/s the floor is **{floor['floor_ms']:.3f} ms**")
        if "mtp_floor_ms_per_token" in floor:
            line += (f", {floor['mtp_floor_ms_per_token']:.3f} ms per token with MTP at accept length "
                     f"{floor['accept_length']:.2f}")
        md.append(line + (f". Measured TPOT / floor = **{ratio:.2f}x**." if ratio else "."))
    md += ["", f"Bandwidth: {bw_note}.", f"Ledger: {floor.get('note', '')}."]
    md += _prefill_markdown(prefill, getattr(eng, "startup", None))
    data = {"benchmark": "synthetic", "meta": meta, "workload": {"input_len": a.input_len, "output_len": a.output_len,
            "num_requests": a.num_requests, "sampling": "greedy, ignore_eos", "seed": a.seed},
            "summary": s, "byte_floor": floor, "prefill": prefill, "startup": getattr(eng, "startup", None),
            "requests": [{"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
                          "ttft_s": o.ttft_s, "tpot_s": o.tpot_s, "e2e_s": o.e2e_s, "spec": o.spec}
                         for o in res["outputs"]]}
    paths = rp.write_report(a.out, a.name, data, md, {"tokens": draw_token_times(res["token_times"], title)})
    t = s["tpot_ms"]
    print(f"[bench] synthetic: TPOT {t['mean']:.3f} ms (P50 {t['p50']:.3f}, P95 {t['p95']:.3f}), decode "
          f"{s['decode_tok_s']['aggregate']:.1f} tok/s, TTFT {s['ttft_ms']['mean']:.1f} ms"
          + (f", accept length {acc:.2f}" if acc else ""))
    if "adaptive" in s:
        ad = s["adaptive"]
        print(f"[bench] adaptive speculation: {ad['plain_steps']} plain steps, {ad['rounds']} MTP rounds, "
              f"{ad['probes']} probes, {ad['catchups']} NEXTN catch-ups ({ad['catchup_ms']:.1f} ms host), ended in "
              f"mode {ad['final_mode']}")
    print("[bench] byte floor: " + (f"{floor['floor_ms']:.3f} ms, TPOT/floor {ratio:.2f}x ({bw_note})"
                                     if ratio else bw_note))
    _print(paths)
    return 0


def _int_list(spec: str, flag: str) -> list[int]:
    from bytebound.errors import ConfigError
    try:
        out = [int(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated token counts, got {spec!r}") from None
    if any(v < 1 for v in out):
        raise ConfigError(f"{flag}: every length must be >= 1, got {spec!r}")
    return out


def _prefill_section(eng, lens: list[int], profile_n: int, seed: int) -> dict:
    from bytebound.bench.synthetic import profile_prefill, run_ttft
    out = {"ttft": run_ttft(eng, lens, seed) if lens else []}
    for r in out["ttft"]:
        print(f"[bench] TTFT {r['input_len']} tokens: {r['ttft_s'] * 1e3:.1f} ms warm ({r['tflops']:.1f} TFLOP/s), "
              f"first request {r['first_ttft_s'] * 1e3:.1f} ms", flush=True)
    if profile_n:
        out["profile"] = profile_prefill(eng, profile_n, seed)
    return out


def _prefill_markdown(prefill: dict, startup: dict | None) -> list[str]:
    md = []
    if prefill.get("ttft"):
        md += ["", "## Prefill (TTFT, prefill-only requests)", "",
               "| prompt tokens | TTFT (warm) | TFLOP/s achieved | first request (compiles new shapes) |",
               "|---:|---:|---:|---:|"]
        md += [f"| {r['input_len']} | {r['ttft_s'] * 1e3:.1f} ms | {r['tflops']:.1f} | {r['first_ttft_s'] * 1e3:.1f} ms |"
               for r in prefill["ttft"]]
        md += ["", "TFLOP/s: 2 x active weights (LM head excluded) per token + causal MLA attention, over TTFT "
               "(`bench.synthetic.prefill_flops`)."]
    p = prefill.get("profile")
    if p and p["rows"]:
        md += ["", f"## Device time by kernel, one {p['tokens']}-token prefill", "",
               f"wall {p['wall_s'] * 1e3:.1f} ms, device {p['device_s'] * 1e3:.1f} ms, {p['kernels']} kernels", "",
               "| kernel | calls | device ms | share |", "|---|---:|---:|---:|"]
        md += [f"| `{r['name']}` | {r['calls']} | {r['device_ms']:.2f} | {100 * r['share']:.1f} % |" for r in p["rows"]]
    if startup:
        md += ["", "## Start-up", "", "| phase | seconds |", "|---|---:|"]
        md += [f"| {k[:-2]} | {v:.1f} |" for k, v in startup.items() if k.endswith("_s") and k != "total_s"]
        md += [f"| **total** | **{startup['total_s']:.1f}** |"]
        if "triton_compiled" in startup:
            md += ["", f"Triton kernels compiled during start-up: {startup['triton_compiled']} ("
                   f"{'warm cache' if startup['triton_compiled'] == 0 else 'cold cache'}, `{startup['triton_cache']}`)."]
    return md


# ---- gsm8k ------------------------------------------------------------------------------------------------
def gsm8k_markdown(res: dict, s: dict, meta: dict, title: str) -> list[str]:
    n, k = res["n"], res["correct"]
    lo, hi = rp.wilson(k, n)
    sp = res["sampling"]
    skip = f"{_skipped(res)} (not in the accuracy). " if res.get("skipped") else ""
    md = [f"# {title}", ""] + rp.meta_section(meta) + ["", "## Accuracy", "",
          f"**{k}/{n} = {100 * k / max(n, 1):.1f}%** (95% Wilson interval {100 * lo:.1f}-{100 * hi:.1f}%). {skip}"
          f"{sp['shots']}-shot prompts (exemplars from train, seed {sp['seed']}), temperature {sp['temperature']}, "
          f"top-p {sp['top_p']}, top-k {sp['top_k']}, max_tokens {sp['max_tokens']}, stop {sp['stop']!r}; "
          "answer = first number after `####` (commas stripped).", "", "## Latency", ""]
    md += rp.latency_table(s)
    return md


def _skipped(res: dict) -> str:
    """``"N skipped: prompt does not fit max_model_len"`` (not in the accuracy), or ``""``."""
    return f"{res['skipped']} skipped: prompt does not fit max_model_len" if res.get("skipped") else ""


@_guard
def cmd_gsm8k(a) -> int:
    from bytebound.bench.gsm8k import run_gsm8k
    eng = _start(_config(a))
    meta = rp.run_meta(eng, weights=a.weights_label, note=a.note)
    res = run_gsm8k(eng, a.limit, a.shots, a.seed, a.max_tokens, a.temperature, a.top_p, a.top_k, not a.no_progress)
    s = rp.summarize(res["outputs"])
    n, k = res["n"], res["correct"]
    title = f"GSM8K benchmark: {len(res['rows'])} test questions, batch 1"
    data = {"benchmark": "gsm8k", "meta": meta, "sampling": res["sampling"],
            "accuracy": k / n if n else 0.0, "correct": k, "n": n, "skipped": res["skipped"],
            "ci95": list(rp.wilson(k, n)), "summary": s, "questions": res["rows"]}
    md = gsm8k_markdown(res, s, meta, title)
    paths = rp.write_report(a.out, a.name, data, md, {"latency": rp.draw_latency(res["outputs"], title)})
    acc = s.get("accept_length", {}).get("aggregate")
    skip = f" ({_skipped(res)})" if res["skipped"] else ""       # skipped questions are not in k/n
    # the prompt length next to TTFT: a 5-shot prompt is ~1,100 tokens, so TTFT here is a prefill of that length
    plen = [r["prompt_tokens"] for r in res["rows"] if "prompt_tokens" in r and not r.get("skipped")]
    pnote = f" ({a.shots}-shot prompts of {sum(plen) / len(plen):.0f} tokens on average)" if plen else ""
    print(f"[bench] gsm8k: accuracy {k}/{n} = {100 * k / max(n, 1):.1f}%{skip}, "
          f"TPOT {rp.fmt(s['tpot_ms']['mean'], 3)} ms, decode {rp.fmt(s['decode_tok_s']['aggregate'], 1)} tok/s, "
          f"TTFT {rp.fmt(s['ttft_ms']['mean'], 1)} ms{pnote}, "
          f"e2e mean {rp.fmt(s['e2e_ms']['mean'], 0)} ms" + (f", accept length {acc:.2f}" if acc else ""))
    _print(paths)
    return 0


# ---- ablation ---------------------------------------------------------------------------------------------
def _pricing(a) -> list[dict]:
    """The accept lengths the +mtp row is priced at (synthetic weights), read and checked before any engine."""
    from bytebound.bench.ablation import accept_from_file, check_pricing
    from bytebound.cli import spec_steps
    from bytebound.errors import ConfigError
    top = spec_steps(a) + 1
    out = []
    for f in a.price_accept_from:
        out += accept_from_file(f, top)
    if a.price_accept_length is not None:
        out += check_pricing([{"accept_length": a.price_accept_length, "source": a.price_accept_source}], top)
    elif a.price_accept_source:
        raise ConfigError("--price-accept-source without --price-accept-length")
    return out


def _reprice(a, pricing: list[dict]) -> int:
    from pathlib import Path
    from bytebound.bench.ablation import draw_ladder, reprice
    from bytebound.errors import ConfigError
    f = Path(a.reprice)
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--reprice {f}: cannot read a JSON record ({type(e).__name__}: {e})") from None
    if not pricing:
        raise ConfigError("--reprice needs --price-accept-from or --price-accept-length")
    data = reprice(data, pricing)
    data.pop("files", None)
    paths = rp.write_report(f.parent, f.stem, data, ablation_markdown(data, data.get("meta") or {},
                                                                      data.get("workload") or {}),
                            {"ladder": draw_ladder(data)})
    for c in (c for s in data["steps"] if s["step"] == "+mtp" for c in s.get("cases", []) if c.get("priced")):
        for q in c["priced"]:
            print(f"[bench] +mtp {c['case'] or ''}: round {c['round']['round_ms']:.3f} ms, c "
                  f"{c['round']['c'] or float('nan'):.3f}; PRICED at accept length {q['accept_length']:.3f} "
                  f"({q['source']}): {q['tpot_ms']:.3f} ms, {q['speedup'] or float('nan'):.2f}x")
    _print(paths)
    return 0


@_guard
def cmd_ablation(a) -> int:
    from bytebound.bench.ablation import draw_ladder, run_ablation
    from bytebound.cli import spec_steps
    pricing = _pricing(a)
    if a.reprice:
        return _reprice(a, pricing)
    progress = not a.no_progress
    cases = None
    if a.workload == "synthetic":
        from bytebound.bench.synthetic import run_synthetic
        base = _config(a, synthetic=True)
        cases = list(a.input_len)
        workload_desc = {"workload": "synthetic", "input_len": cases, "output_len": a.output_len,
                         "num_requests": a.num_requests, "sampling": "greedy, ignore_eos",
                         "max_model_len": base.max_model_len}

        def workload(eng, n):     # warm-up requests once per engine, before its first case
            r = run_synthetic(eng, int(n), a.output_len, a.num_requests, a.warmup if n == cases[0] else 0, a.seed,
                              progress)
            return r["outputs"], {"input_len": int(n), "output_len": a.output_len}
    else:
        from bytebound.bench.gsm8k import run_gsm8k
        base = _config(a)
        workload_desc = {"workload": "gsm8k", "limit": a.limit, "shots": a.shots, "max_tokens": a.max_tokens,
                         "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k, "seed": a.seed}

        def workload(eng):
            r = run_gsm8k(eng, a.limit, a.shots, a.seed, a.max_tokens, a.temperature, a.top_p, a.top_k, progress)
            return r["outputs"], {"accuracy": r["correct"] / r["n"] if r["n"] else 0.0, "correct": r["correct"],
                                  "n": r["n"], "skipped": r["skipped"]}
    meta: dict = {}

    def make(cfg):
        eng = _start(cfg)
        if not meta:
            meta.update(rp.run_meta(eng, weights=a.weights_label, note=a.note))
        return eng

    def write(res):
        data = {"benchmark": "ablation", "meta": meta, "workload": workload_desc, **res}
        return rp.write_report(a.out, a.name, data, ablation_markdown(res, meta, workload_desc),
                               {"ladder": draw_ladder(res)})

    res = run_ablation(base, workload, a.baseline_moe, a.kernel_moe, spec_steps(a), a.tpot_tolerance,
                       a.allow_fallback, make_engine=make, cases=cases, pricing=pricing, tpot_rule=a.tpot_rule,
                       on_step=write)
    _print(write(res))
    return 3 if res["status"] == "stopped" else 0


def _case_label(c: dict, workload: dict) -> str:
    if c.get("case") is None:
        return workload.get("workload", "-")
    return f"{c['case']} in / {workload.get('output_len', '?')} out" if workload.get("workload") == "synthetic" \
        else str(c["case"])


def ablation_markdown(res: dict, meta: dict, workload: dict) -> list[str]:
    """The ablation report: status, one row per step and case, the measured MTP round and (synthetic weights)
    the priced TPOT, then the baseline engine's run record."""
    md = ["# Ablation ladder: one lever at a time", "", f"Workload: `{workload}`. Each step is a fresh engine that "
          "changes one lever of the previous step and checks that the lever is active before it is timed"
          + (" (every case of a step runs on its one engine)." if res.get("cases") else "."), ""]
    skipped = [s["step"] for s in res["steps"] if s.get("skipped")]
    if res["status"] == "running":
        md += [f"**Partial: {len(res['steps'])} of 4 steps done** (the run was still going when this was written, "
               "or was cut short).", ""]
    elif res["stop"]:
        md += [f"**Stopped at step `{res['stop']['step']}`: {res['stop']['message']}**", ""]
    elif res.get("tpot_rule", "enforced").startswith("recorded, not enforced (CPU"):
        md += ["**CPU run: complete as far as a CPU can show.** " + (f"Skipped: {', '.join(skipped)} (see the "
               "check column). " if skipped else "") + "Each lever that ran was checked active; TPOT changes are "
               "recorded, not enforced: the levers cut bytes per token, and a CPU decode of a small model is bound "
               "by per-op overhead, not memory bandwidth. The speed ladder is a CUDA measurement.", ""]
    elif any(s["active"] is False and not s.get("skipped") for s in res["steps"]):
        md += ["**Complete with --allow-fallback, not every lever active: "
               + ", ".join(f"`{s['step']}`" for s in res["steps"] if s["active"] is False and not s.get("skipped"))
               + " (see the check column; an inactive step is not compared, and a later step compares with the "
               "previous step that ran).**", ""]
    elif res.get("regressions"):
        md += ["**Complete: every lever active; TPOT rules recorded, not enforced (--tpot-rule record). Steps that "
               "made TPOT worse: " + ", ".join(f"`{r['step']}`" + (f" at {r['case']}" if r["case"] else "")
                                               + f" ({r['change_pct']:+.2f}%)" for r in res["regressions"])
               + ".**", ""]
    else:
        md += ["**Complete: every lever active, no step made TPOT worse"
               + (" (the +mtp row on synthetic weights excepted: see below)" if res.get("synthetic_weights") else "")
               + ".**", ""]
    gsm = workload.get("workload") == "gsm8k"
    md += ["| step | case | lever | active | check | mean TPOT [ms] | vs previous | vs baseline | decode tok/s | "
           "TTFT mean [ms] | E2E mean / P50 / P95 [ms] | accept length |" + (" accuracy |" if gsm else "") + " note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if gsm else "") + "---|"]
    for s in res["steps"]:
        active = "skipped" if s.get("skipped") else ("yes" if s["active"] else "NO")
        cases = s.get("cases") or [{"case": None, "summary": {}, "note": s.get("note", "")}]
        for i, c in enumerate(cases):
            sm = c.get("summary", {})
            acc = sm.get("accept_length", {}).get("aggregate")
            e2e = sm.get("e2e_ms", {})
            first = i == 0
            md.append(f"| {s['step'] if first else ''} | {_case_label(c, workload) if s.get('cases') else '-'} | "
                      f"{s['lever'] if first else ''} | {active if first else ''} | {s['check'] if first else ''} | "
                      f"{rp.fmt(c.get('tpot_ms'), 3)} | "
                      + (f"{c['change_pct']:+.2f}% ({c['change_ms']:+.3f} ms)" if "change_pct" in c else "-") + " | "
                      + (f"{c['change_vs_baseline_pct']:+.2f}%" if "change_vs_baseline_pct" in c else "-") + " | "
                      f"{rp.fmt(sm.get('decode_tok_s', {}).get('aggregate'), 1)} | "
                      f"{rp.fmt(sm.get('ttft_ms', {}).get('mean'), 1)} | "
                      + (" / ".join(rp.fmt(e2e.get(k), 0) for k in ("mean", "p50", "p95")) if e2e else "-") + " | "
                      f"{rp.fmt(acc)} | "
                      + (f"{100 * c['accuracy']:.1f}% ({c.get('correct')}/{c.get('n')}) | " if gsm and "accuracy" in c
                         else ("- | " if gsm else ""))
                      + f"{c.get('note', '') if s.get('cases') else s.get('note', '')} |")
    md += _mtp_markdown(res, workload)
    if meta:
        md += ["", "## Run (the first engine that started: the baseline unless it could not)", ""]
        md += rp.meta_section(meta)
    md += ["", f"TPOT tolerance {100 * res['tolerance']:.1f}%, rule: {res.get('tpot_rule', 'enforced')}; "
           f"--allow-fallback {res['allow_fallback']} (inactive levers are recorded and not compared instead of "
           "stopping the ladder)."]
    return md


def _mtp_markdown(res: dict, workload: dict) -> list[str]:
    mtp = next((s for s in res["steps"] if s["step"] == "+mtp"), None)
    rows = [c for c in (mtp or {}).get("cases", []) if c.get("round")]
    if not rows:
        return []
    md = ["", "## MTP round cost (measured)", "",
          "| case | plain decode TPOT (previous step) [ms] | round [ms] | c = round / plain | round, wall [ms] | "
          "c, wall | rounds | accept length (measured) |", "|---|---|---|---|---|---|---|---|"]
    for c in rows:
        r = c["round"]
        md.append(f"| {_case_label(c, workload)} | {rp.fmt(r['plain_tpot_ms'], 3)} | **{r['round_ms']:.3f}** | "
                  f"**{rp.fmt(r['c'], 3)}** | {r['round_ms_wall']:.3f} | {rp.fmt(r['c_wall'], 3)} | {r['rounds']} | "
                  f"{r['accept_length']:.3f} |")
    md += ["", f"Round = {rows[0]['round']['round_ms_source']} (with static rounds: the graph replay with its one "
           "host read; pipelined rounds, the CUDA default: from the previous round's read to this one's); wall = first-to-last-token time per round, which also holds the per-round Python loop (the "
           "request's NEXTN pass over the prompt runs before its first token, in TTFT). c is against the previous "
           "step's TPOT in the same case."]
    if not res.get("synthetic_weights"):
        return md + (["", f"Weights are not synthetic: the accept length above is measured, so the "
                      f"{len(res['pricing'])} pricing input(s) given were not used."] if res.get("pricing") else [])
    md += ["", "## +mtp on synthetic weights: PRICED, not measured", "",
           "Random weights accept (almost) nothing (measured accept length above), so the +mtp row's measured TPOT is "
           "one round per token: the cost of a round, not what MTP gives. The priced TPOT is that **measured** round "
           "cost divided by an accept length **measured on a trained model** (source in each row): priced TPOT = "
           "round / A, speed-up = A / c. The static round has fixed shapes, so its cost does not depend on what is "
           "accepted; what the price assumes is that the full-scale model's drafts are accepted as often as those of "
           "the model A was measured on. The TPOT stop rule is not applied to this row: the measured TPOT cannot show "
           "the lever's effect with random weights, and the priced TPOT is a model, not a measurement.", ""]
    priced = [(c, p) for c in rows for p in c.get("priced", [])]
    if not priced:
        return md + ["Not priced: no measured accept length was given (`--price-accept-from FILE` or "
                     "`--price-accept-length A --price-accept-source TEXT`); no accept length is assumed."]
    md += ["| case | accept length A | source of A | priced TPOT = round / A [ms] | priced speed-up A / c | "
           "vs previous step | priced from the wall round [ms] |", "|---|---|---|---|---|---|---|"]
    for c, p in priced:
        md.append(f"| {_case_label(c, workload)} | {p['accept_length']:.3f} | {p['source']} | **{p['tpot_ms']:.3f}** "
                  f"(priced) | **{rp.fmt(p['speedup'], 2)}x** | "
                  + (f"{p['change_pct']:+.1f}%" if p["change_pct"] is not None else "-")
                  + f" | {p['tpot_ms_wall']:.3f} |")
    return md
