"""The Triton MLA decode/verify path (``kernels.triton_mla``) against the layer's torch code and a float64 reference.

The float64 reference is the *expanded* form (keys and values expanded per head from the latents through
``kv_b_proj``, DeepSeek-V2 eq. 9-11), so it also checks the absorption algebra, not only the kernels. Small head
counts with the real 512-wide latent and 64-wide rope; YaRN rope as in Ling-3.0. On a CPU machine the kernels run
in Triton's interpreter (TRITON_INTERPRET=1); CI has no Triton and skips with that reason. Full Ling shapes, graph
replay and 32K contexts run on the GPU (tests/gpu/test_mla_gpu.py)."""

from __future__ import annotations

import math

import pytest
import torch

from bytebound.config import tiny_config
from bytebound.errors import BackendError
from bytebound.layers.mla import GatedMLA
from conftest import ROOT, compiled_in_subprocess, needs_triton, triton_module_fixture

mla = triton_module_fixture("mla", "bytebound.kernels.triton_mla", bf16_round_nearest=True)
fp8k = triton_module_fixture("fp8k", "bytebound.kernels.triton_fp8", bf16_round_nearest=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 131072}
# tiny tilings so that the interpreter runs several key blocks, several splits (some empty, some partly past the
# span) and several split chunks in the merge (a partial one when the split count is odd)
SMALL = {"BN": 16, "split": 32, "combine_SB": 2}


