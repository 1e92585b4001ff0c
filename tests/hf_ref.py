"""Build transformers' ``BailingHybridForCausalLM`` with the same weights as a bytebound model (test helper).

The HF model is the independent oracle of issue 2 (transformers >= 5.20, fp32, CPU, pure-torch path: its
modeling module is imported with fla / causal-conv1d hidden, so HF logs and uses its torch fallbacks even
where those packages are importable).
"""

from __future__ import annotations

import importlib
import sys

import torch

YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
# Packages whose kernels transformers' BailingHybrid would pick up at import when importable. They need a GPU
# (fla: triton), so the CPU oracle is always imported with them hidden: the pure-torch reference paths run.
_HIDE = ("fla", "causal_conv1d")


def _modeling():
    """``transformers...modeling_bailing_hybrid`` imported with fla / causal_conv1d hidden (torch fallbacks).

    With a CUDA torch wheel triton is installed, so ``import fla`` may succeed even on a CPU machine, and
    transformers would then bind fla's Triton kernels to CPU tensors."""
    name = "transformers.models.bailing_hybrid.modeling_bailing_hybrid"
    if name in sys.modules:
        return sys.modules[name]
    saved = {k: sys.modules[k] for k in list(sys.modules) if k.split(".")[0] in _HIDE}
    for k in saved:
        del sys.modules[k]
    for k in _HIDE:
        sys.modules[k] = None          # makes ``import fla`` raise ImportError
    try:
        return importlib.import_module(name)
    finally:
        for k in _HIDE:
            sys.modules.pop(k, None)
        sys.modules.update(saved)


def hf_config(cfg):
    from transformers.models.bailing_hybrid.configuration_bailing_hybrid import BailingHybridConfig
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling["factor"],
                "original_max_position_embeddings": cfg.rope_scaling["original_max_position_embeddings"]}
        rope.update({k: cfg.rope_scaling[k] for k in YARN_KEYS if cfg.rope_scaling.get(k) is not None})
    # HF sizes the shared expert as moe_intermediate_size * n_shared_experts: only comparable when equal.
    assert cfg.shared_intermediate == cfg.moe_intermediate_size * cfg.num_shared_experts, \
        "HF BailingHybrid cannot express a different shared-expert width"
    g = cfg.layer_group_size
    layer_types = None
    if isinstance(g, tuple):
        layer_types = ["full_attention" if x == 0 else "linear_attention" for x in g]
        g = len(g) + 1           # unused by HF once layer_types is given
    return BailingHybridConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.num_shared_experts, n_group=cfg.n_group, topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
        first_k_dense_replace=cfg.first_k_dense_replace, rms_norm_eps=cfg.rms_norm_eps,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, head_dim=cfg.head_dim, short_conv_kernel_size=cfg.short_conv_kernel_size,
        layer_group_size=g, layer_types=layer_types, kda_safe_gate=cfg.kda_safe_gate, kda_lower_bound=cfg.kda_lower_bound,
        rope_parameters=rope, max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_id, num_mtp_layers=0,
    )


def to_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Our (plain-weight) parameters under transformers' names."""
    cfg = model.cfg
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": sd["model.word_embeddings.weight"], "model.norm.weight": sd["model.norm.weight"],
           "lm_head.weight": sd["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        p, q = f"model.layers.{i}", f"model.layers.{i}"
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[f"{q}.{n}"] = sd[f"{p}.{n}"]
        a = f"{p}.attention"
        if cfg.is_mla(i):
            m = {"q_proj": "q_proj", "kv_a_proj_with_mqa": "kv_a_proj_with_mqa", "kv_b_proj": "kv_b_proj",
                 "g_proj": "g_proj", "dense": "o_proj", "kv_a_layernorm": "kv_a_layernorm"}
            for ours, theirs in m.items():
                out[f"{q}.self_attn.{theirs}.weight"] = sd[f"{a}.{ours}.weight"]
        else:
            for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_proj", "o_proj", "o_norm"):
                out[f"{q}.self_attn.{n}.weight"] = sd[f"{a}.{n}.weight"]
            out[f"{q}.self_attn.conv1d.weight"] = torch.cat(
                [sd[f"{a}.{c}_conv1d.weight"] for c in ("q", "k", "v")], 0)
            out[f"{q}.self_attn.forget_gate.f_proj.weight"] = sd[f"{a}.f_proj.weight"]
            out[f"{q}.self_attn.forget_gate.A_log"] = sd[f"{a}.A_log"]
            out[f"{q}.self_attn.forget_gate.dt_bias"] = sd[f"{a}.dt_bias"]
        m = f"{p}.mlp"
        if cfg.is_moe(i):
            out[f"{q}.mlp.gate.weight"] = sd[f"{m}.gate.weight"]
            out[f"{q}.mlp.gate.e_score_correction_bias"] = sd[f"{m}.gate.expert_bias"]
            out[f"{q}.mlp.experts.gate_up_proj"] = sd[f"{m}.experts.w13"]
            out[f"{q}.mlp.experts.down_proj"] = sd[f"{m}.experts.w2"]
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[f"{q}.mlp.shared_experts.{n}.weight"] = sd[f"{m}.shared_experts.{n}.weight"]
        else:
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[f"{q}.mlp.{n}.weight"] = sd[f"{m}.{n}.weight"]
    return out


def build_hf(model):
    """A float32 HF model carrying ``model``'s weights (strict load: every HF parameter set)."""
    hf = _modeling().BailingHybridForCausalLM(hf_config(model.cfg)).float().eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    return hf


def init_sensitive_(model, seed: int = 0, std: float = 0.12, expert_bias_std: float = 0.0):
    """Non-trivial random weights for oracle comparisons (so a wrong formula shows up clearly): linears and
    embeddings N(0, std), every norm weight N(1, 0.1), KDA ``A_log`` U(0, 2), ``dt_bias`` N(0, 0.5), conv
    weights N(0, 0.3), router ``expert_bias`` N(0, expert_bias_std) (0: zero). Plain-weight models only."""
    g = torch.Generator().manual_seed(seed)

    def rnd(shape):
        return torch.randn(shape, generator=g)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype in (torch.uint8, torch.float8_e4m3fn):
                raise ValueError(f"init_sensitive_ needs a plain-weight model ({name} is {p.dtype})")
            leaf = name.split(".")
            if name.endswith("A_log"):
                v = torch.rand(p.shape, generator=g) * 2
            elif name.endswith("dt_bias"):
                v = rnd(p.shape) * 0.5
            elif any("norm" in part for part in leaf[-2:]):
                v = 1 + 0.1 * rnd(p.shape)
            elif "conv1d" in name:
                v = rnd(p.shape) * 0.3
            elif name.endswith("expert_bias"):
                v = rnd(p.shape) * expert_bias_std
            else:
                v = rnd(p.shape) * std
            p.copy_(v.to(p.dtype))
    if hasattr(model, "finish_load"):
        model.finish_load()
    return model
