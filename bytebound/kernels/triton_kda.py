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

One program per (batch row, head) holds that head's state ``[K, V]`` in registers for all M tokens: the state is
read and written once per call, not once per token. The V dimension is not split across programs because the
gated RMSNorm needs the whole V row of ``o``; at Ling's shape (32 heads x 128) that is 32 programs of 64 KB state
each. The program works in two phases: first the key side of all M tokens (q/k conv + SiLU, L2 norms, gate) as
1-D vectors, written to a small float32 scratch; then, after a barrier, the value-side conv, the delta rule and
the norm on the state. In the state's register layout every K-vector is replicated over the lanes that hold
different V columns, so building the ~20 key-side vectors there makes ptxas spill; passing the three results
(q, k, exp(g)) through the scratch keeps the state phase within the register file. With a history request the
kernel also writes, after each token i, the conv window to ``conv_hist[i]`` and the recurrent state to
``rec_hist[i]`` (MTP verify: rollback to token i is a copy from, or an index into, those buffers; no Python loop,
no clones).

The wrapper :func:`fused_kda` allocates only its output ``o`` (the history buffers and, through
:class:`FusedKDA`, the scratch are allocated once), makes no host sync and launches one kernel: it is CUDA-graph
capturable. The float32 rounding points are those of the torch path (``layers.kda`` with ``kda_ref``), so the
only rounding to the model dtype is the final store of ``o``. Tested against the layer's torch path, fla-core's
naive KDA and a float64 derivation in Triton's interpreter on CPU (tests/test_triton_kda.py) and at Ling's full
shape on the GPU (tests/gpu/test_kda_gpu.py).
"""

from __future__ import annotations

import torch

from bytebound.errors import BackendError
from bytebound.kernels.registry import cuda_only, optional_triton, register

MAX_TOKENS = 8          # largest M of the fused kernel (MTP verify is k+1 = 4; 6-token chains fit)
CONV_KERNEL = 4         # Ling's short_conv_kernel_size; the kernel keeps the 3-input window in registers
MAX_HEAD_DIM = 256      # K, V <= 256: the [K, V] float32 state of one head lives in one program's registers

triton, tl, _TRITON_ERR = optional_triton()      # None, None, reason on machines without Triton


if tl is not None:
    @triton.jit
    def _conv_silu_step(x, w0, w1, w2, c0, c1, c2, c3):
        """One causal depthwise-conv output (kernel 4) + SiLU: window (w0 oldest .. w2 newest) and input x."""
        y = c0 * w0 + c1 * w1 + c2 * w2 + c3 * x
        return y * tl.sigmoid(y)

    @triton.jit
    def _fused_kda_kernel(
            qkv_ptr, s_qkv_b, s_qkv_t, f_ptr, s_f_b, s_f_t, gate_ptr, s_gate_b, s_gate_t, b_ptr, s_b_b, s_b_t,
            convw_ptr, conv_ptr, alog_ptr, dtb_ptr, rec_ptr, normw_ptr, o_ptr, s_o_b, s_o_t,
            conv_hist_ptr, rec_hist_ptr, scratch_ptr, lower_bound, eps, scale,
            B, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            M: tl.constexpr, SAFE_GATE: tl.constexpr, HIST: tl.constexpr):
        pid = tl.program_id(0)
        bi = (pid // H).to(tl.int64)
        h = pid % H
        DQK: tl.constexpr = H * K
        C: tl.constexpr = 2 * H * K + H * V          # conv channels q|k|v
        conv_b = conv_ptr + bi * C * 3
        # This program's scratch [M, 3, BK] float32: l2-normalised scaled q, l2-normalised k, decay exp(g).
        scr = scratch_ptr + pid.to(tl.int64) * (M * 3 * BK)

        # ---- phase 1: the key-side vectors of all M tokens (conv + SiLU, L2 norms, gate), 1-D over K ----
        # Kept apart from the [K, V] phase on purpose (module docstring): there a K-vector is replicated over the
        # lanes that hold different V columns, so building these ~20 vectors there spills registers.
        ck = tl.arange(0, BK)
        mk = ck < K
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
        for t in tl.static_range(M):
            xrow = qkv_ptr + bi * s_qkv_b + t * s_qkv_t
            xq = tl.load(xrow + chq, mask=mk, other=0.0).to(tl.float32)
            xk = tl.load(xrow + chk, mask=mk, other=0.0).to(tl.float32)
            q = _conv_silu_step(xq, wq0, wq1, wq2, cq0, cq1, cq2, cq3)
            k = _conv_silu_step(xk, wk0, wk1, wk2, ck0, ck1, ck2, ck3)
            wq0, wq1, wq2 = wq1, wq2, xq
            wk0, wk1, wk2 = wk1, wk2, xk
            # L2 norms (x / sqrt(sum x^2 + 1e-6), fla's form) and the K^-0.5 scale
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            # gate (kda_ref.kda_gate)
            fx = tl.load(f_ptr + bi * s_f_b + t * s_f_t + h * K + ck, mask=mk, other=0.0).to(tl.float32) + dtb
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
                tl.store(hc + chq * 3 + 0, wq0, mask=mk)
                tl.store(hc + chq * 3 + 1, wq1, mask=mk)
                tl.store(hc + chq * 3 + 2, wq2, mask=mk)
                tl.store(hc + chk * 3 + 0, wk0, mask=mk)
                tl.store(hc + chk * 3 + 1, wk1, mask=mk)
                tl.store(hc + chk * 3 + 2, wk2, mask=mk)
        tl.store(conv_b + chq * 3 + 0, wq0, mask=mk)
        tl.store(conv_b + chq * 3 + 1, wq1, mask=mk)
        tl.store(conv_b + chq * 3 + 2, wq2, mask=mk)
        tl.store(conv_b + chk * 3 + 0, wk0, mask=mk)
        tl.store(conv_b + chk * 3 + 1, wk1, mask=mk)
        tl.store(conv_b + chk * 3 + 2, wk2, mask=mk)
        tl.debug_barrier()          # phase 2 reads the scratch that other threads of this program wrote

        # ---- phase 2: value-side conv, the delta rule on the [K, V] state, the gated RMSNorm ----
        rk = tl.arange(0, BK)
        rmk = rk < K
        cv = tl.arange(0, BV)
        mv = cv < V
        chv = 2 * DQK + h * V + cv
        cv0 = tl.load(convw_ptr + chv * 4 + 0, mask=mv, other=0.0)
        cv1 = tl.load(convw_ptr + chv * 4 + 1, mask=mv, other=0.0)
        cv2 = tl.load(convw_ptr + chv * 4 + 2, mask=mv, other=0.0)
        cv3 = tl.load(convw_ptr + chv * 4 + 3, mask=mv, other=0.0)
        wv0 = tl.load(conv_b + chv * 3 + 0, mask=mv, other=0.0)
        wv1 = tl.load(conv_b + chv * 3 + 1, mask=mv, other=0.0)
        wv2 = tl.load(conv_b + chv * 3 + 2, mask=mv, other=0.0)
        nw = tl.load(normw_ptr + cv, mask=mv, other=0.0).to(tl.float32)
        m2 = rmk[:, None] & mv[None, :]
        soff = rk[:, None] * V + cv[None, :]
        rec_bh = rec_ptr + (bi * H + h) * K * V
        s = tl.load(rec_bh + soff, mask=m2, other=0.0)
        for t in tl.static_range(M):
            xv = tl.load(qkv_ptr + bi * s_qkv_b + t * s_qkv_t + chv, mask=mv, other=0.0).to(tl.float32)
            v = _conv_silu_step(xv, wv0, wv1, wv2, cv0, cv1, cv2, cv3)
            wv0, wv1, wv2 = wv1, wv2, xv
            beta = tl.sigmoid(tl.load(b_ptr + bi * s_b_b + t * s_b_t + h).to(tl.float32))
            # delta rule: decay each key channel, predict, rank-1 update (key-side vectors from phase 1)
            s = s * tl.load(scr + (t * 3 + 2) * BK + rk, mask=rmk, other=0.0)[:, None]
            k = tl.load(scr + (t * 3 + 1) * BK + rk, mask=rmk, other=0.0)
            pred = tl.sum(k[:, None] * s, axis=0)
            delta = (v - pred) * beta
            s = s + k[:, None] * delta[None, :]
            q = tl.load(scr + (t * 3 + 0) * BK + rk, mask=rmk, other=0.0)
            o = tl.sum(q[:, None] * s, axis=0)
            # gated RMSNorm over V (RMSNormGated: float32 statistics, one rounding at the store)
            gt = tl.load(gate_ptr + bi * s_gate_b + t * s_gate_t + h * V + cv, mask=mv, other=0.0).to(tl.float32)
            o = tl.where(mv, o, 0.0)
            o = o * tl.rsqrt(tl.sum(o * o, axis=0) / V + eps) * nw * tl.sigmoid(gt)
            tl.store(o_ptr + bi * s_o_b + t * s_o_t + h * V + cv,
                     o.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mv)
            if HIST:
                hc = conv_hist_ptr + (t * B + bi) * C * 3
                tl.store(hc + chv * 3 + 0, wv0, mask=mv)
                tl.store(hc + chv * 3 + 1, wv1, mask=mv)
                tl.store(hc + chv * 3 + 2, wv2, mask=mv)
                tl.store(rec_hist_ptr + ((t * B + bi) * H + h) * K * V + soff, s, mask=m2)
        tl.store(rec_bh + soff, s, mask=m2)
        tl.store(conv_b + chv * 3 + 0, wv0, mask=mv)
        tl.store(conv_b + chv * 3 + 1, wv1, mask=mv)
        tl.store(conv_b + chv * 3 + 2, wv2, mask=mv)


def _rows(x: torch.Tensor, name: str, b: int, t: int, n: int) -> torch.Tensor:
    """``x [B, T, >= n]`` with unit channel stride (a column slice of the fused projection output is fine)."""
    if x.dim() != 3 or x.shape[0] != b or x.shape[1] != t or x.shape[2] != n:
        raise BackendError(f"kda[triton]: {name} must be [B={b}, T={t}, {n}], got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _f32_contig(x: torch.Tensor, name: str, shape: tuple) -> None:
    if tuple(x.shape) != shape or x.dtype != torch.float32 or not x.is_contiguous():
        raise BackendError(f"kda[triton]: {name} must be a contiguous float32 tensor of shape {shape}, got "
                           f"{x.dtype} {tuple(x.shape)}{'' if x.is_contiguous() else ' (not contiguous)'}")


def fused_kda(qkv: torch.Tensor, f: torch.Tensor, gate: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
              conv: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, rec: torch.Tensor,
              norm_weight: torch.Tensor, eps: float, lower_bound: float | None, out_dtype: torch.dtype,
              conv_hist: torch.Tensor | None = None, rec_hist: torch.Tensor | None = None,
              num_warps: int | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """One KDA layer's work between its projections for ``T <= MAX_TOKENS`` tokens, in one kernel launch.

    Args:
        qkv: ``[B, T, 2HK + HV]`` q|k|v projection outputs before the short conv (any float dtype, bf16 in the
            engine; a column slice of the fused q|k|v|f|g output works, the channel stride must be 1).
        f: ``[B, T, HK]`` f_proj output (raw, before ``dt_bias`` and the gate).
        gate: ``[B, T, HV]`` g_proj output (the gated RMSNorm's gate, before the sigmoid).
        b: ``[B, T, H]`` b_proj output (beta logits).
        conv_weight: ``[2HK + HV, 4]`` float32 depthwise conv weights (q|k|v), contiguous.
        conv: ``[B, 2HK + HV, 3]`` float32 conv window (oldest input first); updated in place.
        a_log: ``[H]`` float32; dt_bias: ``[HK]`` float32.
        rec: ``[B, H, K, V]`` float32 recurrent state; updated in place.
        norm_weight: ``[V]`` weight of the gated RMSNorm; eps its epsilon.
        lower_bound: the safe gate's lower bound (``kda_lower_bound``), or None for the plain gate.
        out_dtype: dtype of the returned ``o`` (the model dtype; float32 for tests).
        conv_hist, rec_hist: both or neither; ``[>= T, B, 2HK + HV, 3]`` and ``[>= T, B, H, K, V]`` float32,
            contiguous: entry ``i`` receives the conv window and the recurrent state after token ``i``.
        num_warps: launch width (default 4 for K*V <= 4096, else 8).
        scratch: float32 workspace of >= ``B * H * T * 3 * next_pow2(K)`` elements (the key-side vectors passed
            from the kernel's first phase to its second); allocated per call when None (:class:`FusedKDA` passes
            a persistent one, so a captured graph allocates nothing).

    Returns:
        ``o [B, T, HV]`` in ``out_dtype``: the gated-RMSNormed KDA output, ready for ``o_proj``.

    Raises:
        BackendError: Triton missing, T outside ``1..MAX_TOKENS``, head dims above ``MAX_HEAD_DIM``, or any shape,
            dtype or layout that the kernel does not take (named in the message).

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
    tensors = dict(qkv=qkv, f=f, gate=gate, b=b, conv_weight=conv_weight, conv=conv, A_log=a_log, dt_bias=dt_bias,
                   rec=rec, norm_weight=norm_weight, conv_hist=conv_hist, rec_hist=rec_hist)
    off = [k for k, v in tensors.items() if v is not None and v.device != qkv.device]
    if off:
        raise BackendError(f"kda[triton]: {', '.join(off)} not on {qkv.device} (where qkv is)")
    o = torch.empty(bsz, t, h * dv, dtype=out_dtype, device=qkv.device)
    need = bsz * h * t * 3 * triton.next_power_of_2(dk)
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.float32, device=qkv.device)
    elif scratch.dtype != torch.float32 or not scratch.is_contiguous() or scratch.numel() < need \
            or scratch.device != qkv.device:
        raise BackendError(f"kda[triton]: scratch must be contiguous float32 with >= {need} elements on "
                           f"{qkv.device}, got {scratch.dtype} {tuple(scratch.shape)} on {scratch.device}")
    if num_warps is None:
        num_warps = 4 if dk * dv <= 4096 else 8
    _fused_kda_kernel[(bsz * h,)](
        qkv, qkv.stride(0), qkv.stride(1), f, f.stride(0), f.stride(1), gate, gate.stride(0), gate.stride(1),
        b, b.stride(0), b.stride(1), conv_weight, conv, a_log, dt_bias, rec, norm_weight, o, o.stride(0), o.stride(1),
        conv_hist if hist else conv, rec_hist if hist else rec, scratch,
        float(lower_bound) if lower_bound is not None else 0.0, float(eps), dk ** -0.5,
        bsz, H=h, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=triton.next_power_of_2(dv), M=t,
        SAFE_GATE=lower_bound is not None, HIST=hist, num_warps=num_warps)
    return o