def make_layer(heads: int, nope: int, vdim: int, seed: int = 0) -> GatedMLA:
    cfg = tiny_config(num_attention_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=nope,
                      v_head_dim=vdim, hidden_size=64, rope_scaling=YARN)
    layer = GatedMLA(cfg, lambda name: "plain", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        layer.kv_a_layernorm.weight.copy_(torch.rand(512, generator=g) + 0.5)
    layer = layer.to(device=DEV, dtype=torch.bfloat16)
    layer.prepare(torch.bfloat16)
    return layer


def filled_cache(layer: GatedMLA, n: int, max_len: int, seed: int = 1) -> torch.Tensor:
    """A cache whose first ``n`` slots hold plausible latents (unit-RMS-ish latent, rope part of norm ~1)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.zeros(1, max_len, 576)
    kv[:, :n, :512] = torch.randn(1, n, 512, generator=g) * (torch.rand(512, generator=g) + 0.5)
    kv[:, :n, 512:] = torch.randn(1, n, 64, generator=g)
    return kv.to(DEV, torch.bfloat16)


def inputs(layer: GatedMLA, t: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    h, qd = layer.heads, layer.nope + layer.rope_dim
    q = (torch.randn(1, t, h, qd, generator=g) * 1.5).to(DEV, torch.bfloat16)
    ckv = (torch.randn(1, t, 576, generator=g) * 2).to(DEV, torch.bfloat16)
    gate = torch.randn(1, t, h, generator=g).to(DEV, torch.bfloat16)
    return q, ckv, gate


def ref64(layer: GatedMLA, q, ckv, gate, positions, kv):
    """float64 expanded-form gated attention and the new cache rows (latent normed, k_pe rotated), unrounded."""
    d = torch.float64
    h, nope, rank = layer.heads, layer.nope, layer.rank
    w = layer.kv_b_proj.weight.to(d).view(h, nope + layer.vdim, rank)
    wk, wv = w[:, :nope], w[:, nope:]
    lat = ckv[0, :, :rank].to(d)
    lat = lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + layer.kv_a_layernorm.eps)
    lat = lat * layer.kv_a_layernorm.weight.to(d)
    ang = positions.to(d)[:, None] * layer.rope.inv_freq.to(d)[None, :]
    cos, sin = ang.cos() * layer.rope.attention_factor, ang.sin() * layer.rope.attention_factor

    def rope(x):                                  # x [..., T, 64] interleaved pairs
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    kpe = rope(ckv[0, :, rank:].to(d))
    new = torch.cat([lat, kpe], -1)                                      # [T, 576]
    cache = kv[0].to(d).clone()
    cache[positions] = new
    n = int(positions[-1]) + 1
    c_lat, c_pe = cache[:n, :rank], cache[:n, rank:]
    k_nope = torch.einsum("hnr,lr->hln", wk, c_lat)                      # expanded keys / values
    v = torch.einsum("hvr,lr->hlv", wv, c_lat)
    qh = q[0].to(d).transpose(0, 1)                                      # [H, T, 192]
    q_pe = rope(qh[..., nope:])
    s = (torch.einsum("htn,hln->htl", qh[..., :nope], k_nope) + torch.einsum("htp,lp->htl", q_pe, c_pe))
    s = s * layer.scale
    mask = torch.arange(n, device=q.device)[None, :] <= positions[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.einsum("htl,hlv->thv", torch.softmax(s, -1), v)           # [T, H, v]
    return (o * torch.sigmoid(gate[0].to(d))[..., None])[None], new


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def bf16_steps(got, want) -> torch.Tensor:
    """|got - want| in units of want's BF16 spacing (elementwise)."""
    ulp = torch.exp2(torch.floor(torch.log2(want.double().abs().clamp(min=1e-30))) - 7)
    return (got.double() - want.double()).abs() / ulp


def run(mla, layer, q, ckv, gate, positions, kv, kv_len, cfg):
    wkc, wvc = layer.absorbed(torch.bfloat16)
    n = layer.kv_a_layernorm
    return mla.mla_decode(q, ckv, gate, positions, kv, kv_len, wkc, wvc, n.weight, n.eps, layer.rope.inv_freq,
                          layer.rope.attention_factor, layer.scale, cfg)


# (heads, nope, v): real Ling per-head widths, and a non-power-of-two head count with narrower heads
@pytest.mark.parametrize("heads,nope,vdim", [(4, 128, 128), (3, 64, 48)])
@pytest.mark.parametrize("t,pos,kv_len", [(1, 0, None), (1, 37, 64), (2, 50, 96), (3, 77, 80), (4, 100, 128),
                                          (4, 29, None), (8, 40, 64)])
@needs_triton
@torch.no_grad()
def test_kernel_matches_float64(mla, heads, nope, vdim, t, pos, kv_len):
    layer = make_layer(heads, nope, vdim)
    kv = filled_cache(layer, pos, 128)
    q, ckv, gate = inputs(layer, t, seed=pos + t)
    positions = torch.arange(pos, pos + t, device=DEV)
    want, new = ref64(layer, q, ckv, gate, positions, kv)
    before = kv.clone()
    got = run(mla, layer, q, ckv, gate, positions, kv, kv_len, SMALL)
    assert got.shape == (1, t, heads, vdim) and got.dtype == torch.bfloat16
    # BF16 inputs to the tensor-core products (q_lat, the probabilities, the gated latent output) and the BF16 cache
    # rows against an unrounded float64 reference: ~3.5e-3 relative, the size of the final BF16 rounding alone
    assert rel(got, want) < 6e-3, rel(got, want)
    # the new rows are written at the positions; nothing else in the cache changes. The latent is rounded twice
    # (the normalised value, then times the weight, as RMSNorm), the rotated k_pe once (half a BF16 step)
    steps = bf16_steps(kv[0, positions], new)
    assert (steps[:, :512] <= 2.01).all(), float(steps[:, :512].max())
    assert (steps[:, 512:] <= 0.6).all(), float(steps[:, 512:].max())
    other = torch.ones(kv.shape[1], dtype=torch.bool, device=DEV)
    other[positions] = False
    assert torch.equal(kv[:, other], before[:, other])


@needs_triton
@pytest.mark.parametrize("t,pos", [(1, 45), (4, 60)])
@torch.no_grad()
def test_layer_matches_torch_path(mla, t, pos):
    """GatedMLA.forward with the backend bound == its torch absorbed path (both BF16) == float64, cache too."""
    layer = make_layer(4, 128, 128, seed=3)
    from bytebound.layers.mla import MLAState
    kv = filled_cache(layer, pos, 96)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, t, 64, generator=g).to(DEV, torch.bfloat16)
    positions = torch.arange(pos, pos + t, device=DEV)
    st_ref, st_tri = MLAState(kv.clone()), MLAState(kv.clone())
    want = layer(x, positions, st_ref, 96)
    layer.attn_fn = mla.TritonMLA(SMALL).bind(layer, torch.bfloat16)
    try:
        got = layer(x, positions, st_tri, 96)
    finally:
        layer.attn_fn = None
    # float64 of the whole layer from the same projections: the reference path's own error is the yardstick
    q = layer.q_proj(x).view(1, t, 4, 192)
    ckv = layer.kv_a_proj_with_mqa(x)
    o64, _ = ref64(layer, q, ckv, layer.g_proj(x), positions, kv)
    want64 = o64.reshape(1, t, -1) @ layer.dense.weight.double().t()
    e_ref, e_tri = rel(want, want64), rel(got, want64)
    assert e_ref < 6e-3 and e_tri < 1.5 * e_ref, (e_tri, e_ref)
    assert rel(got, want) < 6e-3
    # identical cache rows up to one BF16 step (float32 statistics in another summation order)
    assert (bf16_steps(st_tri.kv, st_ref.kv) <= 1.01).all()
    assert (st_tri.kv != st_ref.kv).float().mean() < 0.01


