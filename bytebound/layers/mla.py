"""Gated MLA (Ling-3.0 full-attention layers; ``docs/references.md`` §1.4, DeepSeek-V2 arXiv 2405.04434).

    q            = q_proj x -> [H, nope 128 | rope 64]            (no q-LoRA)
    latent|k_pe  = kv_a_proj_with_mqa x -> [512 | 64]; latent = kv_a_layernorm(latent)
    cache        = [latent | rope(k_pe)] : 576 values per token per layer
    k_nope|v     = kv_b_proj latent -> [H, 128 | 128]
    o            = softmax(q.k / sqrt(192)) v  * sigmoid(g_proj x)[head]    (head-wise output gate)
    out          = dense(o)                                                  (checkpoint name of o_proj)

Decode/verify (T <= 8) uses the *absorbed* form over the latent cache: ``q_nope`` is mapped through
``W_kc [H, 128, 512]`` into latent space and the latent attention output through ``W_vc [H, 128, 512]``, so
the per-token cache read is 576 values, never the expanded keys (DeepSeek-V2 section 2.1.2).

q_proj, kv_a_proj_with_mqa and g_proj read the same input: bound (``runner.backends.bind_model``) they run as one
projection (``proj_fn``, rows of one weight: ``layers.linear.fuse_rows``), so with the ``mla`` backend 'triton' a
decode/verify layer is five launches: that GEMV, ``_mla_prep``, ``_mla_attn_split``, ``_mla_combine_out`` and
``dense`` (``kernels.triton_mla``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from bytebound.layers.linear import QLinear
from bytebound.layers.norm import RMSNorm
from bytebound.layers.rope import Rope, mla_softmax_scale

ABSORB_MAX_T = 8

# The prefill's SDPA backends on CUDA. cuDNN attention, which torch prefers on Hopper for a masked call, builds
# an execution plan for every new (query, key) length, tens of milliseconds each: every prompt of a new length
# paid it in TTFT, and with MTP again in the NEXTN's pass over the prompt. The memory-efficient kernel takes the
# mask and the 192 / 128 key / value widths with no per-shape plan (flash takes neither, math is the last resort).
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class MLAState:
    """Latent KV cache of one MLA layer: ``kv [B, max_len, kv_lora_rank + rope_dim]`` in the compute dtype.

    Indexed by position, so rolling back a rejected draft needs no copy: later writes overwrite the slots, and
    only the slots ``[0, pos)`` of the committed length are state (``positional``: a snapshot copies those).
    """
    kv: torch.Tensor
    positional = True       # the tensors' dim 1 is the position (cache slot)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state proper: ``{"kv": kv}`` (slots along dim 1)."""
        return {"kv": self.kv}


