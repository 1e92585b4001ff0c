"""Gated-MLA decode/verify (M <= ``layers.mla.ABSORB_MAX_T`` new tokens) in three Triton kernels.

The torch reference (``GatedMLA._absorbed_attn``) runs the absorbed form as float32 einsums plus about twenty
glue ops per layer. This backend runs the same maths (DeepSeek-V2 arXiv 2405.04434 section 2.1.2, FlashMLA's
latent-space decode) in three launches between the layer's projections (q_proj | kv_a_proj_with_mqa | g_proj
before, bound by ``runner.backends.bind_model`` as one FP8 GEMV whose output columns ``q``, ``ckv`` and ``g`` are
strided views; dense after), so a decode/verify layer is five launches after its input norm:

1. ``_mla_prep``, two roles in one grid. Per new token: kv_a RMSNorm of the latent (float32 statistics, rounded
   where ``layers.norm.RMSNorm`` rounds), interleaved RoPE/YaRN of k_pe (cos/sin computed in-kernel from
   ``inv_freq`` and the position, as ``Rope.cos_sin``), the write of ``[latent | rope(k_pe)]`` into the 576-wide
   cache at the token's position, and RoPE of every head's q_pe. Per (head, 128 latent columns): the q
   absorption ``q_lat[h] = q_nope[h] W_kc[h]`` for all new tokens (BF16 tensor cores, float32 accumulate, BF16
   out, as the reference's BF16 einsum).
2. ``_mla_attn_split``: flash-decoding over the latent cache. Program ``(split, row block, batch)``; a row is
   one (token, head) pair, so all heads of a token share one read of the cache (latent MLA is multi-query).
   Scores ``q_lat . latent + q_rope . k_rope`` on tensor cores (BF16 in, float32 accumulate), online softmax in
   float32 (exp2 with ``scale * log2 e`` folded in), causal mask ``key position <= query position`` per row, so
   the M verify tokens are causal among themselves. Each split writes its normalised partial output
   ``[rows, 512]`` float32 and its log2-sum-exp (FlashDecoding, Dao et al. 2023). Key blocks past the largest
   query position are masked off (no bytes move), so a static span larger than the sequence costs no reads; with
   ``skip_empty`` an empty split runs no key block and a row with no key in its split writes only its lse (-inf),
   not its partial output.
3. ``_mla_combine_kc`` (the default: one program per head, latent block and token, the row's partial products
   summed by its last program after a ticket; ``combine_kc`` false: ``_mla_combine_out``, one program per head,
   v block and token, the same bits): merges the splits per row (log-sum-exp weights; with ``skip_empty`` only the
   splits up to the one holding the row's position, whose partials were written), applies the head gate
   ``sigmoid(g_proj x)`` (a per-head scalar commutes with the v absorption), and multiplies by ``W_vc[h]^T``
   (float32 FMAs on the float32 latent output; BF16 weights), writing ``[B, M, H, v]`` in the layout ``dense``
   reads.

Static shapes: the span is the runner's static ``kv_len`` bucket (``kv.shape[1]`` when None), so the grid never
depends on the position and nothing syncs with the host: graph-capturable, and replay runs the same kernels as
eager. Rounding differs from the reference where BF16 tensor cores replace float32 einsums: the softmax
probabilities are rounded to BF16 before the product with the latents (as FlashAttention does).

Register budget (sm_90, compiled offline with Triton 3.6's ptxas, integer arguments specialised as a launch
specialises them): every default kernel is free of spills (the long-span attention of a verify, BM 32 and BN 64,
spilled 104 B with 4 warps: it runs 8); an unrolled loop over the latent chunks of the merge spills.

Shapes: any head count; ``kv_lora_rank``, qk_nope and rope widths powers of two >= 16 (Ling: 512 / 128 / 64), v
head dim a multiple of 16; BF16 model only. Trip counts are constexprs of the static span (key blocks per split, number
of splits): one compiled variant per (M, span bucket). CUDA with compute capability >= 8.0 (BF16 ``mma``).
Tested against the layer's torch path and a float64 expanded-form reference in Triton's interpreter
(tests/test_triton_mla.py; there ``tl.dot`` runs on the BF16 values widened to float32) and at Ling shapes on a
GPU (tests/gpu/test_mla_gpu.py). The CUDA default (``runner.plan.DEFAULTS_CUDA``); ``--backend mla=torch`` selects the
float32 torch reference.
"""

from __future__ import annotations

import json
import math
import os

import torch

from bytebound.errors import BackendError
from bytebound.kernels.device import sm_count
from bytebound.kernels.pdl import enabled as pdl_enabled
from bytebound.kernels.registry import cuda_only, needs_capability, optional_triton, register
from bytebound.kernels.scratch import scratch
from bytebound.layers.mla import ABSORB_MAX_T

triton, tl, _TRITON_ERR = optional_triton()      # None, None, reason on machines without Triton

