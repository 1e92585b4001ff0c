"""Backend ``triton`` of op ``moe``: one fused MXFP4 routed-MoE kernel for batch-1 decode (M=1) and verify (M<=4).

One launch computes ``y[m] = sum_j w[m, j] * down_e(SwiGLU(gate_e x[m], up_e x[m]))`` for the experts ``e =
ids[m, j]`` straight from the checkpoint's MXFP4 bytes (``RoutedExperts``: ``w13 uint8 [E, 2I, H/2]``, ``w13_scale
uint8 [E, 2I, H/32]`` E8M0, ``w2 uint8 [E, H, I/2]``, ``w2_scale uint8 [E, H, I/32]``; low nibble = even column).
No weight re-layout and no copy: the kernel reads the module's own tensors (viewed as int32 words).

Work split (grid ``(I/BI, M*top_k)``): program ``(j, s)`` owns routing slot ``s`` (token ``s // k``, expert ``e =
ids.flat[s]``) and the intermediate slice ``[j*BI, (j+1)*BI)``:

1. **Dedup** (M>1): if an earlier slot already chose ``e``, the program does nothing - so each distinct expert's
   bytes are read once even when several verify tokens picked it. The surviving program computes for *all* M
   tokens with per-token weights ``w_tok[m] = sum_j w[m, j] [ids[m, j] == e]`` (zero for tokens that did not
   pick ``e``). No host sync, no torch glue ops: the routing tensors go straight into the kernel.
2. **gate/up GEMV**: rows ``gate[j-slice] | up[j-slice]`` (2*BI rows) times ``x [M, H]`` on tensor cores (mma
   m16n8k16, tokens padded to 8 columns); the E2M1 codes are decoded to BF16 in registers by a PRMT lookup
   table (8 values per 32-bit word, ~2.6 instructions per weight including the E8M0 scale multiply), staged
   through shared memory and read back with ldmatrix.
3. SwiGLU (optional clamp ``silu(g).clamp(max=L) * u.clamp(-L, L)``) and the routing weight, in float32; the
   slice's activations become the BF16 B operand of
4. **down GEMV** over the slice: ``w2[e, :, j-slice]`` (all H rows, BI columns) -> partial ``[H, M]`` added with
   atomics into a per-binding workspace ``[H, 8]``: int64 fixed point by default (:data:`FIXED_SHIFT`; integer
   sums do not depend on arrival order, so outputs are bit-identical run to run and graph == eager), or float32
   (config ``"deterministic": false``; order-dependent in the last bit).
5. The last program to finish (an acq_rel ticket counter) converts the workspace to the BF16 output and zeroes
   the workspace and the counter for the next call, so one launch is the whole op and it is CUDA-graph safe.

Config ``"partials": true`` replaces 4-5 by plain stores: each program writes its float32 partial ``[H, M]`` to
its own slot of a shared scratch ``[I/BI, M*top_k, H, M]`` and a second kernel (``_moe_reduce_partials``) sums
the slots in a fixed order. Also bit-identical run to run, without the int64 atomics (at M = 4 they cost +72 %
over float atomics on the H200), at the price of writing and reading the partials (15.7 MB at M = 4 with BI 64,
1 MB at M = 1) and a second launch; at M = 4 it beat the int64 atomics on the H200 (docs/perf/history.md).

Two implementations of the same algorithm: ``gluon`` (Triton's explicit-layout dialect: the register layouts are
chosen so the dequantisation needs no shuffles) and ``tl`` (plain Triton with ``tl.dot_scaled``; the
compiler's generic MX up-cast, slower, kept as the fallback). A third variant, ``split``
(``triton_moe_split.py``), is a different algorithm: two kernels (gate/up, then down) whose hundreds of small
programs issue all their weight bytes up front, against this kernel's latency-bound serial chain. All are specialised per exact shape
``(E, H, I, top_k, M)`` as constexprs and cached by Triton's JIT. Launch configs (variant, BI, BK, BH, warps)
come from ``configs/triton_moe.json`` keyed by shape under the exact GPU name, else under the architecture's
default GPU (every sm_90 part uses the H200's entries), written by ``scripts/bench_moe.py --tune``; anything else
uses :data:`DEFAULT_CONFIG`. :func:`resolve_config` also says which key matched (the manifest records it).

Constraints: M <= :data:`MAX_M` per launch (more raises :class:`BackendError` unless ``fn.prefill`` is set;
``runner.backends.bind_model`` sets it to this kernel over 4-token slices), bf16
activations, E8M0 scale bytes < 255. Graph capture: the callable allocates only its output (caching allocator)
and launches one kernel (two in the partials mode and the ``split`` variant); the atomic workspace and counter
belong to the binding. The partials buffer and the ``split`` scratch are shared by every binding on a device
(allocated, or grown, on the first call of a shape, which must therefore happen before capture). So MoE calls
must not run concurrently on two streams.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from bytebound.errors import BackendError
from bytebound.kernels.limits import MAX_VERIFY_M as MAX_M     # the one verify-width limit (kernels/limits.py)
from bytebound.kernels.registry import cuda_only, needs_capability, optional_triton, register

# Deterministic accumulation: partial sums enter the workspace as int64 fixed point (value * 2^28), and integer
# addition does not depend on the order the programs arrive in, so the output is bit-identical run to run (float32
# atomics differ in the last bit: measured 1 of 2560 outputs at M=1, 4 of 10240 at M=4 on the H200). Resolution
# 2^-28 = 3.7e-9 absolute, range +-3.4e10: far below bf16's 3 significant digits for any value a hidden state holds.
FIXED_SHIFT = 28
NP = 8                      # token columns of the mma tile (m16n8k16)
CONFIG_PATH = Path(__file__).resolve().parent / "configs" / "triton_moe.json"
DEFAULT_CONFIG = {"variant": "gluon", "BI": 64, "BK": 128, "BH": 256, "num_warps": 4}   # H200 sweep: best at M=1, 4
TL_DEFAULT_CONFIG = {"variant": "tl", "BI": 32, "BK": 256, "BH": 128, "num_warps": 4, "num_stages": 3}

triton, tl, _TRITON_ERR = optional_triton()      # None, None, reason on machines without Triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    _GLUON_ERR = None
except Exception as exc:  # pragma: no cover
    gluon = gl = mma_v2 = async_copy = None
    _GLUON_ERR = f"triton.experimental.gluon is not importable: {exc}"


FIXED_ONE = tl.constexpr(float(1 << FIXED_SHIFT)) if tl is not None else None


def available(dev) -> str | None:
    return cuda_only(dev) or _TRITON_ERR or needs_capability(dev, 8, "mma.m16n8k16 bf16")


# E2M1 -> BF16 lookup tables for PRMT (bytes 0..7 = magnitude codes 0..7):
#   low byte  [00 00 80 C0 00 40 80 C0] and high byte [00 3F 3F 3F 40 40 40 40] of 0, .5, 1, 1.5, 2, 3, 4, 6;
#   sign byte table [00 80] indexed by the code's bit 3.
LUT_WORDS = (0xC0800000, 0xC0804000, 0x3F3F3F00, 0x40404040, 0x00008000)


def _lut_tensor(device) -> torch.Tensor:
    vals = [v - (1 << 32) if v >= 1 << 31 else v for v in LUT_WORDS]
    return torch.tensor(vals + [0, 0, 0], dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------------------------------------
# Gluon implementation
# ---------------------------------------------------------------------------------------------------------
if gluon is not None:
    # One int32 word = 8 E2M1 codes (code t in bits 4t..4t+3 = k order). $8 word, $9 bf16x2 (scale, scale),
    # $10..$14 the LUT words (passed as registers so ptxas keeps them resident instead of re-materialising).
    # Outputs $0..$7: the 8 BF16 values in k order.
    _ASM_DEQ8 = gl.constexpr("""
{
.reg .b32 a<13>;
.reg .b32 o<4>;
and.b32  a0, $8, 0x88888888;
shr.u32  a1, a0, 3;
and.b32  a2, $8, 0x77777777;
shr.u32  a3, a2, 16;
shr.u32  a4, a0, 19;
prmt.b32 a5, $10, $11, a2;
prmt.b32 a6, $10, $11, a3;
prmt.b32 a7, $12, $13, a2;
prmt.b32 a8, $12, $13, a3;
prmt.b32 a9, $14, 0, a1;
prmt.b32 a10, $14, 0, a4;
or.b32   a11, a7, a9;
or.b32   a12, a8, a10;
prmt.b32 o0, a5, a11, 0x5140;
prmt.b32 o1, a5, a11, 0x7362;
prmt.b32 o2, a6, a12, 0x5140;
prmt.b32 o3, a6, a12, 0x7362;
mul.rn.bf16x2 o0, o0, $9;
mul.rn.bf16x2 o1, o1, $9;
mul.rn.bf16x2 o2, o2, $9;
mul.rn.bf16x2 o3, o3, $9;
mov.b32 {$0, $1}, o0;
mov.b32 {$2, $3}, o1;
mov.b32 {$4, $5}, o2;
mov.b32 {$6, $7}, o3;
}
""")

    _ASM_FENCE = gl.constexpr("fence.acq_rel.gpu; mov.u32 $0, 0;")

    @gluon.jit
    def _g_dequant(w, s, c0, c1, c2, c3, c4):
        """``w`` int32 ``[R, NB, Q]`` (Q <= 4 consecutive words of one 32-value scale block), ``s`` uint8
        ``[R, NB]`` E8M0 -> BF16 ``[R, NB*Q*8]`` in k order."""
        s16 = s.to(gl.int32) << 7
        s2 = gl.expand_dims(s16 | (s16 << 16), 2)
        s2 = gl.broadcast(s2, w)[0]
        o = gl.inline_asm_elementwise(_ASM_DEQ8, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r",
                                      [w, s2, c0, c1, c2, c3, c4], (gl.bfloat16,) * 8, True, 1)
        v = gl.join(gl.join(gl.join(o[0], o[4]), gl.join(o[2], o[6])),
                    gl.join(gl.join(o[1], o[5]), gl.join(o[3], o[7])))
        R: gl.constexpr = w.shape[0]
        NB: gl.constexpr = w.shape[1]
        Q: gl.constexpr = w.shape[2]
        return v.reshape([R, NB * Q * 8])

    @gluon.jit
    def _moe_fused_gluon(x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, w2_ptr, s2_ptr, ws_ptr, cnt_ptr, out_ptr,
                         lut_ptr, part_ptr, limit,
                         H: gl.constexpr, I: gl.constexpr, TOPK: gl.constexpr, M: gl.constexpr,
                         SP: gl.constexpr, BI: gl.constexpr, BK: gl.constexpr, BH: gl.constexpr,
                         HAS_LIMIT: gl.constexpr, FIXED: gl.constexpr, PARTIALS: gl.constexpr):
        NW: gl.constexpr = gl.num_warps()
        NPC: gl.constexpr = 8
        S: gl.constexpr = M * TOPK
        NJ: gl.constexpr = I // BI
        NPROG: gl.constexpr = NJ * S
        R1: gl.constexpr = 2 * BI
        NK1: gl.constexpr = H // BK
        NB1: gl.constexpr = BK // 32
        NB2: gl.constexpr = BI // 32 if BI >= 32 else 1
        Q2: gl.constexpr = 4 if BI >= 32 else BI // 8
        MV: gl.constexpr = 1 if M == 1 else (4 if M <= 4 else 8)     # workspace row stride (floats)
        HW: gl.constexpr = H // 8          # int32 words per w13 row
        IW: gl.constexpr = I // 8          # int32 words per w2 row

        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        RL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NW], [1, 0])
        WL1: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // NB1, NB1, 1], [NW, 1, 1], [2, 1, 0])
        SL1: gl.constexpr = gl.SliceLayout(2, WL1)
        WL2: gl.constexpr = gl.BlockedLayout([1, 1, Q2], [32 // NB2, NB2, 1], [NW, 1, 1], [2, 1, 0])
        SL2: gl.constexpr = gl.SliceLayout(2, WL2)
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [NPC, 32 // NPC], [1, NW], [1, 0])
        EL: gl.constexpr = gl.BlockedLayout([1, NPC], [32, 1], [NW, 1], [1, 0])
        ASL1: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SWZ2: gl.constexpr = 128 if BI * 2 >= 128 else BI * 2
        ASL2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=SWZ2, element_bitwidth=16, rank=2)
        HSL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

        j = gl.program_id(0)
        s = gl.program_id(1)

        # ---- routing: the slot's expert, dedup against earlier slots, per-token weights ----
        t = gl.arange(0, SP, layout=gl.SliceLayout(0, RL))
        ids = gl.load(ids_ptr + t, mask=t < S, other=-1)
        e = gl.load(ids_ptr + s)
        ndup = gl.sum(gl.where((ids == e) & (t < s), 1, 0), axis=0)
        if ndup == 0:
            tw = gl.load(tw_ptr + t, mask=t < S, other=0.0)
            mcol = gl.arange(0, NPC, layout=gl.SliceLayout(1, RL))
            sel = (ids[None, :] == e) & ((t // TOPK)[None, :] == mcol[:, None])
            wtok = gl.sum(gl.where(sel, tw[None, :], 0.0), axis=1)                  # [NPC]

            c0 = gl.load(lut_ptr)
            c1 = gl.load(lut_ptr + 1)
            c2 = gl.load(lut_ptr + 2)
            c3 = gl.load(lut_ptr + 3)
            c4 = gl.load(lut_ptr + 4)

            # ---- phase-1 addressing: gate|up rows of slice j; first two tiles in flight before anything else ----
            r = gl.arange(0, R1, layout=gl.SliceLayout(1, SL1))
            row = gl.where(r < BI, j * BI + r, I + j * BI + (r - BI))
            b1 = gl.arange(0, NB1, layout=gl.SliceLayout(0, SL1))
            q1 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL1)))
            wp = w13_ptr + e * (2 * I * HW) + (row[:, None, None] * HW + b1[None, :, None] * 4 + q1[None, None, :])
            sp = s13_ptr + e * (2 * I * (H // 32)) + (row[:, None] * (H // 32) + b1[None, :])
            w_c = gl.load(wp)
            s_c = gl.load(sp)
            w_n = gl.load(wp + (BK // 8), mask=NK1 > 1, other=0)
            s_n = gl.load(sp + (BK // 32), mask=NK1 > 1, other=0)

            # ---- stage x (tokens padded to 8 with zeros) in shared memory, one [8, BK] slab per k step; all
            # slabs as cp.async (zero-filled past M) in one group, so their latencies overlap ----
            xs = gl.allocate_shared_memory(gl.bfloat16, [NK1, NPC, BK], ASL1)
            xn = gl.arange(0, NPC, layout=gl.SliceLayout(1, XL))
            xk = gl.arange(0, BK, layout=gl.SliceLayout(0, XL))
            for kk in gl.static_range(NK1):
                async_copy.async_copy_global_to_shared(xs.index(kk), x_ptr + xn[:, None] * H + kk * BK + xk[None, :],
                                                       mask=xn[:, None] < M)
            async_copy.commit_group()
            async_copy.wait_group(0)
            gl.thread_barrier()

            # ---- phase 1: [gate|up rows] x x^T on tensor cores, loads two tiles ahead ----
            a_s = gl.allocate_shared_memory(gl.bfloat16, [R1, BK], ASL1)
            acc = gl.zeros([R1, NPC], gl.float32, MMA)
            for kk in range(NK1):
                pf = kk + 2 < NK1
                w_f = gl.load(wp + (kk + 2) * (BK // 8), mask=pf, other=0)
                s_f = gl.load(sp + (kk + 2) * (BK // 32), mask=pf, other=0)
                a_s.store(_g_dequant(w_c, s_c, c0, c1, c2, c3, c4))
                acc = mma_v2(a_s.load(DA), xs.index(kk).permute([1, 0]).load(DB), acc)
                w_c = w_n
                s_c = s_n
                w_n = w_f
                s_n = s_f

            # prefetch the first two down tiles while the SwiGLU epilogue runs
            NH: gl.constexpr = H // BH
            h = gl.arange(0, BH, layout=gl.SliceLayout(1, SL2))
            b2 = gl.arange(0, NB2, layout=gl.SliceLayout(0, SL2))
            q2 = gl.arange(0, Q2, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL2)))
            wp2 = w2_ptr + e * (H * IW) + (h[:, None, None] * IW + j * (BI // 8) + b2[None, :, None] * 4
                                           + q2[None, None, :])
            sp2 = s2_ptr + e * (H * (I // 32)) + (h[:, None] * (I // 32) + (j * BI) // 32 + b2[None, :])
            w2_c = gl.load(wp2)
            s2_c = gl.load(sp2)
            w2_n = gl.load(wp2 + BH * IW, mask=NH > 1, other=0)
            s2_n = gl.load(sp2 + BH * (I // 32), mask=NH > 1, other=0)

            # ---- SwiGLU + routing weight -> B operand of the down GEMV ----
            h_s = gl.allocate_shared_memory(gl.float32, [R1, NPC], HSL)
            h_s.store(acc)
            g = h_s.slice(0, BI, 0).load(EL)
            u = h_s.slice(BI, BI, 0).load(EL)
            a = g / (1.0 + gl.exp(-g))
            if HAS_LIMIT:
                a = gl.minimum(a, limit)
                u = gl.minimum(gl.maximum(u, -limit), limit)
            wt = gl.convert_layout(wtok, gl.SliceLayout(0, EL))
            act = gl.convert_layout((a * u * wt[None, :]).to(gl.bfloat16), DB)          # [BI, 8]

            # ---- phase 2: down rows (all H) x slice j, atomically accumulated ----
            a2_s = gl.allocate_shared_memory(gl.bfloat16, [BH, BI], ASL2)
            zero = gl.zeros([BH, NPC], gl.float32, MMA)
            if M == 1:
                OL1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
                ho = gl.arange(0, BH, layout=OL1)
            else:
                OL: gl.constexpr = gl.BlockedLayout([1, MV], [32, 1], [NW, 1], [1, 0])
                ho2 = gl.arange(0, BH, layout=gl.SliceLayout(1, OL))
                no2 = gl.arange(0, MV, layout=gl.SliceLayout(0, OL))
            for hb in range(NH):
                pf2 = hb + 2 < NH
                w2_f = gl.load(wp2 + (hb + 2) * (BH * IW), mask=pf2, other=0)
                s2_f = gl.load(sp2 + (hb + 2) * (BH * (I // 32)), mask=pf2, other=0)
                a2_s.store(_g_dequant(w2_c, s2_c, c0, c1, c2, c3, c4))
                d = mma_v2(a2_s.load(DA), act, zero)
                if M == 1:
                    col = gl.arange(0, NPC, layout=gl.SliceLayout(0, MMA))
                    d1 = gl.convert_layout(gl.sum(gl.where(col[None, :] == 0, d, 0.0), axis=1), OL1)
                    if PARTIALS:
                        gl.store(part_ptr + (j * S + s) * H + hb * BH + ho, d1)
                    else:
                        if FIXED:
                            d1 = (d1 * FIXED_ONE).to(gl.int64)
                        gl.atomic_add(ws_ptr + hb * BH + ho, d1, sem="relaxed", scope="gpu")
                else:
                    if MV == NPC:
                        dd = gl.convert_layout(d, OL)
                    else:       # keep columns 0..3 of the 8: [BH, 8] -> [BH, 4, 2] -> first half
                        RL8: gl.constexpr = gl.BlockedLayout([1, NPC], [32, 1], [NW, 1], [1, 0])
                        d8 = gl.convert_layout(d, RL8)
                        d3 = gl.permute(gl.reshape(d8, [BH, 2, MV]), [0, 2, 1])
                        dd = gl.convert_layout(gl.split(d3)[0], OL)
                    if PARTIALS:
                        gl.store(part_ptr + ((j * S + s) * H + hb * BH + ho2[:, None]) * MV + no2[None, :], dd,
                                 mask=no2[None, :] < M)
                    else:
                        if FIXED:
                            dd = (dd * FIXED_ONE).to(gl.int64)
                        gl.atomic_add(ws_ptr + (hb * BH + ho2[:, None]) * MV + no2[None, :], dd,
                                      mask=no2[None, :] < M, sem="relaxed", scope="gpu")
                w2_c = w2_n
                s2_c = s2_n
                w2_n = w2_f
                s2_n = s2_f

        # (PARTIALS: no ticket; the second kernel, _moe_reduce_partials, sums the per-program partials)
        if not PARTIALS:
            # ---- completion ticket: the last program converts the workspace and re-arms it ----
            FL: gl.constexpr = gl.BlockedLayout([1, NPC], [32, 1], [NW, 1], [1, 0])
            fz = gl.arange(0, 32 * NW, layout=gl.SliceLayout(1, FL))
            gl.inline_asm_elementwise(_ASM_FENCE, "=r,r", [fz], gl.int32, False, 1)   # every thread: fence
            gl.thread_barrier()
            ticket = gl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
            if ticket == NPROG - 1:
                FV: gl.constexpr = 8 if H >= 8 * 32 * NW else 1
                FB: gl.constexpr = FV * 32 * NW
                FL2: gl.constexpr = gl.BlockedLayout([FV, MV], [32, 1], [NW, 1], [1, 0])
                fh = gl.arange(0, FB, layout=gl.SliceLayout(1, FL2))
                fn = gl.arange(0, MV, layout=gl.SliceLayout(0, FL2))
                for f0 in range(0, H, FB):
                    fm = (f0 + fh[:, None]) < H
                    p = ws_ptr + (f0 + fh[:, None]) * MV + fn[None, :]
                    if FIXED:
                        v = gl.load(p, mask=fm, other=0, cache_modifier=".cg").to(gl.float32) * (1.0 / FIXED_ONE)
                        gl.store(p, gl.zeros([FB, MV], gl.int64, FL2), mask=fm)
                    else:
                        v = gl.load(p, mask=fm, other=0.0, cache_modifier=".cg")
                        gl.store(p, gl.zeros([FB, MV], gl.float32, FL2), mask=fm)
                    gl.store(out_ptr + fn[None, :] * H + f0 + fh[:, None], v.to(gl.bfloat16), mask=fm & (fn[None, :] < M))
                gl.store(cnt_ptr, 0)


# ---------------------------------------------------------------------------------------------------------
# Plain-Triton implementation (tl.dot_scaled; the compiler's MX up-cast) - same algorithm, the fallback
# ---------------------------------------------------------------------------------------------------------
if tl is not None:
    @triton.jit
    def _moe_fused_tl(x_ptr, ids_ptr, tw_ptr, w13_ptr, s13_ptr, w2_ptr, s2_ptr, ws_ptr, cnt_ptr, out_ptr,
                      part_ptr, limit,
                      H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, M: tl.constexpr, SP: tl.constexpr,
                      BI: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, HAS_LIMIT: tl.constexpr,
                      FIXED: tl.constexpr, PARTIALS: tl.constexpr = False, FENCE: tl.constexpr = True):
        NPC: tl.constexpr = 16
        MVP: tl.constexpr = 1 if M == 1 else 4       # partials' token stride (as the gluon kernel's MV)
        S: tl.constexpr = M * TOPK
        NPROG: tl.constexpr = (I // BI) * S
        j = tl.program_id(0)
        s = tl.program_id(1)
        t = tl.arange(0, SP)
        ids = tl.load(ids_ptr + t, mask=t < S, other=-1)
        e = tl.load(ids_ptr + s)
        ndup = tl.sum(tl.where((ids == e) & (t < s), 1, 0), axis=0)
        if ndup == 0:
            tw = tl.load(tw_ptr + t, mask=t < S, other=0.0)
            mcol = tl.arange(0, NPC)
            sel = (ids[None, :] == e) & ((t // TOPK)[None, :] == mcol[:, None])
            wtok = tl.sum(tl.where(sel, tw[None, :], 0.0), axis=1)
            ri = j * BI + tl.arange(0, BI)
            kb = tl.arange(0, BK // 2)
            ks = tl.arange(0, BK // 32)
            kx = tl.arange(0, BK)
            wg = w13_ptr + e * (2 * I * (H // 2)) + ri[:, None] * (H // 2) + kb[None, :]
            sg = s13_ptr + e * (2 * I * (H // 32)) + ri[:, None] * (H // 32) + ks[None, :]
            xp = x_ptr + mcol[None, :] * H + kx[:, None]
            accg = tl.zeros([BI, NPC], tl.float32)
            accu = tl.zeros([BI, NPC], tl.float32)
            for kk in range(0, H // BK):
                xt = tl.load(xp + kk * BK, mask=mcol[None, :] < M, other=0.0)
                accg = tl.dot_scaled(tl.load(wg + kk * (BK // 2)), tl.load(sg + kk * (BK // 32)), "e2m1",
                                     xt, None, "bf16", accg)
                accu = tl.dot_scaled(tl.load(wg + I * (H // 2) + kk * (BK // 2)),
                                     tl.load(sg + I * (H // 32) + kk * (BK // 32)), "e2m1", xt, None, "bf16", accu)
            a = accg / (1.0 + tl.exp(-accg))
            u = accu
            if HAS_LIMIT:
                a = tl.minimum(a, limit)
                u = tl.minimum(tl.maximum(u, -limit), limit)
            act = (a * u * wtok[None, :]).to(tl.bfloat16)                                  # [BI, NPC]
            hr = tl.arange(0, BH)
            ib = tl.arange(0, BI // 2)
            isb = tl.arange(0, BI // 32)
            w2p = w2_ptr + e * (H * (I // 2)) + hr[:, None] * (I // 2) + j * (BI // 2) + ib[None, :]
            s2p = s2_ptr + e * (H * (I // 32)) + hr[:, None] * (I // 32) + j * (BI // 32) + isb[None, :]
            for hb in range(0, H // BH):
                d = tl.dot_scaled(tl.load(w2p + hb * BH * (I // 2)), tl.load(s2p + hb * BH * (I // 32)), "e2m1",
                                  act, None, "bf16")
                if PARTIALS:
                    mvec = tl.arange(0, MVP)
                    dv = tl.sum(tl.where(mcol[None, None, :] == mvec[None, :, None], d[:, None, :], 0.0), axis=2)
                    tl.store(part_ptr + ((j * S + s) * H + hb * BH + hr[:, None]) * MVP + mvec[None, :], dv,
                             mask=mvec[None, :] < M)
                else:
                    if FIXED:
                        d = (d * FIXED_ONE).to(tl.int64)
                    tl.atomic_add(ws_ptr + (hb * BH + hr[:, None]) * 8 + mcol[None, :], d, mask=mcol[None, :] < M,
                                  sem="relaxed", scope="gpu")
        if not PARTIALS:        # (PARTIALS: the second kernel, _moe_reduce_partials, sums the partials)
            if FENCE:   # (False only under TRITON_INTERPRET, which cannot run PTX)
                tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r", [tl.arange(0, 128)],
                                          dtype=tl.int32, is_pure=False, pack=1)
            tl.debug_barrier()
            ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
            if ticket == NPROG - 1:
                fh = tl.arange(0, 256)
                fn = tl.arange(0, 8)
                for f0 in range(0, H, 256):
                    fm = (f0 + fh[:, None]) < H
                    p = ws_ptr + (f0 + fh[:, None]) * 8 + fn[None, :]
                    if FIXED:
                        v = tl.load(p, mask=fm, other=0, cache_modifier=".cg").to(tl.float32) * (1.0 / FIXED_ONE)
                        tl.store(p, tl.zeros([256, 8], tl.int64), mask=fm)
                    else:
                        v = tl.load(p, mask=fm, other=0.0, cache_modifier=".cg")
                        tl.store(p, tl.zeros([256, 8], tl.float32), mask=fm)
                    tl.store(out_ptr + fn[None, :] * H + f0 + fh[:, None], v.to(tl.bfloat16), mask=fm & (fn[None, :] < M))
                tl.store(cnt_ptr, 0)


if tl is not None:
    @triton.jit
    def _moe_reduce_partials(part_ptr, ids_ptr, out_ptr, H: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                             NJ: tl.constexpr, M: tl.constexpr, MV: tl.constexpr, BHR: tl.constexpr):
        """Second kernel of the ``partials`` mode: ``out[m, h] = sum over (j, s) of part[j, s, h, m]`` for the
        slots ``s`` that own their expert (the first slot that chose it, the fused kernel's dedup rule), in one
        fixed order: no atomics, so the result is bit-identical run to run. ``part float32 [NJ, S, H, MV]``;
        grid ``(H // BHR,)``; slots that are duplicates were never written and are masked out."""
        pid = tl.program_id(0)
        t = tl.arange(0, SP)
        ids = tl.load(ids_ptr + t, mask=t < S, other=-1)
        dup = tl.sum(((ids[:, None] == ids[None, :]) & (t[None, :] < t[:, None])).to(tl.int32), axis=1)
        valid = (dup == 0) & (t < S)                                                          # [SP]
        h = pid * BHR + tl.arange(0, BHR)
        mv = tl.arange(0, MV)
        acc = tl.zeros([BHR, MV], tl.float32)
        for jj in range(NJ):
            p = part_ptr + ((jj * S + t[:, None, None]) * H + h[None, :, None]) * MV + mv[None, None, :]
            v = tl.load(p, mask=valid[:, None, None] & (mv[None, None, :] < M), other=0.0)    # [SP, BHR, MV]
            acc += tl.sum(v, axis=0)
        tl.store(out_ptr + mv[None, :] * H + h[:, None], acc.to(tl.bfloat16), mask=mv[None, :] < M)


# ---------------------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------------------
REDUCE_BH = 32             # hidden rows per program of _moe_reduce_partials (80 programs at H = 2560); config
#                            keys "reduce_bh" / "reduce_warps" override it
_SCRATCH: dict = {}        # (device, name) -> buffers shared by every binding (partials mode, 'split' variant)


def scratch(device, name: str, numel: int, dtype=torch.float32) -> torch.Tensor:
    """A zero-initialised buffer ``name`` of at least ``numel`` elements, shared by every MoE binding on
    ``device``: the partials mode's per-program partials ``[NJ, S, H, MV]``, the ``split`` variant's activations,
    partials and tickets.

    One buffer serves every MoE layer: the layers run one after another on one stream and each launch has
    consumed its scratch before the next layer's writes it (at full scale 15.7 MB of partials instead of 0.6 GB
    for 40 per-layer copies). Ticket buffers stay zero between launches (each launch resets its own). Growing a
    buffer keeps the older ones alive, because a captured CUDA graph holds their addresses."""
    bufs = _SCRATCH.setdefault((str(torch.device(device)), name), [])
    if not bufs or bufs[-1].numel() < numel:
        bufs.append(torch.zeros(numel, dtype=dtype, device=device))
    return bufs[-1]


def shape_key(e: int, h: int, i: int, k: int, m: int) -> str:
    return f"E{e}_H{h}_I{i}_k{k}_M{m}"


def gpu_name(device=None) -> str:
    """``torch.cuda.get_device_name(device)``, or ``"cpu"`` without CUDA."""
    return torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"


def gpu_arch(device=None) -> str | None:
    """The CUDA architecture of ``device`` as ``"sm_<major><minor>"`` (``torch.cuda.get_device_capability``;
    e.g. ``"sm_90"`` for every Hopper part: H100, H200, H800, H20, GH200), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def load_configs(path: Path = CONFIG_PATH) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}


UNTUNED = "untuned class default"


def resolve_config(e, h, i, k, m, device=None, path: Path | None = None) -> tuple[dict, str]:
    """The launch config for this GPU and shape, and which table key supplied it (recorded in the manifest).

    Lookup order, for the shape key ``E{e}_H{h}_I{i}_k{k}_M{m}`` (:func:`shape_key`):

    1. the entry under the exact device name (``torch.cuda.get_device_name()``) -> ``"tuned for <name>"``;
    2. the architecture default: the table's ``"_arch_defaults"`` maps an architecture (:func:`gpu_arch`, e.g.
       ``"sm_90"``) to the GPU whose entries every part of that architecture uses (all sm_90 GPUs run the H200's
       tuned ``split`` kernels, and with them the fused shared expert) -> ``"sm_90 default (tuned on NVIDIA H200)"``;
       the tuning depends on the memory system and SM count, which differ within an architecture, so a GPU's own
       tuned entries (``scripts/bench_moe.py --tune``) come first;
    3. :data:`DEFAULT_CONFIG` -> ``"untuned class default (...)"``.

    The table is ``configs/triton_moe.json``, or the file named by the environment variable
    ``BYTEBOUND_MOE_CONFIG`` (e.g. a fresh ``bench_moe.py --tune`` table; the source then names the file). The
    environment variable ``BYTEBOUND_MOE_VARIANT`` (gluon | tl | split) forces the implementation after the lookup:
    the entry's tiling carries over between the two implementations of the fused algorithm, a ``split`` entry to
    ``split``; otherwise the forced variant's defaults.

    Returns:
        ``(config dict, source str)``; the config is not yet fitted to the shape (:func:`fit_config`).
    """
    env_path = os.environ.get("BYTEBOUND_MOE_CONFIG")
    path = Path(path or env_path or CONFIG_PATH)
    table = load_configs(path)
    key = shape_key(e, h, i, k, m)
    name, arch = gpu_name(device), gpu_arch(device)
    tuned_on = table.get("_arch_defaults", {}).get(arch) if arch else None
    cfg = dict(DEFAULT_CONFIG)
    if key in table.get(name, {}):
        cfg.update(table[name][key])
        source = f"tuned for {name}"
    elif tuned_on and key in table.get(tuned_on, {}):
        cfg.update(table[tuned_on][key])
        source = f"{arch} default (tuned on {tuned_on})"
    else:
        where = name if arch is None else f"{name} or {arch}"
        source = f"{UNTUNED} (no entry for {where} at {key})"
    if path != CONFIG_PATH:
        source += f", table {path}"
    forced = os.environ.get("BYTEBOUND_MOE_VARIANT")
    if forced == "split":
        cfg = dict(_split().SPLIT_DEFAULT, **(cfg if cfg.get("variant") == "split" else {}))
    elif forced:
        # the table entry's tiling carries over only between the two implementations of the fused algorithm
        keep = cfg if cfg.get("variant") in ("gluon", "tl") else {}
        cfg = dict(TL_DEFAULT_CONFIG if forced == "tl" else DEFAULT_CONFIG, **{kk: v for kk, v in keep.items()
                                                                           if kk not in ("variant",)})
        cfg["variant"] = forced
    if forced:
        source += f"; variant forced by BYTEBOUND_MOE_VARIANT={forced}"
    return cfg, source


def lookup_config(e, h, i, k, m, device=None, path: Path | None = None) -> dict:
    """The launch config of :func:`resolve_config` without its source."""
    return resolve_config(e, h, i, k, m, device, path)[0]


def _split():
    """The ``split`` variant's module (imported on first use: it imports this one)."""
    from bytebound.kernels import triton_moe_split
    return triton_moe_split


def _fit(block: int, n: int, lo: int) -> int:
    """Largest power-of-two block <= ``block`` that divides ``n`` (>= ``lo``), else 0 (tensor shapes must be
    powers of two)."""
    b = 1 << (max(int(block), 1).bit_length() - 1)
    while b >= lo:
        if n % b == 0:
            return b
        b //= 2
    return 0


def fit_config(cfg: dict, h: int, i: int) -> dict:
    """Shrink BI/BK/BH to divide this model's I/H (tiny test models); raises BackendError if impossible."""
    if cfg.get("variant") == "split":
        return _split().fit_split_config(cfg, h, i)
    cfg = dict(cfg)
    lo_bi = 16 if cfg["variant"] == "gluon" else 32
    cfg["BI"] = _fit(cfg["BI"], i, lo_bi)
    cfg["BK"] = _fit(cfg["BK"], h, 32)
    cfg["BH"] = _fit(cfg["BH"], h, 16)
    if not (cfg["BI"] and cfg["BK"] and cfg["BH"]) or cfg["BK"] // 32 > 32:
        raise BackendError(f"moe[triton]: no tiling of H={h}, I={i} for config {cfg} (H and I must be multiples "
                           "of 32; use moe backend 'torch' or 'humming')")
    if cfg["BI"] < 32 and cfg["num_warps"] > 2:
        cfg["num_warps"] = 2
    return cfg


class MoEKernel:
    """The bound callable for one ``RoutedExperts``: owns the workspace ``[H, 8]`` float32, the ticket
    counter and the per-M configs; ``__call__(x, ids, w)`` launches the configured variant (module docstring)."""

    max_tokens = MAX_M

    def __init__(self, ex, configs: dict[int, dict] | None = None):
        if ex.fmt != "mxfp4":
            raise BackendError(f"moe[triton] needs MXFP4 experts, got fmt={ex.fmt!r} (use moe backend 'torch')")
        dev = ex.w13.device
        if dev.type != "cuda":
            raise BackendError("moe[triton] needs the experts on a CUDA device")
        self.ex = ex
        self.e, self.h, self.i = ex.n, ex.hidden, ex.inter
        if ex.w13_scale.dtype != torch.uint8 or ex.w2_scale.dtype != torch.uint8:
            raise BackendError("moe[triton]: scales must be uint8 E8M0 bytes")
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            if not getattr(ex, name).is_contiguous():
                raise BackendError(f"moe[triton]: experts.{name} must be contiguous")
        # int32 word views of the packed codes (no copy)
        self.w13w = ex.w13.data.view(torch.uint8).view(torch.int32)
        self.w2w = ex.w2.data.view(torch.uint8).view(torch.int32)
        self.s13 = ex.w13_scale.data
        self.s2 = ex.w2_scale.data
        # one workspace per accumulation mode (int64 fixed point: deterministic; float32: the atomics' order)
        self.ws = {True: torch.zeros(self.h, NP, dtype=torch.int64, device=dev),
                   False: torch.zeros(self.h, NP, dtype=torch.float32, device=dev)}
        self.cnt = torch.zeros(1, dtype=torch.int32, device=dev)
        self.lut = _lut_tensor(dev)
        self.sm90 = torch.cuda.get_device_capability(dev)[0] >= 9     # PDL (the 'split' variant's kernel B)
        self.limit = ex.limit
        self.configs = dict(configs or {})
        self._fitted: dict[int, tuple] = {}  # m -> (the config it was fitted from, fitted to (H, I), its source)
        # Delegate for M > MAX_M (bind_model sets it to this kernel over 4-token slices; humming or torch also
        # fit); None -> BackendError, as the registry contract asks.
        self.prefill = None
        self.shared = None     # triton_moe_split.SharedFP8: the layer's shared expert, inside the 'split' kernels

    def bind_shared(self, mlp) -> None:
        """Run the layer's shared expert (``mlp``, a ``layers.moe.DenseMLP`` with FP8 128x128-block projections)
        inside the ``split`` kernels, as one more slot of each: ``__call__`` then returns routed + shared for the
        token counts whose config is ``split`` (:meth:`shared_for`), and the layer skips its own shared expert
        there. The gate and up weights are copied once into one ``[2I, H]`` tensor (3.9 MB per Ling-3.0-flash
        layer); the block scales become BF16x2 factors ``scale x 2^120`` (see ``triton_moe_split._ASM_FP8X4``).

        Raises:
            BackendError: the projections are not FP8 with 128x128 blocks, the shared intermediate size differs
                from the routed one, or a block scale is not a power of two of at most 2^7 (the checkpoint's
                ``scale_fmt: ue8m0``; ``scale x 2^120`` must be a normal BF16)."""
        from bytebound.kernels.triton_moe_split import shared_fp8
        self.shared = shared_fp8(mlp, self.h, self.i)

    def shared_for(self, m: int, k: int) -> bool:
        """Whether ``__call__`` with ``m`` tokens of top-``k`` routing includes the shared expert (bound, and a
        ``split`` config for ``m``)."""
        return self.shared is not None and m <= MAX_M and self.config(m, k)["variant"] == "split"

    def config(self, m: int, k: int) -> dict:
        """The launch config for ``m`` tokens: a caller-given one (``configs``) or the table's, fitted to this
        model's shape once."""
        return self._config(m, k)[1]

    def config_source(self, m: int, k: int) -> str:
        """Which table key supplied :meth:`config` for ``m`` tokens (:func:`resolve_config`'s source, or
        ``"given by the caller"``), prefixed with the variant: e.g. ``"split, sm_90 default (tuned on NVIDIA
        H200)"``."""
        _, cfg, source = self._config(m, k)
        return f"{cfg['variant']}, {source}"

    def _config(self, m: int, k: int) -> tuple:
        src = self.configs.get(m)
        done = self._fitted.get(m)
        if done is None or done[0] is not src:       # (the cache holds src, so identity cannot be recycled)
            if src is None:
                cfg, source = resolve_config(self.e, self.h, self.i, k, m, self.cnt.device)
            else:
                cfg, source = src, "given by the caller"
            done = (src, fit_config(cfg, self.h, self.i), source)
            self._fitted[m] = done
        return done

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, shared: bool = True) -> torch.Tensor:
        """Routed sum ``[M, H]`` bf16, plus the bound shared expert when ``shared`` and :meth:`shared_for` (the
        prefill delegate calls with ``shared=False``: there the layer adds its dense shared expert itself)."""
        m, k = ids.shape
        if m > MAX_M:
            if self.prefill is not None:
                return self.prefill(x, ids, w)
            raise BackendError(f"moe[triton] handles at most {MAX_M} tokens per call (got {m}); "
                               "bind 'humming' or 'torch' for prefill (or set fn.prefill)")
        if x.dtype != torch.bfloat16:
            raise BackendError(f"moe[triton] needs bf16 activations, got {x.dtype}")
        cfg = self.config(m, k)
        x = x.contiguous()
        ids = ids.contiguous()
        w = w.to(torch.float32).contiguous()
        out = torch.empty(m, self.h, dtype=torch.bfloat16, device=x.device)
        if cfg["variant"] == "split":
            _split().launch_split(self, x, ids, w, out, cfg, self.shared if shared else None)
            return out
        grid = (self.i // cfg["BI"], m * k)
        sp = triton.next_power_of_2(max(m * k, 32))
        limit = float(self.limit) if self.limit is not None else 0.0
        fixed = bool(cfg.get("deterministic", True))
        partials = bool(cfg.get("partials", False))
        ws = self.ws[fixed]
        nj, mv = self.i // cfg["BI"], (1 if m == 1 else 4)
        part = scratch(x.device, "partials", nj * m * k * self.h * mv) if partials else ws
        common = dict(H=self.h, I=self.i, TOPK=k, M=m, SP=sp, BI=cfg["BI"], BK=cfg["BK"], BH=cfg["BH"],
                      HAS_LIMIT=self.limit is not None, FIXED=fixed, PARTIALS=partials)
        if cfg["variant"] == "gluon":
            if gluon is None:
                raise BackendError(f"moe[triton] variant 'gluon': {_GLUON_ERR}")
            _moe_fused_gluon[grid](x, ids, w, self.w13w, self.s13, self.w2w, self.s2, ws, self.cnt, out,
                                   self.lut, part, limit, num_warps=cfg["num_warps"], **common)
        elif cfg["variant"] == "tl":
            _moe_fused_tl[grid](x, ids, w, self.ex.w13.data, self.s13, self.ex.w2.data, self.s2, ws,
                                self.cnt, out, part, limit, num_warps=cfg["num_warps"],
                                num_stages=cfg.get("num_stages", 3), **common)
        else:
            raise BackendError(f"moe[triton]: unknown variant {cfg['variant']!r}")
        if partials:
            bhr = _fit(cfg.get("reduce_bh", REDUCE_BH), self.h, 1)
            _moe_reduce_partials[(self.h // bhr,)](part, ids, out, H=self.h, S=m * k, SP=sp, NJ=nj, M=m, MV=mv,
                                                   BHR=bhr, num_warps=cfg.get("reduce_warps", 4))
        return out

    def weight_bytes(self, n_experts: int) -> int:
        """Bytes of weights + scales read for ``n_experts`` distinct experts."""
        per = (self.ex.w13[0].numel() + self.ex.w13_scale[0].numel() + self.ex.w2[0].numel()
               + self.ex.w2_scale[0].numel())
        return n_experts * per


@register("moe", "triton", available)
class TritonMoE:
    """Fused MXFP4 MoE for M <= 4 (decode and MTP verify). See the module docstring."""
    name = "triton"

    def __init__(self, configs: dict[int, dict] | None = None):
        self.configs = configs

    def bind(self, ex, dtype):
        if dtype != torch.bfloat16:
            raise BackendError(f"moe[triton] runs in bf16, model dtype is {dtype}")
        return MoEKernel(ex, self.configs)