_SCRATCH: dict[str, list[torch.Tensor]] = {}


def _scratch(device: torch.device, numel: int) -> torch.Tensor:
    """The fused kernel's workspace on ``device``, shared by all layers (they run one after another on one stream):
    allocated once, grown when a call needs more; earlier buffers stay referenced, as a captured graph may still
    use them."""
    bufs = _SCRATCH.setdefault(str(device), [])
    if not bufs or bufs[-1].numel() < numel:
        bufs.append(torch.empty(numel, dtype=torch.float32, device=device))
    return bufs[-1]


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


class FusedKDA:
    """The fused decode/verify op bound to one ``KimiDeltaAttention`` layer (``layer.fused_fn``).

    ``fn(qkv, f, gate, b, state, out_dtype) -> o [B, T, H*V]`` in ``out_dtype``, for ``1 <= T <= max_tokens``; it
    updates ``state.conv`` and ``state.rec`` in place. When ``state.history`` is a list (MTP verify), the kernel
    writes every token's state into ``history_buffers(state, T)`` (8 MB per Ling layer at T = 4) and
    ``state.history`` becomes the list of ``(conv [B, C, 3], rec [B, H, K, V])`` views of those buffers, one per
    token: ``KDAState.rollback(i)`` copies from them as it does from the torch path's clones. The layer's conv
    weights are concatenated once here (at bind), so weights changed after binding need a re-bind. Raises
    BackendError as :func:`fused_kda` does, and for a conv kernel size other than 4.
    """
    max_tokens = MAX_TOKENS

    def __init__(self, layer):
        if layer.kernel != CONV_KERNEL:
            raise BackendError(f"kda[triton]: the fused kernel takes short_conv_kernel_size {CONV_KERNEL}, the "
                               f"model has {layer.kernel}")
        self.layer = layer
        self.num_warps = None           # fused_kda's default; scripts/bench_kda.py --warps sweeps it
        self.conv_weight = layer.conv_weight().detach().reshape(-1, layer.kernel).float().contiguous()
        # float32 views (the same tensors when already float32 and contiguous): no per-call cast kernels
        self.a_log = layer.A_log.detach().float().contiguous()
        self.dt_bias = layer.dt_bias.detach().float().contiguous()

    def __call__(self, qkv, f, gate, b, state, out_dtype):
        m = self.layer
        hist = state.history is not None
        ch = rh = None
        if hist:
            ch, rh = history_buffers(state, qkv.shape[1])
        o = fused_kda(qkv, f, gate, b, self.conv_weight, state.conv, self.a_log, self.dt_bias, state.rec,
                      m.o_norm.weight, m.o_norm.eps, m.lower_bound, out_dtype, ch, rh, self.num_warps,
                      _scratch(qkv.device, qkv.shape[0] * m.heads * self.max_tokens * 3 *
                               triton.next_power_of_2(m.head_dim)))
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