def fp8_projections(layer: GatedMLA) -> None:
    """Replace q_proj, kv_a_proj_with_mqa and g_proj by FP8 128x128-block copies of their weights (as Ling stores
    them; kv_a's 576 rows end inside a scale block)."""
    from bytebound.layers.linear import QLinear
    from bytebound.quant import quantize_fp8_block
    for name in ("q_proj", "kv_a_proj_with_mqa", "g_proj"):
        plain = getattr(layer, name)
        lin = QLinear(plain.in_features, plain.out_features, "fp8", (128, 128), torch.bfloat16, DEV)
        wq, sc = quantize_fp8_block(plain.weight.detach().float().cpu(), (128, 128))
        lin.weight.data, lin.weight_scale_inv.data = wq.to(DEV), sc.to(DEV)
        setattr(layer, name, lin)


@needs_triton
@pytest.mark.parametrize("t,pos", [(1, 45), (4, 60)])
@torch.no_grad()
def test_layer_fused_projection_equals_three(mla, fp8k, t, pos):
    """The decode/verify layer as bind_model binds it on CUDA: q|kv_a|g as one FP8 GEMV (``linear.fuse_rows(pad=
    True)``: 768 | 576 + 64 zero rows | 4) whose output slices feed the attention kernels as strided views, against
    the same layer with three GEMVs. With one GEMV launch config both give the same bits (output and cache); the
    torch path (dequantised projections, float32 absorbed attention) is the yardstick of the whole."""
    from bytebound.layers.linear import fuse_rows
    from bytebound.layers.mla import MLAState
    layer = make_layer(4, 128, 128, seed=8)
    fp8_projections(layer)
    parts = [layer.q_proj, layer.kv_a_proj_with_mqa, layer.g_proj]
    kv = filled_cache(layer, pos, 96)
    x = torch.randn(1, t, 64, generator=torch.Generator().manual_seed(11)).to(DEV, torch.bfloat16)
    positions = torch.arange(pos, pos + t, device=DEV)
    st_ref = MLAState(kv.clone())
    want = layer(x, positions, st_ref, 96)                   # unbound: torch path, dequantised projections
    fused = fuse_rows(parts, pad=True)
    assert fused.row_spans == [(0, 768), (768, 1344), (1408, 1412)]
    cfg = fp8k.fit_gemv_config({"BN": 16, "BK": 64, "SPLIT": 1, "num_warps": 4}, 1412, 64, t)

    def gemv(lin):
        return lambda v: fp8k.fp8_block_gemv(v.reshape(-1, 64), lin.weight, lin.weight_scale_inv, lin.block,
                                             cfg).view(*v.shape[:-1], -1)
    layer.attn_fn = mla.TritonMLA(SMALL).bind(layer, torch.bfloat16)
    try:
        for p in parts:
            p.fn = gemv(p)
        st_sep = MLAState(kv.clone())
        sep = layer(x, positions, st_sep, 96)
        for p in parts:
            p.fn = None
        layer.proj_fn, layer.proj_spans = gemv(fused), fused.row_spans
        st_fused = MLAState(kv.clone())
        got = layer(x, positions, st_fused, 96)
    finally:
        layer.attn_fn = layer.proj_fn = layer.proj_spans = None
    assert torch.equal(got, sep) and torch.equal(st_fused.kv, st_sep.kv)
    assert rel(got, want) < 6e-3, rel(got, want)


