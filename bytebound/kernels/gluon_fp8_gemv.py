"""The FP8 block GEMV (decode/verify, M <= 4) on BF16 tensor cores, tokens on the mma N axis (Gluon).

``y[m, n] = sum_k x[m, k] * w[n, k] * s[n // 128, k // 128]`` for an E4M3 weight ``[N, K]`` with float32 128x128
block scales and BF16 activations ``[M <= 4, K]``; the ``MMA`` path of ``triton_fp8.fp8_block_gemv`` (config keys
``MMA``, ``BN`` = R rows per program, ``NC``, ``SPLIT``, ``num_warps``, ``PDL``, optional ``NR``; fitted by
``triton_fp8.fit_gemv_config``).

Why: the FMA path needs four FMAs and ~200 registers per weight tile at M = 4, and the ``DOT`` path pays Triton's
one-instruction-per-weight E4M3 -> BF16 conversion plus a shared-memory staging of the tile. Here the weight is
one mma.m16n8k16 A operand straight from registers, built from the ``split`` MoE kernels' pieces
(``triton_moe_split``): :func:`~bytebound.kernels.triton_moe_split.fp8_word_layout` puts each lane's weight bytes in
16-byte vectors that are exactly its A-fragment rows (in a *logical* k order), ``_frag_fp8`` decodes 4 E4M3 bytes
per few integer instructions (PRMT/shift into BF16 bits, times the BF16x2 factor 2^120, so the BF16 values are the
exact E4M3 values), and ``_load_b`` gathers the activations ``[128, 8]`` in the same logical k order (tokens >= M
are 0). The weight is read once for all M tokens and the mma does the M-fold reuse, so the instruction count per
weight byte does not grow with M.

Program ``(i, p)``: rows ``i*R .. i*R + R`` (R = 16 * num_warps * 2^r divides 128, so every row of the program
shares one row of scales; rows >= N are masked) over the ``p``-th K slice of ``KS`` columns, in chunks of ``NC``
128-column scale blocks. Per scale block a fresh float32 mma accumulator, then ``total += acc * s`` in float32:
any positive float32 block scale works (not only powers of two) and the maths is the ``DOT`` path's. The next
chunk's weight words are loaded before the current chunk is decoded (a register double buffer), so they are in
flight during the decode and the mma. Each mma column is one token and is computed independently of the others,
so a token's result does not depend on M: with one config for M = 1..4 a verify row equals the decode result bit
for bit.

PDL (sm_90): ``launch_dependents`` first; the first chunk's weight words (read-only) are loaded *before*
``griddepcontrol.wait``; the activations, the scratch and the output are touched only after it. Split-K
(``SPLIT > 1``) as ``triton_fp8._fp8_gemv``: float32 partials ``[tiles, SPLIT, 4, R]`` in
``gemv_scratch("part")``, an acq_rel ticket per row tile, the last program sums the partials in the fixed order p
= 0..SPLIT-1 and re-arms the ticket (bit-identical run to run and under CUDA-graph replay).

``NORM`` (opt-in, ``triton_fp8.fp8_block_gemv_add_norm``): the decoder's input add + RMSNorm folded in; after the
wait each program forms x = RMSNorm(h + delta) into its own scratch slot and multiplies by it. One launch fewer per
layer, but measured slower than the norm kernel before the GEMV (docs/perf/history.md), so off by default.
"""

from __future__ import annotations

import torch

from bytebound.errors import BackendError
from bytebound.kernels.device import maxnreg
from bytebound.kernels.triton_moe_split import GLUON_ERR, fp8_word_layout, gl, gluon

# The BF16x2 factor 2^120 in both halves: ``_frag_fp8`` yields the E4M3 value x 2^-120 before it, so with this
# factor the decoded BF16 equals the E4M3 value exactly (the float32 block scale is applied after the mma).
F120 = 0x7B807B80
MAX_NC = 4                  # scale blocks per chunk: the double buffer holds 2 * NC * R * 128 bytes per program


