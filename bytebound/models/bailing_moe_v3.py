"""BailingMoeV3 (Ling-3.0, ``model_type: bailing_hybrid``): KDA/MLA hybrid decoder + MoE + NEXTN layer.

Parameter names equal the checkpoint's tensor names (``docs/references.md`` §4), except the routed
experts, which the loader stacks from per-expert tensors into ``mlp.experts.{w13,w13_scale,w2,w2_scale}``.

    h = embed(ids);  for each layer: h += Attn(RMSNorm(h)); h += MLP_or_MoE(RMSNorm(h))
    hidden = model.norm(h);  logits = lm_head(hidden)
    (each residual add runs inside the norm after it, ``RMSNorm.add_norm``: a layer returns ``(h, delta)``)
    NEXTN (model.layers.{L}): x = eh_proj([enorm(embed(t+1)) | hnorm(hidden_t)]) -> MLA + MoE block
                              -> final_layernorm -> the same lm_head          (predicts token t+2)
"""

from __future__ import annotations

import torch
from torch import nn

from bytebound.config import LingConfig
from bytebound.layers.kda import KimiDeltaAttention
from bytebound.layers.lm_head import LMHead
from bytebound.layers.mla import GatedMLA
from bytebound.layers.moe import MoE, DenseMLP
from bytebound.layers.norm import RMSNorm


def _lin_fmt(cfg: LingConfig, prefix: str):
    return lambda name: "fp8" if cfg.quant.linear_is_fp8(f"{prefix}.{name}") else "plain"


class DecoderLayer(nn.Module):
    """Pre-norm block: attention (KDA or gated MLA) then dense SwiGLU or MoE, each with a residual."""

    def __init__(self, cfg: LingConfig, i: int, dtype, device):
        super().__init__()
        p = f"model.layers.{i}"
        self.index, self.is_mla = i, cfg.is_mla(i)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        attn = GatedMLA if self.is_mla else KimiDeltaAttention
        self.attention = attn(cfg, _lin_fmt(cfg, f"{p}.attention"), dtype, device)
        if cfg.is_moe(i):
            self.mlp = MoE(cfg, i, _lin_fmt(cfg, f"{p}.mlp.shared_experts"), dtype, device)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, _lin_fmt(cfg, f"{p}.mlp"),
                                cfg.quant.weight_block_size, dtype, device, cfg.swiglu_limit(i))

    def forward(self, h, delta, positions, state=None, kv_len=None):
        """Residual stream ``h [B, T, H]`` plus the previous layer's last output ``delta`` (None: nothing to add)
        -> ``(h, delta)`` of this layer, whose output is ``h + delta``. The adds run inside the norms
        (``RMSNorm.add_norm``: one launch with the fused norm kernel); the next norm does this layer's last one.
        Where the attention's fused projection can take the input add + norm itself (``fold_input_norm``, its
        ``proj_fn.add_norm``: the FP8 MMA GEMV at M <= 4), that one launch does the add, the norm and the
        projection; it returns None for calls it does not take, which then run as above."""
        attn, norm = self.attention, self.input_layernorm
        fold = getattr(attn.proj_fn, "add_norm", None) if attn.fold_input_norm and delta is not None else None
        folded = fold(delta, h, norm.weight, norm.eps) if fold is not None else None
        if folded is not None:
            y, x, h = folded
        else:
            y, (x, h) = None, norm.add_norm(delta, h)
        if self.is_mla:
            a = attn(x, positions, state, kv_len, y=y)
        else:
            a = attn(x, state, y=y)
        return self.mlp.add_norm_forward(self.post_attention_layernorm, a, h)     # x, h = norm(a, h); mlp(x)


