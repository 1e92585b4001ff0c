"""The fixed cost per op boundary of a chain of dependent FP8 GEMVs at batch 1, under several executions.

Why: a decode step today is (its weight bytes at full bandwidth) + (about 6 us per kernel boundary), and U = 0.8
needs that boundary cost below ~0.75 us. docs/perf/u08-design.md section 3 proposes one persistent kernel whose
ops wait on data-driven counters instead of kernel boundaries, with each op's weights streamed independently of
its dependency. This script is the first measurement of that design on the simplest chain there is: L dependent
GEMVs ``y_i = W_i @ x_i`` (W_i FP8 E4M3 ``[N_i, K_i]`` row-major with a float32 per-row scale ``[N_i]``;
``x_0`` a BF16 vector ``[K_0]``; ``x_{i+1} = bf16(y_i)``, so ``K_{i+1} = N_i``), activations in static BF16 buffers,
timed as CUDA-graph replays of the whole chain (median of ``--reps``, CUDA events) under:

1. ``plain``: one Triton launch per op (grid ``N_i / BN`` programs, each BN rows over the whole K in chunks of BK
   columns; no split-K), the L launches captured in one graph.
2. ``pdl``: the same kernels with programmatic dependent launch: every program issues
   ``griddepcontrol.launch_dependents`` at its start, loads its first weight tile, then ``griddepcontrol.wait``
   (the previous kernel complete and its memory visible), then reads x (the protocol of ``kernels/pdl.py`` and the
   FP8 GEMV of ``kernels/triton_fp8.py``).
3. ``persist``: ONE persistent kernel over the whole chain (``--programs-per-sm`` x SMs programs, all co-resident).
   Program p takes, op after op, the row blocks p, p + P, p + 2P, ... of each op; per block it loads the first
   weight tile (independent of the chain), then spins until the previous op's counter says all of its row blocks
   are stored (acquire), computes the block, stores it, and bumps its own op's counter (release). The counters are
   zeroed by one extra node inside the same graph, just before the kernel (its time is included).
4. ``read``: one launch that only reads all L ops' weight bytes: the no-boundary floor.
5. ``flag`` / ``flaglate``: the ``pdl`` launches (one per op, ``launch_pdl``) with the dependency carried by a
   counter instead of ``griddepcontrol.wait``: each program of op i spins (acquire) until op i - 1's counter holds
   all of its row blocks, computes, and adds 1 to op i's counter (CTA barrier, then release), as ``persist``'s
   blocks do. So op i may start its reads as soon as op i - 1's last block is stored, instead of when op i - 1's
   grid has retired and its memory been flushed (what ``griddepcontrol.wait`` waits for). ``flag`` lets the next
   op launch at the top of each program (several ops may then be resident and spinning), ``flaglate`` only after
   the program's wait (one op of lookahead, as ``pdl``). Counters are zeroed by one plain node before op 0, which
   alone waits with ``griddepcontrol.wait`` (the zeroes visible) and only then lets op 1 launch. This separates
   the boundary's cost into the launch structure (which ``flag`` keeps) and the grid-completion wait (which it
   drops).
6. ``stream``: ONE persistent kernel (one program per SM, cooperative) whose weight tiles stream into a deep
   shared-memory ring by TMA, in the order the program consumes them and ahead of its dependency waits, up to the
   ring's ``--stream-stages`` x ``--stream-cps`` tiles of ``--stream-rows`` x 128 bytes (``scripts/chain_stream.py``;
   the weights repacked into those tiles once, host-side). Per op: one acquire spin on the previous op's counter,
   x staged once in shared memory, the program's row blocks out of the ring, a release add per block. It sums in
   another order than the other executions (128-column tiles), so it is checked against the float64 chain and its
   bit equality with ``plain`` is only reported. Needs sm_90; skipped on CPU (Gluon and TMA do not run in the
   interpreter). Not in the default ``--only``: name it. ``streamfree``: the same kernel with no dependencies
   (every op reads one fixed input from a buffer of its own, no program waits; each op checked against float64 of
   that input): the stream's and the consumer's own rate, so that ``stream - streamfree`` is what the dependency
   chain itself costs. ``--stream-consumer mma``: each tile multiplied on tensor cores (E4M3 -> FP16 mma fragments
   by the hardware conversion, x staged in FP16; ``_chain_stream_mma``) instead of float32 FMAs, the consumer
   rate the thirty-eighth session found to limit the FMA kernel (docs/perf/u08-design.md section 7.1);
   ``--stream-ksplit`` splits each row block over K as well (float32 partials, summed in a fixed order by the next
   op's programs as they stage x), so that every op spreads over all SMs (section 7.3). On the H100 every form was
   slower per dependent op than ``pdl`` (docs/perf/session38/).

``--prefetch-l2`` adds, for pdl and persist, one bulk L2 prefetch of each row block's whole weights before the
wait (the "weights streamed independently of the dependencies" of section 3, one block deep).

Reported per execution: total us, us per op, GB/s against the total weight bytes, and ``us per op - floor``
(the floor: ``read``'s time per op), i.e. what each op costs beyond streaming its bytes. If ``persist`` brings
that close to zero while ``plain`` / ``pdl`` pay several us, the boundary cost is the launch structure and the
design of section 3 removes it; if ``persist`` pays the same, the cost lies elsewhere.

All executions run the same device function per row block (:func:`_block_rest`), so ``pdl`` equals ``plain`` bit
for bit (checked) and ``persist`` should too (reported). Every execution's intermediates are checked against a
float64 reference (see :data:`LOCAL_TOL`, :func:`chain_tol`).

    python scripts/bench_chain.py [--shapes 2560x16384,16384x2560] [--layers 32] [--bn 16] [--bk 512]
        [--num-warps 4] [--programs-per-sm 1] [--reps 100] [--only plain,pdl,persist,read] [--out DIR --name NAME]
        [--stream-rows 16 --stream-cps 4 --stream-stages 0 --stream-warps 4 --stream-consumer fma]   # with --only ...,stream
    TRITON_INTERPRET=1 python scripts/bench_chain.py --device cpu --shapes 64x128,128x64 --layers 4 --bn 16 --bk 32
    python scripts/bench_chain.py --ptx      # no GPU: compile the kernels for sm_90, check the PTX's ordering

``--device cpu`` runs plain, pdl (no ``griddepcontrol``: the interpreter has no PTX) and read in Triton's
interpreter, as a check of the maths and the reference; it cannot run ``persist`` (see :func:`run_persist`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))          # ptxas_util, chain_stream (imported where needed)

from bytebound.kernels.registry import optional_triton  # noqa: E402

triton, tl, _TRITON_ERR = optional_triton()

EXECUTIONS = ("plain", "pdl", "persist", "read", "flag", "flaglate", "stream", "streamfree")
DEFAULT_SHAPES = "2560x16384,16384x2560"
META = 8                # int64 words per op in the persistent kernel's op table (see Chain.meta)
WEIGHTS = "synthetic (random FP8)"

# Per-op check (each op against a float64 product of the SAME execution's own input x_i): the kernel's y is
# bf16(float32 sum), the reference bf16(float64 sum). The two pre-rounding values differ only by float32
# accumulation error (typically ~sqrt(K) * 2^-24 relative, ~1e-5 at K = 16384), so the rounded values differ by
# at most one bf16 ulp of the element (<= 2^-7 of it) plus that: 2^-6 of max|ref| leaves a margin of 2 over the
# rounding term, and a wrong tile, a stale or unwritten block (NaN-filled before each run) gives O(1).
LOCAL_TOL = 2.0 ** -6


def chain_tol(i: int) -> float:
    """Bound on ``max|y_i - ref_i| / max|ref_i|`` against the float64 reference CHAIN (every ``x_{i+1}`` the
    reference's own ``bf16(y_i)``). Once a single bf16 rounding of the two chains differs (one ulp, 2^-8..2^-7
    relative), the difference propagates through the later ops (the scales keep the maps' gain ~1) and each further
    rounding adds at most independent noise of RMS ~ulp / sqrt(6) per op: a random walk of ~0.35 * 2^-7 * sqrt(i)
    even if the two chains rounded independently from op 0 on. The bound ``2^-7 * sqrt(i + 1)`` is ~3x that (a
    simulation of the same chain in float32 vs float64 stays below 0.4 of it at L = 32); errors of real bugs are
    O(1)."""
    return 2.0 ** -7 * math.sqrt(i + 1)


class ShapeError(ValueError):
    """The ``--shapes`` / ``--layers`` / tile settings do not make a valid chain."""


def parse_shapes(spec: str, layers: int) -> list[tuple[int, int]]:
    """``"KxN,KxN,..."`` repeated to ``layers`` ops -> ``[(K_i, N_i)]``.

    Raises:
        ShapeError: a malformed entry, ``layers < 1``, or an op whose K differs from the previous op's N (the
            output of op i is the input of op i + 1)."""
    pattern = []
    for part in spec.split(","):
        try:
            k, n = (int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            raise ShapeError(f"--shapes entry {part!r} is not KxN (e.g. 2560x16384)") from None
        if k < 1 or n < 1:
            raise ShapeError(f"--shapes entry {part!r}: K and N must be positive")
        pattern.append((k, n))
    if layers < 1:
        raise ShapeError(f"--layers must be >= 1, got {layers}")
    ops = [pattern[i % len(pattern)] for i in range(layers)]
    for i in range(1, layers):
        if ops[i][0] != ops[i - 1][1]:
            raise ShapeError(f"op {i} ({ops[i][0]}x{ops[i][1]}) has K = {ops[i][0]} but op {i - 1} "
                             f"({ops[i - 1][0]}x{ops[i - 1][1]}) produces N = {ops[i - 1][1]} values: the output of "
                             f"op i is the input of op i + 1, so each K must equal the previous N (--shapes {spec!r} "
                             f"repeated to --layers {layers})")
    return ops


def check_tiles(ops: list[tuple[int, int]], bn: int, bk: int) -> None:
    """BN, BK powers of two (Triton block shapes), BK >= 16 (16-byte weight loads), every N a multiple of BN and
    every K of BK (the kernels have no masks: every tile is whole). Raises ShapeError."""
    for name, v, lo in (("--bn", bn, 1), ("--bk", bk, 16)):
        if v < lo or v & (v - 1):
            raise ShapeError(f"{name} must be a power of two >= {lo}, got {v}")
    for i, (k, n) in enumerate(ops):
        if n % bn or k % bk:
            raise ShapeError(f"op {i} ({k}x{n}): N must be a multiple of --bn {bn} and K of --bk {bk}")


if tl is not None:
    from bytebound.kernels.pdl import gdc as _gdc       # griddepcontrol.* by every thread (kernels/pdl.py)
    from bytebound.kernels.pdl import l2_prefetch as _l2_prefetch   # one cp.async.bulk.prefetch.L2 per program

    @triton.jit
    def _first_tile(w_ptr, blk, K, BN: tl.constexpr, BK: tl.constexpr):
        """Chunk 0 (columns ``0..BK-1``) of row block ``blk`` of the E4M3 weight ``w [N, K]``: ``[BN, BK]`` E4M3.
        Weights are never written, so this load may be issued before any dependency wait."""
        rows = blk * BN + tl.arange(0, BN)
        return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + tl.arange(0, BK)[None, :])

    @triton.jit
    def _to_bf16(y, HW: tl.constexpr):
        """float32 -> bf16, round to nearest even. ``HW``: the hardware conversion (``cvt.rn.bf16.f32``). Else
        (Triton's interpreter, whose ``.to(tl.bfloat16)`` truncates and whose ``rtne`` mode drops the carry into
        the exponent) the same rounding on the bits, identical for finite values."""
        if HW:
            out = y.to(tl.bfloat16)
        else:
            u = y.to(tl.uint32, bitcast=True)
            out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return out

    @triton.jit
    def _block_rest(w, w_ptr, s_ptr, x_ptr, y_ptr, blk, K, BN: tl.constexpr, BK: tl.constexpr, HW: tl.constexpr):
        """Rows ``blk*BN .. +BN`` of ``y = bf16(s * (w @ x))``, given their chunk 0 ``w`` (:func:`_first_tile`).

        ``w_ptr`` E4M3 ``[N, K]`` row-major, ``s_ptr`` float32 ``[N]``, ``x_ptr`` bf16 ``[K]``, ``y_ptr`` bf16 ``[N]``;
        ``K`` a multiple of ``BK``. Float32 products accumulate in a ``[BN, BK]`` tile over the K chunks, summed
        over columns at the end (a fixed order: every execution that calls this gets the same bits). Each chunk's
        weights and activations are requested one chunk ahead (a register double buffer), so they are in flight
        while the previous chunk is multiplied. x is read with ``.cg`` (L2, not L1): in ``persist`` it was written
        by other SMs during this kernel. ``HW``: compiled for a GPU (:func:`_to_bf16`)."""
        rows = blk * BN + tl.arange(0, BN)
        kk = tl.arange(0, BK)
        wp = w_ptr + rows[:, None].to(tl.int64) * K + kk[None, :]
        acc = tl.zeros([BN, BK], tl.float32)
        x = tl.load(x_ptr + kk, cache_modifier=".cg")
        for k0 in range(BK, K, BK):
            wn = tl.load(wp + k0)
            xn = tl.load(x_ptr + k0 + kk, cache_modifier=".cg")
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w = wn
            x = xn
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1) * tl.load(s_ptr + rows)
        tl.store(y_ptr + rows, _to_bf16(y, HW))

    @triton.jit
    def _gemv_op(w_ptr, s_ptr, x_ptr, y_ptr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GDC: tl.constexpr, PF: tl.constexpr, HW: tl.constexpr, NT: tl.constexpr):
        """One op of the chain, ``plain`` / ``pdl``: program ``b`` computes rows ``b*BN .. +BN`` of
        ``y bf16 [N] = bf16(s * (w @ x))`` (``w`` E4M3 ``[N, K]``, ``s`` float32 ``[N]``, ``x`` bf16 ``[K]``).

        ``GDC`` (launched with ``launch_pdl``): ``griddepcontrol.launch_dependents`` first (the next op's kernel may
        launch now; its own wait still waits for this grid to complete and flush), then the first weight tile (read
        only), then ``griddepcontrol.wait`` (the previous op's y complete and visible) before x is read and y
        written. Without it the same loads run in the same order with no wait (a plain launch starts only after the
        previous kernel completed). ``PF`` (``--prefetch-l2``, with ``GDC``): also one bulk L2 prefetch of the whole
        block's ``BN * K`` weight bytes (contiguous rows) before the wait. ``HW``: compiled for a GPU, not
        interpreted. ``NT``: 32 * num_warps."""
        blk = tl.program_id(0)
        if GDC:
            _gdc("griddepcontrol.launch_dependents; mov.u32 $0, 0;", NT)
        w = _first_tile(w_ptr, blk, K, BN, BK)
        if PF:
            _l2_prefetch(w_ptr + blk.to(tl.int64) * (BN * K), BN * K, NT)
        if GDC:
            _gdc("griddepcontrol.wait; mov.u32 $0, 0;", NT)
        _block_rest(w, w_ptr, s_ptr, x_ptr, y_ptr, blk, K, BN, BK, HW)

    @triton.jit
    def _wait_count(cnt_ptr, need, dead, err_ptr, op, MAX_POLLS: tl.constexpr):
        """Spin until ``*cnt_ptr >= need`` (int32; acquire, GPU scope), at most ``MAX_POLLS`` polls. Returns
        ``dead``: 1 once this program has timed out, after which it never spins again (so one starved dependency
        costs one timeout, not one per later wait). On a timeout: ``err[0] += 1``, ``err[1] = max(err[1], op)``.

        Memory model: the producer of each block did ``bar.sync`` (all its threads' y stores ordered before its
        thread 0) then a release add on the counter; the acquire read here that observes the count ``need``
        synchronises with every one of those adds (each is an atomic read-modify-write, so the value read lies in the
        release sequence of every earlier add), so the y stores of every block counted happen before this thread's
        later reads; the
        barrier after the loop extends that to every thread of this program (the same pattern as CUTLASS's
        semaphores). Triton runs a scalar atomic in one thread and broadcasts its result through shared memory, so
        the loop condition is uniform across the program (no warp leaves the loop alone)."""
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        polls = 1
        while (seen < need) & (dead == 0) & (polls < MAX_POLLS):
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            polls += 1
        if (seen < need) & (dead == 0):
            tl.atomic_add(err_ptr, 1, sem="relaxed", scope="gpu")
            tl.atomic_max(err_ptr + 1, op, sem="relaxed", scope="gpu")
            dead = dead + 1
        tl.debug_barrier()          # every thread's x loads come after thread 0's acquire
        return dead

    @triton.jit
    def _chain_persist(w_ptr, s_ptr, act_ptr, meta_ptr, cnt_ptr, err_ptr, L: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, MAX_POLLS: tl.constexpr, META_W: tl.constexpr, ACT_ALIGN: tl.constexpr,
                       PF: tl.constexpr, HW: tl.constexpr, NT: tl.constexpr):
        """The whole chain in one persistent launch (grid: all programs co-resident, see :func:`run_persist`).

        ``w_ptr`` E4M3, every op's ``[N_i, K_i]`` weight back to back; ``s_ptr`` float32, the scales back to back;
        ``act_ptr`` bf16 ``[K_0 + sum N_i]``: x_0 then y_0, y_1, ...; ``meta_ptr`` int64 ``[L, META_W]`` per op:
        weight byte offset, scale offset, x offset, y offset (elements), K, row blocks ``N/BN``, row blocks of the
        previous op (0 for op 0); ``cnt_ptr`` int32 ``[L]`` zeroed before the launch: row blocks of op i stored;
        ``err_ptr`` int32 ``[2]``: timeouts and the last op that timed out (:func:`_wait_count`). The offsets are
        multiples of 16 bytes (weights), BN (scales) and ``ACT_ALIGN`` = min(BN, BK) (activations) by construction
        (:func:`make_chain`, :func:`check_tiles`); the hints keep the loads vectors. ``PF``: one bulk L2 prefetch of
        the block's ``BN * K`` weight bytes before the wait (``--prefetch-l2``). ``NT``: 32 * num_warps.

        Program p takes the row blocks b = p, p + P, p + 2P, ... of op 0, then the same of op 1, and so on (P the
        grid). Per block: its first weight tile (independent of the chain) is requested, THEN the program waits
        until ``cnt[i-1] >= blocks(i-1)`` (all of x_i stored), reads x_i, finishes the block (:func:`_block_rest`),
        and signals: a CTA barrier (all threads' y stores issued and ordered before thread 0) then a release add on
        ``cnt[i]``.
        No deadlock when all P programs are resident: a program waiting at op i has finished its own blocks of
        every earlier op, so by induction over i every block of op i - 1 completes. A program that timed out still
        computes (garbage) and signals its blocks, so the others are not starved by it and the kernel ends; the host
        sees ``err`` and raises (:func:`persist_check`)."""
        pid = tl.program_id(0)
        npg = tl.num_programs(0)
        dead = pid * 0
        for i in range(L):
            m = meta_ptr + i * META_W
            w_i = w_ptr + tl.multiple_of(tl.load(m), 16)
            s_i = s_ptr + tl.multiple_of(tl.load(m + 1), BN)
            x_i = act_ptr + tl.multiple_of(tl.load(m + 2), ACT_ALIGN)
            y_i = act_ptr + tl.multiple_of(tl.load(m + 3), ACT_ALIGN)
            K = tl.multiple_of(tl.load(m + 4).to(tl.int32), BK)
            nb = tl.load(m + 5).to(tl.int32)
            need = tl.load(m + 6).to(tl.int32)
            for blk in range(pid, nb, npg):
                w = _first_tile(w_i, blk, K, BN, BK)
                if PF:
                    _l2_prefetch(w_i + blk.to(tl.int64) * BN * K, BN * K, NT)
                if i > 0:
                    dead = _wait_count(cnt_ptr + (i - 1), need, dead, err_ptr, i, MAX_POLLS)
                _block_rest(w, w_i, s_i, x_i, y_i, blk, K, BN, BK, HW)
                tl.debug_barrier()      # release cumulativity covers the stores the barrier ordered before it
                tl.atomic_add(cnt_ptr + i, 1, sem="release", scope="gpu")

    @triton.jit
    def _gemv_flag(w_ptr, s_ptr, x_ptr, y_ptr, cnt_ptr, err_ptr, need, op, K: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, FIRST: tl.constexpr, LATE: tl.constexpr, MAX_POLLS: tl.constexpr,
                   HW: tl.constexpr, NT: tl.constexpr):
        """One op of the ``flag`` / ``flaglate`` executions: program ``b`` computes rows ``b*BN .. +BN`` of ``y =
        bf16(s * (w @ x))`` as :func:`_gemv_op` does, with its dependency on the previous op carried by counters:
        ``cnt_ptr[0]`` counts the previous op's stored row blocks (the program spins until it reaches ``need``,
        :func:`_wait_count`), ``cnt_ptr[1]`` this op's (a CTA barrier, then one release add per program).

        ``FIRST`` (op 0): no counter to wait for; ``griddepcontrol.wait`` instead, so the counters' reset by the
        plain node before it is complete and visible before op 1 may launch. ``LATE``: ``launch_dependents`` after
        the wait (one op of lookahead) instead of at the top. ``HW``: compiled for a GPU (on CPU neither
        ``griddepcontrol`` instruction is issued: the interpreter has no PTX, and runs the launches in order)."""
        blk = tl.program_id(0)
        if HW and FIRST:
            _gdc("griddepcontrol.wait; mov.u32 $0, 0;", NT)
        if HW and not LATE:
            _gdc("griddepcontrol.launch_dependents; mov.u32 $0, 0;", NT)
        w = _first_tile(w_ptr, blk, K, BN, BK)
        if not FIRST:
            _wait_count(cnt_ptr, need, blk * 0, err_ptr, op, MAX_POLLS)
        if HW and LATE:
            _gdc("griddepcontrol.launch_dependents; mov.u32 $0, 0;", NT)
        _block_rest(w, w_ptr, s_ptr, x_ptr, y_ptr, blk, K, BN, BK, HW)
        tl.debug_barrier()          # release cumulativity covers the stores the barrier ordered before it
        tl.atomic_add(cnt_ptr + 1, 1, sem="release", scope="gpu")

    @triton.jit
    def _read_all(words_ptr, out_ptr, n, STEP: tl.constexpr, STEPS: tl.constexpr):
        """The floor: program j XORs the int32 words ``[j*STEP*STEPS, (j+1)*STEP*STEPS)`` of ``words [n]`` (the
        weights of every op, back to back) in STEPS chunks of STEP words (one GEMV tile: BN*BK bytes), the next
        chunk requested before the current one is folded in (as in :func:`_block_rest`), and stores the XOR to
        ``out int32 [grid]`` (checked against the host's, so nothing is optimised away or read twice)."""
        pid = tl.program_id(0)
        offs = tl.arange(0, STEP)
        base = pid.to(tl.int64) * (STEP * STEPS)
        acc = tl.zeros([STEP], tl.int32)
        cur = tl.load(words_ptr + base + offs, mask=base + offs < n, other=0)
        for c in range(1, STEPS):
            o = base + c * STEP + offs
            nxt = tl.load(words_ptr + o, mask=o < n, other=0)
            acc ^= cur
            cur = nxt
        acc ^= cur
        tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


@dataclass
class Config:
    """Tile and launch settings shared by every execution."""
    bn: int = 16
    bk: int = 512
    num_warps: int = 4
    programs_per_sm: int = 1
    max_polls: int = 2 ** 24
    read_steps: int = 0             # 0: the plain launches' mean K chunks per program
    prefetch_l2: bool = False       # pdl / persist: bulk L2 prefetch of each block's weights before the wait
    cooperative: bool = True
    stream_rows: int = 16           # stream: rows per tile and row block (R)
    stream_cps: int = 4             # stream: tiles per ring stage (one mbarrier and one TMA copy each)
    stream_stages: int = 0          # stream: ring stages (0: as many as fit in shared memory, at most 64)
    stream_warps: int = 4
    stream_consumer: str = "fma"    # stream: how a ring stage is multiplied (chain_stream.CONSUMERS)
    stream_ksplit: int = 1          # stream (mma): K parts per row block (items per op = blocks x this)


@dataclass
class Chain:
    """The chain's static buffers on one device.

    ``w`` E4M3 ``[sum N_i K_i]`` (op i's ``[N_i, K_i]`` row-major at ``w_off[i]`` bytes), ``s`` float32
    ``[sum N_i]``, ``act`` bf16 ``[K_0 + sum N_i]`` (x_0 at 0, y_i at ``y_off[i]``; y_i is x_{i+1}), ``meta`` int64
    ``[L, META]`` (:func:`_chain_persist`'s op table). With N multiples of BN and K of BK >= 16
    (:func:`check_tiles`), weight offsets are multiples of 16 bytes, scale offsets of BN elements and activation
    offsets of min(BN, BK) elements: the alignment the persistent kernel's hints claim."""
    ops: list[tuple[int, int]]
    w: torch.Tensor
    s: torch.Tensor
    act: torch.Tensor
    w_off: list[int]
    s_off: list[int]
    y_off: list[int]
    meta: torch.Tensor
    bn: int

    @property
    def weight_bytes(self) -> int:
        return self.w.numel()

    def x_off(self, i: int) -> int:
        return 0 if i == 0 else self.y_off[i - 1]

    def weight(self, i: int) -> torch.Tensor:
        k, n = self.ops[i]
        return self.w[self.w_off[i]:self.w_off[i] + n * k].view(n, k)

    def scale(self, i: int) -> torch.Tensor:
        return self.s[self.s_off[i]:self.s_off[i] + self.ops[i][1]]

    def x(self, i: int) -> torch.Tensor:
        return self.act[self.x_off(i):self.x_off(i) + self.ops[i][0]]

    def y(self, i: int) -> torch.Tensor:
        return self.act[self.y_off[i]:self.y_off[i] + self.ops[i][1]]

    def outputs(self) -> list[torch.Tensor]:
        """Copies of every y_i (bf16 ``[N_i]``)."""
        return [self.y(i).clone() for i in range(len(self.ops))]

    def poison(self) -> None:
        """NaN into every y buffer (x_0 kept): a block an execution fails to write, or reads before it is written,
        shows up as NaN in the checks."""
        self.act[self.ops[0][0]:].fill_(float("nan"))


def make_chain(ops: list[tuple[int, int]], device: torch.device, bn: int, seed: int = 0) -> Chain:
    """Random weights from a seeded generator: E4M3 of N(0, 1) (|w| <= 448 never clips at 5 sigma) and per-row
    scales ``U(0.75, 1.25) / sqrt(K)``, so each op maps an O(1) input to an O(1) output (the rows' variance is
    ``K * E[w^2] * E[x^2] * s^2 ~ E[x^2]``) and the activations stay O(1) along any chain; x_0 BF16 N(0, 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w_off, s_off, y_off = [], [], []
    wb = sb = 0
    ab = ops[0][0]
    for k, n in ops:
        w_off.append(wb)
        s_off.append(sb)
        y_off.append(ab)
        wb += n * k
        sb += n
        ab += n
    w = torch.empty(wb, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty(sb, dtype=torch.float32, device=device)
    for i, (k, n) in enumerate(ops):
        w[w_off[i]:w_off[i] + n * k] = torch.randn(n * k, generator=g, device=device).to(torch.float8_e4m3fn)
        s[s_off[i]:s_off[i] + n] = (0.75 + 0.5 * torch.rand(n, generator=g, device=device)) / math.sqrt(k)
    act = torch.empty(ab, dtype=torch.bfloat16, device=device)
    act[:ops[0][0]] = torch.randn(ops[0][0], generator=g, device=device).to(torch.bfloat16)
    rows = []
    for i, (k, n) in enumerate(ops):
        rows.append([w_off[i], s_off[i], 0 if i == 0 else y_off[i - 1], y_off[i], k, n // bn,
                     0 if i == 0 else ops[i - 1][1] // bn, 0])
    meta = torch.tensor(rows, dtype=torch.int64, device=device)
    return Chain(ops, w, s, act, w_off, s_off, y_off, meta, bn)


def dequant64(chain: Chain, i: int) -> torch.Tensor:
    """``W_i`` as float64 ``[N, K]`` with its row scale applied."""
    return chain.weight(i).float().double() * chain.scale(i).double()[:, None]


def chain_reference(chain: Chain) -> list[torch.Tensor]:
    """The float64 chain: ``y_i = W_i(float64, scaled) @ x_i`` with ``x_0`` the BF16 input and ``x_{i+1} =
    bf16(y_i)`` rounded from the float64 value (the kernels round their float32 sums the same way, RNE). Returns the
    rounded ``y_i`` as float64 ``[N_i]``."""
    x = chain.x(0).double()
    out = []
    for i in range(len(chain.ops)):
        y = (dequant64(chain, i) @ x).to(torch.bfloat16).double()
        out.append(y)
        x = y
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|y - ref| / max|ref|``; inf when y has a NaN/inf (an unwritten or raced block)."""
    y = y.double()
    if not torch.isfinite(y).all():
        return math.inf
    return ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_fixed_input(chain: Chain, ys: list[torch.Tensor], x: torch.Tensor) -> dict:
    """``streamfree``: every op's y against the float64 product of its weight with the one fixed input ``x`` (its
    first K_i values), within :data:`LOCAL_TOL` (:func:`rel_err`). Returns ``ok`` and the worst error."""
    errs = [rel_err(y, (dequant64(chain, i) @ x[:k].double()).to(torch.bfloat16).double())
            for i, ((k, _), y) in enumerate(zip(chain.ops, ys))]
    return {"ok": max(errs) <= LOCAL_TOL, "local_err_max": max(errs), "local_err_max_over_bound": max(errs) / LOCAL_TOL}


def check_outputs(chain: Chain, ys: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """Every y_i of one execution against the float64 chain (:func:`chain_tol`) and against a float64 product of
    the execution's own input (:data:`LOCAL_TOL`). Returns the worst ratios to the bounds and ``ok``."""
    chain_r, local_r, chain_e, local_e = [], [], [], []
    x = chain.x(0).double()
    for i, y in enumerate(ys):
        e = rel_err(y, ref[i])
        loc = rel_err(y, (dequant64(chain, i) @ x).to(torch.bfloat16).double())
        chain_e.append(e)
        local_e.append(loc)
        chain_r.append(e / chain_tol(i))
        local_r.append(loc / LOCAL_TOL)
        x = y.double()
    return {"ok": max(chain_r) <= 1.0 and max(local_r) <= 1.0,
            "chain_err_final": chain_e[-1], "chain_err_max_over_bound": max(chain_r),
            "local_err_max": max(local_e), "local_err_max_over_bound": max(local_r)}


def _events(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` timed calls (CUDA events, ``analysis.bandwidth``), after warm-up."""
    from bytebound.analysis.bandwidth import cuda_event_times
    return statistics.median(cuda_event_times(fn, reps, warmup=5))


def run_plain(chain: Chain, cfg: Config, pdl: bool) -> None:
    """Launch the L op kernels (``pdl``: with ``launch_pdl`` and ``griddepcontrol``; on CPU neither exists and
    this is ``plain``)."""
    gdc = pdl and chain.w.device.type == "cuda"
    extra = {"launch_pdl": True} if gdc else {}
    for i, (k, n) in enumerate(chain.ops):
        _gemv_op[(n // cfg.bn,)](chain.weight(i), chain.scale(i), chain.x(i), chain.y(i), K=k, BN=cfg.bn, BK=cfg.bk,
                                 GDC=gdc, PF=gdc and cfg.prefetch_l2, HW=chain.w.device.type == "cuda",
                                 NT=32 * cfg.num_warps, num_warps=cfg.num_warps, num_stages=1, **extra)


@dataclass
class Persist:
    """The persistent execution's state: counters int32 ``[L]``, error words int32 ``[2]``, the grid."""
    cnt: torch.Tensor
    err: torch.Tensor
    grid: int
    cooperative: bool
    fit_per_sm: int | None = None
    regs: int | None = None


def persist_setup(chain: Chain, cfg: Config, programs: int | None = None) -> Persist:
    """Counters, error words and the grid of the persistent kernel.

    Co-residency is required: a program spinning on ``cnt[i-1]`` holds its SM slot, so if a program that owns one
    of op i-1's blocks were not yet scheduled (waiting for a slot that only a finished program frees) it would
    never run and the spinners never finish. On CUDA the grid is ``programs_per_sm`` x SMs and must not exceed
    what the compiled kernel's registers and shared memory let reside per SM (``triton_moe_persist.programs_per_sm``,
    the CUDA occupancy rules); the launch is cooperative where the driver accepts it (it then refuses a grid that
    cannot be co-resident instead of hanging). ``programs``: override the grid (the CPU test: 1 or 2).

    Raises:
        ShapeError: the grid cannot be co-resident."""
    dev = chain.w.device
    cnt = torch.zeros(len(chain.ops), dtype=torch.int32, device=dev)
    err = torch.zeros(2, dtype=torch.int32, device=dev)
    st = Persist(cnt, err, programs or 1, cfg.cooperative and dev.type == "cuda")
    if dev.type != "cuda":
        return st
    from bytebound.kernels.triton_moe_persist import programs_per_sm
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    k = _chain_persist.warmup(*_persist_args(chain, st), **_persist_consts(chain, cfg), num_warps=cfg.num_warps,
                              num_stages=1, grid=(1,), **_coop(st))
    k._init_handles()           # loads the binary: its register count
    st.regs = k.n_regs
    st.fit_per_sm = programs_per_sm(k.n_regs, k.metadata.shared, cfg.num_warps)
    if cfg.programs_per_sm > st.fit_per_sm:
        raise ShapeError(f"--programs-per-sm {cfg.programs_per_sm}: only {st.fit_per_sm} programs of the persistent "
                         f"kernel fit on an SM ({k.n_regs} registers, {k.metadata.shared} B shared memory, "
                         f"{cfg.num_warps} warps); its spin waits need every program resident")
    st.grid = programs or cfg.programs_per_sm * sms
    assert st.grid <= sms * st.fit_per_sm, (st.grid, sms, st.fit_per_sm)
    return st


def _coop(st: Persist) -> dict:
    """Triton's launch option for a cooperative launch (a compile option too: warm-up and run must agree)."""
    return {"launch_cooperative_grid": True} if st.cooperative else {}


def _persist_args(chain: Chain, st: Persist):
    return chain.w, chain.s, chain.act, chain.meta, st.cnt, st.err


def _persist_consts(chain: Chain, cfg: Config) -> dict:
    hw = chain.w.device.type == "cuda"
    return dict(L=len(chain.ops), BN=cfg.bn, BK=cfg.bk, MAX_POLLS=cfg.max_polls, META_W=META,
                ACT_ALIGN=min(cfg.bn, cfg.bk), PF=hw and cfg.prefetch_l2, HW=hw, NT=32 * cfg.num_warps)


def run_persist(chain: Chain, cfg: Config, st: Persist) -> None:
    """Zero the counters (one node in a captured graph) and launch the persistent kernel.

    Not runnable in Triton's interpreter with more than one program: it runs the programs one after another, so
    program 0 spins at op 1 on blocks that program 1 has not computed yet (it times out and the run is reported
    as failed). A one-program grid runs there (no wait ever blocks), which checks the op table, the round robin
    and the counters, not the waits."""
    st.cnt.zero_()
    _chain_persist[(st.grid,)](*_persist_args(chain, st), **_persist_consts(chain, cfg), num_warps=cfg.num_warps,
                               num_stages=1, **_coop(st))


def _check_counters(chain: Chain, st: Persist, name: str, why: str) -> None:
    """No spin wait of execution ``name`` timed out (``why``: the likely cause, appended to the message) and the last
    L counters equal the ops' row blocks (each block signalled once).

    Raises:
        RuntimeError: a spin wait timed out or a counter is off."""
    err = st.err.tolist()
    if err[0]:
        raise RuntimeError(f"{name}: {err[0]} spin wait(s) timed out after the poll limit (last at op {err[1]})"
                           f"{why}; the outputs of this run are garbage")
    want = [n // chain.bn for _, n in chain.ops]
    got = st.cnt.tolist()[-len(chain.ops):]
    if got != want:
        raise RuntimeError(f"{name}: counters {got} after the run, expected the row blocks per op {want}")


def persist_check(chain: Chain, st: Persist) -> None:
    """After a run: no wait timed out and every counter equals its op's row blocks (each block signalled once).

    Raises:
        RuntimeError: a spin wait timed out (programs not co-resident, or a lost signal) or a counter is off."""
    _check_counters(chain, st, "persist", f": the {st.grid} programs were not all resident at once, or a block's "
                    "signal was lost")


def flag_setup(chain: Chain) -> Persist:
    """Counters int32 ``[L + 1]`` (``cnt[i + 1]``: op i's stored row blocks; ``cnt[0]`` unused) and error words
    for the ``flag`` executions; the grid field is unused (one launch per op)."""
    dev = chain.w.device
    return Persist(torch.zeros(len(chain.ops) + 1, dtype=torch.int32, device=dev),
                   torch.zeros(2, dtype=torch.int32, device=dev), 0, False)


def run_flag(chain: Chain, cfg: Config, st: Persist, late: bool) -> None:
    """Zero the counters (a plain node), then launch the L op kernels with ``launch_pdl`` (:func:`_gemv_flag`).

    No deadlock: a kernel launched early spins only on its predecessor, and it can launch only once every program
    of its predecessor has started (issued ``launch_dependents``), so every op it waits for is entirely resident
    or done; op 0 waits for nothing."""
    hw = chain.w.device.type == "cuda"
    extra = {"launch_pdl": True} if hw else {}
    st.cnt.zero_()
    for i, (k, n) in enumerate(chain.ops):
        need = chain.ops[i - 1][1] // cfg.bn if i else 0
        _gemv_flag[(n // cfg.bn,)](chain.weight(i), chain.scale(i), chain.x(i), chain.y(i), st.cnt[i:], st.err,
                                   need, i, K=k, BN=cfg.bn, BK=cfg.bk, FIRST=i == 0, LATE=late,
                                   MAX_POLLS=cfg.max_polls, HW=hw, NT=32 * cfg.num_warps, num_warps=cfg.num_warps,
                                   num_stages=1, **extra)


def flag_check(chain: Chain, st: Persist) -> None:
    """After a ``flag`` run: no wait timed out and op i's counter (``cnt[i + 1]``) equals its row blocks.

    Raises:
        RuntimeError: a spin wait timed out or a counter is off."""
    _check_counters(chain, st, "flag", "")


def read_steps(chain: Chain, cfg: Config) -> int:
    """Chunks per ``read`` program: ``--read-steps``, else the plain launches' mean (total BN x BK tiles over
    total programs), so a read program reads what a typical GEMV program reads."""
    if cfg.read_steps:
        return cfg.read_steps
    tiles = sum(n * k for k, n in chain.ops) // (cfg.bn * cfg.bk)
    progs = sum(n // cfg.bn for _, n in chain.ops)
    return max(1, round(tiles / progs))


def run_read(chain: Chain, cfg: Config, out: torch.Tensor, steps: int) -> None:
    words = chain.w.view(torch.int32)
    step = cfg.bn * cfg.bk // 4
    _read_all[(out.numel(),)](words, out, words.numel(), STEP=step, STEPS=steps, num_warps=cfg.num_warps,
                              num_stages=1)


def xor_all(t: torch.Tensor) -> int:
    """XOR of every int32 of ``t`` (pairwise halving on its device)."""
    t = t.reshape(-1)
    while t.numel() > 1:
        if t.numel() % 2:
            t = torch.cat([t, t.new_zeros(1)])
        h = t.numel() // 2
        t = t[:h] ^ t[h:]
    return int(t.item())


def time_execution(fn, device: torch.device, reps: int) -> tuple[float, str]:
    """Seconds per call of ``fn`` (the whole chain): CUDA-graph replays timed with events on CUDA (median of
    ``reps``); on CPU the interpreter's wall time (median of ``reps`` calls, not a GPU figure)."""
    if device.type == "cuda":
        from bytebound.runner.graphs import capture_graph
        g, _ = capture_graph(fn, warmup=2)
        return _events(g.replay, reps), "cuda graph replay, cudaEvent median"
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), "interpreter wall time (not a GPU measurement)"


def _replay_check(chain: Chain, fn, device: torch.device, want: list[torch.Tensor], poison=None,
                  outputs=None) -> bool:
    """Capture ``fn`` in a fresh graph, NaN the y buffers, replay once: the outputs equal ``want`` bit for bit
    (a replay that read a y before it was written would read NaN). ``poison`` / ``outputs``: where an execution
    writes its ys elsewhere (``streamfree``), its own (default: the chain's)."""
    from bytebound.runner.graphs import capture_graph
    g, _ = capture_graph(fn, warmup=1)
    (poison or chain.poison)()
    g.replay()
    torch.cuda.synchronize(device)
    return all(torch.equal(a, b) for a, b in zip((outputs or chain.outputs)(), want))


PERSIST_CPU_SKIP = ("Triton's interpreter runs the programs one after another, so a program spinning on another "
                    "program's counter never sees it move; persist needs a GPU (a one-program grid runs in "
                    "tests/test_bench_chain.py)")


def _pdl_unavailable(dev: torch.device, rec: dict) -> bool:
    """On a CUDA device without PDL (compute capability < 9.0): records why in ``rec["skipped"]`` and returns True.
    False on CPU (the interpreter runs the same maths without ``griddepcontrol``) and on PDL-capable GPUs."""
    if dev.type == "cuda":
        from bytebound.kernels.pdl import capable
        if not capable(dev):
            rec["skipped"] = "PDL needs compute capability >= 9.0"
            return True
    return False


def _execution(name: str, chain: Chain, cfg: Config, rec: dict):
    """``(fn, state)`` for one execution: ``fn()`` runs the whole chain once; ``state`` the :class:`Persist` or
    the read kernel's output buffer. Returns ``(None, None)`` with ``rec["skipped"]`` set when it cannot run here."""
    dev = chain.w.device
    if name in ("plain", "pdl"):
        pdl = name == "pdl"
        if pdl and _pdl_unavailable(dev, rec):
            return None, None
        if pdl and dev.type != "cuda":
            rec["notes"].append("cpu: no griddepcontrol/launch_pdl (the interpreter has no PTX): the same kernel "
                                "maths as plain")
        return (lambda: run_plain(chain, cfg, pdl)), None
    if name in ("flag", "flaglate"):
        if _pdl_unavailable(dev, rec):
            return None, None
        if dev.type != "cuda":
            rec["notes"].append("cpu: no griddepcontrol (the interpreter has no PTX; it runs the launches in "
                                "order, so no wait blocks): checks the counters' bookkeeping and the maths")
        st = flag_setup(chain)
        rec["notes"].append("counters zeroed by one extra node (cnt.zero_()) in the same graph, before op 0; "
                            "its time is included")
        late = name == "flaglate"
        return (lambda: run_flag(chain, cfg, st, late)), st
    if name == "persist":
        if dev.type != "cuda":
            rec["skipped"] = PERSIST_CPU_SKIP
            return None, None
        st = persist_setup(chain, cfg)
        rec.update(grid=st.grid, cooperative=st.cooperative, regs=st.regs, fit_per_sm=st.fit_per_sm)
        rec["notes"].append("counters zeroed by one extra node (cnt.zero_()) in the same graph, before the kernel; "
                            "its time is included")
        rec["notes"].append(f"{cfg.programs_per_sm} program(s) per SM, each with ~2 tiles of {cfg.bn}x{cfg.bk} "
                            f"weight bytes in flight; if persist is bandwidth-bound, sweep --programs-per-sm (up to "
                            f"{st.fit_per_sm} fit)")
        return (lambda: run_persist(chain, cfg, st)), st
    if name in ("stream", "streamfree"):
        return _stream_execution(chain, cfg, rec, dep=name == "stream")
    steps = read_steps(chain, cfg)
    n_prog = -(-chain.w.view(torch.int32).numel() // (cfg.bn * cfg.bk // 4 * steps))
    out = torch.empty(n_prog, dtype=torch.int32, device=dev)
    rec.update(grid=n_prog, steps=steps)
    return (lambda: run_read(chain, cfg, out, steps)), out


STREAM_CPU_SKIP = ("the stream kernel (stream, streamfree) is Gluon with TMA copies and mbarriers, which Triton's "
                   "interpreter cannot run; its host-side plan is checked in tests/test_bench_chain.py, its sm_90 "
                   "compile by --ptx")


def _stream_execution(chain: Chain, cfg: Config, rec: dict, dep: bool = True):
    """``(fn, Stream)`` for ``stream`` (``dep``) or ``streamfree``, or ``(None, None)`` with ``rec["skipped"]``
    where it cannot run.

    Raises:
        ShapeError: the chain does not fit the stream's tiles or shared memory (chain_stream.StreamError)."""
    dev = chain.w.device
    if dev.type != "cuda":
        rec["skipped"] = STREAM_CPU_SKIP
        return None, None
    if torch.cuda.get_device_capability(dev)[0] < 9:
        rec["skipped"] = "TMA and mbarriers need compute capability >= 9.0"
        return None, None
    import chain_stream
    try:
        st = chain_stream.Stream(chain, cfg.stream_rows, cfg.stream_cps, cfg.stream_stages, cfg.stream_warps,
                                 cfg.max_polls, dep=dep, cooperative=cfg.cooperative,
                                 consumer=cfg.stream_consumer, ksplit=cfg.stream_ksplit)
    except chain_stream.StreamError as exc:
        raise ShapeError(str(exc)) from None
    except Exception as exc:        # e.g. the TMA descriptor: recorded, and the other executions still run
        raise ShapeError(f"stream: setup failed: {type(exc).__name__}: {exc}") from exc
    rec.update(grid=st.grid, rows=st.rows, cps=st.cps, stages=st.stages, ring_bytes=st.stages * st.cps * st.rows * 128,
               smem_estimate=st.smem, warps=st.num_warps, consumer=st.consumer, ksplit=st.ksplit)
    rec["notes"].append("counters zeroed by one extra node (cnt.zero_()) in the same graph, before the kernel; "
                        "its time is included")
    if not dep:
        rec["notes"].append("no dependencies: every op reads one fixed input (its own buffer) and no program waits; "
                            "checked per op against float64 of that input (LOCAL_TOL): the stream's and the "
                            "consumer's own rate, to set against stream's")
    rec["notes"].append(f"ring of {st.stages} stages x {st.cps} tiles of {st.rows}x128 bytes "
                        f"({rec['ring_bytes'] // 1024} KB per SM) streamed ahead of the waits; the weights repacked "
                        "into those tiles (a second copy, same bytes)")
    if st.ksplit > 1:
        rec["notes"].append(f"each row block split into {st.ksplit} K parts ({st.ksplit} items per block): float32 "
                            "partials, summed in order by the next op's programs as they stage x; y formed from them "
                            "on the host the same way for the checks")

    def fn():
        st.run(chain)
        rec["regs"] = st.regs

    return fn, st


def _measure(name: str, chain: Chain, fn, state, rec: dict, ref: list[torch.Tensor], reps: int, log) -> list | None:
    """Verify one execution (an eager run over NaN-filled outputs), time it, and on CUDA check that a replay of
    its graph equals the eager run bit for bit. Returns its outputs (None for ``read``).

    Raises:
        RuntimeError: ``persist`` timed out or miscounted (:func:`persist_check`)."""
    dev = chain.w.device
    # the stream's own (its partials with --stream-ksplit; streamfree's own buffer); the chain's for the others
    poison, outputs = ((lambda: state.poison(chain)), (lambda: state.outputs(chain))) \
        if name in ("stream", "streamfree") else (chain.poison, chain.outputs)
    poison()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    ys = None
    check = {"persist": persist_check, "flag": flag_check, "flaglate": flag_check,
             "stream": lambda c, s: s.check(c), "streamfree": lambda c, s: s.check(c)}.get(name)
    if check:
        check(chain, state)
    if name == "read":
        rec["ok"] = xor_all(state) == xor_all(chain.w.view(torch.int32))
        if not rec["ok"]:
            rec["notes"].append("the read kernel's XOR differs from the host's: it missed or re-read words")
    else:
        ys = outputs()
        rec.update(check_fixed_input(chain, ys, state.act) if name == "streamfree" else check_outputs(chain, ys, ref))
    try:
        rec["time_s"], rec["timing"] = time_execution(fn, dev, reps)
    except RuntimeError as exc:
        if name not in ("persist", "stream", "streamfree") or not state.cooperative:
            raise
        # a driver that refuses to capture a cooperative launch: the occupancy check (persist) or the shared memory
        # (stream: one program per SM, a grid of one per SM) still guards co-residency
        log(f"{name}: capturing the cooperative launch failed ({exc}); retrying without the attribute")
        state.cooperative = rec["cooperative"] = False
        rec["time_s"], rec["timing"] = time_execution(fn, dev, reps)
    if check:
        check(chain, state)
    if dev.type == "cuda" and ys is not None:
        rec["replay_equals_eager"] = _replay_check(chain, fn, dev, ys, poison, outputs)
        if check:
            check(chain, state)
        rec["ok"] = rec["ok"] and rec["replay_equals_eager"]
    return ys


def run_all(chain: Chain, cfg: Config, only: list[str], reps: int, log=print) -> dict:
    """Verify and time each execution in ``only``. Returns ``{execution: record}``; a record has ``time_s``,
    ``timing``, the checks (:func:`check_outputs`, ``ok``) and ``notes``, or ``skipped`` (why it cannot run here)
    or ``error`` (a persist timeout / miscount: the other executions still run; :func:`main` raises after the
    report)."""
    ref = chain_reference(chain)
    res: dict = {}
    outs: dict = {}
    for name in only:
        rec: dict = {"notes": []}
        res[name] = rec
        try:
            fn, state = _execution(name, chain, cfg, rec)
        except ShapeError as exc:           # persist: the grid cannot be co-resident
            rec["error"] = str(exc)
            log(f"{name}: {exc}")
            continue
        if fn is None:
            log(f"{name}: skipped: {rec['skipped']}")
            continue
        try:
            ys = _measure(name, chain, fn, state, rec, ref, reps, log)
        except RuntimeError as exc:
            if name not in ("persist", "flag", "flaglate", "stream", "streamfree"):
                raise
            rec["error"], rec["ok"] = str(exc), False
            log(str(exc))
            continue
        if ys is not None:
            outs[name] = ys
    if "plain" in outs and "pdl" in outs:
        res["pdl"]["bit_equal_plain"] = all(torch.equal(a, b) for a, b in zip(outs["plain"], outs["pdl"]))
        res["pdl"]["ok"] = res["pdl"]["ok"] and res["pdl"]["bit_equal_plain"]
    for name in ("persist", "flag", "flaglate", "stream"):
        if "plain" in outs and name in outs:
            res[name]["bit_equal_plain"] = all(torch.equal(a, b) for a, b in zip(outs["plain"], outs[name]))
            if name in ("flag", "flaglate"):    # the same per-block function over the same inputs: bit-equal
                res[name]["ok"] = res[name]["ok"] and res[name]["bit_equal_plain"]
    return res


def summarize(res: dict, chain: Chain) -> None:
    """Add us, us per op, GB/s and us per op over the floor to each timed record."""
    n_ops = len(chain.ops)
    floor = res.get("read", {}).get("time_s")
    for rec in res.values():
        t = rec.get("time_s")
        if t is None:
            continue
        rec["us"] = t * 1e6
        rec["us_per_op"] = t * 1e6 / n_ops
        rec["GBps"] = chain.weight_bytes / t / 1e9
        rec["us_per_op_over_floor"] = (t - floor) * 1e6 / n_ops if floor is not None else None


def _fmt(v, spec: str) -> str:
    """``format(v, spec)``, or ``-`` right-aligned to the spec's width when there is no value."""
    return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0] or 0))


def report(meta: dict, res: dict, log=print) -> None:
    log(f"device {meta['device']}  date {meta['date']}  commit {meta['commit']}  weights {meta['weights']}")
    log(f"shapes {meta['shapes']} (KxN) repeated to L = {meta['L']} ops, {meta['weight_bytes'] / 1e6:.1f} MB of "
        f"weights ({meta['weight_bytes'] / meta['L'] / 1e6:.1f} MB per op on average); BN {meta['config']['bn']}, "
        f"BK {meta['config']['bk']}, {meta['config']['num_warps']} warps, "
        f"{meta['config']['programs_per_sm']} persistent program(s) per SM")
    if meta.get("l2_note"):
        log(meta["l2_note"])
    log(f"{'execution':10s} {'total us':>10s} {'us/op':>8s} {'GB/s':>8s} {'us/op-floor':>12s} "
        f"{'chain err/bound':>16s} {'local err/bound':>16s}  ok")
    for name, rec in res.items():
        if "skipped" in rec or "error" in rec:
            log(f"{name:10s} {'skipped' if 'skipped' in rec else 'ERROR'}: {rec.get('skipped') or rec['error']}")
            continue
        log(f"{name:10s} {_fmt(rec.get('us'), '10.1f')} {_fmt(rec.get('us_per_op'), '8.2f')} "
            f"{_fmt(rec.get('GBps'), '8.0f')} {_fmt(rec.get('us_per_op_over_floor'), '12.2f')} "
            f"{_fmt(rec.get('chain_err_max_over_bound'), '16.3f')} {_fmt(rec.get('local_err_max_over_bound'), '16.3f')}"
            f"  {'yes' if rec.get('ok') else 'NO'}")
    for name, rec in res.items():
        extra = []
        if "bit_equal_plain" in rec:
            extra.append(f"bit-equal to plain: {'yes' if rec['bit_equal_plain'] else 'no'}")
        if "replay_equals_eager" in rec:
            extra.append(f"graph replay == eager: {'yes' if rec['replay_equals_eager'] else 'NO'}")
        if name == "persist" and "grid" in rec:
            extra.append(f"grid {rec['grid']} ({rec['regs']} registers, {rec['fit_per_sm']} fit per SM, "
                         f"cooperative {'yes' if rec['cooperative'] else 'no'})")
        if name in ("stream", "streamfree") and "grid" in rec:
            extra.append(f"grid {rec['grid']}, {rec['warps']} warps, tiles {rec['rows']}x128, ring {rec['stages']} x "
                         f"{rec['cps']} tiles ({rec['ring_bytes'] // 1024} KB), registers {rec.get('regs')}")
        if name == "read" and "grid" in rec:
            extra.append(f"grid {rec['grid']} x {rec['steps']} tiles of BNxBK bytes")
        for note in extra + rec.get("notes", []):
            log(f"  {name}: {note}")
    timing = next((r["timing"] for r in res.values() if r.get("timing")), None)
    if timing:
        log(f"timing: {timing}, {meta['reps']} reps; floor = read's time per op")


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu (Triton interpreter)"


def _lines(ptx: str, *needles: str) -> list[int]:
    """Numbers of the PTX lines that contain every one of ``needles``."""
    return [n for n, ln in enumerate(ptx.splitlines()) if all(x in ln for x in needles)]


def compile_ptx(arch: int = 90, cfg: Config | None = None, L: int = 4) -> dict:
    """Compile the kernels for ``sm_<arch>`` without a GPU (Triton not in interpreter mode; ptxas runs too) and
    check, in the PTX text, the orderings the protocols rely on: pdl's launch_dependents, first weight tile (and
    the L2 prefetch with ``PF``), wait, then x and y; persist's first tile (and prefetch) before the acquire spin,
    x after it, a CTA barrier between the y stores and the release, both at GPU scope. Text order is a proxy for
    program order here (straight-line code around each point). Returns ``{kernel: ptxas resource line}``.

    Raises:
        AssertionError: a check fails (the message says which)."""
    import ptxas_util
    cfg = cfg or Config()
    nt = 32 * cfg.num_warps
    opts = dict(num_warps=cfg.num_warps, num_stages=1)
    pf_line = "cp.async.bulk.prefetch.L2"
    out = {}
    for gdc, pf in ((False, False), (True, False), (True, True)):
        k = ptxas_util.compile_kernel(_gemv_op, dict(K=2560, BN=cfg.bn, BK=cfg.bk, GDC=gdc, PF=pf, HW=True, NT=nt),
                                      dict(w_ptr="*fp8e4nv", s_ptr="*fp32", x_ptr="*bf16", y_ptr="*bf16"), arch, opts)
        ptx = k.asm["ptx"]
        assert "ld.global.v4" in ptx, "gemv: weight loads are not 16-byte vectors"
        if gdc:
            launch, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
            assert launch < ptx.index("ld.global.v4") < wait, "pdl: launch_dependents, first tile, wait: out of order"
            assert (pf_line in ptx[launch:wait]) == pf, "pdl: the L2 prefetch is not (only) before the wait"
            assert "ld.global.cg" not in ptx[:wait], "pdl: x is read before griddepcontrol.wait"
            assert "st.global" not in ptx[:wait], "pdl: y is written before griddepcontrol.wait"
        out["pdl" + ("+pf" if pf else "") if gdc else "plain"] = ptxas_util.resource_usage(k)
    for pf in (False, True):
        k = ptxas_util.compile_kernel(
            _chain_persist, dict(L=L, BN=cfg.bn, BK=cfg.bk, MAX_POLLS=cfg.max_polls, META_W=META,
                                 ACT_ALIGN=min(cfg.bn, cfg.bk), PF=pf, HW=True, NT=nt),
            dict(w_ptr="*fp8e4nv", s_ptr="*fp32", act_ptr="*bf16", meta_ptr="*i64", cnt_ptr="*i32", err_ptr="*i32"),
            arch, opts)
        ptx = k.asm["ptx"]
        lines = ptx.splitlines()
        # Triton turns the acquire add of 0 into an acquire load (ld.global.gpu.acquire)
        acq = [n for n in _lines(ptx, ".acquire") if "ld.global" in lines[n] or "atom.global" in lines[n]]
        rel = [n for n in _lines(ptx, ".release") if "atom.global" in lines[n] or "red.global" in lines[n]]
        assert acq and rel, "persist: no acquire read (the spin) or no release atomic (the signal)"
        assert all(".gpu" in lines[n] for n in acq + rel), "persist: an acquire/release is not at GPU scope"
        first_w = _lines(ptx, "ld.global.v4")
        assert first_w and first_w[0] < acq[0], "persist: the first weight tile is not requested before the spin"
        if pf:
            assert _lines(ptx, pf_line) and _lines(ptx, pf_line)[0] < acq[0], "persist: the prefetch is after the spin"
        xs = _lines(ptx, "ld.global.cg")
        assert xs and acq[0] < xs[0], "persist: x is read before the spin"
        for n in rel:
            bars = [m for m in _lines(ptx, "bar.sync") if m < n]
            stores = [m for m in _lines(ptx, "st.global") if m < n]
            assert bars and (not stores or bars[-1] > stores[-1]), \
                "persist: no CTA barrier between the y stores and the release"
        out["persist" + ("+pf" if pf else "")] = ptxas_util.resource_usage(k)
    for first, late in ((False, False), (False, True), (True, False)):
        k = ptxas_util.compile_kernel(
            _gemv_flag, dict(K=2560, BN=cfg.bn, BK=cfg.bk, FIRST=first, LATE=late, MAX_POLLS=cfg.max_polls, HW=True,
                             NT=nt),
            dict(w_ptr="*fp8e4nv", s_ptr="*fp32", x_ptr="*bf16", y_ptr="*bf16", cnt_ptr="*i32", err_ptr="*i32",
                 need="i32", op="i32"), arch, opts)
        ptx = k.asm["ptx"]
        lines = ptx.splitlines()
        launch = _lines(ptx, "griddepcontrol.launch_dependents")
        waits = _lines(ptx, "griddepcontrol.wait")
        rel = [n for n in _lines(ptx, ".release") if "atom.global" in lines[n] or "red.global" in lines[n]]
        assert launch and rel and all(".gpu" in lines[n] for n in rel), "flag: no trigger or no GPU-scope release"
        bars = [m for m in _lines(ptx, "bar.sync") if m < rel[-1]]
        stores = [m for m in _lines(ptx, "st.global") if m < rel[-1]]
        assert bars and stores and bars[-1] > stores[-1], "flag: no CTA barrier between the y stores and the release"
        xs = _lines(ptx, "ld.global.cg")
        if first:
            assert waits and waits[0] < launch[0] and waits[0] < xs[0], "flag: op 0 must wait before trigger and x"
        else:
            acq = [n for n in _lines(ptx, ".acquire") if "ld.global" in lines[n] or "atom.global" in lines[n]]
            assert not waits, "flag: griddepcontrol.wait in an op that waits on its counter"
            assert acq and all(".gpu" in lines[n] for n in acq), "flag: no GPU-scope acquire spin"
            assert _lines(ptx, "ld.global.v4")[0] < acq[0] < xs[0], "flag: first tile, spin, x: out of order"
            assert (launch[0] > acq[0]) == late, "flag: the trigger is not where LATE puts it"
        out["flag" + ("late" if late else "") + ("-first" if first else "")] = ptxas_util.resource_usage(k)
    import chain_stream
    # the launch's own shape: the stages the run takes with x up to K = 16,384 (the big chain), within sm_90's limit
    ncp = 128
    stages = cfg.stream_stages or chain_stream.auto_stages(ncp, cfg.stream_rows, cfg.stream_cps)
    k = chain_stream.compile_sm90(rows=cfg.stream_rows, cps=cfg.stream_cps, stages=stages, ncp=ncp,
                                  num_warps=cfg.stream_warps, consumer=cfg.stream_consumer,
                                  ksplit=cfg.stream_ksplit)
    est = chain_stream.smem_bytes(ncp, cfg.stream_rows, stages * cfg.stream_cps)
    assert k.metadata.shared <= est <= chain_stream.SMEM_LIMIT, \
        f"stream: {k.metadata.shared} B of shared memory compiled, {est} B estimated, {chain_stream.SMEM_LIMIT} B max"
    ptx = k.asm["ptx"]
    lines = ptx.splitlines()
    tma = _lines(ptx, "cp.async.bulk.tensor")
    acq = [n for n in _lines(ptx, ".acquire") if "ld.global" in lines[n] or "atom.global" in lines[n]]
    rel = [n for n in _lines(ptx, ".release") if "atom.global" in lines[n] or "red.global" in lines[n]]
    assert tma and _lines(ptx, "mbarrier.try_wait"), "stream: no TMA copy or no mbarrier wait"
    assert acq and rel and all(".gpu" in lines[n] for n in acq + rel), "stream: no GPU-scope acquire spin / release"
    assert tma[0] < acq[0], "stream: the ring's first copies are not issued before the first spin"
    xs = _lines(ptx, "ld.global.cg")
    assert xs and acq[0] < xs[0], "stream: x is read before the spin"
    for n in rel:
        bars = [m for m in _lines(ptx, "bar.sync") if m < n]
        stores = [m for m in _lines(ptx, "st.global") if m < n]
        assert bars and stores and bars[-1] > stores[-1], "stream: no CTA barrier between the y stores and the release"
    out["stream"] = f"{ptxas_util.resource_usage(k)}; shared {k.metadata.shared} B"
    k = chain_stream.compile_sm90(rows=cfg.stream_rows, cps=cfg.stream_cps, stages=stages, ncp=ncp,
                                  num_warps=cfg.stream_warps, dep=False, consumer=cfg.stream_consumer,
                                  ksplit=cfg.stream_ksplit)
    assert not _lines(k.asm["ptx"], ".acquire"), "streamfree: a spin wait in the kernel without dependencies"
    out["streamfree"] = ptxas_util.resource_usage(k)
    k = ptxas_util.compile_kernel(_read_all, dict(STEP=cfg.bn * cfg.bk // 4, STEPS=8),
                                  dict(words_ptr="*i32", out_ptr="*i32", n="i32"), arch, opts,
                                  aligned=lambda name, ty: ty.startswith("*") or name == "n")
    assert "ld.global.v4" in k.asm["ptx"], "read: loads are not 16-byte vectors"
    out["read"] = ptxas_util.resource_usage(k)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of KxN, repeated to --layers ops")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--bn", type=int, default=16, help="rows per row block (program / work item)")
    ap.add_argument("--bk", type=int, default=512, help="K columns per chunk")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--programs-per-sm", type=int, default=1, help="persist: grid = this x the SM count")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--only", default=",".join(e for e in EXECUTIONS if not e.startswith("stream")),
                    help="comma list of " + ",".join(EXECUTIONS) + " (default: all but stream and streamfree, which "
                    "must be named: their first GPU run is still to come, and a lost TMA copy would leave an mbarrier "
                    "wait with no timeout)")
    ap.add_argument("--max-polls", type=int, default=2 ** 24,
                    help="persist, flag, flaglate, stream: polls per spin wait before it reports a timeout (each poll "
                    "~1 us: 2^24 is seconds, a legitimate wait is one op)")
    ap.add_argument("--read-steps", type=int, default=0, help="read: BNxBK tiles per program (0: plain's mean)")
    ap.add_argument("--prefetch-l2", action="store_true", help="pdl, persist: also a bulk L2 prefetch of each row "
                    "block's whole weights (BN x K bytes) before the wait (default: only the first tile is loaded)")
    ap.add_argument("--no-cooperative", action="store_true", help="persist, stream, streamfree: launch without the "
                    "cooperative attribute (persist's occupancy check, or the stream's shared memory, one program per "
                    "SM, still guards co-residency)")
    ap.add_argument("--stream-rows", type=int, default=16, help="stream: rows per tile and row block")
    ap.add_argument("--stream-cps", type=int, default=4, help="stream: tiles per ring stage (must divide K / 128)")
    ap.add_argument("--stream-stages", type=int, default=0, help="stream: ring stages (0: as many as fit, <= 64)")
    ap.add_argument("--stream-warps", type=int, default=4,
                    help="stream: warps per program (--stream-rows a power of two >= max(8, 2 x warps))")
    ap.add_argument("--stream-consumer", default="fma", choices=("fma", "mma"),
                    help="stream: how a ring stage is multiplied: float32 FMAs (fma), or E4M3 -> FP16 mma fragments "
                         "with x in FP16 (mma; --stream-rows a multiple of 16 x --stream-warps)")
    ap.add_argument("--stream-ksplit", type=int, default=1,
                    help="stream with --stream-consumer mma: K parts per row block, a power of two (every K / 128 / "
                         "this a multiple of --stream-cps), so an op's items spread over more programs; the next op "
                         "forms x from the float32 partials")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_chain")
    ap.add_argument("--name", default="bench_chain")
    ap.add_argument("--ptx", action="store_true", help="no GPU: compile the kernels for sm_90 (TRITON_INTERPRET "
                    "unset), check the PTX orderings, print ptxas' resource usage, exit")
    return ap


def main(argv=None, log=print) -> dict:
    """Run the benchmark; returns the JSON record (also written to ``--out/--name.json``). Exit status (as
    ``SystemExit`` from the command line only): nonzero when a check failed."""
    a = build_parser().parse_args(argv)
    if tl is None:
        raise SystemExit(f"bench_chain: {_TRITON_ERR}")
    cfg = Config(bn=a.bn, bk=a.bk, num_warps=a.num_warps, programs_per_sm=a.programs_per_sm, max_polls=a.max_polls,
                 read_steps=a.read_steps, prefetch_l2=a.prefetch_l2, cooperative=not a.no_cooperative,
                 stream_rows=a.stream_rows, stream_cps=a.stream_cps, stream_stages=a.stream_stages,
                 stream_warps=a.stream_warps, stream_consumer=a.stream_consumer, stream_ksplit=a.stream_ksplit)
    if a.ptx:
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise SystemExit("--ptx compiles for a GPU target: unset TRITON_INTERPRET")
        for name, usage in compile_ptx(cfg=cfg).items():
            log(f"{name:10s} sm_90: {usage}")
        log("PTX orderings: ok")
        return {}
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in only if s not in EXECUTIONS]
    if bad:
        raise ShapeError(f"--only: unknown execution(s) {bad}; choose from {','.join(EXECUTIONS)}")
    for flag, v in (("--reps", a.reps), ("--programs-per-sm", a.programs_per_sm), ("--max-polls", a.max_polls),
                    ("--num-warps", a.num_warps)):
        if v < 1:
            raise ShapeError(f"{flag} must be >= 1, got {v}")
    ops = parse_shapes(a.shapes, a.layers)
    check_tiles(ops, a.bn, a.bk)
    if a.device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        dev = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --device cpu (with TRITON_INTERPRET=1) or --ptx")
        dev = torch.device("cuda", torch.cuda.current_device())
    from bytebound.bench.report import git_commit
    chain = make_chain(ops, dev, a.bn, a.seed)
    meta = {"device": _device_name(dev), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": git_commit(), "weights": WEIGHTS, "shapes": a.shapes, "L": a.layers,
        "ops": [list(o) for o in ops], "weight_bytes": chain.weight_bytes, "reps": a.reps,
        "config": {"bn": cfg.bn, "bk": cfg.bk, "num_warps": cfg.num_warps, "programs_per_sm": cfg.programs_per_sm,
                   "max_polls": cfg.max_polls, "read_steps": read_steps(chain, cfg), "cooperative": cfg.cooperative,
                   "prefetch_l2": cfg.prefetch_l2, "num_stages": 1, "stream_rows": cfg.stream_rows,
                   "stream_cps": cfg.stream_cps, "stream_stages": cfg.stream_stages, "stream_warps": cfg.stream_warps,
                   "stream_consumer": cfg.stream_consumer, "stream_ksplit": cfg.stream_ksplit},
        "tolerances": {"local": LOCAL_TOL, "chain": "2^-7 * sqrt(i + 1) for op i"},
        "command": " ".join([Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv)))}
    if dev.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0)
        if l2 and chain.weight_bytes < 4 * l2:
            meta["l2_note"] = (f"note: the weights ({chain.weight_bytes / 1e6:.0f} MB) are under 4x the L2 "
                               f"({l2 / 1e6:.0f} MB): replays partly read from L2, not HBM")
    res = run_all(chain, cfg, only, a.reps, log)
    summarize(res, chain)
    report(meta, res, log)
    record = {"meta": meta, "results": res,
              "ok": all(r.get("ok", False) for r in res.values() if "skipped" not in r)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{a.name}.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    log(f"wrote {path}")
    if not record["ok"]:
        log("FAILED: a check did not pass (see the ok column)")
    errors = [r["error"] for r in res.values() if "error" in r]
    if errors:
        raise RuntimeError("; ".join(errors))
    return record


if __name__ == "__main__":
    try:
        rec = main()
    except ShapeError as exc:
        raise SystemExit(f"bench_chain: {exc}")
    raise SystemExit(0 if rec.get("ok", True) else 1)
