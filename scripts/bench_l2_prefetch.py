"""Does prefetching the next layer's GEMV weights into L2 during the MoE phase pay? A probe of the premise.

In the decode step the MoE kernels read their ~31 MB (M = 1; ~105 MB at M = 4) at about half of the DRAM peak
(docs/perf/moe-kernels-h200.md), so DRAM has spare bandwidth while they run; the next kernel, the KDA layer's
q|k|v|f|g FP8 GEMV, reads 52 MB cold. This script times, in one CUDA graph per scenario, with every buffer rotated
over copies so that nothing is warm from the previous iteration:

    base      [stream S MB]                              -> [GEMV 20480 x 2560]
    pf-P      [L2 prefetch of the GEMV's first P MB] -> [stream S MB] -> [GEMV]
    pf-P-ef   as pf-P, the stream's loads marked evict_first

where "stream" stands for the MoE phase (a read-only kernel of S MB), and the prefetch is ``cp.async.bulk.prefetch.L2``
issued by one thread per program (``kernels.pdl.l2_prefetch``). It prints the GEMV kernel's own duration (CUPTI,
torch.profiler) and the whole sequence's time per iteration (CUDA events), so the prefetch's cost (its issue and the
DRAM bandwidth it takes from the stream) is counted. Synthetic weights; device, date and commit are printed.

    python3 scripts/bench_l2_prefetch.py [--stream-mb 31,105] [--prefetch-mb 0,16,24,32,48]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemv import graph_time  # noqa: E402  (scripts/bench_gemv.py: one CUDA graph, replayed, timed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stream-mb", default="31,105")
    ap.add_argument("--prefetch-mb", default="0,16,24,32,48")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench_l2_prefetch"))
    a = ap.parse_args(argv)
    import triton
    import triton.language as tl
    from bytebound.kernels.pdl import l2_prefetch
    from bytebound.kernels.triton_fp8 import fp8_block_gemv

    @triton.jit
    def _stream(p, out, n, PER: tl.constexpr, BLOCK: tl.constexpr, EVICT: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], tl.int32)
        for i in range(0, PER, BLOCK):
            offs = pid * PER + i + tl.arange(0, BLOCK)
            if EVICT:
                v = tl.load(p + offs, mask=offs < n, other=0, eviction_policy="evict_first")
            else:
                v = tl.load(p + offs, mask=offs < n, other=0)
            acc = acc ^ v
        tl.store(out + pid, tl.sum(acc, axis=0))

    @triton.jit
    def _prefetch(p, per, NT: tl.constexpr):
        l2_prefetch(p + tl.program_id(0).to(tl.int64) * per, per, NT)

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    commit = os.environ.get("BYTEBOUND_COMMIT", "unknown")
    print(f"device {name}  date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}  "
          f"commit {commit}  weights synthetic", flush=True)
    n, k = 20480, 2560
    g = torch.Generator(device=dev).manual_seed(0)
    ws = [((torch.randn(n, k, device=dev, generator=g) * 8).to(torch.float8_e4m3fn),
           torch.full((n // 128, k // 128), 2.0 ** -8, device=dev)) for _ in range(a.copies)]
    x = torch.randn(1, k, device=dev).to(torch.bfloat16)
    res = []
    for smb in (float(v) for v in a.stream_mb.split(",")):
        words = int(smb * 1e6 / 4)
        per = 16384
        progs = -(-words // per)
        bufs = [torch.randint(0, 1 << 30, (words,), device=dev, dtype=torch.int32) for _ in range(a.copies)]
        sink = torch.empty(progs, dtype=torch.int32, device=dev)
        for pmb in (float(v) for v in a.prefetch_mb.split(",")):
            for evict in ((False, True) if pmb > 0 else (False,)):
                nb = int(pmb * 1e6) // 512 // 16 * 16

                def seq(i, nb=nb, evict=evict):
                    w, s = ws[i]
                    if nb:
                        _prefetch[(512,)](w.view(torch.int8), nb, NT=128, num_warps=4)
                    _stream[(progs,)](bufs[i], sink, words, PER=per, BLOCK=1024, EVICT=evict, num_warps=4)
                    fp8_block_gemv(x, w, s)

                calls = [lambda i=i: seq(i) for i in range(a.copies)]
                held: list = []
                seq_us = graph_time(calls, a.reps, held)
                graph = held[0]
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        graph.replay()
                    torch.cuda.synchronize()
                mean = {e.key: e.self_device_time_total / e.count for e in prof.key_averages()
                        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.count}
                gemv = [v for kname, v in mean.items() if "gemv" in kname.lower()]
                strm = [v for kname, v in mean.items() if "_stream" in kname]
                row = dict(stream_MB=smb, prefetch_MB=nb * 512 / 1e6, evict_first=evict,
                           seq_us=seq_us, gemv_us=gemv[0] if gemv else float("nan"),
                           stream_us=strm[0] if strm else float("nan"))
                res.append(row)
                print(f"stream {smb:5.0f} MB  prefetch {row['prefetch_MB']:5.1f} MB  evict_first {int(evict)}  "
                      f"sequence {row['seq_us']:7.2f} us  GEMV {row['gemv_us']:6.2f} us  stream {row['stream_us']:6.2f} us",
                      flush=True)
        del bufs
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "bench_l2_prefetch.json").write_text(json.dumps(
        {"device": name, "commit": commit, "weights": "synthetic", "rows": res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