if gluon is not None:
    from bytebound.kernels.triton_moe_split import _fence_all, _frag_fp8, _gdc, _load_b, fp8_index, mma_v2

    _F120 = gl.constexpr(F120)

    @gluon.jit
    def _chunk_words(w_ptr, rows, rmask, kb, K: gl.constexpr, EVEN_N: gl.constexpr, WD8: gl.constexpr):
        """int32 words ``[R, NC, 4, 8]`` (layout ``WD8`` = ``fp8_word_layout(R, NC, NW)``) of rows ``rows`` and the
        ``NC`` 128-column blocks from block ``kb`` of the weight viewed as int32 ``[N, K/4]`` (the index maths of
        ``triton_moe_split.fp8_index``); rows >= N (``rmask`` false) read nothing and give 0."""
        off, sb, t, q = fp8_index(rows, kb, K, WD8)
        ptr = w_ptr + off
        if EVEN_N:
            return gl.load(ptr)
        m3 = rmask[:, None, None] & (sb[None, :, None] >= 0) & (t[None, None, :] >= 0)
        return gl.load(ptr, mask=m3[:, :, :, None] & (q[None, None, None, :] >= 0), other=0)

    @gluon.jit
    def _block_mma(total, wb, x_ptr, srow_ptr, kb, K: gl.constexpr, M: gl.constexpr, WD1: gl.constexpr,
                   MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr):
        """``total += (W[rows, block kb] @ x[:, block kb]^T) * s[kb]``: one scale block's words ``wb`` (any layout
        equal to ``WD1`` = ``fp8_word_layout(R, 1, NW)``, shape ``[R, 1, 4, 8]``) decoded to exact BF16, one mma
        product into a fresh float32 accumulator ``[R, 8]``, scaled in float32 by the block's scale (a scalar:
        the program's rows share one scale row, ``srow_ptr``)."""
        NW: gl.constexpr = gl.num_warps()
        R: gl.constexpr = WD1.shape[0]
        wb = gl.convert_layout(wb, WD1, assert_trivial=True)
        f = gl.full([R, 1], _F120, gl.int32, gl.SliceLayout(2, gl.SliceLayout(3, WD1)))
        b = _load_b(x_ptr + kb * 128, K, M, 1, NW, DB)
        sc = gl.load(srow_ptr + kb)
        acc = mma_v2(_frag_fp8(wb, f, DA), b, gl.zeros([R, 8], gl.float32, MMA))
        return total + acc * sc

    @gluon.jit
    def _chunk_mma(total, wv, x_ptr, srow_ptr, kb, K: gl.constexpr, M: gl.constexpr, NC: gl.constexpr,
                   WD1: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr):
        """The ``NC`` scale blocks of one chunk (words ``wv [R, NC, 4, 8]``), in block order. The block axis is
        in-register (``fp8_word_layout``), so moving it last and splitting it costs no data movement."""
        R: gl.constexpr = WD1.shape[0]
        if NC == 1:
            total = _block_mma(total, wv, x_ptr, srow_ptr, kb, K, M, WD1, MMA, DA, DB)
        else:
            v = gl.permute(wv, [0, 2, 3, 1])                          # [R, 4, 8, NC]
            if NC == 2:
                b0, b1 = gl.split(v)
                total = _block_mma(total, gl.reshape(b0, [R, 1, 4, 8]), x_ptr, srow_ptr, kb, K, M, WD1, MMA, DA, DB)
                total = _block_mma(total, gl.reshape(b1, [R, 1, 4, 8]), x_ptr, srow_ptr, kb + 1, K, M, WD1, MMA, DA,
                                   DB)
            else:                                                      # NC == 4: block 2i + j
                j0, j1 = gl.split(gl.reshape(v, [R, 4, 8, 2, 2]))
                b0, b2 = gl.split(j0)
                b1, b3 = gl.split(j1)
                total = _block_mma(total, gl.reshape(b0, [R, 1, 4, 8]), x_ptr, srow_ptr, kb, K, M, WD1, MMA, DA, DB)
                total = _block_mma(total, gl.reshape(b1, [R, 1, 4, 8]), x_ptr, srow_ptr, kb + 1, K, M, WD1, MMA, DA,
                                   DB)
                total = _block_mma(total, gl.reshape(b2, [R, 1, 4, 8]), x_ptr, srow_ptr, kb + 2, K, M, WD1, MMA, DA,
                                   DB)
                total = _block_mma(total, gl.reshape(b3, [R, 1, 4, 8]), x_ptr, srow_ptr, kb + 3, K, M, WD1, MMA, DA,
                                   DB)
        return total

    @gluon.jit
    def _norm_rows(h_ptr, d_ptr, nw_ptr, xs_ptr, xo_ptr, ho_ptr, eps, first, K: gl.constexpr, KP: gl.constexpr,
                   M: gl.constexpr, NW: gl.constexpr):
        """The decoder's input residual add and RMSNorm of the ``M`` rows, with ``triton_norm.add_rmsnorm``'s
        roundings: ``hs = bf16(h + delta)`` (one rounding), ``r = rsqrt(sum(hs^2) / K + eps)`` in float32,
        ``x = bf16(w * bf16(hs * r))``, stored to this program's own slot ``xs`` and read back as its mma operand
        after a CTA barrier (a slot per program: no two programs store to one address). The grid's ``first``
        program also stores ``x`` to ``xo`` and ``hs`` to ``ho`` for the kernels after this one. One row is one
        ``[KP]`` vector (K padded to a power of two, masked), so its loads are one round trip."""
        RL: gl.constexpr = gl.BlockedLayout([8], [32], [NW], [0])
        cols = gl.arange(0, KP, layout=RL)
        km = cols < K
        w = gl.load(nw_ptr + cols, mask=km, other=0.0).to(gl.float32)
        for m in gl.static_range(M):
            hs = (gl.load(h_ptr + m * K + cols, mask=km, other=0.0).to(gl.float32) +
                  gl.load(d_ptr + m * K + cols, mask=km, other=0.0).to(gl.float32))
            hs = hs.to(gl.bfloat16).to(gl.float32)
            r = gl.rsqrt(gl.sum(hs * hs, axis=0) / K + eps)
            x = (w * (hs * r).to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16)
            gl.store(xs_ptr + m * K + cols, x, mask=km)
            if first:
                gl.store(xo_ptr + m * K + cols, x, mask=km)
                gl.store(ho_ptr + m * K + cols, hs.to(gl.bfloat16), mask=km)
        gl.thread_barrier()         # the CTA's slot stores are visible to all its threads before the main loop

    @gluon.jit
    def _fp8_gemv_mma(x_ptr, w_ptr, s_ptr, o_ptr, part_ptr, cnt_ptr, N, K: gl.constexpr, M: gl.constexpr,
                      KS: gl.constexpr, SPLIT: gl.constexpr, EVEN_N: gl.constexpr, PDL: gl.constexpr,
                      WD8: gl.constexpr, WD1: gl.constexpr, h_ptr, d_ptr, nw_ptr, ho_ptr, xs_ptr, eps,
                      NORM: gl.constexpr = False, KP: gl.constexpr = 1):
        """``o[m, n] = sum_k x[m, k] * w[n, k] * s[n // 128, k // 128]`` (module docstring). ``x`` BF16 ``[M, K]``,
        ``w`` the E4M3 weight as int32 ``[N, K/4]``, ``s`` float32 ``[ceil(N/128), K/128]``, ``o`` BF16 ``[M, N]``;
        ``part``/``cnt``: split-K scratch (unused when ``SPLIT == 1``). ``WD8`` = ``fp8_word_layout(R, NC, NW)``
        (R rows, NC blocks per chunk), ``WD1`` the same for one block.

        ``NORM`` (the decoder's input add + RMSNorm folded in, :func:`launch_mma`'s ``norm``): ``h`` is the residual
        stream, ``d`` the previous sublayer's output, ``nw`` the norm weight (``KP`` = K rounded up to a power of
        two); each program forms ``x = RMSNorm(h + d)`` itself into its slot of ``xs`` (``[programs, M, K]`` BF16,
        :func:`_norm_rows`) and multiplies by it; program (0, 0) writes ``x`` to ``x_ptr`` and ``h + d`` to ``ho``,
        which the kernels after this one read only after this grid completed (stream order, or PDL's wait)."""
        NW: gl.constexpr = gl.num_warps()
        R: gl.constexpr = WD8.shape[0]
        NC: gl.constexpr = WD8.shape[1]
        SK: gl.constexpr = K // 128
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        OL: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NW, 1], [1, 0])
        pid = gl.program_id(0)
        pk = gl.program_id(1)
        if PDL:         # the next kernel may launch now; its own wait still waits for this grid to complete
            _gdc("griddepcontrol.launch_dependents; mov.u32 $0, 0;", NW)
        rows = pid * R + gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WD8))))
        rmask = rows < N
        kb0 = pk * (KS // 128)                          # the slice's first scale block
        nch = gl.minimum(KS, K - pk * KS) // (128 * NC)  # its chunks (the last slice may be shorter)
        srow_ptr = s_ptr + (pid * R // 128) * SK
        wv = _chunk_words(w_ptr, rows, rmask, kb0, K, EVEN_N, WD8)     # read-only: may precede the wait
        if PDL:
            _gdc("griddepcontrol.wait; mov.u32 $0, 0;", NW)
        src = x_ptr
        if NORM:
            src = xs_ptr + (pid * SPLIT + pk).to(gl.int64) * (M * K)
            _norm_rows(h_ptr, d_ptr, nw_ptr, src, x_ptr, ho_ptr, eps, (pid == 0) & (pk == 0), K, KP, M, NW)
        total = gl.zeros([R, 8], gl.float32, MMA)
        for c in range(nch - 1):
            wn = _chunk_words(w_ptr, rows, rmask, kb0 + (c + 1) * NC, K, EVEN_N, WD8)   # in flight during the decode
            total = _chunk_mma(total, wv, src, srow_ptr, kb0 + c * NC, K, M, NC, WD1, MMA, DA, DB)
            wv = wn
        total = _chunk_mma(total, wv, src, srow_ptr, kb0 + (nch - 1) * NC, K, M, NC, WD1, MMA, DA, DB)

        out = gl.convert_layout(total, OL)              # [R, 8]: row r, token column m (m >= M is padding)
        orow = gl.arange(0, R, layout=gl.SliceLayout(1, OL))
        ocol = gl.arange(0, 8, layout=gl.SliceLayout(0, OL))
        cm = (orow[:, None] >= 0) & (ocol[None, :] < M)
        omask = cm & (pid * R + orow[:, None] < N)
        optr = o_ptr + ocol[None, :] * N + pid * R + orow[:, None]
        if SPLIT == 1:
            gl.store(optr, out.to(gl.bfloat16), mask=omask)
        else:
            base = part_ptr + pid.to(gl.int64) * (SPLIT * 4 * R) + ocol[None, :] * R + orow[:, None]
            gl.store(base + pk * (4 * R), out, mask=cm)
            _fence_all(NW)      # every thread's partial stores are visible before the program takes its ticket
            ticket = gl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                tot = gl.zeros([R, 8], gl.float32, OL)
                for q in gl.static_range(SPLIT):        # fixed order: bit-identical on every run and replay
                    tot += gl.load(base + q * (4 * R), mask=cm, other=0.0, cache_modifier=".cg")
                gl.store(optr, tot.to(gl.bfloat16), mask=omask)
                gl.store(cnt_ptr + pid, 0)


def mma_refusal(n: int, k: int, block) -> str | None:
    """Why the MMA path cannot run weight ``[n, k]`` with scale ``block`` (None when it can): it needs Gluon, 128x128
    scale blocks (a program's R <= 128 rows share one scale row; one mma product per scale block) and K a multiple
    of 128 (whole blocks: 16-byte vectors, no K tail)."""
    if GLUON_ERR:
        return GLUON_ERR
    if tuple(block) != (128, 128):
        return f"MMA GEMV needs 128x128 scale blocks, got {tuple(block)}"
    if k % 128:
        return f"MMA GEMV needs K a multiple of 128, got K={k}"
    return None


def launch_mma(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor, part, cnt,
               cfg: dict, pdl: bool, norm: tuple | None = None) -> None:
    """Launch :func:`_fp8_gemv_mma` for a fitted MMA config (``triton_fp8.fit_gemv_config`` with ``MMA``).

    ``x2`` BF16 ``[M <= 4, K]`` contiguous, ``weight`` E4M3 ``[N, K]`` contiguous and 16-byte aligned,
    ``scale_inv`` float32 ``[ceil(N/128), K/128]`` contiguous, ``out`` BF16 ``[M, N]``; ``part``/``cnt`` the split-K
    scratch (any tensor when ``SPLIT == 1``). ``norm``: ``(h, delta, norm_weight, h_out, eps, slots)`` folds the
    decoder's input add + RMSNorm in: ``x2`` is then written (x = RMSNorm(h + delta)) rather than read, ``h_out``
    receives h + delta (h, delta, h_out BF16 ``[M, K]`` contiguous, norm_weight ``[K]`` contiguous), ``slots``
    BF16 of >= programs * M * K elements; ``triton_fp8.fp8_block_gemv_add_norm`` checks them.

    Raises:
        BackendError: Gluon missing, activations not BF16, or a weight the 16-byte vector loads cannot read."""
    if gluon is None:
        raise BackendError(f"linear[triton]: MMA GEMV: {GLUON_ERR}")
    m, k = x2.shape
    n = weight.shape[0]
    if x2.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise BackendError(f"linear[triton]: the MMA GEMV takes and returns BF16, got {x2.dtype} -> {out.dtype}")
    if not weight.is_contiguous() or weight.data_ptr() % 16 or k % 128:
        raise BackendError("linear[triton]: the MMA GEMV reads the weight as 16-byte vectors: it needs a contiguous, "
                           f"16-byte aligned [N, K] weight with K % 128 == 0, got {tuple(weight.shape)}")
    r, nc, nw, split = cfg["BN"], cfg["NC"], cfg["num_warps"], cfg["SPLIT"]
    grid = (-(-n // r), split)
    h, d, nwt, ho, eps, slots = norm if norm is not None else (x2, x2, x2, x2, 0.0, x2)
    _fp8_gemv_mma[grid](x2, weight.view(torch.int32), scale_inv, out, part, cnt, n, K=k, M=m, KS=cfg["KS"],
                        SPLIT=split, EVEN_N=n % r == 0, PDL=pdl, WD8=fp8_word_layout(r, nc, nw),
                        WD1=fp8_word_layout(r, 1, nw), h_ptr=h, d_ptr=d, nw_ptr=nwt, ho_ptr=ho, xs_ptr=slots,
                        eps=float(eps), NORM=norm is not None, KP=1 << max(0, (k - 1).bit_length()), num_warps=nw,
                        **({"launch_pdl": True} if pdl else {}), **maxnreg(cfg.get("NR")))
