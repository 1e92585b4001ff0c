"""Issue 19's launch fusions on the GPU at Ling-3.0-flash widths (run by scripts/gpu_check.sh):

* the residual add fused into the next RMSNorm (``kernels.triton_norm.add_rmsnorm``) at hidden 2560, M = 1..4: the
  new residual bit-equal to torch's add, the normed value as the plain norm kernel on it; graph replay == eager;
* beta's b_proj inside the fused KDA kernel (``fused_kda(x=, b_weight=)``) at 32 heads x 128, hidden 2560, M = 1..4,
  against the same kernel fed cuBLAS's b_proj output; graph replay == eager, history included;
* the post-attention add + norm folded into the router launch (``gemv_route_add_norm``) at Ling's routing (512
  experts, 8 groups, top-8, hidden 2560), M = 1..4, against torch's add, the norm and ``route``; graph == eager;
* a six-layer model at full width bound as the engine binds it on CUDA: decode graph replay == eager bit for bit,
  and the kernels of one decode-graph replay counted (torch.profiler) with the fusions off and on, so the saving
  is measured: at least one launch per residual add (2 per layer), one per fused KDA layer, one more per MoE
  layer (its post-attention norm) and two per MLA layer (q_proj | kv_a_proj_with_mqa | g_proj as one GEMV instead
  of three; the MLA layer is then 5 launches: that GEMV, the three kernels of ``kernels.triton_mla``, dense), and
  with the opt-in ``BYTEBOUND_NORM_FOLD=1``, one per layer after the first for the input add + norm folded into the
  attention's FP8 MMA projection (``fold_input_norm``: ``triton_fp8.fp8_block_gemv_add_norm``; off by default,
  measured slower; tests/gpu/test_gemv_gpu.py checks its numerics).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")]

DEV = "cuda"
HID, H, K = 2560, 32, 128


def _graph(fn):
    from bytebound.runner.graphs import capture_graph
    return capture_graph(fn, warmup=2)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_add_rmsnorm_ling_width(m, wdt):
    from bytebound.kernels.triton_norm import add_rmsnorm, rmsnorm
    from bytebound.layers.norm import RMSNorm
    g = torch.Generator(device=DEV).manual_seed(m)
    norm = RMSNorm(HID, 1e-6).to(DEV)
    norm.weight.data = (torch.rand(HID, generator=g, device=DEV) + 0.5).to(wdt)
    h = (torch.randn(1, m, HID, generator=g, device=DEV) * 3).to(torch.bfloat16)
    delta = (torch.randn(1, m, HID, generator=g, device=DEV) * 0.4).to(torch.bfloat16)
    x, h2 = add_rmsnorm(delta, h, norm.weight, norm.eps)
    want_h = h + delta
    assert torch.equal(h2, want_h)
    assert torch.equal(x, rmsnorm(want_h, norm.weight, norm.eps))
    want = norm(want_h)           # the torch module: float32 statistics summed in another order
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp(min=1e-30))) - 7)
    assert ((x.float() - want.float()).abs() <= 2 * ulp).all()
    assert (x != want).float().mean() < 0.01
    graph, out = _graph(lambda: add_rmsnorm(delta, h, norm.weight, norm.eps))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], x) and torch.equal(out[1], h2)


def _kda_inputs(m, seed):
    from test_triton_kda import make_inputs
    x, p, s = make_inputs(1, m, H, K, K, seed=seed, in_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    xin = torch.randn(1, m, HID, generator=g).to(torch.bfloat16)
    wb = (torch.randn(H, HID, generator=g) * 0.02).to(torch.bfloat16)
    return ({k: v.to(DEV) for k, v in x.items()}, {k: v.to(DEV) for k, v in p.items()}, s, xin.to(DEV),
            wb.to(DEV))


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_fused_kda_beta_from_x_ling_shape(m):
    """The in-kernel b_proj against cuBLAS's (``F.linear`` in bf16, then the kernel reads b): both round the float32
    dot to bf16, in different summation orders, so beta may differ by one bf16 step of its logit."""
    from bytebound.kernels import triton_kda as tk
    x, p, s, xin, wb = _kda_inputs(m, 400 + m)

    def call(b, xx, ww, st, ch, rh):
        return tk.fused_kda(x["qkv"], x["f"], x["gate"], b, p["conv_weight"], st["conv"], p["a_log"], p["dt_bias"],
                            st["rec"], p["norm_weight"], 1e-6, -5.0, torch.bfloat16, ch, rh, x=xx, b_weight=ww)

    def fresh():
        return ({k: v.clone().to(DEV) for k, v in s.items()}, torch.zeros(m, 1, 3 * H * K, 3, device=DEV),
                torch.zeros(m, 1, H, K, K, device=DEV))
    st_b, ch_b, rh_b = fresh()
    o_b = call(torch.nn.functional.linear(xin, wb), None, None, st_b, ch_b, rh_b)
    st_x, ch_x, rh_x = fresh()
    o_x = call(None, xin, wb, st_x, ch_x, rh_x)
    err = ((o_x.float() - o_b.float()).norm() / o_b.float().norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(st_x["rec"], st_b["rec"], rtol=2e-2, atol=1e-3)
    assert torch.equal(st_x["conv"], st_b["conv"]) and torch.equal(ch_x, ch_b)
    # graph replay == eager, bit for bit
    st_g, ch_g, rh_g = fresh()
    st0 = {k: v.clone() for k, v in st_g.items()}

    def body():
        return call(None, xin, wb, st_g, ch_g, rh_g)
    from bytebound.runner.graphs import capture_graph
    graph, o_g = capture_graph(body, warmup=2, between=lambda: [st_g[k].copy_(st0[k]) for k in st_g])
    for k in st_g:
        st_g[k].copy_(st0[k])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_g, o_x) and torch.equal(st_g["rec"], st_x["rec"]) and torch.equal(rh_g, rh_x)


@pytest.mark.parametrize("fold", ["1", "0"])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_route_add_norm_ling(m, fold, monkeypatch):
    """The post-attention add + norm inside the router launch (``BYTEBOUND_ROUTER_NORM_FOLD`` unset / 1), or as the
    norm kernel's launch before ``gemv_route`` (0): h' bit-equal to torch's add, x within two BF16 steps of the
    norm on 99 % of elements, the routing equal to ``route`` on x's float32 logits; graph replay == eager."""
    monkeypatch.setenv("BYTEBOUND_ROUTER_NORM_FOLD", fold)
    from bytebound.kernels.triton_router import gemv_route_add_norm
    from bytebound.layers.moe import route
    from bytebound.layers.norm import RMSNorm
    e, g, tg, k = 512, 8, 4, 8
    gen = torch.Generator(device=DEV).manual_seed(10 + m)
    norm = RMSNorm(HID, 1e-6).to(DEV)
    norm.weight.data = (torch.rand(HID, generator=gen, device=DEV) + 0.5).to(torch.bfloat16)
    wg = torch.randn(e, HID, generator=gen, device=DEV) * 0.02
    b = torch.randn(e, generator=gen, device=DEV) * 0.1
    h = (torch.randn(m, HID, generator=gen, device=DEV) * 3).to(torch.bfloat16)
    delta = (torch.randn(m, HID, generator=gen, device=DEV) * 0.4).to(torch.bfloat16)

    def call():
        return gemv_route_add_norm(delta, h, norm.weight, norm.eps, wg, b, k, g, tg, True, 2.5)
    ids, w, x, h2 = call()
    assert torch.equal(h2, h + delta)
    want = norm(h + delta)
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp(min=1e-30))) - 7)
    assert ((x.float() - want.float()).abs() <= 2 * ulp).all() and (x != want).float().mean() < 0.01
    rid, rw = route(torch.nn.functional.linear(x.float(), wg), b, k, g, tg, True, 2.5)
    for i in range(m):
        got = dict(zip(ids[i].tolist(), w[i].tolist()))
        ref = dict(zip(rid[i].tolist(), rw[i].tolist()))
        assert got.keys() == ref.keys()
        assert all(abs(got[j] - ref[j]) <= 1e-4 * max(1.0, abs(ref[j])) for j in got)
    graph, out = _graph(call)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b_) for a, b_ in zip(out, (ids, w, x, h2)))


