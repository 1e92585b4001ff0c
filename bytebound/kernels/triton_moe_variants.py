"""Variants ``gluon`` and ``tl`` of backend ``triton``, op ``moe``: the routed MoE as one fused kernel per call.

These run where no tuned ``split`` entry applies (``moe_host.DEFAULT_CONFIG``, the class default, is ``gluon``) or
where ``BYTEBOUND_MOE_VARIANT`` or a table entry names them; every sm_90 GPU runs the ``split`` variant
(``triton_moe_split.py``). The host object that launches them is ``moe_host.MoEKernel`` (:func:`launch_fused`).

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
   table (``triton_moe_split.ASM_DEQ8``: 8 values per 32-bit word, ~2.6 instructions per weight including the
   E8M0 scale multiply), staged through shared memory and read back with ldmatrix.
3. SwiGLU (optional clamp ``silu(g).clamp(max=L) * u.clamp(-L, L)``) and the routing weight, in float32; the
   slice's activations become the BF16 B operand of
4. **down GEMV** over the slice: ``w2[e, :, j-slice]`` (all H rows, BI columns) -> partial ``[H, M]`` added with
   atomics into a per-binding workspace ``[H, 8]``: int64 fixed point by default (:data:`FIXED_SHIFT`; integer
   sums do not depend on arrival order, so outputs are bit-identical run to run and graph == eager), or float32
   (config ``"deterministic": false``; order-dependent in the last bit).
5. The last program to finish (an acq_rel ticket counter) converts the workspace to the BF16 output and zeroes
   the workspace and the counter for the next call, so one launch is the whole op and it is CUDA-graph safe.

Config ``"partials": true`` replaces 4-5 by plain stores: each program writes its float32 partial ``[H, M]`` to
its own slot of a shared scratch ``[I/BI, M*top_k, H, M]`` (``kernels.scratch``) and a second kernel
(``_moe_reduce_partials``) sums the slots in a fixed order. Also bit-identical run to run, without the int64
atomics, at the price of writing and reading the partials (15.7 MB at M = 4 with BI 64, 1 MB at M = 1) and a
second launch (measurements: docs/perf/moe-kernels-h200.md).

Two implementations of the same algorithm: ``gluon`` (Triton's explicit-layout dialect: the register layouts are
chosen so the dequantisation needs no shuffles) and ``tl`` (plain Triton with ``tl.dot_scaled``; the compiler's
generic MX up-cast, slower, kept as the fallback). Both are specialised per exact shape ``(E, H, I, top_k, M)`` as
constexprs and cached by Triton's JIT. Config keys: ``BI``, ``BK`` (gate/up K step), ``BH`` (down rows per step),
``num_warps``, ``num_stages`` (``tl``), ``deterministic``, ``partials``, ``reduce_bh``, ``reduce_warps``
(:func:`fit_fused_config` fits the tiling to a model's shape).
"""

from __future__ import annotations

import torch

from bytebound.errors import BackendError
from bytebound.kernels.registry import optional_triton
from bytebound.kernels.scratch import scratch
from bytebound.kernels.triton_moe_split import ASM_DEQ8, ASM_FENCE, GLUON_ERR, fit_pow2, gl, gluon

triton, tl, _TRITON_ERR = optional_triton()      # None, None, reason on machines without Triton

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# Deterministic accumulation: partial sums enter the workspace as int64 fixed point (value * 2^28), and integer
# addition does not depend on the order the programs arrive in, so the output is bit-identical run to run (float32
# atomics differ in the last bit of a few outputs per call: docs/perf/moe-kernels-h200.md). Resolution 2^-28 = 3.7e-9 absolute, range +-3.4e10:
# far below bf16's 3 significant digits for any value a hidden state holds.
FIXED_SHIFT = 28
FIXED_ONE = tl.constexpr(float(1 << FIXED_SHIFT)) if tl is not None else None
REDUCE_BH = 32             # hidden rows per program of _moe_reduce_partials (80 programs at H = 2560); config
#                            keys "reduce_bh" / "reduce_warps" override it