@needs_triton
def test_span_and_split_do_not_change_the_result(mla):
    """Keys past the last position are masked: with the same split length any static span >= pos + T gives the
    same bits (the extra splits are empty and weigh exactly 0), so the runner's buckets change nothing. Another
    split length rounds the probabilities to BF16 against other running maxima: equal to BF16 accuracy."""
    layer = make_layer(4, 128, 128, seed=5)
    kv = filled_cache(layer, 70, 128)
    q, ckv, gate = inputs(layer, 3)
    positions = torch.arange(70, 73, device=DEV)
    outs = [run(mla, layer, q, ckv, gate, positions, kv.clone(), n, cfg)
            for n, cfg in [(73, {"BN": 16, "split": 16}), (128, {"BN": 16, "split": 16}), (None, {"BN": 32}),
                           (80, {"BN": 16, "split": 80, "combine_BK": 64, "combine_BV": 16})]]
    assert torch.equal(outs[0], outs[1])
    for o in outs[2:]:
        assert rel(o, outs[0]) < 4e-3, rel(o, outs[0])
    # a stale (nonzero) slot past the positions is never read: poison it
    kv2 = kv.clone()
    kv2[:, 73:] = float("nan")
    o = run(mla, layer, q, ckv, gate, positions, kv2, 128, {"BN": 16, "split": 16})
    assert torch.isfinite(o).all() and torch.equal(o, outs[1])


