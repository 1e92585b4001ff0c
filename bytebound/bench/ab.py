"""Same-process A/B helpers for the kernel benchmarks (``scripts/profile_decode.py --ab``,
``scripts/profile_round.py --token-ab``, ``scripts/bench_router.py``, ``scripts/bench_head.py``): environment
settings (the engine's A/B switches are environment variables read at each call or capture), applied around a
capture and restored after it, and device times of several variants taken in alternating order, so a drift of the
machine (clocks, temperature) hits every variant alike."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
from pathlib import Path

import torch

from bytebound.analysis.bandwidth import cuda_event_times
from bytebound.bench.report import git_commit

# read once at import (kernels.pdl, Triton): setting them between captures would change nothing
AB_IMPORT_TIME = ("BYTEBOUND_PDL", "TRITON_INTERPRET")


def ab_settings(setting: str) -> dict[str, str]:
    """``"VAR=VALUE[;VAR=VALUE]"`` (';' between variables: a value may hold commas, as ``BYTEBOUND_PDL_PREFETCH``
    does) -> ``{VAR: VALUE}``; an empty setting (``""``) is the unchanged environment, a baseline. Raises
    SystemExit for a part without ``=`` or a variable read only at import (:data:`AB_IMPORT_TIME`)."""
    out = {}
    for kv in filter(None, (p.strip() for p in setting.split(";"))):
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise SystemExit(f"--ab {setting!r}: {kv!r} is not VAR=VALUE")
        if k in AB_IMPORT_TIME:
            raise SystemExit(f"--ab {setting!r}: {k} is read once at import; run a separate process for it")
        out[k] = v
    return out


@contextlib.contextmanager
def env_applied(values: dict[str, str]):
    """The environment with ``values`` set for the duration of the ``with`` block, exactly as it was afterwards
    (variables it did not have are removed again)."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def alternating_times(fns: list, reps: int, rounds: int, per: int = 1, warmup: int = 2) -> list[list[float]]:
    """Device times [s] of each callable in ``fns`` (e.g. CUDA graph replays), ``reps`` per round, ``rounds`` rounds
    with the order rotated by one each round; each time divided by ``per`` (calls inside one callable). Returns one
    list of ``reps * rounds`` times per callable, in ``fns``' order."""
    times: list[list[float]] = [[] for _ in fns]
    n = len(fns)
    for rnd in range(rounds):
        for i in [(rnd + j) % n for j in range(n)]:
            times[i] += [t / per for t in cuda_event_times(fns[i], reps, warmup)]
    return times


def run_meta(script: str, weights: str, **extra) -> dict:
    """The header every A/B script records and prints first: device, UTC date, commit (``BYTEBOUND_COMMIT`` where
    the checkout has no git), weights and the command line, plus ``extra`` (its repetition counts)."""
    meta = {"device": torch.cuda.get_device_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": os.environ.get("BYTEBOUND_COMMIT") or git_commit(), "weights": weights,
            "command": " ".join(sys.argv), **extra}
    print(f"{script}: {meta['device']}, {meta['date']}, commit {meta['commit']}, {weights} weights")
    return meta


def write_rows(out_dir: str, name: str, meta: dict, rows: list[dict]) -> None:
    """``<out_dir>/<name>.json`` = the header and the rows; prints its path."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"{name}.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"wrote {path}")
