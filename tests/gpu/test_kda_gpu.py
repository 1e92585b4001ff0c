"""The fused KDA decode/verify kernel (``kernels.triton_kda``, kda backend ``triton``) on the GPU at Ling-3.0-flash's
full KDA shape (32 heads x head_dim 128, hidden 2560), M = 1..4 and 6, at every V_SPLIT (1, 2, 4, 8 programs per
head; run by scripts/gpu_check.sh):

* the kernel against the float64 oracle of tests/test_triton_kda.py (conv, gates, recurrence, gated norm), with
  every token's history entry;
* CUDA-graph replay == eager, bit for bit (o, both states, the history buffers), two eager calls bit-equal, two
  replays bit-equal (the split kernel's tickets are reset by each launch);
* the whole layer with ``layer.fused_fn`` against the layer's torch path (``torch_kda``) and against the current
  CUDA default (``fla``: fused_recurrent for M = 1, the stepwise verify for M > 1), outputs, states and rollback.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")]

DEV = "cuda"
H, K = 32, 128
V_SPLITS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def tk():
    from bytebound.kernels import triton_kda
    return triton_kda


@functools.lru_cache(maxsize=None)
def _case64(m, lower_bound):
    """Inputs and float64 oracle of one (M, gate) case (shared by the V_SPLIT variants)."""
    from test_triton_kda import make_inputs, reference64
    x, p, s = make_inputs(1, m, H, K, K, seed=100 + m, in_dtype=torch.bfloat16)
    return (x, p, s), reference64(x, p, s, lower_bound, H, K, K)


@pytest.mark.parametrize("v_split,m", [(1, m) for m in (1, 2, 3, 4, 6)] +
                         [(vs, m) for vs in V_SPLITS[1:] for m in (1, 2, 3, 4)])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fused_kernel_ling_shape_vs_float64(tk, m, lower_bound, v_split):
    """Every output, state and history entry against the float64 oracle; the bf16 output (checked for both gates
    at V_SPLIT 1, for the safe gate at the others: the store does not depend on the gate) within one bf16 step."""
    from test_triton_kda import close64, run_kernel
    (x, p, s), (o64, conv64, recs64, convs64) = _case64(m, lower_bound)
    o, st, ch, rh = run_kernel(tk, x, p, s, lower_bound, hist=True, v_split=v_split)
    close64(o, o64)
    close64(st["rec"], recs64[-1])
    close64(rh, recs64)
    assert torch.equal(st["conv"].cpu().double(), conv64)
    assert torch.equal(ch.cpu().double(), convs64)
    if v_split > 1 and lower_bound is None:
        return
    # bf16 output (the engine's): one rounding of the float32 value, so within one bf16 step of it
    ob, _, _, _ = run_kernel(tk, x, p, s, lower_bound, out_dtype=torch.bfloat16, v_split=v_split)
    assert ob.dtype == torch.bfloat16
    torch.testing.assert_close(ob.float(), o, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("v_split", V_SPLITS)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_fused_kernel_graph_replay_equals_eager(tk, m, v_split):
    """Eager twice from the same state (bit-equal), then one captured call replayed twice from that state: each
    replay == eager bit for bit, and the tickets are back at zero after every launch."""
    from test_triton_kda import make_inputs
    x, p, s = make_inputs(1, m, H, K, K, seed=200 + m, in_dtype=torch.bfloat16)
    x = {k: v.to(DEV) for k, v in x.items()}
    p = {k: v.to(DEV) for k, v in p.items()}

    def fresh():
        return {k: v.clone().to(DEV) for k, v in s.items()}, torch.zeros(m, 1, 2 * H * K + H * K, 3, device=DEV), \
            torch.zeros(m, 1, H, K, K, device=DEV)

    tickets = torch.zeros(H, dtype=torch.int32, device=DEV)

    def call(st, ch, rh):
        return tk.fused_kda(x["qkv"], x["f"], x["gate"], x["b"], p["conv_weight"], st["conv"], p["a_log"],
                            p["dt_bias"], st["rec"], p["norm_weight"], 1e-6, -5.0, torch.bfloat16, ch, rh,
                            v_split=v_split, tickets=tickets)

    st_e, ch_e, rh_e = fresh()
    o_e = call(st_e, ch_e, rh_e)
    st_2, ch_2, rh_2 = fresh()
    o_2 = call(st_2, ch_2, rh_2)
    torch.cuda.synchronize()
    assert torch.equal(o_2, o_e) and torch.equal(st_2["rec"], st_e["rec"]) and torch.equal(rh_2, rh_e)
    assert torch.equal(st_2["conv"], st_e["conv"]) and torch.equal(ch_2, ch_e)
    assert not tickets.any()
    st_g, ch_g, rh_g = fresh()
    call(st_g, ch_g, rh_g)                       # compile outside the capture
    torch.cuda.synchronize()
    st_g0 = {k: v.clone() for k, v in s.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g = call(st_g, ch_g, rh_g)
    for _ in range(2):
        for k in st_g:
            st_g[k].copy_(st_g0[k].to(DEV))
        ch_g.zero_()
        rh_g.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_g, o_e)
        assert torch.equal(st_g["rec"], st_e["rec"]) and torch.equal(st_g["conv"], st_e["conv"])
        assert torch.equal(rh_g, rh_e) and torch.equal(ch_g, ch_e)
        assert not tickets.any()


@pytest.mark.parametrize("v_split", V_SPLITS)
@pytest.mark.parametrize("beta_in_kernel", [False, True])
def test_fused_kernel_verify_rows_equal_sequential_decode(tk, v_split, beta_in_kernel):
    """An M = 4 call with history (the MTP verify) equals four M = 1 calls without history (decode steps, as the
    engine makes them) on the same inputs, bit for bit: every output row, each token's history entry against the
    decode step's states, and the final states. Greedy speculative == plain decoding rests on this: the verify
    commits the states of its accepted rows, and decode continues from them. ``beta_in_kernel``: beta from ``x``
    and the b_proj weight inside the kernel (the engine's path), else from given b logits."""
    from test_triton_kda import make_inputs
    m, hid = 4, 2560
    x, p, s = make_inputs(1, m, H, K, K, seed=300 + v_split, in_dtype=torch.bfloat16)
    x = {k: v.to(DEV) for k, v in x.items()}
    p = {k: v.to(DEV) for k, v in p.items()}
    g = torch.Generator(device=DEV).manual_seed(7)
    xin = (torch.randn(1, m, hid, device=DEV, generator=g)).to(torch.bfloat16)
    wb = (torch.randn(H, hid, device=DEV, generator=g) * hid ** -0.5).to(torch.bfloat16)

    def call(t0, t1, st, ch, rh):
        sl = slice(t0, t1)
        beta = dict(x=xin[:, sl], b_weight=wb) if beta_in_kernel else {}
        return tk.fused_kda(x["qkv"][:, sl], x["f"][:, sl], x["gate"][:, sl], None if beta_in_kernel else x["b"][:, sl],
                            p["conv_weight"], st["conv"], p["a_log"], p["dt_bias"], st["rec"], p["norm_weight"], 1e-6,
                            -5.0, torch.bfloat16, ch, rh, v_split=v_split, **beta)

    def fresh(n):
        return ({k: v.clone().to(DEV) for k, v in s.items()}, torch.zeros(n, *s["conv"].shape, device=DEV),
                torch.zeros(n, *s["rec"].shape, device=DEV))

    st4, ch4, rh4 = fresh(m)
    o4 = call(0, m, st4, ch4, rh4)
    st1 = {k: v.clone().to(DEV) for k, v in s.items()}
    for t in range(m):
        o1 = call(t, t + 1, st1, None, None)
        torch.cuda.synchronize()
        assert torch.equal(o1[:, 0], o4[:, t]), f"token {t}: verify row != decode step output"
        assert torch.equal(st1["rec"], rh4[t]) and torch.equal(st1["conv"], ch4[t]), \
            f"token {t}: the verify's history entry != the decode step's state"
    assert torch.equal(st1["rec"], st4["rec"]) and torch.equal(st1["conv"], st4["conv"])


@pytest.mark.parametrize("m", [1, 4])
def test_default_launch_is_legal(tk, m):
    """The launch this GPU resolves for Ling's shape (table entry or the SM-filling default) is a legal V_SPLIT."""
    vs, nw, source = tk.resolve_launch(1, H, K, K, m, DEV)
    assert vs in tk.V_SPLITS and nw in (1, 2, 4, 8, 16) and source


def ling_layer(seed=0):
    """One KDA layer at Ling-3.0-flash's config, bf16, FP8 block projections with random E4M3 weights bound to the
    CUDA default linear backend (q|k|v|f|g fused as ``bind_model`` does); larger conv weights than the dummy
    format's so the short conv matters."""
    from bytebound.config import LING3_FLASH_CONFIG, LingConfig
    from bytebound.kernels.registry import resolve
    from bytebound.layers.kda import KimiDeltaAttention
    from bytebound.layers.linear import QLinear, fuse_rows
    from bytebound.models.bailing_moe_v3 import _lin_fmt
    cfg = LingConfig.from_file(LING3_FLASH_CONFIG)
    i = cfg.kda_layers[0]
    torch.manual_seed(seed)
    with torch.device("meta"):
        layer = KimiDeltaAttention(cfg, _lin_fmt(cfg, f"model.layers.{i}.attention"), torch.bfloat16)
    layer = layer.to_empty(device=DEV)
    with torch.no_grad():
        for name, prm in layer.named_parameters():
            if prm.dtype == torch.float8_e4m3fn:
                prm.copy_((torch.randn(prm.shape, device=DEV) * 8).to(torch.float8_e4m3fn))
            elif name.endswith("weight_scale_inv"):
                prm.fill_(2.0 ** -9)
            elif name.endswith("A_log"):
                prm.uniform_(0, 2.7)
            elif name.endswith("dt_bias"):
                prm.uniform_(-5, -2)
            elif name.endswith("norm.weight"):
                prm.uniform_(0.5, 1.5)
            elif "conv1d" in name:
                prm.normal_(0, 0.5)
            else:
                prm.normal_(0, 0.02)
    lin, _ = resolve("linear", "triton", torch.device(DEV))
    parts = [layer.q_proj, layer.k_proj, layer.v_proj, layer.f_proj, layer.g_proj]
    fused = fuse_rows(parts)
    layer.proj_fn = lin.bind(fused, torch.bfloat16) if fused is not None else None
    for mod in layer.modules():
        if isinstance(mod, QLinear) and (fused is None or all(mod is not p for p in parts)):
            mod.fn = lin.bind(mod, torch.bfloat16)
    return layer


@pytest.fixture(scope="module")
def layer():
    return ling_layer()


def _state(layer, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    st = layer.new_state(1, DEV)
    st.conv.copy_(torch.randn(st.conv.shape, generator=g, device=DEV) * 0.5)
    st.rec.copy_(torch.randn(st.rec.shape, generator=g, device=DEV) * 0.1)
    return st


@pytest.mark.parametrize("v_split", V_SPLITS)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("ref_backend", ["torch", "fla"])
def test_layer_fused_vs_reference_paths(tk, layer, m, ref_backend, v_split):
    """Layer output (after o_proj), states and every history entry: fused vs the torch reference / fla path, with
    the same projections (so the inputs of the fused part are identical bf16 values)."""
    from bytebound.kernels.registry import resolve
    from bytebound.layers.kda import torch_kda
    impl, _ = resolve("kda", ref_backend, torch.device(DEV))
    x = torch.randn(1, m, layer.q_proj.in_features, device=DEV, generator=torch.Generator(device=DEV).manual_seed(m))
    x = x.to(torch.bfloat16)
    st_ref, st = _state(layer, m), _state(layer, m)
    with torch.no_grad():
        layer.fused_fn = None
        layer.kda_fn = torch_kda if ref_backend == "torch" else impl.bind(layer, torch.bfloat16)
        st_ref.history = []
        want = layer(x, st_ref)
        layer.fused_fn = tk.FusedKDA(layer)
        layer.fused_fn.v_split = v_split
        # beta from the layer's own b_proj launch, as the reference paths compute it, so the fused kernel sees the
        # same inputs (the in-kernel b_proj sums in another order: test_layer_beta_in_kernel)
        layer.fused_fn.beta_in_kernel = False
        st.history = []
        got = layer(x, st)
        layer.fused_fn, layer.kda_fn = None, torch_kda
    # o is rounded to bf16 once in both paths (a float32 summation-order difference may flip that rounding), then
    # the same FP8 o_proj: compare relative to the output's scale
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, err
    torch.testing.assert_close(st.rec, st_ref.rec, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.conv, st_ref.conv, rtol=0, atol=0)
    assert len(st.history) == len(st_ref.history) == m
    for (c, r), (cr, rr) in zip(st.history, st_ref.history):
        torch.testing.assert_close(c, cr, rtol=0, atol=0)
        torch.testing.assert_close(r, rr, rtol=1e-4, atol=1e-5)
    st.rollback(0)
    st_ref.rollback(0)
    torch.testing.assert_close(st.rec, st_ref.rec, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_layer_beta_in_kernel(tk, layer, m):
    """beta = sigmoid(b_proj x) computed inside the fused kernel (the engine's path) against the fused kernel fed
    with b logits from a float64 b_proj rounded once to BF16: the two differ only where the kernel's float32 sum
    of 2560 products rounds to the other BF16 neighbour, so the states agree to ~1e-4 (a wrong head row, token
    or input would be O(1)), and the layer outputs within the output check of the paths test."""
    x = torch.randn(1, m, layer.q_proj.in_features, device=DEV, generator=torch.Generator(device=DEV).manual_seed(m))
    x = x.to(torch.bfloat16)
    fused = tk.FusedKDA(layer)
    assert fused.beta_in_kernel, fused.beta
    b64 = (x.double() @ layer.b_proj.weight.double().t()).to(torch.bfloat16)
    orig = layer.b_proj.forward
    outs, states = [], []
    try:
        for in_kernel in (True, False):
            st = _state(layer, m)
            st.history = []
            fused.beta_in_kernel = in_kernel
            layer.fused_fn = fused
            if not in_kernel:
                layer.b_proj.forward = lambda inp: b64          # noqa: E731 - the float64-rounded logits
            with torch.no_grad():
                outs.append(layer(x, st).float())
            states.append(torch.stack([r for _, r in st.history]))
    finally:
        layer.b_proj.forward = orig
        layer.fused_fn = None
    rel = lambda a, b: float((a - b).norm() / b.norm())       # noqa: E731
    assert rel(outs[0], outs[1]) < 1e-2
    assert rel(states[0], states[1]) < 1e-3, rel(states[0], states[1])


@pytest.mark.parametrize("v_split", V_SPLITS)
@pytest.mark.parametrize("m", [1, 4])
def test_layer_fused_graph_replay_equals_eager(tk, layer, m, v_split):
    """The whole layer (FP8 projections + fused kernel + o_proj) captured in one CUDA graph, with a history request:
    replay == eager bit for bit, states and history included."""
    from bytebound.runner.graphs import capture_graph
    x = torch.randn(1, m, layer.q_proj.in_features, device=DEV).to(torch.bfloat16)
    layer.fused_fn = tk.FusedKDA(layer)
    layer.fused_fn.v_split = v_split
    try:
        st_e = _state(layer, 7)
        with torch.no_grad():
            st_e.history = []
            want = layer(x, st_e)
        st_g = _state(layer, 7)
        st0 = (st_g.conv.clone(), st_g.rec.clone())

        def body():
            st_g.history = []
            return layer(x, st_g)

        def restore():
            st_g.conv.copy_(st0[0])
            st_g.rec.copy_(st0[1])
        graph, out = capture_graph(body, warmup=2, between=restore)
        restore()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert torch.equal(st_g.rec, st_e.rec) and torch.equal(st_g.conv, st_e.conv)
        for (c, r), (ce, re_) in zip(st_g.history, st_e.history):
            assert torch.equal(c, ce) and torch.equal(r, re_)
    finally:
        layer.fused_fn = None


# ---- the engine with kda=triton ----

NANO = __import__("pathlib").Path(__file__).resolve().parents[2] / "models" / "ling-nano"


@torch.inference_mode()
def test_full_width_decode_graph_replay_equals_eager_with_fused_kda():
    """Six layers at Ling-3.0-flash widths (4 KDA) bound with kda=triton: the captured decode step equals the eager
    one (bit for bit: the same kernels), step after step, from the same state."""
    import json
    from pathlib import Path
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LING3_FLASH_CONFIG, LingConfig
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.graphs import capture_decode
    from bytebound.runner.runner import ModelRunner
    from _replay import replay_vs_eager
    d = json.loads(Path(LING3_FLASH_CONFIG).read_text())
    d["num_hidden_layers"] = 6
    model = dummy_model(LingConfig.from_dict(d), "cuda", torch.bfloat16)
    from bytebound.runner.plan import PLAIN_SWITCHES
    plan = bind_model(model, BackendPlan.default("cuda", kda="triton", **PLAIN_SWITCHES), "cuda", "bf16")
    assert plan.resolutions["kda"].resolved == "triton" and "fused kernel" in plan.resolutions["kda"].prefill
    r = ModelRunner(model, 256)
    capture_decode(r)
    h = r.prefill(torch.randint(0, model.cfg.vocab_size, (24,), device="cuda"))   # > 8 tokens: chunk_kda
    tok = model.logits(h[-1:]).argmax(-1).view(1)
    for eager, replay in replay_vs_eager(r, tok, 3, lambda y: model.logits(y).argmax(-1).view(1)):
        err = float((replay.float() - eager.float()).norm() / eager.float().norm())
        assert torch.equal(replay, eager), f"replay differs from eager (rel err {err:.3g})"


@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
def test_nano_greedy_fused_kda_equals_fla_and_mtp_round():
    """The bundled model on the GPU: greedy with kda=triton (the CUDA default) == greedy with kda=fla, up to a
    near-tie of the fla run's logits at the first differing token; and with kda=triton the captured MTP round
    (verify through the fused M = 4 kernel, rollback from its history buffers) == plain greedy, up to a near-tie
    of the plain logits (``_parity``)."""
    from bytebound.data.gsm8k import load_split
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    from _parity import assert_same_or_near_tie
    p = SamplingParams(max_tokens=64)
    kw = dict(model=str(NANO), device="cuda")
    fla = Engine(**kw, backends={"kda": "fla"})
    fused = Engine(**kw, backends={"kda": "triton"})
    mtp = Engine(**kw, backends={"kda": "triton"}, speculative_steps=3, spec_static_round=True)
    assert fused.plan.resolutions["kda"].resolved == "triton" and fla.plan.resolutions["kda"].resolved == "fla"
    for r in load_split("test")[:5]:
        q = r["question"]
        want = fla.generate(q, p, chat=True)[0].token_ids
        a = fused.generate(q, p, chat=True)[0].token_ids
        b = mtp.generate(q, p, chat=True)[0]
        assert_same_or_near_tie(fused, q, a, b.token_ids, "captured MTP rounds vs plain greedy, kda=triton")
        if a != want:
            i = next(k for k in range(min(len(a), len(want))) if a[k] != want[k])
            ids = fla.encode_prompt(q, chat=True) + want[:i]
            fla.runner.reset()
            with torch.inference_mode():
                lg = fla.runner.logits(fla.runner.prefill(torch.tensor(ids, device="cuda"))[-1:])[0]
            top2 = lg.topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < 0.05 * float(lg.abs().max()), f"kda=triton diverged from fla at token {i}, logit gap {gap}"
