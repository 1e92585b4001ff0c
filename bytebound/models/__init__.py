"""Model families. One file per family; each only wires ``bytebound.layers`` together.

A family is found from a checkpoint's ``config.json`` by ``model_type`` (then by ``architectures``) through
:data:`FAMILIES`, so a second family is one model file plus an entry here (and its checkpoint layout in
``bytebound.checkpoint.layout``); the loader and the synthetic-weight builders ask :func:`model_class`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from bytebound.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """One model family: its ``model_type``, the ``architectures`` names checkpoints use for it, and where its
    ``nn.Module`` lives (imported on first use)."""
    model_type: str
    architectures: tuple[str, ...]
    module: str
    cls: str

    def model_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.cls)


FAMILIES: dict[str, Family] = {
    "bailing_hybrid": Family("bailing_hybrid", ("BailingMoeV3ForCausalLM", "BailingHybridForCausalLM"),
                             "bytebound.models.bailing_moe_v3", "BailingMoeV3ForCausalLM"),
}


def family(model_type: str | None = None, architectures=()) -> Family:
    """The family of ``model_type`` (else of the first known name in ``architectures``).

    Raises:
        ConfigError: neither names a registered family."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    for f in FAMILIES.values():
        if any(a in f.architectures for a in architectures or ()):
            return f
    raise ConfigError(f"no model family for model_type={model_type!r}, architectures={list(architectures or ())} "
                      f"(known: {', '.join(f'{k} {v.architectures}' for k, v in FAMILIES.items())})")


def model_class(cfg) -> type:
    """The ``nn.Module`` class for a parsed config (``cfg.model_type``/``cfg.architectures`` when it has them)."""
    return family(getattr(cfg, "model_type", "bailing_hybrid"), getattr(cfg, "architectures", ())).model_class()
