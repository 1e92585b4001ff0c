"""The tensors a Ling-3.0 checkpoint must hold, derived from its config (``docs/references.md`` §4).

Names follow the public ``inclusionAI/Ling-3.0-flash-fp4`` checkpoint: ``model.word_embeddings.weight``,
``model.layers.{i}.attention.*`` (KDA: q/k/v/f/g/b/o_proj, q/k/v_conv1d, A_log, dt_bias, o_norm; MLA:
q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, g_proj, dense), ``model.layers.{i}.mlp.*`` (dense:
gate/up/down_proj; MoE: gate.weight, gate.expert_bias, shared_experts.*, experts.{e}.{gate,up,down}_proj),
``model.norm.weight``, ``lm_head.weight`` and the NEXTN layer ``model.layers.{L}`` (+ enorm, hnorm, eh_proj,
final_layernorm).

Storage kinds: ``fp8`` linear = ``weight`` F8_E4M3 ``[N, K]`` + ``weight_scale_inv`` F32 ``[ceil(N/128),
ceil(K/128)]``; ``mxfp4`` expert = ``weight`` I8/U8 ``[N, K/2]`` + ``weight_scale_inv`` U8 ``[N, K/32]``;
``float`` = BF16/F16/F32.

Other spellings (``TensorSpec.aliases``): a checkpoint written by transformers' ``BailingHybridForCausalLM.
save_pretrained`` (>= 5.20) names the KDA output projection ``attention.dense`` (its conversion mapping renames
every ``self_attn.o_proj`` back to ``attention.dense`` on save, KDA and MLA alike; the Ling checkpoint calls it
``dense`` only in MLA layers). It holds no NEXTN tensors (the loader then builds the model without the layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bytebound.config import LingConfig

FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TensorSpec:
    """One expected checkpoint tensor.

    ``target``: the model parameter it fills; ``expert``/``rows`` say where inside a stacked expert tensor
    (``rows`` = (start, stop) along dim 1 of ``w13``/``w2``...). ``kind``: float | fp8 | fp8_scale | mxfp4 |
    mxfp4_scale. ``aliases``: other names the same tensor has in checkpoints of other writers (at most one of
    ``name`` and its aliases may be present).
    """
    name: str
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    kind: str
    target: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    aliases: tuple[str, ...] = ()


def _linear(out: list, name: str, n: int, k: int, fp8: bool, block, alias: str | None = None) -> None:
    al = (lambda suffix: (f"{alias}.{suffix}",)) if alias else (lambda suffix: ())
    if fp8:
        out.append(TensorSpec(f"{name}.weight", (n, k), (torch.float8_e4m3fn,), "fp8", f"{name}.weight",
                              aliases=al("weight")))
        sh = (math.ceil(n / block[0]), math.ceil(k / block[1]))
        out.append(TensorSpec(f"{name}.weight_scale_inv", sh, (torch.float32,), "fp8_scale",
                              f"{name}.weight_scale_inv", aliases=al("weight_scale_inv")))
    else:
        out.append(TensorSpec(f"{name}.weight", (n, k), FLOATS, "float", f"{name}.weight", aliases=al("weight")))


def _float(out: list, name: str, *shape: int) -> None:
    out.append(TensorSpec(name, tuple(shape), FLOATS, "float", name))


def expected_tensors(cfg: LingConfig) -> list[TensorSpec]:
    """Every tensor the checkpoint of ``cfg`` must contain, exactly once, in a stable order."""
    q, blk, h = cfg.quant, cfg.quant.weight_block_size, cfg.hidden_size
    out: list[TensorSpec] = []
    _float(out, "model.word_embeddings.weight", cfg.vocab_size, h)
    n_layers = cfg.num_hidden_layers + (1 if cfg.num_nextn_predict_layers else 0)
    for i in range(n_layers):
        p = f"model.layers.{i}"
        lin = lambda name, n, k, alias=None: _linear(out, name, n, k, q.linear_is_fp8(name), blk, alias)  # noqa: E731
        _float(out, f"{p}.input_layernorm.weight", h)
        _float(out, f"{p}.post_attention_layernorm.weight", h)
        a = f"{p}.attention"
        if cfg.is_mla(i):
            lin(f"{a}.q_proj", cfg.num_attention_heads * cfg.qk_head_dim, h)
            lin(f"{a}.kv_a_proj_with_mqa", cfg.mla_cache_dim, h)
            _float(out, f"{a}.kv_a_layernorm.weight", cfg.kv_lora_rank)
            lin(f"{a}.kv_b_proj", cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
            lin(f"{a}.g_proj", cfg.num_attention_heads, h)
            lin(f"{a}.dense", h, cfg.num_attention_heads * cfg.v_head_dim)
        else:
            d = cfg.kda_dim
            for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):
                lin(f"{a}.{n}", d, h)
            lin(f"{a}.b_proj", cfg.num_attention_heads, h)
            lin(f"{a}.o_proj", h, d, alias=f"{a}.dense")       # transformers' save_pretrained spelling
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                _float(out, f"{a}.{n}.weight", d, 1, cfg.short_conv_kernel_size)
            _float(out, f"{a}.A_log", cfg.num_attention_heads)
            _float(out, f"{a}.dt_bias", d)
            _float(out, f"{a}.o_norm.weight", cfg.head_dim)
        m = f"{p}.mlp"
        if cfg.is_moe(i):
            _float(out, f"{m}.gate.weight", cfg.num_experts, h)
            if cfg.moe_router_enable_expert_bias:
                _float(out, f"{m}.gate.expert_bias", cfg.num_experts)
            if cfg.num_shared_experts:
                si = cfg.shared_intermediate
                lin(f"{m}.shared_experts.gate_proj", si, h)
                lin(f"{m}.shared_experts.up_proj", si, h)
                lin(f"{m}.shared_experts.down_proj", h, si)
            inter = cfg.moe_intermediate_size
            for e in range(cfg.num_experts):
                for proj, (n, k), tgt, rows in (("gate_proj", (inter, h), "w13", (0, inter)),
                                                ("up_proj", (inter, h), "w13", (inter, 2 * inter)),
                                                ("down_proj", (h, inter), "w2", (0, h))):
                    name = f"{m}.experts.{e}.{proj}"
                    if q.routed_experts == "mxfp4":
                        out.append(TensorSpec(f"{name}.weight", (n, k // 2), (torch.int8, torch.uint8), "mxfp4",
                                              f"{m}.experts.{tgt}", e, rows))
                        out.append(TensorSpec(f"{name}.weight_scale_inv", (n, k // 32), (torch.uint8,),
                                              "mxfp4_scale", f"{m}.experts.{tgt}_scale", e, rows))
                    else:
                        out.append(TensorSpec(f"{name}.weight", (n, k), FLOATS, "float", f"{m}.experts.{tgt}", e, rows))
        else:
            lin(f"{m}.gate_proj", cfg.intermediate_size, h)
            lin(f"{m}.up_proj", cfg.intermediate_size, h)
            lin(f"{m}.down_proj", h, cfg.intermediate_size)
        if i == cfg.num_hidden_layers:
            for n in ("enorm", "hnorm", "final_layernorm"):
                _float(out, f"{p}.{n}.weight", h)
            lin(f"{p}.eh_proj", h, 2 * h)
    _float(out, "model.norm.weight", h)
    out.append(TensorSpec("lm_head.weight", (cfg.vocab_size, h), FLOATS, "float", "lm_head.weight"))
    return out
