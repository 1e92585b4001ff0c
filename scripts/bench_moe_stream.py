"""How fast can the M = 4 MoE's expert tiles stream at all? TMA into a shared-memory ring vs plain loads.

Kernel A of the ``split`` MoE reads its 32 routed experts' gate/up weights (66 MB at M = 4) at about half of the
DRAM peak whatever its decode costs (docs/perf/session23-h100-w4a8/). This probe takes the decode, the multiply and
the epilogue away and keeps only the access pattern: expert ids read from memory, then 64-row x 256-byte tiles of
those experts' ``[2I, H/2]`` byte matrices (3,840 tiles, 63 MB), consumed by an XOR. Three ways:

    ldg      one program per tile: load the id, then the tile with 16-byte loads (kernel A's structure without its
             multiply and partials)
    tma      persistent: G programs, each walks tiles pid, pid + G, ...; a ring of S shared-memory stages filled by
             TMA (``cp.async.bulk.tensor``) with an mbarrier each, S tiles in flight, refilled as each is consumed
    read     a contiguous read of the same byte count (the same-bytes floor)

Each is timed as a CUDA graph of R launches, each over its own routing (R x 32 distinct experts of 512, so the tiles
come from HBM), median microseconds per launch, and GB/s against the contiguous read. Synthetic bytes; device, date
and commit are printed.

    python3 scripts/bench_moe_stream.py [--stages 2,4,6] [--programs-per-sm 1,2]
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

E, H, I, SLOTS = 512, 2560, 768, 32          # Ling's experts; M = 4 tokens x top-8 distinct experts
BR, BC = 64, 256                              # tile: 64 rows x 256 bytes (one TMA box)
NJ, NC = 2 * I // BR, (H // 2) // BC          # 24 row blocks x 5 column chunks per expert
NITEMS = SLOTS * NJ * NC                      # 3,840 tiles

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
except Exception:  # pragma: no cover
    gluon = None

if gluon is not None:
    @gluon.jit
    def _tma_stream(desc, ids_ptr, out_ptr, NIT: gl.constexpr, PER_E: gl.constexpr, NCc: gl.constexpr,
                    ROWS: gl.constexpr, S: gl.constexpr, NW: gl.constexpr):
        """Tiles ``pid, pid + G, ..`` of ``NIT`` (``PER_E`` per expert, ``NCc`` column chunks, ``ROWS`` rows an
        expert) through a ring of ``S`` shared-memory stages, one TMA box and one mbarrier each."""
        BRc: gl.constexpr = desc.block_type.shape[0]
        BCc: gl.constexpr = desc.block_type.shape[1]
        pid = gl.program_id(0)
        G = gl.num_programs(0)
        smem = gl.allocate_shared_memory(gl.uint8, [S, BRc, BCc], desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(S):
            mbarrier.init(bars.index(i), count=1)
        n_my = (NIT - pid + G - 1) // G
        for i in gl.static_range(S):
            it = pid + i * G
            s = it // PER_E
            rem = it % PER_E
            e = gl.load(ids_ptr + s, mask=i < n_my, other=0)
            mbarrier.expect(bars.index(i), BRc * BCc, pred=i < n_my)
            tma.async_copy_global_to_shared(desc, [e * ROWS + (rem // NCc) * BRc, (rem % NCc) * BCc], bars.index(i),
                                            smem.index(i), pred=i < n_my)
        L: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [NW, 1], [1, 0])
        acc = gl.zeros([BRc, BCc], gl.uint8, L)
        for k in range(n_my):
            st = k % S
            mbarrier.wait(bars.index(st), (k // S) & 1)
            v = smem.index(st).load(L)
            acc = acc ^ v
            gl.thread_barrier()             # every thread has read the stage before it is refilled
            nk = k + S
            it = pid + nk * G
            s = it // PER_E
            rem = it % PER_E
            more = nk < n_my
            e = gl.load(ids_ptr + s, mask=more, other=0)
            mbarrier.expect(bars.index(st), BRc * BCc, pred=more)
            tma.async_copy_global_to_shared(desc, [e * ROWS + (rem // NCc) * BRc, (rem % NCc) * BCc], bars.index(st),
                                            smem.index(st), pred=more)
        gl.store(out_ptr + pid, gl.xor_sum(gl.xor_sum(acc, axis=1), axis=0).to(gl.int32))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="2,4,6")
    ap.add_argument("--programs-per-sm", default="1,2")
    ap.add_argument("--routings", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench_moe_stream"))
    a = ap.parse_args(argv)
    import triton
    import triton.language as tl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    @triton.jit
    def _ldg_tile(w_ptr, ids_ptr, out_ptr, BRc: tl.constexpr, BCc: tl.constexpr, PER_E: tl.constexpr,
                  NCc: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
        it = tl.program_id(0)
        s = it // PER_E
        rem = it % PER_E
        e = tl.load(ids_ptr + s).to(tl.int64)
        r = tl.arange(0, BRc)
        c = tl.arange(0, BCc // 4)
        rows = e * ROWS + (rem // NCc) * BRc + r
        v = tl.load(w_ptr + rows[:, None] * WORDS + (rem % NCc) * (BCc // 4) + c[None, :])
        tl.store(out_ptr + it, tl.xor_sum(tl.xor_sum(v, axis=1), axis=0))

    @triton.jit
    def _read(p, out, n, PER: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], tl.int32)
        for i in range(0, PER, BLOCK):
            offs = pid * PER + i + tl.arange(0, BLOCK)
            acc = acc ^ tl.load(p + offs, mask=offs < n, other=0)
        tl.store(out + pid, tl.xor_sum(acc, axis=0))

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    commit = os.environ.get("BYTEBOUND_COMMIT", "unknown")
    print(f"device {name}  date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}  "
          f"commit {commit}  bytes synthetic", flush=True)
    w = torch.randint(0, 256, (E * 2 * I, H // 2), dtype=torch.uint8, device=dev)       # 1.0 GB: 512 experts
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(E, generator=g)
    assert a.routings * SLOTS <= E, "each routing takes its own experts"
    ids = [perm[r * SLOTS:(r + 1) * SLOTS].to(torch.int32).to(dev) for r in range(a.routings)]
    nbytes = NITEMS * BR * BC
    out = torch.empty(max(NITEMS, 4 * sms), dtype=torch.int32, device=dev)

    def timed(calls) -> float:
        return graph_time(calls, a.reps)

    rows = []

    def report(kind, us, **kw):
        row = dict(kind=kind, us=us, GBps=nbytes / us / 1e3, **kw)
        rows.append(row)
        extra = " ".join(f"{k} {v}" for k, v in kw.items())
        print(f"{kind:5s} {extra:28s} {us:7.2f} us  {row['GBps']:6.0f} GB/s", flush=True)

    # the same-bytes contiguous read (rotated over buffers larger than L2 together)
    words = nbytes // 4
    bufs = [torch.randint(0, 1 << 30, (words,), dtype=torch.int32, device=dev) for _ in range(a.routings)]
    per = 16384
    report("read", timed([lambda b=b: _read[(-(-words // per),)](b, out, words, PER=per, BLOCK=1024, num_warps=4)
                          for b in bufs]))
    del bufs
    w32 = w.view(torch.int32)
    lgeo = dict(PER_E=NJ * NC, NCc=NC, ROWS=2 * I, WORDS=H // 8)     # the tiles' geometry (module constants)
    for nw in (4, 8):
        report("ldg", timed([lambda i=i: _ldg_tile[(NITEMS,)](w32, i, out, BRc=BR, BCc=BC, num_warps=nw, **lgeo)
                             for i in ids]), warps=nw)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    geo = dict(NIT=NITEMS, PER_E=NJ * NC, NCc=NC, ROWS=2 * I)
    desc = TensorDescriptor.from_tensor(w, [BR, BC], layout)
    for s in (int(v) for v in a.stages.split(",")):
        for pps in (int(v) for v in a.programs_per_sm.split(",")):
            for nw in (4,):
                try:
                    us = timed([lambda i=i: _tma_stream[(pps * sms,)](desc, i, out, S=s, NW=nw, num_warps=nw, **geo)
                                for i in ids])
                    report("tma", us, stages=s, programs_per_sm=pps, warps=nw)
                except Exception as exc:        # a tiling that does not fit (shared memory) is a row, not the end
                    print(f"tma stages {s} programs/SM {pps}: {type(exc).__name__}: {exc}"[:300], flush=True)
    # the TMA kernel's checksum against the plain loads' (same tiles): the probe reads what it claims to
    chk = torch.zeros(NITEMS, dtype=torch.int32, device=dev)
    _ldg_tile[(NITEMS,)](w32, ids[0], chk, BRc=BR, BCc=BC, num_warps=4, **lgeo)
    x = 0
    for v in chk.tolist():
        x ^= v & 0xFFFFFFFF
    want = (x ^ (x >> 8) ^ (x >> 16) ^ (x >> 24)) & 0xFF          # XOR of every byte of the tiles
    for s in (2,):
        got_t = torch.zeros(4 * sms, dtype=torch.int32, device=dev)
        _tma_stream[(sms,)](desc, ids[0], got_t, S=s, NW=4, num_warps=4, **geo)
        got = 0
        for v in got_t[:sms].tolist():
            got ^= v & 0xFF
        print(f"checksum (XOR of the tiles' bytes): plain loads {want:#04x}, TMA {got:#04x}: "
              f"{'equal' if got == want else 'DIFFERENT'}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "bench_moe_stream.json").write_text(json.dumps(
        {"device": name, "commit": commit, "bytes_per_launch": nbytes, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
