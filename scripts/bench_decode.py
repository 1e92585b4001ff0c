"""Full-scale Ling-3.0-flash batch-1 decode benchmark on one GPU with ``dummy`` (synthetic) weights.

Measures, in one run: the GPU's streaming-read bandwidth; TPOT and tok/s of the CUDA-graph decode step at
2K and 32K context for each routed-MoE backend and LM-head path; a per-op table (time per token, stored
bytes, achieved GB/s) from graphs of each op class over all its layers; TTFT of a 32K prompt (optional);
U = ledger bytes per token / TPOT / measured bandwidth. Writes JSON + markdown to --out.

The engine is built as ``bytebound generate`` builds it (``Engine`` with ``--load-format dummy``: the same plan,
binding, runner, decode graphs); each variant is a set of plan overrides (``--backend ENTRY=NAME`` for all, the
``+opt`` suffixes of ``--moe-backends`` per variant) applied by ``Engine.rebind`` on the one loaded model.

Weights are synthetic (random values at the real shapes and storage formats): speed only, no quality.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bytebound.analysis.bandwidth import cuda_event_times, measure_read_bandwidth  # noqa: E402
from bytebound.analysis.kernels import kernel_table  # noqa: E402
from bytebound.analysis.ledger import build_ledger  # noqa: E402
from bytebound.bench.report import git_commit  # noqa: E402
from bytebound.config import LING3_FLASH_CONFIG, LingConfig  # noqa: E402
from bytebound.engine.engine import Engine, EngineConfig  # noqa: E402
from bytebound.errors import ConfigError  # noqa: E402
from bytebound.runner.graphs import capture_decode, capture_graph  # noqa: E402
from bytebound.runner.plan import BackendPlan, parse_backend_specs  # noqa: E402

# ``--moe-backends`` suffixes -> plan overrides of that variant ("+pdlN" is a launch-config tweak, not a plan entry)
VARIANT_OPTS = {"shared": {"moe_shared": "fused"}, "dense": {"moe_shared": "separate"}, "gemv": {"router": "gemv"},
                "nogemv": {"router": "triton"}, "mla": {"mla": "triton"}, "kda": {"kda": "triton"}}


def time_graph(fn, reps: int = 50, warmup: int = 3) -> float:
    """Median ms of one replay of a graph capturing ``fn`` once (CPU smoke runs: eager wall clock)."""
    if not torch.cuda.is_available():
        with torch.inference_mode():
            for _ in range(warmup):
                fn()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
        return sorted(ts)[2]
    g, _ = capture_graph(fn, warmup)
    ts = sorted(t * 1e3 for t in cuda_event_times(g.replay, reps, warmup=1))
    return ts[len(ts) // 2]


def decode_tpot(runner, ctx: int, steps: int = 64) -> tuple[float, float]:
    """Median ms per token at context ``ctx`` (cache slots [0, ctx) hold random latents): ``(tpot, step)`` where
    ``step`` is one replay of the captured decode graph (embedding -> final norm) and ``tpot`` adds the LM head,
    launched eagerly after the replay. The engine's plain loop replays the head and the token choice as graphs too
    (``runner.decode_token``), so this ``tpot`` also holds the eager head's launch gaps, which the engine no longer
    pays, and leaves out its argmax. Sampling is not included."""
    runner.reset()
    for st in runner.state:
        if hasattr(st, "kv"):
            st.kv.normal_()
    if runner.device.type != "cuda":                       # CPU smoke run of the script's logic
        ms = time_graph(lambda: runner.model.logits(runner.forward(torch.tensor([17]))))
        return ms, ms
    if runner.graph is None:                               # graphs=eager in the plan: capture for the timing
        capture_decode(runner, tokens=False)        # the step and the eager head are what is timed
    tok = torch.tensor([17], device=runner.device)
    pos = iter(range(ctx, ctx + 2 * steps + 2))
    step = sorted(t * 1e3 for t in cuda_event_times(lambda: runner.graph.replay(tok, next(pos)), steps, warmup=1))

    def with_head():
        with torch.inference_mode():
            runner.model.logits(runner.graph.replay(tok, next(pos)))
    tpot = sorted(t * 1e3 for t in cuda_event_times(with_head, steps, warmup=1))
    return tpot[len(tpot) // 2], step[len(step) // 2]


def kernels_per_step(runner, ctx: int, steps: int = 3):
    """GPU kernels per decode step with the LM head (``analysis.kernels.kernel_table`` over ``steps`` graph
    replays at positions ``ctx + 1 ..`` after one at ``ctx``, as the engine runs a step: replay + head); None on
    CPU."""
    if runner.device.type != "cuda":
        return None
    if runner.graph is None:
        capture_decode(runner, tokens=False)
    tok = torch.tensor([17], device=runner.device)
    pos = iter(range(ctx, ctx + steps + 1))
    with torch.inference_mode():
        _, totals = kernel_table(lambda: runner.model.logits(runner.graph.replay(tok, next(pos))), steps)
    return totals["kernels"]


def what_ran(plan) -> dict:
    """The backends a measurement ran with: each op's resolved backend, and where the MoE layers' shared expert
    and routing ran."""
    moe = plan.resolutions["moe"]
    return {"resolved": {k: v.resolved for k, v in plan.resolutions.items()}, "shared_expert": moe.shared,
            "router": moe.router,
            "plan": {name: {g: e.impl for g, e in regimes.items()} for name, regimes in plan.entries.items()}}


def pdl_in_everywhere(model, value: int) -> None:
    """``+pdlN``: every triton ``split`` MoE kernel's config (M = 1..4) with ``pdl_in`` = N (1, 2: kernel A launched
    as a PDL dependent of the router; 0: not; ``triton_moe_split``), as a table entry with that key would give."""
    from bytebound.layers.moe import RoutedExperts
    k = model.cfg.num_experts_per_tok
    for mod in model.modules():
        fn = getattr(mod, "fn", None) if isinstance(mod, RoutedExperts) else None
        if fn is not None and hasattr(fn, "configs"):
            cfgs = {mm: fn.config(mm, k) for mm in range(1, 5)}
            fn.configs.update({mm: dict(c, pdl_in=value) for mm, c in cfgs.items() if c.get("variant") == "split"})


def per_op(model, runner, ctx: int, m: int = 1) -> list[dict]:
    """Time each op class over all its layers in one graph: [{op, layers, ms, bytes}], for ``m`` tokens at
    positions ``ctx..ctx+m-1`` (``m`` = 4: the MTP verify's shapes; KDA then records per-token states as the verify
    does). Bytes are the stored parameters each op reads once (routed experts: the top-k share of one token)."""
    cfg, dev = model.cfg, runner.device
    x = torch.randn(1, m, cfg.hidden_size, device=dev, dtype=model.dtype)
    pos = torch.arange(ctx, ctx + m, device=dev)
    layers = model.decoder_layers
    kda = [(l, runner.state[l.index]) for l in layers if not l.is_mla]
    runner.reset()
    if m > 1:
        runner.begin_verify(m - 1)          # KDA layers record per-token states, as in the verify
    mla = [(l, runner.state[l.index]) for l in layers if l.is_mla]
    moe = [l for l in layers if hasattr(l.mlp, "experts")]
    dense = [l for l in layers if not hasattr(l.mlp, "experts")]

    def nbytes(mods, frac_experts=None):
        tot = 0
        for m in mods:
            for n, p in m.named_parameters():
                b = p.numel() * p.element_size()
                if ".experts." in f".{n}" or n.startswith("experts."):
                    b *= cfg.num_experts_per_tok / cfg.num_experts
                tot += b
        return tot

    rows = [
        ("KDA attention", len(kda), lambda: [l.attention(x, s) for l, s in kda], nbytes([l.attention for l, _ in kda])),
        ("MLA attention", len(mla), lambda: [l.attention(x, pos, s, runner.kv_span(ctx + m)) for l, s in mla],
         nbytes([l.attention for l, _ in mla]) + len(mla) * (ctx + m) * cfg.mla_cache_dim * 2),
        ("MoE (router+routed+shared)", len(moe), lambda: [l.mlp(x) for l in moe], nbytes([l.mlp for l in moe])),
        ("dense MLP", len(dense), lambda: [l.mlp(x) for l in dense], nbytes([l.mlp for l in dense])),
        ("LM head", 1, lambda: model.lm_head(x), model.lm_head.bytes_per_call()),
        ("norms+embedding", 1, lambda: [l.input_layernorm(x) for l in layers] + [model.embed(pos.view(1, -1))], 0),
    ]
    out = []
    try:
        for name, n, fn, b in rows:
            ms = time_graph(fn)
            out.append({"op": name, "layers": n, "tokens": m, "ms": ms, "bytes": b, "GBps": b / ms / 1e6 if ms else 0})
    finally:
        runner.reset()
    return out


def head_saving(results: list[dict], bw_gbps: float) -> dict | None:
    """The online FP8 head's measured saving against the byte prediction (issue 4): per MoE backend and context,
    ``bf16 - fp8`` of the head alone (graph-timed, 200 replays) and of TPOT, and the predicted saving
    ``(bf16 head bytes - fp8 head bytes) / measured streaming bandwidth``. None without both heads."""
    by = {(r["moe"], r["head"], r["ctx"]): r for r in results if "tpot_ms" in r}
    rows = []
    for (moe, head, ctx), r in by.items():
        f = by.get((moe, "fp8", ctx))
        if head != "bf16" or f is None:
            continue
        d_gb = r["head_GB"] - f["head_GB"]
        rows.append({"moe": moe, "ctx": ctx, "bf16_head_ms": r["head_ms"], "fp8_head_ms": f["head_ms"],
                     "head_saving_ms": r["head_ms"] - f["head_ms"], "tpot_saving_ms": r["tpot_ms"] - f["tpot_ms"],
                     "bytes_saved_GB": d_gb, "predicted_saving_ms": d_gb / bw_gbps * 1e3})
    return {"rows": rows} if rows else None


def round_cost(model, runner, ctx: int, steps: int = 3) -> dict:
    """Graph-timed pieces of one MTP round at context ``ctx``: target verify over steps+1 tokens (KDA state
    recorded per token), NEXTN draft-extend over steps+1 tokens, one NEXTN draft step (each + LM head).
    round = verify + extend + (steps - 1) draft steps (acceptance itself is a few tiny ops, not timed)."""
    cfg, dev = model.cfg, runner.device
    k = steps + 1
    runner.reset()
    toks = torch.randint(0, cfg.vocab_size, (1, k), device=dev)
    pos_k = torch.arange(ctx, ctx + k, device=dev)
    hid = torch.randn(1, k, cfg.hidden_size, device=dev, dtype=model.dtype)

    def verify():
        return model.logits(runner.verify(toks[0], pos_k, runner.kv_span(ctx + k)))

    def extend():
        return model.logits(model.nextn_forward(toks, hid, pos_k, runner.state, runner.kv_span(ctx + k)))

    def draft():
        return model.logits(model.nextn_forward(toks[:, :1], hid[:, :1], pos_k[:1], runner.state,
                                                runner.kv_span(ctx + k)))

    runner.begin_verify(steps)
    r = {"verify_ms": time_graph(verify)}
    runner.reset()
    r.update(extend_ms=time_graph(extend), draft_ms=time_graph(draft))
    r["round_ms"] = r["verify_ms"] + r["extend_ms"] + (steps - 1) * r["draft_ms"]
    # The engine's whole round as one replay (speculative.round: padded extend, drafts, verify, acceptance,
    # rollback, next inputs) plus its one host read, from a synthetic state at ``ctx``.
    try:
        from bytebound.sampling import SamplingParams
        from bytebound.speculative.mtp import MTPDrafter
        from bytebound.speculative.round import StaticRound
        runner.reset()
        rnd = StaticRound(runner, MTPDrafter(model, steps), SamplingParams(), None, capture=dev.type == "cuda")
        rnd.ext_ids.random_(0, cfg.vocab_size)
        rnd.ext_hidden.normal_()
        rnd.j.fill_(steps)
        runner.reset(ctx)
        if dev.type == "cuda":
            ts = sorted(t * 1e3 for t in cuda_event_times(rnd.step, 20, warmup=2))
        else:                                   # CPU smoke run: one eager round
            t0 = time.perf_counter()
            rnd.step()
            ts = [(time.perf_counter() - t0) * 1e3]
        r["static_round_ms"] = ts[len(ts) // 2]
        runner.reset()
    except Exception as e:
        r["static_round_error"] = f"{type(e).__name__}: {e}"
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=str(LING3_FLASH_CONFIG))
    ap.add_argument("--backend", action="append", default=[], metavar="ENTRY=NAME",
                    help="plan override for every variant, as bytebound generate --backend (e.g. router=torch, "
                         "kv=exact, moe_shared=separate); default: the engine's plan for the device")
    ap.add_argument("--kda-backend", default=None, help="shortcut of --backend kda=NAME ('+kda' in --moe-backends "
                    "picks triton for one variant)")
    ap.add_argument("--mla-backend", default=None, help="shortcut of --backend mla=NAME")
    ap.add_argument("--moe-backends", default="triton,torch,humming",
                    help="variants: a moe backend with optional +shared / +dense (moe_shared=fused|separate), +gemv "
                         "/ +nogemv (router=gemv|triton), +mla / +kda (mla|kda=triton), +pdl0 / +pdl1 / +pdl2 (the "
                         "split kernels' pdl_in); humming last: its repacked expert copy needs +1.6 GB per layer")
    ap.add_argument("--heads", default="bf16,fp8")
    ap.add_argument("--contexts", default="2048,32768")
    ap.add_argument("--ttft-len", type=int, default=32768, help="0 skips the TTFT prefill")
    ap.add_argument("--verify-ops", action="store_true",
                    help="also time each op class at 4 tokens (the MTP verify's shapes)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--name", default="bench_decode", help="output file name (NAME.json) in --out")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests the script, with a small --config (e.g. models/ling-nano/config.json)")
    a = ap.parse_args()
    try:
        common = parse_backend_specs(a.backend)
    except ConfigError as e:
        ap.error(str(e))
    common.update({k: v for k, v in (("kda", a.kda_backend), ("mla", a.mla_backend)) if v})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device)
    cfg = LingConfig.from_file(a.config)
    info = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "command": " ".join(sys.argv), "weights": "synthetic (dummy: random, real shapes/formats)",
            "torch": torch.__version__, "plan_overrides": common}
    print(json.dumps(info))
    bw = measure_read_bandwidth(dev, nbytes=(4 << 30) if dev.type == "cuda" else (256 << 20))
    info["read_bandwidth_GBps"] = bw
    print(f"streaming read bandwidth: {bw:.0f} GB/s", flush=True)
    ctxs = [int(c) for c in a.contexts.split(",")]
    # decode_tpot replays 2 x 65 steps past the context; the TTFT prompt runs on the same engine
    max_len = max(max(ctxs) + 256, a.ttft_len + 64)
    variants = []
    for moe in a.moe_backends.split(","):
        moe_b, *opts = moe.split("+")
        known = set(VARIANT_OPTS) | {"pdl0", "pdl1", "pdl2"}
        if set(opts) - known or {"shared", "dense"} <= set(opts) or {"gemv", "nogemv"} <= set(opts):
            ap.error(f"--moe-backends {moe!r}: a backend name with optional +shared or +dense, +gemv or +nogemv, "
                     "+pdl0 / +pdl1 / +pdl2, +mla, +kda")
        over = {**common, "moe": moe_b}
        for o in opts:
            over.update(VARIANT_OPTS.get(o, {}))
        try:        # the engine's own validation, before anything loads: a bad variant is named here
            BackendPlan.build(dev, over)
        except ConfigError as e:
            ap.error(f"--moe-backends {moe!r}: {e}")
        variants.append((moe, opts, over, [int(o[3]) for o in opts if o.startswith("pdl")]))
    heads = a.heads.split(",")
    eng = None
    t = time.perf_counter()
    try:           # the first variant's engine, as bytebound generate builds it
        eng = Engine(EngineConfig(model=a.config, load_format="dummy", device=a.device, lm_head=heads[0],
                                  backends=variants[0][2], max_model_len=max_len))
    except Exception as e:  # BackendError / ConfigError of that plan: load with the torch MoE, the loop reports it
        print(f"first variant's engine: {type(e).__name__}: {e}; loading with moe=torch", flush=True)
        eng = Engine(EngineConfig(model=a.config, load_format="dummy", device=a.device, lm_head=heads[0],
                                  backends={**common, "moe": "torch"}, max_model_len=max_len))
    first_bind = (eng.config.backends, heads[0])
    model = eng.model
    info["weights_create_s"] = eng.startup.get("load_s")
    info["startup_s"] = time.perf_counter() - t
    info["gpu_mem_GB"] = torch.cuda.memory_allocated() / 1e9 if dev.type == "cuda" else 0.0
    print(f"dummy weights: {info['weights_create_s']:.1f} s, {info['gpu_mem_GB']:.1f} GB", flush=True)
    info["kv_spans"] = list(eng.runner.kv_buckets)
    results, ops = [], {}

    def dump():  # after every measurement, so a run cut short by its time limit still leaves its numbers
        (out / f"{a.name}.json").write_text(json.dumps({"info": info, "results": results, "per_op": ops},
                                                          indent=2))
    for moe, opts, over, pdl in variants:
        for head in heads:
            plan = runner = None        # the previous variant's runner and graphs go before rebind makes new ones
            try:
                t = time.perf_counter()
                if (over, head) != first_bind:          # the engine built above already runs this plan
                    eng.rebind(backends=over, lm_head=head)
                first_bind = None
                if pdl:
                    pdl_in_everywhere(model, pdl[0])
                bind_s = time.perf_counter() - t
            except Exception as e:  # BackendError, or out of memory (humming's repacked copy at full scale)
                print(f"skip moe={moe} head={head}: {type(e).__name__}: {e}", flush=True)
                results.append({"moe": moe, "head": head, "error": f"{type(e).__name__}: {e}"})
                first_bind = None
                eng.rebind(backends={**common, "moe": "torch"}, lm_head=head)   # drop a half-made binding
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            plan, runner = eng.plan, eng.runner
            led = build_ledger(cfg, head=head)
            xh = torch.randn(1, cfg.hidden_size, device=dev, dtype=model.dtype)
            head_ms = time_graph(lambda: model.logits(xh), reps=200)     # the head alone: its TPOT share
            head_bytes = model.lm_head.bytes_per_call()
            print(f"LM head {head}: {head_ms:.4f} ms, {head_bytes / 1e9:.3f} GB, "
                  f"{head_bytes / head_ms / 1e6:.0f} GB/s", flush=True)
            for ctx in ctxs:
                try:
                    ms, step_ms = decode_tpot(runner, ctx)
                    kernels = kernels_per_step(runner, ctx)
                except Exception as e:  # report, keep measuring the other variants
                    print(f"FAIL moe={moe} head={head} ctx={ctx}: {type(e).__name__}: {e}", flush=True)
                    results.append({"moe": moe, "head": head, "ctx": ctx, "error": f"{type(e).__name__}: {e}"})
                    continue
                kv = led.kv_bytes_per_token() * ctx
                b = led.bytes + kv + led.state_bytes()
                r = {"moe": moe, "head": head, "ctx": ctx, "tpot_ms": ms, "step_ms_without_head": step_ms,
                     "kernels_per_step": kernels,
                     "head_ms": head_ms, "head_GB": head_bytes / 1e9,
                     "tok_s": 1e3 / ms, "bind_s": bind_s,
                     "ledger_GB": b / 1e9, "floor_ms": b / (bw * 1e9) * 1e3,
                     "U": b / (ms * 1e-3) / (bw * 1e9),
                     **what_ran(plan)}
                results.append(r)
                print(json.dumps(r), flush=True)
                dump()
            if head == "fp8" and "error" not in results[-1]:
                try:
                    rc = round_cost(model, runner, ctxs[0])
                    base = results[-len(ctxs)]["tpot_ms"]
                    if rc.get("static_round_ms"):
                        rc["c_static_round"] = rc["static_round_ms"] / base
                    rc.update({"moe": moe, "head": head, "ctx": ctxs[0], "decode_ms": base, "c": rc["round_ms"] / base,
                               "c_bytes": led.round_bytes(4, 3) / led.bytes, "c_seed": 2.26})
                    ops[f"mtp_round/{moe}"] = rc
                    print("MTP round:", json.dumps(rc), flush=True)
                except Exception as e:
                    print(f"MTP round cost failed ({moe}): {type(e).__name__}: {e}", flush=True)
            if head == "fp8" and (moe == variants[0][0] or opts):
                for m, key in [(1, f"{moe}/{head}")] + ([(4, f"{moe}/{head}/verify4")] if a.verify_ops else []):
                    try:
                        ops[key] = per_op(model, runner, ctxs[0], m)
                    except Exception as e:
                        print(f"per-op table failed ({moe}, {m} tokens): {type(e).__name__}: {e}", flush=True)
                        ops[key] = [{"error": f"{type(e).__name__}: {e}"}]
                    print(f"per op, {m} token(s):", flush=True)
                    for row in ops[key]:
                        if "error" not in row:
                            print(f"  {row['op']:<28} x{row['layers']:<3} {row['ms']:8.3f} ms {row['bytes'] / 1e9:7.3f} GB "
                                  f"{row['GBps']:7.0f} GB/s", flush=True)
            dump()
    if a.ttft_len:
        try:
            eng.rebind(backends=variants[0][2], lm_head="fp8")
            runner = eng.runner
            ids = torch.randint(0, cfg.vocab_size, (a.ttft_len,), device=dev)
            sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
            runner.reset()
            sync()
            t = time.perf_counter()
            h = runner.prefill(ids)
            model.logits(h[-1:])
            sync()
            info["ttft_s"] = {"prompt": a.ttft_len, "s": time.perf_counter() - t, **what_ran(eng.plan)}
            print(f"TTFT {a.ttft_len} tokens: {info['ttft_s']['s']:.2f} s", flush=True)
        except Exception as e:
            info["ttft_s"] = {"prompt": a.ttft_len, "error": f"{type(e).__name__}: {e}"}
            print(f"TTFT failed: {e}", flush=True)
    info["fp8_head_saving"] = head_saving(results, bw)
    if info["fp8_head_saving"]:
        print("FP8 head saving:", json.dumps(info["fp8_head_saving"]), flush=True)
    dump()
    print("\n| variant | head | ctx | TPOT ms | tok/s | kernels/step | ledger GB | floor ms | U |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "tpot_ms" in r:
            print(f"| {r['moe']} | {r['head']} | {r['ctx']} | {r['tpot_ms']:.3f} | {r['tok_s']:.1f} | "
                  f"{r['kernels_per_step']} | {r['ledger_GB']:.3f} | {r['floor_ms']:.3f} | {r['U']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
