"""Backend ``triton`` of ops ``linear`` (FP8 128x128-block weights) and ``lm_head`` (online FP8 per channel).

``linear`` (``QLinear`` with ``fmt == "fp8"``: ``weight`` E4M3 ``[N, K]``, ``weight_scale_inv`` float32
``[ceil(N/128), ceil(K/128)]``):

* **M <= 4** (decode, verify): one GEMV kernel. Each program owns ``BN`` output rows (``BN`` divides the scale
  block's 128 rows, so a program's rows share one row of scales; other block sizes work the same way) and walks K in ``BK`` chunks; the E4M3 bytes are converted to float32
  in registers (``cvt.rn.f16x2.e4m3x2`` + widen) and multiplied into per-token float32 accumulators with the
  activation pre-multiplied by the chunk's block scale (``x * s`` costs BK multiplies per chunk, not one per
  weight). Accumulation is float32, the output BF16 (the activation dtype). The weight is read once for all M
  tokens.
* **M > 4** (prefill): dequantise the whole weight to BF16 with one Triton kernel into a temporary and call
  ``F.linear`` (cuBLAS). The temporary is ``2*N*K`` bytes for the duration of the call; nothing is cached, so the
  resident weight stays FP8. Exactly the torch reference's math (dequantise, BF16 GEMM).
* ``fmt == "plain"``: ``F.linear`` on the stored weight (no kernel of ours).

``lm_head`` (``LMHead``):

* ``mode == "fp8"`` and M <= 4: a one-program-per-token kernel quantises the activation to E4M3 with its
  dynamic scale (``quant.quantize_fp8_token``), then ``logits[m, v] = (sum_k xq[m, k] * wq[v, k]) * sx[m] *
  w_scale[v]`` runs on FP8 tensor cores (``tl.dot`` of E4M3 x E4M3, float32 accumulate; tokens padded to 16
  columns), so the 402 MB weight streams with no per-weight conversion. Same math as the reference
  ``torch._scaled_mm`` row-wise path up to summation order. Two launches.
* fp8 with M > 4: ``torch._scaled_mm`` (row-wise scales, float32 out) like the torch reference.
* ``bf16``/``fp32`` modes delegate to the torch reference (cuBLAS).

All kernels are shape-specialised through constexprs (N, K, M) and Triton's JIT cache; launch configs are
chosen by :func:`gemv_config` (no autotuning at run time, so the first call compiles exactly one kernel and
graph capture sees no tuning).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bytebound.errors import BackendError
from bytebound.kernels.limits import MAX_VERIFY_M as MAX_M     # the one verify-width limit (kernels/limits.py)
from bytebound.kernels.registry import cuda_only, optional_triton, register

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
    @triton.jit
    def _fp8_block_gemv(x_ptr, w_ptr, s_ptr, o_ptr, N, K: tl.constexpr, SK: tl.constexpr, M: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, EVEN_N: tl.constexpr, SBN: tl.constexpr,
                        SBK: tl.constexpr):
        """o[m, n] = sum_k x[m, k] * w[n, k] * s[n // SBN, k // SBK] (out in x's dtype); BN divides SBN."""
        pid = tl.program_id(0)
        rows = pid * BN + tl.arange(0, BN)
        kk = tl.arange(0, BK)
        rmask = rows < N
        srow = s_ptr + ((pid * BN) // SBN) * SK
        wp = w_ptr + rows[:, None].to(tl.int64) * K + kk[None, :]
        acc0 = tl.zeros([BN, BK], tl.float32)
        acc1 = tl.zeros([BN, BK], tl.float32)
        acc2 = tl.zeros([BN, BK], tl.float32)
        acc3 = tl.zeros([BN, BK], tl.float32)
        for k0 in range(0, K, BK):
            kmask = (k0 + kk) < K
            if EVEN_N:
                w = tl.load(wp + k0, mask=kmask[None, :], other=0.0)
            else:
                w = tl.load(wp + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
            wf = w.to(tl.float32)
            sc = tl.load(srow + (k0 + kk) // SBK, mask=kmask, other=0.0)
            x0 = tl.load(x_ptr + k0 + kk, mask=kmask, other=0.0).to(tl.float32) * sc
            acc0 += wf * x0[None, :]
            if M > 1:
                x1 = tl.load(x_ptr + K + k0 + kk, mask=kmask, other=0.0).to(tl.float32) * sc
                acc1 += wf * x1[None, :]
            if M > 2:
                x2 = tl.load(x_ptr + 2 * K + k0 + kk, mask=kmask, other=0.0).to(tl.float32) * sc
                acc2 += wf * x2[None, :]
            if M > 3:
                x3 = tl.load(x_ptr + 3 * K + k0 + kk, mask=kmask, other=0.0).to(tl.float32) * sc
                acc3 += wf * x3[None, :]
        tl.store(o_ptr + rows, tl.sum(acc0, axis=1).to(o_ptr.dtype.element_ty), mask=rmask)
        if M > 1:
            tl.store(o_ptr + N + rows, tl.sum(acc1, axis=1).to(o_ptr.dtype.element_ty), mask=rmask)
        if M > 2:
            tl.store(o_ptr + 2 * N + rows, tl.sum(acc2, axis=1).to(o_ptr.dtype.element_ty), mask=rmask)
        if M > 3:
            tl.store(o_ptr + 3 * N + rows, tl.sum(acc3, axis=1).to(o_ptr.dtype.element_ty), mask=rmask)

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
    def _fp8_head_dot(q_ptr, sx_ptr, w_ptr, ws_ptr, o_ptr, N, K: tl.constexpr, M: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, EVEN_N: tl.constexpr):
        """logits[m, n] = (sum_k q[m, k] * w[n, k]) * sx[m] * ws[n] on FP8 tensor cores (float32 accumulate)."""
        pid = tl.program_id(0)
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
        out = acc * wsc[:, None] * sx[None, :]
        tl.store(o_ptr + mm[None, :] * N + rows[:, None], out, mask=(mm[None, :] < M) & rmask[:, None])


def gemv_config(n: int, k: int, m: int) -> dict:
    """Launch config of the FP8 GEMVs: rows per program BN (divides 128), K chunk BK, warps, stages.

    Enough programs to fill 132 SMs several times (small N -> small BN) and a [BN, BK] float32 accumulator per
    token that fits in registers (BN*BK/threads <= 32 per token for M=4)."""
    bn = 32 if n >= 4096 else 16
    if m >= 3:
        bn = 16
    return {"BN": bn, "BK": 256, "num_warps": 4, "num_stages": 4}


def fp8_block_linear(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                     cfg: dict | None = None) -> torch.Tensor:
    """``x2 [M, K]`` BF16 -> ``[M, N]`` in x's dtype; GEMV for M <= 4, dequantise + cuBLAS otherwise."""
    m, k = x2.shape
    n = weight.shape[0]
    sbn, sbk = block
    if m <= MAX_M:
        cfg = dict(cfg or gemv_config(n, k, m))
        while sbn % cfg["BN"]:
            cfg["BN"] //= 2
        if cfg["BN"] < 1:
            raise BackendError(f"linear[triton]: scale block {block} has no power-of-two row tiling")
        x2 = x2.contiguous()
        out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
        grid = (triton.cdiv(n, cfg["BN"]),)
        _fp8_block_gemv[grid](x2, weight, scale_inv, out, n, K=k, SK=scale_inv.shape[1], M=m, BN=cfg["BN"],
                              BK=cfg["BK"], EVEN_N=(n % cfg["BN"] == 0), SBN=sbn, SBK=sbk,
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return out
    return F.linear(x2, dequantize_fp8_block_gpu(weight, scale_inv, block))


def dequantize_fp8_block_gpu(weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """BF16 ``weight * scale_inv`` (per block) in one Triton kernel: ``2*N*K`` bytes, freed by the caller."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=weight.device)
    grid = (triton.cdiv(n, 64), triton.cdiv(k, 128))
    _fp8_dequant_block[grid](weight, scale_inv, out, n, k, scale_inv.shape[1], BN=64, BK=128, SBN=block[0],
                             SBK=block[1], num_warps=4)
    return out


def fp8_head_logits(x2: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, cfg: dict | None = None
                    ) -> torch.Tensor:
    """``x2 [M<=4, K]`` -> float32 logits ``[M, V]``: per-token E4M3 quantisation (one small kernel), then the
    FP8 x FP8 product on tensor cores with float32 accumulation, scaled by ``sx[m] * w_scale[v]``."""
    m, k = x2.shape
    n = w_fp8.shape[0]
    cfg = cfg or {"BN": 128, "BK": 128, "num_warps": 4, "num_stages": 4}
    x2 = x2.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x2.device)
    sx = torch.empty(m, dtype=torch.float32, device=x2.device)
    _fp8_quant_rows[(m,)](x2, q, sx, K=k, BK=1024, num_warps=4)
    out = torch.empty(m, n, dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(n, cfg["BN"]),)
    _fp8_head_dot[grid](q, sx, w_fp8, w_scale, out, n, K=k, M=m, BN=cfg["BN"], BK=cfg["BK"],
                        EVEN_N=(n % cfg["BN"] == 0), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


@register("linear", "triton", available)
class TritonLinear:
    """FP8 block GEMV for M <= 4, dequantise + cuBLAS for prefill; plain weights go to ``F.linear``."""
    name = "triton"

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

        def fn(x):
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            if x2.dtype != torch.bfloat16:
                x2 = x2.to(torch.bfloat16)
            y = fp8_block_linear(x2, weight, scale, block)
            return y.to(x.dtype).view(*shape[:-1], y.shape[-1])
        fn.max_tokens = MAX_M       # the GEMV's width; more tokens dequantise the weight (read by bind_model)
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
        # the FP8 head GEMV's width (bind_model reads it; the bf16/fp32 paths are cuBLAS at any M)
        fn.max_tokens = MAX_M if head.mode == "fp8" else None
        return fn
