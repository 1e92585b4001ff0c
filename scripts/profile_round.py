"""Where an MTP round's time goes at full scale: each phase of the round body captured in a CUDA graph of its own
and timed, the whole captured round, the host's share, and the plain decode step beside it, in one process.

Phases (as :meth:`bytebound.speculative.round.StaticRound._body` runs them): the NEXTN draft-extend over ``k + 1``
positions with the first draft's head; the ``k - 1`` further draft steps (one NEXTN layer and one head each, also
timed alone); the ``k + 1``-token verify; its LM head and the acceptance; the KDA rollback (``commit_state``), as
the difference of two graphs (verify + head + accept with and without it). Then the captured round itself:
its replay timed by CUDA events, the host time of one ``replay()`` call (the graph launch), ``step()`` (launch,
the one host read, the bookkeeping) in a loop, and pipelined rounds (``StaticRound.rounds`` with ``pipelined``:
each round launched before the host reads the one before it), per round from read to read. Graph walls are CUDA
event medians; "summed" is the profiler's kernel time inside the graph, which with PDL counts a kernel's early
wait too.

Weights are synthetic (``--load-format dummy``: random values at the real shapes; drafts are almost never
accepted, which does not change the cost of a static round). CUDA only. Writes ``NAME.json`` and ``NAME.md``.

    python3 scripts/profile_round.py --ctx 2048 --draft-vocab 32768 --out $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bytebound.analysis.bandwidth import cuda_event_times  # noqa: E402
from bytebound.analysis.kernels import kernel_table  # noqa: E402
from bytebound.bench.ab import alternating_times, env_applied  # noqa: E402
from bytebound.config import LING3_FLASH_CONFIG  # noqa: E402
from bytebound.engine.engine import Engine, EngineConfig  # noqa: E402
from bytebound.runner.graphs import capture_decode, capture_graph  # noqa: E402
from bytebound.sampling import SamplingParams  # noqa: E402
from bytebound.speculative.accept import accept_greedy  # noqa: E402
from bytebound.speculative.mtp import SpecStats  # noqa: E402


def median_us(fn, reps: int) -> float:
    return statistics.median(cuda_event_times(fn, reps, warmup=3)) * 1e6


def phase_fns(eng, span):
    """The round body split into its phases (closures over one dict of intermediate tensors), after one full
    run so that every phase has its inputs. The runner must have a begun verify (``begin_verify``)."""
    r, dr, rnd = eng.runner, eng.drafter, eng.spec_round
    k, ar, pos, S = rnd.k, rnd.ar, eng.runner.pos_buf, {}

    def extend():
        eh = dr.hidden(rnd.ext_ids, rnd.ext_hidden, pos - rnd.j - 1 + ar, r.state, span)
        S["dh"] = eh.index_select(0, rnd.j.view(1))
        S["d0"] = dr.propose(S["dh"])

    def drafts():
        dh, ds = S["dh"], [S["d0"]]
        for i in range(1, k):
            dh = dr.hidden(ds[-1], dh, (pos + (i - 1)).view(1), r.state, span)
            ds.append(dr.propose(dh))
        S["d"] = torch.cat(ds)

    def nextn_layer():
        dr.hidden(S["d0"], S["dh"], pos.view(1), r.state, span)

    def propose():
        dr.propose(S["dh"])

    def verify():
        S["vh"] = r.verify(torch.cat([rnd.y, S["d"]]), pos + ar, span)

    def head_accept():
        S["j"], _ = accept_greedy(r.model.lm_head.argmax(S["vh"]), S["d"])     # as the greedy round body

    def verify_head():
        verify()
        head_accept()

    def verify_head_commit():
        verify_head()
        r.commit_state(S["j"])

    def whole():
        extend()
        drafts()
        verify_head_commit()
    extend()
    drafts()
    verify_head_commit()
    return [("draft-extend (k+1 positions) + first draft's head", extend),
            ("draft steps 2..k", drafts), ("one NEXTN layer, 1 position", nextn_layer),
            ("one draft head (propose)", propose), ("verify, k+1 tokens", verify),
            ("verify + LM head + acceptance", verify_head), ("verify + head + acceptance + KDA rollback",
                                                             verify_head_commit),
            ("all phases in one graph", whole)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(LING3_FLASH_CONFIG), help="model config (dummy weights)")
    ap.add_argument("--ctx", type=int, default=2048, help="committed length the round runs at")
    ap.add_argument("--steps", type=int, default=3, help="MTP draft steps k")
    ap.add_argument("--draft-vocab", default=None,
                    help="hot-vocabulary draft head: N (the first N ids; with random weights which rows are hot "
                         "does not change the cost) or a JSON id list; default: the full head")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of the step() and pipelined loops")
    ap.add_argument("--no-phases", action="store_true", help="skip the phases captured alone (an A/B run)")
    ap.add_argument("--token-ab", action="store_true",
                    help="also time the plain greedy step with the fused head argmax on and off, alternately")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--name", default="profile_round")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_round.py times captured CUDA graphs: it needs a CUDA device")
    dv = a.draft_vocab
    if dv is not None and dv.isdigit():
        path = Path("/tmp") / f"hot{dv}.json"
        path.write_text(json.dumps(list(range(int(dv)))))
        dv = str(path)
    eng = Engine(EngineConfig(model=a.config, load_format="dummy", device="cuda", lm_head="fp8",
                              speculative_steps=a.steps, draft_vocab=dv, max_model_len=a.ctx + 8 * a.rounds + 64))
    r, rnd, k = eng.runner, eng.spec_round, a.steps
    if rnd is None or not rnd.graphs:
        raise SystemExit("the engine has no captured MTP round (round=static, graphs=captured are needed)")
    for st in r.state:
        if hasattr(st, "kv"):
            st.kv.normal_()
    out = {"device": torch.cuda.get_device_name(), "date": dt.date.today().isoformat(),
           "commit": os.environ.get("BYTEBOUND_COMMIT", "unknown"), "weights": "synthetic (dummy)",
           "config": a.config, "ctx": a.ctx, "steps": k, "draft_vocab": a.draft_vocab or "full head",
           "command": " ".join(["python3", "scripts/profile_round.py", *(argv if argv is not None else sys.argv[1:])]),
           "phases": []}
    with torch.inference_mode():
        r.reset(a.ctx)
        r.begin_verify(k)
        span = rnd.span()
        g = rnd.graphs[span]
        out["round_graph_us"] = median_us(g.replay, 30)
        rows, tot = kernel_table(g.replay, 5, True)
        out["round_graph_kernels"] = tot["kernels"]
        out["round_graph_top"] = rows[:20]
        torch.cuda.synchronize()
        launches = []
        for _ in range(20):
            t0 = time.perf_counter()
            g.replay()
            launches.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        out["replay_host_launch_us"] = statistics.median(launches) * 1e6
        for name, fn in ([] if a.no_phases else phase_fns(eng, span)):
            pg, _ = capture_graph(fn, 2)
            _, ptot = kernel_table(pg.replay, 5, True)
            out["phases"].append({"phase": name, "graph_us": median_us(pg.replay, 30), "kernels": ptot["kernels"],
                                  "summed_kernel_us": ptot["kernel_us"]})
            del pg
        r.commit_length(0)
        # the loops as the engine runs them: step() (unpipelined) and rounds(pipelined=True)
        for label, pipelined in (("step_loop", False), ("pipelined_loop", True)):
            r.reset(a.ctx)
            rnd.seed(rnd.ext_ids[:1].clone(), rnd.ext_hidden[:1].clone(), a.ctx - 1, rnd.y.clone())
            stats, n, reads = SpecStats(k), 0, []
            torch.cuda.synchronize()
            for _, rid in rnd.rounds(stats, pipelined=pipelined):
                if rid != n:
                    n = rid
                    reads.append(time.perf_counter())
                if n > a.rounds:
                    break
            gaps = [b - c for b, c in zip(reads[2:], reads[1:-1])]
            out[label] = {"per_round_us": statistics.median(gaps) * 1e6, "rounds": len(gaps),
                          "pipelined_rounds": stats.pipelined}
        r.reset(a.ctx)
        capture_decode(r, tokens=True)
        tok = torch.tensor([17], device="cuda")
        out["decode_graph_plus_head_us"] = median_us(lambda: r.model.logits(r.graph.replay(tok, a.ctx)), 30)
        # the engine's greedy plain step: the decode graph, then the head + argmax token graph
        greedy = SamplingParams(temperature=0.0)
        out["decode_token_us"] = median_us(lambda: r.graph.replay_token(tok, a.ctx, greedy, None), 30)
        # c with its denominator timed beside it: the round graph and the plain step alternately, the order rotated
        # each rotation. The round and the step above are timed minutes apart, and between processes the step has
        # moved by 150 us while the round held (docs/perf/session26-h100-ring/), so this c is the one to compare
        reps, rots = 10, 6
        tr, tp = alternating_times([g.replay, lambda: r.graph.replay_token(tok, a.ctx, greedy, None)], reps, rots,
                                   warmup=3)
        per_rot = [statistics.median(tr[i * reps:(i + 1) * reps]) / statistics.median(tp[i * reps:(i + 1) * reps])
                   for i in range(rots)]
        out["alternating"] = {"round_us": statistics.median(tr) * 1e6, "plain_us": statistics.median(tp) * 1e6,
                              "c": statistics.median(tr) / statistics.median(tp), "c_per_rotation": per_rot,
                              "reps": reps, "rotations": rots}
        if a.token_ab:
            # the plain greedy step with the head's argmax fused (BYTEBOUND_HEAD_ARGMAX=1) and not (=0), each its own
            # captured graphs in this process, timed alternately
            graphs = {}
            for v in ("1", "0"):
                with env_applied({"BYTEBOUND_HEAD_ARGMAX": v}):
                    r.reset(a.ctx)
                    graphs[v] = capture_decode(r, tokens=True)
            ts = alternating_times([lambda gr=gr: gr.replay_token(tok, a.ctx, greedy, None) for gr in graphs.values()],
                                   20, 5, warmup=3)
            out["token_ab_us"] = {f"BYTEBOUND_HEAD_ARGMAX={v}": statistics.median(t) * 1e6 for v, t in zip(graphs, ts)}
    dec = out["decode_token_us"]
    md = [f"# MTP round phases: {out['device']}, {out['date']}, commit {out['commit']}, {out['weights']}, "
          f"ctx {a.ctx}, k = {k}, draft head: {out['draft_vocab']}", "", f"Command: `{out['command']}`", "",
          "| phase (each captured alone) | graph wall [us] | kernels | summed kernel time in the graph [us] |",
          "|---|---:|---:|---:|"]
    md += [f"| {p['phase']} | {p['graph_us']:.1f} | {p['kernels']:.0f} | {p['summed_kernel_us']:.1f} |"
           for p in out["phases"]]
    sl, pl = out["step_loop"], out["pipelined_loop"]
    md += ["", "| the round as the engine runs it | us | c = / plain step |", "|---|---:|---:|",
           f"| captured round, replay (CUDA events), {out['round_graph_kernels']:.0f} kernels | "
           f"{out['round_graph_us']:.1f} | {out['round_graph_us'] / dec:.3f} |",
           f"| host time of one `replay()` call (the graph launch) | {out['replay_host_launch_us']:.1f} | |",
           f"| `step()` loop, per round (read to read, {sl['rounds']} rounds) | {sl['per_round_us']:.1f} | "
           f"{sl['per_round_us'] / dec:.3f} |",
           f"| pipelined rounds, per round (read to read, {pl['rounds']} rounds, {pl['pipelined_rounds']} launched "
           f"ahead) | {pl['per_round_us']:.1f} | {pl['per_round_us'] / dec:.3f} |",
           f"| plain greedy step: decode graph + head/argmax token graph (CUDA events; the c denominator) | "
           f"{dec:.1f} | 1 |",
           f"| decode graph + eager LM head logits (the denominator before the twentieth session) | "
           f"{out['decode_graph_plus_head_us']:.1f} | |"]
    al = out["alternating"]
    md += [f"| **alternating, same process**: round graph / plain greedy step ({al['rotations']} rotations x "
           f"{al['reps']} replays each; c per rotation {min(al['c_per_rotation']):.3f}-"
           f"{max(al['c_per_rotation']):.3f}) | {al['round_us']:.1f} / {al['plain_us']:.1f} | **{al['c']:.3f}** |"]
    md += [f"| plain greedy step, {k} (same process, alternating) | {v:.1f} | |"
           for k, v in out.get("token_ab_us", {}).items()] + [""]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"{a.name}.json").write_text(json.dumps(out, indent=1))
    (Path(a.out) / f"{a.name}.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