@pytest.mark.parametrize("m", [1, 4])
def test_pdl_l2_prefetch_on_equals_off(m, monkeypatch):
    """The opt-in early PDL launch with L2 prefetch before the wait (``BYTEBOUND_PDL_PREFETCH=router,kda``,
    ``kernels.pdl.early``) changes no result: the router (``gemv_route_add_norm``) and the fused KDA kernel (beta in
    the kernel, the verify's history) at Ling's shapes give the same bits with it on as off, eagerly and in a CUDA
    graph where each follows the kernel that writes its input. The prefetch path is asserted to be the one taken
    (aligned tensors on sm_90), so the comparison covers it."""
    from bytebound.kernels import pdl
    from bytebound.kernels import triton_kda as tk
    from bytebound.kernels.triton_router import gemv_route_add_norm
    dev = torch.device(DEV)
    e, g, tg, k = 512, 8, 4, 8
    gen = torch.Generator(device=DEV).manual_seed(70 + m)
    nw = (torch.rand(HID, generator=gen, device=DEV) + 0.5).to(torch.bfloat16)
    wg = torch.randn(e, HID, generator=gen, device=DEV) * 0.02
    b = torch.randn(e, generator=gen, device=DEV) * 0.1
    h = (torch.randn(m, HID, generator=gen, device=DEV) * 3).to(torch.bfloat16)
    d0 = (torch.randn(m, HID, generator=gen, device=DEV) * 0.4).to(torch.bfloat16)
    x, p, s, xin, wb = _kda_inputs(m, 500 + m)
    st0 = {kk: v.clone().to(DEV) for kk, v in s.items()}

    def run():
        """delta written by a kernel just before the router; KDA after the router, on fresh state copies."""
        delta = d0 * 1.0
        ids, w, xr, h2 = gemv_route_add_norm(delta, h, nw, 1e-6, wg, b, k, g, tg, True, 2.5)
        st = {kk: v.clone() for kk, v in st0.items()}
        ch, rh = torch.zeros(m, 1, 3 * H * K, 3, device=DEV), torch.zeros(m, 1, H, K, K, device=DEV)
        o = tk.fused_kda(x["qkv"], x["f"], x["gate"], None, p["conv_weight"], st["conv"], p["a_log"], p["dt_bias"],
                         st["rec"], p["norm_weight"], 1e-6, -5.0, torch.bfloat16, ch, rh, x=xin, b_weight=wb)
        return ids, w, xr, h2, o, st["conv"], st["rec"], ch, rh

    def outputs(value):
        monkeypatch.setenv("BYTEBOUND_PDL_PREFETCH", value)
        eager = [t.clone() for t in run()]
        graph, out = _graph(run)
        graph.replay()
        torch.cuda.synchronize()
        return eager, [t.clone() for t in out]
    monkeypatch.setenv("BYTEBOUND_PDL_PREFETCH", "router,kda")
    assert pdl.early("router", dev) and pdl.early("kda", dev), "the prefetch path is off on this device"
    vs, _, _ = tk.resolve_launch(1, H, K, K, m, str(dev))
    assert tk.prefetch_aligned(torch.zeros(1, H, K, K, device=DEV), p["conv_weight"], st0["conv"], wb, vs)
    off_e, off_g = outputs("")
    on_e, on_g = outputs("router,kda")
    names = ("ids", "w", "x", "h", "o", "conv", "rec", "conv_hist", "rec_hist")
    for name, a, b1, c1, d1 in zip(names, off_e, off_g, on_e, on_g):
        assert torch.equal(a, b1), f"{name}: graph != eager with the prefetch off"
        assert torch.equal(a, c1) and torch.equal(a, d1), f"{name}: the prefetch changed the result"


