"""The FP8 block GEMV (``linear[triton]`` at M <= 4) against a pure read of the same bytes, per decode shape.

For every decode/verify shape of the model (``--config``, default Ling-3.0-flash; the shapes are read off the model
built on the meta device: the fused KDA q|k|v|f|g projection, o_proj, the MLA projections, the dense MLP, the
shared experts, NEXTN eh_proj) and M = 1..4, it times the GEMV as CUDA-graph replays of one call per weight copy,
rotating over enough copies that they exceed L2 several times (decode reads each weight once, cold), and, in the
same run, a kernel that only reads the same bytes (``_read_words``) the same way, plus a large streaming read.
Weights are synthetic (random E4M3, block scales 2^-9..2^-7); correctness of each timed config is checked once
against a float64 dequantised reference.

    python scripts/bench_gemv.py --out DIR                     # the table's configs (or the default)
    python scripts/bench_gemv.py --out DIR --sweep [--jobs 12] # candidate configs per shape and M; the best of
                                                               # each goes to DIR/gemv_table.json (sm_XY key)
    python scripts/bench_gemv.py --out DIR --overrides '[{"NR": 80}]'   # per shape and M: the committed config
                                                               # and each override of it (e.g. the register cap)
    python scripts/bench_gemv.py --out DIR --compare-mma       # per shape and M: the table's kernel against the
                                                               # MMA configs MMA_CONFIGS; per shape the MMA config
                                                               # best summed over M = 1..4 (one config for decode
                                                               # and verify: bit-equal rows)

Output: a table on stdout and DIR/bench_gemv.json (device, date, commit from BYTEBOUND_COMMIT, weights
"synthetic", per shape and M: config, us, GB/s, fraction of the same-bytes read and of the streaming read).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "bytebound" / "assets" / "configs" / "ling-3.0-flash.json"


def decode_shapes(config_path=DEFAULT_CONFIG) -> list[dict]:
    """``[{name, n, k, count}]``: every FP8 QLinear shape the model runs through ``linear[triton]`` at decode, as
    ``bind_model`` binds them (KDA's q|k|v|f|g fused into one, MLA's q|kv_a|g into one with its scale-block padding:
    ``layers.linear.fuse_layout``), with how many layers use it."""
    from bytebound.config import LingConfig
    from bytebound.layers.kda import KimiDeltaAttention
    from bytebound.layers.linear import QLinear, fuse_layout
    from bytebound.layers.mla import GatedMLA
    from bytebound.models import model_class
    cfg = LingConfig.from_file(config_path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, torch.bfloat16)
    found: dict = {}
    fused = set()
    for name, m in model.named_modules():
        key = None
        if isinstance(m, KimiDeltaAttention):
            parts = [m.q_proj, m.k_proj, m.v_proj, m.f_proj, m.g_proj]
            if all(p.fmt == "fp8" for p in parts):
                fused.update(id(p) for p in parts)
                key = ("kda.q|k|v|f|g", sum(p.out_features for p in parts), parts[0].in_features)
        elif isinstance(m, GatedMLA):
            parts = [m.q_proj, m.kv_a_proj_with_mqa, m.g_proj]
            layout = fuse_layout(parts, pad=True)
            if parts[0].fmt == "fp8" and not isinstance(layout, str):
                fused.update(id(p) for p in parts)
                key = ("mla.q|kv_a|g", layout[1], parts[0].in_features)
        elif isinstance(m, QLinear) and m.fmt == "fp8" and id(m) not in fused:
            short = ".".join(x for x in name.split(".") if not x.isdigit() and x not in ("model", "layers"))
            key = (short, m.out_features, m.in_features)
        if key:
            e = found.setdefault((key[1], key[2]), {"name": key[0], "n": key[1], "k": key[2], "count": 0,
                                                    "names": set()})
            e["count"] += 1
            e["names"].add(key[0])
    out = []
    for e in found.values():
        e["name"] = " / ".join(sorted(e.pop("names")))
        out.append(e)
    return sorted(out, key=lambda e: -e["n"] * e["k"] * e["count"])


# The MMA path's (kernels.gluon_fp8_gemv) configs that --compare-mma times and the sweep adds: R = BN rows per
# program 32-128 (R >= 16 * num_warps), NC scale blocks per chunk 1, 2, 4, split-K automatic. Every warp loads
# the whole activation operand of a block (M x 128 BF16 from L2), so R = 32 * num_warps halves that per weight.
MMA_CONFIGS = [{"MMA": True, "BN": bn, "NC": nc, "num_warps": nw, "SPLIT": 0}
               for bn, nw in ((64, 4), (128, 8)) for nc in (1, 2, 4)] + \
              [{"MMA": True, "BN": 128, "NC": 2, "num_warps": 4, "SPLIT": 0},     # two row tiles per warp: each
               {"MMA": True, "BN": 64, "NC": 2, "num_warps": 2, "SPLIT": 0},      # warp loads x once for both
               {"MMA": True, "BN": 32, "NC": 4, "num_warps": 2, "SPLIT": 0}]


def candidates(n: int, k: int, m: int) -> list[dict]:
    """The sweep's configs for one shape and M (fitted later by ``fit_gemv_config``)."""
    c = [dict(x) for x in MMA_CONFIGS]
    for bn, bk in ((16, 256), (32, 256), (16, 512), (8, 512)):
        for split in (0, 1):
            c.append({"BN": bn, "BK": bk, "SPLIT": split, "num_warps": 4})
    c.append({"BN": 16, "BK": 256, "SPLIT": 0, "num_warps": 4, "PRE": True})
    c.append({"BN": 16, "BK": 256, "SPLIT": 0, "num_warps": 4, "PF": 1 << 20})
    c.append({"BN": 32, "BK": 256, "SPLIT": 0, "num_warps": 8, "PF": 1 << 20})
    c.append({"BN": 32, "BK": 256, "SPLIT": 0, "num_warps": 8})
    for bn, nw, ns in ((64, 4, 1), (64, 4, 3), (128, 8, 1), (32, 4, 1)):
        c.append({"BN": bn, "BK": 128, "SPLIT": 0, "num_warps": nw, "num_stages": ns, "DOT": True})
    return c


