"""Group-limited sigmoid routing (``layers.moe.route``) as one Triton kernel for decode and verify (M <= 4 rows).

``route`` in torch is about a dozen small launches per MoE layer (sigmoid, bias add, per-group top-2, group
top-k, scatter, repeat, masked fill, top-k, gather, normalise, scale). At batch 1 each launch costs microseconds
while moving a few KB. Here one program per token does it all in registers over the ``E`` router logits:

    s = sigmoid(logits); sb = s + bias
    key = an int64 ordered as (sb, -index): sb's float order in the high word, E - 1 - index in the low one
    group score = max + second max of sb in each of the G groups (the top-2 sum: two maxima of the keys)
    keep the TOPK_GROUP best groups (iterative max of the group scores' keys), mask the other groups' experts
    ids = the K best remaining sb (iterative max of the keys, s riding along); w = s[ids] / (sum + 1e-20) * scale

Each pick is one reduction over the row: a shuffle tree, then shared memory and barriers across warps, one after
the other, so their number is the routing's length; in ``gemv_route`` one program runs them while the rest of the
GPU waits. A max of keys is a single reduction where argmax carries an index and a gather of s[id] needs another.
``gemv_route``'s tail can therefore cut the row into one segment per warp (whole groups each, :func:`route_segments`):
each warp picks its segment's best keys with shuffles alone, and the row's top K are placed by rank among those
candidates (``_route_rows_seg``; the default, ``BYTEBOUND_ROUTER_SEG=0`` keeps the one-segment ``_route_rows``).
The routing tail's cost, the segmented tail's A/B and the barrier counts: docs/perf/session29-h100-router/ and
docs/perf/session30-h100-routerseg/.

Selection order: ``ids`` come out in decreasing ``sb``. The reference's ``topk(sorted=False)`` leaves the order
open, and the routed sum does not depend on it. On exact ties the lowest index wins, as iterative argmax picks
(for non-NaN scores the picks are argmax's exactly, -inf included). ``torch.topk`` makes no promise there, and
with float32 sigmoid scores a tie is a measure-zero event. With :func:`fused_route`
the router GEMV (``F.linear`` in float32) stays a launch of its own. :func:`gemv_route` does both in one launch
(``_gemv_route_kernel``): E/``be`` programs compute ``be`` experts' logits each for every row, and the last to
finish (an acq_rel ticket) routes all rows at once, or, with M > 1 on a GPU, the last M to finish route one row
each (``SPLIT_TAIL``); the CUDA default (plan entry ``router=gemv``;
docs/perf/moe-kernels-h200.md has its measurements). Both let the MoE kernel A launch early (PDL trigger);
``gemv_route`` is also a PDL dependent that L2-prefetches its weight tile before its wait when
``BYTEBOUND_PDL_PREFETCH`` names ``router`` (``kernels.pdl.early``; off by default). Its logits are summed in a
different order than cuBLAS's, so a routing near-tie can break the other way.

Constraints: ``E`` a power of two divisible by ``G`` (Ling: 512 experts, 8 groups); float32 logits. Tested against
``route`` in the Triton interpreter on CPU and on the H200 (tests/test_triton_router.py, and at Ling's routing in
tests/gpu). It replaces a dozen launches per MoE layer (its measured effect: docs/perf/history.md). On with
CUDA as ``router=triton`` (plan entry; ``--backend router=torch`` turns both off); the full-scale spec_vs_plain
failure once blamed on the fast paths was a routing near-tie that the committed defaults hit too
(docs/perf/gpu-tests-h200.md).
"""

from __future__ import annotations

import os

import torch

from bytebound.errors import BackendError
from bytebound.kernels.limits import MAX_VERIFY_M as MAX_M     # the one verify-width limit (kernels/limits.py)
from bytebound.kernels.pdl import capable as pdl_capable, early as pdl_early
from bytebound.kernels.registry import optional_triton
from bytebound.kernels.scratch import scratch

ROUTE_WARPS = 1     # warps per routing program (fused_route): the fastest of 1, 2 and 4 on the H200 (one row's
#                     E logits fit one warp's registers; docs/perf/history.md)

triton, tl, _TRITON_ERR = optional_triton()      # None, None, reason on machines without Triton


