"""Variant ``persist`` of backend ``triton``, op ``moe``: the routed + shared MoE of one decode/verify call in ONE
persistent launch.

Why: the ``split`` variant (``kernels.triton_moe_split``) runs thousands of small programs in two launches; each
program's serial chain (ids, load, decode, mma, partial store, fence, ticket, read-back) and the wave/tail structure
cost it about half of the read bandwidth, and kernel B cannot read its weights before it is scheduled
(docs/perf/moe-kernels-h200.md). Here ``P`` programs, all co-resident (a cooperative launch), do everything:

1. **Start.** Read ``ids`` and issue ``cp.async.bulk.prefetch.L2`` for the down-projection rows this program reads
   in phase B (each routed slot's MXFP4 ``W2`` rows and E8M0 scales of its hidden-row blocks, and the shared
   expert's FP8 ``W2`` rows), so those bytes stream into L2 while phase A streams gate/up from HBM.
2. **Phase A**, gate/up: work item ``(slot s, block j)`` = rows ``gate[j*BI:(j+1)*BI] | up[...]`` of the slot's
   expert over the FULL H (no split-K, no partials, no tickets): a loop over H chunks of ``HC`` columns whose next
   chunk's weight words are loaded before the current chunk is decoded (a register double buffer), then
   SwiGLU (the ``swiglu_limit`` clamp) x the token's routing weight -> ``act`` bf16 (``split``'s epilogue,
   ``_swiglu_store``). Items are dealt round-robin (item ``pid + n*P``). The shared expert is slot ``S`` (FP8 E4M3,
   128x128 block scales, :class:`~bytebound.kernels.triton_moe_split.SharedFP8`).
3. **Grid barrier** (:func:`_grid_barrier`): an arrival counter and a generation word in scratch.
4. **Phase B**, down: work item = one block of ``BH`` hidden rows; the program computes the down products of ALL
   slots for it and sums them in a fixed order -> ``out`` bf16. No tickets, no atomics.

**Phase B's slot-parallel mma.** A program has ``NW`` warps, each on its own 16-row mma tile, but the B operand of
``mma_v2`` is one tensor that every warp holds, so warps cannot multiply different activations. The trick: the
``G`` warps of a row group take ``G`` *different slots* of the same 16 hidden rows, and the B operand holds the
activations of those ``G`` slots side by side in its 8 token columns: column ``g*MP + m`` = ``act[s0 + g, m]``
(``act`` is laid out ``[slot, MP, I]`` with ``MP`` = M rounded up to a power of two, so one row stride reaches every
column; :func:`~bytebound.kernels.triton_moe_split._load_b` does the load). Warp ``g``'s product is wanted only in
its own column block ``g*MP .. g*MP + MP - 1`` (the "diagonal"); the other columns are discarded. The
accumulator runs over one unrolled pipeline of steps (slot group ``s0 = 0, G, 2G, ...``, I chunk of ``IC``
columns), the next step's words loaded before the current one is decoded; at the end the ``G``
warps' diagonals are combined through shared memory in the order ``g = 0..G-1``. So ``BH = 16 * NW / G`` rows per
item with ``G = min(NW, 8 / MP)`` (reduced until it divides ``S``). The shared expert (FP8) is one more step in
which only warp ``g = 0`` of each row group has a non-zero diagonal (its B columns are ``act[S, m]`` alone).

**Dedup (M > 1).** A slot whose expert an earlier slot chose does no gate/up work (``_slot_expert``); the owner's
``act`` carries every token's weight, and phase A stores zeros into the duplicate slot's ``act``, so that phase B,
which multiplies every slot, adds exactly nothing for it. Phase B *reads* the duplicate's ``W2`` rows (the
owner's expert: from L2, prefetched) -- the HBM bytes stay those of the distinct experts.

**Determinism.** Every sum runs in an order fixed by the launch shape; no float atomics: outputs are bit-identical
run to run and graph == eager.

**Barrier and scratch.** ``act`` (``[ST+..., MP, I]`` bf16) and the barrier words ``[count, generation]`` are
``kernels.scratch`` buffers shared by every binding on a device: MoE calls run one after another on one stream.
The barrier re-arms itself: the last arriver resets the count and then bumps the generation (release); the others
spin on the generation they read before arriving. So every launch, and every CUDA-graph replay, starts from
``count == 0``. With ``pdl_in`` the kernel is a PDL dependent of the kernel before it (the router) and every
program waits (``griddepcontrol.wait``) before it touches ``ids``, x or the scratch.

**Residency.** The barrier deadlocks unless all ``P`` programs are resident at once. :func:`launch_persist` launches
with Triton's ``launch_cooperative_grid=True`` (``CU_LAUNCH_ATTRIBUTE_COOPERATIVE``; Gluon kernels take the same
launch option in Triton 3.6: the driver refuses a grid that cannot be co-resident instead of hanging) and sizes
``P`` from the loaded binary's registers and shared memory (:func:`programs_per_sm`), at most ``per_sm`` per SM and
no more than the larger phase's item count. A kernel still running beside it (the router, under PDL) only delays
some programs' start: it finishes on its own, so the barrier cannot deadlock on it. The first call of each shape
compiles the kernel, loads it to read its registers and allocates the scratch, so it must come before CUDA-graph
capture (as for ``split``).

Config keys (variant ``"persist"``): ``BI`` (phase A rows per item: ``2*BI`` = ``16 * num_warps``), ``HC`` (H columns
per phase A chunk, 128 x 2^n dividing H), ``IC`` (I columns per phase B chunk, likewise), ``num_warps``,
``per_sm`` (upper bound on programs per SM; the occupancy bound applies too), ``prefetch`` (default true),
``pdl_in`` (0 or 1), ``cooperative`` (default true; false launches without the cooperative attribute and relies on
the occupancy arithmetic alone, for a driver or graph capture that refuses the attribute).
:func:`fit_persist_config` fits them or raises BackendError.
"""

