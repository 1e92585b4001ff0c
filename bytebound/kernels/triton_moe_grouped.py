"""Routed MoE for the prefill regime: a grouped GEMM over tokens sorted by expert, W4A16 (MXFP4 -> BF16 tiles).

For M tokens with top-k routing (``ids [M, k]``, ``w [M, k]``) the M*k (token, expert) *slots* are sorted by expert
on the GPU (``torch.argsort`` + ``bincount`` + ``cumsum``; no host sync, so no ``.item()`` stalls the stream).
Each expert's slots are cut into blocks of ``BM`` rows; the number of blocks is bounded on the host by
``ceil(M*k / BM) + min(E, M*k)`` (every non-empty expert wastes at most one partial block), and programs past an
expert's last block, or of an expert with no tokens, return at once - an expert nobody chose costs no weight bytes.

Two kernels, the vLLM / SGLang ``fused_moe`` structure with the MXFP4 decode of this repository's formats
(``layers.moe.RoutedExperts``: ``w13 uint8 [E, 2I, H/2]``, ``w13_scale uint8 [E, 2I, H/32]`` E8M0, ``w2 uint8
[E, H, I/2]``, ``w2_scale uint8 [E, H, I/32]``; low nibble = even column):

1. ``_grouped_gateup``: grid ``(blocks, I / BN)``. A block's rows gather their tokens' activations ``x [BM, BK]``
   (BF16); the gate rows ``[n, n+BN)`` and the up rows ``[I+n, I+n+BN)`` of the block's expert are decoded from
   E2M1 x E8M0 to BF16 in registers (exact: every E2M1 value times a power of two is a BF16 number) and multiplied
   on tensor cores with float32 accumulation; SwiGLU (with the layer's clamp, ``layers.moe.swiglu``) is the
   epilogue, and the BF16 activations ``[BM, BN]`` go to a buffer in sorted-slot order ``act [M*k, I]``.
2. ``_grouped_down``: grid ``(blocks, H / BN)``: ``act`` rows times the decoded ``w2`` tile, scaled by the slot's
   routing weight in float32, stored to the slot's own row of ``y [M*k, H]`` float32.

The k slots of a token are then summed by ``y.view(M, k, H).sum(1)`` in a fixed order (deterministic: no atomics),
and cast to BF16. Rounding differs from ``kernels.torch_ref.moe_reference`` (which rounds the gate/up GEMM and the
SwiGLU to BF16) only in being closer to the float64 reference.

The shared expert is not included (the MoE layer adds its dense shared expert for M above the decode width).
Launch configs come from :func:`prefill_config` (a function of the average number of tokens per expert); the
kernels are specialised on the shape ``(H, I, k)`` and the tiling only, not on M, so one compile serves every
prefill chunk length.
"""

from __future__ import annotations

import os

import torch

from bytebound.errors import BackendError
from bytebound.kernels.registry import optional_triton

triton, tl, _TRITON_ERR = optional_triton()
# Triton's interpreter (CPU tests) multiplies BF16 operands of tl.dot as their raw 16-bit patterns (seen with
# Triton 3.6): under it the products run on float32 copies, which changes no value (BF16 -> float32 is exact).
# The kernels also use tl.full, not tl.zeros: tl.zeros is a jitted library function, compiled for the mode Triton
# was first imported in, so an interpreted kernel cannot call it once a test has imported Triton normally.
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"


def prefill_config(m: int, k: int, e: int) -> dict:
    """Tiling for ``m`` tokens of top-``k`` routing over ``e`` experts: rows per block ``BM`` from the average
    slots per expert ``m*k/e`` (a block mostly full, few blocks per expert so the weights are decoded about once
    per expert), and fixed N/K tiles."""
    avg = m * k / max(e, 1)
    # The kernels are bound by decoding the weights (each block of an expert decodes all of them), so a block
    # should hold all of an expert's slots: about twice the average, as the counts vary (H200 sweep, docs/perf).
    bm = 16
    while bm < 128 and bm < 2 * avg:
        bm *= 2
    return {"BM": bm, "BN": 64, "BK": 128, "BN2": 128, "BK2": 128, "num_warps": 8 if bm >= 128 else 4,
            "num_stages": 3, "deq": "int"}


