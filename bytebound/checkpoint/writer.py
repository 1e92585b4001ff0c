"""Write a model in the Ling checkpoint format (config.json, safetensors shards + index, tokenizer files).

Any config, tiny or full: plain weights are quantised on the way out according to ``quant`` (FP8 128x128
blocks for dense linears not in ``modules_to_not_convert``, MXFP4 for routed experts, BF16 LM head);
already-quantised modules are written as they are.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from bytebound.checkpoint.layout import expected_tensors
from bytebound.config import QuantConfig
from bytebound.quant import quantize_fp8_block, quantize_mxfp4

FP32_NAMES = ("A_log", "dt_bias", "conv1d.weight", "expert_bias", "mlp.gate.weight")   # router_dtype fp32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "added_tokens.json", "generation_config.json")


def checkpoint_tensors(model, quant: QuantConfig | None = None, float_dtype=torch.bfloat16,
                       mxfp4_scale: str = "ocp") -> tuple[dict, object]:
    """Map ``model``'s weights to ``{checkpoint name: tensor}`` under ``quant`` (default: the model's own).

    Returns ``(tensors, cfg_out)``. Plain float tensors are stored as ``float_dtype`` except the small fp32
    parameters (A_log, dt_bias, conv weights, expert_bias), which stay float32.
    """
    cfg = model.cfg if quant is None else model.cfg.replace(quant=quant)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for spec in expected_tensors(cfg):
        if spec.kind in ("fp8_scale", "mxfp4_scale"):
            continue                                   # written together with their weight
        if spec.expert is None:
            src = sd[spec.target]
            if spec.kind == "fp8":
                base = spec.name[: -len(".weight")]
                if src.dtype == torch.float8_e4m3fn:
                    out[spec.name], out[f"{base}.weight_scale_inv"] = src, sd[f"{base}.weight_scale_inv"]
                else:
                    w, s = quantize_fp8_block(src, cfg.quant.weight_block_size,
                                              pow2=cfg.quant.scale_fmt == "ue8m0")
                    out[spec.name], out[f"{base}.weight_scale_inv"] = w, s
            else:
                keep32 = any(spec.name.endswith(n) for n in FP32_NAMES)
                out[spec.name] = src.to(torch.float32 if keep32 else float_dtype)
            continue
        # routed expert slice of a stacked tensor
        e, (r0, r1) = spec.expert, spec.rows
        stacked = sd[spec.target]
        base = spec.name[: -len(".weight")]
        if spec.kind == "mxfp4":
            if stacked.dtype == torch.uint8:          # already MXFP4
                out[spec.name] = stacked[e, r0:r1].view(torch.int8).clone()
                out[f"{base}.weight_scale_inv"] = sd[spec.target + "_scale"][e, r0:r1].clone()
            else:
                w, s = quantize_mxfp4(stacked[e, r0:r1], mxfp4_scale)
                out[spec.name], out[f"{base}.weight_scale_inv"] = w.view(torch.int8), s
        else:
            out[spec.name] = stacked[e, r0:r1].to(float_dtype).clone()
    return {k: v.contiguous() for k, v in out.items()}, cfg


def save_pretrained(model, out_dir, quant: QuantConfig | None = None, tokenizer_dir=None,
                    generation_config: dict | None = None, float_dtype=torch.bfloat16,
                    max_shard_bytes: int | None = None, mxfp4_scale: str = "ocp") -> Path:
    """Write ``model`` to ``out_dir`` in the Ling checkpoint format.

    Args:
        quant: target quantisation (None keeps the model's). tokenizer_dir: copy tokenizer files from here.
        max_shard_bytes: split into ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``;
            None writes one ``model.safetensors``.
        mxfp4_scale: shared-exponent rule for routed experts quantised here (``quant.quantize_mxfp4``).
    Returns the output directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, cfg = checkpoint_tensors(model, quant, float_dtype, mxfp4_scale)
    d = cfg.to_dict()
    d["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[float_dtype]
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    if max_shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        shards, cur, size = [], {}, 0
        for k, v in tensors.items():
            nb = v.numel() * v.element_size()
            if cur and size + nb > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[k], size = v, size + nb
        shards.append(cur)
        wmap = {}
        for i, sh in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(sh, str(out / fname), metadata={"format": "pt"})
            wmap.update({k: fname for k in sh})
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=2) + "\n")
    if tokenizer_dir is not None:
        for f in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / f
            if src.exists() and src.resolve() != (out / f).resolve():
                shutil.copy(src, out / f)
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return out