@needs_triton
@pytest.mark.parametrize("t,pos,kv_len", [(1, 40, 128), (4, 62, 128), (4, 29, 64), (1, 95, 96)])
@torch.no_grad()
def test_skipping_empty_splits_keeps_the_bits(mla, monkeypatch, t, pos, kv_len):
    """``skip_empty`` (opt-in): the splits past a row's position run no key block, write no partial and are not
    merged. The same bits as running and merging them (they weigh exactly 0), with splits empty for every row
    (span far past the sequence), a split boundary between the verify tokens (positions 62..65 with 32-key splits:
    rows 0-1 have no key in the split of rows 2-3), and no empty split at all (95 + 1 = 96 = the span). Every
    buffer the kernels get from ``torch.empty`` starts as NaN, so a partial read without being written shows."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    layer = make_layer(4, 128, 128, seed=7)
    kv = filled_cache(layer, pos, kv_len)
    q, ckv, gate = inputs(layer, t, seed=pos)
    positions = torch.arange(pos, pos + t, device=DEV)
    kv_on, kv_off = kv.clone(), kv.clone()
    on = run(mla, layer, q, ckv, gate, positions, kv_on, kv_len, {**SMALL, "skip_empty": True})
    off = run(mla, layer, q, ckv, gate, positions, kv_off, kv_len, {**SMALL, "skip_empty": False})
    assert torch.isfinite(on).all() and torch.equal(on, off) and torch.equal(kv_on, kv_off)


@needs_triton
@pytest.mark.parametrize("heads,t,pos", [(4, 1, 40), (3, 4, 62)])
@torch.no_grad()
def test_rope_split_keeps_the_bits(mla, monkeypatch, heads, t, pos):
    """``rope_split`` (opt-in): the q_pe rope in programs of its own (one per head, all tokens) instead of the token
    programs gives the same bits: output and cache, for one token and a verify of four, with a head count that is
    not a power of two (the token program's head tile is masked). ``torch.empty`` buffers start as NaN, so a q_rope
    row no program wrote shows."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    layer = make_layer(heads, 64, 128, seed=5)
    kv = filled_cache(layer, pos, 128)
    q, ckv, gate = inputs(layer, t, seed=pos)
    positions = torch.arange(pos, pos + t, device=DEV)
    kv_on, kv_off = kv.clone(), kv.clone()
    off = run(mla, layer, q, ckv, gate, positions, kv_off, 128, {**SMALL, "rope_split": False})
    on = run(mla, layer, q, ckv, gate, positions, kv_on, 128, {**SMALL, "rope_split": True})
    assert torch.isfinite(on).all() and torch.equal(on, off) and torch.equal(kv_on, kv_off)


@needs_triton
@pytest.mark.parametrize("heads,vdim", [(4, 128), (3, 48)])
@pytest.mark.parametrize("t,pos,kv_len,skip", [(1, 40, 128, False), (4, 62, 128, True), (2, 94, 96, False)])
@torch.no_grad()
def test_latent_block_merge_keeps_the_bits(mla, monkeypatch, heads, vdim, t, pos, kv_len, skip):
    """``combine_kc`` (the default): the merge split over latent blocks, the last block's program summing their
    partials after a ticket, gives the per-v-block merge's output bit for bit (same per-element arithmetic and
    order), with and without ``skip_empty``, for Ling's v width and a narrower one that takes several v blocks;
    ``torch.empty`` buffers and the partial products' scratch start as NaN, so a slot read that no program wrote
    shows. Two calls in a row: the tickets are left at zero for the next launch. The interpreter runs the programs
    one after another, so the ticket's ordering across concurrent programs is tested on the GPU
    (tests/gpu/test_mla_gpu.py)."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    layer = make_layer(heads, 64, vdim, seed=11)
    kv = filled_cache(layer, pos, kv_len)
    q, ckv, gate = inputs(layer, t, seed=pos)
    positions = torch.arange(pos, pos + t, device=DEV)
    cfg = {**SMALL, "skip_empty": skip, "combine_BV": 16}
    from bytebound.kernels.scratch import scratch
    # the partial products' scratch as NaN (it comes from torch.zeros, kept between calls): a partial summed before
    # it was written shows; sized as the kernel sizes it, so the call does not grow (replace) it
    scratch(DEV, "mla_y", max(t, 8) * heads * (512 // 128) * vdim).fill_(float("nan"))
    kv_on, kv_off = kv.clone(), kv.clone()
    off = run(mla, layer, q, ckv, gate, positions, kv_off, kv_len, {**cfg, "combine_kc": False})
    for _ in range(2):
        on = run(mla, layer, q, ckv, gate, positions, kv_on.copy_(kv), kv_len, {**cfg, "combine_kc": True})
        assert torch.isfinite(on).all() and torch.equal(on, off) and torch.equal(kv_on, kv_off)
    assert not scratch(DEV, "mla_tickets", 1, torch.int32).any()
    with pytest.raises(BackendError, match="prefetch"):
        run(mla, layer, q, ckv, gate, positions, kv_on, kv_len, {**cfg, "combine_kc": True, "prefetch": True})
    # combine_pre: the W_vc block loaded before the PDL entry where one v block is the whole v row (BV >= v; 48
    # is not a power of two: there the v blocks stay, loaded in the loop)
    wide = {**cfg, "combine_kc": True, "combine_BV": 128}
    want = run(mla, layer, q, ckv, gate, positions, kv_off.copy_(kv), kv_len, {**wide, "combine_pre": False})
    got = run(mla, layer, q, ckv, gate, positions, kv_on.copy_(kv), kv_len, {**wide, "combine_pre": True})
    assert torch.isfinite(got).all() and torch.equal(got, want) and torch.equal(kv_on, kv_off)


@needs_triton
def test_cfg_by_span(mla, monkeypatch):
    """:func:`resolve_cfg`: DEFAULT_CFG, SHORT_CFG up to SHORT_SPAN slots (inclusive), the explicit cfg over both,
    BYTEBOUND_MLA_CFG over all; a bad override is a named error, not a silent default."""
    monkeypatch.delenv("BYTEBOUND_MLA_CFG", raising=False)
    short, long_ = mla.resolve_cfg(mla.SHORT_SPAN), mla.resolve_cfg(mla.SHORT_SPAN + 1)
    assert short == {**mla.DEFAULT_CFG, **mla.SHORT_CFG} and long_ == mla.DEFAULT_CFG
    assert set(mla.SHORT_CFG) <= set(mla.DEFAULT_CFG)
    assert mla.resolve_cfg(2048, {"BN": 16})["BN"] == 16 and mla.resolve_cfg(2048, {"BN": 16})["min_split"] == \
        mla.SHORT_CFG["min_split"]
    assert mla.resolve_cfg(32768, {"num_warps": 8}) == {**mla.DEFAULT_CFG, "num_warps": 8}
    # the decode tiling replaces BM / num_warps for a one-token call only
    one = {"decode_BM": 16, "decode_warps": 2}
    assert (mla.resolve_cfg(2048, one, 1)["BM"], mla.resolve_cfg(2048, one, 1)["num_warps"]) == (16, 2)
    assert (mla.resolve_cfg(2048, one, 4)["BM"], mla.resolve_cfg(2048, one, 4)["num_warps"]) == (short["BM"],
                                                                                                short["num_warps"])
    assert mla.resolve_cfg(2048, {"decode_BM": None, "decode_warps": None}, 1)["num_warps"] == short["num_warps"]
    # an explicit BM / num_warps (a sweep's tiling, BYTEBOUND_MLA_CFG) is what runs, also for one token
    c = mla.resolve_cfg(2048, {**one, "BM": 32}, 1)
    assert (c["BM"], c["num_warps"]) == (32, 2)
    monkeypatch.setenv("BYTEBOUND_MLA_CFG", '{"num_warps": 8}')
    assert (mla.resolve_cfg(2048, one, 1)["BM"], mla.resolve_cfg(2048, one, 1)["num_warps"]) == (16, 8)
    monkeypatch.delenv("BYTEBOUND_MLA_CFG")
    monkeypatch.setenv("BYTEBOUND_MLA_CFG", '{"BN": 128, "min_split": 256}')
    c = mla.resolve_cfg(2048, {"BN": 16, "split": 32})
    assert (c["BN"], c["min_split"], c["split"], c["num_warps"]) == (128, 256, 32, mla.SHORT_CFG["num_warps"])
    for bad in ("{BN: 64}", "[64]", '{"bn": 64}'):
        monkeypatch.setenv("BYTEBOUND_MLA_CFG", bad)
        with pytest.raises(BackendError, match="BYTEBOUND_MLA_CFG"):
            mla.resolve_cfg(2048)
    monkeypatch.setenv("BYTEBOUND_MLA_CFG", "")
    assert mla.resolve_cfg(2048) == short


@needs_triton
def test_split_plan_of_the_default_tilings(mla, monkeypatch):
    """The split sizing the resolved tilings give on a 132-SM GPU (no GPU needed: the SM count is patched): at a
    long span and one row block (M = 1) half the SMs as the program target and >= 128-key splits; with four row
    blocks (M = 4) one program per SM; at a short span the short tiling's 64-key minimum and BN 32."""
    monkeypatch.delenv("BYTEBOUND_MLA_CFG", raising=False)
    # the module reads the count through kernels.device.sm_count (cached per device): patch that name, so that a
    # count cached by an earlier call cannot bypass the patch and the fake count cannot leak into the cache
    monkeypatch.setattr(mla, "sm_count", lambda d: 132)
    dev = torch.device("cuda", 0)
    assert mla.split_plan(32768, 32, 1, mla.resolve_cfg(32768), dev) == (32, 512, 64)       # 66 programs
    assert mla.split_plan(32768, 128, 1, mla.resolve_cfg(32768), dev) == (32, 1024, 32)     # 4 x 33
    assert mla.split_plan(8192, 32, 1, mla.resolve_cfg(8192), dev) == (32, 128, 64)         # min_split
    assert mla.split_plan(2048, 32, 1, mla.resolve_cfg(2048), dev) == (32, 64, 32)          # short: BN 32, 64
    assert mla.split_plan(4096, 32, 1, mla.resolve_cfg(4096), dev) == (32, 64, 64)          # 132 programs
    # target_single applies only to the default target: an explicit target_programs is taken as given
    assert mla.split_plan(32768, 32, 1, {**mla.resolve_cfg(32768), "target_programs": 132}, dev) == (32, 256, 128)
    assert mla.split_plan(32768, 32, 1, mla.resolve_cfg(32768), "cpu") == (32, 32768, 1)


@needs_triton
@torch.no_grad()
def test_batch_rows_are_independent(mla):
    """B = 2 (each row its own cache) gives each row's B = 1 result: the batch strides are right."""
    layer = make_layer(4, 128, 128, seed=6)
    kv = torch.cat([filled_cache(layer, 40, 64, seed=s) for s in (1, 2)])
    qs, cs, gs = zip(*(inputs(layer, 2, seed=s) for s in (3, 4)))
    positions = torch.arange(40, 42, device=DEV)
    both = run(mla, layer, torch.cat(qs), torch.cat(cs), torch.cat(gs), positions, kv.clone(), 64, SMALL)
    for i in range(2):
        kv1 = kv[i:i + 1].clone()
        one = run(mla, layer, qs[i], cs[i], gs[i], positions, kv1, 64, SMALL)
        assert torch.equal(both[i:i + 1], one)


@needs_triton
def test_bad_input_is_a_named_error(mla):
    layer = make_layer(4, 128, 128)
    kv = filled_cache(layer, 8, 32)
    q, ckv, gate = inputs(layer, 1)
    pos = torch.tensor([8], device=DEV)
    with pytest.raises(BackendError, match="bf16"):
        run(mla, layer, q.float(), ckv, gate, pos, kv, None, None)
    with pytest.raises(BackendError, match="span"):
        run(mla, layer, q, ckv, gate, pos, kv, 64, None)
    with pytest.raises(BackendError, match="inconsistent shapes"):
        run(mla, layer, q, ckv[..., :512], gate, pos, kv, None, None)
    with pytest.raises(BackendError, match=">= 16"):                # a rope width too narrow for tensor cores
        small = make_layer(4, 128, 128)
        wkc, wvc = small.absorbed(torch.bfloat16)
        n = small.kv_a_layernorm
        mla.mla_decode(q[..., :136], ckv[..., :520], gate, pos, kv[..., :520], None, wkc, wvc, n.weight, n.eps,
                       small.rope.inv_freq[:4], 1.0, 0.1)
    with pytest.raises(BackendError, match="bf16"):
        mla.TritonMLA().bind(make_layer(4, 128, 128).float(), torch.float32)


@needs_triton
@torch.no_grad()
def test_model_decode_and_verify_match_torch(mla):
    """The tiny model (latent 32, rope 16) with every MLA layer bound to the backend: prefill (torch, T > 8),
    decode steps and a 4-token verify give the hidden states of the torch path, to BF16 accuracy."""
    from bytebound.checkpoint.synthetic import random_model
    from bytebound.runner.runner import ModelRunner
    model = random_model(tiny_config(rope_scaling=YARN, qk_rope_head_dim=16), seed=4, dtype=torch.bfloat16).to(DEV)
    model.finish_load()
    mlas = [m for m in model.modules() if isinstance(m, GatedMLA)]
    assert len(mlas) == 3                                 # two decoder layers and the NEXTN layer's attention
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(0)).to(DEV)
    outs = []
    for bound in (False, True):
        for m in mlas:
            m.attn_fn = mla.TritonMLA({"BN": 16, "split": 16}).bind(m, torch.bfloat16) if bound else None
        r = ModelRunner(model, max_len=48, device=DEV)
        hs = [r.prefill(ids[:12])[-1:]] + [r.forward(ids[i:i + 1]) for i in range(12, 15)]
        hs.append(r.verify(ids[15:19]))
        outs.append((torch.cat(hs), [s.kv.clone() for s in r.state if not hasattr(s, "rec")]))
    for m in mlas:
        m.attn_fn = None
    (h_ref, kv_ref), (h_tri, kv_tri) = outs
    assert rel(h_tri, h_ref) < 1e-2, rel(h_tri, h_ref)
    for a, b in zip(kv_tri, kv_ref):           # the NEXTN layer's cache stays empty without MTP
        assert rel(a, b) < 1e-2 if b.any() else not a.any()


