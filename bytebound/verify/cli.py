"""``bytebound verify``: start an engine, run the start-up canaries, print the manifest.

Exit status: 0 healthy; 1 a canary failed or a requested lever did not resolve (stderr names the lever and the
measured values); 2 the engine could not start (bad checkpoint / unusable backend / VerificationError with
``--strict``), a bad flag, or the ``--watch-tokens`` generation was refused. ``--draft-share weight-only`` is a
test-only reproduction of the seed's silent fallback (the draft shares only the LM head's weight tensor);
verification must refuse it.
"""
# (This docstring is the command's --help description. Other commands, bench and serve, reuse add_verify_args /
# apply_verify_args for --strict and the watchdog flags.)

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path


def add_verify_args(p: argparse.ArgumentParser, strict_default: bool = False) -> None:
    """``--strict/--no-strict``, ``--no-canaries``, watchdog window and threshold (bench: strict by default)."""
    p.add_argument("--strict", dest="strict", action="store_true", default=strict_default,
                   help="abort when a requested lever did not resolve, a canary fails or the watchdog fires"
                        + (" (default)" if strict_default else ""))
    p.add_argument("--no-strict", dest="strict", action="store_false", help="warn loudly instead of aborting")
    p.add_argument("--no-canaries", action="store_true", help="skip the start-up canaries (manifest only)")
    p.add_argument("--watchdog-window", type=int, default=64, help="accept-length watchdog: rounds in the window")
    p.add_argument("--watchdog-threshold", type=float, default=1.05,
                   help="accept-length watchdog: alarm at or below this rolling accept length")


def check_verify_args(a) -> None:
    """Reject bad watchdog flags before the engine loads (the watchdog itself only exists with MTP, so a bad
    value would otherwise pass silently without it, or fail as a bare ValueError inside Engine with it)."""
    from bytebound.errors import ConfigError
    if a.watchdog_window < 1:
        raise ConfigError(f"--watchdog-window must be >= 1 verify rounds, got {a.watchdog_window}")
    if not 0 <= a.watchdog_threshold < math.inf:
        raise ConfigError(f"--watchdog-threshold must be a finite accept length >= 0, got {a.watchdog_threshold}")
    if getattr(a, "watch_tokens", 0) < 0:
        raise ConfigError(f"--watch-tokens must be >= 0, got {a.watch_tokens}")


def apply_verify_args(cfg, a):
    """EngineConfig with the verify flags of ``a`` applied (canaries run inside Engine.__init__).

    Raises:
        ConfigError: a bad watchdog flag (:func:`check_verify_args`).
    """
    check_verify_args(a)
    return dataclasses.replace(cfg, verify=not a.no_canaries, strict=a.strict, watchdog_window=a.watchdog_window,
                               watchdog_threshold=a.watchdog_threshold)


def add_parser(sub) -> None:
    from bytebound.cli import add_engine_args
    from bytebound.helptext import plain_doc
    p = sub.add_parser("verify", help="start the engine, run the start-up canaries and print the manifest",
                       description=plain_doc(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    add_verify_args(p)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the manifest as JSON here")
    p.add_argument("--draft-share", default="module", choices=["module", "weight-only"],
                   help="TEST ONLY: 'weight-only' reproduces the seed's silent fallback (the draft shares only the "
                        "LM-head weight tensor); verification must refuse it")
    p.add_argument("--watch-tokens", type=int, default=0, metavar="N",
                   help="after start-up, generate N greedy tokens on a short prompt feeding the accept-length "
                        "watchdog, and report it (MTP only: needs --speculative-algorithm NEXTN)")
    p.set_defaults(fn=cmd_verify)


def cmd_verify(a) -> int:
    from bytebound.cli import engine_config
    from bytebound.engine.engine import Engine
    from bytebound.errors import ByteboundError, ConfigError
    from bytebound.verify.canaries import CANARY_PROMPT, failure_message, run_canaries
    from bytebound.verify.manifest import build_manifest, print_manifest
    from bytebound.verify.watchdog import AcceptLengthAlarm
    check_verify_args(a)
    if a.watch_tokens >= a.max_model_len:   # cannot fit with any prompt: say so before loading the model
        raise ConfigError(f"--watch-tokens {a.watch_tokens} does not fit --max-model-len {a.max_model_len}")
    # The engine builds a drafter exactly when MTP is on (EngineConfig.speculative_steps > 0), which only
    # --speculative-algorithm NEXTN sets (engine_config); without it the watch run would be skipped silently.
    if a.watch_tokens and a.speculative_algorithm != "NEXTN":
        raise ConfigError("--watch-tokens needs MTP (--speculative-algorithm NEXTN): the watchdog watches the "
                          "accept length")
    cfg = dataclasses.replace(engine_config(a), draft_share=a.draft_share, verify=False, strict=a.strict,
                              watchdog_window=a.watchdog_window, watchdog_threshold=a.watchdog_threshold)
    t0 = time.perf_counter()
    try:
        eng = Engine(cfg)
    except ByteboundError as e:
        print(f"[bytebound verify] engine did not start: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    if not a.no_canaries:
        try:
            run_canaries(eng, strict=a.strict, warn=False)
        except ByteboundError as e:
            print(f"[bytebound verify] {e}", file=sys.stderr)
            eng.canaries = getattr(e, "results", None)
            _dump(a.json, build_manifest(eng), load_s)
            return 2
    if a.watch_tokens:      # MTP is on here (checked above from the flags; the engine refuses NEXTN without a drafter)
        from bytebound.sampling import SamplingParams
        prompt = CANARY_PROMPT if eng.tokenizer is not None else list(range(1, 33))
        try:
            eng.generate(prompt, SamplingParams(max_tokens=a.watch_tokens, ignore_eos=True))
        except AcceptLengthAlarm as e:   # --strict watchdog: the manifest below reports it (degraded, exit 1)
            print(f"[bytebound verify] {type(e).__name__}: {e}", file=sys.stderr)
        except ByteboundError as e:      # the watch run itself is invalid (e.g. does not fit --max-model-len)
            print(f"[bytebound verify] --watch-tokens {a.watch_tokens}: {type(e).__name__}: {e}", file=sys.stderr)
            _dump(a.json, build_manifest(eng), load_s)
            return 2
    man = build_manifest(eng)
    man["load_seconds"] = round(load_s, 3)
    print_manifest(man)
    _dump(a.json, man, load_s)
    bad = [f for f in (eng.canaries or []) if f.passed is False]
    if bad:
        print(f"[bytebound verify] {failure_message(bad)}", file=sys.stderr)
    if man["problems"] and not bad:
        for p in man["problems"]:
            print(f"[bytebound verify] lever {p['lever']} did not resolve: {p['message']}", file=sys.stderr)
    if man["watchdog"] and man["watchdog"]["alarm"]:
        print(f"[bytebound verify] {eng.watchdog.message()}", file=sys.stderr)
    return 1 if man["status"] == "degraded" else 0


def _dump(path, man, load_s) -> None:
    if path:
        man = dict(man, load_seconds=round(load_s, 3))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(man, indent=2) + "\n")
