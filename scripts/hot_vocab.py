"""Hot-vocabulary draft head (issue 21): build the token-frequency ranking, and price it against accept length.

``build``: count the completion tokens of the bundled GSM8K train split with the checkpoint's tokenizer
(``bytebound.speculative.hot_vocab.build_ranking``) and write ``MODEL/draft_vocab.json`` (ranking, counts,
provenance: corpus and tokenizer SHA-256). The engine reads it for ``--speculative-draft-vocab N|COVERAGE``.

``accept``: greedy MTP over the first ``--limit`` GSM8K test questions (chat prompts) with the full draft head and
with each hot-set size in ``--sizes`` (a count N or a coverage in (0, 1)); checks that every speculative output
equals plain greedy token for token, and reports the accept length of each against the byte saving per draft
step: the bound model's head bytes x (1 - N/V), and the same ratio priced on the full-scale ledger
(``bytebound analyze``: Ling-3.0-flash, FP8 head), where c = round bytes / plain-step bytes and S = a / c assume
a bandwidth-bound step (the ledger's model, not a measured time). Writes ``--out/NAME.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bytebound.speculative.hot_vocab import RANKING_FILE, build_ranking  # noqa: E402

FULL_CONFIG = ROOT / "bytebound" / "assets" / "configs" / "ling-3.0-flash.json"
STEPS = 3


def cmd_build(a) -> int:
    from bytebound.config import LingConfig
    from bytebound.engine.tokenizer import Tokenizer
    model = Path(a.model)
    cfg = LingConfig.from_file(str(model))
    rec = build_ranking(model, Tokenizer.from_dir(model), cfg.vocab_size)
    out = Path(a.out) if a.out else model / RANKING_FILE
    out.write_text(json.dumps(rec, separators=(",", ":")) + "\n", encoding="utf-8")
    prov = rec["provenance"]
    print(f"wrote {out}: {prov['distinct_tokens_seen']} of {cfg.vocab_size} tokens seen in "
          f"{prov['tokens_counted']} counted")
    return 0


def full_scale_pricing(share: float, accept: float | None) -> dict:
    """Round bytes with the hot head at ``share`` = N/V of the FP8 head, on the Ling-3.0-flash ledger."""
    from bytebound.analysis.ledger import build_ledger
    from bytebound.config import LingConfig
    led = build_ledger(LingConfig.from_file(str(FULL_CONFIG)), head="fp8")
    plain, head = led.bytes, led.head_bytes
    verify, draft = led.verify_bytes(STEPS + 1), led.draft_step_bytes()
    hot_draft = draft - head * (1.0 - share)
    c_full = (verify + STEPS * draft) / plain
    c_hot = (verify + STEPS * hot_draft) / plain
    out = {"head_bytes_fp8": head, "draft_step_bytes_full": draft, "draft_step_bytes_hot": hot_draft,
           "saved_bytes_per_draft_step": head * (1.0 - share), "round_bytes_full": verify + STEPS * draft,
           "round_bytes_hot": verify + STEPS * hot_draft, "c_full": c_full, "c_hot": c_hot}
    if accept is not None:
        out["S_hot_at_measured_a"] = accept / c_hot
    return out


def cmd_accept(a) -> int:
    from bytebound.bench.report import git_commit
    from bytebound.data.gsm8k import load_split
    from bytebound.engine.engine import Engine, EngineConfig
    from bytebound.sampling import SamplingParams
    from bytebound.speculative.mtp import SpecStats
    qs = [r["question"] for r in load_split("test")[: a.limit]]
    greedy = SamplingParams(max_tokens=a.max_tokens)
    common = dict(model=a.model, lm_head=a.lm_head, max_model_len=1024)
    plain = Engine(EngineConfig(**common))
    t0 = time.perf_counter()
    want = [plain.generate(q, greedy, chat=True)[0].token_ids for q in qs]
    rows = []
    for size in [None] + a.sizes:
        spec = Engine(EngineConfig(**common, speculative_steps=STEPS, draft_vocab=size))
        tot = SpecStats(STEPS)
        mism = []
        for i, q in enumerate(qs):
            out = spec.generate(q, greedy, chat=True)[0]
            if out.token_ids != want[i]:
                mism.append(i)
            s = out.spec
            tot.rounds += s["rounds"]
            tot.committed += s["committed"]
        hot = spec.drafter.hot
        head = spec.model.lm_head
        v = spec.model.cfg.vocab_size
        n = hot.n if hot is not None else v
        row = {"draft_vocab": size, "n": n, "share": n / v, "accept_length": tot.accept_length,
               "rounds": tot.rounds, "committed": tot.committed, "greedy_mismatches": mism,
               "head_bytes": head.bytes_per_call(),
               "draft_head_bytes": hot.bytes_per_call() if hot is not None else head.bytes_per_call(),
               "coverage": hot.provenance.get("coverage") if hot is not None else 1.0}
        row["full_scale"] = full_scale_pricing(n / v, tot.accept_length)
        rows.append(row)
        print(f"N={n:>6} ({n / v:6.1%} of V, coverage {row['coverage']}): accept length {tot.accept_length:.3f} "
              f"over {tot.rounds} rounds, greedy mismatches {len(mism)}, draft head "
              f"{row['draft_head_bytes'] / 1e6:.3f} MB of {row['head_bytes'] / 1e6:.3f} MB; full scale "
              f"c {row['full_scale']['c_full']:.3f} -> {row['full_scale']['c_hot']:.3f}", flush=True)
    a_full = rows[0]["accept_length"]
    rec = {"what": "hot-vocabulary draft head: greedy accept length vs draft-step head bytes (bundled model, CPU)",
           "date": dt.date.today().isoformat(), "commit": git_commit(), "model": a.model, "lm_head": a.lm_head,
           "prompts": len(qs), "max_tokens": a.max_tokens, "steps": STEPS, "seconds": time.perf_counter() - t0,
           "rows": rows,
           "full_scale_reference": {"config": str(FULL_CONFIG.relative_to(ROOT)), "head": "fp8",
                                    "note": "bytes ledger (bandwidth-bound model); S = a / c with the bundled "
                                            "model's measured a, not a measured time",
                                    "issue_example_32768": full_scale_pricing(32768 / 157184, a_full)}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out / (a.name + '.json')}")
    return 1 if any(r["greedy_mismatches"] for r in rows) else 0


def _size(s: str):
    v = float(s)
    return int(v) if v.is_integer() else v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write MODEL/draft_vocab.json")
    b.add_argument("--model", default=str(ROOT / "models" / "ling-nano"))
    b.add_argument("--out", default=None, help="default: MODEL/draft_vocab.json")
    m = sub.add_parser("accept", help="greedy accept length with and without the hot head")
    m.add_argument("--model", default=str(ROOT / "models" / "ling-nano"))
    m.add_argument("--limit", type=int, default=30)
    m.add_argument("--max-tokens", type=int, default=96)
    m.add_argument("--lm-head", default="bf16")
    m.add_argument("--sizes", type=_size, nargs="+", default=[0.99, 2048, 1024])
    m.add_argument("--out", default=str(ROOT / "out" / "hot_vocab"))
    m.add_argument("--name", default="hot-vocab-accept-nano")
    a = ap.parse_args()
    return cmd_build(a) if a.cmd == "build" else cmd_accept(a)


if __name__ == "__main__":
    raise SystemExit(main())
