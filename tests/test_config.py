"""config.json parsing: round trip, layer kinds, and every ConfigError names the offending field."""

from __future__ import annotations

import json

import pytest

from bytebound.config import REQUIRED, LingConfig, QuantConfig, tiny_config
from bytebound.errors import ConfigError


def base_dict(**kw) -> dict:
    d = tiny_config().to_dict()
    d.update(kw)
    return d


def test_round_trip_through_json():
    cfg = tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                      quant=QuantConfig(method="fp8", routed_experts="mxfp4"))
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["model_type"] == "bailing_hybrid"
    assert d["quantization_config"]["routed_experts_quant_method"] == "mxfp4"
    back = LingConfig.from_dict(d)
    assert back == cfg


def test_from_file_reads_dir_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(base_dict()))
    assert LingConfig.from_file(tmp_path) == tiny_config()
    assert LingConfig.from_file(tmp_path / "config.json") == tiny_config()


def test_from_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        LingConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        LingConfig.from_file(tmp_path)


def test_layer_kinds_int_and_list():
    cfg = tiny_config()                                      # group 2: KDA, MLA, KDA, MLA (+ NEXTN = MLA)
    assert [cfg.is_mla(i) for i in range(5)] == [False, True, False, True, True]
    assert cfg.kda_layers == [0, 2] and cfg.mla_layers == [1, 3]
    cfg6 = tiny_config(num_hidden_layers=6, layer_group_size=3, first_k_dense_replace=2)
    assert cfg6.mla_layers == [2, 5]
    assert [cfg6.is_moe(i) for i in range(7)] == [False, False, True, True, True, True, True]
    lst = tiny_config(layer_group_size=[1, 0, 0, 1])
    assert lst.mla_layers == [1, 2] and lst.kda_layers == [0, 3]


def test_aliases_and_extra_keys_kept():
    d = base_dict(some_future_key=7)
    d["num_local_experts"] = d.pop("num_experts")               # transformers' name
    d["n_shared_experts"] = d.pop("num_shared_experts")
    d["num_mtp_layers"] = d.pop("num_nextn_predict_layers")
    cfg = LingConfig.from_dict(d)
    assert cfg.num_experts == 16 and cfg.num_shared_experts == 1 and cfg.num_nextn_predict_layers == 1
    assert cfg.extra["some_future_key"] == 7


@pytest.mark.parametrize("mt", ["bailing_moe", "deepseek_v3", None])
def test_wrong_model_type(mt):
    d = base_dict(model_type=mt)
    with pytest.raises(ConfigError, match="model_type"):
        LingConfig.from_dict(d)


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field(field):
    d = base_dict()
    del d[field]
    with pytest.raises(ConfigError, match=f"missing required field.*{field}"):
        LingConfig.from_dict(d)


def test_required_field_null_is_missing():
    with pytest.raises(ConfigError, match="hidden_size"):
        LingConfig.from_dict(base_dict(hidden_size=None))


@pytest.mark.parametrize("value", [64.5, "64", -1, True])
def test_required_field_wrong_type(value):
    with pytest.raises(ConfigError, match="hidden_size"):
        LingConfig.from_dict(base_dict(hidden_size=value))


@pytest.mark.parametrize("kw, field", [
    (dict(n_group=3), "n_group"),                                   # 3 does not divide 16
    (dict(n_group=0), "n_group"),
    (dict(topk_group=5), "topk_group"),                             # > n_group 4
    (dict(topk_group=1, num_experts_per_tok=5), "num_experts_per_tok"),  # 1 group of 4 cannot hold top-5
    (dict(num_experts_per_tok=17), "num_experts_per_tok"),
    (dict(n_group=16, topk_group=8), "top-2"),                     # 1 expert per group
    (dict(layer_group_size=[1, 0, 1]), "layer_group_size"),         # 3 entries, 4 layers
    (dict(layer_group_size=[1, 0, 1, 0, 1]), "layer_group_size"),
    (dict(layer_group_size=[1, 2, 1, 0]), "layer_group_size"),
    (dict(layer_group_size=0), "layer_group_size"),
    (dict(score_function="softmax"), "score_function"),
    (dict(q_lora_rank=64), "q_lora_rank"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(first_k_dense_replace=5), "first_k_dense_replace"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers"),
    (dict(no_kda_lora=False), "no_kda_lora"),
    (dict(gated_attention_proj_granularity_type="element_wise"), "gated_attention_proj_granularity_type"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "original_max_position_embeddings"),
    (dict(expert_swiglu_limit_list=[7.0, 7.0]), "expert_swiglu_limit_list"),
    (dict(eos_token_id=128), "eos_token_id"),
])
def test_contradictions_raise_naming_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        LingConfig.from_dict(base_dict(**kw))


@pytest.mark.parametrize("q, field", [
    ({"quant_method": "gptq"}, "quant_method"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "routed_experts_quant_method": "nvfp4"}, "routed_experts_quant_method"),
    ({"quant_method": "fp8", "routed_experts_quant_method": "mxfp4", "routed_experts_group_size": 16},
     "routed_experts_group_size"),
])
def test_quantization_config_errors(q, field):
    with pytest.raises(ConfigError, match=field):
        LingConfig.from_dict(base_dict(quantization_config=q))


