"""Our BailingMoeV3 vs transformers' BailingHybridForCausalLM (the independent oracle): same weights, fp32, CPU,
logits to 1e-4 relative (max |diff| / max |logit|) for prefill, step-by-step decode and prefill-then-decode,
on several random configs (YaRN, non-trivial expert bias, layer_group_size 3 with 2 dense layers, per-layer
list of layer kinds)."""

from __future__ import annotations

import pytest
import torch

from bytebound.config import tiny_config
from conftest import make_model

transformers = pytest.importorskip("transformers", reason="transformers >= 5.20 is the oracle (pip install -e '.[test]')")


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:2] if x.isdigit())


pytestmark = pytest.mark.skipif(_version(transformers.__version__) < (5, 20),
                                reason=f"needs transformers >= 5.20 for bailing_hybrid, have {transformers.__version__}")

from hf_ref import build_hf  # noqa: E402  (after the version gate)

TOL = 1e-4
T = 70                     # crosses the KDA chunk boundary (64) in both implementations

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
CONFIGS = {
    "tiny": (dict(), dict()),
    "yarn": (dict(rope_scaling=YARN, max_position_embeddings=128), dict()),
    "expert_bias": (dict(), dict(expert_bias_std=0.3)),
    "group3_dense2": (dict(num_hidden_layers=6, layer_group_size=3, first_k_dense_replace=2, num_experts=8,
                           n_group=2, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=1.5,
                           rope_theta=500.0), dict(expert_bias_std=0.2, std=0.1)),
    "layer_list": (dict(layer_group_size=[1, 0, 0, 1]), dict()),
}


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def pairs():
    cache = {}

    def get(name):
        if name not in cache:
            cfg_kw, init_kw = CONFIGS[name]
            ours = make_model(tiny_config(**cfg_kw), seed=len(cache) + 1, **init_kw)
            hf = build_hf(ours)
            ids = torch.randint(0, ours.cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(11))
            with torch.no_grad():
                ref = hf(ids).logits.float()
            cache[name] = (ours, hf, ids, ref)
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_matches_hf(pairs, name):
    ours, _, ids, ref = pairs(name)
    with torch.no_grad():
        got = ours.logits(ours(ids))
    assert got.shape == ref.shape == (1, T, ours.cfg.vocab_size)
    assert rel(got, ref) < TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_step_decode_matches_hf(pairs, name):
    ours, _, ids, ref = pairs(name)
    st = ours.new_state(T + 8)
    with torch.no_grad():
        got = torch.cat([ours.logits(ours(ids[:, t:t + 1], torch.tensor([t]), st)) for t in range(T)], 1)
    assert rel(got, ref) < TOL


@pytest.mark.parametrize("name", ["tiny", "yarn", "group3_dense2"])
def test_prefill_then_decode_matches_hf(pairs, name):
    ours, _, ids, ref = pairs(name)
    st = ours.new_state(T + 8)
    with torch.no_grad():
        pre = ours.logits(ours(ids[:, :40], torch.arange(40), st))
        dec = [ours.logits(ours(ids[:, t:t + 1], torch.tensor([t]), st)) for t in range(40, T)]
    assert rel(torch.cat([pre] + dec, 1), ref) < TOL


def test_hf_cached_decode_agrees(pairs):
    """The oracle's own decode path (its cache) agrees with its prefill, so comparing our decode to HF's
    prefill logits is comparing like with like."""
    import inspect
    _, hf, ids, ref = pairs("tiny")
    # transformers 5.24 renamed the forward argument ``past_key_values`` to ``cache`` (old name deprecated)
    arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"

    def cache_of(out):
        c = getattr(out, "cache", None)
        return out.past_key_values if c is None else c
    with torch.no_grad():
        out = hf(ids[:, :30], use_cache=True)
        cache, steps = cache_of(out), [out.logits]
        for t in range(30, 40):
            o = hf(ids[:, t:t + 1], use_cache=True, position_ids=torch.tensor([[t]]), **{arg: cache})
            cache = cache_of(o)
            steps.append(o.logits)
    assert rel(torch.cat(steps, 1).float(), ref[:, :40]) < TOL


# ---- the comparison is sensitive: what it is meant to catch really changes the logits by >> TOL -------------
def test_yarn_matters(pairs):
    ours, _, ids, _ = pairs("yarn")
    plain = make_model(tiny_config(max_position_embeddings=128), seed=0)
    plain.load_state_dict(ours.state_dict())
    plain.finish_load()
    with torch.no_grad():
        a, b = ours.logits(ours(ids)), plain.logits(plain(ids))
    assert rel(a, b) > 100 * TOL


def test_expert_bias_matters(pairs):
    ours, _, ids, ref = pairs("expert_bias")
    sd = ours.state_dict()
    nobias = make_model(ours.cfg, seed=0)
    nobias.load_state_dict({k: (torch.zeros_like(v) if k.endswith("expert_bias") else v) for k, v in sd.items()})
    nobias.finish_load()
    with torch.no_grad():
        # the bias changes which experts are picked for many tokens ...
        x = torch.randn(T, ours.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        layer = ours.decoder_layers[1].mlp
        ids_b, _ = layer.router(x)
        ids_0, _ = nobias.decoder_layers[1].mlp.router(x)
        changed = (ids_b.sort(-1).values != ids_0.sort(-1).values).any(-1).float().mean()
        assert changed > 0.3
        # ... and so the logits
        assert rel(nobias.logits(nobias(ids)), ref) > 100 * TOL


def test_tolerance_catches_small_weight_errors(pairs):
    """A 1% error in one KDA decay parameter or one expert's weights fails the 1e-4 comparison."""
    ours, _, ids, ref = pairs("tiny")
    for name in ("model.layers.2.attention.A_log", "model.layers.3.mlp.experts.w2"):
        bad = make_model(ours.cfg, seed=0)
        sd = {k: v.clone() for k, v in ours.state_dict().items()}
        sd[name] = sd[name] * 1.01
        bad.load_state_dict(sd)
        bad.finish_load()
        with torch.no_grad():
            assert rel(bad.logits(bad(ids)), ref) > TOL, name
