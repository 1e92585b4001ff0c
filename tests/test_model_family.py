"""The model-family seam: config.json's model_type / architectures pick the model class (bytebound.models)."""

import pytest

from bytebound.errors import ConfigError
from bytebound.models import FAMILIES, family, model_class
from bytebound.models.bailing_moe_v3 import BailingMoeV3ForCausalLM


def test_family_by_model_type_and_by_architecture():
    assert family("bailing_hybrid").model_class() is BailingMoeV3ForCausalLM
    # transformers' class name for the same family, without a model_type
    assert family(None, ["BailingHybridForCausalLM"]) is FAMILIES["bailing_hybrid"]


def test_unknown_family_is_a_named_error():
    with pytest.raises(ConfigError, match="no model family for model_type='llama'.*known: bailing_hybrid"):
        family("llama", ["LlamaForCausalLM"])


def test_loader_and_dummy_builder_use_the_registry(monkeypatch):
    """A second family registered here is what the synthetic builder instantiates (no hard-coded class)."""
    import dataclasses

    from bytebound.checkpoint.synthetic import random_model
    from bytebound.config import tiny_config
    made = []

    class Other(BailingMoeV3ForCausalLM):
        def __init__(self, cfg, dtype):
            made.append(cfg)
            super().__init__(cfg, dtype)
    monkeypatch.setitem(FAMILIES, "bailing_hybrid",
                        dataclasses.replace(FAMILIES["bailing_hybrid"], module=__name__, cls="_OTHER"))
    monkeypatch.setitem(globals(), "_OTHER", Other)
    m = random_model(tiny_config())
    assert isinstance(m, Other) and made and model_class(tiny_config()) is Other
