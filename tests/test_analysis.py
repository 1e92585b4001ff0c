"""Issue 8: ``bytebound analyze`` reproduces the seed's numbers and gives the exact ledger beside them."""

from __future__ import annotations

import inspect
import json
import math
import struct
from pathlib import Path

import pytest
import torch

from bytebound.analysis import seed as sd
from bytebound.analysis.bandwidth import measure_read_bandwidth
from bytebound.analysis.cli import main, parse_context
from bytebound.analysis.ledger import (Recipe, build_ledger, expected_distinct_experts, ledger_from_specs,
                                       specs_from_safetensors, tensor_bytes)
from bytebound.config import LingConfig, QuantConfig, tiny_config
from bytebound.errors import BackendError

CONFIG = Path(__file__).resolve().parents[1] / "bytebound" / "assets" / "configs" / "ling-3.0-flash.json"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "configs" / "ling-3.0-flash.json"
# The fields of the Ling-3.0-flash config the ledger reads, written out as a second, independent copy.
LING3_FLASH = {
    "model_type": "bailing_hybrid", "vocab_size": 157184, "hidden_size": 2560, "num_hidden_layers": 42,
    "layer_group_size": 6, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
    "intermediate_size": 6144, "first_k_dense_replace": 2, "num_experts": 512, "num_experts_per_tok": 8,
    "num_shared_experts": 1, "moe_intermediate_size": 768, "moe_shared_expert_intermediate_size": 768,
    "n_group": 8, "topk_group": 4, "router_dtype": "fp32", "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "short_conv_kernel_size": 4, "num_nextn_predict_layers": 1,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                            "scale_fmt": "ue8m0", "modules_to_not_convert": ["lm_head", "b_proj"],
                            "routed_experts_quant_method": "mxfp4", "routed_experts_group_size": 32},
}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    if CONFIG.exists():
        return CONFIG
    p = tmp_path_factory.mktemp("cfg") / "config.json"
    p.write_text(json.dumps(LING3_FLASH))
    return p


@pytest.fixture(scope="module")
def cfg(config_path) -> LingConfig:
    return LingConfig.from_file(config_path)


def test_fallback_config_matches_shared_file():
    a, b = LingConfig.from_file(CONFIG), LingConfig.from_dict(LING3_FLASH)
    assert build_ledger(a).bytes == build_ledger(b).bytes and build_ledger(a).params == build_ledger(b).params
    if SHARED.exists():     # the bundled copy is the project's reconstructed config, unchanged
        assert json.loads(SHARED.read_text()) == json.loads(CONFIG.read_text())


# ---- seed mode: every number, to the digits the seed prints -------------------------------------------------
SEED_PRINTED = {
    # section 4 and derivation list
    "active_bytes_gb": "2.55", "lm_head_bf16_gb": "0.805", "lm_head_fp8_gb": "0.402",
    "step_bytes_bf16_gb": "3.355", "step_bytes_fp8_gb": "2.952",
    # section 5
    "b_eff_gbs": "121.1", "utilisation": "0.44", "ai_flop_per_byte": "3.04", "ridge_flop_per_byte": "3663",
    # section 6 / derivation list, section 7
    "b_eff_humming_gbs": "132.4", "b_eff_humming_s7_gbs": "132.3", "lm_head_params_m": "402.39",
    "lm_head_share_bf16_pct": "24.0", "lm_head_share_fp8_pct": "13.6", "fp8_head_cf_saving_ms": "3.32",
    "fp8_head_cf_tpot_ms": "24.38", "fp8_head_pred_tpot_ms": "22.31", "fp8_head_pred_err_pct": "-2.0",
    # section 8 and 14
    "distinct_experts": "31.3", "spec_speedup": "1.73", "spec_tpot_ms": "13.19", "byte_ratio_needed": "1.55",
    "spec_speedup_gsm8k": "1.19",
    # section 10
    "equiv_bytes_gb": "1.711", "equiv_bytes_factor": "1.96", "b_eff_mtp_gbs": "176.0", "b_eff_factor": "1.45",
    "decomposed_speedup": "2.85", "measured_speedup": "2.85", "gsm8k_equiv_bytes_gb": "2.489",
    "gsm8k_bytes_factor": "1.35", "gsm8k_b_eff_gbs": "126.8", "gsm8k_b_eff_all_gbs": "134.1",
    "gsm8k_b_eff_factor": "1.06", "gsm8k_measured_speedup": "1.43",
    # section 11
    "fallback_tpot_ms": "51", "fallback_tok_s": "20", "fallback_vs_base_pct": "55",
    # section 13
    "kv_per_token_kib": "7.88", "kv_2K": "16", "kv_32K": "258", "kv_256K": "2.06",
    "kv_2K_pct": "0.5", "kv_32K_pct": "7.7", "kv_256K_pct": "61.5",
}


