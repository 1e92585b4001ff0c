"""The Triton MLA decode/verify backend (``kernels.triton_mla``) at Ling-3.0-flash shapes on a GPU.

32 heads, qk_nope 128, qk_rope 64, v 128, kv_lora_rank 512, YaRN (the committed config), M = 1..4 new tokens at
the end of a 2K and a 32K context (static spans 2K + 64 and 32K + 64, so the spans are not multiples of the
key block and the last splits are partly or wholly past the positions). Checked against a float64 expanded-form
reference (``tests/test_triton_mla.ref64``), next to the layer's float32 torch path as the yardstick; the layer
forward with the backend bound against the torch forward; CUDA-graph replay == eager bit for bit. The bundled
nano model with the backend: captured decode == eager over 48 steps across two kv buckets, and greedy tokens
equal to the torch MLA's (or a near-tie). The layer as bind_model binds it with FP8 q_proj / kv_a_proj_with_mqa /
g_proj: their one fused GEMV (``linear.fuse_rows(pad=True)``, 6144 | 576 + 64 zero rows | 32) against the three
GEMVs, M = 1..4: bit-equal (output and cache) when the three use the fused GEMV's launch config, within the
float64 reference's accuracy of the three as they bind on their own (their own table configs); graph == eager.
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


FP8_PROJ = ("q_proj", "kv_a_proj_with_mqa", "g_proj")


@pytest.fixture(scope="module")
def ling_fp8_layer():
    """A Ling-shaped layer whose q_proj, kv_a_proj_with_mqa, g_proj and dense are FP8 128x128 blocks (ue8m0 scales,
    as the checkpoint stores them), and the first three fused as bind_model fuses them. Returns ``(layer, fused
    QLinear)``."""
    from bytebound.config import LING3_FLASH_CONFIG, LingConfig
    from bytebound.layers.linear import fuse_rows
    from bytebound.layers.mla import GatedMLA
    from bytebound.quant import quantize_fp8_block
    cfg = LingConfig.from_file(LING3_FLASH_CONFIG)
    torch.manual_seed(1)
    fp8 = FP8_PROJ + ("dense",)
    layer = GatedMLA(cfg, lambda name: "fp8" if name in fp8 else "plain", dtype=torch.bfloat16, device=DEV)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dtype != torch.float8_e4m3fn and not name.endswith("weight_scale_inv"):
                p.copy_(torch.randn(p.shape, device=DEV) / p.shape[-1] ** 0.5)
        for name in fp8:
            lin = getattr(layer, name)
            wq, sc = quantize_fp8_block(torch.randn(lin.weight.shape, device=DEV) / lin.in_features ** 0.5)
            lin.weight.copy_(wq)
            lin.weight_scale_inv.copy_(sc)
        layer.kv_a_layernorm.weight.copy_(torch.rand(layer.rank, device=DEV) + 0.5)
    layer = layer.to(DEV)
    layer.prepare(torch.bfloat16)
    fused = fuse_rows([getattr(layer, n) for n in FP8_PROJ], pad=True)
    assert fused.row_spans == [(0, 6144), (6144, 6720), (6784, 6816)]
    return layer, fused


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


@torch.no_grad()
@pytest.mark.parametrize("cfg", [{"combine_kc": False}, {"combine_kc": False, "prefetch": True},
                                 {"skip_empty": True}, {"combine_kc": False, "prefetch": True, "skip_empty": True},
                                 {"combine_pre": False},
                                 {"combine_BV": 64, "combine_kc": False, "prefetch": True}])
@pytest.mark.parametrize("pos,span,m", [(2048, 4096, 1), (2045, 4096, 4), (20000, 32768, 1), (20000, 32768, 4)])
def test_opt_in_switches_keep_the_bits(ling_layer, cfg, pos, span, m):
    """The merge's forms and switches (``combine_kc`` false: the per-v-block merge instead of the one over latent
    blocks with a ticket; ``prefetch``: that merge's W_vc L2 prefetch before its PDL wait; ``combine_pre`` false: the
    W_vc block loaded after the wait; ``skip_empty``: the splits past the sequence skipped) give the default's output
    and cache bit for bit, eagerly and under graph replay, at the engine's power-of-two spans (at 2K about half the
    splits are past the sequence)."""
    from bytebound.kernels.triton_mla import TritonMLA
    from bytebound.runner.graphs import capture_graph
    layer = ling_layer
    # a v-block width is a tiling (it may change a sum's order): the base runs the switch's width
    base = TritonMLA({k: cfg[k] for k in ("combine_BV",) if k in cfg}).bind(layer, torch.bfloat16)
    opt = TritonMLA(cfg).bind(layer, torch.bfloat16)
    kv = filled(pos, span, seed=pos + m)
    g = torch.Generator(device=DEV).manual_seed(m)
    q = torch.randn(1, m, 32, 192, generator=g, device=DEV).to(torch.bfloat16)
    ckv = torch.randn(1, m, 576, generator=g, device=DEV).to(torch.bfloat16)
    gl = torch.randn(1, m, 32, generator=g, device=DEV).to(torch.bfloat16)
    positions = torch.arange(pos, pos + m, device=DEV)
    kv_b, kv_o, kv_g = kv.clone(), kv.clone(), kv.clone()
    want = base(q, ckv, gl, positions, kv_b, span)
    got = opt(q, ckv, gl, positions, kv_o, span)
    graph, out = capture_graph(lambda: opt(q, ckv, gl, positions, kv_g, span))
    kv_g.copy_(kv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(kv_o, kv_b)
    assert torch.equal(out, want) and torch.equal(kv_g, kv_b)


@torch.no_grad()
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_fused_projection_layer_equals_three_projections(ling_fp8_layer, m):
    """Five launches per layer (fused GEMV, prep, attention, combine, dense) against seven (three GEMVs first)."""
    from bytebound.analysis.kernels import kernel_table
    from bytebound.kernels.triton_fp8 import TritonLinear, fp8_block_gemv, gemv_config
    from bytebound.kernels.triton_mla import TritonMLA
    from bytebound.layers.mla import MLAState
    from bytebound.quant import dequantize_fp8_block
    from bytebound.runner.graphs import capture_graph
    from test_triton_mla import ref64
    layer, fused = ling_fp8_layer
    parts = [getattr(layer, n) for n in FP8_PROJ]
    span, pos = 2048 + 64, 2048 - m
    kv = filled(pos, span + 64, seed=50 + m)
    g = torch.Generator(device=DEV).manual_seed(60 + m)
    x = torch.randn(1, m, 2560, generator=g, device=DEV).to(torch.bfloat16)
    positions = torch.arange(pos, pos + m, device=DEV)
    cfg = gemv_config(6816, 2560, m, DEV)             # the fused GEMV's launch config (its table entry or default)

    def same_cfg(p):
        return lambda v: fp8_block_gemv(v.reshape(-1, 2560), p.weight, p.weight_scale_inv, p.block,
                                        cfg).view(*v.shape[:-1], -1)

    def run():
        st = MLAState(kv.clone())
        return layer(x, positions, st, span), st.kv

    def kernels() -> float:             # CUDA kernels of one layer call (the same slots rewritten each call)
        kv_c = kv.clone()
        return kernel_table(lambda: layer(x, positions, MLAState(kv_c), span), 3)[1]["kernels"]
    layer.attn_fn = TritonMLA().bind(layer, torch.bfloat16)
    layer.dense.fn = TritonLinear().bind(layer.dense, torch.bfloat16)
    try:
        layer.proj_fn, layer.proj_spans = TritonLinear().bind(fused, torch.bfloat16), fused.row_spans
        out_f, kv_f = run()
        n_fused = kernels()
        kv_g = kv.clone()
        graph, out_g = capture_graph(lambda: layer(x, positions, MLAState(kv_g), span),
                                     between=lambda: kv_g.copy_(kv))
        kv_g.copy_(kv)
        graph.replay()
        torch.cuda.synchronize()
        layer.proj_fn = layer.proj_spans = None
        for p in parts:
            p.fn = same_cfg(p)
        out_s, kv_s = run()
        for p in parts:                                  # as bind_model binds them unfused: each its own config
            p.fn = TritonLinear().bind(p, torch.bfloat16)
        out_t, _ = run()
        n_three = kernels()
    finally:
        layer.attn_fn = layer.proj_fn = layer.proj_spans = layer.dense.fn = None
        for p in parts:
            p.fn = None
    assert (n_fused, n_three) == (5, 7)
    assert torch.equal(out_f, out_s) and torch.equal(kv_f, kv_s)
    assert torch.equal(out_g, out_f) and torch.equal(kv_g, kv_f)
    # float64 reference from the correctly rounded BF16 projections (neither GEMV's summation order)
    x64 = x.double()
    def w64(p):
        return dequantize_fp8_block(p.weight, p.weight_scale_inv, p.block, torch.float64)
    q, ckv, gl = ((x64 @ w64(p).t()).to(torch.bfloat16) for p in parts)
    o64, _ = ref64(layer, q.view(1, m, 32, 192), ckv, gl, positions, kv)
    want64 = o64.reshape(1, m, -1) @ w64(layer.dense).t()
    e_f, e_t = rel(out_f, want64), rel(out_t, want64)
    print(f"M {m}: layer rel vs float64: fused projection {e_f:.2e}, three projections (own configs) {e_t:.2e}")
    assert e_t < 6e-3 and e_f < 1.5 * e_t + 1e-3


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
