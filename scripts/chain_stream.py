"""The ``stream`` execution of ``scripts/bench_chain.py``: the chain of dependent FP8 GEMVs as ONE persistent kernel
whose weight tiles stream into a deep shared-memory ring ahead of the dependency waits.

Why: docs/perf/u08-design.md section 3 proposes a decode step as one persistent kernel whose ops wait on
data-driven counters, with every op's weights streamed independently of its dependency. Two measurements of that
design's parts were slower than one PDL launch per op: counter waits with a two-tile register pipeline (``persist``,
sixteenth session, 1.5-2.4x slower) and counters between PDL launches (``flag``, thirty-fourth session). Both
sections end on the same condition: the design can only pay with a weight stream that runs *ahead of* the waits,
several items deep. This execution is that stream, on the simplest chain there is, so that its boundary cost can be
read off against ``pdl`` and ``read`` in one run.

How (one program per SM, all co-resident, a cooperative launch):

- The weights are repacked once, host-side, into tiles of ``R`` rows x ``BKC`` = 128 columns (E4M3 bytes, 2 KB at
  ``R`` 16), tile ``(op i, row block b, chunk c)`` contiguous: one 2-D TMA box each (:func:`repack`).
- Work is split by the host into per-program item lists (:func:`plan_items`): each row block, op after op, goes to
  the program with the fewest tiles so far, so a program that took one block more in one op takes one less in a
  later one and every program streams about the same bytes over the chain (the ring's lookahead lets a program
  run ahead of the others across op boundaries only by its ring's depth).
- Each program keeps a ring of ``ST`` stages of ``CPS`` tiles (one mbarrier per stage). Its tiles are issued in the
  order it consumes them; a stage is refilled with the ``CPS`` tiles ``ST`` stages ahead as soon as it has been read
  (a CTA barrier, then one TMA copy: a stage's tiles are consecutive in the repacked buffer, so one box of
  ``CPS * R`` rows holds them): the copies depend on nothing but the ring, so while the program spins on
  op i - 1's counter the ring fills with op i's and later ops' tiles, up to ``ST * CPS * R * 128`` bytes ahead.
- Per op (when the program has blocks in it): one acquire spin until op i - 1's counter holds all of its row blocks,
  x_i staged once into shared memory (one L2 round trip for the whole vector); per block: ``NC = K / 128`` tiles out
  of the ring into a ``[R, 128]`` float32 accumulator, ``y = bf16(s * rowsum)``, stored; a CTA barrier and one
  release add on op i's counter (the memory protocol of ``bench_chain._wait_count`` / ``_chain_persist``).

What it computes: ``y_i = bf16(s_i * (W_i @ x_i))``, x_{i+1} = y_i, as the other executions. Its float32 sums run in
another order than ``_block_rest``'s (128-column tiles, not BK), so it is checked against the float64 chain within
bench_chain's bounds and its bit equality with ``plain`` is only reported. No deadlock with every program resident:
a program waiting at op i has finished all its items of the ops before i, so by induction every block of op i - 1
completes; a program that times out (``MAX_POLLS``) records it, computes garbage and still signals, so the kernel
ends and the host raises (:meth:`Stream.check`). (A design argument; no run on the H100 hung, docs/perf/session38/.)
Needs sm_90 (TMA, mbarriers) and about ``ST * CPS * R * 128 + K_max * 2`` bytes of shared memory per program
(:func:`check_stream`).

Two variants (docs/perf/u08-design.md sections 7.2, 7.3): the ``mma`` consumer (:func:`_chain_stream_mma`: the
tiles multiplied on tensor cores as E4M3 -> FP16 fragments, x in FP16) and, with it, a split of every row block
over K (``ksplit``: float32 partials that the next op's programs sum in a fixed order as they stage x). Measured on
the H100, every form is slower per dependent op than one PDL launch per op.
"""

from __future__ import annotations

import heapq

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    GLUON_ERR = None
except Exception as exc:  # pragma: no cover
    gluon = gl = mbarrier = tma = TensorDescriptor = None
    GLUON_ERR = f"triton.experimental.gluon (Hopper TMA) is not importable: {exc}"
if gluon is not None:
    # the ``mma`` consumer's pieces: the decode step's tensor-core FP8 GEMV (kernels/gluon_fp8_gemv.py)
    from bytebound.kernels.triton_moe_ring import word_layout_2d
    from bytebound.kernels.triton_moe_split import _frag_fp8, fp8_word_layout, mma_v2

BKC = 128               # tile columns: one 128-byte TMA box row (E4M3), the ring's swizzle width
CONSUMERS = ("fma", "mma")  # the consumer of a ring stage: float32 FMAs, or FP16 mma in gluon_fp8_gemv's fragment order
SMEM_LIMIT = 227 * 1024  # sm_90's largest shared memory per block (opt-in), bytes
MAX_STAGES = 64         # the ring's init and first fill are unrolled
STREAM_META = 8         # int64 words per op in the stream kernel's op table (see plan_items)


class StreamError(ValueError):
    """The chain or the stream settings do not fit the ``stream`` execution (tile sizes, shared memory)."""