@pytest.mark.parametrize("key,printed", sorted(SEED_PRINTED.items()))
def test_seed_number_reproduced(key, printed):
    assert sd.seed_report()[key].printed == printed


def test_seed_units_match_the_seed():
    rep = sd.seed_report()
    assert (rep["kv_2K"].unit, rep["kv_32K"].unit, rep["kv_256K"].unit) == ("MB", "MB", "GB")
    assert rep["kv_per_token_kib"].unit == "KiB" and rep["step_bytes_bf16_gb"].unit == "GB"
    assert sd.kv_bytes_per_token(7, 576, 2) == 8064


def test_seed_rounding_chains_are_flagged():
    """Where the seed carried a rounded intermediate, the unrounded formula gives other digits; say so."""
    rep = sd.seed_report()
    assert format(rep["b_eff_humming_gbs"].exact, ".1f") == "132.3"  # 3.355 GB / 25.35 ms
    assert format(rep["fallback_tok_s"].exact, ".1f") == "19.4"
    for key in ("b_eff_humming_gbs", "fallback_tok_s", "fallback_vs_base_pct", "fp8_head_cf_tpot_ms",
                "gsm8k_equiv_bytes_gb"):
        assert rep[key].note
    for key, v in rep.items():  # every other number is the unrounded formula at the printed digits
        if not v.note:
            assert format(v.exact, v.fmt) == v.printed, key


def test_seed_formulas_cite_their_section():
    for name in ("step_bytes", "lm_head_params", "effective_bandwidth", "utilisation", "arithmetic_intensity",
                 "ridge_point", "speculative_speedup", "speculative_tpot", "equivalent_bytes", "fallback_tpot",
                 "kv_bytes_per_token", "byte_ratio_needed"):
        assert "Section" in inspect.getdoc(getattr(sd, name)), name