def test_backend_is_registered_and_cuda_only():
    """``mla=triton`` resolves on CUDA only: elsewhere a named BackendError, or the recorded torch fallback."""
    from bytebound.kernels.registry import backends, resolve
    assert "triton" in backends("mla")
    with pytest.raises(BackendError, match="needs a CUDA device"):
        resolve("mla", "triton", torch.device("cpu"))
    impl, res = resolve("mla", "triton", torch.device("cpu"), allow_fallback=True)
    assert (res.resolved, res.fallback_from) == ("torch", "triton") and impl.bind(None, torch.float32) is None


@needs_triton
@pytest.mark.parametrize("t", [1, 4])
def test_kernels_compile_for_sm90(t):
    """The three kernels compile for an H100/H200 (sm_90) at Ling shapes with the default tilings (long and short
    span), offline (Triton's own ptxas, no GPU needed), within the 227 KiB of shared memory a block may use: the
    GPU-only code path (BF16 tensor-core ``tl.dot``) that the interpreter tests replace with float32 products. Runs
    in a subprocess without the interpreter (this session's Triton is in interpreter mode: conftest)."""
    import importlib.util
    import os
    if compiled_in_subprocess(__file__, f"test_kernels_compile_for_sm90[{t}]"):
        return
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    # a private copy of the module, decorated without TRITON_INTERPRET (the fixture's copy is the interpreter's)
    from bytebound.kernels import registry
    old, entries = os.environ.pop("TRITON_INTERPRET", None), dict(registry._REGISTRY["mla"])
    try:
        spec = importlib.util.spec_from_file_location("_triton_mla_sm90", ROOT / "bytebound/kernels/triton_mla.py")
        M = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(M)
    finally:
        registry._REGISTRY["mla"].update(entries)         # the copy's @register must not replace the backend
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old
    cfg = M.DEFAULT_CFG
    c = dict(T=t, H=32, R=512)
    kernels = [
        (M._mla_prep, dict(c, P=64, NOPE=128, HP=32, TP=16, BRC=cfg["absorb_BC"], DOT_F32=False), 4,
         dict(ckv_ptr="*bf16", q_ptr="*bf16", qr_ptr="*bf16", ql_ptr="*bf16", wk_ptr="*bf16", kv_ptr="*bf16",
              pos_ptr="*i64", nw_ptr="*bf16", inv_ptr="*fp32", eps="fp32", att="fp32", s_ckv_t="i32", s_q_t="i32",
              s_q_h="i32", s_kv_b="i32", s_kv_l="i32", BT="i32")),
        (M._mla_attn_split, dict(c, P=64, BM=cfg["BM"], BN=cfg["BN"], NT=8, DOT_F32=False, SKIP=cfg["skip_empty"]),
         cfg["num_warps"],
         dict(ql_ptr="*bf16", qr_ptr="*bf16", kv_ptr="*bf16", pos_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32",
              qk_scale="fp32", L="i32", s_ql_h="i32", s_ql_t="i32", s_kv_b="i32", s_kv_l="i32", B="i32")),
        (M._mla_combine_out, dict(NS=128, **c, V=128, BV=cfg["combine_BV"], SB=cfg["combine_SB"],
                                  BK=cfg["combine_BK"], SKIP=cfg["skip_empty"]), cfg["combine_warps"],
         dict(o_ptr="*fp32", lse_ptr="*fp32", g_ptr="*bf16", wv_ptr="*bf16", out_ptr="*bf16", pos_ptr="*i64",
              B="i32", s_g_t="i32", s_out_t="i32", SPLIT="i32")),
    ]
    # the opt-in rope_split prep (the q_pe rope in programs of its own)
    kernels.append((M._mla_prep, dict(kernels[0][1], QSPLIT=True), kernels[0][2], kernels[0][3]))
    # the opt-in skip_empty path too (the attention and the merge with SKIP on)
    kernels += [(fn, dict(consts, SKIP=True), warps, sig) for fn, consts, warps, sig in kernels[1:3]]
    # the opt-in W_vc prefetch of the merge (its L2 bulk prefetch between the PDL trigger and wait)
    kernels.append((M._mla_combine_out, dict(kernels[2][1], PF=True), kernels[2][2], kernels[2][3]))
    # the opt-in merge over latent blocks (combine_kc: ticket, fence and last-program sum), with and without SKIP
    kc_sig = dict(kernels[2][3], y_ptr="*fp32", tk_ptr="*i32")
    kc = dict(kernels[2][1], FENCE=True)
    kernels += [(M._mla_combine_kc, dict(kc, SKIP=sk), kernels[2][2], kc_sig) for sk in (False, True)]
    kernels.append((M._mla_combine_kc, dict(kc, BV=128, PRE=True), kernels[2][2], kc_sig))
    # a one-token call's attention tiling (decode_BM / decode_warps) at the long and the short span
    kernels += [(M._mla_attn_split, dict(kernels[1][1], T=1, BM=cfg["decode_BM"], BN=bn), cfg["decode_warps"],
                 kernels[1][3]) for bn in (cfg["BN"], M.SHORT_CFG["BN"])]
    short = {**cfg, **M.SHORT_CFG}         # the tiling of spans up to SHORT_SPAN (resolve_cfg)
    kernels.append((M._mla_attn_split, dict(kernels[1][1], BM=short["BM"], BN=short["BN"]), short["num_warps"],
                    kernels[1][3]))
    kernels.append((M._mla_attn_split, dict(kernels[-1][1], SKIP=True), short["num_warps"], kernels[1][3]))
    for fn, consts, warps, sig in kernels:
        consts = {**consts, "PDL": True, "NTH": 32 * warps}     # as launched on sm_90 (kernels.pdl.enter)
        sig = {**sig, **{k: "constexpr" for k in consts}}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": cfg["num_stages"]})
        assert k.asm.get("cubin") and k.metadata.shared <= 227 * 1024, (fn, k.metadata.shared)
        ptx = k.asm["ptx"]
        assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait"), fn
        if fn is M._mla_combine_kc:          # the partials are visible GPU-wide before the ticket is taken
            assert ptx.index("fence.acq_rel.gpu") < ptx.index("atom.global.gpu.acq_rel"), consts
