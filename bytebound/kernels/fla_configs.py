"""Shipped launch configs for fla-core's autotuned KDA kernels, so a fresh start compiles one config per kernel.

fla-core's kernels are autotuned: on a machine with an empty Triton cache the first prefill compiles and times
every candidate config of every kernel, which dominates a fresh start. fla-core can instead read the best config
of each kernel from JSON files (``fla.ops.utils.cache``: ``FLA_CONFIG_DIR/{kernel_name}.json``, looked up per
``FLA_CACHE_MODE``; mode ``full`` takes the exact tuning key, else one that differs only in its numbers, such as the
sequence length, else the file's default config, and autotunes only a kernel with no file).

This module keeps those files as one bundle per GPU architecture (``configs/fla_<arch>.json``: kernel name -> the
file's content), written on a GPU by :func:`dump` after the kernels have been tuned (``scripts/tune_fla.py``), and
:func:`apply` unpacks the bundle for this device into a cache folder and points fla-core at it. Both environment
variables are read when fla-core is first imported, so :func:`apply` must run before that; it changes nothing when
the user set either variable or fla-core is already imported, and says so in its return value.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def arch(device) -> str:
    """``"sm_90"`` for compute capability 9.0."""
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"sm_{major}{minor}"


def bundle_path(device) -> Path:
    return CONFIG_DIR / f"fla_{arch(device)}.json"


def apply(device, cache_root: Path | None = None) -> str:
    """Point fla-core at the shipped configs for ``device``'s architecture; returns what happened (for the
    manifest). Call before fla-core is imported."""
    if torch.device(device).type != "cuda":
        return "not applicable (not CUDA)"
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ:
        return (f"user settings (FLA_CONFIG_DIR={os.environ.get('FLA_CONFIG_DIR')}, "
                f"FLA_CACHE_MODE={os.environ.get('FLA_CACHE_MODE')})")
    src = bundle_path(device)
    if not src.is_file():
        return f"autotuned at first use (no shipped configs for {arch(device)})"
    if "fla" in sys.modules:
        return "autotuned at first use (fla-core was imported before the shipped configs could be applied)"
    raw = src.read_bytes()
    bundle = json.loads(raw)
    root = cache_root or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bytebound"
    out = root / f"fla-configs-{arch(device)}-{hashlib.sha256(raw).hexdigest()[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    for name, content in bundle["kernels"].items():
        f = out / f"{name}.json"
        if not f.is_file():
            f.write_text(json.dumps(content))
    os.environ["FLA_CONFIG_DIR"] = str(out)
    os.environ["FLA_CACHE_MODE"] = "full"
    return f"shipped {arch(device)} configs for {len(bundle['kernels'])} kernels ({src.name}, tuned on {bundle['tuned_on']})"


def _autotuners():
    """Every Triton autotuner in fla-core's imported modules, by kernel name (unwrapping ``triton.heuristics``
    and other wrappers, whose ``fn`` is the next object down)."""
    from triton.runtime.autotuner import Autotuner
    out = {}
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("fla.") and m is not None]:
        for obj in list(vars(mod).values()):
            for _ in range(4):
                if isinstance(obj, Autotuner):
                    base = obj.fn
                    while hasattr(base, "fn"):
                        base = base.fn
                    out[getattr(base, "__name__", str(base))] = obj
                    break
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break
    return out


def restrict_plain_autotuners() -> int:
    """fla-core kernels decorated with Triton's own ``triton.autotune`` (not fla's cached autotuner) do not read
    ``FLA_CONFIG_DIR``: keep only the shipped default config of each (one config: Triton then neither benchmarks
    nor compiles the others). Call after fla-core is imported; returns how many kernels were restricted."""
    d = os.environ.get("FLA_CONFIG_DIR")
    if not d or "fla" not in sys.modules:
        return 0
    import triton

    from fla.ops.utils.cache import CachedAutotuner
    n = 0
    for name, obj in _autotuners().items():
        f = Path(d) / f"{name}.json"
        if not isinstance(obj, CachedAutotuner) and len(obj.configs) > 1 and f.is_file():
            c = json.loads(f.read_text())["default_config"]
            obj.configs = [triton.Config(c["kwargs"], num_warps=c["num_warps"], num_stages=c["num_stages"])]
            n += 1
    return n


def _config_dict(cfg) -> dict:
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "num_ctas": getattr(cfg, "num_ctas", 1), "maxnreg": getattr(cfg, "maxnreg", None)}


def dump(path: Path) -> dict:
    """Write the tuned configs of every fla-core autotuner that has run in this process to the bundle ``path``
    (``{"tuned_on", "triton", "fla", "kernels": {name: {"kernel_name", "triton_version", "autotune_entries",
    "default_config"}}}``); the default config is the one tuned for the largest tuning key seen (a long prefill
    chunk). Returns the bundle."""
    import triton

    from fla.ops.utils.cache import AutotuneKey
    seen = {name: t for name, t in _autotuners().items() if t.cache}
    kernels = {}
    for name, tuner in sorted(seen.items()):
        entries = {AutotuneKey.key_hash(list(k)): {"autotune_key": AutotuneKey.normalize_autotune_key(list(k)),
                                                   "config": _config_dict(c)} for k, c in tuner.cache.items()}

        def size(key):
            return sum(v for v in key if isinstance(v, int) and not isinstance(v, bool))
        top = max(tuner.cache, key=size)
        kernels[name] = {"kernel_name": name, "triton_version": triton.__version__, "autotune_entries": entries,
                         "default_config": _config_dict(tuner.cache[top])}
    from importlib.metadata import version
    bundle = {"tuned_on": torch.cuda.get_device_name(), "triton": triton.__version__, "fla": version("fla-core"),
              "kernels": kernels}
    Path(path).write_text(json.dumps(bundle, indent=1))
    return bundle
