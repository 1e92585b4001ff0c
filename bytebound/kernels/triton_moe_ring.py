"""Kernel A of the ``split`` MoE as a persistent TMA ring (config key ``TR``, experimental): the routed gate/up
weights stream into shared memory while earlier tiles are decoded and multiplied.

Why: kernel A of ``triton_moe_split`` runs a thousand-odd short programs, each of which loads its expert id, then
its weight tile into registers, then decodes, multiplies and stores a partial. On the H100 it reads the M = 4
verify's 67 MB at about half of the rate at which the same tiles stream when nothing is computed
(docs/perf/session23-h100-w4a8/: 45 us against 23 us), with 40 % of the SM's issue slots used: every program
pays the id -> weights -> partial chain, and ptxas keeps only 1-2 of a thread's weight loads in flight ahead of
the first mma (docs/perf/session24-h100-rk/). Here one program per SM walks the work items ``pid, pid + G, ...``
(item = slot s, row block j, H chunk p of ``CW = 128*NS`` columns) and keeps ``ST`` items' tiles in flight: a ring
of ``ST`` shared-memory stages, each filled by two TMA copies (the ``BI`` gate rows and the ``BI`` up rows of
expert ``ids[s]``) and tracked by one mbarrier; a stage is refilled with item ``k + ST`` as soon as item ``k`` has
been read out of it. Which expert a slot's items read, and whether the slot owns it, is looked up per item in a
row built once per program (:func:`_slot_info`, scratch ``ring_info``).

Per item the maths is kernel A's with ``KP = H / CW``, ``KC = 1``, ``RK = 1`` exactly: the same words decoded by
the same :func:`~bytebound.kernels.triton_moe_split.frag_dequant` into the same mma order against the same B
operand (x in the logical k order: staged once per program in shared memory, or with ``TR_XS 0`` loaded per item
from global memory as the split kernel does), and the same float32 partial stored in the ``RK`` layout. So
:func:`~bytebound.kernels.triton_moe_split._moe_reduce_swiglu` and kernel B run after it unchanged, and the output
is the ``split`` kernels' at that tiling bit for bit (``tests/gpu/test_kernels_gpu.py::
test_ring_kernel_a_keeps_the_bits``: passed on the H100 before the slot row; measured slower than the ``split``
kernel A at every tried shape, docs/perf/session26-h100-ring/, hence off).

A slot whose expert an earlier slot chose does no work (``split``'s dedup): its items arrive on their stage's
mbarrier without a copy, so the ring's phases stay in step. The E8M0 scales (8 bytes a row and item, below TMA's
16-byte minimum box) are loaded into registers one item ahead. The fused shared expert's items (FP8) come first in
each program's list and run the ``split`` kernel's shared-slot code with plain loads; their stages only arrive.
Needs sm_90 (TMA, mbarriers, ~110 KB of shared memory per program).
"""

from __future__ import annotations

import functools

import torch

from bytebound.errors import BackendError
from bytebound.kernels.device import sm_count
from bytebound.kernels import triton_moe_split as ts
from bytebound.kernels.scratch import scratch

gluon, gl = ts.gluon, ts.gl
mma_v2 = ts.mma_v2
if gluon is not None:
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@functools.lru_cache(maxsize=None)
def word_layout_2d(rows: int, ns: int, num_warps: int, words: int = 4):
    """:func:`~bytebound.kernels.triton_moe_split.word_layout` (E2M1: ``words`` 4; FP8: 8) for the flat tile
    ``[rows, 4*words*ns]`` int32 as TMA writes it (word ``4*words*sb + words*t + q``): the same registers, so that
    the reshape to ``[rows, ns, 4, words]`` is that layout with no data movement. Also the FP8 stream consumer's
    tile layout (``scripts/chain_stream.py``)."""
    reg = [[0, 1 << b] for b in range(words.bit_length() - 1)] + [[8, 0]]
    reg += [[0, 4 * words << b] for b in range(ns.bit_length() - 1)]
    r = 16 * num_warps
    while r < rows:
        reg.append([r, 0])
        r *= 2
    lane = [[0, words], [0, 2 * words], [1, 0], [2, 0], [4, 0]]
    warp = [[16 << b, 0] for b in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [rows, 4 * words * ns])


