"""Backend ``triton`` of ops ``linear`` (FP8 128x128-block weights) and ``lm_head`` (online FP8 per channel).

``linear`` (``QLinear`` with ``fmt == "fp8"``: ``weight`` E4M3 ``[N, K]``, ``weight_scale_inv`` float32
``[ceil(N/128), ceil(K/128)]``):

* **M <= 4** (decode, verify): one GEMV kernel. Each program owns ``BN`` output rows (``BN`` divides the scale
  block's 128 rows, so a program's rows share one row of scales; other block sizes work the same way) and walks K in ``BK`` chunks; the E4M3 bytes are converted to float32
  in registers (``cvt.rn.f16x2.e4m3x2`` + widen) and multiplied into per-token float32 accumulators with the
  activation pre-multiplied by the chunk's block scale (``x * s`` costs BK multiplies per chunk, not one per
  weight). Accumulation is float32, the output BF16 (the activation dtype). The weight is read once for all M
  tokens. A config with ``MMA`` runs the Gluon kernel of ``kernels.gluon_fp8_gemv`` instead: E4M3 words decoded
  straight into BF16 mma.m16n8k16 A fragments, tokens on the mma N axis, a fresh float32 accumulator per
  128x128 scale block scaled in float32 (the ``DOT`` path's maths); one such config for M = 1..4 makes verify
  rows bit-equal to decode results.
* **M > 4** (prefill), ``TritonLinear(prefill=...)``:

  - ``"dequant"`` (default): dequantise the whole weight to BF16 with one Triton kernel into a temporary and call
    ``F.linear`` (cuBLAS). The temporary is ``2*N*K`` bytes for the duration of the call; nothing is cached, so
    the resident weight stays FP8. Exactly the torch reference's math (dequantise, BF16 GEMM).
  - ``"fp8"``: the DeepSeek-V3 fine-grained FP8 GEMM (arXiv 2412.19437 sec. 3.3). One kernel quantises the
    activations to E4M3 per token and 128 columns (``quant.quantize_fp8_group``), a second multiplies them with
    the E4M3 weight on FP8 tensor cores: per 128-wide K block a fresh ``tl.dot`` (float32 accumulate) scaled by
    ``sx[m, kb] * scale_inv[n // 128, kb]`` and added in float32. BF16 out, no weight temporary.
  - ``"scaled_mm"``: the same two operands through cuBLASLt's block scaling (``torch._scaled_mm`` with 1x128 x
    128x128 scales; sm_90, cuBLAS >= 12.9), used only where the probe ``scaled_mm_available`` passes.

  The FP8 paths round the activations to E4M3 (lossy, like the FP8 head); dequant keeps them in BF16.
* ``fmt == "plain"``: ``F.linear`` on the stored weight (no kernel of ours).

``lm_head`` (``LMHead``):

* ``mode == "fp8"`` and M <= 4: a one-program-per-token kernel quantises the activation to E4M3 with its
  dynamic scale (``quant.quantize_fp8_token``), then ``logits[m, v] = (sum_k xq[m, k] * wq[v, k]) * sx[m] *
  w_scale[v]`` runs on FP8 tensor cores (``tl.dot`` of E4M3 x E4M3, float32 accumulate; tokens padded to 16
  columns), so the 402 MB weight streams with no per-weight conversion. Same math as the reference
  ``torch._scaled_mm`` row-wise path up to summation order. Two launches. A greedy token needs only the argmax:
  :func:`fp8_head_argmax` reduces it inside the head kernel (per-program best keys, the last program's
  reduction) instead of storing the logits for a separate argmax launch; the bound head exposes it as
  ``fn.argmax`` (``layers.lm_head.head_argmax``), by default for the hot-vocabulary draft head only
  (:func:`argmax_fused_enabled`).
* fp8 with M > 4: ``torch._scaled_mm`` (row-wise scales, float32 out) like the torch reference.
* ``bf16``/``fp32`` modes delegate to the torch reference (cuBLAS).

All kernels are shape-specialised through constexprs (N, K, M) and Triton's JIT cache; launch configs are
chosen by :func:`gemv_config` and :func:`gemm_config` (no autotuning at run time, so the first call compiles exactly one kernel and
graph capture sees no tuning).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from bytebound.errors import BackendError, ConfigError
from bytebound.kernels.device import check_register_cap, sm_count
from bytebound.kernels.limits import MAX_VERIFY_M as MAX_M     # the one verify-width limit (kernels/limits.py)
from bytebound.kernels.pdl import enabled as pdl_enabled
from bytebound.kernels.registry import cuda_only, optional_triton, register
from bytebound.kernels.scratch import scratch

triton, tl, _TRITON_ERR = optional_triton()      # None, None, reason on machines without Triton


def available(dev) -> str | None:
    why = cuda_only(dev) or _TRITON_ERR
    if why:
        return why
    major, minor = torch.cuda.get_device_capability(torch.device(dev))
    if (major, minor) < (8, 9):
        return f"FP8 (E4M3) conversion needs compute capability >= 8.9, got {major}.{minor}"
    return None


if tl is not None:
    from bytebound.kernels.pdl import gdc as _gdc     # griddepcontrol / fence, every thread
    from bytebound.kernels.pdl import ticket as _ticket     # a split's ticket: fence, barrier, acq_rel add
    from bytebound.kernels.triton_router import _key as _router_key     # float order as int64 keys

    # $1 a 16-byte aligned global address, $2 a byte count (a multiple of 16; 0: nothing); also used by the Gluon
    # kernels of kernels.triton_moe_persist
    ASM_L2_PREFETCH = tl.constexpr(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")

    @triton.jit
    def _l2_prefetch(row_ptr, nbytes):
        """``cp.async.bulk.prefetch.L2`` (sm_90): the copy engine brings ``nbytes`` (a multiple of 16, may be 0)
        from each row pointer (16-byte aligned) into L2. A hint: nothing is written or waited for."""
        tl.inline_asm_elementwise(ASM_L2_PREFETCH, "=r,l,r", [row_ptr, nbytes + tl.zeros(row_ptr.shape, tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _gemv_loads(wp, x_ptr, srow, k0, kend, kk, rmask, K: tl.constexpr, M: tl.constexpr, SBK: tl.constexpr,
                    BK: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr):
        """The loads of the K chunk at ``k0``: weight tile ``[BN, BK]``, its block scale(s) and the activations
        (DOT: ``[BK, 16]`` token-padded in ``x0``; else one ``[BK]`` vector per token, ``x1..x3`` unused past M).
        Past ``kend`` everything is masked off (no memory traffic)."""
        if EVEN_K:      # whole chunks: one predicate per chunk keeps the loads 16-byte vectors
            kmask = (kk < BK) & (k0 < kend)
        else:
            kmask = (k0 + kk) < kend
        if EVEN_N:
            w = tl.load(wp + k0, mask=kmask[None, :], other=0.0)
        else:
            w = tl.load(wp + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
        x1 = 0.0
        x2 = 0.0
        x3 = 0.0
        if DOT:
            mm = tl.arange(0, 16)
            sc = tl.load(srow + k0 // SBK, mask=k0 < kend, other=0.0)
            x0 = tl.load(x_ptr + mm[None, :] * K + (k0 + kk)[:, None], mask=(mm[None, :] < M) & kmask[:, None],
                         other=0.0)
        else:
            sc = tl.load(srow + (k0 + kk) // SBK, mask=kmask, other=0.0)
            x0 = tl.load(x_ptr + k0 + kk, mask=kmask, other=0.0)
            if M > 1:
                x1 = tl.load(x_ptr + K + k0 + kk, mask=kmask, other=0.0)
            if M > 2:
                x2 = tl.load(x_ptr + 2 * K + k0 + kk, mask=kmask, other=0.0)
            if M > 3:
                x3 = tl.load(x_ptr + 3 * K + k0 + kk, mask=kmask, other=0.0)
        return w, sc, x0, x1, x2, x3

    @triton.jit
    def _fp8_gemv(x_ptr, w_ptr, s_ptr, o_ptr, part_ptr, cnt_ptr, N, K: tl.constexpr, SK: tl.constexpr,
                  M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, SPLIT: tl.constexpr,
                  SBN: tl.constexpr, SBK: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                  DOT: tl.constexpr, PRE: tl.constexpr, PF: tl.constexpr, PDL: tl.constexpr, HW: tl.constexpr,
                  NT: tl.constexpr):
        """``o[m, n] = sum_k x[m, k] * w[n, k] * s[n // SBN, k // SBK]`` (float32 sums, out in o's dtype).

        Program ``(i, p)``: rows ``i*BN ..`` (BN divides SBN: one scale row) over columns ``p*KS .. p*KS + KS``.
        ``PRE``: each K chunk's loads are issued one chunk ahead, so they are in flight while the previous chunk
        is multiplied (else each chunk is loaded and used in turn, and other resident programs hide the latency). ``DOT``: BF16 tensor-core products of one scale block (BK <= SBK; E4M3 -> BF16 is exact) into
        a fresh float32 accumulator, scaled in float32; else float32 FMAs with x pre-multiplied by the scales.
        ``SPLIT > 1``: the float32 partial goes to ``part`` and the last of the SPLIT programs of row tile i
        (acq_rel ticket ``cnt[i]``) sums the partials in the order p = 0..SPLIT-1, stores the output and re-arms
        the ticket (deterministic, graph-safe). ``HW``: compiled for a GPU (False in Triton's interpreter: no
        PTX). ``PDL``: the weight prefetch runs before ``griddepcontrol.wait``;
        x, the scales' consumers, part, cnt and o are touched only after it."""
        pid = tl.program_id(0)
        pk = tl.program_id(1)
        if PDL:         # the next kernel may launch now; its own wait still waits for this grid to complete
            _gdc("griddepcontrol.launch_dependents; mov.u32 $0, 0;", NT)
        rows = pid * BN + tl.arange(0, BN)
        rmask = rows < N
        kk = tl.arange(0, BK)
        kbeg = pk * KS
        kend = kbeg + KS            # the slice's end; the masks' bound is min(kend, K)
        if EVEN_K:
            klim = kend
        else:
            klim = tl.minimum(kend, K)
        srow = s_ptr + ((pid * BN) // SBN) * SK
        wp = w_ptr + rows[:, None].to(tl.int64) * K + kk[None, :]
        if PF > 0:      # read-only weights: may be requested before the dependency wait
            _l2_prefetch(w_ptr + rows.to(tl.int64) * K + kbeg, (tl.minimum(PF, klim - kbeg) // 16) * 16)
        if PDL:
            _gdc("griddepcontrol.wait; mov.u32 $0, 0;", NT)
        if PRE:
            w, sc, x0, x1, x2, x3 = _gemv_loads(wp, x_ptr, srow, kbeg, klim, kk, rmask, K, M, SBK, BK, EVEN_N, EVEN_K,
                                                DOT)
        if DOT:
            mm = tl.arange(0, 16)
            acc = tl.zeros([BN, 16], tl.float32)
        else:
            acc0 = tl.zeros([BN, BK], tl.float32)
            acc1 = tl.zeros([BN, BK], tl.float32)
            acc2 = tl.zeros([BN, BK], tl.float32)
            acc3 = tl.zeros([BN, BK], tl.float32)
        for c in range(0, KS // BK):       # constant trip count (KS is a multiple of BK)
            k0 = kbeg + c * BK
            if PRE:     # the next chunk's loads go out before this chunk is multiplied
                wn, scn, x0n, x1n, x2n, x3n = _gemv_loads(wp, x_ptr, srow, k0 + BK, klim, kk, rmask, K, M, SBK, BK,
                                                          EVEN_N, EVEN_K, DOT)
            else:
                w, sc, x0, x1, x2, x3 = _gemv_loads(wp, x_ptr, srow, k0, klim, kk, rmask, K, M, SBK, BK, EVEN_N,
                                                    EVEN_K, DOT)
            if DOT:
                if HW:
                    acc += tl.dot(w.to(tl.bfloat16), x0.to(tl.bfloat16)) * sc
                else:           # the interpreter has no BF16 products: the same exact operands in float32
                    acc += tl.dot(w.to(tl.float32), x0.to(tl.float32), input_precision="ieee") * sc
            else:
                wf = w.to(tl.float32)
                acc0 += wf * (x0.to(tl.float32) * sc)[None, :]
                if M > 1:
                    acc1 += wf * (x1.to(tl.float32) * sc)[None, :]
                if M > 2:
                    acc2 += wf * (x2.to(tl.float32) * sc)[None, :]
                if M > 3:
                    acc3 += wf * (x3.to(tl.float32) * sc)[None, :]
            if PRE:
                w, sc, x0, x1, x2, x3 = wn, scn, x0n, x1n, x2n, x3n
        lr = tl.arange(0, BN)
        mr = tl.arange(0, 4)
        if DOT:
            # [BN, 16] -> [4, BN] (tokens 4..15 are padding)
            out = tl.sum(tl.where(mm[None, None, :] == mr[:, None, None], acc[None, :, :], 0.0), axis=2)
        else:
            out = tl.where(mr[:, None] == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
            if M > 1:
                out += tl.where(mr[:, None] == 1, tl.sum(acc1, axis=1)[None, :], 0.0)
            if M > 2:
                out += tl.where(mr[:, None] == 2, tl.sum(acc2, axis=1)[None, :], 0.0)
            if M > 3:
                out += tl.where(mr[:, None] == 3, tl.sum(acc3, axis=1)[None, :], 0.0)
        omask = (mr[:, None] < M) & rmask[None, :]
        if SPLIT == 1:
            tl.store(o_ptr + mr[:, None] * N + rows[None, :], out.to(o_ptr.dtype.element_ty), mask=omask)
        else:
            base = part_ptr + pid.to(tl.int64) * (SPLIT * 4 * BN)
            tl.store(base + pk * (4 * BN) + mr[:, None] * BN + lr[None, :], out, mask=mr[:, None] < M)
            # every thread's partial stores are visible before the program takes its ticket (the fence with HW)
            ticket = _ticket(cnt_ptr, HW, NT, pid)
            if ticket == SPLIT - 1:
                tot = tl.zeros([4, BN], tl.float32)
                for q in tl.static_range(SPLIT):        # fixed order: bit-identical on every run and replay
                    tot += tl.load(base + q * (4 * BN) + mr[:, None] * BN + lr[None, :], mask=mr[:, None] < M,
                                   other=0.0, cache_modifier=".cg")
                tl.store(o_ptr + mr[:, None] * N + rows[None, :], tot.to(o_ptr.dtype.element_ty), mask=omask)
                tl.store(cnt_ptr + pid, 0)

    @triton.jit
    def _fp8_dequant_block(w_ptr, s_ptr, o_ptr, N, K, SK, BN: tl.constexpr, BK: tl.constexpr, SBN: tl.constexpr,
                           SBK: tl.constexpr):
        """o[n, k] = bf16(w[n, k] * s[n // SBN, k // SBK]); one [BN, BK] tile per program."""
        pn = tl.program_id(0)
        pk = tl.program_id(1)
        rows = pn * BN + tl.arange(0, BN)
        cols = pk * BK + tl.arange(0, BK)
        m = (rows[:, None] < N) & (cols[None, :] < K)
        off = rows[:, None].to(tl.int64) * K + cols[None, :]
        s = tl.load(s_ptr + (rows[:, None] // SBN) * SK + cols[None, :] // SBK, mask=m, other=0.0)
        w = tl.load(w_ptr + off, mask=m, other=0.0).to(tl.float32)
        tl.store(o_ptr + off, (w * s).to(tl.bfloat16), mask=m)

    @triton.jit
    def _fp8_quant_rows(x_ptr, q_ptr, s_ptr, K: tl.constexpr, BK: tl.constexpr):
        """Per-token E4M3: s[m] = max(max|x[m]| / 448, 1e-12), q[m] = e4m3(clamp(x[m] / s[m])) (quant.quantize_fp8_token)."""
        m = tl.program_id(0)
        kk = tl.arange(0, BK)
        amax = tl.zeros([BK], tl.float32)
        for k0 in range(0, K, BK):
            amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + m * K + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)))
        # IEEE divisions (div_rn), as torch computes them, so the E4M3 codes match the reference bit for bit
        sc = tl.maximum(tl.div_rn(tl.max(amax, axis=0), 448.0), 1e-12)
        for k0 in range(0, K, BK):
            x = tl.load(x_ptr + m * K + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)
            q = tl.clamp(tl.div_rn(x, tl.full([BK], 1.0, tl.float32) * sc), -448.0, 448.0)
            tl.store(q_ptr + m * K + k0 + kk, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=k0 + kk < K)
        tl.store(s_ptr + m, sc)

    @triton.jit
    def _head_tile(q_ptr, sx_ptr, w_ptr, ws_ptr, pid, N, K: tl.constexpr, M: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, EVEN_N: tl.constexpr):
        """Program ``pid``'s ``BN`` rows of the FP8 head's logits: ``(out [BN, 16] float32, rows [BN], rmask [BN],
        mm [16])`` with ``out[r, m] = (sum_k q[m, k] * w[rows[r], k]) * sx[m] * ws[rows[r]]`` for tokens ``m < M``
        (tokens padded to 16 mma columns), E4M3 x E4M3 on tensor cores with float32 accumulation."""
        rows = pid * BN + tl.arange(0, BN)
        rmask = rows < N
        kk = tl.arange(0, BK)
        mm = tl.arange(0, 16)
        wp = w_ptr + rows[:, None].to(tl.int64) * K + kk[None, :]
        qp = q_ptr + mm[:, None] * K + kk[None, :]
        acc = tl.zeros([BN, 16], tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_N:
                w = tl.load(wp + k0)
            else:
                w = tl.load(wp + k0, mask=rmask[:, None], other=0.0)
            q = tl.load(qp + k0, mask=mm[:, None] < M, other=0.0)
            # A fresh accumulator per K step, added in float32: Hopper's FP8 tensor cores keep only ~14 bits
            # while accumulating, so long K runs lose precision (DeepSeek-V3 report, sec. 3.3.2: promote every
            # 128 elements). BK = 128 gives exactly that promotion interval.
            acc += tl.dot(w, tl.trans(q))
        sx = tl.load(sx_ptr + mm, mask=mm < M, other=0.0)
        wsc = tl.load(ws_ptr + rows, mask=rmask, other=0.0)
        return acc * wsc[:, None] * sx[None, :], rows, rmask, mm

    @triton.jit
    def _fp8_head_dot(q_ptr, sx_ptr, w_ptr, ws_ptr, o_ptr, N, K: tl.constexpr, M: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, EVEN_N: tl.constexpr):
        """logits[m, n] = (sum_k q[m, k] * w[n, k]) * sx[m] * ws[n] on FP8 tensor cores (float32 accumulate)."""
        out, rows, rmask, mm = _head_tile(q_ptr, sx_ptr, w_ptr, ws_ptr, tl.program_id(0), N, K, M, BN, BK, EVEN_N)
        tl.store(o_ptr + mm[None, :] * N + rows[:, None], out, mask=(mm[None, :] < M) & rmask[:, None])

    @triton.jit
    def _argmax_key(v, row, N):
        """int64 keys of float32 logits ``v`` at vocabulary rows ``row``, ordered as torch's argmax picks: larger
        value first, then the lower row (``N - 1 - row`` in the low word); -0.0 equals 0.0
        (:func:`kernels.triton_router._key`), and a NaN (either sign) outranks every number, as torch's argmax
        propagates NaN."""
        low = (N - 1 - row).to(tl.int64)
        return tl.where(v != v, (0x7FFFFFFF << 32) | low, _router_key(v, low))

    @triton.jit
    def _fp8_head_argmax(q_ptr, sx_ptr, w_ptr, ws_ptr, part_ptr, cnt_ptr, ids_ptr, map_ptr, N, P, K: tl.constexpr,
                         M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         EVEN_N: tl.constexpr, FENCE: tl.constexpr, RB: tl.constexpr, HAS_MAP: tl.constexpr):
        """``ids[m] = argmax_n logits[m, n]`` with the logits of :func:`_fp8_head_dot` (the same :func:`_head_tile`,
        so the same float32 values), never stored: each of the ``P`` programs keeps its ``BN`` rows' best
        :func:`_argmax_key` per token in ``part [M, P]``, and the last to finish (an acq_rel ticket, as
        ``triton_router.gemv_route``) reduces them in chunks of ``RB`` and writes ``ids`` int64
        (``HAS_MAP``: ``map[row]``, the row's vocabulary id for a row subset of the head), then re-arms the ticket."""
        pid = tl.program_id(0)
        out, rows, rmask, mm = _head_tile(q_ptr, sx_ptr, w_ptr, ws_ptr, pid, N, K, M, BN, BK, EVEN_N)
        key = _argmax_key(out, rows[:, None] + tl.zeros([BN, 16], tl.int32), N)
        key = tl.where(rmask[:, None], key, -0x7FFFFFFFFFFFFFFF - 1)      # rows past N never win
        tl.store(part_ptr + mm * P + pid, tl.max(key, axis=0), mask=mm < M)
        # FENCE: False only under TRITON_INTERPRET. 128 elements: one per thread at HEAD_CONFIG's 4 warps (a wider
        # launch replicates them, so every thread still fences)
        ticket = _ticket(cnt_ptr, FENCE, 128)
        if ticket == P - 1:
            r = tl.arange(0, MP)
            best = tl.full([MP], -0x7FFFFFFFFFFFFFFF - 1, tl.int64)
            for c0 in range(0, P, RB):
                c = c0 + tl.arange(0, RB)
                # .cg (L2, not L1): other SMs stored these partials moments ago
                kb = tl.load(part_ptr + r[:, None] * P + c[None, :], mask=(r[:, None] < M) & (c[None, :] < P),
                             other=-0x7FFFFFFFFFFFFFFF - 1, cache_modifier=".cg")
                best = tl.maximum(best, tl.max(kb, axis=1))
            row = (N - 1 - best.to(tl.int32)).to(tl.int64)      # the low word (N - 1 - row < 2^31)
            if HAS_MAP:
                row = tl.load(map_ptr + row, mask=r < M, other=0)
            tl.store(ids_ptr + r, row, mask=r < M)
            tl.store(cnt_ptr, 0)

    @triton.jit
    def _fp8_quant_groups(x_ptr, q_ptr, s_ptr, M, K, G: tl.constexpr, BM: tl.constexpr, POW2: tl.constexpr):
        """Per token and G-column group g: s[g, m] = max(amax / 448, 1e-12) (POW2: rounded up to 2^e),
        q[m, g*G:(g+1)*G] = e4m3(clamp(x / s)) (quant.quantize_fp8_group). ``s`` is stored group-major
        ([ceil(K/G), M] contiguous): the GEMM reads one K block's scales of BM consecutive tokens, and cuBLAS's
        1x128 recipe wants this outer-dim-major layout."""
        pm = tl.program_id(0)
        g = tl.program_id(1)
        rows = pm * BM + tl.arange(0, BM)
        cols = g * G + tl.arange(0, G)
        rmask = rows < M
        msk = rmask[:, None] & (cols[None, :] < K)
        off = rows[:, None].to(tl.int64) * K + cols[None, :]
        x = tl.load(x_ptr + off, mask=msk, other=0.0).to(tl.float32)
        # IEEE divisions (div_rn), as torch computes them, so codes and scales match the reference bit for bit
        sc = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), 448.0), 1e-12)
        if POW2:     # ceil to a power of two on the bits (quant.round_up_pow2): exact, unlike exp2(ceil(log2))
            sc = ((sc.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
        q = tl.clamp(tl.div_rn(x, sc[:, None] + tl.zeros([BM, G], tl.float32)), -448.0, 448.0)
        tl.store(q_ptr + off, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=msk)
        tl.store(s_ptr + g * M + rows, sc, mask=rmask)

    @triton.jit
    def _fp8_block_gemm(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K: tl.constexpr, SK, SBN: tl.constexpr,
                        SBK: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                        EVEN_K: tl.constexpr):
        """c[m, n] = sum_kb (sum_{k in kb} a[m, k] * b[n, k]) * as[kb, m] * bs[n // SBN, kb] on FP8 tensor cores.

        a E4M3 [M, K] with float32 scales ``as`` [SK, M] (one per token and SBK columns), b E4M3 [N, K] with
        float32 scales ``bs`` [ceil(N/SBN), SK], c [M, N] in its own dtype (BF16). BK divides SBK, so each
        K step lies in one scale block."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        # Grouped launch order: GROUP_M row tiles walk the N tiles together, so a weight tile is read from L2
        # by several programs in a row instead of once per sweep over M.
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % gsize
        pid_n = (pid % per_group) // gsize
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        # Out-of-range rows/columns load a valid row (mod M / N) instead of a masked one: no masks in the inner
        # loop except the K tail; the store below drops them.
        ra = rm % M
        rb = rn % N
        a_ptrs = a_ptr + ra[:, None].to(tl.int64) * K + rk[None, :]
        b_ptrs = b_ptr + rb[None, :].to(tl.int64) * K + rk[:, None]
        as_ptrs = as_ptr + ra
        bs_ptrs = bs_ptr + (rb // SBN) * SK
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=rk[None, :] < K - k0, other=0.0)
                b = tl.load(b_ptrs, mask=rk[:, None] < K - k0, other=0.0)
            kb = k0 // SBK
            sa = tl.load(as_ptrs + kb * M)
            sb = tl.load(bs_ptrs + kb)
            # A fresh tensor-core product per K block, scaled and added in float32: the block scales differ per
            # block, and Hopper's FP8 MMA keeps only ~14 bits while accumulating (DeepSeek-V3 report, sec.
            # 3.3.2: promote to float32 every 128 elements), so BK <= 128 is also the promotion interval.
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            a_ptrs += BK
            b_ptrs += BK
        cmask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=cmask)


# ---- decode/verify GEMV (M <= 4): launch configs, scratch, launch ------------------------------------------
GEMV_CONFIG_PATH = Path(__file__).resolve().parent / "configs" / "triton_fp8_gemv.json"
GEMV_KEYS = ("BN", "BK", "SPLIT", "num_warps", "num_stages", "DOT", "PRE", "PF", "PDL", "MMA", "NC", "NR")
GEMV_WAVES = 2              # the default's split-K aims at this many programs per SM


def gemv_key(n: int, k: int, m: int) -> str:
    """Table key of one GEMV shape: ``N{n}_K{k}_M{m}`` (weight ``[n, k]``, ``m`` tokens)."""
    return f"N{n}_K{k}_M{m}"


def gemv_table(path: str | None = None) -> dict:
    """The launch-config table ``{architecture ("sm_90"): {gemv_key: config}}``: ``path``, else the file named by
    ``BYTEBOUND_GEMV_CONFIG`` (e.g. the ``gemv_table.json`` a sweep just wrote), else the committed
    ``configs/triton_fp8_gemv.json`` (written from ``scripts/bench_gemv.py --sweep``; keys starting with ``_`` are
    notes). Read once per path. Raises ConfigError on a file that is not such a table."""
    return _read_gemv_table(_gemv_table_path(path))


def _gemv_table_path(path: str | None = None) -> str:
    """The table file :func:`gemv_table` reads: ``path``, ``BYTEBOUND_GEMV_CONFIG`` or the committed one."""
    return str(path or os.environ.get("BYTEBOUND_GEMV_CONFIG") or GEMV_CONFIG_PATH)


@functools.lru_cache(maxsize=None)
def _read_gemv_table(path: str) -> dict:
    with open(path) as f:
        table = json.load(f)
    if not isinstance(table, dict) or any(not isinstance(v, dict) for k, v in table.items() if not k.startswith("_")):
        raise ConfigError(f"{path}: not a {{arch: {{shape: config}}}} table")
    return {k: v for k, v in table.items() if not k.startswith("_")}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1): host-side config arithmetic that must work without Triton."""
    return 1 << max(0, int(x) - 1).bit_length()


def gemv_default(n: int, k: int, m: int, sm_count: int = 132) -> dict:
    """The config for a shape the table lacks (and for GPUs it has no architecture entry for): FMA path, 16 or 32
    rows per program, 256-column chunks, and split-K up to about :data:`GEMV_WAVES` programs per SM."""
    bn = 32 if n >= 4096 and m <= 2 else 16
    return {"BN": bn, "BK": 256, "SPLIT": 0, "num_warps": 4, "num_stages": 1, "DOT": False, "PRE": False, "PF": 0,
            "PDL": True}


def fit_gemv_config(cfg: dict, n: int, k: int, m: int, block=(128, 128), sm_count: int = 132) -> dict:
    """A GEMV config made valid for weight ``[n, k]`` with scale ``block``: BN a power of two dividing the scale
    block's rows (so a program's rows share one row of scales), BK a power of two >= 16 (the tensor-core path
    ``DOT``: <= the scale block's columns, so each chunk has one scale; tensor cores need BN, BK >= 16, else the FMA
    path), ``SPLIT`` slices of K of ``KS`` columns (a multiple of BK; ``SPLIT`` 0 = as many as bring the grid to
    about :data:`GEMV_WAVES` programs per SM), ``PF`` (bytes per row prefetched into L2 before the PDL wait) 0
    unless rows are 16-byte aligned. Raises BackendError for a scale block with no power-of-two row tiling.

    ``MMA`` (the Gluon tensor-core path, ``kernels.gluon_fp8_gemv``): see :func:`_fit_mma`; where that path cannot
    run (no Gluon, a scale block other than 128x128, K % 128) the result is the FMA path's default config
    (:func:`gemv_default`) with the reason in ``"MMA_WHY"``, so reports can say why. ``NR``: MMA only (else
    BackendError)."""
    if cfg.get("MMA"):
        from bytebound.kernels.gluon_fp8_gemv import mma_refusal
        why = mma_refusal(n, k, block)
        if why is None:
            return _fit_mma(cfg, n, k, sm_count)
        return dict(fit_gemv_config(gemv_default(n, k, m, sm_count), n, k, m, block, sm_count), MMA_WHY=why)
    if cfg.get("NR") is not None:
        raise BackendError("linear[triton]: NR (a register cap) is a key of the MMA GEMV only; this config has no MMA")
    sbn, sbk = block
    out = {kk: cfg[kk] for kk in GEMV_KEYS if kk in cfg}
    out = {"SPLIT": 0, "num_stages": 1, "DOT": False, "PRE": False, "PF": 0, "PDL": True, **out}
    bn = int(out["BN"])
    while bn > 1 and (sbn % bn or bn & (bn - 1)):
        bn //= 2
    if bn < 1 or sbn % bn:
        raise BackendError(f"linear[triton]: scale block {tuple(block)} has no power-of-two row tiling")
    bk = max(16, _next_pow2(int(out["BK"])))
    dot = bool(out["DOT"]) and bn >= 16 and sbk >= 16
    if dot:
        while bk > sbk or sbk % bk:
            bk //= 2
    bk = min(bk, max(16, _next_pow2(k)))
    tiles = _cdiv(n, bn)
    split = int(out["SPLIT"])
    if split <= 0:
        split = max(1, min(_cdiv(k, bk), (GEMV_WAVES * sm_count) // tiles))
    ks = _cdiv(_cdiv(k, min(split, _cdiv(k, bk))), bk) * bk
    split = _cdiv(k, ks)
    pf = int(out["PF"]) if k % 16 == 0 else 0
    out.update(BN=bn, BK=bk, DOT=dot, PRE=bool(out["PRE"]), SPLIT=split, KS=ks, PF=min(pf, ks) // 16 * 16,
               MMA=False)
    out.pop("NC", None)
    return out


def _pow2_floor(x: int) -> int:
    """Largest power of two <= x (x >= 1)."""
    return 1 << (max(1, int(x)).bit_length() - 1)


def _fit_mma(cfg: dict, n: int, k: int, sm_count: int) -> dict:
    """The MMA path's config for weight ``[n, k]`` (128x128 scale blocks, ``k % 128 == 0``; checked by the caller).

    ``BN`` (R, rows per program): a power of two in 16..128 (so it divides the 128-row scale block) and a multiple
    of ``16 * num_warps`` (one mma row tile per warp; ``num_warps`` a power of two <= 8, cut to ``R // 16`` where
    R is smaller). ``NC`` (scale blocks per chunk): the largest power of two <= min(NC, 4) that divides K / 128.
    ``SPLIT``: slices of ``KS`` columns, a whole number of chunks (0 = as many as bring the grid to about
    :data:`GEMV_WAVES` programs per SM; the last slice may hold fewer chunks). ``BK`` is the chunk's width,
    ``128 * NC``. Nothing depends on the token count M, so one config serves M = 1..4 and a verify row equals the
    decode result bit for bit. ``NR`` (optional): the kernel's register cap per thread (ptxas ``maxnreg``,
    24..255): the same arithmetic, another register allocation and schedule (the MoE kernel A's cap paid 5 %,
    docs/perf/session27-h100-nr/).

    Raises:
        BackendError: ``NR`` is not an integer in 24..255."""
    out = {"num_warps": 4, "BN": 64, "NC": 2, "SPLIT": 0, "PDL": True,
           **{kk: cfg[kk] for kk in GEMV_KEYS if kk in cfg}}
    check_register_cap(out.get("NR"), "linear[triton]: MMA GEMV: NR (the register cap per thread)")
    r = min(128, max(16, _pow2_floor(int(out["BN"]))))
    nw = min(8, _pow2_floor(int(out["num_warps"])), r // 16)
    nb = k // 128
    nc = min(_pow2_floor(int(out["NC"])), 4)
    while nb % nc:
        nc //= 2
    chunks = nb // nc
    tiles = _cdiv(n, r)
    split = int(out["SPLIT"])
    if split <= 0:
        split = max(1, (GEMV_WAVES * sm_count) // tiles)
    per = _cdiv(chunks, min(split, chunks))
    out.update(MMA=True, BN=r, num_warps=nw, NC=nc, BK=128 * nc, KS=per * nc * 128, SPLIT=_cdiv(chunks, per),
               num_stages=1, DOT=False, PRE=False, PF=0, PDL=bool(out["PDL"]))
    return out


_GEMV_DEV: dict = {}          # device -> (architecture, multiprocessor count)


def gemv_scratch(device, name: str, numel: int, dtype=torch.float32) -> torch.Tensor:
    """A zero-initialised buffer ``name`` of at least ``numel`` elements shared by every split-K GEMV on
    ``device`` (``"part"``: float32 partials ``[tiles, SPLIT, 4, BN]``; ``"ticket"``: int32, one per row tile, zero
    between launches since each launch re-arms its own). One buffer serves every projection: the GEMVs run one
    after another on one stream, and a PDL dependent touches it only after its wait, i.e. after the previous
    launch completed. Growing keeps older buffers alive (a captured CUDA graph holds their addresses);
    :class:`TritonLinear` grows it at bind time, so nothing is allocated during graph capture. The buffers are
    :func:`kernels.scratch.scratch`'s ``gemv_<name>``."""
    return scratch(device, "gemv_" + name, numel, dtype)


def _device_info(dev: torch.device) -> tuple[str | None, int]:
    """(architecture "sm_XY" or None without CUDA, multiprocessor count)."""
    if dev.type != "cuda":
        return None, 132
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev not in _GEMV_DEV:
        major, minor = torch.cuda.get_device_capability(dev)
        _GEMV_DEV[dev] = (f"sm_{major}{minor}", sm_count(dev))
    return _GEMV_DEV[dev]


def gemv_config(n: int, k: int, m: int, device=None, block=(128, 128)) -> dict:
    """The fitted GEMV launch config of weight ``[n, k]`` for ``m`` tokens on ``device``: the table entry of the
    device's architecture (``sm_90`` for every Hopper part), else :func:`gemv_default`; then
    :func:`fit_gemv_config`. Fixed per shape (no run-time tuning: one compile per shape, nothing to tune while a
    graph is captured)."""
    return gemv_config_source(n, k, m, device, block)[0]


def gemv_config_source(n: int, k: int, m: int, device=None, block=(128, 128)) -> tuple[dict, str]:
    """:func:`gemv_config` and where its config came from, for the manifest: ``"sm_90 table"`` (the committed
    table's entry for this architecture; a table named by ``BYTEBOUND_GEMV_CONFIG`` is named too) or ``"untuned
    default, ..."`` (:func:`gemv_default`: no entry for this shape, no section for this architecture, or no CUDA
    architecture at all). Raises BackendError like :func:`fit_gemv_config`."""
    arch, sms = _device_info(torch.device(device) if device is not None else torch.device("cpu"))
    path = _gemv_table_path()
    table = gemv_table()
    cfg = table.get(arch or "", {}).get(gemv_key(n, k, m))
    where = "" if path == str(GEMV_CONFIG_PATH) else f" {path}"
    if cfg:
        source = f"{arch} table{where}"
    else:
        cfg = gemv_default(n, k, m, sms)
        source = ("untuned default, no CUDA architecture" if arch is None else
                  f"untuned default, no {arch} entry{where}" if arch in table else
                  f"untuned default, table{where} has no {arch} section")
    return fit_gemv_config(cfg, n, k, m, block, sms), source


def gemv_path(cfg: dict) -> str:
    """The kernel a fitted GEMV config runs: ``"mma"`` (the Gluon tensor-core kernel, ``kernels.gluon_fp8_gemv``),
    ``"dot"`` (BF16 tensor cores through ``tl.dot``) or ``"fma"`` (float32 FMAs)."""
    return "mma" if cfg.get("MMA") else "dot" if cfg.get("DOT") else "fma"


def gemv_bind_configs(n: int, k: int, device, block=(128, 128)) -> tuple[dict[int, dict], dict[int, dict]]:
    """What :meth:`TritonLinear.bind` fixes for weight ``[n, k]`` with scale ``block`` on ``device``, per token
    count M = 1..4: the fitted launch configs (:func:`gemv_config_source`), and per M ``{"path": mma | dot | fma
    (:func:`gemv_path`), "source": the config's source, "refused": why the MMA path the table asked for cannot run
    (``fit_gemv_config``'s ``MMA_WHY``: the FMA default runs instead), else None}`` (read into the manifest:
    ``runner.backends``, :func:`describe_gemv_path`). Raises BackendError like :func:`fit_gemv_config`."""
    cfgs, paths = {}, {}
    for m in range(1, MAX_M + 1):
        cfgs[m], source = gemv_config_source(n, k, m, device, block)
        paths[m] = {"path": gemv_path(cfgs[m]), "source": source, "refused": cfgs[m].get("MMA_WHY")}
    return cfgs, paths


def describe_gemv_path(info: dict) -> str:
    """One line for the manifest from a :func:`gemv_bind_configs` path record: ``"mma (sm_90 table)"``, ``"fma
    (untuned default, no sm_90 entry)"``, ``"fma (sm_90 table; mma refused: <why>)"``."""
    refused = f"; mma refused: {info['refused']}" if info.get("refused") else ""
    return f"{info['path']} ({info['source']}{refused})"


def gemv_reserve(device, n: int, k: int, block=(128, 128), cfgs=None) -> None:
    """Grow the split-K scratch for weight ``[n, k]`` at M = 1..4 (``cfgs``: per-M configs, default the table's),
    and with the add + norm fold on (:func:`norm_fold_enabled`) its slots for MMA configs, so that no call
    allocates (graph capture)."""
    fold = torch.device(device).type == "cuda" and norm_fold_enabled()
    for m in range(1, MAX_M + 1):
        cfg = cfgs[m] if cfgs else gemv_config(n, k, m, device, block)
        _split_scratch(device, n, cfg, None)
        if fold and cfg.get("MMA"):
            _fold_slots(device, n, k, cfg, m)     # the add + norm fold's slots (tiles * SPLIT * M * K BF16)


def _split_scratch(device, n: int, cfg: dict, unused):
    """``(part, cnt)``: the split-K partials and tickets of weight rows ``n`` under ``cfg`` (``gemv_scratch``, grown
    as needed), or ``(unused, unused)`` when ``SPLIT == 1`` (the kernels then touch neither)."""
    if cfg["SPLIT"] <= 1:
        return unused, unused
    tiles = _cdiv(n, cfg["BN"])
    return (gemv_scratch(device, "part", tiles * cfg["SPLIT"] * 4 * cfg["BN"]),
            gemv_scratch(device, "ticket", tiles, torch.int32))


def fp8_block_gemv(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                   cfg: dict | None = None) -> torch.Tensor:
    """``y [M, N] = x2 [M, K] @ W.T`` for M <= 4 in one launch, W = ``weight * scale_inv`` per ``block``.

    Math: E4M3 weight (exact in float32/BF16), float32 block scales applied in float32, float32 sums, output in
    x2's dtype (the torch reference's ``F.linear`` on the dequantised weight up to summation order and one rounding
    of w*s to BF16 it does and this does not). Split-K, where the config asks, sums partials in a fixed order,
    so every call on the same inputs is bit-identical, eager or graph-replayed.

    Args:
        x2: ``[M, K]`` activations, M <= 4 (made contiguous). weight: E4M3 ``[N, K]``; scale_inv: float32
            ``[ceil(N/block[0]), ceil(K/block[1])]``, contiguous.
        cfg: a fitted config (:func:`gemv_config` / :func:`fit_gemv_config`); default the device's table entry.
            ``MMA``: the Gluon tensor-core kernel (``kernels.gluon_fp8_gemv``, BF16 x only), same maths.
    Raises:
        BackendError: M > 4, or mismatched shapes; MMA with non-BF16 x or an unaligned weight.
    """
    m, k = x2.shape
    n = weight.shape[0]
    if m > MAX_M or weight.shape[1] != k:
        raise BackendError(f"linear[triton]: the GEMV takes [M <= {MAX_M}, K] x [N, K], got {tuple(x2.shape)} and "
                           f"{tuple(weight.shape)}")
    dev = x2.device
    if cfg is None:
        cfg = gemv_config(n, k, m, dev, block)
    elif "KS" not in cfg:           # not yet fitted (a hand-written config, e.g. from the benchmark's sweep)
        cfg = fit_gemv_config(cfg, n, k, m, block, _device_info(dev)[1])
    x2 = x2.contiguous()
    out = torch.empty(m, n, dtype=x2.dtype, device=dev)
    if m == 0:
        return out
    bn, split = cfg["BN"], cfg["SPLIT"]
    tiles = triton.cdiv(n, bn)
    part, cnt = _split_scratch(dev, n, cfg, out)
    pdl = bool(cfg.get("PDL", True)) and pdl_enabled(dev)   # off under the interpreter, BYTEBOUND_PDL=0
    if cfg.get("MMA"):
        from bytebound.kernels.gluon_fp8_gemv import launch_mma
        launch_mma(x2, weight, scale_inv, out, part, cnt, cfg, pdl)
        return out
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    nw = cfg["num_warps"]
    extra = {"launch_pdl": True} if pdl else {}
    _fp8_gemv[(tiles, split)](x2, weight, scale_inv, out, part, cnt, n, K=k, SK=scale_inv.shape[1], M=m, BN=bn,
                              BK=cfg["BK"], KS=cfg["KS"], SPLIT=split, SBN=block[0], SBK=block[1],
                              EVEN_N=(n % bn == 0), EVEN_K=(k % cfg["KS"] == 0 and cfg["KS"] % cfg["BK"] == 0),
                              DOT=cfg["DOT"], PRE=bool(cfg["PRE"]), PF=0 if interp else cfg["PF"], PDL=pdl,
                              HW=not interp, NT=32 * nw, num_warps=nw, num_stages=cfg.get("num_stages", 1),
                              **extra)
    return out


def norm_fold_enabled() -> bool:
    """Whether the decoder's input add + RMSNorm run inside the attention's FP8 MMA projection
    (:func:`fp8_block_gemv_add_norm`): opt-in, ``BYTEBOUND_NORM_FOLD=1``. Off by default because it measured
    slower than the norm kernel before a PDL-launched GEMV (docs/perf/history.md). Read at bind (it must be on
    then: ``runner.backends`` sets the layers' ``fold_input_norm`` and :func:`gemv_reserve` grows the slots) and at
    each call of the binding's ``add_norm``, so a graph captured after turning it off runs unfolded: an A/B is a
    run started with ``BYTEBOUND_NORM_FOLD=1`` and ``scripts/profile_decode.py --ab BYTEBOUND_NORM_FOLD=0 ""``."""
    return os.environ.get("BYTEBOUND_NORM_FOLD", "0") == "1"


def _fold_slots(dev, n: int, k: int, cfg: dict, m: int) -> torch.Tensor:
    """The fold's scratch: one ``[M, K]`` BF16 slot per program of the MMA grid (``gemv_scratch``, grown at bind
    by :func:`gemv_reserve`, so a capture allocates nothing)."""
    return gemv_scratch(dev, "norm_x", triton.cdiv(n, cfg["BN"]) * cfg["SPLIT"] * m * k, torch.bfloat16)


def fp8_block_gemv_add_norm(delta2: torch.Tensor, h2: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, scale_inv: torch.Tensor, cfg: dict
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder's input residual add and RMSNorm folded into the projection after it: one launch of the MMA
    GEMV (``kernels.gluon_fp8_gemv``, ``NORM``) instead of ``triton_norm.add_rmsnorm`` and :func:`fp8_block_gemv`.

    Math: ``h_new = bf16(h + delta)``, ``x = bf16(w * bf16(h_new * rsqrt(mean(h_new^2) + eps)))`` (the roundings
    of ``add_rmsnorm``; the float32 sum of squares runs in another order, so ``x`` can differ from it in the last
    BF16 bit where ``r`` lands on a rounding edge), then ``y = x @ W.T`` as :func:`fp8_block_gemv`. Every row's
    result is independent of M (the statistics are per row), so verify rows equal decode results bit for bit.

    Args:
        delta2, h2: BF16 ``[M <= 4, K]``, the previous sublayer's output and the residual stream;
        norm_weight: ``[K]`` (any float dtype, read as float32); eps: the norm's epsilon;
        weight / scale_inv: as :func:`fp8_block_gemv` (128x128 blocks); cfg: that weight's fitted config for
            this M, which must be the MMA path (:func:`gemv_path`).

    Returns:
        ``(y [M, N], x [M, K], h_new [M, K])``, all BF16.

    Raises:
        BackendError: a config that is not the MMA path, non-BF16 or mismatched activations, a norm weight not of
            K elements, M outside 1..4; the MMA kernel's own checks (``launch_mma``).
    """
    from bytebound.kernels.gluon_fp8_gemv import launch_mma
    m, k = h2.shape
    if not cfg.get("MMA"):
        raise BackendError(f"linear[triton]: the add + norm fold needs the MMA GEMV path, the config is "
                           f"{gemv_path(cfg)}")
    if (delta2.shape != h2.shape or h2.dtype != torch.bfloat16 or delta2.dtype != torch.bfloat16 or
            norm_weight.numel() != k or not 0 < m <= MAX_M or weight.shape[1] != k):
        raise BackendError(f"linear[triton]: add + norm GEMV needs BF16 delta and h of one shape [1..{MAX_M}, K], a "
                           f"norm weight of K elements and a weight [N, K]; got {tuple(delta2.shape)} "
                           f"{delta2.dtype}, {tuple(h2.shape)} {h2.dtype}, {norm_weight.numel()}, "
                           f"{tuple(weight.shape)}")
    dev = h2.device
    n = weight.shape[0]
    h2, delta2, nw = h2.contiguous(), delta2.contiguous(), norm_weight.contiguous()
    x, h_new = torch.empty_like(h2), torch.empty_like(h2)
    out = torch.empty(m, n, dtype=h2.dtype, device=dev)
    part, cnt = _split_scratch(dev, n, cfg, out)
    launch_mma(x, weight, scale_inv, out, part, cnt, cfg, bool(cfg.get("PDL", True)) and pdl_enabled(dev),
               norm=(h2, delta2, nw, h_new, float(eps), _fold_slots(dev, n, k, cfg, m)))
    return out, x, h_new


# ---- prefill on FP8 tensor cores (DeepSeek-V3 recipe: 1x128 activation scales x 128x128 weight scales) -------
PREFILL_PATHS = ("dequant", "fp8", "scaled_mm")


def _check_block_gemm(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block) -> None:
    """Named errors for inputs the block GEMMs cannot take (shapes, dtypes, scale grid, K block size)."""
    if x2.dim() != 2 or weight.dim() != 2 or x2.shape[1] != weight.shape[1]:
        raise BackendError(f"linear[triton]: activation {tuple(x2.shape)} and weight {tuple(weight.shape)} do not "
                           "multiply ([M, K] x [N, K])")
    if weight.dtype != torch.float8_e4m3fn or scale_inv.dtype != torch.float32:
        raise BackendError(f"linear[triton]: FP8 GEMM needs an E4M3 weight and float32 scales, got {weight.dtype} "
                           f"and {scale_inv.dtype}")
    n, k = weight.shape
    want = (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if tuple(scale_inv.shape) != want or not scale_inv.is_contiguous():
        raise BackendError(f"linear[triton]: weight_scale_inv {tuple(scale_inv.shape)} is not the contiguous "
                           f"{want} grid of weight {(n, k)} with block {tuple(block)}")
    sbk = block[1]
    if sbk < 32 or sbk & (sbk - 1):
        raise BackendError(f"linear[triton]: FP8 GEMM needs a power-of-two K scale block >= 32 (one FP8 MMA step), "
                           f"got block {tuple(block)}")


def quantize_fp8_groups(x2: torch.Tensor, group: int = 128, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic E4M3 per token and ``group`` columns in one Triton launch (``quant.quantize_fp8_group``, bit for bit).

    Args:
        x2: ``[M, K]`` BF16/FP16/float32 activations (made contiguous).
        group: columns per scale, a power of two (128 for the Ling checkpoint's 128x128 weight blocks).
        pow2: round each scale up to a power of two (``ue8m0``).
    Returns:
        ``q float8_e4m3fn [M, K]`` and ``s float32 [M, ceil(K/group)]`` with strides ``(1, M)`` (group-major
        storage: what :func:`fp8_block_gemm` reads and cuBLAS's 1x128 recipe requires).
    Raises:
        BackendError: ``x2`` not 2-D or ``group`` not a power of two.
    """
    if x2.dim() != 2 or group < 1 or group & (group - 1):
        raise BackendError(f"linear[triton]: per-group FP8 quantisation needs [M, K] and a power-of-two group, got "
                           f"{tuple(x2.shape)} and {group}")
    x2 = x2.contiguous()
    m, k = x2.shape
    sk = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x2.device)
    s = torch.empty(sk, m, dtype=torch.float32, device=x2.device)
    bm = max(1, min(16, 4096 // group))             # a [BM, group] float32 tile of <= 4096 values
    _fp8_quant_groups[(triton.cdiv(m, bm), sk)](x2, q, s, m, k, G=group, BM=bm, POW2=pow2, num_warps=4)
    return q, s.t()


def gemm_config(m: int, n: int, k: int, sm_count: int = 132) -> dict:
    """Launch config of :func:`fp8_block_gemm` (fixed per shape: no autotuning at run time, so one compile per
    shape and nothing to tune under graph capture). 128x128 tiles for prefill; for M <= 64 a 64-row tile (one
    Hopper warpgroup MMA), for M <= 16 a 16-row one; 64 columns where 128 would leave SMs idle. ``BK`` is clamped
    to the scale block by the caller. Not yet measured: ``scripts/bench_fp8_gemm.py --sweep`` times the
    alternatives."""
    bm = 16 if m <= 16 else 64 if m <= 64 else 128
    bn = 128
    if triton.cdiv(m, bm) * triton.cdiv(n, bn) < sm_count:
        bn = 64
    return {"BM": bm, "BN": bn, "BK": 128, "GROUP_M": 8, "num_warps": 8 if bm * bn >= 128 * 128 else 4,
            "num_stages": 4 if bm * bn >= 128 * 128 else 3}


def fp8_block_gemm(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                   cfg: dict | None = None, pow2: bool = False, out_dtype=torch.bfloat16) -> torch.Tensor:
    """``y [M, N] = x2 [M, K] @ W.T`` on FP8 tensor cores, W = ``weight * scale_inv`` per ``block``.

    Two launches: :func:`quantize_fp8_groups` (E4M3 per token and ``block[1]`` columns), then
    ``_fp8_block_gemm``: per K block of ``block[1]`` columns a fresh FP8 x FP8 MMA product (float32 accumulate),
    scaled by ``sx[m, kb] * scale_inv[n // block[0], kb]`` and added in float32; output ``out_dtype``. The
    DeepSeek-V3 fine-grained FP8 GEMM (arXiv 2412.19437 sec. 3.3). No ``2*N*K`` temporary: only ``M*K`` bytes of
    E4M3 activations and ``4*M*ceil(K/128)`` of scales. Tails of M, N and K (e.g. N = 576) are masked.

    Args:
        x2: activations ``[M, K]`` (any float dtype; quantised on the fly).
        weight: E4M3 ``[N, K]``; scale_inv: float32 ``[ceil(N/bn), ceil(K/bk)]``, contiguous.
        cfg: launch config (:func:`gemm_config` by default).
    Raises:
        BackendError: mismatched shapes/dtypes, a scale grid that does not fit, or a K block < 32 / not 2^i.
    """
    _check_block_gemm(x2, weight, scale_inv, block)
    m, k = x2.shape
    n = weight.shape[0]
    dev = x2.device
    if cfg is None:
        cfg = gemm_config(m, n, k, sm_count(dev) if dev.type == "cuda" else 132)
    sbn, sbk = block
    bk = min(cfg["BK"], sbk)
    q, sx = quantize_fp8_groups(x2, sbk, pow2)
    out = torch.empty(m, n, dtype=out_dtype, device=dev)
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    _fp8_block_gemm[grid](q, sx, weight, scale_inv, out, m, n, k, scale_inv.shape[1], SBN=sbn, SBK=sbk,
                          BM=cfg["BM"], BN=cfg["BN"], BK=bk, GROUP_M=cfg["GROUP_M"], EVEN_K=(k % bk == 0),
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


_SCALED_MM: dict = {}        # device -> ((api, padded) or None, reason or None)


def _cuda_dev(dev) -> torch.device:
    dev = torch.device(dev)
    return torch.device("cuda", torch.cuda.current_device()) if dev.index is None else dev


def _weight_scale_layout(scale_inv: torch.Tensor, padded: bool) -> torch.Tensor:
    """The ``[ceil(N/128), ceil(K/128)]`` grid transposed for ``mat2 = W.T``; ``padded``: each column of the
    transposed grid (a weight block row) padded to a multiple of 4 scales (16 bytes), the layout the explicit
    recipe API (``F.scaled_mm``) of torch 2.13 checks for; ``torch._scaled_mm`` there wants it unpadded."""
    if not padded:
        return scale_inv.t()
    nb, kb = scale_inv.shape
    pad = torch.zeros(nb, -(-kb // 4) * 4, dtype=torch.float32, device=scale_inv.device)
    pad[:, :kb] = scale_inv
    return pad.t()


def scaled_mm_weight_scale(scale_inv: torch.Tensor) -> torch.Tensor:
    """The weight scales laid out as the block-wise ``_scaled_mm`` variant that :func:`scaled_mm_available`
    found on the scale's device takes them (computed once at bind time). Raises BackendError where there is none."""
    why = scaled_mm_available(scale_inv.device)
    if why:
        raise BackendError(f"linear[triton]: prefill 'scaled_mm': {why}")
    return _weight_scale_layout(scale_inv, _SCALED_MM[_cuda_dev(scale_inv.device)][0][1])


def _scaled_mm_call(api: str, q, sx, weight, scale_b, out_dtype=torch.bfloat16):
    if api == "F.scaled_mm":          # explicit recipes (torch >= 2.10)
        from torch.nn.functional import ScalingType, scaled_mm
        return scaled_mm(q, weight.t(), sx, ScalingType.BlockWise1x128, scale_b, ScalingType.BlockWise128x128,
                         output_dtype=out_dtype)
    return torch._scaled_mm(q, weight.t(), scale_a=sx, scale_b=scale_b, out_dtype=out_dtype)


def scaled_mm_available(dev, block=(128, 128)) -> str | None:
    """None when ``torch._scaled_mm`` runs the DeepSeek-V3 block recipe (activations 1x128, weights 128x128) on
    ``dev``, else the reason. It is a cuBLASLt feature of sm_90 with cuBLAS >= 12.9, and the scale layouts it
    checks differ between torch versions and APIs; rather than trust version numbers, the probe multiplies a
    small problem (N = 320, K = 640: partial edge blocks, 5 K blocks so padding to 4 matters) with each API this
    torch offers and both weight-scale layouts, and keeps the first that matches the float64 reference to 1e-2
    (a layout mistake is an O(1) error). Cached per device."""
    if tuple(block) != (128, 128):
        return f"cuBLAS block scaling is fixed at 128x128 weight blocks, got {tuple(block)}"
    why = cuda_only(dev) or _TRITON_ERR
    if why:
        return why
    dev = _cuda_dev(dev)
    if dev in _SCALED_MM:
        return _SCALED_MM[dev][1]
    from bytebound.quant import fp8_block_matmul_ref, quantize_fp8_block
    g = torch.Generator(device=dev).manual_seed(0)
    wq, ws = quantize_fp8_block(torch.randn(320, 640, device=dev, generator=g) * 0.05)
    q, sx = quantize_fp8_groups(torch.randn(48, 640, device=dev, generator=g).to(torch.bfloat16))
    ref = fp8_block_matmul_ref(q, sx, wq, ws)
    reasons = []
    apis = (["F.scaled_mm"] if hasattr(F, "ScalingType") and hasattr(F, "scaled_mm") else []) + ["torch._scaled_mm"]
    for variant in [(api, padded) for api in apis for padded in (True, False)]:
        name = f"{variant[0]} ({'padded' if variant[1] else 'unpadded'} weight scales)"
        try:
            y = _scaled_mm_call(variant[0], q, sx, wq, _weight_scale_layout(ws, variant[1]))
            err = float((y.double() - ref).norm() / ref.norm())
        except Exception as e:          # noqa: BLE001 - any refusal by the op is a reason, recorded
            reasons.append(f"{name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
            continue
        if err <= 1e-2:
            _SCALED_MM[dev] = (variant, None)
            return None
        reasons.append(f"{name}: rel err {err:.2e} vs the float64 reference")
    _SCALED_MM[dev] = (None, f"torch {torch.__version__} block-wise _scaled_mm unusable: " + "; ".join(reasons))
    return _SCALED_MM[dev][1]


def scaled_mm_variant(dev) -> str | None:
    """The API and weight-scale layout the probe chose on ``dev`` (for reports), None where there is none."""
    if scaled_mm_available(dev):
        return None
    api, padded = _SCALED_MM[_cuda_dev(dev)][0]
    return f"{api} ({'padded' if padded else 'unpadded'} weight scales)"


SCALED_MM_ROWS = 16        # block-scaled cuBLASLt calls get a row count padded to a multiple of this


def scaled_mm_block_gemm(x2: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor, block=(128, 128),
                         out_dtype=torch.bfloat16) -> torch.Tensor:
    """``y [M, N] = x2 @ W.T`` through cuBLASLt's FP8 block scaling (``torch._scaled_mm``, DeepSeek-V3 recipe):
    :func:`quantize_fp8_groups` (1x128), then one cuBLAS call. ``scale_b``: ``scaled_mm_weight_scale(scale_inv)``.

    Raises:
        BackendError: the probe :func:`scaled_mm_available` failed on this device (the message says why).
    """
    why = scaled_mm_available(x2.device, block)
    if why:
        raise BackendError(f"linear[triton]: prefill 'scaled_mm': {why}")
    m = x2.shape[0]
    # cuBLASLt finds no block-scaled algorithm for row counts off a multiple of 16 (M = 5 on the H200 with
    # torch 2.11: CUBLAS_STATUS_NOT_SUPPORTED): pad with zero rows, whose products are zero, and drop them
    pad = -m % SCALED_MM_ROWS
    q, sx = quantize_fp8_groups(torch.nn.functional.pad(x2, (0, 0, 0, pad)) if pad else x2, 128)
    y = _scaled_mm_call(_SCALED_MM[_cuda_dev(x2.device)][0][0], q, sx, weight, scale_b, out_dtype)
    return y[:m] if pad else y

def fp8_block_linear(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                     cfg: dict | None = None, prefill: str = "dequant", scale_b=None) -> torch.Tensor:
    """``x2 [M, K]`` BF16 -> ``[M, N]`` in x's dtype; GEMV for M <= 4, else the ``prefill`` path (one of
    :data:`PREFILL_PATHS`: ``dequant`` = dequantise + cuBLAS, ``fp8`` = :func:`fp8_block_gemm`, ``scaled_mm`` =
    :func:`scaled_mm_block_gemm` with ``scale_b`` from :func:`scaled_mm_weight_scale`). ``cfg`` is the GEMV's
    launch config for M <= 4 and the GEMM's for ``fp8``."""
    if x2.shape[0] <= MAX_M:
        return fp8_block_gemv(x2, weight, scale_inv, block, cfg)
    if prefill == "fp8":
        return fp8_block_gemm(x2, weight, scale_inv, block, cfg)
    if prefill == "scaled_mm":
        return scaled_mm_block_gemm(x2, weight, scale_b if scale_b is not None else
                                    scaled_mm_weight_scale(scale_inv), block)
    if prefill != "dequant":
        raise BackendError(f"linear[triton]: prefill path {prefill!r} is not one of {PREFILL_PATHS}")
    return F.linear(x2, dequantize_fp8_block_gpu(weight, scale_inv, block))


def dequantize_fp8_block_gpu(weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """BF16 ``weight * scale_inv`` (per block) in one Triton kernel: ``2*N*K`` bytes, freed by the caller."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=weight.device)
    grid = (triton.cdiv(n, 64), triton.cdiv(k, 128))
    _fp8_dequant_block[grid](weight, scale_inv, out, n, k, scale_inv.shape[1], BN=64, BK=128, SBN=block[0],
                             SBK=block[1], num_warps=4)
    return out


HEAD_CONFIG = {"BN": 128, "BK": 128, "num_warps": 4, "num_stages": 4}     # the FP8 head kernels' launch config


def _quant_tokens(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2 [M, K]`` -> ``(q [M, K] E4M3, sx [M] float32)``: the head's per-token quantisation, one program per
    token (``_fp8_quant_rows``)."""
    m, k = x2.shape
    x2 = x2.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x2.device)
    sx = torch.empty(m, dtype=torch.float32, device=x2.device)
    _fp8_quant_rows[(m,)](x2, q, sx, K=k, BK=1024, num_warps=4)
    return q, sx


def fp8_head_logits(x2: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, cfg: dict | None = None
                    ) -> torch.Tensor:
    """``x2 [M<=4, K]`` -> float32 logits ``[M, V]``: per-token E4M3 quantisation (one small kernel), then the
    FP8 x FP8 product on tensor cores with float32 accumulation, scaled by ``sx[m] * w_scale[v]``."""
    m, k = x2.shape
    n = w_fp8.shape[0]
    cfg = cfg or HEAD_CONFIG
    q, sx = _quant_tokens(x2)
    out = torch.empty(m, n, dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(n, cfg["BN"]),)
    _fp8_head_dot[grid](q, sx, w_fp8, w_scale, out, n, K=k, M=m, BN=cfg["BN"], BK=cfg["BK"],
                        EVEN_N=(n % cfg["BN"] == 0), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def fp8_head_argmax(x2: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, cfg: dict | None = None,
                    index_map: torch.Tensor | None = None) -> torch.Tensor:
    """``x2 [M<=4, K]`` BF16 -> ``ids [M]`` int64, the argmax over the vocabulary of :func:`fp8_head_logits`' logits
    (the same per-token quantisation and the same float32 values, torch's tie rule: the lowest id), with the
    reduction inside the head kernel (``_fp8_head_argmax``): the logits are never written and no separate argmax
    launch reads them back. ``index_map [V]`` int64 (optional): return ``index_map[argmax]`` instead, the
    vocabulary id of the winning row when ``w_fp8`` is a row subset of the head (the hot-vocabulary draft head),
    with no gather launch after it. The partial keys and the ticket are per-device scratch (``kernels.scratch``), so calls
    on one device must not overlap (one stream, as the engine runs).

    Raises:
        BackendError: M outside 1..:data:`MAX_M`, an x width other than the weight's, or an index map that is not
            int64 of V elements."""
    m, k = x2.shape
    n = w_fp8.shape[0]
    if index_map is not None and (index_map.dtype != torch.int64 or index_map.numel() != n):
        raise BackendError(f"lm_head[triton]: the fused argmax's index map must be int64 [{n}], got "
                           f"{index_map.dtype} [{index_map.numel()}]")
    if not 0 < m <= MAX_M or w_fp8.shape[1] != k:
        raise BackendError(f"lm_head[triton]: the fused argmax takes [1..{MAX_M}, K] x [V, K], got {tuple(x2.shape)} "
                           f"and {tuple(w_fp8.shape)}")
    cfg = cfg or HEAD_CONFIG
    q, sx = _quant_tokens(x2)
    p = triton.cdiv(n, cfg["BN"])
    part = scratch(x2.device, "head_argmax_keys", MAX_M * p, torch.int64)
    cnt = scratch(x2.device, "head_argmax_ticket", 1, torch.int32)
    ids = torch.empty(m, dtype=torch.int64, device=x2.device)
    _fp8_head_argmax[(p,)](q, sx, w_fp8, w_scale, part, cnt, ids, ids if index_map is None else index_map, n, p,
                           K=k, M=m, MP=triton.next_power_of_2(m), BN=cfg["BN"], BK=cfg["BK"],
                           EVEN_N=(n % cfg["BN"] == 0), FENCE=os.environ.get("TRITON_INTERPRET") != "1", RB=512,
                           HAS_MAP=index_map is not None,
                           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return ids


@register("linear", "triton", available)
class TritonLinear:
    """FP8 block GEMV for M <= 4; for prefill (M > 4) the path ``prefill`` picks; plain weights go to ``F.linear``.

    Args:
        prefill: ``"dequant"`` (default: dequantise the weight to BF16, cuBLAS; the torch reference's maths),
            ``"fp8"`` (:func:`fp8_block_gemm`: 1x128 E4M3 activations x 128x128 weights on FP8 tensor cores) or
            ``"scaled_mm"`` (:func:`scaled_mm_block_gemm`, cuBLASLt block scaling; needs 128x128 blocks and a
            torch/cuBLAS that passes :func:`scaled_mm_available`). The FP8 paths quantise the activations, so they
            are lossy like the FP8 head (E4M3 rounding, ~2-3 % relative per element).
    Raises:
        BackendError: an unknown ``prefill`` (here), or at bind a path this weight/device cannot take.
    """
    name = "triton"

    def __init__(self, prefill: str = "dequant"):
        if prefill not in PREFILL_PATHS:
            raise BackendError(f"linear[triton]: prefill must be one of {PREFILL_PATHS}, got {prefill!r}")
        self.prefill = prefill

    def bind(self, lin, dtype):
        if lin.fmt == "plain":
            w = lin.weight.detach().to(dtype)
            return lambda x: F.linear(x, w)
        if lin.fmt != "fp8":
            raise BackendError(f"linear[triton]: unsupported fmt {lin.fmt!r}")
        if lin.weight.device.type != "cuda":
            raise BackendError("linear[triton] needs the weight on a CUDA device")
        weight, scale = lin.weight.detach().contiguous(), lin.weight_scale_inv.detach().float().contiguous()
        block = tuple(lin.block)
        prefill, scale_b = self.prefill, None
        if prefill == "fp8":
            _check_block_gemm(weight[:1], weight, scale, block)
        elif prefill == "scaled_mm":
            why = scaled_mm_available(weight.device, block)
            if why is None and (weight.shape[0] % 16 or weight.shape[1] % 16):
                why = f"cuBLAS FP8 needs N and K divisible by 16, got weight {tuple(weight.shape)}"
            if why:
                raise BackendError(f"linear[triton]: prefill 'scaled_mm' unusable: {why}")
            scale_b = scaled_mm_weight_scale(scale)
        # the GEMV's configs per M, fixed at bind (no lookup per call), and its split-K scratch grown now
        cfgs, paths = gemv_bind_configs(weight.shape[0], weight.shape[1], weight.device, block)
        gemv_reserve(weight.device, weight.shape[0], weight.shape[1], block, cfgs)

        def fn(x):
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            if x2.dtype != torch.bfloat16:
                x2 = x2.to(torch.bfloat16)
            m = x2.shape[0]
            y = (fp8_block_gemv(x2, weight, scale, block, cfgs[m]) if 0 < m <= MAX_M else
                 fp8_block_linear(x2, weight, scale, block, prefill=prefill, scale_b=scale_b))
            return y.to(x.dtype).view(*shape[:-1], y.shape[-1])
        def add_norm(delta, h, norm_weight, eps):
            """``(y, x, h_new)`` of :func:`fp8_block_gemv_add_norm` for ``delta, h [..., K]`` BF16 with M = 1..4
            rows whose config is the MMA path; None for any other call, or with the fold off
            (:func:`norm_fold_enabled`; the caller runs the norm, then ``fn``)."""
            m = h.numel() // h.shape[-1] if h.dim() else 0
            if (not 0 < m <= MAX_M or not cfgs[m].get("MMA") or h.dtype != torch.bfloat16 or
                    delta.dtype != torch.bfloat16 or delta.shape != h.shape or not norm_fold_enabled()):
                return None
            y, x, hn = fp8_block_gemv_add_norm(delta.reshape(m, -1), h.reshape(m, -1), norm_weight, eps, weight,
                                               scale, cfgs[m])
            return y.view(*h.shape[:-1], y.shape[-1]), x.view(h.shape), hn.view(h.shape)
        fn.add_norm = add_norm if block == (128, 128) else None
        fn.max_tokens = MAX_M       # the GEMV's width; more tokens dequantise the weight (read by bind_model)
        # which GEMV kernel each M runs and why (runner.backends puts it in the manifest's linear lever)
        fn.gemv_shape, fn.gemv_paths = tuple(weight.shape), paths
        return fn


@register("lm_head", "triton", available)
class TritonLMHead:
    """FP8 per-channel head GEMV for M <= 4 (float32 logits); other modes/sizes use the torch reference."""
    name = "triton"

    def bind(self, head, dtype):
        from bytebound.kernels.torch_ref import lm_head_reference

        def fn(x):
            if head.mode == "fp8" and x.shape[0] <= MAX_M and x.is_cuda:
                xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
                return fp8_head_logits(xb, head.w_fp8, head.w_scale)
            return lm_head_reference(head, x)
        subset = hasattr(head, "ids")      # a row subset of the head (the hot-vocabulary draft head)

        def argmax(x, index_map=None):
            """``ids [M]`` int64 of :func:`fp8_head_argmax` (``index_map``: its map) for the FP8 head at M <= 4 on
            CUDA (the argmax inside the head kernel); None for any other call, which then takes ``fn`` and torch's
            argmax."""
            if head.mode == "fp8" and 0 < x.shape[0] <= MAX_M and x.is_cuda and argmax_fused_enabled(subset):
                return fp8_head_argmax(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16), head.w_fp8,
                                       head.w_scale, index_map=index_map)
            return None
        # the FP8 head GEMV's width (bind_model reads it; the bf16/fp32 paths are cuBLAS at any M)
        fn.max_tokens = MAX_M if head.mode == "fp8" else None
        fn.argmax = argmax
        return fn


def argmax_fused_enabled(subset: bool) -> bool:
    """Whether :func:`fp8_head_argmax` serves a greedy token of the full head (``subset`` False) or of a row subset
    of it (True: the hot-vocabulary draft head). ``BYTEBOUND_HEAD_ARGMAX``: ``draft`` (the default) the row subsets
    only, ``1`` both, ``0`` neither (the head's logits and torch's argmax, two more launches; the same ids). The
    default follows the measurements (docs/perf/README.md, twentieth session): on the full head's plain greedy step
    the fused kernel was slower than the head GEMV + torch's argmax, while the MTP round with only the draft heads
    fused was as fast as with every head fused. An A/B switch read at each call, so a graph captured after a change
    sees it."""
    v = os.environ.get("BYTEBOUND_HEAD_ARGMAX", "draft")
    return v == "1" or (v == "draft" and subset)