from __future__ import annotations


import torch

from bytebound.errors import BackendError
from bytebound.kernels.device import sm_count
from bytebound.kernels.scratch import scratch
from bytebound.kernels.triton_moe_split import GLUON_ERR, SharedFP8, gl, gluon

PERSIST_DEFAULT = {"variant": "persist", "BI": 32, "HC": 512, "IC": 256, "num_warps": 4, "per_sm": 4,
                   "prefetch": True, "pdl_in": 0}

if gluon is not None:      # the device code (and the split kernels' device functions it reuses) needs Gluon
    from bytebound.kernels.triton_fp8 import ASM_L2_PREFETCH
    from bytebound.kernels.triton_moe_split import (_fp8_tile, _frag_fp8, _gdc, _load_b, _slot_expert,
                                                    _swiglu_store, fp8_word_layout, frag_dequant, mma_v2,
                                                    mxfp4_tile, word_layout)

    ASM_FENCE_ONLY = gl.constexpr("fence.acq_rel.gpu; mov.u32 $0, 0;")

    @gluon.jit
    def _fence_threads(NW: gl.constexpr):
        """``bar.sync``, then every thread ``fence.acq_rel.gpu``, then ``bar.sync``: the CTA's earlier writes are
        ordered before what one thread does next (arrival), and what one thread observed (the release) before
        everything the CTA does after it."""
        FL: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        gl.thread_barrier()
        gl.inline_asm_elementwise(ASM_FENCE_ONLY, "=r,r", [gl.arange(0, 32 * NW, layout=FL)], gl.int32, False, 1)
        gl.thread_barrier()

    @gluon.jit
    def _grid_barrier(bar_ptr, NP, NW: gl.constexpr):
        """All ``NP`` programs (co-resident) meet here. ``bar_ptr`` int32 ``[2]``: arrival count (0 between
        launches) and generation. Read the generation, arrive (acq_rel), and either be last (reset the count, then
        release-bump the generation) or spin until the generation moves (volatile loads; the fence after the loop
        makes the observing load an acquire)."""
        _fence_threads(NW)
        gen = gl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
        ticket = gl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == NP - 1:
            gl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
            gl.atomic_add(bar_ptr + 1, 1, sem="release", scope="gpu")
        else:
            cur = gen
            while cur == gen:
                cur = gl.load(bar_ptr + 1, volatile=True)
        _fence_threads(NW)

    @gluon.jit
    def _prefetch_down(ids_ptr, w2_ptr, s2_ptr, sw2_ptr, hb, H: gl.constexpr, I: gl.constexpr, S: gl.constexpr,
                       BH: gl.constexpr, SHARED: gl.constexpr, NW: gl.constexpr):
        """L2 prefetch of phase B item ``hb``: thread ``t < S`` the ``W2`` rows ``[hb*BH, +BH)`` of slot ``t``'s
        expert (``BH*I/2`` bytes) and its E8M0 scales (rounded out to 16 bytes), thread ``S`` the shared expert's
        FP8 rows (``BH*I`` bytes). Duplicate experts are prefetched twice (a hint: the second costs no HBM)."""
        FL: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        t = gl.arange(0, 32 * NW, layout=FL)
        e = gl.load(ids_ptr + t, mask=t < S, other=0)
        row = e * H + hb * BH
        nw = gl.where(t < S, BH * (I // 2), 0)
        gl.inline_asm_elementwise(ASM_L2_PREFETCH, "=r,l,r", [w2_ptr + row * (I // 8), nw], gl.int32, False, 1)
        so = row * (I // 32)                                    # byte offset of the scales
        s0 = (so // 16) * 16
        ns = gl.where(t < S, ((so + BH * (I // 32) - s0 + 15) // 16) * 16, 0).to(gl.int32)
        gl.inline_asm_elementwise(ASM_L2_PREFETCH, "=r,l,r", [s2_ptr + s0, ns], gl.int32, False, 1)
        if SHARED:
            n8 = gl.where(t == S, BH * I, 0)
            gl.inline_asm_elementwise(ASM_L2_PREFETCH, "=r,l,r", [sw2_ptr + hb * BH * (I // 4) + t * 0, n8],
                                      gl.int32, False, 1)

    # NP (the grid size) is a run-time argument that is never specialised: one binary for every grid, so the
    # occupancy read from it (persist_grid) is the launched kernel's
    @gluon.jit(do_not_specialize=["NP"])
    def _moe_persist(x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, w2_ptr, s2_ptr, act_ptr, out_ptr, bar_ptr, lut_ptr,
                     limit, sw13_ptr, ss13_ptr, sw2_ptr, ss2_ptr, slimit, NP,
                     H: gl.constexpr, I: gl.constexpr, TOPK: gl.constexpr, M: gl.constexpr, MP: gl.constexpr,
                     SP: gl.constexpr, BI: gl.constexpr, HC: gl.constexpr, IC: gl.constexpr, G: gl.constexpr,
                     HAS_LIMIT: gl.constexpr, SHARED: gl.constexpr, PREFETCH: gl.constexpr,
                     PDL_IN: gl.constexpr, WA: gl.constexpr, WA8: gl.constexpr, WB: gl.constexpr,
                     WB8: gl.constexpr):
        NW: gl.constexpr = gl.num_warps()
        S: gl.constexpr = M * TOPK
        ST: gl.constexpr = S + SHARED
        NJ: gl.constexpr = I // BI
        BH: gl.constexpr = 16 * NW // G
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        RL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NW], [1, 0])
        pid = gl.program_id(0)
        if PDL_IN > 0:      # the router (or whatever ran before) may still run: ids, x and the scratch after this
            _gdc("griddepcontrol.wait; mov.u32 $0, 0;", NW)
        if PREFETCH:
            for hb in range(pid, H // BH, NP):
                _prefetch_down(ids_ptr, w2_ptr, s2_ptr, sw2_ptr, hb, H, I, S, BH, SHARED, NW)

        # ---- phase A: gate/up over the full H, SwiGLU -> act ----
        for it in range(pid, ST * NJ, NP):
            s = it // NJ
            j = it % NJ
            if SHARED:
                if s == S:
                    _gateup_shared_full(x_ptr, sw13_ptr, ss13_ptr, act_ptr, slimit, s, j, H, I, M, MP, BI, HC,
                                        HAS_LIMIT, WA8, MMA, DA, DB)
                else:
                    _gateup_routed_full(x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, act_ptr, lut_ptr, limit, s, j, H,
                                        I, TOPK, M, MP, SP, BI, HC, HAS_LIMIT, WA, MMA, DA, DB, RL)
            else:
                _gateup_routed_full(x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, act_ptr, lut_ptr, limit, s, j, H, I,
                                    TOPK, M, MP, SP, BI, HC, HAS_LIMIT, WA, MMA, DA, DB, RL)

        _grid_barrier(bar_ptr, NP, NW)

        # ---- phase B: all slots' down products of one hidden-row block, summed in a fixed order ----
        for hb in range(pid, H // BH, NP):
            _down_block(act_ptr, ids_ptr, w2_ptr, s2_ptr, out_ptr, lut_ptr, sw2_ptr, ss2_ptr, hb, H, I, M, MP, S,
                        IC, G, SHARED, WB, WB8, MMA, DA, DB)

    @gluon.jit
    def _gateup_epilogue_full(acc, wtok, act_ptr, s, j, limit, I: gl.constexpr, MP: gl.constexpr,
                              BI: gl.constexpr, HAS_LIMIT: gl.constexpr):
        """SwiGLU of the ``[2*BI, 8]`` accumulator (gate rows, then up rows) -> ``act[s, :MP, j-block]``
        (``split``'s ``_swiglu_store``; token columns ``M..MP-1`` carry weight 0 and store zeros)."""
        NW: gl.constexpr = gl.num_warps()
        EL: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NW, 1], [1, 0])
        HSL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        h_s = gl.allocate_shared_memory(gl.float32, [2 * BI, 8], HSL)
        h_s.store(acc)
        gl.thread_barrier()
        _swiglu_store(h_s.slice(0, BI, 0).load(EL), h_s.slice(BI, BI, 0).load(EL), wtok, act_ptr, s, j, limit, I,
                      MP, BI, HAS_LIMIT, EL)
        gl.thread_barrier()     # the next item's store into h_s waits for these loads

    @gluon.jit
    def _gateup_routed_full(x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, act_ptr, lut_ptr, limit, s, j,
                            H: gl.constexpr, I: gl.constexpr, TOPK: gl.constexpr, M: gl.constexpr,
                            MP: gl.constexpr, SP: gl.constexpr, BI: gl.constexpr, HC: gl.constexpr,
                            HAS_LIMIT: gl.constexpr, WA: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr,
                            DB: gl.constexpr, RL: gl.constexpr):
        """Phase A item ``(s, j)`` of a routed slot: MXFP4 rows of ``gate | up`` over all of H in chunks of ``HC``
        columns, the next chunk's words loaded before this one is decoded; a duplicate slot stores zeros."""
        NW: gl.constexpr = gl.num_warps()
        S: gl.constexpr = M * TOPK
        R1: gl.constexpr = 2 * BI
        NS: gl.constexpr = HC // 128
        NCH: gl.constexpr = H // HC
        SD: gl.constexpr = gl.SliceLayout(3, WA)
        ids, e, owner = _slot_expert(ids_ptr, s, S, SP, RL)
        mcol = gl.arange(0, 8, layout=gl.SliceLayout(1, RL))
        acc = gl.zeros([R1, 8], gl.float32, MMA)
        if owner:
            r = gl.arange(0, R1, layout=gl.SliceLayout(1, gl.SliceLayout(2, SD)))
            row = gl.where(r < BI, j * BI + r, I + j * BI + (r - BI))
            wp = w13_ptr + e * (2 * I * (H // 8))
            sp = s13_ptr + e * (2 * I * (H // 32))
            c0 = gl.load(lut_ptr)
            c1 = gl.load(lut_ptr + 1)
            c2 = gl.load(lut_ptr + 2)
            c3 = gl.load(lut_ptr + 3)
            c4 = gl.load(lut_ptr + 4)
            wv, sv = mxfp4_tile(wp, sp, row, 0, H, WA)
            for c in gl.static_range(NCH):
                if c + 1 < NCH:     # the next chunk's words in flight while this one is decoded
                    wn, sn = mxfp4_tile(wp, sp, row, (c + 1) * NS, H, WA)
                b = _load_b(x_ptr + c * HC, H, M, NS, NW, DB)
                acc = mma_v2(frag_dequant(wv, sv, c0, c1, c2, c3, c4, DA), b, acc)
                if c + 1 < NCH:
                    wv = wn
                    sv = sn
            t = gl.arange(0, SP, layout=gl.SliceLayout(0, RL))
            tw = gl.load(tw_ptr + t, mask=t < S, other=0.0)
            sel = (ids[None, :] == e) & ((t // TOPK)[None, :] == mcol[:, None])
            wtok = gl.sum(gl.where(sel, tw[None, :], 0.0), axis=1)                  # [8]
        else:       # the owner's act carries this expert for every token; phase B must add nothing here
            wtok = gl.zeros([8], gl.float32, gl.SliceLayout(1, RL))
        _gateup_epilogue_full(acc, wtok, act_ptr, s, j, limit, I, MP, BI, HAS_LIMIT)

    @gluon.jit
    def _gateup_shared_full(x_ptr, sw13_ptr, ss13_ptr, act_ptr, slimit, s, j, H: gl.constexpr, I: gl.constexpr,
                            M: gl.constexpr, MP: gl.constexpr, BI: gl.constexpr, HC: gl.constexpr,
                            HAS_LIMIT: gl.constexpr, WA8: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr,
                            DB: gl.constexpr):
        """Phase A item ``(S, j)``: the shared expert's FP8 rows over all of H, in chunks of ``NC`` super-blocks
        (``WA8``; half of a routed chunk's columns when it can, so the same register budget), double-buffered;
        routing weight 1 for every token."""
        NW: gl.constexpr = gl.num_warps()
        R1: gl.constexpr = 2 * BI
        NC: gl.constexpr = WA8.shape[1]
        NCH: gl.constexpr = H // (NC * 128)
        r8 = gl.arange(0, R1, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WA8))))
        row8 = gl.where(r8 < BI, j * BI + r8, I + j * BI + (r8 - BI))               # row of [gate; up]
        acc = gl.zeros([R1, 8], gl.float32, MMA)
        wv, sv = _fp8_tile(sw13_ptr, ss13_ptr, row8, 0, H, WA8)
        for c in gl.static_range(NCH):
            if c + 1 < NCH:
                wn, sn = _fp8_tile(sw13_ptr, ss13_ptr, row8, (c + 1) * NC, H, WA8)
            b = _load_b(x_ptr + c * (NC * 128), H, M, NC, NW, DB)
            acc = mma_v2(_frag_fp8(wv, sv, DA), b, acc)
            if c + 1 < NCH:
                wv = wn
                sv = sn
        RLW: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NW], [1, 0])
        mcol = gl.arange(0, 8, layout=gl.SliceLayout(1, RLW))
        wtok = gl.where(mcol < M, 1.0, 0.0)
        _gateup_epilogue_full(acc, wtok, act_ptr, s, j, slimit, I, MP, BI, HAS_LIMIT)

    @gluon.jit
    def _down_block(act_ptr, ids_ptr, w2_ptr, s2_ptr, out_ptr, lut_ptr, sw2_ptr, ss2_ptr, hb, H: gl.constexpr,
                    I: gl.constexpr, M: gl.constexpr, MP: gl.constexpr, S: gl.constexpr, IC: gl.constexpr,
                    G: gl.constexpr, SHARED: gl.constexpr, WB: gl.constexpr, WB8: gl.constexpr, MMA: gl.constexpr,
                    DA: gl.constexpr, DB: gl.constexpr):
        """Phase B item ``hb``: ``out[:, hb*BH:(hb+1)*BH] = sum_s W2[e_s, rows] @ act[s]^T`` (+ the shared
        expert), BF16. Warp ``w`` = (row group ``w // G``, slot offset ``g = w % G``) (module docstring)."""
        NW: gl.constexpr = gl.num_warps()
        R: gl.constexpr = 16 * NW
        BH: gl.constexpr = R // G
        NS: gl.constexpr = IC // 128
        NCH: gl.constexpr = I // IC
        SD: gl.constexpr = gl.SliceLayout(3, WB)
        r = gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, SD)))
        g = (r // 16) % G
        hid = hb * BH + (r // 16 // G) * 16 + r % 16
        c0 = gl.load(lut_ptr)
        c1 = gl.load(lut_ptr + 1)
        c2 = gl.load(lut_ptr + 2)
        c3 = gl.load(lut_ptr + 3)
        c4 = gl.load(lut_ptr + 4)
        acc = gl.zeros([R, 8], gl.float32, MMA)
        # one pipeline over the steps q = (slot group q // NCH, I chunk q % NCH), unrolled, so the next step's
        # words (also across a slot-group boundary, and the shared expert's first chunk) are in flight while this
        # step is decoded; groups in the order s = 0, G, 2G, ...
        NQ: gl.constexpr = (S // G) * NCH
        if SHARED:
            NC: gl.constexpr = WB8.shape[1]
            NCH8: gl.constexpr = I // (NC * 128)
            RS8: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WB8)))
            r8 = gl.arange(0, R, layout=RS8)
            h8 = hb * BH + (r8 // 16 // G) * 16 + r8 % 16
        row = gl.load(ids_ptr + g) * H + hid
        wv, sv = mxfp4_tile(w2_ptr, s2_ptr, row, 0, I, WB)
        for q in gl.static_range(NQ):
            if q + 1 < NQ:
                if (q + 1) % NCH == 0:      # the next slot group's experts
                    rown = gl.load(ids_ptr + ((q + 1) // NCH) * G + g) * H + hid
                else:
                    rown = row
                wn, sn = mxfp4_tile(w2_ptr, s2_ptr, rown, ((q + 1) % NCH) * NS, I, WB)
            elif SHARED:
                wv8, sv8 = _fp8_tile(sw2_ptr, ss2_ptr, h8, 0, I, WB8)
            # token column g*MP + m = act[s0 + g, m]
            b = _load_b(act_ptr + (q // NCH) * G * (MP * I) + (q % NCH) * IC, I, G * MP, NS, NW, DB)
            acc = mma_v2(frag_dequant(wv, sv, c0, c1, c2, c3, c4, DA), b, acc)
            if q + 1 < NQ:
                wv = wn
                sv = sn
                row = rown
        if SHARED:      # slot S, FP8: only the columns of g = 0 are non-zero (the others' diagonals add 0)
            for c in gl.static_range(NCH8):
                if c + 1 < NCH8:
                    wn8, sn8 = _fp8_tile(sw2_ptr, ss2_ptr, h8, (c + 1) * NC, I, WB8)
                b = _load_b(act_ptr + S * (MP * I) + c * (NC * 128), I, M, NC, NW, DB)
                acc = mma_v2(_frag_fp8(wv8, sv8, DA), b, acc)
                if c + 1 < NCH8:
                    wv8 = wn8
                    sv8 = sn8
        # combine the G diagonals of each row group in the order g = 0..G-1 (through shared memory: they sit in
        # different warps)
        HSL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        OL: gl.constexpr = gl.BlockedLayout([1, MP], [32, 1], [NW, 1], [1, 0])
        a_s = gl.allocate_shared_memory(gl.float32, [R, 8], HSL)
        a_s.store(acc)
        gl.thread_barrier()
        orow = gl.arange(0, 16, layout=gl.SliceLayout(1, OL))
        ocol = gl.arange(0, MP, layout=gl.SliceLayout(0, OL))
        for rb in gl.static_range(NW // G):
            tot = gl.zeros([16, MP], gl.float32, OL)
            for gg in gl.static_range(G):
                tot += a_s.slice((rb * G + gg) * 16, 16, 0).slice(gg * MP, MP, 1).load(OL)
            gl.store(out_ptr + ocol[None, :] * H + hb * BH + rb * 16 + orow[:, None], tot.to(gl.bfloat16),
                     mask=(ocol[None, :] < M) & (orow[:, None] >= 0))
        gl.thread_barrier()     # the next item's store into a_s waits for these loads


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def token_pad(m: int) -> int:
    """``MP``: the token count rounded up to a power of two (``act``'s token stride, phase B's column blocks)."""
    return 1 << (max(int(m), 1) - 1).bit_length()


def slot_group(num_warps: int, m: int, topk: int) -> int:
    """``G``: the slots phase B multiplies per mma step (one per warp of a row group): the largest power of two
    <= ``min(num_warps, 8 / MP)`` that divides ``S = m * topk``."""
    g = min(num_warps, 8 // token_pad(m))
    while g > 1 and (m * topk) % g:
        g //= 2
    return g


def _chunk(want: int, n: int) -> int:
    """A chunk width 128 x 2^a <= ``want`` that divides ``n`` (the largest), or 0."""
    c = 128 * _pow2_floor(max(want // 128, 1))
    while c >= 128:
        if n % c == 0:
            return c
        c //= 2
    return 0


def fit_persist_config(cfg: dict, h: int, i: int) -> dict:
    """Fit a ``persist`` config to this model's H and I: ``HC`` / ``IC`` to the largest 128 x 2^a chunk <= the asked
    width dividing H / I, ``num_warps`` to a power of two in 2..8 with ``2*BI = 16 * num_warps`` (one mma row tile
    per warp in phase A), ``per_sm`` >= 1.

    Raises:
        BackendError: H or I is not a multiple of 128 (then no chunk fits; ``BI`` <= 64 always divides such an
            I). The token count's constraints are checked at launch (:func:`launch_persist`)."""
    cfg = dict(PERSIST_DEFAULT, **cfg)
    hc, ic = _chunk(int(cfg["HC"]), h), _chunk(int(cfg["IC"]), i)
    if not (hc and ic):
        raise BackendError(f"moe[triton] variant 'persist' needs H and I in chunks of 128 x 2^n columns, got H={h}, "
                           f"I={i}; use variant 'split' or 'gluon'")
    nw = min(8, max(2, _pow2_floor(int(cfg["num_warps"]))))
    bi = 8 * nw
    if i % bi:
        nw, bi = 2, 16
        if i % bi:
            raise BackendError(f"moe[triton] variant 'persist': I={i} is not a multiple of 16 (2*BI rows per item)")
    cfg.update(HC=hc, IC=ic, num_warps=nw, BI=bi, per_sm=max(1, int(cfg["per_sm"])),
               pdl_in=1 if int(cfg.get("pdl_in", 0)) else 0, prefetch=bool(cfg.get("prefetch", True)))
    return cfg


def programs_per_sm(n_regs: int, shared_bytes: int, num_warps: int, sm_shared: int = 228 * 1024,
                    regs_per_sm: int = 65536, max_warps: int = 64, max_blocks: int = 32) -> int:
    """How many programs of a compiled kernel fit on one SM (Hopper limits by default; CUDA occupancy rules):
    registers are allocated per warp in units of 256 (``n_regs`` x 32 rounded up) from each of the 4 SM
    sub-partitions' quarter of the register file, shared memory per block plus 1 KB reserved, at most
    ``max_warps`` warps and ``max_blocks`` blocks. Returns 0 when none fits."""
    per_warp = ((max(n_regs, 1) * 32 + 255) // 256) * 256
    by_regs = (4 * ((regs_per_sm // 4) // per_warp)) // num_warps
    by_smem = sm_shared // (shared_bytes + 1024)
    return max(0, min(by_regs, by_smem, max_warps // num_warps, max_blocks))



def launch_persist(kern, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: dict,
                   sh: SharedFP8 | None = None) -> None:
    """Run the persistent kernel for one call of :class:`~bytebound.kernels.moe_host.MoEKernel` ``kern``.

    ``x bf16 [M, H]``, ``ids int32/int64 [M, k]``, ``w float32 [M, k]`` (contiguous), ``out bf16 [M, H]``; with a
    shared expert ``sh`` (``MoEKernel.bind_shared``) ``out`` is routed + shared. ``cfg`` fitted by
    :func:`fit_persist_config`.

    Raises:
        BackendError: Gluon is not importable, the GPU is older than sm_90 (``cp.async.bulk.prefetch``, PDL), the
            token count does not fit the program (``S + 1`` prefetch lanes, one per slot and one for the shared
            expert, more than its ``32 * num_warps`` threads; H not a multiple of phase B's ``BH`` rows), or no
            program fits on an SM."""
    if gluon is None:
        raise BackendError(f"moe[triton] variant 'persist': {GLUON_ERR}")
    if not kern.sm90:
        raise BackendError("moe[triton] variant 'persist' needs sm_90+ (bulk L2 prefetch); use 'split' or 'gluon'")
    m, k = ids.shape
    s = m * k
    st = s + (sh is not None)
    h, i = kern.h, kern.i
    nw, bi, hc, ic = cfg["num_warps"], cfg["BI"], cfg["HC"], cfg["IC"]
    if s + 1 > 32 * nw:
        raise BackendError(f"moe[triton] variant 'persist': {s} slots need more than {nw} warps (one prefetch lane "
                           "per slot)")
    mp = token_pad(m)
    g = slot_group(nw, m, k)
    bh = 16 * nw // g
    if h % bh:
        raise BackendError(f"moe[triton] variant 'persist': H={h} is not a multiple of the phase-B block {bh}")
    dev = x.device
    sp = max(32, 1 << (s - 1).bit_length())
    # act [slots, MP, I]; phase B's last slot group reads up to G - 1 slots past the routed ones
    act = scratch(dev, "persist_act", (st + g) * mp * i, torch.bfloat16)
    bar = scratch(dev, "persist_bar", 2, torch.int32)
    inf = float("inf")
    limit = float(kern.limit) if kern.limit is not None else inf
    slimit = float(sh.limit) if sh is not None and sh.limit is not None else inf
    has_limit = kern.limit is not None or (sh is not None and sh.limit is not None)
    sw13, ss13, sw2, ss2 = (sh.w13w, sh.s13, sh.w2w, sh.s2) if sh is not None else (kern.w13w, kern.lut) * 2
    prefetch = bool(cfg.get("prefetch", True)) and all(
        t.data_ptr() % 16 == 0 for t in (kern.w2w, kern.s2, sw2))
    consts = dict(H=h, I=i, TOPK=k, M=m, MP=mp, SP=sp, BI=bi, HC=hc, IC=ic, G=g, HAS_LIMIT=has_limit,
                  SHARED=sh is not None, PREFETCH=prefetch, PDL_IN=int(cfg.get("pdl_in", 0)),
                  WA=word_layout(2 * bi, hc // 128, nw),
                  WA8=fp8_word_layout(2 * bi, max(1, hc // 256), nw) if sh is not None else None,
                  WB=word_layout(16 * nw, ic // 128, nw),
                  WB8=fp8_word_layout(16 * nw, max(1, ic // 256), nw) if sh is not None else None)
    args = (x, ids, w, kern.w13w, kern.s13, kern.w2w, kern.s2, act, out, bar, kern.lut, limit, sw13, ss13, sw2, ss2,
            slimit)
    coop = bool(cfg.get("cooperative", True))
    key = (dev.index, h, i, m, k, sh is not None, has_limit, prefetch, tuple(sorted(cfg.items())))
    n_prog = _GRID.get(key)
    if n_prog is None:
        n_prog = persist_grid(args, consts, nw, int(cfg["per_sm"]), sm_count(dev), st * (i // bi),
                              h // bh, coop)
        _GRID[key] = n_prog
    _moe_persist[(n_prog,)](*args, n_prog, **consts, num_warps=nw, launch_cooperative_grid=coop,
                            launch_pdl=consts["PDL_IN"] > 0)


_GRID: dict = {}


def persist_grid(args, consts: dict, nw: int, per_sm: int, sms: int, items_a: int, items_b: int,
                 coop: bool = True) -> int:
    """``P`` for one specialisation: ``sms x min(per_sm, programs_per_sm(...))`` of the compiled kernel (its
    registers and shared memory do not depend on ``NP``, a run-time argument that is not specialised), and
    no more than the larger phase's item count.

    Raises:
        BackendError: not one program fits on an SM."""
    k = _moe_persist.warmup(*args, 1, **consts, num_warps=nw, launch_cooperative_grid=coop,
                            launch_pdl=consts["PDL_IN"] > 0, grid=(1,))
    k._init_handles()       # loads the binary: its register count
    fit = programs_per_sm(k.n_regs, k.metadata.shared, nw)
    if fit < 1:
        raise BackendError(f"moe[triton] variant 'persist': no program fits on an SM ({k.n_regs} registers, "
                           f"{k.metadata.shared} B shared memory, {nw} warps)")
    return max(1, min(sms * min(per_sm, fit), max(items_a, items_b)))