class NextNLayer(DecoderLayer):
    """The MTP/NEXTN layer ``model.layers.{num_hidden_layers}``: eh_proj over [enorm(e) | hnorm(h)], then an
    MLA + MoE decoder block, then ``final_layernorm`` (``docs/references.md`` §2.1; order: embedding
    first, hidden second)."""

    def __init__(self, cfg: LingConfig, dtype, device):
        super().__init__(cfg, cfg.num_hidden_layers, dtype, device)
        h = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        from bytebound.layers.linear import QLinear
        self.eh_proj = QLinear(2 * h, h, _lin_fmt(cfg, f"model.layers.{cfg.num_hidden_layers}")("eh_proj"),
                               cfg.quant.weight_block_size, dtype, device)

    def forward(self, emb, prev_hidden, positions, state=None, kv_len=None):
        """``emb [B, T, H]`` (embedding of token t+1), ``prev_hidden [B, T, H]`` (target hidden at t) ->
        normed draft hidden ``[B, T, H]``."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(prev_hidden.to(emb.dtype))], -1))
        h, delta = super().forward(x, None, positions, state, kv_len)
        return self.final_layernorm.add_norm(delta, h)[0]


class BailingMoeV3Model(nn.Module):
    """Embedding, decoder layers (+ the NEXTN layer at index L when the config has one) and final norm."""

    def __init__(self, cfg: LingConfig, dtype, device):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        layers = [DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers)]
        if cfg.num_nextn_predict_layers:
            layers.append(NextNLayer(cfg, dtype, device))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class BailingMoeV3ForCausalLM(nn.Module):
    """The whole model. Batch dimension kept for training; inference runs with B = 1.

    Args:
        cfg: parsed config. dtype: compute/storage dtype of plain tensors (float32 on CPU, bfloat16 on GPU).
    """

    def __init__(self, cfg: LingConfig, dtype=torch.float32, device=None):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.model = BailingMoeV3Model(cfg, dtype, device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, device)

    def finish_load(self) -> "BailingMoeV3ForCausalLM":
        """After weights are in place (``to_empty`` + fill): rebuild buffers, materialise MLA absorbed weights."""
        from bytebound.layers.rope import Rope
        for m in self.modules():
            if isinstance(m, Rope):
                m.reset_buffers()
        for layer in self.model.layers:
            if layer.is_mla:
                layer.attention.prepare(self.dtype)
        return self.eval()

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers[: self.cfg.num_hidden_layers])

    @property
    def nextn(self) -> NextNLayer | None:
        return self.model.layers[self.cfg.num_hidden_layers] if self.cfg.num_nextn_predict_layers else None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.word_embeddings(ids)

    def new_state(self, max_len: int, batch: int = 1, device=None) -> list:
        """Fresh per-layer state: ``KDAState`` for KDA layers, ``MLAState`` (``max_len`` slots) for MLA and NEXTN."""
        dev = device or self.lm_head.weight.device
        out = []
        for layer in self.model.layers:
            a = layer.attention
            out.append(a.new_state(batch, max_len, self.dtype, dev) if layer.is_mla else a.new_state(batch, dev))
        return out

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, state: list | None = None,
                kv_len: int | None = None) -> torch.Tensor:
        """``ids [B, T]`` at ``positions [T]`` -> final-normed hidden ``[B, T, H]``. With ``state`` (from
        :meth:`new_state`) continues the sequence; without it runs the whole causal sequence from scratch."""
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)
        h, delta = self.embed(ids), None
        for i, layer in enumerate(self.decoder_layers):
            h, delta = layer(h, delta, positions, None if state is None else state[i], kv_len)
        return self.model.norm.add_norm(delta, h)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[.., V]`` through the LM head's configured path."""
        return self.lm_head(hidden)

    def nextn_forward(self, next_ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                      state: list | None = None, kv_len: int | None = None) -> torch.Tensor:
        """NEXTN draft hidden for ``next_ids [B, T]`` (token t+1) given target ``prev_hidden [B, T, H]`` (at t)."""
        layer = self.nextn
        st = None if state is None else state[self.cfg.num_hidden_layers]
        return layer(self.embed(next_ids), prev_hidden, positions, st, kv_len)