def test_quantization_config_parsed():
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "scale_fmt": "ue8m0", "modules_to_not_convert": ["lm_head", "b_proj"],
         "routed_experts_quant_method": "mxfp4", "routed_experts_group_size": 32}
    cfg = LingConfig.from_dict(base_dict(quantization_config=q))
    assert cfg.quant.method == "fp8" and cfg.quant.routed_experts == "mxfp4"
    assert cfg.quant.linear_is_fp8("model.layers.0.attention.q_proj")
    assert not cfg.quant.linear_is_fp8("model.layers.0.attention.b_proj")
    assert not cfg.quant.linear_is_fp8("lm_head")
    assert cfg.quant.to_json()["modules_to_not_convert"] == ["lm_head", "b_proj"]


def test_replace_validates():
    with pytest.raises(ConfigError, match="n_group"):
        tiny_config().replace(n_group=5)
    with pytest.raises(ConfigError, match="layer_group_size"):
        tiny_config(layer_group_size=[1, 0])


# ---- config.json of the wrong JSON type, zero and absurd sizes ------------------------------------------------
@pytest.mark.parametrize("text", ["[]", "null", "5", '"x"'])
def test_config_json_not_an_object(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=r"config.json: must be a JSON object"):
        LingConfig.from_file(tmp_path)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        LingConfig.from_dict(json.loads(text))


@pytest.mark.parametrize("kw, field", [
    (dict(quantization_config="fp8"), "quantization_config"),
    (dict(quantization_config=["fp8"]), "quantization_config"),
    (dict(rope_scaling="yarn"), "rope_scaling"),
    (dict(rope_scaling=["yarn"]), "rope_scaling"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": ["a", 128]}), "weight_block_size"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": 128}), "weight_block_size"),
    (dict(quantization_config={"quant_method": "fp8", "routed_experts_quant_method": "mxfp4",
                               "routed_experts_group_size": "32"}), "routed_experts_group_size"),
    (dict(quantization_config={"quant_method": "fp8", "routed_experts_quant_method": "none",
                               "modules_to_not_convert": "lm_head"}), "modules_to_not_convert"),
])
def test_nested_objects_of_the_wrong_type(kw, field):
    with pytest.raises(ConfigError, match=field):
        LingConfig.from_dict(base_dict(**kw))


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                                   "kv_lora_rank", "v_head_dim", "short_conv_kernel_size"])
def test_zero_sized_dimension_rejected(field):
    with pytest.raises(ConfigError, match=f"{field}=0 must be a positive int"):
        LingConfig.from_dict(base_dict(**{field: 0}))
    with pytest.raises(ConfigError, match=field):              # the same rule on every construction path
        tiny_config().replace(**{field: 0})


@pytest.mark.parametrize("kw, field", [
    (dict(intermediate_size=0), "intermediate_size"),                          # layer 0 is a dense MLP
    (dict(num_experts=0, num_experts_per_tok=0, intermediate_size=0, first_k_dense_replace=0), "intermediate_size"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(qk_nope_head_dim=0, qk_rope_head_dim=0), "qk_nope_head_dim"),
    (dict(short_conv_kernel_size="4"), "short_conv_kernel_size"),
    (dict(first_k_dense_replace=-1), "first_k_dense_replace"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(hidden_size=10**12), "hidden_size"),
    (dict(num_hidden_layers=10**9, first_k_dense_replace=0), "num_hidden_layers"),
])
def test_sizes_zero_where_used_or_absurd_rejected(kw, field):
    with pytest.raises(ConfigError, match=field):
        LingConfig.from_dict(base_dict(**kw))


@pytest.mark.parametrize("kw", [
    dict(num_experts=0, num_experts_per_tok=0),                  # dense-only model: is_moe is False everywhere
    dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, num_shared_experts=0),
    dict(num_shared_experts=0), dict(first_k_dense_replace=0), dict(num_nextn_predict_layers=0),
    dict(first_k_dense_replace=0, intermediate_size=0),          # every layer MoE: the dense width is unused
    dict(qk_nope_head_dim=0), dict(qk_rope_head_dim=0),
])
def test_zero_where_it_means_none_still_allowed(kw):
    cfg = LingConfig.from_dict(base_dict(**kw))
    assert all(getattr(cfg, k) == v for k, v in kw.items())