if gluon is not None:
    @gluon.jit
    def _slot_info(ids_ptr, info, S: gl.constexpr, SP: gl.constexpr, NW: gl.constexpr):
        """Once per program: ``info[s]`` = the expert of routed slot ``s`` where no earlier slot chose it (this slot
        owns the expert's work, ``split``'s dedup), else -1, for ``s < S``; ``info`` is this program's own row of
        scratch, so no other program writes it. Ends with a CTA barrier, after which every thread (both partitions of
        ``TR 2``) reads the row with scalar loads (:func:`_item`): two warp reductions per item lookup, three lookups
        an item, cost the ring a third more instructions than the split kernel A (docs/perf/session26-h100-ring/)."""
        L2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
        sr = gl.arange(0, SP, layout=gl.SliceLayout(1, L2))
        tc = gl.arange(0, SP, layout=gl.SliceLayout(0, L2))
        e_s = gl.load(ids_ptr + sr, mask=sr < S, other=-1).to(gl.int32)
        e_t = gl.load(ids_ptr + tc, mask=tc < S, other=-2).to(gl.int32)
        dup = gl.sum(gl.where((e_s[:, None] == e_t[None, :]) & (tc[None, :] < sr[:, None]), 1, 0), axis=1)
        gl.store(info + sr, gl.where(dup == 0, e_s, -1), mask=sr < S)
        gl.thread_barrier()

    @gluon.jit
    def _program_items(ids_ptr, info_ptr, PDL_IN: gl.constexpr, PDL: gl.constexpr, S: gl.constexpr,
                       SP: gl.constexpr, NW: gl.constexpr, NIT: gl.constexpr):
        """Both ring kernels' start once their barriers exist: wait for the router (PDL), build this program's slot
        row (:func:`_slot_info`) and count its items ``pid, pid + G, ..`` of ``NIT``. Returns ``(pid, G, info,
        n_my)``."""
        pid = gl.program_id(0)
        G = gl.num_programs(0)
        ts._pdl_in(PDL_IN, PDL, NW)         # the router's ids and x are complete past this point
        info = info_ptr + pid * SP
        _slot_info(ids_ptr, info, S, SP, NW)
        return pid, G, info, (NIT - pid + G - 1) // G

    @gluon.jit
    def _item(info, it, S: gl.constexpr, NJ: gl.constexpr, KP: gl.constexpr, NSH: gl.constexpr):
        """Work item ``it`` -> ``(sh, s, j, p, e, owner)``: whether it is the shared expert's (items ``0 .. NSH-1``,
        slot ``S``: first, so that their plain loads start each program), slot, row block, H chunk, expert (-1 where
        this routed slot does not own it), and whether this routed slot does the expert's work (no earlier slot chose
        it; false for shared items). ``info``: this program's :func:`_slot_info` row (one scalar load, L1-resident)."""
        sh = it < NSH
        ri = gl.maximum(it - NSH, 0)
        s = gl.where(sh, S, ri // (NJ * KP))
        rem = gl.where(sh, it, ri % (NJ * KP))
        e = gl.load(info + gl.minimum(s, S - 1))
        owner = (e >= 0) & (sh == 0)
        return sh, s, rem // KP, rem % KP, e, owner

    @gluon.jit
    def _issue(desc, ring, bars, info, it, st, valid, S: gl.constexpr, I: gl.constexpr, BI: gl.constexpr,
               NJ: gl.constexpr, KP: gl.constexpr, NSH: gl.constexpr, NWORD: gl.constexpr):
        """Fill stage ``st`` with item ``it`` (when ``valid``): the gate rows and the up rows of its expert, H chunk
        ``p``, by TMA; a non-owner or shared item only arrives on the stage's barrier."""
        sh, s, j, p, e, owner = _item(info, it, S, NJ, KP, NSH)
        go = valid & owner
        bar = bars.index(st)
        buf = ring.index(st)
        mbarrier.expect(bar, 2 * BI * NWORD * 4, pred=go)
        tma.async_copy_global_to_shared(desc, [e * (2 * I) + j * BI, p * NWORD], bar, buf.slice(0, BI, 0), pred=go)
        tma.async_copy_global_to_shared(desc, [e * (2 * I) + I + j * BI, p * NWORD], bar, buf.slice(BI, BI, 0),
                                        pred=go)
        mbarrier.arrive(bar, pred=valid & (owner == 0))

    @gluon.jit
    def _scales(s13_ptr, info, it, valid, r, S: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
                BI: gl.constexpr, NJ: gl.constexpr, KP: gl.constexpr, NSH: gl.constexpr, NS: gl.constexpr,
                WD: gl.constexpr):
        """Item ``it``'s E8M0 bytes ``[2*BI, NS, 4]`` (layout ``SliceLayout(3, WD)``), zeros when not ``valid`` or
        not a routed owner."""
        sh, s, j, p, e, owner = _item(info, it, S, NJ, KP, NSH)
        SD: gl.constexpr = gl.SliceLayout(3, WD)
        sb = gl.arange(0, NS, layout=gl.SliceLayout(0, gl.SliceLayout(2, SD)))
        tb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, SD)))
        row = gl.where(r < BI, j * BI + r, I + j * BI + (r - BI))
        off = (e * (2 * I) + row)[:, None, None] * (H // 32) + p * (NS * 4) + sb[None, :, None] * 4 \
            + tb[None, None, :]
        return gl.load(s13_ptr + off, mask=(off >= 0) & valid & owner, other=0)

    @gluon.jit
    def _stage_x(x_ptr, H: gl.constexpr, M: gl.constexpr, NS: gl.constexpr, KPP: gl.constexpr, NW: gl.constexpr,
                 DQ: gl.constexpr):
        """x ``[M, H]`` as the B operand of every H chunk, staged once per program: shared ``[KPP, 128*NS, 8]``
        BF16 (``KPP`` = H / (128 NS)), chunk ``p`` in the logical k order of the routed decode ``DQ``
        (``triton_moe_split._b_spread``)."""
        CW: gl.constexpr = NS * 128
        x_s = gl.allocate_shared_memory(gl.bfloat16, [KPP, CW, 8], ts.XS_LAYOUT)
        for pc in gl.static_range(H // CW):
            x_s.index(pc).store(ts._b_spread(x_ptr + pc * CW, H, M, NS, NW, DQ))
        gl.thread_barrier()
        return x_s

    @gluon.jit
    def _moe_gateup_ring(desc, s13_ptr, x_ptr, ids_ptr, part_ptr, lut_ptr, sw13_ptr, ss13_ptr, act_ptr, cnt_ptr,
                         info_ptr, slimit, H: gl.constexpr, I: gl.constexpr,
                         TOPK: gl.constexpr, M: gl.constexpr, SP: gl.constexpr, BI: gl.constexpr, NS: gl.constexpr,
                         KPP: gl.constexpr, ST: gl.constexpr, WD: gl.constexpr, WD2: gl.constexpr,
                         DQ: gl.constexpr, PDL_IN: gl.constexpr, PDL: gl.constexpr, SHARED: gl.constexpr,
                         HAS_LIMIT: gl.constexpr, WD8: gl.constexpr, XSG: gl.constexpr):
        """``TR 1``: one program per SM (module docstring); the program issues the TMA copies itself, refilling a
        stage after a CTA barrier once every warp has read it (:func:`_consume_items`)."""
        NW: gl.constexpr = gl.num_warps()
        S: gl.constexpr = M * TOPK
        R1: gl.constexpr = 2 * BI
        NJ: gl.constexpr = I // BI
        NWORD: gl.constexpr = NS * 16
        KP: gl.constexpr = H // (NS * 128)
        NSH: gl.constexpr = NJ * KP if SHARED else 0
        NIT: gl.constexpr = S * NJ * KP + NSH
        ring = gl.allocate_shared_memory(gl.int32, [ST, R1, NWORD], desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [ST, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(ST):
            mbarrier.init(bars.index(i), count=1)
        pid, G, info, n_my = _program_items(ids_ptr, info_ptr, PDL_IN, PDL, S, SP, NW, NIT)
        for i in gl.static_range(ST):
            _issue(desc, ring, bars, info, pid + i * G, i, i < n_my, S, I, BI, NJ, KP, NSH, NWORD)
        x_s = _stage_x(x_ptr, H, M, NS, KPP, NW, DQ) if XSG else ring
        _consume_items(desc, s13_ptr, info, part_ptr, lut_ptr, x_ptr, sw13_ptr, ss13_ptr, act_ptr, cnt_ptr, slimit,
                       ring, bars, bars, x_s, n_my, pid, G, H, I, M, S, SP, BI, NS, ST, WD, WD2, DQ, NW, NSH, HAS_LIMIT,
                       WD8, 0, XSG)

if gluon is not None:
    @gluon.jit
    def _ws_load(desc, info, ring, ready, empty, n_my, pid, G, I: gl.constexpr, BI: gl.constexpr,
                 NJ: gl.constexpr, KP: gl.constexpr, NWORD: gl.constexpr, S: gl.constexpr, SP: gl.constexpr,
                 ST: gl.constexpr, NSH: gl.constexpr):
        """``TR 2``, the producer warp: for each of this program's items, wait until its stage is free (the
        consumers arrived on ``empty``), then fill it by TMA (or arrive without a copy for a non-owner item)."""
        for k in range(n_my):
            st = k % ST
            mbarrier.wait(empty.index(st), ((k // ST) & 1) ^ 1)
            _issue(desc, ring, ready, info, pid + k * G, st, True, S, I, BI, NJ, KP, NSH, NWORD)

    @gluon.jit
    def _consume_items(desc, s13_ptr, info, part_ptr, lut_ptr, x_ptr, sw13_ptr, ss13_ptr, act_ptr, cnt_ptr, slimit,
                       ring, ready, empty, x_s, n_my, pid, G, H: gl.constexpr, I: gl.constexpr, M: gl.constexpr,
                       S: gl.constexpr, SP: gl.constexpr, BI: gl.constexpr, NS: gl.constexpr, ST: gl.constexpr,
                       WD: gl.constexpr, WD2: gl.constexpr, DQ: gl.constexpr, NW: gl.constexpr, NSH: gl.constexpr,
                       HAS_LIMIT: gl.constexpr, WD8: gl.constexpr, WS: gl.constexpr, XSG: gl.constexpr):
        """The consumers' loop over this program's items: wait for the item's stage (``ready``), read its weight
        words out, decode, multiply and store the partial (routed owners) or run the shared-slot code (shared
        items). ``WS`` 1 (``TR 2``, the default partition): release the stage on ``empty`` right after reading it,
        for the producer warp to refill. ``WS`` 0 (``TR 1``): a CTA barrier, then this program refills the stage
        with the item ``ST`` ahead itself."""
        NPC: gl.constexpr = 8
        R1: gl.constexpr = 2 * BI
        NJ: gl.constexpr = I // BI
        CW: gl.constexpr = NS * 128
        NWORD: gl.constexpr = NS * 16
        KP: gl.constexpr = H // CW
        MV: gl.constexpr = 1 if M == 1 else 4
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        RL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NW], [1, 0])
        SD: gl.constexpr = gl.SliceLayout(3, WD)
        l0 = gl.load(lut_ptr)
        l1 = gl.load(lut_ptr + 1)
        l2 = gl.load(lut_ptr + 2)
        l3 = gl.load(lut_ptr + 3)
        l4 = gl.load(lut_ptr + 4)
        r = gl.arange(0, R1, layout=gl.SliceLayout(1, gl.SliceLayout(2, SD)))
        # the partial is stored straight from the mma accumulator's layout (no shared-memory conversion, no barrier)
        pr = gl.arange(0, R1, layout=gl.SliceLayout(1, MMA))
        gc = gl.arange(0, NPC, layout=gl.SliceLayout(0, MMA))
        pm = (gl.zeros([R1, NPC], gl.int32, MMA) + gc[None, :]) < MV
        sv_next = _scales(s13_ptr, info, pid, 0 < n_my, r, S, H, I, BI, NJ, KP, NSH, NS, WD)
        for k in range(n_my):
            st = k % ST
            it = pid + k * G
            sh, s, j, p, e, owner = _item(info, it, S, NJ, KP, NSH)
            sv = sv_next
            sv_next = _scales(s13_ptr, info, it + G, k + 1 < n_my, r, S, H, I, BI, NJ, KP, NSH, NS, WD)
            mbarrier.wait(ready.index(st), (k // ST) & 1)
            w2 = ring.index(st).load(WD2)
            if WS:
                fence_async_shared()
                mbarrier.arrive(empty.index(st), count=1)
            if NSH > 0:
                if sh:
                    ts._gateup_shared(x_ptr, sw13_ptr, ss13_ptr, act_ptr, part_ptr, cnt_ptr, slimit, S, j, p, H, I,
                                      M, BI, KP, HAS_LIMIT, WD8, 0, MMA, DA, DB, RL, 1, 1, 0)
            if owner:
                wv = gl.convert_layout(gl.reshape(w2, [R1, NS, 4, 4]), WD, assert_trivial=True)
                if XSG:
                    b = x_s.index(p).load(DB)
                else:
                    b = ts._load_b(x_ptr + p * CW, H, M, NS, NW, DB, DQ=DQ)
                acc = mma_v2(ts.frag_dequant(wv, sv, l0, l1, l2, l3, l4, DA, DQ), b,
                             gl.zeros([R1, NPC], gl.float32, MMA))
                base = part_ptr + (s * NJ + j) * (KP * R1 * MV) + p * (R1 * MV)
                gl.store(base + pr[:, None] * MV + gc[None, :], acc, mask=pm)
            if not WS:
                gl.thread_barrier()             # every warp has read stage st before it is refilled
                _issue(desc, ring, ready, info, it + ST * G, st, k + ST < n_my, S, I, BI, NJ, KP, NSH, NWORD)

    @gluon.jit
    def _moe_gateup_ring_ws(desc, s13_ptr, x_ptr, ids_ptr, part_ptr, lut_ptr, sw13_ptr, ss13_ptr, act_ptr, cnt_ptr,
                            info_ptr, slimit, H: gl.constexpr, I: gl.constexpr,
                            TOPK: gl.constexpr, M: gl.constexpr, SP: gl.constexpr, BI: gl.constexpr,
                            NS: gl.constexpr, KPP: gl.constexpr, ST: gl.constexpr, WD: gl.constexpr,
                            WD2: gl.constexpr, DQ: gl.constexpr, PDL_IN: gl.constexpr, PDL: gl.constexpr,
                            SHARED: gl.constexpr, HAS_LIMIT: gl.constexpr, WD8: gl.constexpr, XSG: gl.constexpr):
        """``TR 2``: :func:`_moe_gateup_ring` with the TMA issue in a producer warp of its own (warp
        specialisation) and a ``ready`` / ``empty`` mbarrier pair per stage, so the consumer warps never stop at a
        CTA-wide barrier inside the loop. Same items, same maths, same bits."""
        NW: gl.constexpr = gl.num_warps()
        S: gl.constexpr = M * TOPK
        R1: gl.constexpr = 2 * BI
        NJ: gl.constexpr = I // BI
        CW: gl.constexpr = NS * 128
        NWORD: gl.constexpr = NS * 16
        KP: gl.constexpr = H // CW
        NSH: gl.constexpr = NJ * KP if SHARED else 0
        NIT: gl.constexpr = S * NJ * KP + NSH
        ring = gl.allocate_shared_memory(gl.int32, [ST, R1, NWORD], desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [ST, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [ST, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(ST):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        pid, G, info, n_my = _program_items(ids_ptr, info_ptr, PDL_IN, PDL, S, SP, NW, NIT)
        x_s = _stage_x(x_ptr, H, M, NS, KPP, NW, DQ) if XSG else ring
        gl.warp_specialize([
            (_consume_items, (desc, s13_ptr, info, part_ptr, lut_ptr, x_ptr, sw13_ptr, ss13_ptr, act_ptr, cnt_ptr,
                              slimit, ring, ready, empty, x_s, n_my, pid, G, H, I, M, S, SP, BI, NS, ST, WD, WD2, DQ,
                              NW, NSH, HAS_LIMIT, WD8, 1, XSG)),
            (_ws_load, (desc, info, ring, ready, empty, n_my, pid, G, I, BI, NJ, KP, NWORD, S, SP, ST, NSH)),
        ], [1], [40])


def ring_constexprs(m: int, k: int, h: int, i: int, cfg: dict, pdl: bool, pdl_in: int, dq: int,
                    shared: bool = False, has_limit: bool = False) -> dict:
    """Compile-time arguments of :func:`_moe_gateup_ring` for ``m`` tokens under a fitted ``split`` config with
    ``TR`` (``BI``, ``num_warps``, ``TR_NS`` super-blocks per item (default 2: 256 columns, one 128-byte TMA row),
    ``TR_ST`` ring stages (default 4), ``TR_XS`` 1 (default: x staged once per program in shared memory, ~40 KB at
    Ling's H) or 0 (each item's B operand loaded from global memory, L1/L2-resident, as the ``split`` kernel A
    does: less shared memory per program, so more programs fit on an SM)).

    Raises:
        BackendError: H is not a multiple of the item width."""
    ns = int(cfg.get("TR_NS", 2))
    cw = 128 * ns
    if h % cw:
        raise BackendError(f"moe[triton] TR: H={h} is not a multiple of {cw} columns")
    kp = h // cw
    s = m * k
    return dict(H=h, I=i, TOPK=k, M=m, SP=max(32, 1 << (s - 1).bit_length()), BI=cfg["BI"], NS=ns,
                KPP=kp, ST=int(cfg.get("TR_ST", 4)), XSG=int(cfg.get("TR_XS", 1)),
                WD=ts.word_layout(2 * cfg["BI"], ns, cfg["num_warps"]),
                WD2=word_layout_2d(2 * cfg["BI"], ns, cfg["num_warps"]), DQ=dq, PDL_IN=pdl_in, PDL=pdl,
                SHARED=shared, HAS_LIMIT=has_limit,
                WD8=ts.fp8_word_layout(2 * cfg["BI"], max(1, cw // 256), cfg["num_warps"]) if shared else None)


def weight_layout(ns: int):
    """The shared layout of a ring stage's ``[rows, 16*NS]`` int32 words: a 128-byte swizzle for 32-word rows
    (conflict-free 16-byte shared loads)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, 64 * ns), element_bitwidth=32, rank=2)


def weight_desc(kern, bi: int, ns: int):
    """The TMA descriptor of ``kern``'s gate/up words ``[E*2I, H/8]`` int32, box ``[BI, 16*NS]``, cached on the
    binding itself (so it lives and dies with the weights it points at)."""
    cache = kern.__dict__.setdefault("_ring_desc", {})
    d = cache.get((bi, ns))
    if d is None:
        w = kern.w13w.reshape(kern.e * 2 * kern.i, kern.h // 8)
        d = cache[(bi, ns)] = TensorDescriptor.from_tensor(w, [bi, 16 * ns], weight_layout(ns))
    return d


def launch_ring_gateup(kern, x: torch.Tensor, ids: torch.Tensor, part: torch.Tensor, cfg: dict, dq: int,
                       pdl: bool, pdl_in: int, sh=None, act=None, cnt=None, slimit: float = float("inf"),
                       has_limit: bool = False, programs: int | None = None) -> None:
    """Kernel A as the TMA ring for one call: ``x bf16 [M, H]``, ``ids int [M, k]`` -> ``part`` float32 in the
    ``RK`` layout with ``KP = H / (128 * TR_NS)``; with a shared expert ``sh``
    (:class:`~bytebound.kernels.triton_moe_split.SharedFP8`) its partials too (slot ``M*k``, through the ``split``
    kernel's shared-slot code, plain loads), ``act`` / ``cnt`` the launch's scratch, ``slimit`` its clamp (the
    reduce launch uses the same KP, which ``fit_split_config`` put into ``cfg``). ``programs``: the grid (default
    ``TR_G`` x SMs, ``TR_G`` default 1).

    Raises:
        BackendError: H is not a multiple of the item width (:func:`ring_constexprs`)."""
    m, k = ids.shape
    c = ring_constexprs(m, k, kern.h, kern.i, cfg, pdl, pdl_in, dq, sh is not None, has_limit)
    sms = sm_count(x.device)
    g = programs or int(cfg.get("TR_G", 1)) * sms
    nit = (m * k + (sh is not None)) * (kern.i // cfg["BI"]) * (kern.h // (128 * c["NS"]))
    kernel = _moe_gateup_ring_ws if int(cfg.get("TR", 1)) == 2 else _moe_gateup_ring
    extra = dict(maxnreg=int(cfg.get("TR_REGS", 128))) if kernel is _moe_gateup_ring_ws else {}
    sw13, ss13 = (sh.w13w, sh.s13) if sh is not None else (kern.w13w, kern.lut)
    act = part if act is None else act
    cnt = kern.lut if cnt is None else cnt
    grid = min(g, nit)
    info = scratch(x.device, "ring_info", grid * c["SP"], torch.int32)     # one row of slot experts per program
    kernel[(grid,)](weight_desc(kern, cfg["BI"], c["NS"]), kern.s13, x, ids, part, kern.lut, sw13, ss13, act, cnt,
                    info, slimit, **c, num_warps=cfg["num_warps"], launch_pdl=pdl_in > 0, **extra)