# ---- formulas ------------------------------------------------------------------------------------------------
def test_expected_distinct_experts_formula():
    assert expected_distinct_experts(512, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(512, 8, 4) == pytest.approx(512 * (1 - (1 - 8 / 512) ** 4))
    assert expected_distinct_experts(512, 8, 4) < 32
    assert expected_distinct_experts(512, 8, 10_000) == pytest.approx(512)
    g = torch.Generator().manual_seed(0)  # Monte Carlo: 4 tokens, each top-8 of 512 uniformly
    hits = [len(set(torch.cat([torch.randperm(512, generator=g)[:8] for _ in range(4)]).tolist()))
            for _ in range(4000)]
    assert sum(hits) / len(hits) == pytest.approx(31.26, abs=0.05)


def test_tensor_bytes_formats():
    assert tensor_bytes((4096, 2560), "fp8_block") == (4096 * 2560, 4 * 32 * 20)
    assert tensor_bytes((576, 2560), "fp8_block") == (576 * 2560, 4 * 5 * 20)  # ceil(576/128) = 5
    assert tensor_bytes((768, 2560), "mxfp4") == (768 * 1280, 768 * 80)
    assert tensor_bytes((157184, 2560), "fp8_channel") == (157184 * 2560, 4 * 157184)
    assert tensor_bytes((512, 2560), "fp32") == (4 * 512 * 2560, 0)


# ---- exact ledger ------------------------------------------------------------------------------------------
def test_ling3_flash_active_params_and_bytes(cfg):
    bf16, fp8 = build_ledger(cfg), build_ledger(cfg, head="fp8")
    assert bf16.params == pytest.approx(5.1e9, rel=0.01)
    assert bf16.params == 5_103_304_672 == fp8.params
    assert bf16.bytes == 4_784_230_304          # 4.784 GB per token, BF16 head
    assert fp8.bytes == 4_382_468_000           # 4.382 GB per token, FP8 head
    assert bf16.head_bytes == 2 * 157184 * 2560
    assert fp8.head_bytes == 157184 * 2560 + 4 * 157184
    assert build_ledger(cfg).with_head("fp8").bytes == fp8.bytes
    g = bf16.group_bytes()
    assert max(g, key=g.get) == "KDA projections"  # the largest group is FP8 attention, not the experts
    assert g["routed experts x top-k"] == 40 * 8 * 3 * (768 * 1280 + 768 * 80)
    assert g["router"] == 40 * (512 * 2560 + 512) * 4


def test_ling3_flash_recipe_follows_quantization_config(cfg):
    r = Recipe.from_config(cfg)
    assert r.linear_fmt("kda.attention.b_proj") == "bf16"
    assert r.linear_fmt("mla.attention.kv_b_proj") == "fp8_block"  # suffix match on a dot boundary
    assert r.routed == "mxfp4" and r.router == "fp32" and r.head == "bf16"
    plain = cfg.replace(quant=QuantConfig())  # a BF16 checkpoint: everything 2 B/param, router fp32
    led = build_ledger(plain)
    assert {it.fmt for it in led.items} <= {"bf16", "fp32"}
    assert led.params == build_ledger(cfg).params


def test_ling3_flash_verify_draft_kv(cfg):
    led = build_ledger(cfg, head="fp8")
    assert led.verify_bytes(1) == pytest.approx(led.bytes)
    grow = expected_distinct_experts(512, 8, 4) / 8
    assert led.verify_bytes(4) == pytest.approx(led.bytes + led.routed_bytes * (grow - 1))
    assert "nextn.eh_proj" in {it.name for it in led.nextn}
    assert led.draft_step_bytes() > led.head_bytes
    assert led.round_bytes(4, 3) == pytest.approx(led.verify_bytes(4) + 3 * led.draft_step_bytes())
    assert led.kv_bytes_per_token() == 8064 and led.kv_bytes_per_token(with_nextn=True) == 8 * 1152
    assert led.state_bytes() == 35 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2)


