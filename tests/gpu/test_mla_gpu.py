"""The Triton MLA decode/verify backend (``kernels.triton_mla``) at Ling-3.0-flash shapes on a GPU.

32 heads, qk_nope 128, qk_rope 64, v 128, kv_lora_rank 512, YaRN (the committed config), M = 1..4 new tokens at
the end of a 2K and a 32K context (static spans 2K + 64 and 32K + 64, so the spans are not multiples of the
key block and the last splits are partly or wholly past the positions). Checked against a float64 expanded-form
reference (``tests/test_triton_mla.ref64``), next to the layer's float32 torch path as the yardstick; the layer
forward with the backend bound against the torch forward; CUDA-graph replay == eager bit for bit. The bundled
nano model with the backend: captured decode == eager over 48 steps across two kv buckets, and greedy tokens
equal to the torch MLA's (or a near-tie).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")]
DEV = "cuda"


@pytest.fixture(scope="module")
def ling_layer():
    from bytebound.config import LING3_FLASH_CONFIG, LingConfig
    from bytebound.layers.mla import GatedMLA
    cfg = LingConfig.from_file(LING3_FLASH_CONFIG)
    torch.manual_seed(0)
    layer = GatedMLA(cfg, lambda name: "plain", dtype=torch.bfloat16, device=DEV)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, device=DEV) / p.shape[-1] ** 0.5)
        layer.kv_a_layernorm.weight.copy_(torch.rand(layer.rank, device=DEV) + 0.5)
    layer = layer.to(DEV)                   # the rope and norm buffers are made on the CPU
    layer.prepare(torch.bfloat16)
    assert (layer.heads, layer.nope, layer.rope_dim, layer.vdim, layer.rank) == (32, 128, 64, 128, 512)
    return layer


def filled(n: int, max_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    kv = torch.zeros(1, max_len, 576, device=DEV)
    kv[:, :n, :512] = torch.randn(1, n, 512, generator=g, device=DEV)
    kv[:, :n, 512:] = torch.randn(1, n, 64, generator=g, device=DEV)
    return kv.to(torch.bfloat16)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@torch.no_grad()
@pytest.mark.parametrize("ctx", [2048, 32768])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_kernel_vs_float64_and_torch(ling_layer, ctx, m):
    from bytebound.kernels.triton_mla import TritonMLA
    from bytebound.layers.mla import MLAState
    from test_triton_mla import ref64
    layer = ling_layer
    span = ctx + 64
    pos = ctx - m
    kv = filled(pos, span + 64, seed=ctx + m)
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(1, m, layer.q_proj.in_features, generator=g, device=DEV).to(torch.bfloat16)
    positions = torch.arange(pos, pos + m, device=DEV)
    q = layer.q_proj(x).view(1, m, 32, 192)
    ckv = layer.kv_a_proj_with_mqa(x)
    gl = layer.g_proj(x)
    o64, _ = ref64(layer, q, ckv, gl, positions, kv)
    want64 = o64.reshape(1, m, -1) @ layer.dense.weight.double().t()
    st_ref, st_tri = MLAState(kv.clone()), MLAState(kv.clone())
    ref = layer(x, positions, st_ref, span)                   # the float32 torch absorbed path
    fn = TritonMLA().bind(layer, torch.bfloat16)
    o_tri = fn(q, ckv, gl, positions, st_tri.kv, span)
    e_attn = rel(o_tri, o64)
    layer.attn_fn = fn
    try:
        got = layer(x, positions, MLAState(kv.clone()), span)
    finally:
        layer.attn_fn = None
    e_ref, e_tri = rel(ref, want64), rel(got, want64)
    print(f"ctx {ctx} M {m}: attention rel {e_attn:.2e}; layer rel triton {e_tri:.2e}, torch {e_ref:.2e}")
    assert e_attn < 6e-3
    assert e_ref < 6e-3 and e_tri < 1.5 * e_ref + 1e-3
    # the cache rows: the torch path's values; float32 statistics summed in another order may flip the first of
    # the norm's two BF16 roundings (then 1-2 BF16 steps off), as in tests/test_triton_norm.py
    d = (st_tri.kv.float() - st_ref.kv.float()).abs()
    ulp = torch.exp2(torch.floor(torch.log2(st_ref.kv.float().abs().clamp(min=1e-30))) - 7)
    assert (d <= 2.01 * ulp).all() and (d > 0).float().mean() < 0.01


@torch.no_grad()
@pytest.mark.parametrize("m", [1, 4])
def test_graph_replay_equals_eager(ling_layer, m):
    from bytebound.kernels.triton_mla import TritonMLA
    layer = ling_layer
    fn = TritonMLA().bind(layer, torch.bfloat16)
    span = 32768
    kv = filled(20000, span, seed=7)
    g = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(1, m, 32, 192, generator=g, device=DEV).to(torch.bfloat16)
    ckv = torch.randn(1, m, 576, generator=g, device=DEV).to(torch.bfloat16)
    gl = torch.randn(1, m, 32, generator=g, device=DEV).to(torch.bfloat16)
    positions = torch.arange(20000, 20000 + m, device=DEV)
    kv_e = kv.clone()
    eager = fn(q, ckv, gl, positions, kv_e, span)
    from bytebound.runner.graphs import capture_graph
    kv_g = kv.clone()
    graph, out = capture_graph(lambda: fn(q, ckv, gl, positions, kv_g, span))
    kv_g.copy_(kv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(kv_g, kv_e)
    positions.add_(37)                                       # a later position through the same graph
    graph.replay()
    eager2 = fn(q, ckv, gl, positions, kv_e, span)
    torch.cuda.synchronize()
    assert torch.equal(out, eager2) and torch.equal(kv_g, kv_e)


NANO = Path(__file__).resolve().parents[2] / "models" / "ling-nano"


@torch.inference_mode()
def test_nano_graph_replay_equals_eager_with_triton_mla():
    """The bundled model (4 heads, latent 128, rope 32) decoding 48 steps with mla=triton: the captured step
    equals the eager one bit for bit (kv buckets on, so the span changes under the graphs)."""
    from bytebound.checkpoint.loader import load_model
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.graphs import capture_decode
    from bytebound.runner.runner import ModelRunner
    from _replay import greedy_logits
    model = load_model(NANO, "cuda")
    from bytebound.runner.plan import PLAIN_SWITCHES
    plan = bind_model(model, BackendPlan.default("cuda", mla="triton", **PLAIN_SWITCHES), "cuda", "bf16")
    assert plan.resolutions["mla"].resolved == "triton"
    prompt = torch.randint(0, model.cfg.vocab_size, (40,), device="cuda")

    def run(graph: bool) -> list[torch.Tensor]:
        r = ModelRunner(model, 128, kv_buckets=(64,))
        if graph:
            capture_decode(r)
        tok = model.logits(r.prefill(prompt)[-1:]).argmax(-1)
        return greedy_logits(model, r, tok, 48)   # crosses slot 64: both buckets' graphs

    for i, (a, b) in enumerate(zip(run(False), run(True))):
        assert torch.equal(a, b), f"step {i}: graph replay differs from eager"
    bind_model(model, BackendPlan.default("cuda", **PLAIN_SWITCHES), "cuda", "bf16")


@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
def test_nano_greedy_triton_mla_matches_torch_mla():
    """Greedy tokens of the trained nano model on the GPU with mla=triton equal those with mla=torch, or diverge
    only at a near-tie of the torch run's logits (as tests/gpu/test_engine_gpu.py's GPU vs CPU check)."""
    from bytebound.data.gsm8k import load_split
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    q = load_split("test")[0]["question"]
    p = SamplingParams(max_tokens=64, ignore_eos=True)
    ref = Engine(model=str(NANO), device="cuda")
    a = ref.generate(q, p, chat=True)[0].token_ids
    tri = Engine(model=str(NANO), device="cuda", backends={"mla": "triton"})
    assert tri.plan.resolutions["mla"].resolved == "triton"
    b = tri.generate(q, p, chat=True)[0].token_ids
    if a == b:
        return
    i = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
    ids = ref.encode_prompt(q, chat=True) + a[:i]
    with torch.inference_mode():
        lg = ref.model.logits(ref.model(torch.tensor([ids], device="cuda")))[0, -1].float()
    top2 = lg.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < 0.05 * float(lg.abs().max()), f"triton MLA diverged from torch MLA at token {i} (gap {gap:.4f})"