LOG2E = 1.4426950408889634
# Triton's interpreter multiplies BF16 operands of tl.dot as their raw 16-bit patterns: there the products run on
# the same BF16 values widened to float32 (exact products, float32 sums, as the tensor cores do).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_DOT_F32 = _INTERPRET
# Tilings (``TritonMLA(cfg)`` overrides; chosen on the H200 from scripts/bench_mla.py --sweep and an in-model A/B of
# the captured step, docs/perf/decode-h200.md): BM query rows and BN keys per attention block, split sizing
# (split_plan: ``target_single`` "half" halves the default program target when all query rows fit one block, as at
# M = 1); for a span of at most SHORT_SPAN slots SHORT_CFG replaces the long-context keys (more, shorter splits;
# merge order: resolve_cfg); absorb_BC latent columns per q-absorption program, combine_BV v columns / combine_BK
# latent columns per merge step / combine_SB splits per load;
# pdl: each of the three kernels enters through kernels.pdl.enter (launched as a PDL dependent on sm_90+);
# prefetch (opt-in, with pdl and combine_kc False): the merge prefetches its W_vc block into L2 before its PDL wait
# (_mla_combine_out's PF). Off by default: no gain in the captured step on the H100
# (docs/perf/session32-h100-kda-tail/).
# skip_empty (opt-in, BYTEBOUND_MLA_CFG='{"skip_empty": true}'): the splits past the sequence (a power-of-two span
# holds a sequence between half and all of it) run no key block, write no partial output and are not read by the
# merge: the same bits as running them (they weigh exactly 0). Off by default: neither of its two forms made the
# captured step faster on the H100 (docs/perf/session31-h200/, docs/perf/session32-h100-kda-tail/).
# decode_BM / decode_warps: the attention's BM / num_warps for a one-token call (resolve_cfg; None: BM /
# num_warps); combine_kc: the merge as _mla_combine_kc, parallel over latent blocks with a ticket (each partial and
# W_vc byte read once; False: _mla_combine_out); combine_pre (with combine_kc, where the v block is the whole v row,
# combine_BV >= v) loads the program's W_vc block before its PDL wait. These four measured faster together in the
# captured step on the H100 (docs/perf/session33-h100-mla-merge/). num_warps 8 (the long-span tiling, so a verify's:
# one-token calls take decode_warps): with 4 warps ptxas spilled that tiling (BM 32, BN 64) and the 4-token verify
# at 32K was slower in bench_mla and bench_decode on the H100 (docs/perf/session34/).
# rope_split (opt-in): the prep's q_pe rope in H programs of its own instead of the token program (_mla_prep QSPLIT;
# the same bits).
SHORT_SPAN = 4096
SHORT_CFG = {"BN": 32, "num_warps": 8, "min_split": 64, "target_single": None}
DEFAULT_CFG = {"BM": 32, "BN": 64, "num_warps": 8, "num_stages": 2, "min_split": 128, "target_programs": None,
               "target_single": "half",
               "split": None, "absorb_BC": 128, "combine_BV": 128, "combine_BK": 128, "combine_SB": 16,
               "combine_warps": 4, "pdl": True, "skip_empty": False, "prefetch": False, "combine_kc": True,
               "combine_pre": True, "decode_BM": 16, "decode_warps": 4, "rope_split": False}


def available(dev) -> str | None:
    return cuda_only(dev) or _TRITON_ERR or needs_capability(dev, 8, "bf16 mma")