def _checkpoint_specs(cfg: LingConfig) -> dict:
    """Tensor names/shapes/dtypes of a Ling fp4 checkpoint (spec section 4), for the loaded-model path."""
    d, H, D, V = cfg.hidden_size, cfg.num_attention_heads, cfg.kda_dim, cfg.vocab_size
    s: dict = {"model.word_embeddings.weight": ((V, d), "BF16"), "lm_head.weight": ((V, d), "BF16"),
               "model.norm.weight": ((d,), "BF16")}

    def fp8(name, n, k):
        s[name + ".weight"] = ((n, k), "F8_E4M3")
        s[name + ".weight_scale_inv"] = ((math.ceil(n / 128), math.ceil(k / 128)), "F32")

    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = ((d,), "BF16")
        a = p + "attention."
        if cfg.is_mla(i):
            fp8(a + "q_proj", H * cfg.qk_head_dim, d)
            fp8(a + "kv_a_proj_with_mqa", cfg.mla_cache_dim, d)
            s[a + "kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), "BF16")
            fp8(a + "kv_b_proj", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
            fp8(a + "g_proj", H, d)
            fp8(a + "dense", d, H * cfg.v_head_dim)
        else:
            for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):
                fp8(a + n, D, d)
            fp8(a + "o_proj", d, D)
            s[a + "b_proj.weight"] = ((H, d), "BF16")
            for n in ("q", "k", "v"):
                s[a + f"{n}_conv1d.weight"] = ((D, 1, 4), "BF16")
            s[a + "A_log"], s[a + "dt_bias"] = ((H,), "F32"), ((D,), "F32")
            s[a + "o_norm.weight"] = ((cfg.head_dim,), "BF16")
        if not cfg.is_moe(i):
            I = cfg.intermediate_size
            fp8(p + "mlp.gate_proj", I, d), fp8(p + "mlp.up_proj", I, d), fp8(p + "mlp.down_proj", d, I)
        else:
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            s[p + "mlp.gate.weight"], s[p + "mlp.gate.expert_bias"] = ((E, d), "F32"), ((E,), "F32")
            for e in range(E):
                for n, (o, k) in (("gate_proj", (I, d)), ("up_proj", (I, d)), ("down_proj", (d, I))):
                    s[p + f"mlp.experts.{e}.{n}.weight"] = ((o, k // 2), "I8")
                    s[p + f"mlp.experts.{e}.{n}.weight_scale_inv"] = ((o, k // 32), "U8")
            S = cfg.shared_intermediate
            fp8(p + "mlp.shared_experts.gate_proj", S, d), fp8(p + "mlp.shared_experts.up_proj", S, d)
            fp8(p + "mlp.shared_experts.down_proj", d, S)
        if i >= cfg.num_hidden_layers:
            fp8(p + "eh_proj", d, 2 * d)
            for n in ("enorm", "hnorm", "final_layernorm"):
                s[p + n + ".weight"] = ((d,), "BF16")
            s[p + "shared_head.head.weight"] = ((V, d), "BF16")
    return s


def test_loaded_model_ledger_matches_config_ledger(cfg):
    from_cfg, from_ckpt = build_ledger(cfg), ledger_from_specs(cfg, _checkpoint_specs(cfg))
    assert from_ckpt.bytes == pytest.approx(from_cfg.bytes, rel=1e-12)
    assert from_ckpt.params == pytest.approx(from_cfg.params, rel=1e-12)
    assert from_ckpt.group_bytes() == pytest.approx(from_cfg.group_bytes(), rel=1e-12)
    assert from_ckpt.draft_step_bytes() == pytest.approx(from_cfg.draft_step_bytes(), rel=1e-12)


def test_specs_from_safetensors_header(tmp_path):
    q = QuantConfig(method="fp8", routed_experts="mxfp4", modules_to_not_convert=("lm_head", "b_proj"))
    cfg = tiny_config(quant=q)
    specs = _checkpoint_specs(cfg)
    header, off = {}, 0
    for k, (shape, dt) in specs.items():
        n = math.prod(shape) * {"BF16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1, "U8": 1}[dt]
        header[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(off))
    read = specs_from_safetensors(tmp_path)
    assert read == {k: (tuple(s), d) for k, (s, d) in specs.items()}
    assert ledger_from_specs(cfg, read).bytes == pytest.approx(build_ledger(cfg).bytes, rel=1e-12)


# ---- CLI, bandwidth ----------------------------------------------------------------------------------------
def test_parse_context():
    assert parse_context("2K,32K,256K") == (2000, 32000, 256000)
    assert parse_context("32Ki, 131072") == (32768, 131072)


def test_cli_writes_json_and_pngs(tmp_path, capsys, config_path):
    rc = main(["--config", str(config_path), "--json", str(tmp_path / "a.json"), "--plots", str(tmp_path)])
    assert rc == 0
    rep = json.loads((tmp_path / "a.json").read_text())
    assert rep["seed"]["step_bytes_bf16_gb"]["printed"] == "3.355"
    assert rep["exact"]["active_params_b"] == pytest.approx(5.1, rel=0.01)
    assert rep["exact"]["step_bytes_fp8_gb"] == pytest.approx(4.382468)
    for name in ("ledger.png", "roofline.png", "kv_context.png", "speculative.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "3.355" in out and "4.784" in out and "121.1" in out


# exact values priced at the seed's measured operating points (TPOTs, accept length)
PRICED_AT_SEED_MEASUREMENTS = ("b_eff_gbs", "utilisation", "b_eff_humming_gbs", "fp8_head_pred_tpot_ms",
                               "spec_speedup", "spec_tpot_ms", "fallback_tpot_ms", "fallback_tok_s", "b_eff_mtp_gbs")


def test_seed_measurements_price_only_the_model_they_were_measured_on(tmp_path, capsys, config_path):
    """The seed's TPOTs and accept length were measured with Ling-3.0-flash on a DGX Spark: the exact column of
    another model (ling-nano) is not priced at them (the output says so), only at the user's own --tpot etc."""
    nano_dir = Path(__file__).resolve().parents[1] / "models" / "ling-nano"

    def report(*args):
        path = tmp_path / "r.json"
        assert main([*args, "--json", str(path)]) == 0
        return json.loads(path.read_text()), " ".join(capsys.readouterr().out.split())

    flash, out = report("--config", str(config_path))
    assert all(k in flash["exact"] for k in PRICED_AT_SEED_MEASUREMENTS)
    assert flash["reference_points"]["seed_model"] and "not on this model" not in out
    assert "172.7" in out                                    # B_eff of the exact flash ledger at 27.71 ms
    nano, out = report("--config", str(nano_dir))
    assert not any(k in nano["exact"] for k in PRICED_AT_SEED_MEASUREMENTS), nano["exact"].keys()
    assert not nano["reference_points"]["seed_model"]
    assert "not on this model" in out and "Ling-3.0-flash" in out and "--tpot" in out
    assert nano["seed"] == flash["seed"]                     # the seed column is the seed's model either way
    # the bytes, and the hardware's own numbers (floor at 273 GB/s, ridge), still apply
    assert 0 < nano["exact"]["step_bytes_bf16_gb"] < 0.01 and nano["exact"]["floor_bf16_ms"] > 0
    assert nano["exact"]["ridge_flop_per_byte"] == flash["exact"]["ridge_flop_per_byte"]
    # measurements of this model, given on the command line, price it; the two without a flag stay out
    mine, out = report("--config", str(nano_dir), "--tpot", "5", "--tpot-fp8-head", "4.5", "--accept-length", "2.5")
    e = mine["exact"]
    assert e["b_eff_gbs"] == pytest.approx(e["step_bytes_bf16_gb"] / 5e-3)
    assert e["spec_tpot_ms"] == pytest.approx(4.5 * e["byte_ratio"] / 2.5)
    assert e["fallback_tpot_ms"] == pytest.approx(4.5 * e["byte_ratio"])
    assert "b_eff_humming_gbs" not in e and "b_eff_mtp_gbs" not in e and "not on this model" in out
    for d in (tmp_path / "plots-nano", tmp_path / "plots-mine"):    # the plots leave the missing points out
        assert main(["--config", str(nano_dir), "--plots", str(d)] + (["--tpot", "5"] if "mine" in d.name else [])) == 0
        assert (d / "roofline.png").is_file() and (d / "speculative.png").is_file()


def test_add_parser_sets_dispatch():
    import argparse
    from bytebound.analysis.cli import add_parser, run
    sub = argparse.ArgumentParser().add_subparsers()
    args = add_parser(sub).parse_args([])
    assert args.func is run and args.fn is run


def test_cli_seed_only_and_errors(tmp_path, capsys):
    assert main(["--tpot", "27.71", "--bandwidth", "273"]) == 0
    assert "132.4" in capsys.readouterr().out
    assert main(["--config", str(tmp_path / "missing.json")]) == 2
    assert "ConfigError" in capsys.readouterr().err


def test_measure_read_bandwidth_cpu():
    assert measure_read_bandwidth("cpu", nbytes=1 << 22, iters=3, warmup=1) > 0.1
    assert measure_read_bandwidth("cpu", nbytes=1 << 22, iters=3, warmup=1, mode="copy") > 0.1
    with pytest.raises(BackendError):
        measure_read_bandwidth("cpu", mode="write")
    if not torch.cuda.is_available():
        with pytest.raises(BackendError):
            measure_read_bandwidth("cuda")


# ---- bad --checkpoint / --bandwidth / --device: named errors, no traceback -----------------------------------
def _bad_checkpoints(root: Path) -> dict[str, Path]:
    """One checkpoint folder per way a model.safetensors can be broken."""
    out = {}
    for kind in ("random", "empty", "directory", "header_not_json", "header_list", "entry_no_shape"):
        d = root / kind
        d.mkdir()
        f = d / "model.safetensors"
        if kind == "random":
            f.write_bytes(bytes(range(200, 256)) * 20)      # the first 8 bytes read as a length far past the end
        elif kind == "empty":
            f.write_bytes(b"")
        elif kind == "directory":
            f.mkdir()
        else:
            raw = {"header_not_json": b"{not json", "header_list": b"[1, 2]",
                   "entry_no_shape": json.dumps({"lm_head.weight": {"dtype": "BF16"}}).encode()}[kind]
            f.write_bytes(struct.pack("<Q", len(raw)) + raw)
        out[kind] = d
    return out


def test_specs_from_safetensors_bad_files_name_the_file(tmp_path):
    from bytebound.errors import CheckpointError
    with pytest.raises(CheckpointError, match="nonexistent"):
        specs_from_safetensors(tmp_path / "nonexistent")
    (tmp_path / "no-files").mkdir()
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        specs_from_safetensors(tmp_path / "no-files")
    for kind, d in _bad_checkpoints(tmp_path).items():
        with pytest.raises(CheckpointError, match="model.safetensors") as e:
            specs_from_safetensors(d)
        assert str(d) in str(e.value), kind


def test_cli_bad_checkpoint_is_a_named_error(tmp_path, capsys, config_path):
    for d in [tmp_path / "nonexistent", *_bad_checkpoints(tmp_path).values()]:
        assert main(["--config", str(config_path), "--checkpoint", str(d)]) == 2, d
        err = capsys.readouterr().err
        assert "CheckpointError" in err and str(d) in err and "Traceback" not in err


@pytest.mark.parametrize("args, flag", [
    (["--bandwidth", "measure", "--device", "bogus"], "--device"),
    (["--bandwidth", "measure", "--device", "meta"], "--device"),
    (["--bandwidth", "abc"], "--bandwidth"),
    (["--bandwidth", "-1"], "--bandwidth"),
    (["--bandwidth", "inf"], "--bandwidth"),
    (["--bandwidth", "nan"], "--bandwidth"),
    (["--context", "inf"], "--context"),
])
def test_cli_bad_bandwidth_device_context(args, flag, capsys):
    assert main(["--config", "none", *args]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and flag in err


def test_kernel_table_counts_ops_per_call():
    """analysis.kernels.kernel_table (the kernels-per-step counter of the decode benchmarks): per call of fn, on
    CPU the ops it ran, with the untimed first call left out."""
    import torch
    from bytebound.analysis.kernels import kernel_table
    a, b = torch.ones(64), torch.ones(64)
    calls = []

    def fn():
        calls.append(1)
        torch.mul(torch.add(a, b), torch.add(a, b))
    rows, totals = kernel_table(fn, 3, cuda=False)
    by = {r["name"]: r for r in rows}
    assert len(calls) == 4                                   # one untimed call, then the three profiled
    assert by["aten::add"]["calls"] == 2 and by["aten::mul"]["calls"] == 1
    assert totals["kernels"] == sum(r["calls"] for r in rows) >= 3
    assert [r["us"] for r in rows] == sorted((r["us"] for r in rows), reverse=True)
