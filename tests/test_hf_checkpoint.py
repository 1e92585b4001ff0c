"""Checkpoints written by transformers' own ``BailingHybridForCausalLM.save_pretrained`` (issue 22, item 5).

The end-to-end tests build a random ``bailing_hybrid`` model in transformers (>= 5.20) with its own config class
and parameter names (no bytebound code involved), save it with ``save_pretrained`` (its config spellings, the KDA
output projection as ``attention.dense``, no NEXTN tensors although the config says one NEXTN layer, no
tokenizer), and check that bytebound loads it and matches transformers' logits (fp32, CPU, 1e-4 relative) and
greedy tokens; that MTP is refused at start-up with a named error; and that ``--prompt-ids`` works without a
tokenizer. The unit tests check each config spelling and tensor-name mapping on its own, with values that
differ from bytebound's defaults (an ignored mapping would fail them).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bytebound.config import SPELLINGS, LingConfig, tiny_config
from bytebound.errors import CheckpointError, ConfigError, RequestError
from conftest import NANO_TOKENIZER, make_model, quant_tiny


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:2] if x.isdigit())


try:        # only the end-to-end tests need transformers; the mapping unit tests run without it
    import transformers
    HF_VERSION = transformers.__version__
except ImportError:
    HF_VERSION = "none"
needs_hf = pytest.mark.skipif(HF_VERSION == "none" or _version(HF_VERSION) < (5, 20),
                              reason=f"transformers >= 5.20 writes the checkpoint (pip install -e '.[test]'), "
                                     f"have {HF_VERSION}")

TOL = 1e-4          # as tests/test_model_hf.py: max |diff| / max |logit|, fp32
T = 24              # prompt length of the logits comparison
N_GREEDY = 8

# Two transformers configs: (1) the periodic layer pattern, default RoPE; (2) a per-layer list of layer kinds
# that no layer_group_size gives, YaRN, two dense layers, KDA head width != MLA rope width, one routing group.
HF_CONFIGS = {
    "periodic": dict(num_hidden_layers=4, layer_group_size=2, first_k_dense_replace=1, n_group=4, topk_group=2,
                     num_local_experts=16, num_experts_per_tok=4, head_dim=16, qk_rope_head_dim=8,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "layer_list_yarn": dict(num_hidden_layers=4, layer_group_size=6,
                            layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention"],
                            first_k_dense_replace=2, n_group=1, topk_group=1, num_local_experts=8,
                            num_experts_per_tok=2, head_dim=24, qk_rope_head_dim=8, routed_scaling_factor=1.5,
                            norm_topk_prob=False, max_position_embeddings=256,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                                             "original_max_position_embeddings": 32}),
}
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=4, n_shared_experts=1, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
              short_conv_kernel_size=4, pad_token_id=0, eos_token_id=1, num_mtp_layers=1)


def _hf_random_model(kw: dict, seed: int):
    """transformers' model with non-trivial random weights set by its own parameter names: linears N(0, 0.12),
    norms N(1, 0.1), KDA A_log U(0, 2) and dt_bias N(0, 0.5), convs N(0, 0.3), router bias N(0, 0.2)."""
    from hf_ref import _modeling
    from transformers.models.bailing_hybrid.configuration_bailing_hybrid import BailingHybridConfig
    cfg = BailingHybridConfig(**{**COMMON, **kw})
    model = _modeling().BailingHybridForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                v = torch.rand(p.shape, generator=g) * 2
            elif name.endswith("dt_bias"):
                v = r * 0.5
            elif "norm" in name.split(".")[-2]:
                v = 1 + 0.1 * r
            elif "conv1d" in name:
                v = r * 0.3
            elif name.endswith("e_score_correction_bias"):
                v = r * 0.2
            else:
                v = r * 0.12
            p.copy_(v)
    return model


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    """``name -> (transformers model, checkpoint dir written by its save_pretrained)``, built on demand."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = _hf_random_model(HF_CONFIGS[name], seed=len(cache) + 3)
            d = tmp_path_factory.mktemp(f"hf_{name}")
            # the second one in shards with model.safetensors.index.json, as a full-size model is saved
            hf.save_pretrained(d, max_shard_size="50KB" if name == "layer_list_yarn" else "5GB")
            cache[name] = (hf, d)
        return cache[name]
    return get


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@needs_hf
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_saved_checkpoint_is_what_the_issue_describes(hf_ckpt, name):
    """Guard: the files really use transformers' spellings, so the tests below prove what they claim."""
    hf, d = hf_ckpt(name)
    raw = json.loads((d / "config.json").read_text())
    for theirs in ("num_experts_per_token", "num_expert_group", "moe_renormalize", "model_max_length",
                   "linear_head_dim", "rope_parameters", "layer_types", "mlp_layer_types"):
        assert theirs in raw, theirs
    assert "num_experts_per_tok" not in raw and raw["head_dim"] == raw["qk_rope_head_dim"] != raw["linear_head_dim"]
    assert raw["num_nextn_predict_layers"] == 1
    from bytebound.analysis.ledger import specs_from_safetensors
    names = set(specs_from_safetensors(d))
    assert (d / "model.safetensors.index.json").exists() == (name == "layer_list_yarn")
    kda = [i for i, t in enumerate(raw["layer_types"]) if t == "linear_attention"]
    assert all(f"model.layers.{i}.attention.dense.weight" in names for i in kda)
    assert not any(".o_proj." in n for n in names)
    assert not any(n.startswith(f"model.layers.{raw['num_hidden_layers']}.") for n in names)
    assert not (d / "tokenizer.json").exists()


