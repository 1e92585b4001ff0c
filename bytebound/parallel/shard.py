"""Slice a loaded BailingMoeV3 model into one rank's tensor-/expert-parallel share, in place.

Megatron-style partitioning (Shoeybi et al., arXiv 1909.08053, section 3), with the routed experts split by
expert (GShard / DeepSpeed-MoE expert parallelism):

* KDA: heads ``H / N`` per rank: q/k/v/f/g projection rows, b_proj rows, the q/k/v depthwise conv channels,
  ``A_log`` (per head) and ``dt_bias`` (per channel) - every op of the layer is per head, so a rank's
  recurrent state ``[B, H/N, K, V]`` is complete; ``o_norm`` acts on one head's ``head_dim`` and is replicated;
  ``o_proj`` keeps the input columns of the rank's heads (a partial sum).
* gated MLA: heads ``H / N``: q_proj, kv_b_proj and g_proj rows, ``dense`` input columns; ``kv_a_proj_with_mqa``,
  ``kv_a_layernorm`` and so the 576-wide latent cache are replicated (every head reads the whole latent).
* dense MLP and the shared expert: intermediate ``I / N`` (gate/up rows, down columns).
* routed experts: ``E / N`` whole experts per rank (rank r holds experts ``[r E/N, (r+1) E/N)``); the router is
  replicated, so every rank computes the same top-k, and a rank's MoE output sums only its own experts.
* LM head: vocabulary rows ``V / N``; the logits are all-gathered to ``[.., V]`` in rank order.

One all-reduce (sum) after each attention and one after each MLP / MoE (the NEXTN layer's too), as forward hooks
on those modules: the partial outputs add to the unsharded result up to float summation order.

FP8 weights (E4M3, ``weight_scale_inv`` per 128x128 block) are sliced with their scales, so a slice must start on
a block edge or lie inside one block; MXFP4 experts are never split inside an expert. A ``kv_b_proj`` whose head
slice is not on block edges (e.g. 96 rows per head in the bundled ling-nano) is dequantised to the model dtype
first: decode and verify read the absorbed copies ``W_kc``/``W_vc`` (already in the model dtype), only the
expanded prefill path reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from bytebound.errors import ConfigError
from bytebound.layers.kda import KimiDeltaAttention
from bytebound.layers.linear import QLinear
from bytebound.layers.mla import GatedMLA
from bytebound.layers.moe import DenseMLP, MoE, RoutedExperts


def _span(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    if n % world:
        raise ConfigError(f"--tensor-parallel-size {world} does not divide {what} ({n})")
    k = n // world
    return rank * k, (rank + 1) * k


def _fits_blocks(a: int, b: int, blk: int) -> bool:
    """A slice ``[a, b)`` of a block-scaled dimension keeps one scale per block when it starts on a block edge
    or lies inside one block."""
    return a % blk == 0 or a // blk == (b - 1) // blk


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


def _slice_rows(lin: QLinear, a: int, b: int, name: str, dequant_to: torch.dtype | None = None) -> None:
    """Keep output rows ``[a, b)`` of ``lin`` (weight and, for FP8, the scale rows of their blocks). With
    ``dequant_to``, an FP8 slice off block edges is dequantised to that dtype instead of refused."""
    if lin.fmt == "fp8":
        bn = lin.block[0]
        if not _fits_blocks(a, b, bn):
            if dequant_to is None:
                raise ConfigError(f"{name}: rows [{a}, {b}) of {lin.out_features} do not fall on FP8 block edges "
                                  f"({bn} rows): choose a --tensor-parallel-size whose shares are whole blocks")
            _to_plain(lin, dequant_to)
        else:
            lin.weight_scale_inv = _param(lin.weight_scale_inv.data[a // bn:(b - 1) // bn + 1])
    lin.weight = _param(lin.weight.data[a:b])
    lin.out_features = b - a


def _slice_cols(lin: QLinear, a: int, b: int, name: str) -> None:
    """Keep input columns ``[a, b)`` of ``lin``."""
    if lin.fmt == "fp8":
        bk = lin.block[1]
        if not _fits_blocks(a, b, bk):
            raise ConfigError(f"{name}: columns [{a}, {b}) of {lin.in_features} do not fall on FP8 block edges "
                              f"({bk} columns): choose a --tensor-parallel-size whose shares are whole blocks")
        lin.weight_scale_inv = _param(lin.weight_scale_inv.data[:, a // bk:(b - 1) // bk + 1])
    lin.weight = _param(lin.weight.data[:, a:b])
    lin.in_features = b - a


def _to_plain(lin: QLinear, dtype: torch.dtype) -> None:
    """Replace an FP8 ``lin`` by its dequantised weight in ``dtype`` (exactly what the torch backend reads)."""
    w = lin.dequantized(dtype)
    del lin.weight_scale_inv
    lin.fmt = "plain"
    lin.weight = _param(w)


def _shard_kda(a: KimiDeltaAttention, r: int, n: int, name: str) -> None:
    h0, h1 = _span(a.heads, r, n, f"{name}: KDA heads")
    c0, c1 = h0 * a.head_dim, h1 * a.head_dim
    for p in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):
        _slice_rows(getattr(a, p), c0, c1, f"{name}.{p}")
    _slice_rows(a.b_proj, h0, h1, f"{name}.b_proj")
    _slice_cols(a.o_proj, c0, c1, f"{name}.o_proj")
    for conv in (a.q_conv1d, a.k_conv1d, a.v_conv1d):
        conv.weight = _param(conv.weight.data[c0:c1])
    a.A_log = _param(a.A_log.data[h0:h1])
    a.dt_bias = _param(a.dt_bias.data[c0:c1])
    a.heads, a.dim = h1 - h0, c1 - c0


def _shard_mla(a: GatedMLA, r: int, n: int, name: str, dtype: torch.dtype) -> None:
    h0, h1 = _span(a.heads, r, n, f"{name}: MLA heads")
    qd, kvd = a.nope + a.rope_dim, a.nope + a.vdim
    _slice_rows(a.q_proj, h0 * qd, h1 * qd, f"{name}.q_proj")
    _slice_rows(a.kv_b_proj, h0 * kvd, h1 * kvd, f"{name}.kv_b_proj", dequant_to=dtype)
    _slice_rows(a.g_proj, h0, h1, f"{name}.g_proj")
    _slice_cols(a.dense, h0 * a.vdim, h1 * a.vdim, f"{name}.dense")
    a.heads = h1 - h0


def _shard_dense(m: DenseMLP, r: int, n: int, name: str) -> None:
    i0, i1 = _span(m.gate_proj.out_features, r, n, f"{name}: intermediate size")
    _slice_rows(m.gate_proj, i0, i1, f"{name}.gate_proj")
    _slice_rows(m.up_proj, i0, i1, f"{name}.up_proj")
    _slice_cols(m.down_proj, i0, i1, f"{name}.down_proj")


def _shard_experts(ex: RoutedExperts, r: int, n: int, name: str) -> None:
    e0, e1 = _span(ex.n, r, n, f"{name}: routed experts")
    for p in ("w13", "w13_scale", "w2", "w2_scale"):
        if hasattr(ex, p):
            setattr(ex, p, _param(getattr(ex, p).data[e0:e1]))
    ex.n, ex.first = e1 - e0, e0
    inner = ex.local_forward = ex.forward      # local expert ids (the start-up canary calls it directly)

    def forward(x, ids, w, _inner=inner, _lo=e0, _n=e1 - e0):
        """Global expert ids -> this rank's: other ranks' experts get weight 0 (on local expert 0, whose finite
        output times 0 adds exactly 0)."""
        local = ids - _lo
        mine = (local >= 0) & (local < _n)
        return _inner(x, torch.where(mine, local, torch.zeros_like(local)), torch.where(mine, w, torch.zeros_like(w)))
    ex.forward = forward


def _allreduce_hook(tp):
    def hook(_module, _inputs, out):
        return tp.all_reduce_(out)
    return hook


def shard_model(model, tp) -> dict:
    """Slice ``model`` (a loaded ``BailingMoeV3ForCausalLM``, before kernels are bound) to rank ``tp.rank`` of
    ``tp.world`` and register the all-reduce / all-gather hooks. Returns the sharding description for the
    manifest: ``{"size", "rank", "attention", "moe", "mlp", "lm_head", "allreduces_per_step", "notes"}``.

    Raises:
        ConfigError: N does not divide the heads, experts, an intermediate size or the vocabulary, or an FP8
            slice would cut a 128x128 scale block (the message names the tensor).
    """
    r, n = tp.rank, tp.world
    notes: list[str] = []
    if n == 1:
        return {"size": 1, "rank": 0}
    hook = _allreduce_hook(tp)
    hooks = 0
    for i, layer in enumerate(model.model.layers):
        name = f"model.layers.{i}"
        a = layer.attention
        if isinstance(a, GatedMLA):
            fmt = a.kv_b_proj.fmt
            _shard_mla(a, r, n, f"{name}.attention", model.dtype)
            if fmt != a.kv_b_proj.fmt:
                notes.append(f"{name}.attention.kv_b_proj: head slices off FP8 block edges, dequantised to "
                             f"{str(model.dtype).replace('torch.', '')} (decode reads its absorbed copies)")
        else:
            _shard_kda(a, r, n, f"{name}.attention")
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            _shard_experts(mlp.experts, r, n, f"{name}.mlp.experts")
            if mlp.shared_experts is not None:
                _shard_dense(mlp.shared_experts, r, n, f"{name}.mlp.shared_experts")
        else:
            _shard_dense(mlp, r, n, f"{name}.mlp")
        a.register_forward_hook(hook)
        mlp.register_forward_hook(hook)
        hooks += 2
    head = model.lm_head
    v0, v1 = _span(head.weight.shape[0], r, n, "the vocabulary (LM head rows)")
    head.weight = _param(head.weight.data[v0:v1])
    head.register_forward_hook(lambda _m, _i, out: tp.all_gather_last(out))
    model.finish_load()       # MLA absorbed weights from the sliced kv_b_proj
    nl = model.cfg.num_hidden_layers
    return {"size": n, "rank": r, "backend": tp.backend,
            "attention": "KDA and MLA by heads (MLA latent cache replicated)",
            "moe": f"routed experts by expert ({model.cfg.num_experts // n} per rank), shared expert by intermediate",
            "mlp": "dense MLP by intermediate", "lm_head": "vocabulary rows, logits all-gathered",
            "allreduces_per_step": 2 * nl, "allreduces_per_nextn_step": 2 if model.nextn is not None else 0,
            "hooks": hooks, "notes": notes}
