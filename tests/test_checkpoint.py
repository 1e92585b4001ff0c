"""Checkpoint writer -> strict loader: identical logits (fp32 plain, BF16, quantised; single file and sharded),
and every bad-checkpoint case raises one CheckpointError whose message names the tensor and the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bytebound.checkpoint.layout import expected_tensors
from bytebound.checkpoint.loader import load_model
from bytebound.checkpoint.writer import FP32_NAMES, save_pretrained
from bytebound.errors import CheckpointError, ConfigError
from bytebound.quant import dequantize_fp8_block, dequantize_mxfp4, quantize_fp8_block, quantize_mxfp4
from conftest import QUANT_TINY, quant_tiny

INDEX = "model.safetensors.index.json"
IDS = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(3))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model.logits(model(ids))


# ---- helpers to corrupt a copy of a checkpoint ---------------------------------------------------------------
def copy_ckpt(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def weight_map(d: Path) -> dict[str, str]:
    if (d / INDEX).exists():
        return json.loads((d / INDEX).read_text())["weight_map"]
    return {k: "model.safetensors" for k in load_file(str(d / "model.safetensors"))}


def file_of(d: Path, name: str) -> str:
    return weight_map(d)[name]


def edit(d: Path, name: str, fn, in_index: bool = True) -> str:
    """Replace tensor ``name`` in its file by ``fn(tensor)`` (None deletes it; with ``in_index=False`` the index
    entry goes too). Returns the file name."""
    fname = file_of(d, name)
    tensors = load_file(str(d / fname))
    new = fn(tensors[name])
    if new is None:
        del tensors[name]
    else:
        tensors[name] = new.contiguous()
    save_file(tensors, str(d / fname), metadata={"format": "pt"})
    if new is None and not in_index and (d / INDEX).exists():
        idx = json.loads((d / INDEX).read_text())
        del idx["weight_map"][name]
        (d / INDEX).write_text(json.dumps(idx))
    return fname


def add(d: Path, name: str, t: torch.Tensor, fname: str | None = None) -> str:
    fname = fname or sorted(set(weight_map(d).values()))[-1]
    tensors = load_file(str(d / fname))
    tensors[name] = t
    save_file(tensors, str(d / fname), metadata={"format": "pt"})
    if (d / INDEX).exists():
        idx = json.loads((d / INDEX).read_text())
        idx["weight_map"][name] = fname
        (d / INDEX).write_text(json.dumps(idx))
    return fname


def load_error(d: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_model(d)
    msg = str(ei.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in error message:\n{msg}"
    return msg


# ---- round trips -------------------------------------------------------------------------------------------
def test_plain_fp32_single_file_identical(tiny_model, plain_ckpt):
    assert (plain_ckpt / "model.safetensors").exists() and not (plain_ckpt / INDEX).exists()
    m = load_model(plain_ckpt)
    assert m.loaded_tensors == len(expected_tensors(m.cfg))
    sd0, sd1 = tiny_model.state_dict(), m.state_dict()
    assert sd0.keys() == sd1.keys()
    assert all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    assert torch.equal(logits(m), logits(tiny_model))


def test_plain_sharded_identical(tiny_model, tmp_path):
    d = save_pretrained(tiny_model, tmp_path / "sh", float_dtype=torch.float32, max_shard_bytes=40_000)
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert len(shards) > 3 and set(weight_map(d).values()) == set(shards)
    assert torch.equal(logits(load_model(d)), logits(tiny_model))


def test_bf16_checkpoint_round_trip_is_stable(tiny_model, tmp_path):
    """Default BF16 storage: loading gives the BF16-rounded weights exactly, and write -> load is idempotent."""
    d1 = save_pretrained(tiny_model, tmp_path / "a")
    m1 = load_model(d1)
    for k, v in tiny_model.state_dict().items():
        keep32 = any(k.endswith(s) for s in FP32_NAMES)         # incl. the fp32 router (router_dtype)
        want = v if keep32 else v.to(torch.bfloat16).float()
        assert torch.equal(m1.state_dict()[k], want), k
    m2 = load_model(save_pretrained(m1, tmp_path / "b"))
    assert torch.equal(logits(m1), logits(m2))


def fake_quant_reference(model, block=QUANT_TINY["weight_block_size"]):
    """The plain model with each FP8 linear replaced by dequant(quant(W)) and each expert by its MXFP4 round trip."""
    from conftest import make_model
    cfg = model.cfg.replace(quant=quant_tiny())
    ref = make_model(model.cfg)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for spec in expected_tensors(cfg):
        if spec.kind == "fp8":
            w = sd[spec.target]
            sd[spec.target] = dequantize_fp8_block(*quantize_fp8_block(w, block), block)
        elif spec.kind == "mxfp4":
            e, (r0, r1) = spec.expert, spec.rows
            w = sd[spec.target][e, r0:r1]
            sd[spec.target][e, r0:r1] = dequantize_mxfp4(*quantize_mxfp4(w))
    ref.load_state_dict(sd)
    ref.finish_load()
    return ref


def test_quantised_sharded_matches_fake_quant_reference(tiny_model, quant_ckpt):
    assert (quant_ckpt / INDEX).exists() and len(list(quant_ckpt.glob("model-*.safetensors"))) > 3
    m = load_model(quant_ckpt)
    fmt = {n: mod.fmt for n, mod in m.named_modules() if hasattr(mod, "fmt")}
    assert fmt["model.layers.0.attention.q_proj"] == "fp8" and fmt["model.layers.1.attention.kv_b_proj"] == "fp8"
    assert fmt["model.layers.0.attention.b_proj"] == "plain" and fmt["model.layers.1.mlp.experts"] == "mxfp4"
    assert m.model.layers[1].attention.kv_b_proj.weight_scale_inv.shape == (4, 1)      # 128 x 32 in 32-blocks
    ref = fake_quant_reference(tiny_model)
    got, want = logits(m), logits(ref)
    assert torch.equal(got, want)          # same dequantised values, same ops: bit for bit
    # quantisation really happened (the comparison above is not plain vs plain)
    assert ((logits(tiny_model) - want).abs().max() / want.abs().max()) > 1e-3


def test_quantised_single_file_equals_sharded(tiny_model, quant_ckpt, tmp_path):
    d = save_pretrained(tiny_model, tmp_path / "single", quant=quant_tiny(), float_dtype=torch.float32)
    assert not (d / INDEX).exists()
    assert torch.equal(logits(load_model(d)), logits(load_model(quant_ckpt)))


def test_quantised_rewrite_is_byte_identical(quant_ckpt, tmp_path):
    """Loading a quantised checkpoint and writing it again keeps the stored bytes (no re-quantisation)."""
    m = load_model(quant_ckpt)
    d = save_pretrained(m, tmp_path / "again", float_dtype=torch.float32)
    a = {}
    for f in sorted(set(weight_map(quant_ckpt).values())):
        a.update(load_file(str(quant_ckpt / f)))
    b = load_file(str(d / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert json.loads((d / "config.json").read_text())["quantization_config"] == \
        json.loads((quant_ckpt / "config.json").read_text())["quantization_config"]
    assert torch.equal(logits(load_model(d)), logits(m))


def test_checkpoint_dtypes_follow_the_format(quant_ckpt):
    t = {}
    for f in set(weight_map(quant_ckpt).values()):
        t.update(load_file(str(quant_ckpt / f)))
    assert t["model.layers.0.attention.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.layers.0.attention.q_proj.weight_scale_inv"].dtype == torch.float32
    assert t["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.int8
    assert t["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (32, 32)
    assert t["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"].dtype == torch.uint8
    assert t["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"].shape == (64, 1)
    assert "lm_head.weight_scale_inv" not in t and "model.layers.0.attention.b_proj.weight_scale_inv" not in t
    scales = [v for k, v in t.items() if k.endswith("weight_scale_inv") and v.dtype == torch.float32]
    assert all(torch.equal(torch.exp2(torch.log2(s).round()), s) for s in scales)     # ue8m0: powers of two


# ---- bad checkpoints: one CheckpointError naming tensor + file ----------------------------------------------
KVB_SCALE = "model.layers.1.attention.kv_b_proj.weight_scale_inv"
GATE_SCALE = "model.layers.0.mlp.gate_proj.weight_scale_inv"              # [96, 64] in 32-blocks: grid (3, 2)
EXPERT_SCALE = "model.layers.3.mlp.experts.5.gate_proj.weight_scale_inv"  # [32, 64/32] = (32, 2)


@pytest.fixture
def qc(quant_ckpt, tmp_path):
    return copy_ckpt(quant_ckpt, tmp_path)


@pytest.fixture
def pc(plain_ckpt, tmp_path):
    return copy_ckpt(plain_ckpt, tmp_path)


def test_missing_tensor_sharded(qc):
    f = edit(qc, KVB_SCALE, lambda t: None, in_index=False)
    load_error(qc, "missing tensor " + KVB_SCALE, INDEX)
    assert f.startswith("model-")


def test_missing_tensor_single_file(pc):
    edit(pc, "model.layers.2.attention.dt_bias", lambda t: None)
    load_error(pc, "missing tensor model.layers.2.attention.dt_bias", "model.safetensors")


def test_tensor_in_index_but_not_in_its_shard(qc):
    f = edit(qc, KVB_SCALE, lambda t: None, in_index=True)
    load_error(qc, KVB_SCALE, f, "not in that file")


def test_unexpected_tensor(qc, pc):
    f = add(qc, "model.layers.0.attention.extra_proj.weight", torch.zeros(4, 4))
    load_error(qc, "unexpected tensor model.layers.0.attention.extra_proj.weight", f)
    add(pc, "model.layers.9.mlp.gate.weight", torch.zeros(16, 64))       # a layer the config does not have
    load_error(pc, "unexpected tensor model.layers.9.mlp.gate.weight", "model.safetensors")


def test_mis_shaped_tensor(qc):
    name = "model.layers.0.attention.A_log"
    f = edit(qc, name, lambda t: torch.cat([t, t]))
    load_error(qc, name, "shape (8,), expected (4,)", f)


def test_mis_shaped_expert(qc):
    name = "model.layers.1.mlp.experts.7.down_proj.weight"
    f = edit(qc, name, lambda t: t[:, :8])
    load_error(qc, name, "shape (64, 8), expected (64, 16)", f)


@pytest.mark.parametrize("name, conv, what", [
    ("model.norm.weight", lambda t: t.to(torch.int32), "dtype torch.int32"),
    ("model.layers.0.attention.q_proj.weight", lambda t: t.to(torch.bfloat16), "dtype torch.bfloat16"),
    ("model.layers.0.attention.q_proj.weight_scale_inv", lambda t: t.to(torch.bfloat16), "dtype torch.bfloat16"),
    ("model.layers.1.mlp.experts.0.up_proj.weight", lambda t: t.to(torch.int16).view(32, 32), "dtype torch.int16"),
    (EXPERT_SCALE, lambda t: t.float(), "dtype torch.float32"),
])
def test_wrong_dtype(qc, name, conv, what):
    f = edit(qc, name, conv)
    load_error(qc, name, what, f)


@pytest.mark.parametrize("name, bad", [
    ("model.layers.0.attention.A_log", float("nan")),
    ("model.word_embeddings.weight", float("inf")),
    ("model.layers.3.mlp.gate.expert_bias", float("-inf")),
])
def test_non_finite_float(qc, name, bad):
    def poison(t):
        t = t.clone()
        t.view(-1)[1] = bad
        return t
    f = edit(qc, name, poison)
    load_error(qc, name, "non-finite", f)


def test_non_finite_fp8_weight(qc):
    name = "model.layers.2.attention.o_proj.weight"
    def poison(t):
        b = t.view(torch.uint8).clone()
        b[3, 5] = 0x7F                                    # E4M3FN NaN
        return b.view(torch.float8_e4m3fn)
    f = edit(qc, name, poison)
    load_error(qc, name, "non-finite", f)


def test_fp8_scale_transposed_grid(qc):
    f = edit(qc, GATE_SCALE, lambda t: t.t())
    load_error(qc, GATE_SCALE, "scale layout (2, 3), expected (3, 2)", f)


def test_fp8_scale_128_grid_in_32_block_checkpoint(qc):
    f = edit(qc, GATE_SCALE, lambda t: t[:1, :1])          # a 128x128-block grid where 32x32 is configured
    load_error(qc, GATE_SCALE, "scale layout (1, 1), expected (3, 2)", f)


def test_mxfp4_scale_wrong_layout(qc):
    f = edit(qc, EXPERT_SCALE, lambda t: t.t())
    load_error(qc, EXPERT_SCALE, "scale layout (2, 32), expected (32, 2)", f)
    name = "model.layers.3.mlp.experts.6.down_proj.weight_scale_inv"   # one per 16 inputs instead of 32
    f2 = edit(qc, name, lambda t: t.repeat(1, 2))
    msg = load_error(qc, name, "scale layout (64, 2), expected (64, 1)", f2)
    assert "2 problem(s)" in msg                           # all problems are gathered into one error


def test_fp8_scale_not_power_of_two(qc):
    f = edit(qc, KVB_SCALE, lambda t: t * 1.5)
    load_error(qc, KVB_SCALE, "power-of-two", f)


def test_fp8_scale_non_power_of_two_allowed_without_ue8m0(qc):
    edit(qc, KVB_SCALE, lambda t: t * 1.5)
    cfg = json.loads((qc / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = "float"
    (qc / "config.json").write_text(json.dumps(cfg))
    m = load_model(qc)
    assert torch.equal(m.model.layers[1].attention.kv_b_proj.weight_scale_inv,
                       load_file(str(qc / file_of(qc, KVB_SCALE)))[KVB_SCALE])


def test_fp8_scale_non_positive(qc):
    f = edit(qc, GATE_SCALE, lambda t: -t)
    load_error(qc, GATE_SCALE, "non-positive", f)


def test_e8m0_scale_byte_255(qc):
    def nan(t):
        t = t.clone()
        t[4, 1] = 255
        return t
    f = edit(qc, EXPERT_SCALE, nan)
    load_error(qc, EXPERT_SCALE, "255", f)


def _shard_with(d: Path, name: str) -> tuple[Path, list[str]]:
    wm = weight_map(d)
    f = wm[name]
    return d / f, [k for k, v in wm.items() if v == f]


def test_truncated_shard(qc):
    p, names = _shard_with(qc, KVB_SCALE)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 100])                 # header intact, data cut short
    msg = load_error(qc, p.name, "truncated")
    assert any(n in msg for n in names), msg
    p.write_bytes(data[:6])                                # cut inside the 8-byte header length
    load_error(qc, p.name, "truncated")


def test_garbage_shard(qc):
    p, names = _shard_with(qc, GATE_SCALE)
    p.write_bytes(b"this is not a safetensors file" * 50)
    msg = load_error(qc, p.name, "unreadable")
    assert any(n in msg for n in names), msg


def test_index_names_missing_shard(qc):
    p, names = _shard_with(qc, EXPERT_SCALE)
    p.unlink()
    msg = load_error(qc, p.name, "missing")
    assert any(n in msg for n in names), msg


def test_unreadable_index(qc):
    (qc / INDEX).write_text("{ nope")
    load_error(qc, INDEX, "unreadable index")


def test_single_file_garbage(pc):
    (pc / "model.safetensors").write_bytes(b"\x00" * 64)
    load_error(pc, "model.safetensors", "unreadable")


def test_no_weights_at_all(pc):
    (pc / "model.safetensors").unlink()
    load_error(pc, "no model.safetensors")


def test_config_errors_surface_as_config_error(pc):
    cfg = json.loads((pc / "config.json").read_text())
    cfg["model_type"] = "bailing_moe"
    (pc / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type"):
        load_model(pc)
    (pc / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(pc)


def test_config_shape_mismatch_is_a_checkpoint_error(pc):
    """A config that disagrees with the tensors (vocab 256 vs the stored 128) names the tensors."""
    cfg = json.loads((pc / "config.json").read_text())
    cfg["vocab_size"] = 256
    (pc / "config.json").write_text(json.dumps(cfg))
    load_error(pc, "model.word_embeddings.weight", "lm_head.weight", "expected (256, 64)", "model.safetensors")


def test_many_problems_listed_and_counted(qc):
    for i in range(15):
        add(qc, f"junk.{i}", torch.zeros(1))
    msg = load_error(qc, "15 problem(s)", "junk.0", "and 3 more")
    assert msg.count("unexpected tensor") == 12
