"""Random weights at a config's real shapes: for tests (``random_model``) and full-scale speed runs without
files (``dummy_model``, the ``dummy`` load format: created directly in device memory, quantised formats
generated as bytes so no float copy of the 124B parameters ever exists)."""

from __future__ import annotations

import math

import torch

from bytebound.checkpoint.memory import ensure_fits
from bytebound.config import LingConfig
from bytebound.models import model_class
from bytebound.models.bailing_moe_v3 import BailingMoeV3ForCausalLM


def init_plain_(model: BailingMoeV3ForCausalLM, seed: int = 0, std: float = 0.02) -> BailingMoeV3ForCausalLM:
    """Initialise a plain-weight model in place: linears N(0, std), norms 1, KDA A_log/dt_bias as
    transformers' BailingHybrid ``_init_weights`` (A_log = log U(1, 16); dt_bias = softplus^-1(dt),
    dt log-uniform in [1e-3, 1e-1]), conv weights N(0, 0.2), expert bias 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype in (torch.uint8, torch.float8_e4m3fn):
                continue
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=g).log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif "norm" in name.split(".")[-2] or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("expert_bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def random_model(cfg: LingConfig, seed: int = 0, dtype=torch.float32, std: float = 0.02) -> BailingMoeV3ForCausalLM:
    """A plain-weight model of ``cfg`` (quantisation ignored) with seeded random weights, on CPU."""
    from bytebound.config import QuantConfig
    cfg = cfg.replace(quant=QuantConfig())
    model = model_class(cfg)(cfg, dtype)
    return init_plain_(model, seed, std)


def dummy_model(cfg: LingConfig, device="cuda", dtype=torch.bfloat16, seed: int = 0) -> BailingMoeV3ForCausalLM:
    """The ``dummy`` load format: random weights at the real shapes and storage formats, made on ``device``.

    FP8 weights are random E4M3 of roughly unit scale with power-of-two ``weight_scale_inv`` 2^-9; MXFP4
    experts are random nibbles with E8M0 scale 2^-6 (values ~0.02); plain tensors N(0, 0.02).

    Raises:
        ResourceError: the weights exceed ``device``'s free memory (``checkpoint.memory.ensure_fits``).
    """
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, dtype)
    ensure_fits(model, device, f"--load-format dummy ({cfg.num_hidden_layers} layers, {cfg.num_experts} experts, "
                               f"hidden {cfg.hidden_size})")
    model = model.to_empty(device=device)
    dummy_fill_(model, device)
    model.finish_load()
    return model


def dummy_fill_(module: torch.nn.Module, device) -> torch.nn.Module:
    """Fill every parameter of ``module`` (materialised on ``device``) with the ``dummy`` load format's random
    values (see :func:`dummy_model`); in place, returns ``module``. Also used for single-layer benchmarks."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dtype == torch.float8_e4m3fn:
                p.copy_((torch.randn(p.shape, device=device, dtype=torch.bfloat16) * 8).to(torch.float8_e4m3fn))
            elif name.endswith("weight_scale_inv"):
                p.fill_(2.0 ** -9)
            elif p.dtype == torch.uint8 and name.endswith("_scale"):
                p.fill_(127 - 6)
            elif p.dtype == torch.uint8:
                p.copy_(torch.randint(0, 256, p.shape, device=device, dtype=torch.uint8))
            elif name.endswith("A_log"):
                p.uniform_(0, 2.7)
            elif name.endswith("dt_bias"):
                p.uniform_(-5, -2)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("expert_bias"):
                p.zero_()
            else:
                p.normal_(0, 0.02)
    return module