class GatedMLA(nn.Module):
    """One gated-MLA layer. ``lin_fmt(name)`` gives each projection's storage format."""

    def __init__(self, cfg, lin_fmt, dtype=torch.float32, device=None):
        super().__init__()
        self.heads, self.nope, self.rope_dim, self.vdim = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                                                           cfg.qk_rope_head_dim, cfg.v_head_dim)
        self.rank = cfg.kv_lora_rank
        hid, blk = cfg.hidden_size, cfg.quant.weight_block_size

        def lin(name, i, o):
            return QLinear(i, o, lin_fmt(name), blk, dtype, device)
        self.q_proj = lin("q_proj", hid, self.heads * (self.nope + self.rope_dim))
        self.kv_a_proj_with_mqa = lin("kv_a_proj_with_mqa", hid, self.rank + self.rope_dim)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = lin("kv_b_proj", self.rank, self.heads * (self.nope + self.vdim))
        self.g_proj = lin("g_proj", hid, self.heads)
        self.dense = lin("dense", self.heads * self.vdim, hid)
        self.rope = Rope(self.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        self.scale = mla_softmax_scale(self.nope + self.rope_dim, cfg.rope_scaling)
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        # decode/verify attention bound at load (``kernels.triton_mla``): ``attn_fn(q [B,T,H,192], kv_a [B,T,576],
        # g [B,T,H], positions, cache, kv_len) -> gated [B,T,H,v]``; None runs the torch code below
        self.attn_fn = None
        # q|kv_a|g in one projection, set by runner.backends.bind_model: ``proj_fn(x [B,T,hidden]) -> [B,T,N]``
        # holding q_proj's, kv_a_proj_with_mqa's and g_proj's outputs at columns ``proj_spans`` (start, stop) each
        # (FP8 scale-block padding in between is never read); None: the three projections
        self.proj_fn = None
        self.proj_spans: list[tuple[int, int]] | None = None
        self.fold_input_norm = False    # the decoder's input add + norm inside proj_fn (as layers.kda's)

    def new_state(self, batch: int, max_len: int, dtype, device) -> MLAState:
        return MLAState(torch.zeros(batch, max_len, self.rank + self.rope_dim, dtype=dtype, device=device))

    def absorbed(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_kc [H, nope, R], W_vc [H, v, R])`` from kv_b_proj, cached once weights are final (``prepare``)."""
        if self._absorbed is not None and self._absorbed[0].dtype == dtype:
            return self._absorbed
        w = self.kv_b_proj.dequantized(dtype).view(self.heads, self.nope + self.vdim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def prepare(self, dtype) -> None:
        """Materialise the absorbed weights (call after loading)."""
        self._absorbed = None
        wkc, wvc = self.absorbed(dtype)
        self._absorbed = (wkc.contiguous(), wvc.contiguous())

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: MLAState | None = None,
                kv_len: int | None = None, y: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, T, hidden]`` at ``positions [T]`` -> ``[B, T, hidden]``.

        With ``state`` the new latents are written at ``positions`` and attention reads slots ``[0, kv_len)``
        (``kv_len`` defaults to ``positions[-1] + 1``; a larger static length is masked by position, which is
        what CUDA-graph replay uses). ``y``: the fused projection's output ``proj_fn(x)`` when the caller already has
        it (the input norm folded into it).
        """
        b, t, _ = x.shape
        if y is not None or self.proj_fn is not None:   # one GEMV/GEMM; q, ckv, g: column slices (views)
            y = self.proj_fn(x) if y is None else y
            q, ckv, g = (y[..., i:j] for i, j in self.proj_spans)
        else:
            q, ckv, g = self.q_proj(x), self.kv_a_proj_with_mqa(x), self.g_proj(x)
        q = q.view(b, t, self.heads, self.nope + self.rope_dim)
        if self.attn_fn is not None and state is not None and t <= ABSORB_MAX_T:
            out = self.attn_fn(q, ckv, g, positions, state.kv, kv_len)        # norm, rope, cache, gate
            return self.dense(out.reshape(b, t, self.heads * self.vdim))
        q = q.transpose(1, 2)                                                  # [B,H,T,192]
        q_nope, q_pe = q.split([self.nope, self.rope_dim], -1)
        latent, k_pe = ckv.split([self.rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = self.rope.cos_sin(positions)
        q_pe = Rope.apply(q_pe, cos, sin)
        k_pe = Rope.apply(k_pe, cos, sin)                                     # [B,T,64]
        if state is None:
            out = self._expanded(q_nope, q_pe, latent, k_pe, positions, positions)
        else:
            state.kv[:, positions] = torch.cat([latent, k_pe], -1).to(state.kv.dtype)
            n = int(positions[-1]) + 1 if kv_len is None else kv_len
            kv = state.kv[:, :n]
            kpos = torch.arange(n, device=x.device)
            lat_c, pe_c = kv.split([self.rank, self.rope_dim], -1)
            if t <= ABSORB_MAX_T:
                out = self._absorbed_attn(q_nope, q_pe, lat_c, pe_c, positions, kpos)
            else:
                out = self._expanded(q_nope, q_pe, lat_c, pe_c, positions, kpos)
        gate = torch.sigmoid(g.float())                                       # [B,T,H]
        out = (out.float() * gate[..., None]).to(x.dtype)                     # [B,T,H,v]
        return self.dense(out.reshape(b, t, self.heads * self.vdim))

    def _mask(self, qpos, kpos):
        return kpos[None, :] <= qpos[:, None]                                 # [T, L]

    def _expanded(self, q_nope, q_pe, latent, k_pe, qpos, kpos):
        """Naive form: expand keys/values from latents, one SDPA. Returns ``[B, T, H, v]``."""
        b, l = latent.shape[0], latent.shape[1]
        kv = self.kv_b_proj(latent.to(q_nope.dtype)).view(b, l, self.heads, self.nope + self.vdim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vdim], -1)
        k = torch.cat([k_nope, k_pe.to(k_nope.dtype)[:, None].expand(-1, self.heads, -1, -1)], -1)
        q = torch.cat([q_nope, q_pe], -1)
        mask = self._mask(qpos, kpos)
        if q.is_cuda:
            with sdpa_kernel(PREFILL_SDPA):
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o.transpose(1, 2)

    def _absorbed_attn(self, q_nope, q_pe, latent, k_pe, qpos, kpos):
        """Latent-space attention: reads the 576-wide cache only. Returns ``[B, T, H, v]``."""
        wkc, wvc = self.absorbed(q_nope.dtype)
        # The contractions einsum would plan, written as the batched products it would run (heads and query
        # tokens folded into the rows of one product with the shared latent cache): no per-call planning or
        # permutes, which dominate a decode step's tiny products on a CPU.
        b, h, t, _ = q_nope.shape
        lat = latent.float()
        q_lat = torch.matmul(q_nope, wkc).float().reshape(b, h * t, self.rank)           # [B,H*T,R]
        s = (torch.bmm(q_lat, lat.transpose(1, 2))
             + torch.bmm(q_pe.float().reshape(b, h * t, self.rope_dim), k_pe.float().transpose(1, 2))) * self.scale
        s = s.view(b, h, t, -1).masked_fill(~self._mask(qpos, kpos), float("-inf"))        # [B,H,T,L]
        p = torch.softmax(s, -1)
        o_lat = torch.bmm(p.view(b, h * t, -1), lat).view(b, h, t, self.rank)            # [B,H,T,R]
        return torch.matmul(o_lat, wvc.float().transpose(1, 2)).transpose(1, 2).to(q_nope.dtype)   # [B,T,H,v]
