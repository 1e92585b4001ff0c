"""Strict loading of Ling checkpoints (HF-style directory: config.json + safetensors shards/index).

Every expected tensor (``layout.expected_tensors``) must be present exactly once with the right shape and
dtype, finite, with scales of the right layout; nothing unexpected may be left over. All problems found
are gathered and raised as one :class:`~bytebound.errors.CheckpointError` naming the tensors and files.

Checkpoints written by transformers' ``BailingHybridForCausalLM.save_pretrained`` load too: their config
spellings are resolved by :func:`bytebound.config.resolve_spellings`, their tensor names by the layout's
``aliases``, and their missing NEXTN layer (the config says ``num_nextn_predict_layers: 1``, the files hold no
``model.layers.{L}.*``; transformers ignores that layer) gives a model without a draft layer
(``model.nextn_absent``), for which the engine refuses MTP by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from bytebound.checkpoint.layout import TensorSpec, expected_tensors
from bytebound.checkpoint.memory import ensure_fits
from bytebound.config import LingConfig
from bytebound.errors import CheckpointError
from bytebound.models import model_class
from bytebound.models.bailing_moe_v3 import BailingMoeV3ForCausalLM

MAX_LISTED = 12


def _index(path: Path) -> dict[str, str]:
    """``{tensor name: shard file name}`` from the index, or from the single ``model.safetensors``."""
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        try:
            wmap = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{idx}: unreadable index ({e})") from e
        return dict(wmap)
    single = path / "model.safetensors"
    if path.is_file():       # e.g. --model DIR/config.json: the config loads, the tensors are in the folder
        raise CheckpointError(f"{path} is a file, not a checkpoint folder: give the folder ({path.parent}); a config "
                              "file alone serves only random weights (--load-format dummy)")
    if not single.exists():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return {k: single.name for k in _open(single).keys()}


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except FileNotFoundError as e:
        raise CheckpointError(f"shard {file} is missing (named in the index)") from e
    except Exception as e:  # safetensors raises SafetensorError / OSError for truncated headers
        raise CheckpointError(f"shard {file} is unreadable or truncated: {e}") from e


def _check(spec: TensorSpec, t: torch.Tensor, scale_pow2: bool) -> str | None:
    """Problem with tensor ``t`` against ``spec`` (None when fine)."""
    if tuple(t.shape) != spec.shape:
        what = "scale layout" if spec.kind.endswith("scale") else "shape"
        return f"{spec.name}: {what} {tuple(t.shape)}, expected {spec.shape}"
    if t.dtype not in spec.dtypes:
        return f"{spec.name}: dtype {t.dtype}, expected one of {[str(d) for d in spec.dtypes]}"
    if spec.kind in ("float", "fp8", "fp8_scale") and not torch.isfinite(t.float()).all():
        return f"{spec.name}: non-finite values"
    if spec.kind == "fp8_scale":
        if (t <= 0).any():
            return f"{spec.name}: non-positive scale"
        if scale_pow2 and not torch.equal(torch.exp2(torch.log2(t).round()), t):
            return f"{spec.name}: scale_fmt ue8m0 needs power-of-two scales"
    if spec.kind == "mxfp4_scale" and (t == 255).any():
        return f"{spec.name}: E8M0 scale byte 255 (NaN)"
    return None


def _resolve(specs: list[TensorSpec], wmap: dict[str, str], source: str
             ) -> tuple[list[TensorSpec], set[str], list[str]]:
    """Match each spec to the one name (its own or an alias) the checkpoint uses.

    Returns ``(specs found, renamed to the name in the files; every name accounted for; problems)``: a spec
    with no name in ``wmap`` is missing, one with two of its names present is ambiguous."""
    found, names, problems = [], set(), []
    for s in specs:
        present = [n for n in (s.name, *s.aliases) if n in wmap]
        names.update(present)
        if len(present) == 1:
            found.append(s if present[0] == s.name else dataclasses.replace(s, name=present[0]))
        elif present:
            problems.append(f"tensor {s.name} is present under two names ({' and '.join(present)} in {source}): "
                            "one of them must go")
        else:
            alt = f" or {' / '.join(s.aliases)}" if s.aliases else ""
            problems.append(f"missing tensor {s.name}{alt} (not in {source})")
    return found, names, problems


def load_model(path, device="cpu", dtype: torch.dtype | None = None) -> BailingMoeV3ForCausalLM:
    """Build the model of ``path/config.json`` and fill it from the checkpoint, strictly.

    A config with one NEXTN layer whose checkpoint holds none of that layer's tensors (``model.layers.{L}.*``,
    as transformers' ``save_pretrained`` writes it) loads without the layer: the model's config then says
    ``num_nextn_predict_layers = 0`` and ``model.nextn_absent`` is True. A NEXTN layer present in part is
    still an error (its missing tensors are listed).

    Args:
        path: checkpoint directory. device: where the weights end up. dtype: compute dtype of plain tensors
            (default float32 on CPU, bfloat16 on CUDA).
    Raises:
        ResourceError: the weights exceed ``device``'s free memory (``checkpoint.memory.ensure_fits``).
        ConfigError: bad config. CheckpointError: missing / unexpected / mis-shaped / wrong-dtype / non-finite
            tensors, a tensor under two of its names, bad scale layout, unreadable or truncated shards (one
            error, all names and files listed); transformers' in-memory tensor names
            (``save_original_format=False``).
    """
    path = Path(path)
    cfg = LingConfig.from_file(path)
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    wmap = _index(path)
    if "model.embed_tokens.weight" in wmap or any(".self_attn." in n for n in wmap):
        # transformers' in-memory names (fused conv1d and experts): what save_pretrained writes only when told
        # not to convert back to the checkpoint's own layout
        raise CheckpointError(f"checkpoint {path} uses transformers' in-memory tensor names (model.embed_tokens, "
                              "self_attn.*, fused experts.gate_up_proj), as save_pretrained(..., "
                              "save_original_format=False) writes them; save it again with the default "
                              "save_original_format=True (the Ling checkpoint layout)")
    nextn_prefix = f"model.layers.{cfg.num_hidden_layers}."
    nextn_absent = bool(cfg.num_nextn_predict_layers) and not any(n.startswith(nextn_prefix) for n in wmap)
    if nextn_absent:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, dtype)
    ensure_fits(model, device, f"checkpoint {path}")
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    by_file: dict[str, list[TensorSpec]] = defaultdict(list)
    source = ("model.safetensors.index.json" if (path / "model.safetensors.index.json").exists()
              else "model.safetensors")
    specs, expected, problems = _resolve(expected_tensors(cfg), wmap, source)
    for s in specs:
        by_file[wmap[s.name]].append(s)
    unexpected = sorted(set(wmap) - expected)
    problems += [f"unexpected tensor {n} (in {wmap[n]})" for n in unexpected]
    filled: set[str] = set()
    pow2 = cfg.quant.scale_fmt == "ue8m0"
    with torch.no_grad():
        for fname, group in by_file.items():
            try:
                f = _open(path / fname)
            except CheckpointError as e:     # name the tensors the shard should have held, not just the file
                names = [s.name for s in group]
                listed = ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
                problems.append(f"{e}; its tensors cannot be loaded: {listed}")
                continue
            keys = set(f.keys())
            for s in group:
                if s.name not in keys:
                    problems.append(f"{s.name}: listed in the index for {fname} but not in that file")
                    continue
                try:
                    t = f.get_tensor(s.name)
                except Exception as e:
                    problems.append(f"{s.name}: unreadable in {fname} (truncated shard?): {e}")
                    continue
                why = _check(s, t, pow2)
                if why:
                    problems.append(f"{why} (in {fname})")
                    continue
                p = params[s.target]
                if s.expert is None:
                    p.copy_(t.to(p.dtype) if p.dtype != torch.float8_e4m3fn else t)
                else:
                    src = t.view(torch.uint8) if p.dtype == torch.uint8 else t.to(p.dtype)
                    p[s.expert, s.rows[0]:s.rows[1]].copy_(src)
                filled.add(s.name)
    if problems:
        shown = problems[:MAX_LISTED]
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise CheckpointError(f"checkpoint {path} failed strict loading ({len(problems)} problem(s)):\n  "
                              + "\n  ".join(shown) + more)
    model.finish_load()
    model.loaded_tensors = len(filled)
    model.loaded_names = filled
    model.nextn_absent = nextn_absent
    return model
