"""Backend ``triton`` of op ``kda``: the whole KDA layer between its projections as ONE Triton kernel for decode and
verify (M <= :data:`MAX_TOKENS` tokens), fla-core's ``chunk_kda`` for prefill.

Per head, for each of the M tokens in order (``layers.kda``; Kimi Linear, arXiv 2510.26692, eq. 1;
``ling3-reference.md`` section 1.5), all in float32:

    x_t      = q|k|v projection output (pre-conv) of token t, window W = the conv state's last 3 inputs
    q, k, v  = SiLU(w0 W0 + w1 W1 + w2 W2 + w3 x_t)                  # depthwise conv, kernel 4; W <- (W1, W2, x_t)
    g        = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))      # safe gate (kda_ref.kda_gate),
               or -exp(A_log) * softplus(f + dt_bias)                 #   plain gate when lower_bound is None
    beta     = sigmoid(b)                                             # b_proj output
    q, k     = l2norm(q) * K^-0.5, l2norm(k)                          # x / sqrt(sum x^2 + 1e-6)
    S        = S * exp(g)[:, None];  S += k (beta (v - S^T k))^T      # delta rule on the fp32 state S [K, V]
    o_t      = RMSNorm_V(S^T q) * w * sigmoid(gate)                   # RMSNormGated, rounded once to o's dtype

The grid is ``(batch row x head, V_SPLIT)``: program ``(bh, j)`` holds columns ``j*V/V_SPLIT ..`` of that head's
state ``[K, V]`` in registers for all M tokens, so the state is read and written once per call, not once per token.
The delta rule is separable over V: column ``c`` of ``S`` needs only ``v_c`` and the key-side vectors, so with
``V_SPLIT > 1`` 2-16x more SMs stream the state and the history (at Ling's shape, 32 heads x 128, ``V_SPLIT = 1`` is
32 programs of 64 KB state each on a 132-SM part). Each program works in two phases: first the key side of all M
tokens (q/k conv + SiLU, L2 norms, gate) as 1-D vectors, written to its own float32 scratch (every program of a
head recomputes these 128-wide vectors: cheaper than a second sync); then, after a barrier, the value-side conv,
the delta rule and ``S^T q`` on its state slice. Both phases loop over the tokens as a software pipeline: token t+1's
inputs are loaded before token t's arithmetic and stores, so an M-token verify pays one L2 round trip per phase, not M
(the arithmetic, and so every rounding, is the same for M = 1 and M > 1). In the state's register layout every K-vector
is replicated over the lanes that hold different V columns, so building the ~20 key-side vectors there makes ptxas
spill; passing the three results (q, k, exp(g)) through the scratch keeps the state phase within the register file. With
a history request the kernel also writes, after each token i, the conv window to ``conv_hist[i]`` and the recurrent
state to ``rec_hist[i]`` (MTP verify: rollback to token i is a copy from, or an index into, those buffers; no Python
loop, no clones); each program writes its own columns (and a 1/V_SPLIT share of the q/k windows).

The gated RMSNorm needs the whole V row of ``o``. With ``V_SPLIT = 1`` the program applies it directly. Otherwise
each program stores its slice of the un-normalised ``o`` (float32) and its partial sum of squares per token into
its scratch, fences, and takes an acq_rel ticket of its (batch row, head); the last of the ``V_SPLIT`` programs to
arrive sums the partial sums in the fixed slice order ``j = 0..V_SPLIT-1``, normalises, applies the weight and
sigmoid(gate), stores the whole ``o`` row (all M tokens as one tile: one L2 round trip for an M-token verify),
writes the q/k conv windows back (only it may: every program reads the old windows in its first phase, and all
of them have passed the ticket) and resets the ticket (the pattern of
``triton_moe_split``'s KP slices). No float atomics, every sum in an order fixed by the launch shape: outputs are
bit-identical run to run and graph replay == eager. ``V_SPLIT`` and ``num_warps`` come from
``configs/triton_kda.json`` (:func:`resolve_launch`; written from ``scripts/bench_kda.py``'s sweep), else a default
that fills the SMs once.

PDL (sm_90, ``kernels.pdl.enabled``): the kernel is launched as a PDL dependent and first lets the next kernel
launch (``griddepcontrol.launch_dependents``), then waits for the kernel before it (``griddepcontrol.wait``) before
any load or store. With ``PF`` (``kernels.pdl.early("kda")``, opt-in through ``BYTEBOUND_PDL_PREFETCH``; only where
every prefetched address is 16-byte aligned) each program issues, between the two, L2 bulk prefetches of bytes no
kernel before it writes: its share of the head's recurrent state, of the b_proj row and of the conv weights and
windows (a hint: nothing is read into registers or written before the wait).

The wrapper :func:`fused_kda` allocates only its output ``o`` (the history buffers and, through :class:`FusedKDA`,
the scratch and the tickets are allocated once), makes no host sync and launches one kernel: it is CUDA-graph
capturable. The float32 rounding points are those of the torch path (``layers.kda`` with ``kda_ref``), so the
only rounding to the model dtype is the final store of ``o``. Tested against the layer's torch path, fla-core's
naive KDA and a float64 derivation in Triton's interpreter on CPU (tests/test_triton_kda.py) and at Ling's full
shape on the GPU (tests/gpu/test_kda_gpu.py).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from bytebound.errors import BackendError
from bytebound.kernels.device import sm_count
from bytebound.kernels.pdl import early as pdl_early, enabled as pdl_enabled
from bytebound.kernels.registry import cuda_only, optional_triton, register
from bytebound.kernels import scratch as shared

MAX_TOKENS = 8          # largest M of the fused kernel (MTP verify is k+1 = 4; 6-token chains fit)
TAIL_ROWS = 1 << (MAX_TOKENS - 1).bit_length()      # the V_SPLIT tail's token tile (MT): >= MAX_TOKENS, a power of 2
CONV_KERNEL = 4         # Ling's short_conv_kernel_size; the kernel keeps the 3-input window in registers
MAX_HEAD_DIM = 256      # K, V <= 256: the [K, V] float32 state of one head lives in one program's registers
V_SPLITS = (1, 2, 4, 8, 16)  # programs per (batch row, head), each holding V / V_SPLIT state columns
CONFIG_PATH = Path(__file__).resolve().parent / "configs" / "triton_kda.json"

triton, tl, _TRITON_ERR = optional_triton()      # None, None, reason on machines without Triton


if tl is not None:
    from bytebound.kernels.pdl import gdc as pdl_gdc, l2_prefetch as pdl_l2_prefetch, ticket as pdl_ticket

    @triton.jit
    def _store_window(ptr, ch, w0, w1, w2, mask):
        """Store a 3-input conv window (oldest first) of channels ``ch`` at ``ptr + ch * 3 + {0, 1, 2}``: the
        layout of the conv state and of its per-token history."""
        tl.store(ptr + ch * 3 + 0, w0, mask=mask)
        tl.store(ptr + ch * 3 + 1, w1, mask=mask)
        tl.store(ptr + ch * 3 + 2, w2, mask=mask)

    @triton.jit
    def _conv_silu_step(x, w0, w1, w2, c0, c1, c2, c3):
        """One causal depthwise-conv output (kernel 4) + SiLU: window (w0 oldest .. w2 newest) and input x."""
        y = c0 * w0 + c1 * w1 + c2 * w2 + c3 * x
        return y * tl.sigmoid(y)

    # M (tokens), HIST (per-token history stores) and SCR (scratch floats per program) are run-time arguments,
    # not specialised (Triton would otherwise fold M = 1 into a separate binary): one compiled kernel serves the
    # decode step and the MTP verify, so verify row t runs exactly the decode step's instructions on the same
    # inputs and rounds the same way, and the states the verify commits are the ones decode would have made.
    @triton.jit(do_not_specialize=["M", "HIST", "SCR"])
    def _fused_kda_kernel(
            qkv_ptr, s_qkv_b, s_qkv_t, f_ptr, s_f_b, s_f_t, gate_ptr, s_gate_b, s_gate_t, b_ptr, s_b_b, s_b_t,
            x_ptr, s_x_b, s_x_t, wb_ptr,
            convw_ptr, conv_ptr, alog_ptr, dtb_ptr, rec_ptr, normw_ptr, o_ptr, s_o_b, s_o_t,
            conv_hist_ptr, rec_hist_ptr, scratch_ptr, ticket_ptr, lower_bound, eps, scale,
            B, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            M, SAFE_GATE: tl.constexpr, HIST, VS: tl.constexpr, SCR,
            FENCE: tl.constexpr, BETA_X: tl.constexpr = False, HID: tl.constexpr = 1, HB: tl.constexpr = 1,
            PDL: tl.constexpr = False, NTH: tl.constexpr = 128, PF: tl.constexpr = False,
            MT: tl.constexpr = TAIL_ROWS):
        pid = tl.program_id(0)          # batch row x head
        if VS == 1:
            vs = 0                      # a constant: the unsplit kernel's addressing stays as simple as before
        else:
            vs = tl.program_id(1)       # V slice: state columns vs*BVS .. vs*BVS + BVS - 1
        bi = (pid // H).to(tl.int64)
        h = pid % H
        DQK: tl.constexpr = H * K
        C: tl.constexpr = 2 * H * K + H * V          # conv channels q|k|v
        BVS: tl.constexpr = BV // VS
        conv_b = conv_ptr + bi * C * 3
        if PDL:
            pdl_gdc("griddepcontrol.launch_dependents; mov.u32 $0, 0;", NTH)
            if PF:
                # Bytes no kernel before this one writes (the weights, and this layer's own state, last written by
                # this kernel in an earlier step or by ordinary torch copies, which no PDL kernel can overtake)
                # stream into L2 while the projection GEMV still runs; the launch sets PF only where every address
                # below is 16-byte aligned. This program's share: 1/VS of the head's recurrent state, and of the
                # b_proj row; its value-side conv weights and windows; the head's q/k ones from program 0.
                SB: tl.constexpr = K * V * 4 // VS
                pdl_l2_prefetch(rec_ptr + (bi * H + h) * K * V + vs * (SB // 4), SB, NTH)
                if BETA_X:
                    WB: tl.constexpr = (HID * 2 // VS) // 16 * 16
                    pdl_l2_prefetch(wb_ptr + h * HID + vs * (WB // 2), WB, NTH)     # (2-byte weights)
                pdl_l2_prefetch(convw_ptr + (2 * DQK + h * V + vs * BVS) * 4, BVS * 16, NTH)
                pdl_l2_prefetch(conv_b + (2 * DQK + h * V + vs * BVS) * 3, BVS * 12, NTH)
                if vs == 0:
                    pdl_l2_prefetch(convw_ptr + h * K * 4, K * 16, NTH)
                    pdl_l2_prefetch(convw_ptr + (DQK + h * K) * 4, K * 16, NTH)
                    pdl_l2_prefetch(conv_b + h * K * 3, K * 12, NTH)
                    pdl_l2_prefetch(conv_b + (DQK + h * K) * 3, K * 12, NTH)
            pdl_gdc("griddepcontrol.wait; mov.u32 $0, 0;", NTH)     # nothing else is touched before it
        # This program's scratch (SCR floats): [M, 3, BK] l2-normalised scaled q, l2-normalised k, decay exp(g);
        # with BETA_X then [M] beta of the M tokens; with VS > 1 then, from offset PO, [M, BVS] its slice of the
        # un-normalised o and [M] its sums of squares.
        PB = M * 3 * BK
        if BETA_X:
            PO = PB + M
        else:
            PO = PB
        scr = scratch_ptr + (pid * VS + vs).to(tl.int64) * SCR
        # ---- phase 1: the key-side vectors of all M tokens (conv + SiLU, L2 norms, gate), 1-D over K ----
        # Kept apart from the [K, V] phase on purpose (module docstring): there a K-vector is replicated over the
        # lanes that hold different V columns, so building these ~20 vectors there spills registers.
        ck = tl.arange(0, BK)
        mk = ck < K
        if VS == 1:
            mown = mk
        else:
            mown = mk & ((ck * VS) // BK == vs)        # this program's share of the q/k history windows
        chq = h * K + ck
        chk = DQK + h * K + ck
        # conv weights [C, 4] and windows [C, 3] (oldest first), float32
        cq0 = tl.load(convw_ptr + chq * 4 + 0, mask=mk, other=0.0)
        cq1 = tl.load(convw_ptr + chq * 4 + 1, mask=mk, other=0.0)
        cq2 = tl.load(convw_ptr + chq * 4 + 2, mask=mk, other=0.0)
        cq3 = tl.load(convw_ptr + chq * 4 + 3, mask=mk, other=0.0)
        ck0 = tl.load(convw_ptr + chk * 4 + 0, mask=mk, other=0.0)
        ck1 = tl.load(convw_ptr + chk * 4 + 1, mask=mk, other=0.0)
        ck2 = tl.load(convw_ptr + chk * 4 + 2, mask=mk, other=0.0)
        ck3 = tl.load(convw_ptr + chk * 4 + 3, mask=mk, other=0.0)
        wq0 = tl.load(conv_b + chq * 3 + 0, mask=mk, other=0.0)
        wq1 = tl.load(conv_b + chq * 3 + 1, mask=mk, other=0.0)
        wq2 = tl.load(conv_b + chq * 3 + 2, mask=mk, other=0.0)
        wk0 = tl.load(conv_b + chk * 3 + 0, mask=mk, other=0.0)
        wk1 = tl.load(conv_b + chk * 3 + 1, mask=mk, other=0.0)
        wk2 = tl.load(conv_b + chk * 3 + 2, mask=mk, other=0.0)
        rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        dtb = tl.load(dtb_ptr + h * K + ck, mask=mk, other=0.0).to(tl.float32)
        if BETA_X:
            # beta = sigmoid(b_proj x) for this head, per token: the dot of the normed layer input x [M, HID] with
            # row h of the b_proj weight [H, HID], float32 sums, rounded to x's dtype as the torch path's
            # ``b_proj(x)`` output is before ``sigmoid(.float())`` (each of the head's VS programs computes it: 5 KB
            # at Ling's width, cheaper than passing beta between them). One 1-D [HB] dot per token, never an
            # [M, HB] tile: a 2-D tile's reduction tree depends on its shape, so token t's beta would round
            # differently in an M = 4 verify than in the M = 1 decode step; this way verify row t equals the
            # decode step of the same inputs bit for bit.
            cb = tl.arange(0, HB)
            mb = cb < HID
            wbv = tl.load(wb_ptr + h * HID + cb, mask=mb, other=0.0)
            xb_n = tl.load(x_ptr + bi * s_x_b + cb, mask=mb, other=0.0)
        # Software pipeline over the tokens: token t+1's inputs are loaded at the top of iteration t, before its
        # stores, so their L2 round trip overlaps token t's arithmetic (the loop is not unrolled and the compiler
        # may not move a load above a store it cannot prove disjoint). The arithmetic is unchanged.
        xrow = qkv_ptr + bi * s_qkv_b
        xq_n = tl.load(xrow + chq, mask=mk, other=0.0)
        xk_n = tl.load(xrow + chk, mask=mk, other=0.0)
        fx_n = tl.load(f_ptr + bi * s_f_b + h * K + ck, mask=mk, other=0.0)
        for t in range(M):
            xq = xq_n.to(tl.float32)
            xk = xk_n.to(tl.float32)
            fx = fx_n.to(tl.float32) + dtb
            more = t + 1 < M
            xrow = qkv_ptr + bi * s_qkv_b + (t + 1) * s_qkv_t
            xq_n = tl.load(xrow + chq, mask=mk & more, other=0.0)
            xk_n = tl.load(xrow + chk, mask=mk & more, other=0.0)
            fx_n = tl.load(f_ptr + bi * s_f_b + (t + 1) * s_f_t + h * K + ck, mask=mk & more, other=0.0)
            if BETA_X:
                xb = xb_n
                xb_n = tl.load(x_ptr + bi * s_x_b + (t + 1) * s_x_t + cb, mask=mb & more, other=0.0)
                bl = tl.sum(xb.to(tl.float32) * wbv.to(tl.float32), axis=0)
                bl = bl.to(x_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
                tl.store(scr + PB + t, tl.sigmoid(bl))
            q = _conv_silu_step(xq, wq0, wq1, wq2, cq0, cq1, cq2, cq3)
            k = _conv_silu_step(xk, wk0, wk1, wk2, ck0, ck1, ck2, ck3)
            wq0, wq1, wq2 = wq1, wq2, xq
            wk0, wk1, wk2 = wk1, wk2, xk
            # L2 norms (x / sqrt(sum x^2 + 1e-6), fla's form) and the K^-0.5 scale
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            # gate (kda_ref.kda_gate)
            if SAFE_GATE:
                g = lower_bound * tl.sigmoid(rate * fx)
            else:
                # softplus as torch computes it (threshold 20), in the overflow-free form for the rest
                sp = tl.maximum(fx, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(fx)))
                g = -rate * tl.where(fx > 20.0, fx, sp)
            tl.store(scr + (t * 3 + 0) * BK + ck, q, mask=mk)
            tl.store(scr + (t * 3 + 1) * BK + ck, k, mask=mk)
            tl.store(scr + (t * 3 + 2) * BK + ck, tl.exp(g), mask=mk)
            if HIST:
                hc = conv_hist_ptr + (t * B + bi) * C * 3
                _store_window(hc, chq, wq0, wq1, wq2, mown)
                _store_window(hc, chk, wk0, wk1, wk2, mown)
        if VS == 1:
            # with VS > 1 the last program of the head writes the q/k windows back (after the ticket, see below)
            _store_window(conv_b, chq, wq0, wq1, wq2, mk)
            _store_window(conv_b, chk, wk0, wk1, wk2, mk)
        tl.debug_barrier()          # phase 2 reads the scratch that other threads of this program wrote

        # ---- phase 2: value-side conv, the delta rule on this program's [K, BVS] state slice, S^T q ----
        rk = tl.arange(0, BK)
        rmk = rk < K
        cv = vs * BVS + tl.arange(0, BVS)
        mv = cv < V
        chv = 2 * DQK + h * V + cv
        cv0 = tl.load(convw_ptr + chv * 4 + 0, mask=mv, other=0.0)
        cv1 = tl.load(convw_ptr + chv * 4 + 1, mask=mv, other=0.0)
        cv2 = tl.load(convw_ptr + chv * 4 + 2, mask=mv, other=0.0)
        cv3 = tl.load(convw_ptr + chv * 4 + 3, mask=mv, other=0.0)
        wv0 = tl.load(conv_b + chv * 3 + 0, mask=mv, other=0.0)
        wv1 = tl.load(conv_b + chv * 3 + 1, mask=mv, other=0.0)
        wv2 = tl.load(conv_b + chv * 3 + 2, mask=mv, other=0.0)
        if VS == 1:
            nw = tl.load(normw_ptr + cv, mask=mv, other=0.0).to(tl.float32)
        m2 = rmk[:, None] & mv[None, :]
        soff = rk[:, None] * V + cv[None, :]
        rec_bh = rec_ptr + (bi * H + h) * K * V
        s = tl.load(rec_bh + soff, mask=m2, other=0.0)
        # the same software pipeline as phase 1: token t+1's inputs (value-side input, beta, the key-side vectors
        # from the scratch, the gate) are loaded before token t's delta rule and stores
        vrow = qkv_ptr + bi * s_qkv_b
        xv_n = tl.load(vrow + chv, mask=mv, other=0.0)
        if BETA_X:
            beta_n = tl.load(scr + PB)
        else:
            beta_n = tl.load(b_ptr + bi * s_b_b + h)
        eg_n = tl.load(scr + 2 * BK + rk, mask=rmk, other=0.0)
        k_n = tl.load(scr + BK + rk, mask=rmk, other=0.0)
        q_n = tl.load(scr + rk, mask=rmk, other=0.0)
        if VS == 1:
            gt_n = tl.load(gate_ptr + bi * s_gate_b + h * V + cv, mask=mv, other=0.0)
        for t in range(M):
            xv = xv_n.to(tl.float32)
            eg = eg_n
            k = k_n
            q = q_n
            if BETA_X:
                beta = beta_n
            else:
                beta = tl.sigmoid(beta_n.to(tl.float32))
            if VS == 1:
                gt = gt_n.to(tl.float32)
            more = t + 1 < M
            tn = t + 1
            xv_n = tl.load(vrow + tn * s_qkv_t + chv, mask=mv & more, other=0.0)
            if BETA_X:
                beta_n = tl.load(scr + PB + tn, mask=more, other=0.0)
            else:
                beta_n = tl.load(b_ptr + bi * s_b_b + tn * s_b_t + h, mask=more, other=0.0)
            eg_n = tl.load(scr + (tn * 3 + 2) * BK + rk, mask=rmk & more, other=0.0)
            k_n = tl.load(scr + (tn * 3 + 1) * BK + rk, mask=rmk & more, other=0.0)
            q_n = tl.load(scr + (tn * 3 + 0) * BK + rk, mask=rmk & more, other=0.0)
            if VS == 1:
                gt_n = tl.load(gate_ptr + bi * s_gate_b + tn * s_gate_t + h * V + cv, mask=mv & more, other=0.0)
            v = _conv_silu_step(xv, wv0, wv1, wv2, cv0, cv1, cv2, cv3)
            wv0, wv1, wv2 = wv1, wv2, xv
            # delta rule: decay each key channel, predict, rank-1 update (key-side vectors from phase 1)
            s = s * eg[:, None]
            pred = tl.sum(k[:, None] * s, axis=0)
            delta = (v - pred) * beta
            s = s + k[:, None] * delta[None, :]
            o = tl.sum(q[:, None] * s, axis=0)
            if VS == 1:
                # gated RMSNorm over V (RMSNormGated: float32 statistics, one rounding at the store)
                o = tl.where(mv, o, 0.0)
                o = o * tl.rsqrt(tl.sum(o * o, axis=0) / V + eps) * nw * tl.sigmoid(gt)
                tl.store(o_ptr + bi * s_o_b + t * s_o_t + h * V + cv,
                         o.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mv)
            else:
                # this slice of the un-normalised o and its sum of squares, for the head's last program
                o = tl.where(mv, o, 0.0)
                tl.store(scr + PO + t * BVS + tl.arange(0, BVS), o)
                tl.store(scr + PO + M * BVS + t, tl.sum(o * o, axis=0))
            if HIST:
                hc = conv_hist_ptr + (t * B + bi) * C * 3
                _store_window(hc, chv, wv0, wv1, wv2, mv)
                tl.store(rec_hist_ptr + ((t * B + bi) * H + h) * K * V + soff, s, mask=m2)
        tl.store(rec_bh + soff, s, mask=m2)
        _store_window(conv_b, chv, wv0, wv1, wv2, mv)

        if VS > 1:
            # ---- the head's last program: the gated RMSNorm over the whole V row (triton_moe_split's tickets) ----
            # every thread's scratch stores are visible GPU-wide before the CTA takes its ticket (FENCE: False only
            # in Triton's interpreter, which has no inline asm and runs the programs one by one)
            ticket = pdl_ticket(ticket_ptr, FENCE, NTH, pid)
            if ticket == VS - 1:
                # every program of the head has read the old q/k windows (phase 1, before its ticket)
                _store_window(conv_b, chq, wq0, wq1, wq2, mk)
                _store_window(conv_b, chk, wk0, wk1, wk2, mk)
                cf = tl.arange(0, BV)
                mf = cf < V
                # all M tokens as one [MT, BV] tile (rows >= M masked: no bytes move), so their loads make one L2
                # round trip, not one per token after the previous token's store; every element's arithmetic (the
                # slices' sum of squares in the order j = 0..VS-1, then rsqrt, weight and gate) is the per-token
                # form's, so the bits are too
                tt = tl.arange(0, MT)
                mt = tt < M
                m2f = mt[:, None] & mf[None, :]
                # slice j of the row lives in program (pid, j)'s scratch; .cg: read L2, not a stale L1 line
                part = scratch_ptr + (pid * VS + cf // BVS).to(tl.int64) * SCR + PO + cf % BVS
                head = scratch_ptr + (pid * VS).to(tl.int64) * SCR + PO + M * BVS
                nwf = tl.load(normw_ptr + cf, mask=mf, other=0.0).to(tl.float32)
                ss = tl.load(head + tt, mask=mt, other=0.0, cache_modifier=".cg")
                for j in tl.static_range(1, VS):
                    ss += tl.load(head + j * SCR + tt, mask=mt, other=0.0, cache_modifier=".cg")
                of = tl.load(part[None, :] + tt[:, None] * BVS, mask=m2f, other=0.0, cache_modifier=".cg")
                gt = tl.load(gate_ptr + bi * s_gate_b + tt[:, None] * s_gate_t + h * V + cf[None, :], mask=m2f,
                             other=0.0).to(tl.float32)
                of = of * tl.rsqrt(ss / V + eps)[:, None] * nwf[None, :] * tl.sigmoid(gt)
                tl.store(o_ptr + bi * s_o_b + tt[:, None] * s_o_t + h * V + cf[None, :],
                         of.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m2f)
                tl.store(ticket_ptr + pid, 0)       # self-contained launch: the next one finds 0 (graph replay)


def _rows(x: torch.Tensor, name: str, b: int, t: int, n: int) -> torch.Tensor:
    """``x [B, T, >= n]`` with unit channel stride (a column slice of the fused projection output is fine)."""
    if x.dim() != 3 or x.shape[0] != b or x.shape[1] != t or x.shape[2] != n:
        raise BackendError(f"kda[triton]: {name} must be [B={b}, T={t}, {n}], got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _f32_contig(x: torch.Tensor, name: str, shape: tuple) -> None:
    if tuple(x.shape) != shape or x.dtype != torch.float32 or not x.is_contiguous():
        raise BackendError(f"kda[triton]: {name} must be a contiguous float32 tensor of shape {shape}, got "
                           f"{x.dtype} {tuple(x.shape)}{'' if x.is_contiguous() else ' (not contiguous)'}")


def shape_key(batch: int, heads: int, dk: int, dv: int, tokens: int) -> str:
    """The launch-table key of a call: ``B{batch}_H{heads}_K{dk}_V{dv}_M{tokens}``."""
    return f"B{batch}_H{heads}_K{dk}_V{dv}_M{tokens}"


def default_num_warps(dk: int, dv: int, v_split: int) -> int:
    """Launch width for a ``[K, V / v_split]`` state slice: 4 up to 4096 float32 elements per program, else 8."""
    return 4 if dk * triton.next_power_of_2(dv) // v_split <= 4096 else 8


def _check_v_split(v_split, dv: int, where: str) -> int:
    if v_split not in V_SPLITS or triton.next_power_of_2(dv) < v_split:
        raise BackendError(f"kda[triton]: V_SPLIT {v_split!r} ({where}) must be one of {V_SPLITS} and at most "
                           f"next_pow2(V) = {triton.next_power_of_2(dv)}")
    return v_split


@functools.lru_cache(maxsize=None)
def _table(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}


def lookup_entry(table: dict, name: str, arch: str | None, key: str) -> tuple[dict | None, str | None]:
    """The launch-table entry for ``key`` under GPU ``name``, else under the table's ``"_arch_defaults"`` GPU of
    ``arch``: ``(entry, source)``, or ``(None, None)``."""
    if key in table.get(name, {}):
        return table[name][key], f"tuned for {name}"
    tuned_on = table.get("_arch_defaults", {}).get(arch) if arch else None
    if tuned_on and key in table.get(tuned_on, {}):
        return table[tuned_on][key], f"{arch} default (tuned on {tuned_on})"
    return None, None


@functools.lru_cache(maxsize=None)
def resolve_launch(batch: int, heads: int, dk: int, dv: int, tokens: int, device: str = "cuda",
                   path: str | None = None) -> tuple[int, int, str]:
    """``(V_SPLIT, num_warps, source)`` of the fused kernel for one call shape on ``device``.

    Lookup for :func:`shape_key` in ``configs/triton_kda.json`` (or ``path``, else the file the environment variable
    ``BYTEBOUND_KDA_CONFIG`` names, as ``BYTEBOUND_MOE_CONFIG`` does for the MoE), entries ``{"v_split": n[,
    "num_warps": w]}`` as ``scripts/bench_kda.py`` prints them: the exact GPU name, then the table's
    ``"_arch_defaults"`` GPU for this architecture (as ``moe_host.resolve_config``), else the default: the
    largest V_SPLIT whose ``batch * heads * V_SPLIT`` programs fit the SMs in one wave with >= 16 state columns
    each (1 off CUDA: Triton's interpreter). ``num_warps`` defaults to :func:`default_num_warps`. Cached per shape
    and device (host-side only: no sync, safe while capturing a graph).

    Raises:
        BackendError: a table entry with a V_SPLIT outside :data:`V_SPLITS` or above next_pow2(V).
    """
    key = shape_key(batch, heads, dk, dv, tokens)
    dev = torch.device(device)
    entry = source = None
    if dev.type == "cuda":
        from bytebound.kernels.moe_host import gpu_arch, gpu_name
        table = str(path or os.environ.get("BYTEBOUND_KDA_CONFIG") or CONFIG_PATH)
        entry, source = lookup_entry(_table(table), gpu_name(dev), gpu_arch(dev), key)
    if entry is not None:
        vs = _check_v_split(entry.get("v_split"), dv, f"table entry {key}, {source}")
        nw = int(entry.get("num_warps") or default_num_warps(dk, dv, vs))
        return vs, nw, source
    vs = 1
    if dev.type == "cuda":
        sms = sm_count(dev)
        for c in V_SPLITS:
            if batch * heads * c <= sms and triton.next_power_of_2(dv) // c >= 16:
                vs = c
    return vs, default_num_warps(dk, dv, vs), f"default (no entry at {key})"


def _scratch_per_program(tokens: int, bk: int, bv: int, v_split: int, beta: bool = False) -> int:
    """float32 elements of one program's scratch: ``[T, 3, BK]`` key-side vectors, with ``beta`` then ``[T]``
    beta, with ``v_split > 1`` then ``[T, BV / v_split]`` un-normalised o and ``[T]`` sums of squares; rounded up
    to 16 (64-byte blocks)."""
    n = tokens * 3 * bk + (tokens if beta else 0) + \
        (tokens * (bv // v_split) + tokens if v_split > 1 else 0)
    return -(-n // 16) * 16


def scratch_numel(batch: int, heads: int, tokens: int, dk: int, dv: int, v_split: int, beta: bool = False) -> int:
    """float32 elements of :func:`fused_kda`'s workspace for a call of ``tokens`` tokens at ``v_split`` (``beta``:
    the kernel computes beta from ``x``)."""
    return batch * heads * v_split * _scratch_per_program(tokens, triton.next_power_of_2(dk),
                                                           triton.next_power_of_2(dv), v_split, beta)


def prefetch_aligned(rec: torch.Tensor, conv_weight: torch.Tensor, conv: torch.Tensor,
                     b_weight: torch.Tensor | None, v_split: int) -> bool:
    """Whether every L2 bulk prefetch of the kernel's ``PF`` path (before its PDL wait) is 16-byte aligned and a
    multiple of 16 bytes for these (validated) tensors: aligned bases, power-of-two head dims, slices of whole
    4-float groups (the conv windows are 12 bytes a channel), a b_proj row (``b_weight``, None when beta is an
    input) of 2-byte weights in 16-byte multiples."""
    _, h, dk, dv = rec.shape
    c = conv.shape[1]
    if any(t_.data_ptr() % 16 for t_ in (rec, conv_weight, conv) + ((b_weight,) if b_weight is not None else ())):
        return False
    if b_weight is not None and (b_weight.element_size() != 2 or b_weight.shape[-1] * 2 % 16):
        return False
    return (dk & (dk - 1) == 0 and dv & (dv - 1) == 0 and (dk * dv // v_split) % 4 == 0 and dk % 4 == 0
            and (dv // v_split) % 4 == 0 and (c * 3) % 4 == 0)


def fused_kda(qkv: torch.Tensor, f: torch.Tensor, gate: torch.Tensor, b: torch.Tensor | None,
              conv_weight: torch.Tensor, conv: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              rec: torch.Tensor, norm_weight: torch.Tensor, eps: float, lower_bound: float | None,
              out_dtype: torch.dtype, conv_hist: torch.Tensor | None = None, rec_hist: torch.Tensor | None = None,
              num_warps: int | None = None, scratch: torch.Tensor | None = None, v_split: int | None = None,
              tickets: torch.Tensor | None = None, x: torch.Tensor | None = None,
              b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """One KDA layer's work between its projections for ``T <= MAX_TOKENS`` tokens, in one kernel launch.

    Args:
        qkv: ``[B, T, 2HK + HV]`` q|k|v projection outputs before the short conv (any float dtype, bf16 in the
            engine; a column slice of the fused q|k|v|f|g output works, the channel stride must be 1).
        f: ``[B, T, HK]`` f_proj output (raw, before ``dt_bias`` and the gate).
        gate: ``[B, T, HV]`` g_proj output (the gated RMSNorm's gate, before the sigmoid).
        b: ``[B, T, H]`` b_proj output (beta logits); or None with ``x`` and ``b_weight``: the kernel computes it.
        conv_weight: ``[2HK + HV, 4]`` float32 depthwise conv weights (q|k|v), contiguous.
        conv: ``[B, 2HK + HV, 3]`` float32 conv window (oldest input first); updated in place.
        a_log: ``[H]`` float32; dt_bias: ``[HK]`` float32.
        rec: ``[B, H, K, V]`` float32 recurrent state; updated in place.
        norm_weight: ``[V]`` weight of the gated RMSNorm; eps its epsilon.
        lower_bound: the safe gate's lower bound (``kda_lower_bound``), or None for the plain gate.
        out_dtype: dtype of the returned ``o`` (the model dtype; float32 for tests).
        conv_hist, rec_hist: both or neither; ``[>= T, B, 2HK + HV, 3]`` and ``[>= T, B, H, K, V]`` float32,
            contiguous: entry ``i`` receives the conv window and the recurrent state after token ``i``.
        num_warps: launch width (default: :func:`resolve_launch`'s with the table's V_SPLIT, else
            :func:`default_num_warps`).
        scratch: float32 workspace of >= ``scratch_numel(B, H, T, K, V, v_split)`` elements (the key-side vectors
            passed from the kernel's first phase to its second; with ``v_split > 1`` also the partial ``o`` rows
            and sums of squares); allocated per call when None (:class:`FusedKDA` passes a persistent one, so a
            captured graph allocates nothing).
        v_split: programs per (batch row, head), one of :data:`V_SPLITS` (<= next_pow2(V)); default: the launch
            table's or the SM-filling default (:func:`resolve_launch`).
        tickets: with ``v_split > 1``, int32 ``[>= B*H]`` all zero (each launch leaves them zero); allocated per
            call when None (:class:`FusedKDA` passes a persistent one).
        x, b_weight: instead of ``b``: the layer's normed input ``x [B, T, HID]`` (channel stride 1) and the plain
            ``b_proj`` weight ``[H, HID]`` (contiguous, any float dtype): beta = sigmoid(dtype(x . b_weight[h])),
            the dot summed in float32 and rounded to x's dtype as the torch path's ``b_proj(x)`` output, so the
            b_proj is no launch of its own (``scratch`` then needs ``scratch_numel(..., beta=True)``).

    Returns:
        ``o [B, T, HV]`` in ``out_dtype``: the gated-RMSNormed KDA output, ready for ``o_proj``.

    Raises:
        BackendError: Triton missing, T outside ``1..MAX_TOKENS``, head dims above ``MAX_HEAD_DIM``, a V_SPLIT
            outside :data:`V_SPLITS`, neither or both of ``b`` and ``x``/``b_weight``, or any shape, dtype or layout
            that the kernel does not take (named in the message).

    The maths and its sources are in the module docstring; float32 throughout, as ``layers.kda``.
    """
    if _TRITON_ERR:
        raise BackendError(f"kda[triton]: {_TRITON_ERR}")
    if rec.dim() != 4:
        raise BackendError(f"kda[triton]: rec must be [B, H, K, V], got {tuple(rec.shape)}")
    bsz, h, dk, dv = rec.shape
    t = qkv.shape[1] if qkv.dim() == 3 else -1
    if not 1 <= t <= MAX_TOKENS:
        raise BackendError(f"kda[triton]: the fused kernel takes 1..{MAX_TOKENS} tokens, got qkv {tuple(qkv.shape)}")
    if dk > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        raise BackendError(f"kda[triton]: head dims K={dk}, V={dv} above {MAX_HEAD_DIM}")
    c = 2 * h * dk + h * dv
    qkv = _rows(qkv, "qkv", bsz, t, c)
    f = _rows(f, "f", bsz, t, h * dk)
    gate = _rows(gate, "gate", bsz, t, h * dv)
    beta_x = b is None
    if beta_x == (x is None) or (x is None) != (b_weight is None):
        raise BackendError("kda[triton]: give either b (the b_proj output) or x with b_weight (beta in the kernel)")
    if beta_x:
        hid = x.shape[-1] if x.dim() == 3 else -1
        x = _rows(x, "x", bsz, t, hid)
        if b_weight.shape != (h, hid) or not b_weight.is_contiguous() or not b_weight.is_floating_point():
            raise BackendError(f"kda[triton]: b_weight must be a contiguous float [H={h}, {hid}] tensor, got "
                               f"{b_weight.dtype} {tuple(b_weight.shape)}")
        if b_weight.element_size() < 2:
            raise BackendError(f"kda[triton]: b_weight {b_weight.dtype} is quantised (scales not applied here)")
    else:
        b = _rows(b, "b", bsz, t, h)
    _f32_contig(rec, "rec", (bsz, h, dk, dv))
    _f32_contig(conv, "conv", (bsz, c, CONV_KERNEL - 1))
    _f32_contig(conv_weight, "conv_weight", (c, CONV_KERNEL))
    _f32_contig(a_log, "A_log", (h,))
    _f32_contig(dt_bias, "dt_bias", (h * dk,))
    if norm_weight.shape != (dv,) or not norm_weight.is_contiguous():
        raise BackendError(f"kda[triton]: norm weight must be contiguous [{dv}], got {tuple(norm_weight.shape)}")
    hist = conv_hist is not None
    if hist != (rec_hist is not None):
        raise BackendError("kda[triton]: conv_hist and rec_hist go together")
    if hist:
        n = conv_hist.shape[0]
        if n < t:
            raise BackendError(f"kda[triton]: history buffers hold {n} tokens, the call has {t}")
        _f32_contig(conv_hist, "conv_hist", (n, bsz, c, CONV_KERNEL - 1))
        _f32_contig(rec_hist, "rec_hist", (n, bsz, h, dk, dv))
    tensors = dict(qkv=qkv, f=f, gate=gate, b=b, x=x, b_weight=b_weight, conv_weight=conv_weight, conv=conv,
                   A_log=a_log, dt_bias=dt_bias, rec=rec, norm_weight=norm_weight, conv_hist=conv_hist,
                   rec_hist=rec_hist)
    off = [k for k, v in tensors.items() if v is not None and v.device != qkv.device]
    if off:
        raise BackendError(f"kda[triton]: {', '.join(off)} not on {qkv.device} (where qkv is)")
    if v_split is None:
        v_split, nw_cfg, _ = resolve_launch(bsz, h, dk, dv, t, str(qkv.device))
        num_warps = nw_cfg if num_warps is None else num_warps
    v_split = _check_v_split(v_split, dv, "argument")
    if num_warps is None:
        num_warps = default_num_warps(dk, dv, v_split)
    o = torch.empty(bsz, t, h * dv, dtype=out_dtype, device=qkv.device)
    need = scratch_numel(bsz, h, t, dk, dv, v_split, beta_x)
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.float32, device=qkv.device)
    elif scratch.dtype != torch.float32 or not scratch.is_contiguous() or scratch.numel() < need \
            or scratch.device != qkv.device:
        raise BackendError(f"kda[triton]: scratch must be contiguous float32 with >= {need} elements on "
                           f"{qkv.device}, got {scratch.dtype} {tuple(scratch.shape)} on {scratch.device}")
    if v_split == 1:
        tickets = scratch                       # not touched by the kernel
    elif tickets is None:
        tickets = torch.zeros(bsz * h, dtype=torch.int32, device=qkv.device)
    elif tickets.dtype != torch.int32 or not tickets.is_contiguous() or tickets.numel() < bsz * h \
            or tickets.device != qkv.device:
        raise BackendError(f"kda[triton]: tickets must be contiguous int32 with >= {bsz * h} elements on "
                           f"{qkv.device}, got {tickets.dtype} {tuple(tickets.shape)} on {tickets.device}")
    bb, xx = (x, x) if beta_x else (b, b)         # the pointer the kernel does not read: any tensor of the call
    hid = x.shape[-1] if beta_x else 1
    bk, bv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    pdl = pdl_enabled(qkv.device)
    pf = pdl and pdl_early("kda", qkv.device) and prefetch_aligned(rec, conv_weight, conv, b_weight if beta_x else None,
                                                                   v_split)
    _fused_kda_kernel[(bsz * h, v_split)](
        qkv, qkv.stride(0), qkv.stride(1), f, f.stride(0), f.stride(1), gate, gate.stride(0), gate.stride(1),
        bb, bb.stride(0), bb.stride(1), xx, xx.stride(0), xx.stride(1), b_weight if beta_x else xx,
        conv_weight, conv, a_log, dt_bias, rec, norm_weight, o, o.stride(0), o.stride(1),
        conv_hist if hist else conv, rec_hist if hist else rec, scratch, tickets,
        float(lower_bound) if lower_bound is not None else 0.0, float(eps), dk ** -0.5,
        bsz, H=h, K=dk, V=dv, BK=bk, BV=bv, M=t, SAFE_GATE=lower_bound is not None, HIST=int(hist), VS=v_split,
        SCR=_scratch_per_program(t, bk, bv, v_split, beta_x),
        FENCE=qkv.is_cuda and os.environ.get("TRITON_INTERPRET") != "1", BETA_X=beta_x, HID=hid,
        HB=triton.next_power_of_2(hid), PDL=pdl, NTH=32 * num_warps, PF=pf, MT=TAIL_ROWS,
        num_warps=num_warps, **({"launch_pdl": True} if pdl else {}))
    return o


def _scratch(device: torch.device, numel: int) -> torch.Tensor:
    """The fused kernel's workspace on ``device``, shared by all layers (they run one after another on one stream):
    :func:`kernels.scratch.scratch`'s ``kda_work``, grown when a call needs more (earlier buffers stay referenced,
    as a captured graph may still use them)."""
    return shared.scratch(device, "kda_work", numel)


def history_buffers(state, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token history buffers of a ``layers.kda.KDAState`` for a ``tokens``-token call: ``conv_hist [n, B, C, 3]``
    and ``rec_hist [n, B, H, K, V]`` float32 with ``n >= tokens``, allocated on first use and kept on the state
    (``state.hist_buf``, a list whose last pair is current), so a captured graph writes the same memory at every
    replay. A larger ``tokens`` later allocates a larger pair; the earlier pairs stay referenced, because a graph
    captured with them still writes there."""
    bufs = state.hist_buf or []
    cur = bufs[-1] if bufs else None
    if cur is None or cur[0].shape[0] < tokens or cur[0].shape[1:] != state.conv.shape \
            or cur[1].shape[1:] != state.rec.shape or cur[0].device != state.conv.device:
        cur = (torch.zeros(tokens, *state.conv.shape, dtype=torch.float32, device=state.conv.device),
               torch.zeros(tokens, *state.rec.shape, dtype=torch.float32, device=state.rec.device))
        state.hist_buf = bufs + [cur]
    return cur