@needs_hf
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_saved_checkpoint_matches_transformers_logits(hf_ckpt, name):
    from bytebound.checkpoint.loader import load_model
    hf, d = hf_ckpt(name)
    ours = load_model(d)
    assert ours.nextn is None and ours.nextn_absent and ours.cfg.num_nextn_predict_layers == 0
    hc = hf.config
    assert ours.cfg.head_dim == hc.linear_head_dim and ours.cfg.qk_rope_head_dim == hc.head_dim
    assert [not ours.cfg.is_mla(i) for i in range(hc.num_hidden_layers)] == \
        [t == "linear_attention" for t in hc.layer_types]
    ids = torch.randint(0, hc.vocab_size, (1, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits.float()
        got = ours.logits(ours(ids))
    assert got.shape == ref.shape
    assert _rel(got, ref) < TOL


@needs_hf
def test_hf_saved_checkpoint_in_the_byte_ledger(hf_ckpt):
    """``analyze --checkpoint`` prices the KDA output projection (``attention.dense``) with the projections."""
    from bytebound.analysis.ledger import ledger_from_specs, specs_from_safetensors
    _, d = hf_ckpt("periodic")
    cfg = LingConfig.from_file(d)
    led = ledger_from_specs(cfg, specs_from_safetensors(d))
    kda = sum(it.params for it in led.items if it.group == "KDA projections")
    assert kda == len(cfg.kda_layers) * 6 * cfg.kda_dim * cfg.hidden_size


@needs_hf
def test_hf_in_memory_tensor_names_are_a_named_error(tmp_path):
    """``save_pretrained(save_original_format=False)`` keeps transformers' in-memory names and fused tensors:
    one named error saying how to save it instead (not a list of a hundred unexpected tensors)."""
    from bytebound.checkpoint.loader import load_model
    hf = _hf_random_model(HF_CONFIGS["periodic"], seed=9)
    hf.save_pretrained(tmp_path, save_original_format=False)
    assert "model.embed_tokens.weight" in load_file(str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="save_original_format=True"):
        load_model(tmp_path)


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@needs_hf
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_saved_checkpoint_greedy_tokens_match(hf_ckpt, name):
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    hf, d = hf_ckpt(name)
    eng = Engine(model=str(d), max_model_len=64)
    assert eng.tokenizer is None and eng.drafter is None
    prompt = [7, 21, 3, 99, 42, 17]
    out = eng.generate(prompt, SamplingParams(max_tokens=N_GREEDY, ignore_eos=True))[0]
    assert out.token_ids == _hf_greedy(hf, prompt, N_GREEDY)


@needs_hf
def test_hf_saved_checkpoint_refuses_mtp_by_name(hf_ckpt):
    from bytebound.engine.engine import Engine
    _, d = hf_ckpt("periodic")
    with pytest.raises(ConfigError, match=r"NEXTN.*no model\.layers\.4\.\* tensors"):
        Engine(model=str(d), speculative_steps=3, max_model_len=64)


@needs_hf
def test_hf_saved_checkpoint_cli(hf_ckpt, capsys):
    """``generate --prompt-ids`` works without a tokenizer and prints the engine's ids; MTP and a text prompt
    are one named line each (exit 2)."""
    from bytebound.cli import main
    hf, d = hf_ckpt("periodic")
    base = ["generate", "--model", str(d), "--max-tokens", "4"]
    assert main(base + ["--prompt-ids", "7,21,3"]) == 0
    got = [int(t) for t in capsys.readouterr().out.split("token ids:")[1].split()]
    # EOS (id 1) ends generation, as in the engine; without EOS in the 4 tokens they are transformers' greedy
    want = _hf_greedy(hf, [7, 21, 3], 4)
    want = want[:want.index(1)] if 1 in want else want
    assert got == want
    assert main(base + ["--prompt-ids", "7,21,3", "--speculative-algorithm", "NEXTN"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and "NEXTN" in err and "Traceback" not in err
    assert main(base + ["--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert "RequestError" in err and "no tokenizer.json" in err and "--prompt-ids" in err


# ---- each config spelling on its own ----------------------------------------------------------------------

# transformers' spelling -> a value differing from LingConfig's default (or required), and the field's value
NON_DEFAULT = {
    "num_experts_per_token": 3, "num_expert_group": 2, "moe_renormalize": False, "model_max_length": 2048,
    "num_local_experts": 8, "n_shared_experts": 2, "num_mtp_layers": 1, "linear_conv_kernel_dim": 3,
    "dtype": "float32",
}


def test_every_spelling_has_a_case():
    assert set(NON_DEFAULT) == set(SPELLINGS)


@pytest.mark.parametrize("theirs", list(SPELLINGS))
def test_spelling_maps_to_our_field(theirs):
    ours = SPELLINGS[theirs]
    d = tiny_config().to_dict()
    d.pop(ours)
    d[theirs] = NON_DEFAULT[theirs]
    default = LingConfig.__dataclass_fields__[ours].default      # MISSING for a required field
    assert default is dataclasses.MISSING or NON_DEFAULT[theirs] != default
    cfg = LingConfig.from_dict(d)
    assert getattr(cfg, ours) == NON_DEFAULT[theirs]
    assert theirs not in cfg.extra and theirs not in cfg.to_dict()
    assert LingConfig.from_dict(cfg.to_dict()) == cfg          # written back in our spelling only


@pytest.mark.parametrize("theirs", list(SPELLINGS))
def test_two_spellings_that_disagree_are_a_named_error(theirs):
    ours = SPELLINGS[theirs]
    d = tiny_config().to_dict()
    d[ours] = NON_DEFAULT[theirs]
    assert LingConfig.from_dict({**d, theirs: NON_DEFAULT[theirs]}) is not None      # agreeing: fine
    other = {bool: lambda v: not v, int: lambda v: v + 1, str: lambda v: "bfloat16"}[type(NON_DEFAULT[theirs])]
    with pytest.raises(ConfigError, match=f"{ours}=.*{theirs}="):
        LingConfig.from_dict({**d, theirs: other(NON_DEFAULT[theirs])})


def _hf_form(**kw) -> dict:
    """tiny_config's dict in transformers' form for the head widths: head_dim = rope width, linear_head_dim."""
    d = tiny_config().to_dict()
    d["linear_head_dim"], d["head_dim"] = d["head_dim"], d["qk_rope_head_dim"]
    d.update(kw)
    return d


def test_linear_head_dim_is_the_kda_width_and_head_dim_the_rope_width():
    cfg = LingConfig.from_dict(_hf_form(linear_num_heads=4, qk_head_dim=24))
    assert cfg.head_dim == 16 and cfg.qk_rope_head_dim == 8 and cfg == tiny_config()
    with pytest.raises(ConfigError, match="head_dim=12 must equal qk_rope_head_dim"):
        LingConfig.from_dict(_hf_form(head_dim=12))
    with pytest.raises(ConfigError, match="linear_num_heads=2"):
        LingConfig.from_dict(_hf_form(linear_num_heads=2))
    with pytest.raises(ConfigError, match="qk_head_dim=20"):
        LingConfig.from_dict(_hf_form(qk_head_dim=20))


def test_rope_parameters_win_over_the_stale_top_level_rope_theta():
    d = _hf_form(rope_theta=6e6, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    cfg = LingConfig.from_dict(d)
    assert cfg.rope_theta == 500.0 and cfg.rope_scaling is None
    yarn = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 16.0}
    cfg = LingConfig.from_dict(_hf_form(rope_theta=6e6, rope_parameters=yarn))
    assert cfg.rope_theta == 500.0
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                "beta_fast": 16.0}
    with pytest.raises(ConfigError, match="rope_type="):
        LingConfig.from_dict(_hf_form(rope_parameters={"rope_type": "dynamic", "rope_theta": 1.0, "factor": 2.0}))
    with pytest.raises(ConfigError, match="rope_parameters"):
        LingConfig.from_dict(_hf_form(rope_parameters=[1, 2]))


def test_layer_types_give_the_layer_kinds():
    periodic = ["linear_attention", "full_attention"] * 2
    assert LingConfig.from_dict(_hf_form(layer_types=periodic)).layer_group_size == 2      # int form kept
    odd = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    cfg = LingConfig.from_dict(_hf_form(layer_types=odd))             # layer_group_size 2 says otherwise
    assert cfg.layer_group_size == (0, 1, 1, 0) and cfg.mla_layers == [0, 3]
    with pytest.raises(ConfigError, match="layer_types="):
        LingConfig.from_dict(_hf_form(layer_types=["linear_attention", "sliding_attention"] * 2))
    with pytest.raises(ConfigError, match="layer_group_size list has 3 entries"):
        LingConfig.from_dict(_hf_form(layer_types=odd[:3]))


def test_mlp_layer_types_give_first_k_dense_replace():
    d = _hf_form(mlp_layer_types=["dense", "dense", "sparse", "sparse"])
    d.pop("first_k_dense_replace")
    assert LingConfig.from_dict(d).first_k_dense_replace == 2
    with pytest.raises(ConfigError, match="first_k_dense_replace=1 and mlp_layer_types=2"):
        LingConfig.from_dict(_hf_form(mlp_layer_types=["dense", "dense", "sparse", "sparse"]))
    with pytest.raises(ConfigError, match="dense layer after a sparse one"):
        LingConfig.from_dict(_hf_form(mlp_layer_types=["dense", "sparse", "dense", "sparse"]))
    with pytest.raises(ConfigError, match="mlp_layer_types="):
        LingConfig.from_dict(_hf_form(mlp_layer_types=["dense", "moe", "moe", "moe"]))


def test_unsupported_transformers_settings_are_named():
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        LingConfig.from_dict(_hf_form(hidden_act="gelu"))
    with pytest.raises(ConfigError, match="attention_bias"):
        LingConfig.from_dict(_hf_form(attention_bias=True))
    assert LingConfig.from_dict(_hf_form(hidden_act="silu", attention_bias=False)) == tiny_config()


# ---- tensor names, NEXTN absence and the tokenizer on bytebound's own checkpoints -----------------------------

@pytest.fixture(scope="module")
def own_model():
    return make_model(seed=4)


def _write(model, d, quant=None):
    from bytebound.checkpoint.writer import save_pretrained
    return save_pretrained(model, d, quant=quant, float_dtype=torch.float32, tokenizer_dir=NANO_TOKENIZER)


def _rewrite(d, fn) -> None:
    sd = load_file(str(d / "model.safetensors"))
    save_file(fn(sd), str(d / "model.safetensors"))


def _kda_dense(sd: dict, cfg) -> dict:
    """Every KDA ``attention.o_proj.*`` renamed to transformers' ``attention.dense.*``."""
    out = {}
    for k, v in sd.items():
        i = int(k.split(".")[2]) if k.startswith("model.layers.") else -1
        if ".attention.o_proj." in k and 0 <= i < cfg.num_hidden_layers and not cfg.is_mla(i):
            k = k.replace(".attention.o_proj.", ".attention.dense.")
        out[k] = v
    return out


@pytest.mark.parametrize("quant", [False, True], ids=["plain", "fp8"])
def test_kda_output_projection_as_attention_dense(tmp_path, own_model, quant):
    from bytebound.checkpoint.loader import load_model
    cfg = own_model.cfg
    ref_dir = _write(own_model, tmp_path / "ref", quant_tiny() if quant else None)
    d = _write(own_model, tmp_path / "hf", quant_tiny() if quant else None)
    _rewrite(d, lambda sd: _kda_dense(sd, cfg))
    names = set(load_file(str(d / "model.safetensors")))
    assert "model.layers.0.attention.dense.weight" in names
    assert ("model.layers.0.attention.dense.weight_scale_inv" in names) == quant
    a, b = load_model(ref_dir), load_model(d)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa.view(torch.uint8) if pa.dtype == torch.float8_e4m3fn else pa,
                                        pb.view(torch.uint8) if pb.dtype == torch.float8_e4m3fn else pb), na


def test_kda_output_projection_under_both_names_or_none(tmp_path, own_model):
    from bytebound.checkpoint.loader import load_model
    d = _write(own_model, tmp_path / "both")
    a = "model.layers.0.attention"
    _rewrite(d, lambda sd: {**sd, f"{a}.dense.weight": sd[f"{a}.o_proj.weight"].clone()})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.attention\.o_proj\.weight is present under two "
                                              r"names .*attention\.dense\.weight"):
        load_model(d)
    d = _write(own_model, tmp_path / "none")
    _rewrite(d, lambda sd: {k: v for k, v in sd.items() if k != "model.layers.2.attention.o_proj.weight"})
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.attention\.o_proj\.weight or "
                                              r"model\.layers\.2\.attention\.dense\.weight"):
        load_model(d)


def test_nextn_layer_absent_loads_without_draft(tmp_path, own_model):
    """All NEXTN tensors gone: the target model loads unchanged and MTP is refused by name; one NEXTN tensor
    gone: still a strict-loading error naming it (never a random draft)."""
    from bytebound.checkpoint.loader import load_model
    from bytebound.engine.engine import Engine
    L = own_model.cfg.num_hidden_layers
    full = load_model(_write(own_model, tmp_path / "full"))
    d = _write(own_model, tmp_path / "no_nextn")
    _rewrite(d, lambda sd: {k: v for k, v in sd.items() if not k.startswith(f"model.layers.{L}.")})
    m = load_model(d)
    assert m.nextn is None and m.nextn_absent and len(m.model.layers) == L
    assert LingConfig.from_file(d).num_nextn_predict_layers == 1      # the file's config is left as it is
    ids = torch.randint(0, m.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(m.logits(m(ids)), full.logits(full(ids)))
    with pytest.raises(ConfigError, match=f"no model.layers.{L}"):
        Engine(model=str(d), speculative_steps=2)
    assert not full.nextn_absent and full.nextn is not None
    d = _write(own_model, tmp_path / "part")
    _rewrite(d, lambda sd: {k: v for k, v in sd.items() if k != f"model.layers.{L}.eh_proj.weight"})
    with pytest.raises(CheckpointError, match=f"missing tensor model.layers.{L}.eh_proj.weight"):
        load_model(d)


def test_mtp_on_a_config_without_nextn_is_a_named_error(tmp_path):
    from bytebound.engine.engine import Engine
    d = _write(make_model(tiny_config(num_nextn_predict_layers=0), seed=1), tmp_path / "zero")
    with pytest.raises(ConfigError, match="num_nextn_predict_layers = 0"):
        Engine(model=str(d), speculative_steps=1)


def test_no_tokenizer_json_means_token_ids_only(tmp_path, own_model):
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    d = _write(own_model, tmp_path / "tok")
    with_tok = Engine(model=str(d)).generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / f).unlink(missing_ok=True)
    eng = Engine(model=str(d))
    assert eng.tokenizer is None
    assert eng.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids == with_tok.token_ids
    with pytest.raises(RequestError, match="no tokenizer.json"):
        eng.generate("hello")
    # without a tokenizer the stop ids of generation_config.json still count (transformers' generate uses them)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 9]}))
    eng = Engine(model=str(d))
    assert eng.stop_ids(SamplingParams()) == {1, 9} and eng.stop_ids(SamplingParams(ignore_eos=True)) == set()
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "9"}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id"):
        Engine(model=str(d))
    (d / "generation_config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="generation_config.json: unreadable"):
        Engine(model=str(d))
    (d / "generation_config.json").unlink()
    # tokenizer.json present but its config missing: an incomplete tokenizer, still a named error
    shutil.copy(NANO_TOKENIZER / "tokenizer.json", d)
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Engine(model=str(d))