def smem_bytes(ncp: int, rows: int, tiles: int) -> int:
    """The shared memory one program needs (bytes, an upper estimate of the compiled kernel's): a ring of ``tiles``
    tiles of ``rows x 128`` bytes, x staged as ``ncp`` rows of 128 BF16 values, a barrier word per tile (at most one
    per stage is used), 1 KB of the compiler's own."""
    return tiles * rows * BKC + ncp * BKC * 2 + tiles * 8 + 1024


def check_stream(ops: list[tuple[int, int]], r: int, st: int, num_warps: int, smem_limit: int = SMEM_LIMIT,
                 cps: int = 1, consumer: str = "fma", ksplit: int = 1) -> int:
    """:func:`smem_bytes` of a ring of ``st`` tiles of ``R x 128`` bytes (stages x tiles per stage) with x up to the
    largest K, after checking that the settings fit the chain.

    Raises:
        StreamError: ``R`` is not a power of two of at least 8 and ``2 * num_warps`` (the swizzle, the tile's register
            layout), or with the ``mma`` consumer not a multiple of ``16 * num_warps`` (one mma row tile of 16 rows
            per warp), an unknown ``consumer``, ``ksplit`` (K parts per row block) not a power of two or above 1
            with the ``fma`` consumer or not dividing every K / 128, ``cps * R`` over TMA's 256-row box, ``cps`` not
            dividing every K / 128 / ``ksplit``, a K is not a multiple of 128 or an N of ``R``, ``st < 2``, or the
            ring and x exceed ``smem_limit``."""
    if consumer not in CONSUMERS:
        raise StreamError(f"stream: --stream-consumer {consumer!r}: one of {', '.join(CONSUMERS)}")
    if consumer == "mma" and (r % (16 * num_warps) or r & (r - 1)):
        raise StreamError(f"stream: the mma consumer needs --stream-rows a power of two and a multiple of 16 x "
                          f"num_warps ({16 * num_warps}: a 16-row mma tile per warp), got {r}")
    if r < max(8, 2 * num_warps) or r & (r - 1):
        raise StreamError(f"stream: --stream-rows {r} must be a power of two >= 8 (the 128-byte swizzle's period) "
                          f"and >= 2 x num_warps ({2 * num_warps}: the tile's register layout, tile_layout_regs)")
    if cps * r > 256:
        raise StreamError(f"stream: --stream-cps {cps} x --stream-rows {r} rows: one TMA box (a ring stage) holds at "
                          "most 256 rows")
    if ksplit < 1 or ksplit & (ksplit - 1) or (ksplit > 1 and consumer != "mma"):
        raise StreamError(f"stream: --stream-ksplit {ksplit}: a power of two, above 1 only with "
                          "--stream-consumer mma")
    if any((k // BKC) % ksplit for k, _ in ops):
        raise StreamError(f"stream: --stream-ksplit {ksplit} must divide every K / {BKC} "
                          f"({sorted({k // BKC for k, _ in ops})})")
    if any((k // BKC // ksplit) % cps for k, _ in ops):
        raise StreamError(f"stream: --stream-cps {cps} must divide every K / {BKC} / ksplit "
                          f"({sorted({k // BKC // ksplit for k, _ in ops})})")
    if st < 2:
        raise StreamError(f"stream: a ring of {st} tile(s): at least 2 are needed (--stream-stages x --stream-cps)")
    for i, (k, n) in enumerate(ops):
        if k % BKC or n % r:
            raise StreamError(f"stream: op {i} ({k}x{n}): K must be a multiple of {BKC} and N of --stream-rows {r}")
    kmax = max(k for k, _ in ops)
    need = smem_bytes(_pow2(kmax // BKC), r, st)
    if need > smem_limit:
        raise StreamError(f"stream: a ring of {st} tiles of {r}x{BKC} bytes + x of up to {kmax} BF16 values need "
                          f"{need} B of shared memory per program, over {smem_limit} B: lower --stream-stages")
    return need


def auto_stages(ncp: int, rows: int, cps: int) -> int:
    """The most ring stages of ``cps`` tiles of ``rows x 128`` bytes whose :func:`smem_bytes` (x: ``ncp`` rows of 128
    BF16 values) fit :data:`SMEM_LIMIT`, at most :data:`MAX_STAGES`."""
    return min(MAX_STAGES, (SMEM_LIMIT - smem_bytes(ncp, rows, 0)) // (cps * (rows * BKC + 8)))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def repack(w: torch.Tensor, w_off: list[int], ops: list[tuple[int, int]], r: int) -> tuple[torch.Tensor, list[int]]:
    """Every op's E4M3 ``[N, K]`` weight (in ``w`` at byte offsets ``w_off``) as tiles ``[R, 128]``: returns the
    uint8 view ``[T * R, 128]`` (tile t = rows ``t*R .. t*R + R - 1``) and each op's first tile index; op i's tile
    ``(b, c)`` is ``base_i + b * (K_i / 128) + c``. The same bytes, another order."""
    tiles, base, t = [], [], 0
    for (k, n), off in zip(ops, w_off):
        wi = w[off:off + n * k].view(torch.uint8).view(n // r, r, k // BKC, BKC)
        tiles.append(wi.permute(0, 2, 1, 3).reshape(-1, BKC))
        base.append(t)
        t += (n // r) * (k // BKC)
    return torch.cat(tiles).contiguous(), base


def plan_items(ops: list[tuple[int, int]], r: int, programs: int, base: list[int], s_off: list[int],
               x_off: list[int], y_off: list[int], device, ksplit: int = 1) -> dict:
    """Host-side work lists of the ``programs`` programs.

    Returns ``items`` int32 ``[sum items, 2]`` (op, row block x ``ksplit`` + K part) grouped by program in
    consumption order, ``item_start`` int32 ``[P + 1]``, ``tiles`` int32 ``[sum tiles]`` (each program's tile
    indices in the order it consumes them), ``tile_start`` int32 ``[P + 1]``, and ``meta`` int64 ``[L, STREAM_META]``
    per op: first tile, scale offset, x offset, y offset, K, row blocks, items of the previous op (its row blocks x
    ``ksplit``; 0 for op 0), and the offset of the op's float32 partials ``[ksplit, N]`` in the partials buffer
    (:func:`part_elems` elements in all; used with ``ksplit > 1``). An item is row block b's K part p: tiles ``p *
    nc/ksplit .. (p + 1) * nc/ksplit - 1`` of the block (``nc = K / 128``). Each item, op after op, goes to the
    program with the fewest tiles so far (ties in turn), so the programs' tile counts over the chain stay within one
    item of each other (module docstring). An item's tiles are consecutive, so any ``CPS`` dividing ``K / 128 /
    ksplit`` makes every ring stage one contiguous run of tiles (one TMA box)."""
    per_items = [[] for _ in range(programs)]
    per_tiles = [[] for _ in range(programs)]
    heap = [(0, p, p) for p in range(programs)]        # (tiles so far, tie-break, program)
    seq = programs
    meta = []
    part = 0
    for i, (k, n) in enumerate(ops):
        nb, nc = n // r, k // BKC
        npart = nc // ksplit
        for b in range(nb):
            for q in range(ksplit):
                load, _, p = heapq.heappop(heap)
                per_items[p].append((i, b * ksplit + q))
                first = base[i] + b * nc + q * npart
                per_tiles[p].extend(range(first, first + npart))
                heapq.heappush(heap, (load + npart, seq, p))   # ties go round the programs in turn
                seq += 1
        meta.append([base[i], s_off[i], x_off[i], y_off[i], k, nb, ops[i - 1][1] // r * ksplit if i else 0, part])
        part += ksplit * n

    def flat(lists, width):
        start = [0]
        for lst in lists:
            start.append(start[-1] + len(lst))
        data = [v for lst in lists for v in lst]
        t = torch.tensor(data if data else ([(0, 0)] if width == 2 else [0]), dtype=torch.int32, device=device)
        return t, torch.tensor(start, dtype=torch.int32, device=device)

    items, item_start = flat(per_items, 2)
    tiles, tile_start = flat(per_tiles, 1)
    return dict(items=items, item_start=item_start, tiles=tiles, tile_start=tile_start,
                meta=torch.tensor(meta, dtype=torch.int64, device=device))


def part_elems(ops: list[tuple[int, int]], ksplit: int) -> int:
    """float32 elements of the partials buffer of a split over K (``plan_items``' ``meta[:, 7]`` offsets): ``ksplit``
    partial vectors ``[N]`` per op."""
    return ksplit * sum(n for _, n in ops)


def tile_layout():
    """The shared layout of one ring stage ``[R, 128]`` uint8 (TMA's 128-byte swizzle)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)


def word_tile_layout():
    """The shared layout of one ring stage for the ``mma`` consumer: the same bytes as :func:`tile_layout` viewed as
    int32 words ``[R, 32]`` (TMA's 128-byte swizzle works on 16-byte chunks, so the placement is the same)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)


def tile_layout_regs(rows: int, num_warps: int):
    """The register layout of a ``[rows, 128]`` E4M3 tile in the consumer: 16 bytes a thread and 8 threads a row
    (``rows >= 4 * num_warps``, ``rows / (4 * num_warps)`` rows a thread), else 8 bytes a thread and 16 threads a row
    (``rows = 2 * num_warps``, one row a thread: twice the row blocks of an op for the same warps)."""
    if rows >= 4 * num_warps:
        return gl.BlockedLayout([rows // (4 * num_warps), 16], [4, 8], [num_warps, 1], [1, 0])
    return gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])


def descriptor(packed: torch.Tensor, rows: int, consumer: str = "fma"):
    """The TMA descriptor of the repacked tiles (:func:`repack`), box ``[rows, 128]`` bytes (a ring stage: ``CPS *
    R``); for the ``mma`` consumer the same bytes as int32 words, box ``[rows, 32]``."""
    if consumer == "mma":
        return TensorDescriptor.from_tensor(packed.view(torch.int32), [rows, BKC // 4], word_tile_layout())
    return TensorDescriptor.from_tensor(packed, [rows, BKC], tile_layout())


if gluon is not None:
    @gluon.jit
    def _issue(desc, ring, bars, tiles_ptr, t0, g, st, n_tiles, R: gl.constexpr, CPS: gl.constexpr):
        """Fill stage ``st`` with this program's tile group ``g`` (its tiles ``CPS*g .. CPS*g + CPS - 1``): ONE TMA
        copy of ``CPS * R`` rows from the group's first tile ``tiles[t0 + CPS*g]`` (a group's tiles are consecutive
        in the repacked buffer: :func:`plan_items`), on the stage's mbarrier; nothing past ``n_tiles``."""
        bar = bars.index(st)
        valid = CPS * g < n_tiles
        t = gl.load(tiles_ptr + t0 + CPS * g, mask=valid, other=0)
        mbarrier.expect(bar, CPS * R * 128, pred=valid)
        tma.async_copy_global_to_shared(desc, [t * R, 0], bar, ring.index(st), pred=valid)

    @gluon.jit
    def _ring_start(desc, ring, tiles_ptr, tile_start_ptr, item_start_ptr, pid, R: gl.constexpr, CPS: gl.constexpr,
                    ST: gl.constexpr):
        """Program ``pid``'s ring start, shared by both consumers: the ``ST`` stage mbarriers initialised (a CTA
        barrier before any is armed or waited on), its tile and item ranges read from the plan, and its first
        ``ST`` stages issued (before any dependency wait). Returns ``(bars, t0, n_tiles, i0, n_items)``."""
        bars = gl.allocate_shared_memory(gl.int64, [ST, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(ST):
            mbarrier.init(bars.index(i), count=1)
        gl.thread_barrier()                     # every barrier initialised before any thread arms or waits on one
        t0 = gl.load(tile_start_ptr + pid)
        n_tiles = gl.load(tile_start_ptr + pid + 1) - t0
        i0 = gl.load(item_start_ptr + pid)
        n_items = gl.load(item_start_ptr + pid + 1) - i0
        for j in gl.static_range(ST):
            _issue(desc, ring, bars, tiles_ptr, t0, j, j, n_tiles, R, CPS)
        return bars, t0, n_tiles, i0, n_items

    @gluon.jit
    def _item(items_ptr, meta_ptr, s_ptr, act_ptr, idx, META_W: gl.constexpr):
        """Work item ``idx`` of the plan: ``(op, its second word (row block, or block x KS + K part), op's table
        row, op's scales, op's y, op's K / 128)``. The x / y offsets are multiples of 128 elements (every N but
        the last is the next op's K, a multiple of 128)."""
        op = gl.load(items_ptr + idx * 2)
        b = gl.load(items_ptr + idx * 2 + 1)
        m = meta_ptr + op * META_W
        return (op, b, m, s_ptr + gl.load(m + 1), act_ptr + gl.multiple_of(gl.load(m + 3), 16),
                gl.load(m + 4).to(gl.int32) // 128)

    @gluon.jit
    def _spin(cnt_ptr, need, dead, err_ptr, op, MAX_POLLS: gl.constexpr):
        """``bench_chain._wait_count`` in Gluon (a Gluon kernel cannot call a ``@triton.jit`` function): spin
        (acquire, GPU scope) until ``*cnt_ptr >= need``, at most ``MAX_POLLS`` polls; on a timeout count it in
        ``err`` and return ``dead`` 1 (never spin again). The scalar atomic runs in one thread and its result is
        broadcast, so the loop condition is uniform; the CTA barrier after it orders every thread's later reads
        after the acquire."""
        seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        polls = 1
        while (seen < need) & (dead == 0) & (polls < MAX_POLLS):
            seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            polls += 1
        if (seen < need) & (dead == 0):
            gl.atomic_add(err_ptr, 1, sem="relaxed", scope="gpu")
            gl.atomic_max(err_ptr + 1, op, sem="relaxed", scope="gpu")
            dead = dead + 1
        gl.thread_barrier()
        return dead

    @gluon.jit
    def _chain_stream(desc, s_ptr, act_ptr, meta_ptr, items_ptr, item_start_ptr, tiles_ptr, tile_start_ptr,
                      cnt_ptr, err_ptr, R: gl.constexpr, CPS: gl.constexpr, ST: gl.constexpr, NCP: gl.constexpr,
                      MAX_POLLS: gl.constexpr, META_W: gl.constexpr, BL: gl.constexpr, DEP: gl.constexpr = True):
        """The whole chain in one persistent launch (module docstring). ``desc``: the repacked tiles' TMA
        descriptor, box ``[CPS * R, 128]`` (one copy per ring stage); ``s_ptr`` float32 scales, ``act_ptr`` bf16
        activations (x_0, y_0, y_1, ...), ``meta_ptr`` / ``items_ptr`` / ``tiles_ptr`` and their starts:
        :func:`plan_items`; ``cnt_ptr`` int32 ``[L]`` zeroed before the launch; ``err_ptr`` int32 ``[2]``. The
        ring: ``ST`` stages of ``CPS`` tiles (one mbarrier, one TMA copy and one explicit CTA barrier per stage; 3
        ``bar.sync`` once compiled); every K / 128 must be a multiple of ``CPS``. ``NCP``: the largest K / 128,
        rounded up to a power of two (x's shared-memory rows). ``BL``: the tiles' register layout
        (:func:`tile_layout_regs`). ``DEP`` False (``streamfree``): no spin, every op reads the x its op table names
        (all one fixed input: the host's plan), so the ops are independent and the run times the stream and the
        consumer alone."""
        NW: gl.constexpr = gl.num_warps()
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])                # [NCP, 128] x rows
        XS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])                          # unswizzled
        pid = gl.program_id(0)
        ring = gl.allocate_shared_memory(gl.uint8, [ST, CPS * R, 128], desc.layout)
        x_s = gl.allocate_shared_memory(gl.bfloat16, [NCP, 128], XS)     # row c: x's columns 128c .. 128c + 127
        # the same bytes as rows, for the per-tile reads (an unswizzled row-major buffer: a view, no copy)
        x_rows = x_s._reinterpret(gl.bfloat16, [NCP, 128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        bars, t0, n_tiles, i0, n_items = _ring_start(desc, ring, tiles_ptr, tile_start_ptr, item_start_ptr, pid, R,
                                                     CPS, ST)
        rows = gl.arange(0, R, layout=gl.SliceLayout(1, BL))
        xr = gl.arange(0, NCP, layout=gl.SliceLayout(1, XL))
        xc = gl.arange(0, 128, layout=gl.SliceLayout(0, XL))
        g = 0                                   # tile groups (stages' fills) consumed so far
        dead = pid * 0
        prev = pid * 0 - 1
        for it in range(n_items):
            op, blk, m, s_i, y_i, nc = _item(items_ptr, meta_ptr, s_ptr, act_ptr, i0 + it, META_W)
            if op != prev:
                # this program's first block of op `op`: its input is op - 1's whole output
                if DEP and op > 0:
                    dead = _spin(cnt_ptr + (op - 1), gl.load(m + 6).to(gl.int32), dead, err_ptr, op, MAX_POLLS)
                x_i = act_ptr + gl.multiple_of(gl.load(m + 2), 16)
                xv = gl.load(x_i + xr[:, None] * 128 + xc[None, :], mask=(xr < nc)[:, None], other=0.0,
                             cache_modifier=".cg")
                x_s.store(xv)
                gl.thread_barrier()
                prev = op
            acc = gl.zeros([R, 128], gl.float32, BL)
            for c0 in range(0, nc, CPS):
                st = g % ST
                mbarrier.wait(bars.index(st), (g // ST) & 1)
                for j in gl.static_range(CPS):
                    # tile j of the stage: rows j*R .. (a multiple of 8 rows: the 128-byte swizzle's period)
                    w = ring.index(st).slice(j * R, R).load(BL).to(gl.float8e4nv, bitcast=True)
                    x = x_rows.index(c0 + j).load(gl.SliceLayout(0, BL))
                    acc += w.to(gl.float32) * x.to(gl.float32)[None, :]
                gl.thread_barrier()             # every warp has read stage st before TMA overwrites it
                _issue(desc, ring, bars, tiles_ptr, t0, g + ST, st, n_tiles, R, CPS)
                g += 1
            y = gl.sum(acc, axis=1) * gl.load(s_i + blk * R + rows)
            gl.store(y_i + blk * R + rows, y.to(gl.bfloat16))
            gl.thread_barrier()                 # release cumulativity covers the stores ordered before it
            gl.atomic_add(cnt_ptr + op, 1, sem="release", scope="gpu")


if gluon is not None:
    @gluon.jit
    def _b_row(x4, c, DB: gl.constexpr):
        """The mma B operand ``[128, 8]`` FP16 of x's columns ``128c .. 128c + 127``, read from x staged in shared
        memory (``x4``: ``[NCP, 1, 4, 32]`` FP16, row-major) in the logical k order of ``_frag_fp8``
        (``triton_moe_split._b_logical`` with ``DQ`` 0). Lane ``4g + t`` reads columns ``32t .. 32t + 31`` for
        every g (lanes of one t read the same address: a broadcast), so all 8 token columns hold x and all 8
        accumulator columns the same sums; the caller keeps column 0. No masking instructions, no zero fill."""
        NW: gl.constexpr = gl.num_warps()
        XL: gl.constexpr = gl.BlockedLayout([1, 1, 1, 32], [1, 8, 4, 1], [1, 1, 1, NW], [3, 2, 1, 0])
        v = gl.expand_dims(x4.index(c).load(gl.SliceLayout(1, XL)), 1)               # [1, 1, 4, 32]
        x = gl.broadcast(v, gl.zeros([1, 8, 4, 32], gl.float16, XL))[0]             # [1, 8, 4, 32]
        x = gl.permute(gl.reshape(x, [1, 8, 4, 4, 2, 2, 2]), [0, 3, 4, 5, 2, 6, 1])  # -> [s, tau, p, h, t, j, n]
        return gl.convert_layout(gl.reshape(x, [128, 8]), DB, assert_trivial=True)

    @gluon.jit
    def _chain_stream_mma(desc, s_ptr, act_ptr, meta_ptr, items_ptr, item_start_ptr, tiles_ptr, tile_start_ptr,
                          cnt_ptr, err_ptr, part_ptr, R: gl.constexpr, CPS: gl.constexpr, ST: gl.constexpr,
                          NCP: gl.constexpr, MAX_POLLS: gl.constexpr, META_W: gl.constexpr, WL2: gl.constexpr,
                          WD1: gl.constexpr, DEP: gl.constexpr = True, KS: gl.constexpr = 1):
        """:func:`_chain_stream` with the ``mma`` consumer: the same ring, plan, waits, x staging and signals; each
        tile's words are read out of the ring in ``WL2`` (``triton_moe_ring.word_layout_2d`` with 8 words: the
        E4M3 fragment rows of ``fp8_word_layout``, flattened), converted to exact FP16 mma A
        fragments by the hardware conversion (``_frag_fp8`` with ``F16``; the row scale applied after the sum) and
        multiplied by x's 128 columns, staged once per op as FP16, as the B operand (:func:`_b_row`) into a float32
        mma accumulator ``[R, 8]``: the fragment order of the decode step's FP8 GEMV (kernels/gluon_fp8_gemv.py),
        fed from shared memory. FP16 rather than BF16 operands: the E4M3 -> BF16 decode of that GEMV takes ~12
        integer instructions a word, the FP16 conversion 2; x in FP16 is exact for |x| in FP16's normal range (the
        chain's activations are), a change of rounding point against the other executions, within the checks'
        bounds or reported.
        ``desc``: the tiles as int32 words, box ``[CPS * R, 32]`` (:func:`word_tile_layout`). ``WD1``:
        ``fp8_word_layout(R, 1, num_warps)``; R a multiple of 16 x num_warps.

        ``KS > 1``: each op split over K as well (``plan_items``' items: row block b's K part p), so an op's work
        spreads over more programs. An item stores its unscaled float32 column sums ``[R]`` into the op's partials
        (``part_ptr``, ``[KS, N]`` at the op's ``meta[7]``) instead of y; the next op's programs, after their
        spin, form x themselves: ``bf16(s * (part_0 + part_1 + ...))`` summed in the fixed order p = 0..KS-1 (so
        every program stages the same bits), then FP16. y is never stored: :meth:`Stream.outputs` forms it from the
        partials the same way. Without dependencies (``streamfree``) x stays the fixed input."""
        NW: gl.constexpr = gl.num_warps()
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])                # [NCP, 128] x rows
        XS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])                          # unswizzled
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        OL: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NW, 1], [1, 0])
        pid = gl.program_id(0)
        ring = gl.allocate_shared_memory(gl.int32, [ST, CPS * R, 32], desc.layout)
        x_s = gl.allocate_shared_memory(gl.float16, [NCP, 128], XS)      # row c: x's columns 128c .. 128c + 127
        # the same bytes as [NCP, 1, 4, 32] (row c, lane column group t, column): _b_row's reads (a view, no copy)
        x4 = x_s._reinterpret(gl.float16, [NCP, 1, 4, 32], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        # KS > 1: x formed XR rows at a time from the partials (a view of the same bytes as [NCP / XR, XR, 128])
        XR: gl.constexpr = 16 if NCP >= 16 else NCP
        x_parts = x_s._reinterpret(gl.float16, [NCP // XR, XR, 128], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        PL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])                 # [XR, 128] rows
        pr = gl.arange(0, XR, layout=gl.SliceLayout(1, PL))
        pc = gl.arange(0, 128, layout=gl.SliceLayout(0, PL))
        bars, t0, n_tiles, i0, n_items = _ring_start(desc, ring, tiles_ptr, tile_start_ptr, item_start_ptr, pid, R,
                                                     CPS, ST)
        orow = gl.arange(0, R, layout=gl.SliceLayout(1, OL))
        ocol = gl.arange(0, 8, layout=gl.SliceLayout(0, OL))
        xr = gl.arange(0, NCP, layout=gl.SliceLayout(1, XL))
        xc = gl.arange(0, 128, layout=gl.SliceLayout(0, XL))
        g = 0                                   # tile groups (stages' fills) consumed so far
        dead = pid * 0
        prev = pid * 0 - 1
        for it in range(n_items):
            op, bq, m, s_i, y_i, nc = _item(items_ptr, meta_ptr, s_ptr, act_ptr, i0 + it, META_W)
            blk = bq // KS
            q = bq % KS
            if op != prev:
                if DEP and op > 0:
                    dead = _spin(cnt_ptr + (op - 1), gl.load(m + 6).to(gl.int32), dead, err_ptr, op, MAX_POLLS)
                if DEP and (KS > 1) and (op > 0):
                    # x = op - 1's y, formed from its partials (fixed order), as Stream.outputs forms y; XR rows of
                    # 128 at a time (the whole [NCP, 128] in float32 at once would spill)
                    mp = meta_ptr + (op - 1) * META_W
                    pp = part_ptr + gl.load(mp + 7)
                    sp = s_ptr + gl.load(mp + 1)
                    for r0 in range(0, nc, XR):
                        pm = (r0 + pr < nc)[:, None]
                        po = (r0 + pr)[:, None] * 128 + pc[None, :]
                        xs = gl.load(pp + po, mask=pm, other=0.0, cache_modifier=".cg")
                        for p in gl.static_range(1, KS):
                            xs += gl.load(pp + p * (nc * 128) + po, mask=pm, other=0.0, cache_modifier=".cg")
                        xv = (xs * gl.load(sp + po, mask=pm, other=0.0)).to(gl.bfloat16)
                        x_parts.index(r0 // XR).store(xv.to(gl.float16))
                else:
                    x_i = act_ptr + gl.multiple_of(gl.load(m + 2), 16)
                    xv = gl.load(x_i + xr[:, None] * 128 + xc[None, :], mask=(xr < nc)[:, None], other=0.0,
                                 cache_modifier=".cg")
                    x_s.store(xv.to(gl.float16))
                gl.thread_barrier()
                prev = op
            acc = gl.zeros([R, 8], gl.float32, MMA)
            npart = nc // KS
            for c0 in range(q * npart, (q + 1) * npart, CPS):
                st = g % ST
                mbarrier.wait(bars.index(st), (g // ST) & 1)
                for j in gl.static_range(CPS):
                    w2 = ring.index(st).slice(j * R, R).load(WL2)                      # [R, 32] int32
                    wv = gl.convert_layout(gl.reshape(w2, [R, 1, 4, 8]), WD1, assert_trivial=True)
                    acc = mma_v2(_frag_fp8(wv, None, DA, True), _b_row(x4, c0 + j, DB), acc)
                gl.thread_barrier()             # every warp has read stage st before TMA overwrites it
                _issue(desc, ring, bars, tiles_ptr, t0, g + ST, st, n_tiles, R, CPS)
                g += 1
            out = gl.convert_layout(acc, OL)    # [R, 8]: row r, token column (all 8 hold the same sums)
            col = gl.sum(gl.where(ocol[None, :] == 0, out, 0.0), axis=1)
            if KS > 1:
                n_i = gl.load(m + 5).to(gl.int32) * R
                gl.store(part_ptr + gl.load(m + 7) + q * n_i + blk * R + orow, col)
            else:
                gl.store(y_i + blk * R + orow, (col * gl.load(s_i + blk * R + orow)).to(gl.bfloat16))
            gl.thread_barrier()                 # release cumulativity covers the stores ordered before it
            gl.atomic_add(cnt_ptr + op, 1, sem="release", scope="gpu")


def stream_constexprs(rows: int, cps: int, stages: int, ncp: int, num_warps: int, max_polls: int, dep: bool,
                      consumer: str, ksplit: int = 1) -> dict:
    """The compile-time arguments of the stream kernel of ``consumer`` (``fma``: :func:`_chain_stream`, ``mma``:
    :func:`_chain_stream_mma`), shared by the launch and :func:`compile_sm90`."""
    d = dict(R=rows, CPS=cps, ST=stages, NCP=ncp, MAX_POLLS=max_polls, META_W=STREAM_META, DEP=dep)
    if consumer == "mma":
        return dict(d, WL2=word_layout_2d(rows, 1, num_warps, 8), WD1=fp8_word_layout(rows, 1, num_warps), KS=ksplit)
    return dict(d, BL=tile_layout_regs(rows, num_warps))


class Stream:
    """The ``stream`` execution's state on one device: the repacked tiles and their descriptor, the work plan
    (:func:`plan_items`), counters int32 ``[L]``, error words int32 ``[2]``, and the launch settings. ``dep`` False:
    the ``streamfree`` execution (every op reads the same fixed input, held in this object's own buffer; no waits:
    the stream's and the consumer's own rate). ``ksplit > 1`` (``mma`` only): each row block also split into that
    many K parts, their float32 partials in ``part`` (:func:`part_elems`), y formed from them.

    Raises:
        StreamError: settings the chain cannot be tiled or fitted with (:func:`check_stream`)."""

    def __init__(self, chain, rows: int, cps: int, stages: int, num_warps: int, max_polls: int,
                 programs: int | None = None, dep: bool = True, cooperative: bool = True, consumer: str = "fma",
                 ksplit: int = 1):
        ops = chain.ops
        dev = chain.w.device
        self.ncp = _pow2(max(k for k, _ in ops) // BKC)
        if stages <= 0:
            stages = auto_stages(self.ncp, rows, cps)
        self.smem = check_stream(ops, rows, stages * cps, num_warps, cps=cps, consumer=consumer, ksplit=ksplit)
        self.consumer, self.ksplit = consumer, ksplit
        self.rows, self.cps, self.stages, self.num_warps, self.max_polls = rows, cps, stages, num_warps, max_polls
        self.grid = programs or (torch.cuda.get_device_properties(dev).multi_processor_count
                                 if dev.type == "cuda" else 1)
        self.packed, base = repack(chain.w, chain.w_off, ops, rows)
        self.dep = dep
        if dep:
            self.act, x_off, self.y_off = chain.act, [chain.x_off(i) for i in range(len(ops))], chain.y_off
        else:
            # every op reads one fixed input (N(0, 1) BF16, as large as the largest K) from a buffer of its own, so
            # no op reads what another writes
            kmax = max(k for k, _ in ops)
            self.act = torch.empty(kmax + sum(n for _, n in ops), dtype=torch.bfloat16, device=dev)
            g = torch.Generator(device=dev).manual_seed(1)
            self.act[:kmax] = torch.randn(kmax, generator=g, device=dev).to(torch.bfloat16)
            x_off, self.y_off, o = [0] * len(ops), [], kmax
            for _, n in ops:
                self.y_off.append(o)
                o += n
        self.plan = plan_items(ops, rows, self.grid, base, chain.s_off, x_off, self.y_off, dev, ksplit)
        self.part = torch.zeros(part_elems(ops, ksplit) if ksplit > 1 else 1, dtype=torch.float32, device=dev)
        self.cnt = torch.zeros(len(ops), dtype=torch.int32, device=dev)
        self.err = torch.zeros(2, dtype=torch.int32, device=dev)
        self.desc = descriptor(self.packed, rows * cps, consumer) if dev.type == "cuda" else None
        self.cooperative = cooperative and dev.type == "cuda"
        self.regs = None

    def constexprs(self) -> dict:
        return stream_constexprs(self.rows, self.cps, self.stages, self.ncp, self.num_warps, self.max_polls,
                                 self.dep, self.consumer, self.ksplit)

    def run(self, chain) -> None:
        """Zero the counters (one node in a captured graph) and launch the persistent kernel."""
        self.cnt.zero_()
        p = self.plan
        args = (self.desc, chain.s, self.act, p["meta"], p["items"], p["item_start"], p["tiles"], p["tile_start"],
                self.cnt, self.err) + ((self.part,) if self.consumer == "mma" else ())
        kern = _chain_stream_mma if self.consumer == "mma" else _chain_stream
        k = kern[(self.grid,)](*args, **self.constexprs(), num_warps=self.num_warps,
                               **({"launch_cooperative_grid": True} if self.cooperative else {}))
        if self.regs is None and k is not None:
            self.regs = getattr(k, "n_regs", None)

    def outputs(self, chain) -> list[torch.Tensor]:
        """Copies of every op's y (bf16 ``[N_i]``) where this execution writes them; with ``ksplit > 1`` formed from
        the op's partials as the kernel forms the next op's x: ``bf16(s * (part_0 + part_1 + ...))``, float32 adds
        in the order p = 0..ksplit-1."""
        if self.ksplit == 1:
            return [self.act[o:o + n].clone() for o, (_, n) in zip(self.y_off, chain.ops)]
        ys, off = [], 0
        for i, (_, n) in enumerate(chain.ops):
            parts = self.part[off:off + self.ksplit * n].view(self.ksplit, n)
            acc = parts[0].clone()
            for q in range(1, self.ksplit):
                acc = acc + parts[q]
            ys.append((acc * chain.s[chain.s_off[i]:chain.s_off[i] + n]).to(torch.bfloat16))
            off += self.ksplit * n
        return ys

    def poison(self, chain) -> None:
        """NaN into every y this execution writes (the inputs kept), and into the partials."""
        if self.dep:
            chain.poison()
        else:
            self.act[self.y_off[0]:].fill_(float("nan"))
        self.part.fill_(float("nan"))

    def check(self, chain) -> None:
        """No spin wait timed out and op i's counter equals its items (``N / R`` row blocks x ``ksplit``).

        Raises:
            RuntimeError: a wait timed out or a counter is off."""
        err = self.err.tolist()
        if err[0]:
            raise RuntimeError(f"stream: {err[0]} spin wait(s) timed out (last at op {err[1]}): the {self.grid} "
                               "programs were not all resident at once, or a block's signal was lost; the outputs "
                               "of this run are garbage")
        want = [n // self.rows * self.ksplit for _, n in chain.ops]
        if self.cnt.tolist() != want:
            raise RuntimeError(f"stream: counters {self.cnt.tolist()} after the run, expected {want}")


def compile_sm90(rows: int = 16, cps: int = 4, stages: int = 16, ncp: int = 128, num_warps: int = 4,
                 max_polls: int = 1 << 24, dep: bool = True, consumer: str = "fma", ksplit: int = 1):
    """The stream kernel of ``consumer`` compiled for sm_90 without a GPU (``scripts/ptxas_util.py``): the kernel
    object (its ``asm["ptx"]``, ``asm["sass"]`` via ptxas_util, ``metadata.shared``)."""
    import ptxas_util
    from triton.runtime.jit import mangle_type
    if consumer == "mma":
        t = torch.empty(0, dtype=torch.int32).new_empty((1 << 20, BKC // 4), device="meta")
        d = TensorDescriptor(t, list(t.shape), list(t.stride()), [rows * cps, BKC // 4], word_tile_layout())
    else:
        t = torch.empty(0, dtype=torch.uint8).new_empty((1 << 20, BKC), device="meta")
        d = TensorDescriptor(t, list(t.shape), list(t.stride()), [rows * cps, BKC], tile_layout())
    return ptxas_util.compile_kernel(
        _chain_stream_mma if consumer == "mma" else _chain_stream,
        stream_constexprs(rows, cps, stages, ncp, num_warps, max_polls, dep, consumer, ksplit),
        dict(desc=mangle_type(d), s_ptr="*fp32", act_ptr="*bf16", meta_ptr="*i64", items_ptr="*i32",
             item_start_ptr="*i32", tiles_ptr="*i32", tile_start_ptr="*i32", cnt_ptr="*i32", err_ptr="*i32",
             **({"part_ptr": "*fp32"} if consumer == "mma" else {})),
        90, dict(num_warps=num_warps), gluon=True)