if tl is not None:
    @triton.jit
    def _select_slot_kernel(src_ptr, idx_ptr, dst_ptr, S, T, BLOCK: tl.constexpr):
        """``dst[l] = src[l, idx]`` for one layer ``l`` (grid axis 1) and one ``BLOCK`` of its ``S`` elements (axis
        0): the slot index is read on the device, so the copy is capturable and needs no host read."""
        layer = tl.program_id(1).to(tl.int64)
        j = tl.load(idx_ptr).to(tl.int64)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < S
        v = tl.load(src_ptr + (layer * T + j) * S + offs, mask=m, eviction_policy="evict_first")
        tl.store(dst_ptr + layer * S + offs, v, mask=m)


def select_slot(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[l] = src[l, index]`` for every ``l``: the MTP rollback of every KDA layer at once, from the fused kernel's
    per-token history (``src [L, T, *S]``, the runner's shared buffers) into the states (``out [L, *S]``, the
    arena), with ``index`` a 0-d (or one-element) int64 device tensor in ``[0, T)``, the accepted count. One launch
    of a plain streaming copy: ``torch.index_select`` with one index runs an indexing kernel over every element
    (~2x the copy's time for the 73 MB of Ling's recurrent states). Same dtype and device for both, contiguous;
    CUDA only (the caller keeps ``index_select`` elsewhere). Returns ``out``.

    Raises:
        BackendError: Triton unavailable, or shapes / dtypes / layouts that do not match."""
    if triton is None:
        raise BackendError(f"select_slot needs Triton: {_TRITON_ERR}")
    if (src.dim() < 2 or tuple(out.shape) != (src.shape[0], *src.shape[2:]) or src.dtype != out.dtype
            or not src.is_contiguous() or not out.is_contiguous() or index.numel() != 1
            or index.dtype != torch.int64 or not (src.device == out.device == index.device)):
        raise BackendError(f"select_slot: src {tuple(src.shape)} {src.dtype}, out {tuple(out.shape)} {out.dtype}, "
                           f"index {tuple(index.shape)} {index.dtype}: want src [L, T, *S], out [L, *S], one int64 "
                           "index, contiguous, one dtype and device")
    L, T = src.shape[0], src.shape[1]
    S = out[0].numel() if L else 0
    if S == 0:
        return out
    block = 4096
    _select_slot_kernel[(triton.cdiv(S, block), L)](src, index, out, S, T, BLOCK=block, num_warps=4)
    return out


class FusedKDA:
    """The fused decode/verify op bound to one ``KimiDeltaAttention`` layer (``layer.fused_fn``).

    ``fn(qkv, f, gate, x, state, out_dtype) -> o [B, T, H*V]`` in ``out_dtype``, for ``1 <= T <= max_tokens``, with
    ``x [B, T, hidden]`` the layer's normed input; it updates ``state.conv`` and ``state.rec`` in place. A plain
    (BF16/FP32) ``b_proj`` runs inside the kernel (beta from ``x``, :func:`fused_kda`); an FP8 one (a checkpoint that
    quantises it) keeps its own projection launch: :attr:`beta` says which and why. When ``state.history`` is a list
    (MTP verify), the kernel writes every token's state into ``history_buffers(state, T)`` (8 MB per Ling layer at
    T = 4) and ``state.history`` becomes the list of ``(conv [B, C, 3], rec [B, H, K, V])`` views of those buffers,
    one per token: ``KDAState.rollback(i)`` copies from them as it does from the torch path's clones. The layer's
    conv weights are concatenated once here (at bind), so weights changed after binding need a re-bind. ``v_split``
    and ``num_warps`` (None: :func:`resolve_launch` per call shape) override the launch table, for benchmarks. The
    workspace (:func:`_scratch`, sized for ``max_tokens`` and the largest V_SPLIT, so it never grows inside a graph
    capture) and the tickets (``kernels.scratch``, name ``kda_tickets``) are shared by all layers of a device.
    Raises BackendError as :func:`fused_kda` does, and for a conv kernel size other than 4.
    """
    max_tokens = MAX_TOKENS

    def __init__(self, layer):
        if layer.kernel != CONV_KERNEL:
            raise BackendError(f"kda[triton]: the fused kernel takes short_conv_kernel_size {CONV_KERNEL}, the "
                               f"model has {layer.kernel}")
        self.layer = layer
        self.num_warps = None           # fused_kda's default; scripts/bench_kda.py --warps sweeps it
        self.v_split = None             # the launch table's / default; scripts/bench_kda.py --v-splits sweeps it
        self.conv_weight = layer.conv_weight().detach().reshape(-1, layer.kernel).float().contiguous()
        # float32 views (the same tensors when already float32 and contiguous): no per-call cast kernels
        self.a_log = layer.A_log.detach().float().contiguous()
        self.dt_bias = layer.dt_bias.detach().float().contiguous()
        bp = layer.b_proj
        why = ("stored FP8 (not in modules_to_not_convert): its own projection, dequantised by the linear backend"
               if bp.fmt != "plain" else
               f"weight {tuple(bp.weight.shape)} is not [heads={layer.heads}, hidden] contiguous"
               if bp.weight.shape != (layer.heads, bp.in_features) or not bp.weight.is_contiguous() else None)
        self.beta_in_kernel = why is None
        #: where beta = sigmoid(b_proj x) is computed (recorded by bind_model in the kda resolution)
        self.beta = "b_proj inside the fused kernel" if why is None else f"b_proj separate launch: {why}"

    def __call__(self, qkv, f, gate, x, state, out_dtype):
        m = self.layer
        hist = state.history is not None
        ch = rh = None
        if hist:
            ch, rh = history_buffers(state, qkv.shape[1])
        bsz, h, dk, dv = state.rec.shape
        vs_max = min(V_SPLITS[-1], triton.next_power_of_2(dv))
        b, xb, wb = (None, x, m.b_proj.weight) if self.beta_in_kernel else (m.b_proj(x), None, None)
        o = fused_kda(qkv, f, gate, b, self.conv_weight, state.conv, self.a_log, self.dt_bias, state.rec,
                      m.o_norm.weight, m.o_norm.eps, m.lower_bound, out_dtype, ch, rh, self.num_warps,
                      _scratch(qkv.device, max(scratch_numel(bsz, h, self.max_tokens, dk, dv, vs, beta=True)
                                               for vs in V_SPLITS if vs <= vs_max)),
                      self.v_split, shared.scratch(qkv.device, "kda_tickets", bsz * h, torch.int32), x=xb, b_weight=wb)
        if hist:
            state.history = [(ch[i], rh[i]) for i in range(qkv.shape[1])]
        return o


def available(dev) -> str | None:
    """None when the fused kernel can run on ``dev`` (a CUDA device and an importable Triton), else the reason."""
    return cuda_only(dev) or _TRITON_ERR


@register("kda", "triton", available)
class TritonKDA:
    """Decode/verify (M <= ``MAX_TOKENS``) through :class:`FusedKDA`; prefill through fla-core's ``chunk_kda``
    when fla-core is usable (``kernels.fla_kda``), else the torch reference (``prefill_backend`` says which)."""
    name = "triton"

    def __init__(self):
        from bytebound.kernels import fla_kda
        why = fla_kda.available(torch.device("cuda"))
        self.prefill_backend = "fla" if why is None else "torch"
        # recorded in the manifest (Resolution.prefill): the torch reference is slow, so it is never silent
        self.prefill = (f"M <= {MAX_TOKENS}: fused kernel; larger M: " +
                        ("fla chunk_kda" if why is None else f"torch reference (fla unusable: {why})"))

    def bind(self, layer, dtype):
        """The layer's ``kda_fn`` for what the fused op does not take (T > ``MAX_TOKENS``, or no state)."""
        if self.prefill_backend == "fla":
            from bytebound.kernels.fla_kda import make_kda_fn
            return make_kda_fn(inplace=True)
        from bytebound.layers.kda import torch_kda
        return torch_kda

    def bind_fused(self, layer, dtype):
        """The layer's ``fused_fn`` (:class:`FusedKDA`); raises BackendError for a conv kernel size other than 4."""
        return FusedKDA(layer)