if tl is not None:
    from bytebound.kernels.pdl import enter as pdl_enter, l2_prefetch as pdl_l2_prefetch, ticket as pdl_ticket

    @triton.jit
    def _dot(a, b, F32: tl.constexpr):
        if F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _rope_pairs(x1, x2, cos, sin, dt):
        """Interleaved (GPT-J) rotation of the pairs ``(x1, x2)`` (float32) by the angles whose amplitude-scaled
        ``cos`` / ``sin`` are given, each half rounded to ``dt`` (round to nearest even) as ``Rope.apply`` rounds."""
        return ((x1 * cos - x2 * sin).to(dt, fp_downcast_rounding="rtne"),
                (x2 * cos + x1 * sin).to(dt, fp_downcast_rounding="rtne"))

    @triton.jit
    def _mla_prep(ckv_ptr, q_ptr, qr_ptr, ql_ptr, wk_ptr, kv_ptr, pos_ptr, nw_ptr, inv_ptr, eps, att,
                  s_ckv_t, s_q_t, s_q_h, s_kv_b, s_kv_l, BT,
                  T: tl.constexpr, H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, NOPE: tl.constexpr,
                  HP: tl.constexpr, TP: tl.constexpr, BRC: tl.constexpr, DOT_F32: tl.constexpr,
                  PDL: tl.constexpr = False, NTH: tl.constexpr = 128, QSPLIT: tl.constexpr = False):
        """Two roles in one launch. Programs ``0 .. BT-1``, one per new token ``(b, t)``: kv_a norm + rope + cache
        write, and rope of the H q_pe heads. Programs ``BT + QN + h * (R / BRC) + c``: q absorption of head h,
        latent columns ``[c * BRC, +BRC)``, for all BT tokens (W_kc read once).

        ``QSPLIT`` (``cfg["rope_split"]``): the q_pe rope leaves the token programs for ``QN = H`` programs of their
        own, ``BT + h`` roping head h's q_pe of all BT tokens, so that the token program (the launch's tail in ncu)
        runs a shorter chain. The same operations on the same values: the same bits."""
        pdl_enter(PDL, NTH)
        pid = tl.program_id(0)
        QN: tl.constexpr = H if QSPLIT else 0
        if pid < BT:
            bt = pid.to(tl.int64)
            b = bt // T
            t = bt % T
            # Every load of this token's role is issued here, before the norm's reduction: none depends on another
            # (only the cache row's address and the angle need pos), and a load below the reduction's barrier would
            # start only after the latent's round trip (one program runs this role: its chain of round trips is the
            # launch's tail, the absorption programs beside it are done sooner).
            pos = tl.load(pos_ptr + t)
            r = tl.arange(0, R)
            x = tl.load(ckv_ptr + bt * s_ckv_t + r).to(tl.float32)
            w = tl.load(nw_ptr + r).to(tl.float32)
            i = tl.arange(0, P // 2)
            inv = tl.load(inv_ptr + i)
            k1 = tl.load(ckv_ptr + bt * s_ckv_t + R + 2 * i).to(tl.float32)
            k2 = tl.load(ckv_ptr + bt * s_ckv_t + R + 2 * i + 1).to(tl.float32)
            if not QSPLIT:
                h = tl.arange(0, HP)
                hm = h[:, None] < H
                qb = q_ptr + bt * s_q_t + h[:, None] * s_q_h + NOPE + 2 * i[None, :]
                q1 = tl.load(qb, mask=hm, other=0.0).to(tl.float32)
                q2 = tl.load(qb + 1, mask=hm, other=0.0).to(tl.float32)
            # kv_a RMSNorm, rounded as layers.norm.RMSNorm: dtype(w * dtype(x * rsqrt(mean(x^2) + eps)))
            inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / R + eps)
            dt = kv_ptr.dtype.element_ty
            lat = w * (x * inv_rms).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
            dst = kv_ptr + b * s_kv_b + pos * s_kv_l
            tl.store(dst + r, lat.to(dt, fp_downcast_rounding="rtne"))
            # interleaved (GPT-J) RoPE: pairs (x[2i], x[2i+1]) rotate by pos * inv_freq[i]; YaRN amplitude ``att``
            ang = pos.to(tl.float32) * inv
            cos = tl.cos(ang) * att
            sin = tl.sin(ang) * att
            kr1, kr2 = _rope_pairs(k1, k2, cos, sin, dt)
            tl.store(dst + R + 2 * i, kr1)
            tl.store(dst + R + 2 * i + 1, kr2)
            if not QSPLIT:
                # q_pe of all heads -> q_rope [B*T, H, P] (rounded to the model dtype like Rope.apply)
                ob = qr_ptr + (bt * H + h[:, None]) * P + 2 * i[None, :]
                qr1, qr2 = _rope_pairs(q1, q2, cos[None, :], sin[None, :], qr_ptr.dtype.element_ty)
                tl.store(ob, qr1, mask=hm)
                tl.store(ob + 1, qr2, mask=hm)
        elif pid < BT + QN:
            # QSPLIT: head hh's q_pe of every new token -> q_rope, as the token programs do it without QSPLIT
            hh = pid - BT
            rr = tl.arange(0, TP)
            rm = rr < BT
            pos = tl.load(pos_ptr + rr % T, mask=rm, other=0)
            i = tl.arange(0, P // 2)
            inv = tl.load(inv_ptr + i)
            qb = q_ptr + rr[:, None].to(tl.int64) * s_q_t + hh * s_q_h + NOPE + 2 * i[None, :]
            q1 = tl.load(qb, mask=rm[:, None], other=0.0).to(tl.float32)
            q2 = tl.load(qb + 1, mask=rm[:, None], other=0.0).to(tl.float32)
            ang = pos.to(tl.float32)[:, None] * inv[None, :]
            cos = tl.cos(ang) * att
            sin = tl.sin(ang) * att
            ob = qr_ptr + (rr[:, None].to(tl.int64) * H + hh) * P + 2 * i[None, :]
            qr1, qr2 = _rope_pairs(q1, q2, cos, sin, qr_ptr.dtype.element_ty)
            tl.store(ob, qr1, mask=rm[:, None])
            tl.store(ob + 1, qr2, mask=rm[:, None])
        else:
            # q_lat[h, bt, cols] = q_nope[bt, h, :] @ W_kc[h][:, cols]: BF16 in, float32 accumulate, BF16 out (the
            # reference's q_lat is a BF16 einsum too)
            j = pid - BT - QN
            hh = j // (R // BRC)
            c0 = (j % (R // BRC)) * BRC
            rr = tl.arange(0, TP)
            n = tl.arange(0, NOPE)
            cols = c0 + tl.arange(0, BRC)
            qn = tl.load(q_ptr + rr[:, None].to(tl.int64) * s_q_t + hh * s_q_h + n[None, :],
                         mask=rr[:, None] < BT, other=0.0)                               # [TP, NOPE]
            wk = tl.load(wk_ptr + hh * (NOPE * R) + n[:, None] * R + cols[None, :])      # [NOPE, BRC]
            ql = _dot(qn, wk, DOT_F32)
            tl.store(ql_ptr + (hh * BT + rr[:, None]) * R + cols[None, :],
                     ql.to(ql_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=rr[:, None] < BT)

    @triton.jit
    def _mla_attn_split(ql_ptr, qr_ptr, kv_ptr, pos_ptr, o_ptr, lse_ptr, qk_scale, L,
                        s_ql_h, s_ql_t, s_kv_b, s_kv_l, B,
                        T: tl.constexpr, H: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, DOT_F32: tl.constexpr,
                        SKIP: tl.constexpr = False, PDL: tl.constexpr = False, NTH: tl.constexpr = 128):
        """Program ``(split, row block, b)``: partial softmax(QK^T)V over keys ``[split * NT * BN, +NT * BN)``.

        ``SKIP``: a split with no key at or before any of its rows' positions (past the sequence in the static
        span) runs no key block, and a row without a key in the split stores only its lse (-inf), not its
        ``[R]`` partial output: the merge reads no partial of weight 0 (``_mla_combine_out``, same SKIP)."""
        pdl_enter(PDL, NTH)
        sp = tl.program_id(0)
        b = tl.program_id(2).to(tl.int64)
        rows = tl.program_id(1) * BM + tl.arange(0, BM)
        row_ok = rows < T * H
        t = rows // H
        h = rows % H
        qpos = tl.load(pos_ptr + t, mask=row_ok, other=-1)
        r = tl.arange(0, R)
        p = tl.arange(0, P)
        tok = b * T + t
        q = tl.load(ql_ptr + h[:, None] * s_ql_h + tok[:, None] * s_ql_t + r[None, :], mask=row_ok[:, None],
                    other=0.0)
        qp = tl.load(qr_ptr + (tok[:, None] * H + h[:, None]) * P + p[None, :], mask=row_ok[:, None], other=0.0)
        start = sp * (NT * BN)
        # keys past the last query position are masked for every row: their loads are masked off (no bytes
        # move). The trip count is NT key blocks per split, fixed by the static span (0 for an empty split with
        # SKIP).
        end = tl.minimum(tl.minimum(start + NT * BN, L), tl.max(qpos, axis=0) + 1)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, R], tl.float32)
        kvb = kv_ptr + b * s_kv_b
        # SKIP: a split with no valid key runs no block; a partly valid one runs all NT (its masked blocks move no
        # bytes and leave m_i, l_i and acc bit for bit unchanged: alpha = 1, no probability mass). Trimming those
        # too (a trip count per split) made ptxas spill more in the long-span tiling.
        nt = NT
        if SKIP:
            nt = nt * (start < end)
        for i in range(nt):
            offs = start + i * BN + tl.arange(0, BN)
            kmask = offs < end
            lat = tl.load(kvb + offs[:, None] * s_kv_l + r[None, :], mask=kmask[:, None], other=0.0)
            kp = tl.load(kvb + offs[:, None] * s_kv_l + R + p[None, :], mask=kmask[:, None], other=0.0)
            s = _dot(q, tl.trans(lat), DOT_F32) + _dot(qp, tl.trans(kp), DOT_F32)
            s = s * qk_scale
            valid = (offs[None, :] <= qpos[:, None]) & kmask[None, :]
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row with no key yet: no NaN
            alpha = tl.exp2(m_i - m_use)
            pr = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            acc = acc * alpha[:, None] + _dot(pr.to(lat.dtype), lat, DOT_F32)
            m_i = m_new
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        prow = (sp * B + b) * (T * H) + rows
        o_ok = row_ok & has if SKIP else row_ok
        tl.store(o_ptr + prow[:, None] * R + r[None, :], o, mask=o_ok[:, None])
        tl.store(lse_ptr + prow, lse, mask=row_ok)

    @triton.jit
    def _merge_row(pos_ptr, h, SPLIT, T: tl.constexpr, H: tl.constexpr, NS: tl.constexpr, SKIP: tl.constexpr):
        """A merge program's row: ``(bt, b, row, ns)`` for token ``bt = b * T + t`` (program axis 2) and head ``h``;
        ``ns``: the splits to merge, NS, or with ``SKIP`` those up to the one holding the token's position (split
        length ``SPLIT``): the splits past it have no key for the row (lse -inf, weight 0)."""
        bt = tl.program_id(2).to(tl.int64)
        t = bt % T
        ns = tl.minimum(tl.load(pos_ptr + t) // SPLIT + 1, NS) if SKIP else NS
        return bt, bt // T, t * H + h, ns

    @triton.jit
    def _split_max(lse_ptr, b, row, ns, B, TH: tl.constexpr, NS: tl.constexpr, SB: tl.constexpr):
        """The largest log2-sum-exp of row ``row``'s splits ``< ns`` (0 when none has a key). The loops keep the
        constexpr bound NS (unrolled, their loads in flight together; a run-time bound ns made the merge slower in
        the captured step on the H100) and mask the splits past ns: no bytes move for them."""
        sb = tl.arange(0, SB)
        m = tl.full([SB], float("-inf"), tl.float32)
        for s0 in range(0, NS, SB):                  # elementwise running max over the chunks, then one max
            sm = (s0 + sb) < ns
            lse = tl.load(lse_ptr + ((s0 + sb).to(tl.int64) * B + b) * TH + row, mask=sm, other=float("-inf"))
            m = tl.maximum(m, lse)
        m_max = tl.max(m, axis=0)
        return tl.where(m_max == float("-inf"), 0.0, m_max)

    @triton.jit
    def _split_den(lse_ptr, b, row, ns, m_max, B, TH: tl.constexpr, NS: tl.constexpr, SB: tl.constexpr):
        """``sum_s 2^(lse_s - m_max)`` over row ``row``'s splits ``< ns``: the softmax denominator of the merge."""
        sb = tl.arange(0, SB)
        den = tl.zeros([SB], tl.float32)
        for s0 in range(0, NS, SB):
            sm = (s0 + sb) < ns
            lse = tl.load(lse_ptr + ((s0 + sb).to(tl.int64) * B + b) * TH + row, mask=sm, other=float("-inf"))
            den += tl.exp2(lse - m_max)
        return tl.sum(den, axis=0)

    @triton.jit
    def _split_merge(o_ptr, lse_ptr, b, row, ns, m_max, k0, B, TH: tl.constexpr, R: tl.constexpr,
                     NS: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr):
        """``sum_s 2^(lse_s - m_max) o_s[k0 : k0 + BK]`` over row ``row``'s splits ``< ns`` (float32 ``[BK]``,
        the un-normalised merged latent output of those columns)."""
        sb = tl.arange(0, SB)
        k = tl.arange(0, BK)
        acc = tl.zeros([BK], tl.float32)
        for s0 in range(0, NS, SB):
            sm = (s0 + sb) < ns
            prow = ((s0 + sb).to(tl.int64) * B + b) * TH + row
            wgt = tl.exp2(tl.load(lse_ptr + prow, mask=sm, other=float("-inf")) - m_max)
            o = tl.load(o_ptr + prow[:, None] * R + k0 + k[None, :], mask=sm[:, None], other=0.0)
            acc += tl.sum(wgt[:, None] * o, axis=0)
        return acc

    @triton.jit
    def _mla_combine_out(o_ptr, lse_ptr, g_ptr, wv_ptr, out_ptr, pos_ptr, B, s_g_t, s_out_t, SPLIT,
                         NS: tl.constexpr,
                         T: tl.constexpr, H: tl.constexpr, R: tl.constexpr, V: tl.constexpr,
                         BV: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, SKIP: tl.constexpr = False,
                         PDL: tl.constexpr = False, NTH: tl.constexpr = 128, PF: tl.constexpr = False):
        """Program ``(h, v block, b * T + t)``: merge the splits of row (t, h), gate, multiply by W_vc[h]^T.

        The latent output is built ``BK`` columns at a time and multiplied into that ``[BK, BV]`` block of W_vc
        (float32 FMAs: one row is too few for tensor cores). One row per program keeps the tiles small; the M
        verify rows of a head re-read its W_vc block, from L2. ``SKIP``: the splits past the one holding the row's
        position (split length ``SPLIT``) have no key for the row (lse -inf, weight exactly 0) and, with SKIP in
        ``_mla_attn_split``, no partial output written: their loads are masked off (no bytes move), which leaves
        every sum bit for bit as when they added exact zeros.

        ``PF`` (set only with ``PDL``; ``cfg["prefetch"]``): before its PDL entry (and so before waiting for the
        kernel before it), the program issues one L2 bulk prefetch of its ``[BV, R]`` block of W_vc (contiguous,
        static: no kernel writes it), so the weight loads of the latent-column loop below, which follow the
        partials' merge, hit L2 instead of starting cold in HBM."""
        h = tl.program_id(0)
        vb = tl.program_id(1)
        if PF:
            pdl_l2_prefetch(wv_ptr + h * (V * R) + vb * (BV * R), BV * R * 2, NTH)
        pdl_enter(PDL, NTH)
        bt, b, row, ns = _merge_row(pos_ptr, h, SPLIT, T, H, NS, SKIP)
        # pass 1, log2-sum-exp of the splits (lse only): the weight of split s is 2^(lse_s - m) / den
        m_max = _split_max(lse_ptr, b, row, ns, B, T * H, NS, SB)
        den_s = _split_den(lse_ptr, b, row, ns, m_max, B, T * H, NS, SB)
        gate = tl.sigmoid(tl.load(g_ptr + bt * s_g_t + h).to(tl.float32))
        scl = gate / tl.where(den_s > 0, den_s, 1.0)           # head gate folded into the normalisation
        v = vb * BV + tl.arange(0, BV)
        k = tl.arange(0, BK)
        y = tl.zeros([BV], tl.float32)
        # pass 2, per BK latent columns: weighted sum of the partials, times that block of W_vc^T
        for k0 in range(0, R, BK):             # a loop, not unrolled: unrolled copies spill registers
            acc = _split_merge(o_ptr, lse_ptr, b, row, ns, m_max, k0, B, T * H, R, NS, SB, BK)
            wv = tl.load(wv_ptr + h * (V * R) + v[None, :] * R + k0 + k[:, None]).to(tl.float32)  # [BK, BV]
            y += tl.sum(acc[:, None] * wv, axis=0)
        y = y * scl
        tl.store(out_ptr + bt * s_out_t + h * V + v, y.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"))


    @triton.jit
    def _mla_combine_kc(o_ptr, lse_ptr, g_ptr, wv_ptr, out_ptr, pos_ptr, y_ptr, tk_ptr, B, s_g_t, s_out_t, SPLIT,
                        NS: tl.constexpr,
                        T: tl.constexpr, H: tl.constexpr, R: tl.constexpr, V: tl.constexpr,
                        BV: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, SKIP: tl.constexpr = False,
                        PDL: tl.constexpr = False, NTH: tl.constexpr = 128, FENCE: tl.constexpr = True,
                        PRE: tl.constexpr = False):
        """``_mla_combine_out`` parallel over the latent columns (``cfg["combine_kc"]``). Program ``(h, latent
        block kc, b * T + t)`` merges the splits of row (t, h) over latent columns ``[kc * BK, +BK)`` only and
        multiplies them into that ``[V, BK]`` block of W_vc, writing a float32 partial ``y_kc [V]`` to ``y_ptr``;
        the last of the row's ``R / BK`` programs (an acq_rel ticket, ``kernels.pdl.ticket``) sums the partials in
        the order kc = 0, 1, ... and applies the gate. Each partial output and each W_vc byte is read
        by one program (``_mla_combine_out`` re-reads a row's partials for every v block) and a program's chain
        of dependent loads is one latent block long, not ``R / BK``. Every element's arithmetic is
        ``_mla_combine_out``'s with the same ``BK``, ``BV`` and ``SB``, in the same order (its y starts at 0 and
        adds the latent blocks in order), so the bits are too. Tickets: int32 ``[>= B * T * H]``, zero before the
        launch and reset by each row's last program.

        ``PRE`` (``cfg["combine_pre"]``, set where ``BV == V``): the program loads its ``[BK, V]`` W_vc block into
        registers before its PDL entry, so that HBM read overlaps the attention kernel still running (W_vc is
        static: no kernel writes it, so it may be read before the wait)."""
        h = tl.program_id(0)
        kc = tl.program_id(1)
        KC: tl.constexpr = R // BK
        k0 = kc * BK
        k = tl.arange(0, BK)
        if PRE:
            wpre = tl.load(wv_ptr + h * (V * R) + tl.arange(0, BV)[None, :] * R + k0 + k[:, None])
        pdl_enter(PDL, NTH)
        bt, b, row, ns = _merge_row(pos_ptr, h, SPLIT, T, H, NS, SKIP)
        m_max = _split_max(lse_ptr, b, row, ns, B, T * H, NS, SB)
        acc = _split_merge(o_ptr, lse_ptr, b, row, ns, m_max, k0, B, T * H, R, NS, SB, BK)
        yb = y_ptr + ((bt * H + h) * KC + kc) * V
        for v0 in range(0, V, BV):             # a loop, not unrolled (register budget, as the latent loop there)
            v = v0 + tl.arange(0, BV)
            if PRE:
                wv = wpre.to(tl.float32)
            else:
                wv = tl.load(wv_ptr + h * (V * R) + v[None, :] * R + k0 + k[:, None]).to(tl.float32)  # [BK, BV]
            tl.store(yb + v, tl.zeros([BV], tl.float32) + tl.sum(acc[:, None] * wv, axis=0))
        # every thread's partial stores are visible GPU-wide before the program takes its ticket (FENCE false only
        # in Triton's interpreter, which has no inline asm and runs the programs one by one)
        ticket = pdl_ticket(tk_ptr + bt * H + h, FENCE, NTH)
        if ticket == KC - 1:
            den_s = _split_den(lse_ptr, b, row, ns, m_max, B, T * H, NS, SB)
            gate = tl.sigmoid(tl.load(g_ptr + bt * s_g_t + h).to(tl.float32))
            scl = gate / tl.where(den_s > 0, den_s, 1.0)
            for u0 in tl.static_range(0, V, BV):
                u = u0 + tl.arange(0, BV)
                yr = y_ptr + (bt * H + h) * KC * V + u
                y = tl.zeros([BV], tl.float32)
                for c in tl.static_range(KC):    # .cg: the other programs' partials from L2, not a stale L1 line
                    y += tl.load(yr + c * V, cache_modifier=".cg")
                y = y * scl
                tl.store(out_ptr + bt * s_out_t + h * V + u, y.to(out_ptr.dtype.element_ty,
                                                                  fp_downcast_rounding="rtne"))
            tl.store(tk_ptr + bt * H + h, 0)      # self-contained launch: the next one finds 0 (graph replay)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def resolve_cfg(span: int, cfg: dict | None = None, tokens: int | None = None) -> dict:
    """The tiling of a call over ``span`` slots: :data:`DEFAULT_CFG`, then :data:`SHORT_CFG` when ``span <=
    SHORT_SPAN``, then ``cfg`` (``TritonMLA(cfg)``), then ``BYTEBOUND_MLA_CFG`` (a JSON object of overrides: a
    diagnostic for in-model A/B, e.g. ``profile_decode.py --ab``; read per call, so a re-captured graph picks it up).
    For a call of ``tokens == 1`` new token (a decode step) ``decode_BM`` / ``decode_warps``, where not None, then
    replace the attention's ``BM`` / ``num_warps``, unless ``cfg`` or ``BYTEBOUND_MLA_CFG`` names that key itself
    (an explicit tiling, as in a sweep, is what runs).

    Raises:
        BackendError: ``BYTEBOUND_MLA_CFG`` not a JSON object, or naming a key :data:`DEFAULT_CFG` does not have (a
            misspelt key would otherwise leave the A/B measuring the default).
    """
    env = os.environ.get("BYTEBOUND_MLA_CFG")
    over = {}
    if env:
        try:
            over = json.loads(env)
        except json.JSONDecodeError as e:
            raise BackendError(f"mla[triton]: BYTEBOUND_MLA_CFG is not JSON ({e}): {env!r}") from None
        if not isinstance(over, dict) or set(over) - set(DEFAULT_CFG):
            raise BackendError(f"mla[triton]: BYTEBOUND_MLA_CFG must be a JSON object with keys of DEFAULT_CFG "
                               f"({', '.join(DEFAULT_CFG)}), got {env!r}")
    out = {**DEFAULT_CFG, **(SHORT_CFG if span <= SHORT_SPAN else {}), **(cfg or {}), **over}
    if tokens == 1:
        explicit = set(cfg or {}) | set(over)
        for key, dk in (("BM", "decode_BM"), ("num_warps", "decode_warps")):
            if out[dk] is not None and key not in explicit:
                out[key] = out[dk]
    return out


def split_plan(span: int, rows: int, batch: int, cfg: dict, device) -> tuple[int, int, int]:
    """``(BM, split, n_splits)`` for a static span of ``span`` slots and ``rows = M * H`` query rows.

    Enough splits that ``batch * row blocks * splits`` reaches ``cfg["target_programs"]`` (default one program
    per SM, half that with ``cfg["target_single"] == "half"`` and a single row block; 1 on a CPU) so long contexts
    use the whole GPU, each split at least ``cfg["min_split"]`` keys (more
    splits cost partial outputs of ``rows * 2 KiB`` each, written and merged through L2) and a whole number of
    ``BN`` key blocks. ``cfg["split"]`` forces the split length (tests)."""
    bm = max(16, min(cfg["BM"], triton.next_power_of_2(rows)))
    bn = cfg["BN"]
    n_rb = -(-rows // bm)
    if cfg.get("split"):
        split = int(cfg["split"])
    else:
        target = cfg.get("target_programs")
        if target is None:
            target = sm_count(device) if torch.device(device).type == "cuda" else 1
            if n_rb == 1 and cfg.get("target_single") == "half":
                # one row block: fewer, longer splits halve the partial outputs the merge reads back, which
                # measured faster at 32K (docs/perf/decode-h200.md, run L)
                target = max(1, target // 2)
        per = max(1, target // max(1, batch * n_rb))
        split = max(-(-span // per), int(cfg.get("min_split") or bn))
    split = max(bn, -(-split // bn) * bn)
    return bm, split, -(-span // split)


def mla_decode(q: torch.Tensor, ckv: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
               kv_len: int | None, wkc: torch.Tensor, wvc: torch.Tensor, norm_w: torch.Tensor, eps: float,
               inv_freq: torch.Tensor, att: float, scale: float, cfg: dict | None = None) -> torch.Tensor:
    """Gated latent attention of ``T`` new tokens against the cache, writing their latents into it.

    Args:
        q: ``[B, T, H, nope + P]`` BF16 (q_proj output, rope part un-rotated). ckv: ``[B, T, R + P]`` BF16
            (kv_a_proj_with_mqa output, latent not yet normed). g: ``[B, T, H]`` (g_proj output, pre-sigmoid).
            Each may be a column slice of one fused projection's output (``GatedMLA.proj_spans``): only the last
            dim must be contiguous, B and T are read through their strides.
        positions: ``[T]`` int64 on the device, the tokens' cache slots (read on the device, no host sync, so
            not range-checked here: the runner keeps them below ``max_len``).
        kv: ``[B, max_len, R + P]`` BF16 latent cache (``MLAState.kv``), updated in place at ``positions``.
        kv_len: static span of slots attended (the runner's bucket), default ``max_len``; keys past each row's
            position are masked, so any span ``> positions[-1]`` gives the same result.
        wkc, wvc: ``[H, nope, R]`` and ``[H, v, R]`` BF16, contiguous (``GatedMLA.absorbed``).
        norm_w: ``[R]`` kv_a_layernorm weight; eps its epsilon. inv_freq: ``[P/2]`` float32 rope inverse
            frequencies, att the YaRN cos/sin amplitude (``Rope``). scale: softmax scale (``mla_softmax_scale``).
        cfg: tiling overrides of :data:`DEFAULT_CFG` (and of :data:`SHORT_CFG` at spans up to
            :data:`SHORT_SPAN`); ``BYTEBOUND_MLA_CFG`` overrides them in turn (:func:`resolve_cfg`).

    Returns:
        ``[B, T, H, v]`` BF16: ``sigmoid(g) * softmax(q.k * scale) V`` per head (the input of ``dense``).

    Raises:
        BackendError: Triton missing, a dtype other than BF16, or shapes this kernel does not take.
    """
    if _TRITON_ERR:
        raise BackendError(f"mla[triton]: {_TRITON_ERR}")
    span = kv.shape[1] if kv_len is None else int(kv_len)
    b, t, h, qd = q.shape
    cfg = resolve_cfg(span, cfg, t)
    _, nope, rank = wkc.shape
    vdim = wvc.shape[1]
    pdim = qd - nope
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16 or ckv.dtype != torch.bfloat16:
        raise BackendError(f"mla[triton] runs in bf16 (q {q.dtype}, cache {kv.dtype}, kv_a {ckv.dtype})")
    # tensor-core products need every dimension >= 16
    if not (_pow2(rank) and _pow2(pdim) and _pow2(nope) and min(rank, nope, pdim) >= 16 and vdim % 16 == 0):
        raise BackendError(f"mla[triton]: needs power-of-two kv_lora_rank, qk_nope and qk_rope dims >= 16 and "
                           f"v_head_dim % 16 == 0 (rank {rank}, nope {nope}, rope {pdim}, v {vdim})")
    if (ckv.shape != (b, t, rank + pdim) or kv.shape[0] != b or kv.shape[2] != rank + pdim
            or wkc.shape[0] != h or wvc.shape != (h, vdim, rank) or g.shape != (b, t, h)
            or positions.shape != (t,)):
        raise BackendError(f"mla[triton]: inconsistent shapes q {tuple(q.shape)}, kv_a {tuple(ckv.shape)}, "
                           f"cache {tuple(kv.shape)}, W_kc {tuple(wkc.shape)}, W_vc {tuple(wvc.shape)}, "
                           f"gate {tuple(g.shape)}, positions {tuple(positions.shape)}")
    if not 0 < span <= kv.shape[1]:
        raise BackendError(f"mla[triton]: span {span} outside the cache (1..{kv.shape[1]} slots)")
    if (q.stride(3) != 1 or ckv.stride(2) != 1 or kv.stride(2) != 1 or g.stride(2) != 1
            or not (wkc.is_contiguous() and wvc.is_contiguous())):
        raise BackendError("mla[triton]: the last dim of q, kv_a, gate and cache must be contiguous, and W_kc, "
                           "W_vc contiguous")
    q2, ckv2, g2 = q.reshape(b * t, h, qd), ckv.reshape(b * t, rank + pdim), g.reshape(b * t, h)
    dev = q.device
    pdl = pdl_enabled(dev) and bool(cfg.get("pdl", True))   # kernels.pdl: each kernel enters with launch/wait
    pk = {"launch_pdl": True} if pdl else {}
    q_rope = torch.empty(b * t, h, pdim, dtype=q.dtype, device=dev)
    q_lat = torch.empty(h, b * t, rank, dtype=q.dtype, device=dev)
    brc = min(cfg["absorb_BC"], rank)
    qsplit = bool(cfg["rope_split"])
    _mla_prep[(b * t + (h if qsplit else 0) + h * (rank // brc),)](
        ckv2, q2, q_rope, q_lat, wkc, kv, positions, norm_w, inv_freq, float(eps), float(att),
        ckv2.stride(0), q2.stride(0), q2.stride(1), kv.stride(0), kv.stride(1), b * t,
        T=t, H=h, R=rank, P=pdim, NOPE=nope, HP=triton.next_power_of_2(h),
        TP=max(16, triton.next_power_of_2(b * t)), BRC=brc, DOT_F32=_DOT_F32, PDL=pdl, NTH=128, QSPLIT=qsplit,
        num_warps=4, **pk)
    rows = t * h
    bm, split, ns = split_plan(span, rows, b, cfg, dev)
    skip = bool(cfg["skip_empty"])
    o_part = torch.empty(ns, b, rows, rank, dtype=torch.float32, device=dev)
    lse = torch.empty(ns, b, rows, dtype=torch.float32, device=dev)
    _mla_attn_split[(ns, -(-rows // bm), b)](
        q_lat, q_rope, kv, positions, o_part, lse, float(scale) * LOG2E, span,
        q_lat.stride(0), q_lat.stride(1), kv.stride(0), kv.stride(1), b,
        T=t, H=h, R=rank, P=pdim, BM=bm, BN=cfg["BN"], NT=split // cfg["BN"], DOT_F32=_DOT_F32, SKIP=skip,
        PDL=pdl, NTH=32 * cfg["num_warps"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pk)
    out = torch.empty(b, t, h, vdim, dtype=q.dtype, device=dev)
    bv = math.gcd(cfg["combine_BV"], vdim)          # a power of two dividing v (cfg values are powers of two)
    bk = min(cfg["combine_BK"], rank)
    if cfg["combine_kc"]:
        if cfg["prefetch"]:
            raise BackendError("mla[triton]: the W_vc prefetch is a switch of the per-v-block merge "
                               "(combine_kc false); combine_kc reads W_vc in [v, BK] column blocks")
        kc = rank // bk
        # sized for the widest call (ABSORB_MAX_T tokens) at the first one, so a wider call captured later into a
        # graph does not grow them inside the capture (kernels.scratch: allocation must precede capture)
        tmax = max(t, ABSORB_MAX_T)
        y = scratch(dev, "mla_y", b * tmax * h * kc * vdim)
        tickets = scratch(dev, "mla_tickets", b * tmax * h, torch.int32)
        pre = bool(cfg["combine_pre"]) and bv == vdim     # one [BK, v] register block (v narrower than BV)
        _mla_combine_kc[(h, kc, b * t)](o_part, lse, g2, wvc, out, positions, y, tickets, b, g2.stride(0),
                                        h * vdim, split, NS=ns, T=t, H=h, R=rank, V=vdim, BV=bv,
                                        SB=cfg["combine_SB"], BK=bk, SKIP=skip, PDL=pdl, PRE=pre,
                                        NTH=32 * cfg["combine_warps"], FENCE=not _INTERPRET,
                                        num_warps=cfg["combine_warps"], **pk)
        return out
    # the W_vc prefetch: a 16-byte aligned block (torch allocations are; BV * R * 2 bytes is a multiple of 16)
    pf = pdl and bool(cfg["prefetch"]) and wvc.data_ptr() % 16 == 0
    _mla_combine_out[(h, vdim // bv, b * t)](o_part, lse, g2, wvc, out, positions, b, g2.stride(0), h * vdim,
                                             split, NS=ns, T=t, H=h, R=rank, V=vdim, BV=bv, SB=cfg["combine_SB"],
                                             BK=bk, SKIP=skip, PDL=pdl, PF=pf,
                                             NTH=32 * cfg["combine_warps"], num_warps=cfg["combine_warps"], **pk)
    return out


@register("mla", "triton", available)
class TritonMLA:
    """Binds :func:`mla_decode` to a ``GatedMLA`` layer (``layer.attn_fn``) for decode/verify; prefill and the
    stateless forward keep the layer's torch code. ``cfg``: tiling overrides (:func:`resolve_cfg`)."""
    name = "triton"

    def __init__(self, cfg: dict | None = None):
        self.cfg = cfg

    def bind(self, layer, dtype):
        """Returns ``fn(q, ckv, g, positions, kv, kv_len) -> [B, T, H, v]`` (see :func:`mla_decode`).
        Raises BackendError for a model dtype other than BF16, or widths the kernels do not take (checked here,
        at load, with the same rule as :func:`mla_decode`)."""
        if dtype != torch.bfloat16:
            raise BackendError(f"mla[triton] runs in bf16, model dtype is {dtype}")
        rank, nope, pdim, vdim = layer.rank, layer.nope, layer.rope_dim, layer.vdim
        if not (_pow2(rank) and _pow2(pdim) and _pow2(nope) and min(rank, nope, pdim) >= 16 and vdim % 16 == 0):
            raise BackendError(f"mla[triton]: needs power-of-two kv_lora_rank, qk_nope and qk_rope dims >= 16 and "
                               f"v_head_dim % 16 == 0 (rank {rank}, nope {nope}, rope {pdim}, v {vdim})")
        wkc, wvc = (w.contiguous() for w in layer.absorbed(dtype))
        norm, rope, cfg = layer.kv_a_layernorm, layer.rope, self.cfg

        def fn(q, ckv, g, positions, kv, kv_len):
            return mla_decode(q, ckv, g, positions, kv, kv_len, wkc, wvc, norm.weight, norm.eps, rope.inv_freq,
                              rope.attention_factor, layer.scale, cfg)
        return fn
