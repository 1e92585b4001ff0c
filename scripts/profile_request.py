"""Where one request's wall time goes, host and device: GSM8K 5-shot requests on an engine (default the bundled
ling-nano on CUDA, the seed's sampling T 0.6 / top-p 0.95 / top-k 29), plain and with MTP.

For each mode it runs ``--requests`` questions untimed once (warm-up: graphs, compiles), then the same questions
timed, and prints per request TTFT, TPOT, the largest gap between two emitted tokens and where it fell, then one
request under ``torch.profiler`` with the engine's phases labelled (prefill, the prefill's sample, the NEXTN prefix
over the prompt, MTP round steps, plain forward / logits / sample, detokenisation): their host (CPU) time and call
counts, and the top host-side operators. It answers "why is TPOT above the step's graph time" and "what is the
one-off cost inside a request". JSON to ``--out``.

    python3 scripts/profile_request.py [--model models/ling-nano] [--requests 6] [--modes plain,mtp,adaptive]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = [  # (module path, attribute, label)
    ("bytebound.runner.runner", "ModelRunner.prefill", "prefill"),
    ("bytebound.runner.runner", "ModelRunner.forward", "plain.forward"),
    ("bytebound.runner.runner", "ModelRunner.logits", "logits"),
    ("bytebound.sampling", "sample", "sample"),
    ("bytebound.speculative.round", "StaticRound.start", "mtp.start (NEXTN over the prompt)"),
    ("bytebound.speculative.round", "StaticRound.seed", "mtp.seed"),
    ("bytebound.speculative.round", "StaticRound.step", "mtp.round step"),
    ("bytebound.speculative.round", "nextn_prefix", "nextn_prefix"),
    ("bytebound.speculative.adaptive", "nextn_prefix", "nextn_prefix (adaptive)"),
    ("bytebound.engine.tokenizer", "IncrementalDecoder.decode_stream", "detokenize"),
]


def _label(fn, label):
    import functools
    import torch

    @functools.wraps(fn)
    def wrapped(*a, **kw):
        with torch.profiler.record_function("phase: " + label):
            return fn(*a, **kw)
    return wrapped


def install_labels():
    """Wrap the engine's phase functions in ``record_function`` ranges (module-level names too, where a module
    imported the function by name)."""
    import importlib
    for mod_name, attr, label in PHASES:
        mod = importlib.import_module(mod_name)
        if "." in attr:
            cls_name, meth = attr.split(".")
            cls = getattr(mod, cls_name)
            setattr(cls, meth, _label(getattr(cls, meth), label))
        else:
            setattr(mod, attr, _label(getattr(mod, attr), label))
    # names bound by `from bytebound.sampling import sample`
    import bytebound.engine.engine as eng
    import bytebound.runner.runner as rn
    import bytebound.speculative.adaptive as ad
    import bytebound.speculative.round as rd
    import bytebound.sampling as sm
    for m in (eng, rn, ad, rd):
        if hasattr(m, "sample"):
            m.sample = sm.sample


def timed_stream(engine, ids, p):
    """Run one request through ``Engine.stream``; returns its output and the arrival time of every chunk."""
    t0 = time.perf_counter()
    arrivals, out = [], None
    for ch in engine.stream(ids, p):
        arrivals.append((time.perf_counter() - t0, len(ch.token_ids)))
        out = ch.output or out
    return out, arrivals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/ling-nano")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--modes", default="plain,mtp,adaptive")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from bytebound.bench.gsm8k import gsm8k_requests
    from bytebound.data.gsm8k import FEW_SHOT_STOP
    from bytebound.engine.engine import Engine, EngineConfig
    from bytebound.sampling import SamplingParams
    install_labels()
    recs = gsm8k_requests(args.requests + 1)      # the last one is profiled unseen (its prompt length is new)
    report = {"model": args.model, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "modes": {}}
    for mode in args.modes.split(","):
        kw = {} if mode == "plain" else {"speculative_steps": 3, "speculative_adaptive": mode == "adaptive"}
        t = time.perf_counter()
        eng = Engine(EngineConfig(model=args.model, device=args.device, **kw))
        print(f"== {mode}: engine started in {time.perf_counter() - t:.1f} s")
        prompts = [eng.encode_prompt(r["prompt"]) for r in recs]
        fresh = prompts.pop()

        def params(i):
            return SamplingParams(max_tokens=args.max_tokens, temperature=0.6, top_p=0.95, top_k=29, seed=i,
                                  stop=FEW_SHOT_STOP)
        for i, ids in enumerate(prompts):               # first pass: a one-off cost per prompt shows here
            out, _ = timed_stream(eng, ids, params(i))
            print(f"  first pass req {i}: P {len(ids)}, TTFT {out.ttft_s * 1e3:.1f} ms, TPOT {out.tpot_s * 1e3:.3f} ms")
        rows = []
        for i, ids in enumerate(prompts):
            out, arr = timed_stream(eng, ids, params(i))
            gaps = [(b[0] - a[0], k) for k, (a, b) in enumerate(zip(arr, arr[1:]))]
            gmax = max(gaps, default=(0.0, -1))
            rows.append({"prompt_tokens": len(ids), "tokens": out.completion_tokens, "ttft_ms": out.ttft_s * 1e3,
                         "tpot_ms": out.tpot_s * 1e3, "e2e_ms": out.e2e_s * 1e3,
                         "max_gap_ms": gmax[0] * 1e3, "max_gap_after_chunk": gmax[1],
                         "median_gap_ms": sorted(g for g, _ in gaps)[len(gaps) // 2] * 1e3 if gaps else None,
                         "accept_length": (out.spec or {}).get("accept_length")})
            r = rows[-1]
            print(f"  req {i}: P {r['prompt_tokens']}, {r['tokens']} tok, TTFT {r['ttft_ms']:.1f} ms, TPOT "
                  f"{r['tpot_ms']:.3f} ms, max gap {r['max_gap_ms']:.1f} ms after chunk {r['max_gap_after_chunk']}, "
                  f"median gap {r['median_gap_ms'] or 0:.3f} ms, accept {r['accept_length']}")
        # one request under the profiler, with a prompt (and length) this engine has not seen
        acts = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            out, _ = timed_stream(eng, fresh, params(len(prompts)))
            if args.device == "cuda":
                torch.cuda.synchronize()
        ka = prof.key_averages()
        phases = sorted(((e.key, e.count, e.cpu_time_total / 1e3, e.device_time_total / 1e3) for e in ka
                         if e.key.startswith("phase: ")), key=lambda x: -x[2])
        print(f"  profiled request (unseen prompt, P {len(fresh)}): {out.completion_tokens} tokens, TTFT "
              f"{out.ttft_s * 1e3:.1f} ms, TPOT {out.tpot_s * 1e3:.3f} ms, e2e {out.e2e_s * 1e3:.1f} ms")
        print("  phase | calls | host ms (incl. children) | device ms")
        for k, c, cpu, dev in phases:
            print(f"    {k[7:]:40s} {c:6d} {cpu:10.2f} {dev:10.2f}")
        top = sorted(((e.key, e.count, e.self_cpu_time_total / 1e3) for e in ka if not e.key.startswith("phase")),
                     key=lambda x: -x[2])[:25]
        print("  top host operators (self CPU ms):")
        for k, c, cpu in top:
            print(f"    {k[:70]:70s} {c:6d} {cpu:9.2f}")
        report["modes"][mode] = {"requests": rows, "profiled": {"tokens": out.completion_tokens,
                                                                "e2e_ms": out.e2e_s * 1e3},
                                 "phases": [dict(zip(("phase", "calls", "host_ms", "device_ms"), x)) for x in phases],
                                 "top_host_ops": [dict(zip(("op", "calls", "self_cpu_ms"), x)) for x in top]}
        del eng
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