# ---------------------------------------------------------------------------------------------------------
# Gluon implementation
# ---------------------------------------------------------------------------------------------------------
if gluon is not None:
    @gluon.jit
    def _g_dequant(w, s, c0, c1, c2, c3, c4):
        """``w`` int32 ``[R, NB, Q]`` (Q <= 4 consecutive words of one 32-value scale block), ``s`` uint8
        ``[R, NB]`` E8M0 -> BF16 ``[R, NB*Q*8]`` in k order."""
        s16 = s.to(gl.int32) << 7
        s2 = gl.expand_dims(s16 | (s16 << 16), 2)
        s2 = gl.broadcast(s2, w)[0]
        o = gl.inline_asm_elementwise(ASM_DEQ8, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r",
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
            gl.inline_asm_elementwise(ASM_FENCE, "=r,r", [fz], gl.int32, False, 1)   # every thread: fence
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
    from bytebound.kernels.pdl import ticket as pdl_ticket     # a split's ticket: fence, barrier, acq_rel add

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
            # FENCE: False only under TRITON_INTERPRET, which cannot run PTX. 128 elements: at least one per thread
            # up to 4 warps (a wider launch replicates them)
            ticket = pdl_ticket(cnt_ptr, FENCE, 128)
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


def fit_fused_config(cfg: dict, h: int, i: int) -> dict:
    """Shrink a ``gluon`` / ``tl`` config's BI/BK/BH to divide this model's I/H (tiny test models).

    Raises:
        BackendError: no power-of-two tiling fits (H and I must be multiples of 32)."""
    cfg = dict(cfg)
    lo_bi = 16 if cfg["variant"] == "gluon" else 32
    cfg["BI"] = fit_pow2(cfg["BI"], i, lo_bi)
    cfg["BK"] = fit_pow2(cfg["BK"], h, 32)
    cfg["BH"] = fit_pow2(cfg["BH"], h, 16)
    if not (cfg["BI"] and cfg["BK"] and cfg["BH"]) or cfg["BK"] // 32 > 32:
        raise BackendError(f"moe[triton]: no tiling of H={h}, I={i} for config {cfg} (H and I must be multiples "
                           "of 32; use moe backend 'torch' or 'humming')")
    if cfg["BI"] < 32 and cfg["num_warps"] > 2:
        cfg["num_warps"] = 2
    return cfg


def launch_fused(kern, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: dict) -> None:
    """Run the fused kernel (and, in the ``partials`` mode, the reduce) for one call of
    :class:`~bytebound.kernels.moe_host.MoEKernel` ``kern`` with the fitted ``gluon`` / ``tl`` config ``cfg``.

    ``x bf16 [M, H]``, ``ids int32/int64 [M, k]``, ``w float32 [M, k]`` (contiguous), ``out bf16 [M, H]``. The
    atomic workspace ``kern.ws`` and ticket ``kern.cnt`` belong to the binding, the partials to ``kernels.scratch``.

    Raises:
        BackendError: variant ``gluon`` without an importable Gluon, or a variant that is neither ``gluon`` nor
            ``tl``."""
    m, k = ids.shape
    grid = (kern.i // cfg["BI"], m * k)
    sp = triton.next_power_of_2(max(m * k, 32))
    limit = float(kern.limit) if kern.limit is not None else 0.0
    fixed = bool(cfg.get("deterministic", True))
    partials = bool(cfg.get("partials", False))
    ws = kern.ws[fixed]
    nj, mv = kern.i // cfg["BI"], (1 if m == 1 else 4)
    part = scratch(x.device, "partials", nj * m * k * kern.h * mv) if partials else ws
    common = dict(H=kern.h, I=kern.i, TOPK=k, M=m, SP=sp, BI=cfg["BI"], BK=cfg["BK"], BH=cfg["BH"],
                  HAS_LIMIT=kern.limit is not None, FIXED=fixed, PARTIALS=partials)
    if cfg["variant"] == "gluon":
        if gluon is None:
            raise BackendError(f"moe[triton] variant 'gluon': {GLUON_ERR}")
        _moe_fused_gluon[grid](x, ids, w, kern.w13w, kern.s13, kern.w2w, kern.s2, ws, kern.cnt, out,
                               kern.lut, part, limit, num_warps=cfg["num_warps"], **common)
    elif cfg["variant"] == "tl":
        _moe_fused_tl[grid](x, ids, w, kern.ex.w13.data, kern.s13, kern.ex.w2.data, kern.s2, ws,
                            kern.cnt, out, part, limit, num_warps=cfg["num_warps"],
                            num_stages=cfg.get("num_stages", 3), **common)
    else:
        raise BackendError(f"moe[triton]: unknown variant {cfg['variant']!r}")
    if partials:
        bhr = fit_pow2(cfg.get("reduce_bh", REDUCE_BH), kern.h, 1)
        _moe_reduce_partials[(kern.h // bhr,)](part, ids, out, H=kern.h, S=m * k, SP=sp, NJ=nj, M=m, MV=mv,
                                               BHR=bhr, num_warps=cfg.get("reduce_warps", 4))