def _ref(x, w, s):
    from bytebound.quant import dequantize_fp8_block
    return x.double() @ dequantize_fp8_block(w, s, (128, 128), torch.float64).t()


def make_weights(n: int, k: int, copies: int, dev, seed: int = 0):
    g = torch.Generator(device=dev).manual_seed(seed)
    w = (torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 8).to(torch.float8_e4m3fn)
    s = torch.exp2(-torch.randint(7, 10, (math.ceil(n / 128), math.ceil(k / 128)), device=dev, generator=g).float())
    return [(w.clone(), s.clone()) for _ in range(copies)]


def graph_time(calls, reps: int = 15, graph_out: list | None = None) -> float:
    """Median microseconds per call of ``calls`` (a list of thunks) captured in one CUDA graph, replayed; the graph is
    appended to ``graph_out`` when one is given (for a profiler pass over the same replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls:                     # warm-up (compiles) outside the graph
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(calls))
    if graph_out is not None:
        graph_out.append(g)
    return statistics.median(ts)


_READ = None


def read_kernel():
    """A Triton kernel that only reads ``n`` int32 words (16-byte vectors, 4 KB per step per program) and writes
    one word per program: the same-bytes floor of a GEMV."""
    global _READ
    if _READ is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _read_words(p, out, n, PER: tl.constexpr, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            offs = tl.arange(0, BLOCK)
            acc = tl.zeros([BLOCK], tl.int32)
            base = pid.to(tl.int64) * PER
            for i in tl.static_range(0, PER, BLOCK):
                o = base + i + offs
                acc ^= tl.load(p + o, mask=o < n, other=0)
            tl.store(out + pid, tl.sum(acc, axis=0))
        _READ = _read_words
    return _READ


def read_call(buf: torch.Tensor, out: torch.Tensor, per: int = 8192, block: int = 1024):
    import triton
    words = buf.view(torch.int32).view(-1)
    n = words.numel()
    grid = (triton.cdiv(n, per),)
    k = read_kernel()
    return lambda: k[grid](words, out, n, PER=per, BLOCK=block, num_warps=4)


def git_commit() -> str:
    c = os.environ.get("BYTEBOUND_COMMIT")
    if c:
        return c
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:                    # noqa: BLE001 - no git on the device copy
        return "unknown"


def _precompile(jobs):
    """Worker: compile (and so cache on disk) each (n, k, m, cfg) by one call."""
    from bytebound.kernels.triton_fp8 import fp8_block_gemv
    dev = torch.device("cuda", torch.cuda.current_device())
    done = 0
    for n, k, m, cfg in jobs:
        w, s = make_weights(n, k, 1, dev)[0]
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        try:
            fp8_block_gemv(x, w, s, cfg=dict(cfg))
            done += 1
        except Exception as e:           # noqa: BLE001 - reported by the main process's own call
            print(f"precompile {n}x{k} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    torch.cuda.synchronize()
    return done


def precompile(jobs: list, workers: int) -> None:
    if workers <= 1 or not jobs:
        return
    import multiprocessing as mp
    chunks = [jobs[i::workers] for i in range(workers)]
    t = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        done = sum(pool.map(_precompile, chunks))
    print(f"precompiled {done}/{len(jobs)} kernels in {time.time() - t:.1f} s with {workers} processes", flush=True)


FOLD_SHAPES = ((20480, 2560, "kda q|k|v|f|g"), (6816, 2560, "mla q|kv_a|g"))


def fold_main(a) -> int:
    """``--fold``: per projection shape and M, microseconds per call (CUDA graph over weight copies covering
    ``--l2-factor`` times the L2, as the GEMV rows) of ``add_rmsnorm`` then ``fp8_block_gemv`` (two launches, the
    default step), of ``fp8_block_gemv_add_norm`` (one launch, the opt-in fold) and of the GEMV alone; the fold's
    output is checked against the two-launch result (tests/gpu/test_gemv_gpu.py has the exact checks)."""
    from bytebound.kernels import triton_fp8 as tf
    from bytebound.kernels.triton_norm import add_rmsnorm
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, k, name in FOLD_SHAPES:
        nbytes = n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)
        copies = max(2, min(256, math.ceil(a.l2_factor * l2 / nbytes)))
        ws = make_weights(n, k, copies, dev)
        calls = max(a.min_calls, copies)
        idx = [i % copies for i in range(calls)]
        nw = (1 + 0.2 * torch.randn(k, device=dev)).float()
        tf.gemv_reserve(dev, n, k)
        for m in (int(x) for x in a.m.split(",")):
            cfg = tf.gemv_config(n, k, m, dev)
            h = torch.randn(m, k, device=dev).to(torch.bfloat16)
            d = torch.randn(m, k, device=dev).to(torch.bfloat16)
            x = add_rmsnorm(d, h, nw, 1e-6)[0]
            modes = {"gemv alone": lambda i: tf.fp8_block_gemv(x, *ws[i], cfg=cfg),
                     "add_rmsnorm + gemv": lambda i: tf.fp8_block_gemv(add_rmsnorm(d, h, nw, 1e-6)[0], *ws[i],
                                                                         cfg=cfg)}
            if cfg.get("MMA"):
                modes["fold"] = lambda i: tf.fp8_block_gemv_add_norm(d, h, nw, 1e-6, *ws[i], cfg)
                y, xf, _ = modes["fold"](0)
                y2 = tf.fp8_block_gemv(x, *ws[0], cfg=cfg)
                err = float((y.float() - y2.float()).norm() / y2.float().norm())
                if err > 1e-2 or (xf.float() - x.float()).abs().max() > 2 ** -6 * x.float().abs().max():
                    print(f"  WRONG {name} M={m} fold: rel err {err:.2e} against the two launches", flush=True)
            for label, f in modes.items():
                us = graph_time([(lambda i=i, f=f: f(i)) for i in idx])
                rows.append({"shape": name, "n": n, "k": k, "M": m, "mode": label, "us": round(us, 3),
                             "config": {kk: cfg[kk] for kk in tf.GEMV_KEYS + ("KS",) if kk in cfg}})
                print(f"{name:16s} {n:6d}x{k:<5d} M={m} {label:20s} {us:8.2f} us", flush=True)
    meta = {"device": props.name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "weights": "synthetic", "command": "scripts/bench_gemv.py --fold " + a.m}
    (out_dir / "bench_gemv_fold.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/bench_gemv")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--m", default="1,2,3,4")
    ap.add_argument("--sweep", action="store_true", help="time candidate configs; best per shape/M -> gemv_table.json")
    ap.add_argument("--compare-mma", action="store_true", help="time the table's config against MMA_CONFIGS per "
                    "shape and M (and report the best single MMA config per shape over M = 1..4)")
    ap.add_argument("--overrides", type=json.loads, default=None, metavar="JSON",
                    help='a list of overrides of the committed config, each timed beside it per shape and M, e.g. '
                         '\'[{"NR": 80}, {"NR": 96}]\' (the MMA GEMV\'s register cap)')
    ap.add_argument("--jobs", type=int, default=8, help="processes that precompile the sweep's kernels")
    ap.add_argument("--l2-factor", type=float, default=3.0, help="weight copies cover this many times the L2")
    ap.add_argument("--min-calls", type=int, default=24)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop the sweep after this many seconds")
    ap.add_argument("--fold", action="store_true", help="time the input add + RMSNorm folded into the attention "
                    "projections against the norm kernel then the GEMV; writes bench_gemv_fold.json")
    a = ap.parse_args(argv)
    if a.fold:
        return fold_main(a)
    from bytebound.kernels import triton_fp8 as tf
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    arch = "sm_%d%d" % torch.cuda.get_device_capability(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = decode_shapes(a.config)
    ms = [int(x) for x in a.m.split(",")]
    t0 = time.time()

    # streaming read of 4 GB
    big = torch.empty(1 << 30, dtype=torch.int32, device=dev).random_()
    sink = torch.empty(1 << 20, dtype=torch.int32, device=dev)
    stream_us = graph_time([read_call(big, sink, per=16384, block=2048)], reps=10)
    stream_gbs = big.numel() * 4 / stream_us / 1e3
    del big
    print(f"{props.name} ({arch}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MB): streaming read "
          f"{stream_gbs:.0f} GB/s", flush=True)

    plan = []
    for sh in shapes:
        n, k = sh["n"], sh["k"]
        for m in ms:
            cfgs = candidates(n, k, m) if a.sweep else [None] + MMA_CONFIGS if a.compare_mma else [None]
            if a.overrides:             # over the committed config; NR (the register cap) is an MMA-only key
                base = {kk: v for kk, v in tf.gemv_config(n, k, m, dev).items() if kk in tf.GEMV_KEYS}
                cfgs = [None] + [dict(base, **o) for o in a.overrides
                                 if base.get("MMA") or "NR" not in o]
            plan.append((sh, m, cfgs))
    if a.sweep or a.compare_mma or a.overrides:
        jobs, seen = [], set()
        for sh, m, cfgs in plan:
            for c in cfgs:
                f = (tf.fit_gemv_config(c, sh["n"], sh["k"], m, (128, 128), props.multi_processor_count)
                     if c is not None else tf.gemv_config(sh["n"], sh["k"], m, dev))
                key = (sh["k"], m, sh["n"] % f["BN"] == 0, json.dumps(f, sort_keys=True))
                if key not in seen:
                    seen.add(key)
                    jobs.append((sh["n"], sh["k"], m, f))
        precompile(jobs, a.jobs)

    results, table = [], {}
    for sh in shapes:
        n, k = sh["n"], sh["k"]
        nbytes = n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)
        copies = max(2, min(256, math.ceil(a.l2_factor * l2 / nbytes)))
        ws = make_weights(n, k, copies, dev)
        calls = max(a.min_calls, copies)
        idx = [i % copies for i in range(calls)]
        read_us = graph_time([read_call(ws[i][0], sink) for i in idx])
        read_gbs = nbytes / read_us / 1e3
        for shp, m, cfgs in plan:
            if shp is not sh:
                continue
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = _ref(x, *ws[0])
            best = None
            for c in cfgs:
                if time.time() - t0 > a.budget_s:
                    print("sweep budget spent; stopping", flush=True)
                    break
                f = (tf.fit_gemv_config(c, n, k, m, (128, 128), props.multi_processor_count) if c is not None
                     else tf.gemv_config(n, k, m, dev))
                try:
                    y = tf.fp8_block_gemv(x, *ws[0], cfg=f)
                    err = float((y.double() - ref).norm() / ref.norm())
                    y2 = tf.fp8_block_gemv(x, *ws[0], cfg=f)
                    same = bool(torch.equal(y, y2))

                    def mk(i, f=f):
                        return lambda: tf.fp8_block_gemv(x, *ws[i], cfg=f)
                    us = graph_time([mk(i) for i in idx])
                except Exception as e:       # noqa: BLE001 - a config that does not compile or run is reported
                    print(f"  {sh['name']} M={m} {c}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                rec = {"shape": sh["name"], "n": n, "k": k, "layers": sh["count"], "M": m, "bytes": nbytes,
                       "config": {kk: f[kk] for kk in tf.GEMV_KEYS + ("KS", "MMA_WHY") if kk in f},
                       "us": round(us, 3),
                       "GBps": round(nbytes / us / 1e3, 1), "read_us": round(read_us, 3),
                       "read_GBps": round(read_gbs, 1), "frac_of_read": round(read_us / us, 4),
                       "frac_of_stream": round(nbytes / us / 1e3 / stream_gbs, 4), "rel_err": err,
                       "repeat_bit_equal": same, "copies": copies}
                if a.sweep or a.compare_mma or a.overrides:
                    rec["candidate"] = c
                results.append(rec)
                if a.overrides:
                    print(f"{sh['name'][:34]:34s} {n:6d}x{k:<5d} M={m} {us:8.2f} us  read {read_us:7.2f} us  "
                          f"{100 * read_us / us:5.1f} % of read  {'committed' if c is None else json.dumps(c)}",
                          flush=True)
                    continue
                if a.compare_mma and c is None:
                    print(f"{sh['name'][:34]:34s} {n:6d}x{k:<5d} M={m} table {us:8.2f} us  read {read_us:7.2f} us  "
                          f"{100 * read_us / us:5.1f} % of read  {json.dumps(rec['config'])}", flush=True)
                    continue            # the best below is the best MMA config
                if best is None or us < best["us"]:
                    best = rec
                if err > 1e-2 or not same:
                    print(f"  WRONG {sh['name']} M={m} {c}: rel err {err:.2e}, repeat equal {same}", flush=True)
            if best is not None and a.compare_mma:
                print(f"{'':34s} {'':12s} M={m} MMA   {best['us']:8.2f} us  {'':19s}  "
                      f"{100 * best['frac_of_read']:5.1f} % of read  {json.dumps(best['config'])}", flush=True)
            elif best is not None:
                table[tf.gemv_key(n, k, m)] = {kk: best["config"][kk] for kk in tf.GEMV_KEYS if kk in best["config"]}
                print(f"{sh['name'][:34]:34s} {n:6d}x{k:<5d} M={m} {best['us']:8.2f} us {best['GBps']:7.0f} GB/s "
                      f"read {read_us:7.2f} us ({read_gbs:5.0f} GB/s)  {100 * best['frac_of_read']:5.1f} % of read "
                      f"{100 * best['frac_of_stream']:5.1f} % of stream  {json.dumps(best['config'])}", flush=True)
        if a.compare_mma:       # one MMA config for M = 1..4 (decode and verify bit-equal): best summed over M
            tot: dict = {}
            for r in results:
                if r["n"] == n and r["k"] == k and r["candidate"] is not None:
                    tot.setdefault(json.dumps(r["candidate"], sort_keys=True), []).append(r["us"])
            full = {c: sum(v) for c, v in tot.items() if len(v) == len(ms)}
            tab = sum(r["us"] for r in results if r["n"] == n and r["k"] == k and r["candidate"] is None)
            if full:
                c = min(full, key=full.get)
                print(f"{'':34s} {n:6d}x{k:<5d} sum over M={a.m}: table {tab:8.2f} us, best single MMA "
                      f"{full[c]:8.2f} us {c}", flush=True)
        del ws
        torch.cuda.empty_cache()
        meta = {"device": props.name, "arch": arch, "sm_count": props.multi_processor_count,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "commit": git_commit(), "weights": "synthetic", "torch": torch.__version__,
                "triton": __import__("triton").__version__, "stream_read_GBps": round(stream_gbs, 1),
                "command": " ".join(sys.argv), "sweep": a.sweep, "compare_mma": a.compare_mma,
                "overrides": a.overrides}
        (out_dir / "bench_gemv.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        if not a.compare_mma and not a.overrides:
            (out_dir / "gemv_table.json").write_text(json.dumps({arch: table}, indent=1, sort_keys=True))
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