if tl is not None:
    from bytebound.kernels.pdl import gdc as pdl_gdc, l2_prefetch as pdl_l2_prefetch, ticket as pdl_ticket

    @triton.jit
    def _key(v, low):
        """int64 keys of float32 ``v`` with ``low`` (0 <= low < 2**31) as the low word, ordered as (v, low): the high
        word is v's bits with a negative float's magnitude negated, so that signed int32 order is float order (v not
        NaN), -0.0 and 0.0, equal floats, share a key, and -inf has the lowest. With ``low = E - 1 - index`` the
        largest key is argmax's pick with argmax's tie rule (the lowest index of the largest value)."""
        b = v.to(tl.int32, bitcast=True)
        t = b >> 31
        return (((b ^ (t & 0x7FFFFFFF)) - t).to(tl.int64) << 32) | low

    @triton.jit
    def _key_value(key):
        """The float32 value of a :func:`_key` key (0.0 for -0.0)."""
        hi = (key >> 32).to(tl.int32)
        t = hi >> 31
        return (((hi ^ t) - t) | (t << 31)).to(tl.float32, bitcast=True)

    @triton.jit
    def _max_key(k1, v1, k2, v2):
        """``tl.reduce`` combine: the larger key and the value riding with it (a row's keys are distinct: the index
        is in them)."""
        gt = k1 > k2
        return tl.where(gt, k1, k2), tl.where(gt, v1, v2)

    @triton.jit
    def _load_bias(bias_ptr, E: tl.constexpr, MP: tl.constexpr):
        """The expert bias as ``[MP, E]`` float32, every row the same: loaded in the logits' shape so that it needs
        no layout conversion (shared memory, a barrier) where it is added."""
        offs = tl.zeros([MP, 1], tl.int32) + tl.arange(0, E)[None, :]
        return tl.load(bias_ptr + offs).to(tl.float32)

    @triton.jit
    def _route_rows(logits_ptr, bias, ids_ptr, w_ptr, scale, row0, M, E: tl.constexpr, G: tl.constexpr,
                    TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
                    NORM: tl.constexpr, MP: tl.constexpr):
        """Route rows ``row0 .. row0+MP-1`` (those < ``M``) of ``logits [M, E]`` float32 into ``ids [M, K]``,
        ``w [M, K]`` (module docstring); ``bias`` is :func:`_load_bias`'s (unused without ``HAS_BIAS``). The rows go
        through every step together, as ``[MP, E]`` tensors, so MP rows cost one pass of reductions rather than MP
        passes.

        Every pick is a max over :func:`_key` keys of (sb, ``E - 1 - index``), one reduction (argmax would carry
        the index beside the value), and the expert's unbiased score s rides along in it, so no second reduction
        fetches s[id]. A picked or masked-out expert's key becomes -inf's key at its index, which is what argmax
        over scores set to -inf sees: the picks are those of iterative argmax even where -inf scores compete
        (fewer than K finite ones left: expert 0, again and again)."""
        EG: tl.constexpr = E // G
        DEAD: tl.constexpr = -0x7F800000 << 32      # the high word of -inf's key
        rows = row0 + tl.arange(0, MP)
        live = rows < M
        offs = tl.arange(0, E)
        # .cg (L2, not L1): in _gemv_route_kernel other SMs wrote these logits moments ago
        s = tl.sigmoid(tl.load(logits_ptr + rows[:, None] * E + offs[None, :], mask=live[:, None], other=0.0,
                               cache_modifier=".cg").to(tl.float32))                      # [MP, E]
        if HAS_BIAS:
            sb = s + bias
        else:
            sb = s
        low = tl.zeros([MP, 1], tl.int64) + (E - 1 - offs).to(tl.int64)[None, :]
        dead = low + DEAD                                                     # -inf's key at each index
        key = _key(sb, low)                                                   # [MP, E]
        if G > 1:       # (one group: every expert is kept)
            # per-group top-2 sum: the group's best key, then the best with that one at -inf
            key3 = tl.reshape(key, (MP, G, EG))
            dead3 = tl.reshape(dead, (MP, G, EG))
            k1 = tl.max(key3, axis=2)
            k2 = tl.max(tl.where(key3 == k1[:, :, None], dead3, key3), axis=2)
            gkey_low = (G - 1 - tl.arange(0, G)).to(tl.int64)[None, :]
            gkey = _key(_key_value(k1) + _key_value(k2), gkey_low)            # [MP, G]
            # keep the TOPK_GROUP best groups
            keep = tl.zeros([MP, G], tl.int32)
            for _ in tl.static_range(TOPK_GROUP):
                hit = gkey == tl.max(gkey, axis=1)[:, None]
                keep = tl.where(hit, 1, keep)
                gkey = tl.where(hit, gkey_low + DEAD, gkey)
            keep_e = tl.reshape(tl.broadcast_to(keep[:, :, None], (MP, G, EG)), (MP, E))
            key = tl.where(keep_e != 0, key, dead)
        # the K best experts of the kept groups
        kk = tl.arange(0, KP)
        out_ids = tl.zeros([MP, KP], tl.int64)
        out_w = tl.zeros([MP, KP], tl.float32)
        for i in tl.static_range(K):
            kmax, w = tl.reduce((key, s), 1, _max_key)                       # [MP]
            at_i = kk[None, :] == i
            out_ids = tl.where(at_i, (E - 1 - kmax.to(tl.int32)).to(tl.int64)[:, None], out_ids)
            out_w = tl.where(at_i, w[:, None], out_w)
            key = tl.where(key == kmax[:, None], dead, key)
        _store_routes(ids_ptr, w_ptr, out_ids, out_w, rows, live, scale, K, NORM)

    @triton.jit
    def _store_routes(ids_ptr, w_ptr, out_ids, out_w, rows, live, scale, K: tl.constexpr, NORM: tl.constexpr):
        """Store the picks ``out_ids`` / ``out_w`` ``[MP, KP]`` of ``rows`` (those ``live``) into ``ids [M, K]``,
        ``w [M, K]``: the weights (with ``NORM``) divided by their sum over the K places (the places past K count
        as zeros), times ``scale``."""
        kk = tl.arange(0, out_w.shape[1])
        if NORM:
            out_w = tl.where(kk[None, :] < K, out_w, 0.0)
            out_w = out_w / (tl.sum(out_w, axis=1)[:, None] + 1e-20)
        dst = rows[:, None] * K + kk[None, :]
        ok = live[:, None] & (kk[None, :] < K)
        tl.store(ids_ptr + dst, out_ids, mask=ok)
        tl.store(w_ptr + dst, out_w * scale, mask=ok)

    @triton.jit
    def _load_bias_seg(bias_ptr, E: tl.constexpr, MP: tl.constexpr, SEG: tl.constexpr):
        """The expert bias as ``[MP, SEG, E // SEG]`` float32, every row the same: :func:`_route_rows_seg`'s shape."""
        ES: tl.constexpr = E // SEG
        offs = (tl.zeros([MP, 1, 1], tl.int32) + tl.arange(0, SEG)[None, :, None] * ES
                + tl.arange(0, ES)[None, None, :])
        return tl.load(bias_ptr + offs).to(tl.float32)

    @triton.jit
    def _route_rows_seg(logits_ptr, bias, ids_ptr, w_ptr, scale, row0, M, E: tl.constexpr, G: tl.constexpr,
                        TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
                        NORM: tl.constexpr, MP: tl.constexpr, SEG: tl.constexpr):
        """:func:`_route_rows` with the row cut into ``SEG`` segments of ``ES = E / SEG`` experts (whole groups
        each), the same ids and weights (to float32 rounding of the normalising sum) with far fewer reductions
        across warps. ``bias`` is :func:`_load_bias_seg`'s.

        A row's ``[SEG, ES]`` view puts a segment in one warp (the default layout of a tensor loaded with ES
        contiguous elements per segment), so the per-group top-2 and each segment's ``KP`` picks (its best keys in
        order, a picked key set below every other) are reductions inside one warp: shuffles, no barriers. The top
        K of the row are among the ``SEG * KP`` candidates (keys are distinct), and each candidate's place in the
        output is its rank, the number of candidates with a larger key: one ``[C, C]`` comparison and a sum,
        instead of K passes over the row that each cross every warp. The groups are chosen the same way, by rank
        among the G group keys.

        The degenerate picks of :func:`_route_rows` are kept: once the finite scores of the kept groups (or the
        finite groups) run out, iterative argmax picks expert 0 (group 0), again and again, so the places from the
        number of finite candidates on get expert 0 with its s; with fewer finite groups than TOPK_GROUP, group 0
        is kept beside them."""
        ES: tl.constexpr = E // SEG
        GS: tl.constexpr = G // SEG if G > 1 else 1         # groups per segment
        EG: tl.constexpr = ES // GS                           # experts per group
        C: tl.constexpr = SEG * KP                            # candidates per row
        DEAD: tl.constexpr = -0x7F800000 << 32                # the high word of -inf's key
        GONE: tl.constexpr = -0x7FFFFFFFFFFFFFFF - 1          # below every key, dead ones included
        rows = row0 + tl.arange(0, MP)
        live = rows < M
        seg = tl.arange(0, SEG)
        col = tl.arange(0, ES)
        idx = seg[None, :, None] * ES + col[None, None, :]                          # [1, SEG, ES]
        # .cg (L2, not L1): in _gemv_route_kernel other SMs wrote these logits moments ago
        s = tl.sigmoid(tl.load(logits_ptr + rows[:, None, None] * E + idx, mask=live[:, None, None], other=0.0,
                               cache_modifier=".cg").to(tl.float32))                 # [MP, SEG, ES]
        s0 = tl.sigmoid(tl.load(logits_ptr + rows * E, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32))
        if HAS_BIAS:
            sb = s + bias
        else:
            sb = s
        low = tl.zeros([MP, 1, 1], tl.int64) + (E - 1 - idx).to(tl.int64)
        dead = low + DEAD                                                            # -inf's key at each index
        key = _key(sb, low)                                                          # [MP, SEG, ES]
        if G > 1:
            key4 = tl.reshape(key, (MP, SEG, GS, EG))
            dead4 = tl.reshape(dead, (MP, SEG, GS, EG))
            k1 = tl.max(key4, axis=3)
            k2 = tl.max(tl.where(key4 == k1[:, :, :, None], dead4, key4), axis=3)       # [MP, SEG, GS]
            gidx = tl.reshape(tl.arange(0, G), (1, SEG, GS))
            gkey = _key(_key_value(k1) + _key_value(k2), (G - 1 - gidx).to(tl.int64))
            gk = tl.reshape(gkey, (MP, G))
            grank = tl.sum((gk[:, None, :] > gk[:, :, None]).to(tl.int32), axis=2)     # [MP, G]
            galive = (gk >> 32) > (DEAD >> 32)
            nfin = tl.sum(galive.to(tl.int32), axis=1)                                  # [MP]
            g1 = tl.arange(0, G)[None, :]
            keep = ((grank < TOPK_GROUP) & galive) | ((g1 == 0) & (nfin < TOPK_GROUP)[:, None])
            keep4 = tl.broadcast_to(tl.reshape(keep, (MP, SEG, GS))[:, :, :, None], (MP, SEG, GS, EG))
            key = tl.where(tl.reshape(keep4, (MP, SEG, ES)), key, dead)
        # each segment's KP best keys, best first, with their s
        kk = tl.arange(0, KP)
        ck = tl.zeros([MP, SEG, KP], tl.int64)
        cs = tl.zeros([MP, SEG, KP], tl.float32)
        for i in tl.static_range(KP):
            kmax, w = tl.reduce((key, s), 2, _max_key)                                  # [MP, SEG]
            at_i = kk[None, None, :] == i
            ck = tl.where(at_i, kmax[:, :, None], ck)
            cs = tl.where(at_i, w[:, :, None], cs)
            key = tl.where(key == kmax[:, :, None], GONE, key)
        ck = tl.reshape(ck, (MP, C))
        cs = tl.reshape(cs, (MP, C))
        rank = tl.sum((ck[:, None, :] > ck[:, :, None]).to(tl.int32), axis=2)          # [MP, C]: its place
        nalive = tl.sum(((ck >> 32) > (DEAD >> 32)).to(tl.int32), axis=1)              # [MP]
        at = rank[:, :, None] == kk[None, None, :]                                      # [MP, C, KP]
        cid = (E - 1 - (ck & 0x7FFFFFFF)).to(tl.int64)                                  # the expert of a key
        out_ids = tl.sum(tl.where(at, cid[:, :, None], 0), axis=1)                      # [MP, KP]
        out_w = tl.sum(tl.where(at, cs[:, :, None], 0.0), axis=1)
        spent = kk[None, :] >= nalive[:, None]           # out of finite candidates: iterative argmax's expert 0
        out_ids = tl.where(spent, 0, out_ids)
        out_w = tl.where(spent, s0[:, None], out_w)
        _store_routes(ids_ptr, w_ptr, out_ids, out_w, rows, live, scale, K, NORM)

    @triton.jit
    def _route_tail(logits_ptr, bias, ids_ptr, w_ptr, scale, row0, M, E: tl.constexpr, G: tl.constexpr,
                    TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
                    NORM: tl.constexpr, MP: tl.constexpr, SEG: tl.constexpr):
        """:func:`_route_rows_seg` with ``SEG`` > 1 segments (``bias`` from :func:`_load_bias_seg`), else
        :func:`_route_rows` (``bias`` from :func:`_load_bias`)."""
        if SEG > 1:
            _route_rows_seg(logits_ptr, bias, ids_ptr, w_ptr, scale, row0, M, E, G, TOPK_GROUP, K, KP, HAS_BIAS, NORM,
                            MP, SEG)
        else:
            _route_rows(logits_ptr, bias, ids_ptr, w_ptr, scale, row0, M, E, G, TOPK_GROUP, K, KP, HAS_BIAS, NORM, MP)

    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, scale, M, E: tl.constexpr, G: tl.constexpr,
                      TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
                      NORM: tl.constexpr, PDL_OUT: tl.constexpr):
        if PDL_OUT:     # the MoE kernel A may launch now (PDL, ``pdl_in``); it waits for this kernel's results
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r,r",
                                      [tl.arange(0, 32)], dtype=tl.int32, is_pure=False, pack=1)
        bias = _load_bias(bias_ptr, E, 1) if HAS_BIAS else 0.0
        _route_rows(logits_ptr, bias, ids_ptr, w_ptr, scale, tl.program_id(0), M, E, G, TOPK_GROUP, K, KP,
                    HAS_BIAS, NORM, 1)

    @triton.jit
    def _gemv_route_kernel(x_ptr, wg_ptr, logits_ptr, cnt_ptr, bias_ptr, ids_ptr, w_ptr, scale,
                           d_ptr, nw_ptr, hout_ptr, xout_ptr, eps, H: tl.constexpr,
                           E: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                           KP: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, M: tl.constexpr,
                           MP: tl.constexpr, BE: tl.constexpr, HP: tl.constexpr, FENCE: tl.constexpr,
                           PDL_OUT: tl.constexpr, ADD_NORM: tl.constexpr, PDL_IN: tl.constexpr = False,
                           PF: tl.constexpr = 0, NTH: tl.constexpr = 128, SPLIT_TAIL: tl.constexpr = False,
                           BATCH_ROWS: tl.constexpr = False, ROUTE: tl.constexpr = True, SEG: tl.constexpr = 1):
        """Router GEMV and routing in one launch: program ``pid`` computes ``logits[:, pid*BE:(pid+1)*BE]`` in
        float32 (``x [M, H]`` against the router weight ``[E, H]``), and the last program to finish (an acq_rel
        ticket) routes every row from the complete logits.

        Each program loads its whole ``[BE, H]`` weight tile at once (``HP`` = H rounded up to a power of two,
        masked): one memory round trip, not one per column chunk, which is what bounds a GEMV this small (the
        chunked loop's time: docs/perf/history.md). It also lets the next kernel launch at
        once (``griddepcontrol.launch_dependents``, PDL): the MoE kernel A (``pdl_in``) then loads the shared
        expert's weights while this kernel runs.

        ``PDL_IN`` (``kernels.pdl.early("router")``, opt-in through ``BYTEBOUND_PDL_PREFETCH``; launched with
        ``launch_pdl``): this kernel is itself a PDL dependent of the kernel before it. Each program issues one L2
        bulk prefetch of its ``PF`` weight bytes (0: none, where the tile is not 16-byte aligned) and then
        ``griddepcontrol.wait``, before any other load or store. The trigger above then precedes the wait, so kernel
        A may launch while this kernel still waits; A touches only weights before its own wait, which returns once
        this kernel (and so the one before it) has completed.

        ``ADD_NORM``: ``x_ptr`` is the residual stream h and ``d_ptr`` the attention output delta; every program
        forms ``h + delta`` and its RMSNorm (weight ``nw_ptr``) itself, rounded as ``kernels.triton_norm``'s
        ``add_rmsnorm`` rounds (one row's statistics are a sum over its H values, so no program needs another's),
        runs the GEMV on that normed x, and program 0 writes the new h (``hout_ptr``) and x (``xout_ptr``) for the
        expert kernels, which start after this kernel completes (or wait for it: ``griddepcontrol.wait``).

        ``BATCH_ROWS`` (M > 1, :func:`batch_rows_enabled`): the M rows of x (and of h, delta) are loaded as one
        ``[MP, HP]`` tile and normalised with one reduction over the tile, so their memory round trips overlap the
        weight tile's instead of following the previous row's reductions; a row's norm then sums its squares in
        another order than the one-row code (float32 rounding: x may differ by a BF16 step).

        ``SPLIT_TAIL`` (M > 1 on a GPU, :func:`split_tail_enabled`): the last ``M`` programs to take a ticket route one
        row each, in parallel, instead of the last one routing all ``M``: row ``r`` goes to the program with ticket
        ``E/BE - 1 - r``, which waits (acquire loads of the ticket) until all ``E/BE`` programs have arrived. Each
        routing program then counts itself out on the same ticket, and the last of them re-arms it. Needs ``E/BE >=
        M`` (:func:`split_tail_for`). The rows' picks are :func:`_route_rows`' at ``MP = 1``: the same experts as the
        one-program tail, the weights to float32 rounding (their normalising sum runs in another layout). Waiting is safe: a waiter holds its SM only while programs that already hold a ticket or are still
        to be scheduled finish, and the PDL dependents (kernel A) can launch only after every program of this
        grid has started (each triggers first), so they cannot crowd out a program not yet scheduled. Not under
        TRITON_INTERPRET, which runs programs one after another (a waiter would wait forever).

        ``ROUTE`` False (a benchmark probe, ``scripts/bench_moe.py --router``; never SPLIT_TAIL): the last program
        only re-arms the ticket, so ``ids`` / ``w`` stay unwritten and the launch costs the GEMV, the add + norm and
        the ticket without the routing tail."""
        pid = tl.program_id(0)
        if PDL_OUT:     # (sm_90+ and not under TRITON_INTERPRET, which cannot run PTX)
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r,r",
                                      [tl.arange(0, 128)], dtype=tl.int32, is_pure=False, pack=1)
        if PDL_IN:
            # a PDL dependent of the kernel before it (the attention's output projection): this program's weight
            # rows (static, contiguous: PF bytes) stream into L2 while that kernel still runs; everything else
            # waits for its completion
            pdl_l2_prefetch(wg_ptr + pid * BE * H, PF, NTH)
            pdl_gdc("griddepcontrol.wait; mov.u32 $0, 0;", NTH)
        e = pid * BE + tl.arange(0, BE)
        kk = tl.arange(0, HP)
        km = kk < H
        wt = tl.load(wg_ptr + e[:, None] * H + kk[None, :], mask=km[None, :], other=0.0).to(tl.float32)
        # the routing's bias, in every program (2 KB from L2): whichever program routes has it in registers by then,
        # its load overlapped with the weight tile's rather than waited for after the ticket
        RP: tl.constexpr = 1 if SPLIT_TAIL else MP          # rows a routing program routes
        if SEG > 1:
            bias = _load_bias_seg(bias_ptr, E, RP, SEG) if HAS_BIAS else 0.0
        else:
            bias = _load_bias(bias_ptr, E, RP) if HAS_BIAS else 0.0
        if BATCH_ROWS:
            # all M rows in one [MP, HP] load (and one norm reduction for all of them), issued beside the weight
            # tile's, instead of one row's loads after the previous row's reductions
            rows = tl.arange(0, MP)
            rk = (rows < M)[:, None] & km[None, :]
            off2 = rows[:, None] * H + kk[None, :]
            if ADD_NORM:
                hs2 = (tl.load(x_ptr + off2, mask=rk, other=0.0).to(tl.float32) +
                       tl.load(d_ptr + off2, mask=rk, other=0.0).to(tl.float32))
                hs2 = hs2.to(hout_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
                r2 = tl.rsqrt(tl.sum(hs2 * hs2, axis=1) / H + eps)
                nw = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
                xv2 = nw[None, :] * (hs2 * r2[:, None]).to(xout_ptr.dtype.element_ty,
                                                          fp_downcast_rounding="rtne").to(tl.float32)
                xv2 = xv2.to(xout_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
                if pid == 0:
                    tl.store(hout_ptr + off2, hs2.to(hout_ptr.dtype.element_ty), mask=rk)
                    tl.store(xout_ptr + off2, xv2, mask=rk)
                xs = xv2.to(tl.float32)
            else:
                xs = tl.load(x_ptr + off2, mask=rk, other=0.0).to(tl.float32)
            for m in tl.static_range(M):
                xv = tl.sum(tl.where(rows[:, None] == m, xs, 0.0), axis=0)       # row m (adds exact zeros)
                tl.store(logits_ptr + m * E + e, tl.sum(wt * xv[None, :], axis=1))
        else:
            for m in tl.static_range(M):
                if ADD_NORM:
                    hs = (tl.load(x_ptr + m * H + kk, mask=km, other=0.0).to(tl.float32) +
                          tl.load(d_ptr + m * H + kk, mask=km, other=0.0).to(tl.float32))
                    hs = hs.to(hout_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
                    r = tl.rsqrt(tl.sum(hs * hs, axis=0) / H + eps)
                    nw = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
                    xv = nw * (hs * r).to(xout_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
                    xv = xv.to(xout_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
                    if pid == 0:
                        tl.store(hout_ptr + m * H + kk, hs.to(hout_ptr.dtype.element_ty), mask=km)
                        tl.store(xout_ptr + m * H + kk, xv, mask=km)
                    xv = xv.to(tl.float32)
                else:
                    xv = tl.load(x_ptr + m * H + kk, mask=km, other=0.0).to(tl.float32)
                tl.store(logits_ptr + m * E + e, tl.sum(wt * xv[None, :], axis=1))
        # FENCE: False only under TRITON_INTERPRET. 128 elements (not NTH): at 8 warps (M > 1) they are replicated,
        # so every thread still fences; NTH there changes the index arithmetic's SASS for no gain
        ticket = pdl_ticket(cnt_ptr, FENCE, 128)
        NP: tl.constexpr = E // BE
        if SPLIT_TAIL:
            r = NP - 1 - ticket
            if (r >= 0) & (r < M):
                seen = ticket + 1
                while seen < NP:        # every program's logits are stored once all NP tickets are taken
                    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
                _route_tail(logits_ptr, bias, ids_ptr, w_ptr, scale, r, M, E, G, TOPK_GROUP, K, KP, HAS_BIAS, NORM,
                            1, SEG)
                # the last of the M routing programs re-arms the ticket (every waiter has seen NP by then)
                if tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu") == NP + M - 1:
                    tl.store(cnt_ptr, 0)
        else:
            if ticket == NP - 1:
                if ROUTE:
                    _route_tail(logits_ptr, bias, ids_ptr, w_ptr, scale, 0, M, E, G, TOPK_GROUP, K, KP, HAS_BIAS,
                                NORM, MP, SEG)
                tl.store(cnt_ptr, 0)


def _pdl_out(device: torch.device) -> bool:
    """Whether the routing kernels may issue ``griddepcontrol.launch_dependents`` (PDL: the MoE kernel A that
    follows, config ``pdl_in``, then starts early and waits for the routing itself). The instruction needs sm_90;
    older GPUs and Triton's interpreter (which cannot run PTX) get kernels without it."""
    return pdl_capable(device)


def shape_error(e: int, n_group: int) -> str | None:
    """Why the routing kernels cannot take ``e`` experts in ``n_group`` groups (None: they can): E must be a power
    of two divisible by the group count, and at least 4 (``gemv_route``'s experts per program). Checked once at
    bind (``runner.backends.bind_model``), not per call."""
    g = max(n_group, 1)
    if e & (e - 1) or e % g or e < 4:
        return f"needs E a power of two >= 4 divisible by n_group (got E={e}, n_group={n_group})"
    return None


def fused_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
                norm: bool, scale: float, num_warps: int = ROUTE_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [M, E]`` float32 (M <= 4) -> ``(ids [M, k] int64, weights [M, k] float32)``, as ``moe.route``.
    One program of ``num_warps`` warps per row (a tuning knob for ``scripts/bench_moe.py --router``).

    Which M reach it is the binding's decision (``runner.backends.bind_model``: the layer's ``route_m``), and the
    shape is checked once there (:func:`shape_error`); one program per row, so no M overruns a buffer here.

    Raises BackendError when Triton is missing.
    """
    if _TRITON_ERR:
        raise BackendError(f"router[triton]: {_TRITON_ERR}")
    m, e = logits.shape
    g = max(n_group, 1)
    logits = logits.float().contiguous()
    ids = torch.empty(m, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(m, top_k, dtype=torch.float32, device=logits.device)
    b = bias if bias is not None else logits       # dummy pointer when there is no bias
    _route_kernel[(m,)](logits, b, ids, w, float(scale), m, E=e, G=g, TOPK_GROUP=topk_group if g > 1 else 1,
                        K=top_k, KP=triton.next_power_of_2(top_k), HAS_BIAS=bias is not None, NORM=bool(norm),
                        PDL_OUT=_pdl_out(logits.device), num_warps=num_warps)
    return ids, w



def gemv_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
               topk_group: int, norm: bool, scale: float, be: int | None = None,
               num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, H]`` (M <= 4) and the router weight ``[E, H]`` -> ``(ids [M, k] int64, weights [M, k] float32)``:
    the router GEMV (float32 accumulation, as ``F.linear(x.float(), weight.float())``) and :func:`fused_route`'s
    routing in one launch (``_gemv_route_kernel``). The logits and the ticket live in a per-device scratch that
    the last program re-arms, so the call is CUDA-graph safe; calls on one device must not overlap (one stream,
    as the engine runs; the MoE kernels' scratch asks the same). ``be`` experts per program (E/be programs) and
    ``num_warps`` are tuning knobs (``scripts/bench_moe.py --router``); by default the H200's best of that sweep:
    2 experts and 4 warps at M = 1, 4 experts and 8 warps at M > 1 (its times: docs/perf/history.md).
    The shape is checked once at bind (:func:`shape_error`); the one per-call check left guards the logits
    scratch of :data:`MAX_M` rows, which a wider call would overrun.

    Raises BackendError when Triton is missing, M > :data:`MAX_M` (the binding routes wider calls to torch), or a
    tuning ``be`` that is not a power of two dividing E."""
    return _gemv_route(x, None, None, 0.0, weight, bias, top_k, n_group, topk_group, norm, scale, be, num_warps)[:2]


def gemv_route_add_norm(delta: torch.Tensor, h: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
                        norm: bool, scale: float, be: int | None = None, num_warps: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The post-attention residual add and RMSNorm folded into :func:`gemv_route`'s launch.

    Args:
        delta: ``[M, H]`` the attention output; h: ``[M, H]`` the residual stream, same dtype (M <= 4);
        norm_weight: ``[H]`` the post-attention RMSNorm's weight, eps its epsilon; the rest as :func:`gemv_route`.

    Returns:
        ``(ids [M, k] int64, weights [M, k] float32, x [M, H], h_new [M, H])``: the routing of x, x = RMSNorm(h_new)
        and h_new = h + delta in h's dtype, rounded as ``kernels.triton_norm.add_rmsnorm`` rounds them (h_new bit-equal
        to torch's add), for ``layers.moe.MoE.add_norm_forward``.

    With ``BYTEBOUND_ROUTER_NORM_FOLD=0`` (:func:`norm_fold_enabled`) the add + norm are a launch of their own.

    Raises:
        BackendError: as :func:`gemv_route`, and for a delta of another shape or dtype than h or a norm weight not of
            H elements.
    """
    if delta.shape != h.shape or delta.dtype != h.dtype or norm_weight.numel() != h.shape[-1]:
        raise BackendError(f"router[triton]: gemv_route_add_norm needs delta of h's shape and dtype and a norm weight "
                           f"of H elements, got {tuple(delta.shape)} {delta.dtype}, {tuple(h.shape)} {h.dtype}, "
                           f"{norm_weight.numel()}")
    if not norm_fold_enabled():
        from bytebound.kernels.triton_norm import add_rmsnorm
        x, h2 = add_rmsnorm(delta, h, norm_weight, eps)
        ids, w = _gemv_route(x, None, None, 0.0, weight, bias, top_k, n_group, topk_group, norm, scale, be,
                             num_warps)[:2]
        return ids, w, x, h2
    return _gemv_route(h, delta, norm_weight, eps, weight, bias, top_k, n_group, topk_group, norm, scale, be,
                       num_warps)


def norm_fold_enabled() -> bool:
    """False when ``BYTEBOUND_ROUTER_NORM_FOLD=0``: :func:`gemv_route_add_norm` then runs the add + norm as their own
    launch (``triton_norm.add_rmsnorm``) before :func:`gemv_route`, with the same results up to the norm's float32
    summation order. An A/B switch (``scripts/profile_decode.py --ab BYTEBOUND_ROUTER_NORM_FOLD=0``), read at each
    call, so a graph captured after a change sees it."""
    return os.environ.get("BYTEBOUND_ROUTER_NORM_FOLD", "1") != "0"


def split_tail_enabled() -> bool:
    """False when ``BYTEBOUND_ROUTER_SPLIT_TAIL=0``: :func:`gemv_route` with M > 1 rows then routes them all in its
    last program instead of one row per program (``_gemv_route_kernel``'s ``SPLIT_TAIL``; the same ids, the
    weights to float32 rounding). An A/B switch read at each call, like :func:`norm_fold_enabled`; the interpreter never splits."""
    return os.environ.get("BYTEBOUND_ROUTER_SPLIT_TAIL", "1") != "0"


def split_tail_for(m: int, e: int, be: int, interp: bool) -> bool:
    """Whether ``gemv_route`` splits its routing tail for ``m`` rows: M > 1, at least M programs (``E/be >= M``:
    each of the last M to finish routes one row, so fewer programs would leave rows unrouted and the ticket
    un-armed), not under TRITON_INTERPRET (one program after another: a waiter would wait forever), and not
    switched off (:func:`split_tail_enabled`)."""
    return m > 1 and e // be >= m and not interp and split_tail_enabled()


def route_segments(e: int, n_group: int, top_k: int, num_warps: int) -> int:
    """How many segments ``_route_rows_seg`` cuts a row of ``e`` experts into for a routing program of
    ``num_warps`` warps: the largest power of two S <= num_warps that splits the row into whole groups (S divides
    ``n_group``, or any S with one group) of at least ``next_power_of_2(top_k)`` experts each (a segment yields
    that many candidates). ``BYTEBOUND_ROUTER_SEG=0`` gives 1 (the one-segment :func:`_route_rows`), an A/B switch
    read at each call like :func:`split_tail_enabled`; both tails pick the same ids (tests/test_triton_router.py).
    Measured in docs/perf/session29-h100-router/ and session30-h100-routerseg/."""
    if os.environ.get("BYTEBOUND_ROUTER_SEG", "1") == "0":
        return 1
    kp = triton.next_power_of_2(top_k)
    g = max(n_group, 1)
    seg = 1
    while (seg * 2 <= num_warps and e % (seg * 2) == 0 and e // (seg * 2) >= kp
           and (g == 1 or g % (seg * 2) == 0)):
        seg *= 2
    return seg


def batch_rows_enabled() -> bool:
    """False when ``BYTEBOUND_ROUTER_BATCH_ROWS=0``: :func:`gemv_route` with M > 1 rows then loads and normalises
    one row after another (``_gemv_route_kernel``'s ``BATCH_ROWS`` off). An A/B switch read at each call."""
    return os.environ.get("BYTEBOUND_ROUTER_BATCH_ROWS", "1") != "0"


def _gemv_route(x, delta, norm_weight, eps, weight, bias, top_k, n_group, topk_group, norm, scale, be, num_warps,
                route: bool = True):
    """:func:`gemv_route` (``delta`` None) or :func:`gemv_route_add_norm`: ``(ids, w, x_normed, h_new)``, the last
    two None without ``delta``. ``route`` False is the benchmark's probe (``_gemv_route_kernel``'s ``ROUTE``): the
    same launch without the routing tail, ``ids`` and ``w`` left uninitialised."""
    if _TRITON_ERR:
        raise BackendError(f"router[triton]: {_TRITON_ERR}")
    m, h = x.shape
    e = weight.shape[0]
    g = max(n_group, 1)
    be = be or (2 if m == 1 else 4)
    num_warps = num_warps or (4 if m == 1 else 8)
    if m > MAX_M or e < be or be & (be - 1):
        raise BackendError(f"router[triton]: needs M <= {MAX_M} (the logits scratch) and be a power of two <= E "
                           f"(got M={m}, E={e}, be={be})")
    ids = torch.empty(m, top_k, dtype=torch.int64, device=x.device)
    w = torch.empty(m, top_k, dtype=torch.float32, device=x.device)
    add = delta is not None
    x = x.contiguous()
    xo, ho = (torch.empty_like(x), torch.empty_like(x)) if add else (None, None)
    if m == 0:
        return ids, w, xo, ho
    # grow-only, shared by every MoE layer on the device (they run one after another on one stream); a captured
    # CUDA graph keeps the addresses it saw, so an outgrown buffer stays alive
    logits = scratch(x.device, "router_logits", MAX_M * e)
    cnt = scratch(x.device, "router_ticket", 1, torch.int32)
    b = bias if bias is not None else weight
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    # PDL dependent (pdl.early: sm_90, not BYTEBOUND_PDL=0, named in BYTEBOUND_PDL_PREFETCH): the weight tile's L2
    # prefetch before the wait needs a 16-byte aligned tile of a multiple of 16 bytes (else PF 0: no prefetch)
    pdl_in = pdl_early("router", x.device)
    wt = weight.contiguous()
    tile = be * h * wt.element_size()
    pf = tile if tile % 16 == 0 and wt.data_ptr() % 16 == 0 else 0
    d, nw, xo_, ho_ = (delta.contiguous(), norm_weight.contiguous(), xo, ho) if add else (x, x, x, x)
    _gemv_route_kernel[(e // be,)](x, wt, logits, cnt, b, ids, w, float(scale),
                                   d, nw, ho_, xo_, float(eps),
                                   H=h, E=e, G=g, TOPK_GROUP=topk_group if g > 1 else 1, K=top_k,
                                   KP=triton.next_power_of_2(top_k), HAS_BIAS=bias is not None, NORM=bool(norm),
                                   M=m, MP=triton.next_power_of_2(m), BE=be, HP=triton.next_power_of_2(h),
                                   FENCE=not interp, PDL_OUT=_pdl_out(x.device), ADD_NORM=add,
                                   PDL_IN=pdl_in, PF=pf, NTH=32 * num_warps,
                                   SPLIT_TAIL=route and split_tail_for(m, e, be, interp),
                                   BATCH_ROWS=m > 1 and batch_rows_enabled(), ROUTE=route,
                                   SEG=route_segments(e, g, top_k, num_warps), num_warps=num_warps,
                                   **({"launch_pdl": True} if pdl_in else {}))
    return ids, w, xo, ho