def _kernels_per_replay(runner, pos: int, replays: int = 3) -> float:
    """CUDA kernels in one replay of the captured decode graph (``analysis.kernels.kernel_table``, as
    scripts/bench_decode.py counts ``kernels_per_step``, without the LM head: the fusions do not touch it)."""
    from bytebound.analysis.kernels import kernel_table
    from bytebound.runner.graphs import capture_decode
    capture_decode(runner)
    tok = torch.tensor([17], device=DEV)
    at = iter(range(pos, pos + replays + 1))
    _, totals = kernel_table(lambda: runner.graph.replay(tok, next(at)), replays)
    runner.graph = None
    return totals["kernels"]


@torch.inference_mode()
@pytest.mark.parametrize("fold", ["0", "1"])
def test_full_width_decode_fusions_graph_equals_eager_and_kernel_count(fold, monkeypatch):
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LING3_FLASH_CONFIG, LingConfig
    from bytebound.kernels.triton_fp8 import TritonLinear
    from bytebound.layers.kda import KimiDeltaAttention
    from bytebound.layers.mla import GatedMLA
    from bytebound.layers.moe import MoE
    from bytebound.layers.norm import RMSNorm
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.graphs import capture_decode
    from bytebound.runner.runner import ModelRunner
    from _replay import replay_vs_eager
    monkeypatch.setenv("BYTEBOUND_NORM_FOLD", fold)
    d = json.loads(Path(LING3_FLASH_CONFIG).read_text())
    d["num_hidden_layers"] = 6
    model = dummy_model(LingConfig.from_dict(d), DEV, torch.bfloat16)
    # the device's default plan, as the engine binds it (router=gemv, norm=triton, moe_shared=fused, kda=triton)
    plan = bind_model(model, BackendPlan.default(DEV), DEV, "bf16")
    kda = [m for m in model.modules() if isinstance(m, KimiDeltaAttention) and m.fused_fn is not None]
    assert kda and all(m.fused_fn.beta_in_kernel for m in kda), plan.resolutions["kda"].fused
    assert plan.resolutions["kda"].fused == "b_proj inside the fused kernel"
    norms = [m for m in model.modules() if isinstance(m, RMSNorm) and m.add_fn is not None]
    moes = [m for m in model.modules() if isinstance(m, MoE) and m.gemv_add_norm_fn is not None]
    assert moes and "post-attention add + norm" in plan.resolutions["moe"].router
    # the decoder layers' MLA (the NEXTN layer's is not run): q|kv_a|g as one FP8 GEMV, kv_a padded 576 -> 640 rows
    mlas = [layer.attention for layer in model.decoder_layers if isinstance(layer.attention, GatedMLA)]
    assert mlas and all(m.proj_fn is not None and m.attn_fn is not None for m in mlas)
    assert plan.resolutions["mla"].fused == ("q_proj | kv_a_proj_with_mqa | g_proj: one fp8 projection of 6816 rows "
                                             "(64 zero rows keep the parts on 128-row scale-block edges)")
    folds = [layer.attention for layer in model.decoder_layers if layer.attention.fold_input_norm]
    if fold == "1":
        assert len(folds) == model.cfg.num_hidden_layers, "every attention projection takes the input norm (MMA)"
        assert plan.resolutions["norm"].fused.startswith("input add + RMSNorm inside the attention's fused FP8")
    else:
        assert not folds and plan.resolutions["norm"].fused is None
    r = ModelRunner(model, 256)
    h = r.prefill(torch.randint(0, model.cfg.vocab_size, (12,), device=DEV))
    tok = model.logits(h[-1:]).argmax(-1).view(1)
    capture_decode(r)
    snap = r.snapshot()
    for eager, replay in replay_vs_eager(r, tok, 2, lambda y: model.logits(y).argmax(-1).view(1)):
        assert torch.equal(replay, eager)
    r.graph = None

    def step():         # one eager decode step from the snapshot, then the counted graph replays (they mutate)
        r.restore(snap)
        out = r.forward(torch.tensor([17], device=DEV)).clone()
        r.restore(snap)
        return out, _kernels_per_replay(r, snap.pos)
    fused_out, fused = step()
    for m in norms:
        m.add_fn_saved, m.add_fn = m.add_fn, None
    for m in kda:
        m.fused_fn.beta_in_kernel = False
    for m in moes:
        m.gemv_add_norm_saved, m.gemv_add_norm_fn = m.gemv_add_norm_fn, None
    parts = [p for m in mlas for p in (m.q_proj, m.kv_a_proj_with_mqa, m.g_proj)]
    for m in folds:
        m.fold_input_norm = False
    for m in mlas:                      # the three projections, each bound as the triton linear binds it alone
        m.proj_saved, m.proj_fn = m.proj_fn, None
    for p in parts:
        p.fn = TritonLinear().bind(p, torch.bfloat16)
    try:
        unfused_out, unfused = step()
    finally:
        for m in norms:
            m.add_fn = m.add_fn_saved
        for m in kda:
            m.fused_fn.beta_in_kernel = True
        for m in moes:
            m.gemv_add_norm_fn = m.gemv_add_norm_saved
        for m in mlas:
            m.proj_fn = m.proj_saved
        for m in folds:
            m.fold_input_norm = True
        for p in parts:
            p.fn = None
    L = model.cfg.num_hidden_layers
    n_moe = sum(isinstance(layer.mlp, MoE) for layer in model.decoder_layers)     # (the NEXTN layer's is not run)
    expect = 2 * L + len(kda) + n_moe + 2 * len(mlas) + (L - 1 if folds else 0)     # L - 1: the folded norms
    print(f"\nkernels per decode-graph replay ({L} layers, {len(kda)} fused KDA, {n_moe} MoE, {len(mlas)} MLA): "
          f"unfused {unfused:.1f}, fused {fused:.1f}, saved {unfused - fused:.1f} (expected >= {expect})")
    if os.environ.get("OUT"):           # the device tool's result folder (scripts/gpu_check.sh)
        Path(os.environ["OUT"], f"fuse_kernel_count_fold{fold}.json").write_text(json.dumps(
            {"layers": L, "fused_kda_layers": len(kda), "moe_layers": n_moe, "mla_layers": len(mlas),
             "add_norms": len(norms), "kernels_unfused": unfused, "kernels_fused": fused}, indent=2))
    assert unfused - fused >= expect
    # the same step either way, up to beta's bf16 rounding (summation order of the b_proj dot) and the folded norm's
    # (its sum of squares in another order)
    err = ((fused_out.float() - unfused_out.float()).norm() / unfused_out.float().norm()).item()
    assert err < 2e-2, err
