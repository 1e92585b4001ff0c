"""Kernel table of one decode step and one verify forward, built through ``Engine`` as ``bytebound generate`` runs.

For each GPU kernel: calls per step, device microseconds per step and per call, sorted by time; plus the totals
(kernels per step, summed kernel time) and the step's wall time from CUDA events. The decode step is one replay
of the captured decode graph plus the LM head (as the engine runs it); the verify is the eager ``M``-token
forward of the MTP round (``runner.verify``) plus its head, at the same context. torch.profiler with CUDA
activity; kernel names are truncated to 90 characters.

Weights are synthetic (``--load-format dummy``: random values at the real shapes): speed only. Writes
``NAME.json`` and ``NAME.md`` under ``--out``. CPU runs smoke-test the script (CPU op table instead).

    python3 scripts/profile_decode.py --ctx 2048 --verify-m 4 --out $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bytebound.analysis.bandwidth import cuda_event_times  # noqa: E402
from bytebound.analysis.kernels import kernel_table  # noqa: E402
from bytebound.bench.ab import ab_settings, env_applied  # noqa: E402
from bytebound.config import LING3_FLASH_CONFIG  # noqa: E402
from bytebound.engine.engine import Engine, EngineConfig  # noqa: E402
from bytebound.runner.graphs import capture_decode  # noqa: E402


def ab_walls(runner, tok, ctx: int, settings: list[str], rounds: int) -> dict[str, list[float]]:
    """Median wall (ms) of 30 replays of the decode graph (+ eager head) re-captured under each environment setting
    ``"VAR=VALUE[;VAR=VALUE]"`` (:func:`ab_settings`) in turn, ``rounds`` times (interleaved, so drift hits every
    setting alike). The environment is restored afterwards; the caller re-captures the graph under it."""
    parsed = {s: ab_settings(s) for s in settings}
    walls: dict[str, list[float]] = {s: [] for s in settings}
    for _ in range(rounds):
        for s in settings:
            with env_applied(parsed[s]):
                capture_decode(runner, tokens=False)
                step = lambda: runner.model.logits(runner.graph.replay(tok, ctx))      # noqa: E731
                w = sorted(cuda_event_times(step, 30, warmup=3))
                walls[s].append(w[len(w) // 2] * 1e3)
    return walls


def ncu_range(runner, tok, ctx: int, verify_m: int, device) -> int:
    """One eager decode step at ``ctx`` (then a marker kernel and one ``verify_m``-token verify with its rollback, if > 0) inside
    ``cudaProfilerStart/Stop``, after one untimed warm-up of each (the JIT compiles there, outside the range), so
    that ``ncu --profile-from-start off`` sees exactly those kernels, each launched on its own (no graph)."""
    ids = torch.full((max(verify_m, 1),), 17, device=device)

    def decode():
        runner.pos = ctx
        return runner.model.logits(runner.forward(tok))

    def verify():
        runner.reset(ctx)
        h = runner.verify(ids)
        runner.commit(verify_m - 1)
        return runner.model.logits(h)
    with torch.inference_mode():
        runner.graph = None
        runner.reset(ctx)
        decode()
        if verify_m:
            verify()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        decode()
        if verify_m:
            torch.cuda._sleep(1000)     # the marker kernel (spin_kernel) between the phases, for scripts/ncu_table.py
            verify()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print(f"ncu range done: decode at ctx {ctx}" + (f", verify of {verify_m} tokens" if verify_m else ""))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(LING3_FLASH_CONFIG), help="model config (dummy weights)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, default=2048, help="context length (cache positions) of the step")
    ap.add_argument("--verify-m", type=int, default=4, help="tokens of the profiled verify forward (0: none)")
    ap.add_argument("--steps", type=int, default=5, help="profiled repetitions (the table is per step)")
    ap.add_argument("--eager-decode", action="store_true",
                    help="also profile the decode step launched eagerly (each kernel's own duration, no PDL overlap)")
    ap.add_argument("--ab", nargs="+", default=[], metavar="VAR=VALUE[;VAR=VALUE]",
                    help="A/B the captured step's wall time over these environment settings in this process: each "
                         "is set, the decode graph re-captured and timed, in turns (--ab-rounds); '' is the "
                         "unchanged environment (e.g. BYTEBOUND_PDL_PREFETCH=router,kda BYTEBOUND_MLA_CFG='{...}')")
    ap.add_argument("--ab-rounds", type=int, default=3)
    ap.add_argument("--ncu-range", action="store_true",
                    help="for Nsight Compute (ncu --profile-from-start off): after a warm-up, one eager decode step "
                         "and one eager verify between cudaProfilerStart/Stop, then exit (no tables)")
    ap.add_argument("--top", type=int, default=40, help="rows in the markdown table")
    ap.add_argument("--backend", action="append", default=[], metavar="OP=NAME", help="backend override(s)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--name", default="profile_decode")
    a = ap.parse_args(argv)
    for s in a.ab:
        ab_settings(s)          # a bad setting fails before the model is built

    backends = dict(kv.split("=", 1) for kv in a.backend)
    eng = Engine(EngineConfig(model=a.config, load_format="dummy", device=a.device, lm_head="fp8",
                              backends=backends, max_model_len=a.ctx + 64))
    runner, cuda = eng.runner, eng.device.type == "cuda"
    for st in runner.state:
        if hasattr(st, "kv"):
            st.kv.normal_()
    tok = torch.tensor([17], device=eng.device)
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "date": dt.date.today().isoformat(),
                 "commit": os.environ.get("BYTEBOUND_COMMIT", "unknown"), "weights": "synthetic (dummy)",
                 "config": a.config, "ctx": a.ctx, "steps": a.steps,
                 "command": " ".join(["python3", "scripts/profile_decode.py", *sys.argv[1:]]),
                 "resolved": {k: v.resolved for k, v in eng.plan.resolutions.items()}}
    if a.ncu_range:
        if not cuda:
            raise SystemExit("--ncu-range profiles CUDA kernels: it needs --device cuda")
        return ncu_range(runner, tok, a.ctx, a.verify_m, eng.device)
    with torch.inference_mode():
        if cuda:
            capture_decode(runner, tokens=False)       # the table is of the step and the eager head
            step = lambda: runner.model.logits(runner.graph.replay(tok, a.ctx))            # noqa: E731
            wall = sorted(cuda_event_times(step, 30, warmup=2))
            out["decode_wall_ms"] = wall[len(wall) // 2] * 1e3
        else:
            runner.reset(a.ctx)
            step = lambda: runner.model.logits(runner.forward(tok))                          # noqa: E731
        rows, tot = kernel_table(step, a.steps, cuda)
        out["decode"] = {"totals": tot, "kernels": rows}
        if cuda and a.eager_decode:
            # The same step launched eagerly: the CPU's launch cost leaves the GPU idle between kernels, so each
            # kernel's duration is its own execution (in the graph, PDL lets a kernel start while its predecessor
            # runs, and its duration then includes that wait).
            graph, runner.graph = runner.graph, None

            def eager():
                runner.pos = a.ctx          # not reset(): its state fills would join the table
                return runner.model.logits(runner.forward(tok))
            rows, tot = kernel_table(eager, a.steps, cuda)
            out["decode_eager"] = {"totals": tot, "kernels": rows}
            runner.graph = graph
            del graph               # (else --ab's re-captures would keep this graph's memory pool alive)
        if cuda and a.ab:
            out["ab"] = ab_walls(runner, tok, a.ctx, a.ab, a.ab_rounds)
            capture_decode(runner, tokens=False)
        if a.verify_m:
            runner.graph = None
            ids = torch.full((a.verify_m,), 17, device=eng.device)

            def verify():
                runner.reset(a.ctx)
                h = runner.verify(ids)
                runner.commit(a.verify_m - 1)
                return runner.model.logits(h)
            if cuda:
                wall = sorted(cuda_event_times(verify, 10, warmup=2))
                out["verify_eager_wall_ms"] = wall[len(wall) // 2] * 1e3
            rows, tot = kernel_table(verify, a.steps, cuda)
            out["verify"] = {"m": a.verify_m, "totals": tot, "kernels": rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"{a.name}.json").write_text(json.dumps(out, indent=1))
    md = [f"# Kernel table: {out['device']}, {out['date']}, commit {out['commit']}, {out['weights']}, ctx {a.ctx}", "",
          f"Command: `{out['command']}`", ""]
    for part in ("decode", "decode_eager", "verify"):
        if part not in out:
            continue
        t = out[part]["totals"]
        # (the eager decode has no wall of its own: the CPU's launch gaps, not the GPU, set it)
        wall = out.get({"decode": "decode_wall_ms", "verify": "verify_eager_wall_ms"}.get(part, ""))
        md += [f"## {part}: {t['kernels']:.0f} kernels, {t['kernel_us'] / 1e3:.3f} ms summed"
               + (f", wall {wall:.3f} ms" if wall else ""), "", "| kernel | calls | us | us/call |", "|---|---:|---:|---:|"]
        md += [f"| `{r['name']}` | {r['calls']:.0f} | {r['us']:.1f} | {r['us_per_call']:.2f} |"
               for r in out[part]["kernels"][:a.top]]
        md.append("")
    if "ab" in out:
        md += ["## A/B of the captured step (median wall per round, ms)", "", "| setting | rounds | median |",
               "|---|---|---:|"]
        md += [f"| `{k}` | {' '.join(f'{w:.3f}' for w in v)} | {sorted(v)[len(v) // 2]:.3f} |"
               for k, v in out["ab"].items()]
        md.append("")
    (Path(a.out) / f"{a.name}.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
