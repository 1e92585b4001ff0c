"""``bytebound analyze``: the seed's byte model beside the exact ledger, as a table, JSON and PNG plots.

Usage::

    bytebound analyze --config ling-3.0-flash.json [--tpot 27.71] [--tpot-fp8-head 22.76]
        [--bandwidth 273|measure] [--peak-tflops 1000] [--accept-length 3.90] [--verify-cost 2.26]
        [--draft-tokens 4] [--draft-steps 3] [--context 2K,32K,256K] [--checkpoint DIR]
        [--json out.json] [--plots DIR]

Defaults are the seed's inputs, so a bare run reproduces the seed's numbers (seed column) and prices the same
operating points with the exact ledger (exact column). Without ``--config`` the exact column uses the bundled
Ling-3.0-flash config, or with ``--checkpoint DIR`` that checkpoint's own ``config.json``; ``--config none``
shows the seed column only.
Contexts: ``32K`` = 32,000 tokens (the seed's convention), ``32Ki`` = 32,768.
The seed's TPOTs and accept length were measured with Ling-3.0-flash on a DGX Spark: the exact column prices
another model at them only when they are given (``--tpot``, ``--tpot-fp8-head``, ``--accept-length``, measured
on that model); the rows priced at the others show ``—``, and a note says so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

from bytebound.analysis import seed as sd
from bytebound.analysis.ledger import Ledger, build_ledger, expected_distinct_experts, ledger_from_specs, \
    specs_from_safetensors
from bytebound.errors import BackendError, ByteboundError, ConfigError

GB = 1e9
# flag (argparse dest) -> the seed input it sets; a given value is a measurement of the model being priced
MEASURED_FLAGS = {"tpot": "tpot_ms", "tpot_fp8_head": "tpot_fp8_head_ms", "accept_length": "accept_length"}


def parse_context(text: str) -> tuple[int, ...]:
    """``"2K,32K,256K"`` -> (2000, 32000, 256000); ``Ki``/``Mi`` suffixes are binary (32Ki = 32768)."""
    out = []
    for tok in str(text).replace(" ", "").split(","):
        t = tok.upper()
        for suf, mul in (("KI", 1024), ("MI", 1 << 20), ("K", 1000), ("M", 1_000_000), ("", 1)):
            if t.endswith(suf):
                try:
                    out.append(int(float(t[: len(t) - len(suf)] if suf else t) * mul))
                except (ValueError, OverflowError):      # "abc", "inf"
                    raise ConfigError(f"--context: cannot parse {tok!r} (examples: 2K, 32Ki, 131072)") from None
                break
    return tuple(out)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``analyze`` on an ``argparse`` subparsers object; returns the parser."""
    d = sd.SeedInputs()
    from bytebound.helptext import plain_doc
    p = subparsers.add_parser("analyze", help="byte ledger, roofline and speculative cost model (seed vs exact)",
                              description=plain_doc(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    from bytebound.config import LING3_FLASH_CONFIG
    p.add_argument("--config", default=None,
                   help="config.json (file or checkpoint dir) for the exact ledger (default: the --checkpoint's own "
                        f"config.json, else the bundled Ling-3.0-flash config {LING3_FLASH_CONFIG.name}, a name "
                        "that finds the bundled file from any folder); 'none' shows the seed column only")
    p.add_argument("--checkpoint", help="price the stored tensors of this checkpoint (safetensors headers)")
    seed = "(default: the seed's {:g}, measured with Ling-3.0-flash: it prices that model only)"
    p.add_argument("--tpot", type=float, default=None, help="measured TPOT, BF16 head [ms] " + seed.format(d.tpot_ms))
    p.add_argument("--tpot-fp8-head", type=float, default=None,
                   help="measured TPOT, FP8 head [ms] " + seed.format(d.tpot_fp8_head_ms))
    p.add_argument("--bandwidth", default=str(d.bandwidth_gbs), help="GB/s, or 'measure' (streaming read here)")
    p.add_argument("--device", default=None, help="device for --bandwidth measure (default cuda if present)")
    p.add_argument("--peak-tflops", type=float, default=d.peak_flops / 1e12, help="peak TFLOP/s for the roofline")
    p.add_argument("--accept-length", type=float, default=None,
                   help="a, tokens per round " + seed.format(d.accept_length))
    p.add_argument("--verify-cost", type=float, default=d.verify_cost, help="c, round time / plain step time")
    p.add_argument("--draft-tokens", type=int, default=d.draft_tokens, help="verify window k")
    p.add_argument("--draft-steps", type=int, default=3, help="NEXTN draft steps per round")
    p.add_argument("--context", default="2K,32K,256K", help="context lengths (K = 1000, Ki = 1024)")
    p.add_argument("--detail", action="store_true", help="also print every tensor kind of the exact ledger")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--plots", help="write ledger/roofline/kv/speculative PNGs into this folder")
    p.set_defaults(func=run, fn=run)  # bytebound.cli dispatches on fn
    return p


def parse_bandwidth(text, words: str = "'measure'") -> float:
    """A ``--bandwidth`` number in GB/s: finite and positive (``bench`` reuses it for its own flag).
    ``words`` names the non-numeric values the caller accepts, for the message."""
    try:
        bw = float(text)
    except ValueError:
        raise ConfigError(f"--bandwidth must be a number of GB/s or {words}, got {text!r}") from None
    if not 0 < bw < math.inf:           # also rejects nan: every floor divides by it
        raise ConfigError(f"--bandwidth must be a positive number of GB/s, got {text!r}")
    return bw


def _bandwidth(args) -> tuple[float, str]:
    if str(args.bandwidth).lower() != "measure":
        return parse_bandwidth(args.bandwidth), "given"
    import torch
    from bytebound.analysis.bandwidth import measure_read_bandwidth
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(dev).type
    except RuntimeError:
        raise ConfigError(f"--device {dev!r} is not a torch device (examples: cpu, cuda, cuda:1)") from None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"--device {dev!r}: --bandwidth measure runs on cpu or cuda only")
    try:
        return measure_read_bandwidth(dev), f"measured (streaming read on {dev})"
    except RuntimeError as e:            # e.g. cuda:7 on a one-GPU host, or out of memory for the 1 GiB buffer
        raise BackendError(f"--bandwidth measure on --device {dev}: {type(e).__name__}: {e}") from None


def exact_values(led: Ledger, s: sd.SeedInputs, draft_steps: int,
                 measured=sd.MEASURED) -> dict[str, float]:
    """The seed's quantities recomputed from the exact ledger ``led`` (BF16 head) at the same operating points.

    Speculation: c_B = round bytes / plain-step bytes (FP8 head), S = a / c_B (seed section 8 with the byte
    ratio in place of the measured time ratio), TPOT_MTP = TPOT_fp8 c_B / a, fallback = c_B TPOT_fp8 (section 11),
    and the round's effective bandwidth at the reported MTP TPOT: (round bytes / a) / TPOT_MTP (section 10).
    ``measured``: the fields of ``s`` named in :data:`~bytebound.analysis.seed.MEASURED` that were measured on
    ``led``'s model; a value priced at another measurement is left out (TPOTs of another model say nothing of
    this one's bandwidth).
    """
    f8 = led.with_head("fp8")
    b16, b8 = led.bytes, f8.bytes
    beff = sd.effective_bandwidth(b16, s.tpot_ms)
    hum = sd.effective_bandwidth(b16, s.tpot_humming_ms)
    cb = f8.round_bytes(s.draft_tokens, draft_steps) / b8
    kv, kvn, st = led.kv_bytes_per_token(s.kv_bytes), led.kv_bytes_per_token(s.kv_bytes, True), led.state_bytes()
    c = led.cfg
    v = {
        "active_params_b": led.params / 1e9, "active_bytes_gb": (b16 - led.head_bytes) / GB,
        "lm_head_params_m": c.vocab_size * c.hidden_size / 1e6,
        "lm_head_bf16_gb": led.head_bytes / GB, "lm_head_fp8_gb": f8.head_bytes / GB,
        "step_bytes_bf16_gb": b16 / GB, "step_bytes_fp8_gb": b8 / GB,
        "lm_head_share_bf16_pct": 100 * led.head_bytes / b16, "lm_head_share_fp8_pct": 100 * f8.head_bytes / b8,
        "floor_bf16_ms": sd.floor_ms(b16, s.bandwidth_gbs), "floor_fp8_ms": sd.floor_ms(b8, s.bandwidth_gbs),
        "b_eff_gbs": beff, "utilisation": sd.utilisation(beff, s.bandwidth_gbs), "b_eff_humming_gbs": hum,
        "fp8_head_pred_tpot_ms": b8 / (hum * GB) * 1e3,
        "ai_flop_per_byte": sd.arithmetic_intensity(led.params, b16),
        "ridge_flop_per_byte": sd.ridge_point(s.peak_flops, s.bandwidth_gbs),
        "kv_per_token_kib": kv / 1024, "kv_per_token_nextn_kib": kvn / 1024, "kda_state_mb": st / 1e6,
        "kda_state_pct": 100 * st / b16,
        "distinct_experts": expected_distinct_experts(c.num_experts, c.num_experts_per_tok, s.draft_tokens),
        "verify_bytes_gb": f8.verify_bytes(s.draft_tokens) / GB, "draft_step_bytes_gb": f8.draft_step_bytes() / GB,
        "round_bytes_gb": f8.round_bytes(s.draft_tokens, draft_steps) / GB, "byte_ratio": cb,
        "spec_speedup": s.accept_length / cb, "spec_tpot_ms": s.tpot_fp8_head_ms * cb / s.accept_length,
        "fallback_tpot_ms": cb * s.tpot_fp8_head_ms, "fallback_tok_s": 1e3 / (cb * s.tpot_fp8_head_ms),
        "b_eff_mtp_gbs": sd.effective_bandwidth(f8.round_bytes(s.draft_tokens, draft_steps) / s.accept_length,
                                                s.tpot_mtp_ms),
    }
    for key, points in PRICED_AT.items():
        if not set(points) <= set(measured):
            del v[key]
    for n in s.contexts:
        v[f"kv_{n}_bytes"] = n * kv
        v[f"kv_{n}_pct"] = 100 * n * kv / b16
    return v


# exact value -> the measured seed inputs it is priced at
PRICED_AT = {"b_eff_gbs": ("tpot_ms",), "utilisation": ("tpot_ms",), "b_eff_humming_gbs": ("tpot_humming_ms",),
             "fp8_head_pred_tpot_ms": ("tpot_humming_ms",), "spec_speedup": ("accept_length",),
             "spec_tpot_ms": ("tpot_fp8_head_ms", "accept_length"), "fallback_tpot_ms": ("tpot_fp8_head_ms",),
             "fallback_tok_s": ("tpot_fp8_head_ms",), "b_eff_mtp_gbs": ("tpot_mtp_ms", "accept_length")}


def is_seed_model(cfg) -> bool:
    """Whether ``cfg`` is the model the seed measured, the Ling-3.0-flash fp4 checkpoint: the same active
    parameters and bytes per decode step as the bundled config (another shape or another quantization is
    another model, and the seed's TPOTs and accept length say nothing about it)."""
    from bytebound.config import LING3_FLASH_CONFIG, LingConfig
    led, ref = build_ledger(cfg), build_ledger(LingConfig.from_file(LING3_FLASH_CONFIG))
    return (led.params, led.bytes) == (ref.params, ref.bytes)


def _reference_note(s: sd.SeedInputs, measured, config) -> str | None:
    """Why rows of the exact column show ``—``: the seed's measurements that are not this model's; None when
    every one it would be priced at applies."""
    names = {"tpot_ms": f"TPOT {s.tpot_ms:g} ms (--tpot)", "tpot_humming_ms": f"TPOT {s.tpot_humming_ms:g} ms "
             "with Humming", "tpot_fp8_head_ms": f"FP8-head TPOT {s.tpot_fp8_head_ms:g} ms (--tpot-fp8-head)",
             "tpot_mtp_ms": f"MTP TPOT {s.tpot_mtp_ms:g} ms", "accept_length": f"accept length "
             f"{s.accept_length:.2f} (--accept-length)"}
    missing = [n for k, n in names.items() if k not in measured]
    if not missing:
        return None
    return (f"exact ledger of {config}: not priced at the seed's {', '.join(missing)}, measured with "
            "Ling-3.0-flash on a DGX Spark, not on this model: those rows show — (the flags named take this "
            "model's own measurements). Bytes, the bandwidth floor and the ridge point apply as they are.")


def _rows(sv: dict[str, sd.SeedValue], ex: dict[str, float] | None, s: sd.SeedInputs) -> list[list[str]]:
    """Side-by-side rows: quantity, seed mode (as printed), exact ledger, unit, seed section."""
    def e(key, fmt):
        return "—" if ex is None or key not in ex else format(ex[key], fmt)

    def p(key):
        return sv[key].printed

    bw = f"{s.bandwidth_gbs:.4g}"
    rows = [
        ["active parameters", f"{s.active_params / 1e9:.2f}", e("active_params_b", ".3f"), "B", "4"],
        ["active weights, head excluded", p("active_bytes_gb"), e("active_bytes_gb", ".3f"), "GB", "4"],
        ["LM head parameters", p("lm_head_params_m"), e("lm_head_params_m", ".2f"), "M", "7"],
        ["LM head, BF16 / FP8", f"{p('lm_head_bf16_gb')} / {p('lm_head_fp8_gb')}",
         f"{e('lm_head_bf16_gb', '.3f')} / {e('lm_head_fp8_gb', '.3f')}", "GB", "4, 7"],
        ["bytes per step, BF16 head", p("step_bytes_bf16_gb"), e("step_bytes_bf16_gb", ".3f"), "GB", "4"],
        ["bytes per step, FP8 head", p("step_bytes_fp8_gb"), e("step_bytes_fp8_gb", ".3f"), "GB", "4"],
        ["LM head share, BF16 / FP8", f"{p('lm_head_share_bf16_pct')} / {p('lm_head_share_fp8_pct')}",
         f"{e('lm_head_share_bf16_pct', '.1f')} / {e('lm_head_share_fp8_pct', '.1f')}", "%", "7"],
        [f"floor at {bw} GB/s, BF16 / FP8 head", f"{p('floor_bf16_ms')} / "
         f"{sd.floor_ms(sv['step_bytes_fp8_gb'].value * GB, s.bandwidth_gbs):.2f}",
         f"{e('floor_bf16_ms', '.2f')} / {e('floor_fp8_ms', '.2f')}", "ms", "5"],
        [f"B_eff at {s.tpot_ms:g} ms", p("b_eff_gbs"), e("b_eff_gbs", ".1f"), "GB/s", "5"],
        [f"U = B_eff / {bw}", p("utilisation"), e("utilisation", ".2f"), "", "5"],
        [f"B_eff at {s.tpot_humming_ms:g} ms", p("b_eff_humming_gbs"), e("b_eff_humming_gbs", ".1f"), "GB/s", "6"],
        [f"FP8-head TPOT from it (reported {s.tpot_fp8_head_ms:g})", p("fp8_head_pred_tpot_ms"),
         e("fp8_head_pred_tpot_ms", ".2f"), "ms", "7"],
        ["arithmetic intensity / ridge", f"{p('ai_flop_per_byte')} / {p('ridge_flop_per_byte')}",
         f"{e('ai_flop_per_byte', '.2f')} / {e('ridge_flop_per_byte', '.0f')}", "FLOP/B", "5"],
        ["KV per token (MLA latent)", p("kv_per_token_kib"),
         "—" if ex is None else f"{ex['kv_per_token_kib']:.2f} (+NEXTN {ex['kv_per_token_nextn_kib']:.2f})",
         "KiB", "13"],
        ["KDA state, any length", "—",
         "—" if ex is None else f"{ex['kda_state_mb']:.1f} MB ({ex['kda_state_pct']:.1f} %)", "", "13"],
    ]
    for n in s.contexts:
        tag = f"{n // 1000}K" if n % 1000 == 0 else str(n)
        key = f"kv_{tag}"
        seed = f"{sv[key].printed} {sv[key].unit} ({sv[key + '_pct'].printed} %)" if key in sv else "—"
        exs = "—"
        if ex is not None:
            b = ex[f"kv_{n}_bytes"]
            exs = (f"{b / 1e6:.0f} MB" if b < 1e9 else f"{b / 1e9:.2f} GB") + f" ({ex[f'kv_{n}_pct']:.1f} %)"
        rows.append([f"KV at {tag} (share of step bytes)", seed, exs, "", "13"])
    rows += [
        [f"distinct experts, {s.draft_tokens} tokens", p("distinct_experts"), e("distinct_experts", ".1f"), "", "8"],
        [f"verify step / draft step bytes (FP8 head)", "—",
         f"{e('verify_bytes_gb', '.3f')} / {e('draft_step_bytes_gb', '.3f')}", "GB", "8"],
        ["c: round cost / plain step (seed: time; exact: bytes)", f"{s.verify_cost:.2f}", e("byte_ratio", ".2f"),
         "x", "8"],
        [f"S = a / c at a = {s.accept_length:.2f}", p("spec_speedup"), e("spec_speedup", ".2f"), "x", "8"],
        [f"MTP TPOT = {s.tpot_fp8_head_ms:g} c / a (reported {s.tpot_mtp_ms:g})", p("spec_tpot_ms"),
         e("spec_tpot_ms", ".2f"), "ms", "8"],
        [f"B_eff of MTP rounds at {s.tpot_mtp_ms:g} ms", p("b_eff_mtp_gbs"), e("b_eff_mtp_gbs", ".1f"), "GB/s",
         "10"],
        ["fallback a = 1: TPOT / throughput", f"≈ {p('fallback_tpot_ms')} / ≈ {p('fallback_tok_s')}",
         f"{e('fallback_tpot_ms', '.1f')} / {e('fallback_tok_s', '.1f')}", "ms, tok/s", "11"],
    ]
    return rows


def resolve_config(config: str | None, checkpoint: str | None) -> Path | None:
    """The config the exact ledger uses: ``config`` as given; None (not given) -> the checkpoint's own
    ``config.json`` when ``checkpoint`` is set (a folder, or the folder of a .safetensors file), else the bundled
    Ling-3.0-flash config; ``"none"`` -> None (seed column only). A bare file name that does not exist in the
    working directory but names a bundled config (``ling-3.0-flash.json``) is that bundled file.

    Raises:
        ConfigError: ``checkpoint`` given without ``config`` and it has no ``config.json`` beside its tensors.
    """
    from bytebound.config import LING3_FLASH_CONFIG
    if config is not None:
        if config.lower() == "none":
            return None
        p = Path(config)
        bundled = LING3_FLASH_CONFIG.parent / p.name
        # a bare file name that is not here but is a bundled config (the usage line's ling-3.0-flash.json): that one
        if not p.exists() and p.name == config and p.suffix == ".json" and bundled.is_file():
            return bundled
        return p
    if checkpoint is None:
        return Path(LING3_FLASH_CONFIG)
    ck = Path(checkpoint)
    own = (ck if ck.is_dir() else ck.parent) / "config.json"
    if ck.exists() and not own.is_file():
        raise ConfigError(f"--checkpoint {ck}: no config.json beside its tensors ({own}); pass --config for the "
                          "layer kinds and routing")
    return own if ck.exists() else Path(LING3_FLASH_CONFIG)   # a missing checkpoint: the loader names it


def _check_specs_match(specs: dict, cfg, config: Path, checkpoint: str) -> None:
    """A checkpoint priced against another model's config gives wrong numbers: compare the shapes that the
    config fixes (embedding and head ``[vocab_size, hidden_size]``, the decoder layer count with or without the
    NEXTN layers).

    Raises:
        ConfigError: a shape or the layer count differs (names both paths and the values).
    """
    want = (cfg.vocab_size, cfg.hidden_size)
    for name in ("model.word_embeddings.weight", "lm_head.weight"):
        if name in specs and tuple(specs[name][0]) != want:
            raise ConfigError(f"--checkpoint {checkpoint}: {name} is {list(specs[name][0])}, but --config {config} "
                              f"says [vocab_size, hidden_size] = {list(want)}: not this checkpoint's config")
    layers = {int(k.split(".")[2]) for k in specs if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    n = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    if layers and max(layers) + 1 not in (n, cfg.num_hidden_layers):     # NEXTN tensors may be absent
        raise ConfigError(f"--checkpoint {checkpoint}: tensors of {max(layers) + 1} layers (model.layers.*), but "
                          f"--config {config} says {cfg.num_hidden_layers} + {cfg.num_nextn_predict_layers} NEXTN")


def build_report(args) -> dict:
    """Everything ``analyze`` prints, plots and writes, as one JSON-able dict."""
    bw, source = _bandwidth(args)
    for name in ("tpot", "tpot_fp8_head", "accept_length", "verify_cost", "peak_tflops"):
        v = getattr(args, name)
        if v is not None and not (v > 0 and v != float("inf")):
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    if args.draft_tokens < 1 or args.draft_steps < 0:
        raise ConfigError("--draft-tokens must be >= 1 and --draft-steps >= 0")
    own = {f: getattr(args, k) for k, f in MEASURED_FLAGS.items() if getattr(args, k) is not None}
    s = replace(sd.SeedInputs(), **own, bandwidth_gbs=bw, peak_flops=args.peak_tflops * 1e12,
                verify_cost=args.verify_cost, draft_tokens=args.draft_tokens, contexts=parse_context(args.context))
    led = ex = note = None
    seed_model = False
    config = resolve_config(args.config, args.checkpoint)
    if config is not None:
        from bytebound.config import LingConfig
        cfg = LingConfig.from_file(config)
        if args.checkpoint:
            specs = specs_from_safetensors(args.checkpoint)
            _check_specs_match(specs, cfg, config, args.checkpoint)
            led = ledger_from_specs(cfg, specs)
        else:
            led = build_ledger(cfg)
        seed_model = is_seed_model(cfg)
        measured = sd.MEASURED if seed_model else tuple(own)
        ex = exact_values(led, s, args.draft_steps, measured)
        note = _reference_note(s, measured, config)
    elif args.checkpoint:
        raise ConfigError("--checkpoint needs --config (the layer kinds and routing come from it)")
    sv = sd.seed_report(s)
    return {
        "inputs": {**asdict(s), "draft_steps": args.draft_steps, "bandwidth_source": source,
                   "config": None if config is None else str(config),
                   "checkpoint": args.checkpoint},
        "seed": sd.as_json(sv), "exact": ex,
        # whether the exact column's model is the one the seed measured, and what was left out if not
        "reference_points": {"seed_model": seed_model, "note": note},
        "ledger": None if led is None else {"bf16_head": led.to_json(), "fp8_head": led.with_head("fp8").to_json()},
        "rows": _rows(sv, ex, s),
    }


def render(report: dict, console=None, detail: bool = False):
    """Print the side-by-side table (and the exact ledger by group) with rich; returns the console. Without a
    ``console``, stdout's: a terminal's width, or where stdout is not a terminal (``analyze > file``), the width
    of the widest table, so that no row is folded (rich's default there is 80 columns, or ``COLUMNS``)."""
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table
    tables = []
    t = Table(title="bytes per decode step: seed mode vs exact ledger (batch 1)")
    for col, just in (("quantity", "left"), ("seed mode", "right"), ("exact ledger", "right"), ("unit", "left"),
                      ("seed §", "left")):
        t.add_column(col, justify=just)
    for r in report["rows"]:
        t.add_row(*r)
    tables.append(t)
    if report["ledger"]:
        g = Table(title="exact ledger by tensor group (one decode step)")
        for col in ("group", "params (M)", "BF16 head (MB)", "FP8 head (MB)", "share (BF16 head)"):
            g.add_column(col, justify="left" if col == "group" else "right")
        a, b = report["ledger"]["bf16_head"], report["ledger"]["fp8_head"]
        for name, v in a["groups"].items():
            g.add_row(name, f"{v['params'] / 1e6:.2f}", f"{v['bytes'] / 1e6:.1f}",
                      f"{b['groups'][name]['bytes'] / 1e6:.1f}", f"{100 * v['bytes'] / a['bytes_per_step']:.1f} %")
        g.add_row("total", f"{a['active_params'] / 1e6:.1f}", f"{a['bytes_per_step'] / 1e6:.1f}",
                  f"{b['bytes_per_step'] / 1e6:.1f}", "100 %")
        tables.append(g)
    if detail and report["ledger"]:
        d = Table(title="exact ledger, every tensor kind (BF16 head; FP8 head: lm_head fp8_channel)")
        for col in ("tensor", "shape [N, K]", "format", "copies/step", "payload (MB)", "scales (MB)"):
            d.add_column(col, justify="left" if col in ("tensor", "format") else "right")
        for it in report["ledger"]["bf16_head"]["items"]:
            d.add_row(it["name"], "x".join(map(str, it["shape"])), it["fmt"], f"{it['count']:g}",
                      f"{it['payload_bytes'] / 1e6:.3f}", f"{it['scale_bytes'] / 1e6:.3f}")
        tables.append(d)
    con = console or Console()
    if console is None and not con.is_terminal:
        unbounded = con.options.update_width(1 << 16)
        need = max(Measurement.get(con, unbounded, x).maximum for x in tables)
        con = Console(width=max(con.width, need))
    con.print(tables[0])
    if report["reference_points"]["note"]:
        con.print(report["reference_points"]["note"], markup=False, highlight=False)
    for x in tables[1:]:
        con.print(x)
    return con


def run(args) -> int:
    """Run ``analyze``; returns the exit code (2 on a named error, printed to stderr)."""
    try:
        rep = build_report(args)
    except ByteboundError as e:
        print(f"bytebound analyze: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    render(rep, detail=getattr(args, "detail", False))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1))
    if args.plots:
        from bytebound.analysis.plots import save_all
        for f in save_all(rep, args.plots):
            print(f"wrote {f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bytebound")
    add_parser(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(["analyze", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