if triton is not None:
    @triton.jit
    def _dequant_tile(wp, sp, BN: tl.constexpr, BK: tl.constexpr, DEQ_INT: tl.constexpr):
        """Packed E2M1 bytes ``wp`` -> ``[BN, BK // 2]`` uint8 pointers, E8M0 bytes ``sp`` -> ``[BN, BK // 32]`` ->
        BF16 ``[BN, BK]`` in column order (low nibble = even column), exact.

        ``DEQ_INT``: the BF16 bit pattern is built in integers with the scale folded into the exponent field:
        magnitude code ``m`` >= 2 (1, 1.5, 2, 3, 4, 6) is ``(m << 6) + ((s - 1) << 7)``, code 1 (0.5) is
        ``(s - 1) << 7``, code 0 is 0, the sign bit is ``(code & 8) << 12`` (valid for E8M0 bytes 2..254, far
        outside which no checkpoint scale lies). Else float32: codes 2..7 are ``(m << 22) + (126 << 23)``, code 1 is
        0.5, times ``2^(s - 127)`` (the float32 whose exponent field is ``s``)."""
        p = tl.load(wp)
        lo = p & 0xF
        hi = p >> 4
        c = tl.reshape(tl.join(lo, hi), (BN, BK)).to(tl.int32)
        mag = c & 7
        s = tl.load(sp).to(tl.int32)
        if DEQ_INT:
            sb = tl.reshape(tl.broadcast_to(tl.expand_dims((s - 1) << 7, 2), (BN, BK // 32, 32)), (BN, BK))
            bits = tl.where(mag == 0, 0, (mag << 6) + sb - tl.where(mag == 1, 64, 0)) | ((c & 8) << 12)
            return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        v = tl.where(mag >= 2, ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True), mag.to(tl.float32) * 0.5)
        v = tl.where((c & 8) != 0, -v, v)
        sf = (s << 23).to(tl.float32, bitcast=True)
        sf = tl.reshape(tl.broadcast_to(tl.expand_dims(sf, 2), (BN, BK // 32, 32)), (BN, BK))
        return (v * sf).to(tl.bfloat16)

    @triton.jit
    def _mma(a, b, acc, F32: tl.constexpr):
        """``acc + a @ b.T`` for BF16 ``a [BM, BK]``, ``b [BN, BK]`` with float32 accumulation."""
        if F32:
            return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
        return tl.dot(a, tl.trans(b), acc)

    @triton.jit
    def _block_rows(bexp_ptr, bstart_ptr, cnt_ptr, tstart_ptr, order_ptr, pid_b, E: tl.constexpr,
                    BM: tl.constexpr):
        """The expert of block ``pid_b`` (``E`` = idle block), its rows' sorted positions, validity and slots."""
        e = tl.load(bexp_ptr + pid_b)
        e_safe = tl.minimum(e, E - 1)
        lb = pid_b - tl.load(bstart_ptr + e_safe)
        cnt = tl.load(cnt_ptr + e_safe)
        r = lb * BM + tl.arange(0, BM)
        valid = (r < cnt) & (e < E)
        pos = tl.load(tstart_ptr + e_safe) + r
        slot = tl.load(order_ptr + pos, mask=valid, other=0)
        return e, e_safe, pos, valid, slot

    @triton.jit
    def _grouped_gateup(x_ptr, w13_ptr, s13_ptr, bexp_ptr, bstart_ptr, cnt_ptr, tstart_ptr, order_ptr, act_ptr,
                        limit, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_LIMIT: tl.constexpr,
                        F32: tl.constexpr, DEQ_INT: tl.constexpr):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        e, e_safe, pos, valid, slot = _block_rows(bexp_ptr, bstart_ptr, cnt_ptr, tstart_ptr, order_ptr, pid_b,
                                                  E, BM)
        if e < E:
            tok = (slot // TOPK).to(tl.int64)
            n = pid_n * BN + tl.arange(0, BN)
            kk = tl.arange(0, BK)
            kb = tl.arange(0, BK // 2)
            ks = tl.arange(0, BK // 32)
            base_w = w13_ptr + e_safe.to(tl.int64) * (2 * I * (H // 2))
            base_s = s13_ptr + e_safe.to(tl.int64) * (2 * I * (H // 32))
            gw = base_w + n[:, None] * (H // 2) + kb[None, :]
            uw = gw + I * (H // 2)
            gs = base_s + n[:, None] * (H // 32) + ks[None, :]
            us = gs + I * (H // 32)
            xp = x_ptr + tok[:, None] * H + kk[None, :]
            acc_g = tl.full((BM, BN), 0.0, tl.float32)
            acc_u = tl.full((BM, BN), 0.0, tl.float32)
            for k0 in range(0, H, BK):
                a = tl.load(xp + k0, mask=valid[:, None], other=0.0)
                wg = _dequant_tile(gw + k0 // 2, gs + k0 // 32, BN, BK, DEQ_INT)
                acc_g = _mma(a, wg, acc_g, F32)
                wu = _dequant_tile(uw + k0 // 2, us + k0 // 32, BN, BK, DEQ_INT)
                acc_u = _mma(a, wu, acc_u, F32)
            g = acc_g / (1.0 + tl.exp(-acc_g))          # silu in float32
            if HAS_LIMIT:
                g = tl.minimum(g, limit)
                acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            out = (g * acc_u).to(tl.bfloat16)
            tl.store(act_ptr + pos.to(tl.int64)[:, None] * I + n[None, :], out, mask=valid[:, None])

    @triton.jit
    def _grouped_down(act_ptr, w2_ptr, s2_ptr, wt_ptr, bexp_ptr, bstart_ptr, cnt_ptr, tstart_ptr, order_ptr, y_ptr,
                      E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
                      DEQ_INT: tl.constexpr):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        e, e_safe, pos, valid, slot = _block_rows(bexp_ptr, bstart_ptr, cnt_ptr, tstart_ptr, order_ptr, pid_b,
                                                  E, BM)
        if e < E:
            n = pid_n * BN + tl.arange(0, BN)
            kk = tl.arange(0, BK)
            kb = tl.arange(0, BK // 2)
            ks = tl.arange(0, BK // 32)
            dw = w2_ptr + e_safe.to(tl.int64) * (H * (I // 2)) + n[:, None] * (I // 2) + kb[None, :]
            ds = s2_ptr + e_safe.to(tl.int64) * (H * (I // 32)) + n[:, None] * (I // 32) + ks[None, :]
            ap = act_ptr + pos.to(tl.int64)[:, None] * I + kk[None, :]
            acc = tl.full((BM, BN), 0.0, tl.float32)
            for k0 in range(0, I, BK):
                a = tl.load(ap + k0, mask=valid[:, None], other=0.0)
                wd = _dequant_tile(dw + k0 // 2, ds + k0 // 32, BN, BK, DEQ_INT)
                acc = _mma(a, wd, acc, F32)
            wt = tl.load(wt_ptr + slot, mask=valid, other=0.0)
            acc = acc * wt[:, None]
            tl.store(y_ptr + slot.to(tl.int64)[:, None] * H + n[None, :], acc, mask=valid[:, None])


def _fit_tile(want: int, dim: int, lo: int) -> int:
    """The largest power of two <= ``want`` and >= ``lo`` dividing ``dim`` (0 if none)."""
    t = want
    while t >= lo:
        if dim % t == 0:
            return t
        t //= 2
    return 0


def expert_blocks(ids: torch.Tensor, e: int, bm: int) -> tuple[torch.Tensor, ...]:
    """Sort the slots of ``ids [M, k]`` by expert into blocks of ``bm`` rows, on the device, without a host sync.

    Returns ``(order int32 [M*k], counts int32 [E], tok_start int32 [E], blk_start int32 [E], blk_expert int32
    [NB])``: ``order`` lists the flat slot indices (``m*k + j``) grouped by expert (stable); expert ``e`` owns the
    sorted positions ``tok_start[e] .. tok_start[e] + counts[e]`` and the blocks ``blk_start[e] ..``;
    ``blk_expert[b]`` is block ``b``'s expert, or ``E`` for the idle blocks past the last one. ``NB = ceil(M*k /
    bm) + min(E, M*k)`` bounds the blocks needed for any routing.
    """
    flat = ids.reshape(-1)
    s = flat.numel()
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.bincount(flat, minlength=e)[:e]
    nblk = (counts + bm - 1) // bm
    blk_end = torch.cumsum(nblk, 0)
    nb = -(-s // bm) + min(e, s)
    blk_expert = torch.searchsorted(blk_end, torch.arange(nb, device=ids.device), right=True).to(torch.int32)
    tok_start = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    return order, counts.to(torch.int32), tok_start, (blk_end - nblk).to(torch.int32), blk_expert


class GroupedMoE:
    """The prefill path of one ``RoutedExperts`` (MXFP4): ``__call__(x [M, H] bf16, ids [M, k] int64, w [M, k]
    float32) -> [M, H] bf16``, the routed sum without the shared expert, any M >= 1 (module docstring).

    Raises:
        BackendError: not MXFP4 experts on a CUDA device (or Triton's interpreter), H or I not tileable by the
            kernels (multiples of 32 with a power-of-two tile dividing them), non-bf16 activations.
    """

    def __init__(self, ex, configs: dict | None = None):
        if _TRITON_ERR:
            raise BackendError(f"moe prefill[triton grouped]: {_TRITON_ERR}")
        if ex.fmt != "mxfp4":
            raise BackendError(f"moe prefill[triton grouped] needs MXFP4 experts, got fmt={ex.fmt!r}")
        self.ex = ex
        self.e, self.h, self.i = ex.n, ex.hidden, ex.inter
        self.limit = ex.limit
        self.configs = configs

    def config(self, m: int, k: int) -> dict:
        cfg = dict(self.configs or prefill_config(m, k, self.e))
        for key, dim in (("BN", self.i), ("BK", self.h), ("BN2", self.h), ("BK2", self.i)):
            t = _fit_tile(cfg[key], dim, 16 if key.startswith("BN") else 32)
            if not t:
                raise BackendError(f"moe prefill[triton grouped]: no {key} tile divides {dim} (H={self.h}, "
                                   f"I={self.i} must be multiples of 32)")
            cfg[key] = t
        return cfg

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise BackendError(f"moe prefill[triton grouped] needs bf16 activations, got {x.dtype}")
        m, k = ids.shape
        if m == 0:
            return x.new_empty(0, self.h)
        cfg = self.config(m, k)
        ex = self.ex
        x = x.contiguous()
        wt = w.to(torch.float32).contiguous().view(-1)
        order, counts, tstart, bstart, bexp = expert_blocks(ids, self.e, cfg["BM"])
        nb = bexp.numel()
        s = m * k
        act = torch.empty(s, self.i, dtype=torch.bfloat16, device=x.device)
        y = torch.empty(s, self.h, dtype=torch.float32, device=x.device)
        limit = float(self.limit) if self.limit is not None else 0.0
        deq_int = cfg.get("deq", "int") == "int"
        _grouped_gateup[(nb, self.i // cfg["BN"])](
            x, ex.w13.data, ex.w13_scale.data, bexp, bstart, counts, tstart, order, act, limit,
            E=self.e, H=self.h, I=self.i, TOPK=k, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
            HAS_LIMIT=self.limit is not None, F32=_DOT_F32, DEQ_INT=deq_int, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        _grouped_down[(nb, self.h // cfg["BN2"])](
            act, ex.w2.data, ex.w2_scale.data, wt, bexp, bstart, counts, tstart, order, y,
            E=self.e, H=self.h, I=self.i, BM=cfg["BM"], BN=cfg["BN2"], BK=cfg["BK2"], F32=_DOT_F32,
            DEQ_INT=deq_int, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return y.view(m, k, self.h).sum(1).to(torch.bfloat16)
