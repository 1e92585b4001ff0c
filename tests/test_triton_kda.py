"""The fused KDA decode/verify kernel (``kernels.triton_kda``): short conv + SiLU, gate, beta, L2 norms, the delta-rule
recurrence and the gated RMSNorm in one launch, against (a) a float64 derivation built from ``test_kda.kda_float64``
(Kimi Linear eq. 1, explicit matrices), (b) fla-core's naive recurrent KDA and (c) the layer's own torch path,
including the per-token (conv, recurrent) history an MTP verify rolls back to. On a CPU machine the kernel runs in
Triton's interpreter (TRITON_INTERPRET=1) when Triton is installed; CI has no Triton and skips with that reason. On
a GPU it compiles for real (tests/gpu/test_kda_gpu.py, Ling's full shape)."""

from __future__ import annotations

import copy

import pytest
import torch

from bytebound.errors import BackendError
from conftest import make_model, needs_triton, triton_module_fixture
from test_kda import FLA, kda_float64, needs_fla

pytestmark = needs_triton
tk = triton_module_fixture("tk", "bytebound.kernels.triton_kda", bf16_round_nearest=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(b, t, h, dk, dv, seed, in_dtype=torch.float32):
    """Raw projection outputs of ``t`` tokens and a non-trivial prior state (conv window, recurrent state)."""
    g = torch.Generator().manual_seed(seed)
    c = 2 * h * dk + h * dv
    x = dict(qkv=torch.randn(b, t, c, generator=g) * 1.5, f=torch.randn(b, t, h * dk, generator=g) * 2,
             gate=torch.randn(b, t, h * dv, generator=g) * 2, b=torch.randn(b, t, h, generator=g) * 2)
    x = {k: v.to(in_dtype) for k, v in x.items()}
    p = dict(conv_weight=torch.randn(c, 4, generator=g) * 0.5, a_log=torch.randn(h, generator=g) * 0.5,
             dt_bias=torch.randn(h * dk, generator=g) * 0.5, norm_weight=torch.rand(dv, generator=g) + 0.5)
    s = dict(conv=torch.randn(b, c, 3, generator=g), rec=torch.randn(b, h, dk, dv, generator=g) * 0.5)
    return x, p, s


def reference64(x, p, s, lower_bound, h, dk, dv, eps=1e-6):
    """Float64 oracle of the whole fused op: ``(o [B, T, HV], conv_after [B, C, 3], rec after each token [T, B, H, K,
    V], conv window after each token [T, B, C, 3])``. Conv: ``y_t = sum_j w_j full_{t+j}`` over ``full = [window,
    inputs]`` (F.conv1d's cross-correlation); gates as ``kda_ref.kda_gate``; recurrence via ``kda_float64``."""
    d = {k: v.double() for k, v in {**x, **p, **s}.items()}
    b, t, c = d["qkv"].shape
    full = torch.cat([d["conv"], d["qkv"].transpose(1, 2)], -1)                 # [B, C, 3 + T]
    y = torch.stack([(full[..., i:i + 4] * d["conv_weight"]).sum(-1) for i in range(t)], 1)   # [B, T, C]
    y = y * torch.sigmoid(y)
    q = y[..., :h * dk].reshape(b, t, h, dk)
    k = y[..., h * dk:2 * h * dk].reshape(b, t, h, dk)
    v = y[..., 2 * h * dk:].reshape(b, t, h, dv)
    z = (d["f"] + d["dt_bias"]).reshape(b, t, h, dk)
    rate = d["a_log"].exp()[:, None]
    gl = lower_bound * torch.sigmoid(rate * z) if lower_bound is not None else \
        -rate * torch.nn.functional.softplus(z)
    beta = torch.sigmoid(d["b"])
    o, _ = kda_float64(q, k, v, gl, beta, d["rec"])
    recs = torch.stack([kda_float64(q[:, :i + 1], k[:, :i + 1], v[:, :i + 1], gl[:, :i + 1], beta[:, :i + 1],
                                    d["rec"])[1] for i in range(t)])
    convs = torch.stack([full[..., i + 1:i + 4] for i in range(t)])
    gate = d["gate"].reshape(b, t, h, dv)
    on = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * d["norm_weight"] * torch.sigmoid(gate)
    return on.reshape(b, t, h * dv), full[..., -3:], recs, convs


def run_kernel(tk, x, p, s, lower_bound, out_dtype=torch.float32, hist=False, tokens=None, v_split=None,
               tickets=None):
    s = {k: v.clone().to(DEV) for k, v in s.items()}
    xd = {k: v.to(DEV) for k, v in x.items()}
    pd = {k: v.to(DEV) for k, v in p.items()}
    t = x["qkv"].shape[1]
    ch = rh = None
    if hist:
        n = tokens or t
        ch = torch.full((n, *s["conv"].shape), float("nan"), device=DEV)
        rh = torch.full((n, *s["rec"].shape), float("nan"), device=DEV)
    o = tk.fused_kda(xd["qkv"], xd["f"], xd["gate"], xd["b"], pd["conv_weight"], s["conv"], pd["a_log"],
                     pd["dt_bias"], s["rec"], pd["norm_weight"], 1e-6, lower_bound, out_dtype, ch, rh,
                     v_split=v_split, tickets=tickets)
    return o, s, ch, rh


def close64(got, want, tol=1e-5):
    """Max abs error relative to the reference's max magnitude (all values here are O(1))."""
    err = ((got.double().cpu() - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("h,dk", [(2, 16), (2, 32)])
def test_fused_matches_float64_with_history(tk, m, lower_bound, h, dk):
    """o, the final states and every token's history entry against the float64 oracle; the conv windows are copies
    of the (float32) inputs, so those are exact."""
    x, p, s = make_inputs(1, m, h, dk, dk, seed=m * 10 + dk + (lower_bound is None))
    o, st, ch, rh = run_kernel(tk, x, p, s, lower_bound, hist=True, tokens=m + 1, v_split=1)
    o64, conv64, recs64, convs64 = reference64(x, p, s, lower_bound, h, dk, dk)
    assert o.shape == (1, m, h * dk) and o.dtype == torch.float32
    close64(o, o64)
    close64(st["rec"], recs64[-1])
    assert torch.equal(st["conv"].cpu().double(), conv64)
    close64(rh[:m], recs64)
    assert torch.equal(ch[:m].cpu().double(), convs64)
    # entries past M are not written (the kernel touches exactly M entries)
    assert torch.isnan(ch[m:]).all() and torch.isnan(rh[m:]).all()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v_split", [2, 4, 8, 16])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_v_split_matches_float64_with_history(tk, m, v_split, lower_bound):
    """V split over 2 / 4 programs per head (the gated RMSNorm by the head's last program through the ticket): o,
    the final states and every history entry against the float64 oracle as with one program; the q/k conv windows,
    written back only by the last program after every program read them, are exact; entries past M untouched; the
    tickets are left at zero (each launch is self-contained)."""
    h, dk = 2, 16
    x, p, s = make_inputs(1, m, h, dk, dk, seed=m * 10 + v_split + (lower_bound is None))
    tickets = torch.zeros(h, dtype=torch.int32, device=DEV)
    o, st, ch, rh = run_kernel(tk, x, p, s, lower_bound, hist=True, tokens=m + 1, v_split=v_split, tickets=tickets)
    o64, conv64, recs64, convs64 = reference64(x, p, s, lower_bound, h, dk, dk)
    close64(o, o64)
    close64(st["rec"], recs64[-1])
    assert torch.equal(st["conv"].cpu().double(), conv64)
    close64(rh[:m], recs64)
    assert torch.equal(ch[:m].cpu().double(), convs64)
    assert torch.isnan(ch[m:]).all() and torch.isnan(rh[m:]).all()
    assert not tickets.any()


@pytest.mark.parametrize("v_split", [2, 4])
def test_v_split_batch2_uneven_v(tk, v_split):
    """Two batch rows, K = 16, V = 24 (BV = 32: the last slice is partly masked), M = 3, with history: every
    state column, window and o against the oracle, two calls from the same state bit-equal."""
    h, dk, dv = 2, 16, 24
    x, p, s = make_inputs(2, 3, h, dk, dv, seed=40 + v_split)
    o, st, ch, rh = run_kernel(tk, x, p, s, -5.0, hist=True, v_split=v_split)
    o64, conv64, recs64, convs64 = reference64(x, p, s, -5.0, h, dk, dv)
    close64(o, o64)
    close64(st["rec"], recs64[-1])
    close64(rh, recs64)
    assert torch.equal(st["conv"].cpu().double(), conv64)
    assert torch.equal(ch.cpu().double(), convs64)
    o2, st2, ch2, rh2 = run_kernel(tk, x, p, s, -5.0, hist=True, v_split=v_split)
    assert torch.equal(o2, o) and torch.equal(st2["rec"], st["rec"]) and torch.equal(rh2, rh)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fused_without_history_and_batch2(tk, lower_bound):
    """Two batch rows (each its own state), M = 3, no history: same as the oracle row by row."""
    x, p, s = make_inputs(2, 3, 2, 16, 16, seed=7)
    o, st, _, _ = run_kernel(tk, x, p, s, lower_bound)
    o64, conv64, recs64, _ = reference64(x, p, s, lower_bound, 2, 16, 16)
    close64(o, o64)
    close64(st["rec"], recs64[-1])
    assert torch.equal(st["conv"].cpu().double(), conv64)


@pytest.mark.parametrize("v_split", [1, 2])
def test_fused_chained_calls_continue_the_state(tk, v_split):
    """1 token, then 4, then 1: the in-place states carry over exactly as one 6-token call (float64 oracle)."""
    x, p, s = make_inputs(1, 6, 2, 16, 16, seed=3)
    o64, conv64, recs64, _ = reference64(x, p, s, -5.0, 2, 16, 16)
    st = {k: v.clone().to(DEV) for k, v in s.items()}
    outs = []
    for a, e in ((0, 1), (1, 5), (5, 6)):
        xs = {k: v[:, a:e] for k, v in x.items()}
        o, st, _, _ = run_kernel(tk, xs, p, st, -5.0, v_split=v_split)
        outs.append(o)
    close64(torch.cat(outs, 1), o64)
    close64(st["rec"], recs64[-1])
    assert torch.equal(st["conv"].cpu().double(), conv64)


@needs_fla
def test_recurrence_matches_fla_naive(tk):
    """With unit conv (w3 = 1, others 0: q, k, v = SiLU(x)) and unit norm pieces replaced by the fla oracle's own
    output normalisation, the recurrence part equals fla-core's ``naive_recurrent_kda`` (float32)."""
    h, dk, m = 2, 32, 4
    x, p, s = make_inputs(1, m, h, dk, dk, seed=11)
    p["conv_weight"] = torch.zeros_like(p["conv_weight"])
    p["conv_weight"][:, 3] = 1.0
    o, st, _, rh = run_kernel(tk, x, p, s, -5.0, hist=True)
    y = torch.nn.functional.silu(x["qkv"])
    q, k, v = (y[..., i * h * dk:(i + 1) * h * dk].reshape(1, m, h, dk) for i in range(3))
    l2 = lambda a: a * torch.rsqrt((a * a).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    g = -5.0 * torch.sigmoid(p["a_log"].exp()[:, None] * (x["f"] + p["dt_bias"]).reshape(1, m, h, dk))
    ref_o, ref_s = FLA.naive_recurrent_kda(l2(q), l2(k), v, g, torch.sigmoid(x["b"]), initial_state=s["rec"],
                                           output_final_state=True)
    ref_o = ref_o * torch.rsqrt((ref_o * ref_o).mean(-1, keepdim=True) + 1e-6) * p["norm_weight"] * \
        torch.sigmoid(x["gate"].reshape(1, m, h, dk))
    torch.testing.assert_close(o.cpu().reshape(1, m, h, dk), ref_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st["rec"].cpu(), ref_s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("v_split", [1, 4, 16])
def test_ling_head_dim_128(tk, v_split):
    """Ling's head_dim (K = V = 128) with two heads, a 4-token verify with history, bf16 projection inputs."""
    h, dk, m = 2, 128, 4
    x, p, s = make_inputs(1, m, h, dk, dk, seed=128, in_dtype=torch.bfloat16)
    o, st, ch, rh = run_kernel(tk, x, p, s, -5.0, hist=True, v_split=v_split)
    o64, conv64, recs64, convs64 = reference64(x, p, s, -5.0, h, dk, dk)
    close64(o, o64)
    close64(rh, recs64)
    assert torch.equal(ch.cpu().double(), convs64)
    assert torch.equal(st["conv"].cpu().double(), conv64)


# ---- the layer: fused op bound as layer.fused_fn vs the layer's torch path ----

def tiny_layer(dtype, safe=True):
    """A ``KimiDeltaAttention`` of ``tiny_config`` (hidden 64, 4 heads x 16) with plain weights, seeded."""
    from bytebound.config import tiny_config
    from bytebound.layers.kda import KimiDeltaAttention
    layer = KimiDeltaAttention(tiny_config(kda_safe_gate=safe), lambda name: "plain", dtype=dtype)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_((torch.randn(prm.shape, generator=g) * 0.4).to(prm.dtype))
        layer.o_norm.weight.copy_(torch.rand(layer.o_norm.weight.shape, generator=g) + 0.5)
    return layer.to(DEV)


def _bf16_close(got, want):
    """bf16 outputs of two float32 computations that round once at the end: within two bf16 steps of each other
    (float32 summation order may flip a rounding), nearly all identical."""
    g, w = got.float(), want.float()
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp(min=1e-30))) - 7)
    assert ((g - w).abs() <= 2 * ulp + 1e-6).all()
    assert (got != want).float().mean() < 0.05


@pytest.mark.parametrize("dtype,m", [(torch.float32, 4), (torch.bfloat16, 4), (torch.float32, 2),
                                     (torch.float32, 3), (torch.bfloat16, 6)])
@pytest.mark.parametrize("safe", [True, False])
def test_layer_fused_equals_torch_path_with_rollback(tk, dtype, m, safe, v_split=None):
    """Decode (M = 1) then a recorded M-token verify through ``layer.fused_fn``, against the same steps through the
    torch path (``_stepwise``): outputs, states, and each history entry (``KDAState.rollback(i)`` lands on the
    same state)."""
    layer = tiny_layer(dtype, safe)
    fused = tk.FusedKDA(layer)
    fused.v_split = v_split
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, n, layer.q_proj.in_features, generator=g).to(dtype).to(DEV) for n in (1, m)]
    st_ref = layer.new_state(1, DEV)
    with torch.no_grad():
        st_ref.rec.copy_(torch.randn(st_ref.rec.shape, generator=g).to(DEV) * 0.3)
        st_ref.conv.copy_(torch.randn(st_ref.conv.shape, generator=g).to(DEV))
    st = copy.deepcopy(st_ref)
    with torch.no_grad():
        layer.fused_fn = None
        ref1 = layer(xs[0], st_ref)
        st_ref.history = []
        ref4 = layer(xs[1], st_ref)
        layer.fused_fn = fused
        got1 = layer(xs[0], st)
        st.history = []
        got4 = layer(xs[1], st)
        layer.fused_fn = None
    for got, want in ((got1, ref1), (got4, ref4)):
        assert got.shape == want.shape and got.dtype == want.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        else:
            # o is rounded to bf16 before o_proj in both paths; the projection then sums 64 such values in bf16
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(st.rec, st_ref.rec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.conv, st_ref.conv, rtol=0, atol=0)
    assert len(st.history) == len(st_ref.history) == m
    for (c, r), (cr, rr) in zip(st.history, st_ref.history):
        torch.testing.assert_close(c, cr, rtol=0, atol=0)
        torch.testing.assert_close(r, rr, rtol=1e-5, atol=1e-5)
    st.rollback(1)
    st_ref.rollback(1)
    torch.testing.assert_close(st.rec, st_ref.rec, rtol=1e-5, atol=1e-5)
    assert st.history is None and st.hist_buf is not None


@pytest.mark.parametrize("dtype,m", [(torch.float32, 4), (torch.bfloat16, 3)])
@pytest.mark.parametrize("v_split", [2, 4])
def test_layer_split_equals_torch_path_with_rollback(tk, dtype, m, v_split):
    """As above with the V dimension split over 2 / 4 programs per head (tiny heads: 8 / 4 state columns each),
    through :class:`FusedKDA`'s shared scratch and tickets."""
    test_layer_fused_equals_torch_path_with_rollback(tk, dtype, m, True, v_split)


def test_layer_fused_o_before_projection_bf16(tk):
    """The kernel's o (before o_proj) against the torch path's ``o_norm(o, gate).to(bf16)`` at bf16: one rounding
    at the end in both, so within two bf16 steps and nearly all equal."""
    layer = tiny_layer(torch.bfloat16)
    fused = tk.FusedKDA(layer)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, 64, generator=g).to(torch.bfloat16).to(DEV)
    st_ref = layer.new_state(1, DEV)
    st = copy.deepcopy(st_ref)
    captured = []
    hook = layer.o_proj.register_forward_pre_hook(lambda mod, args: captured.append(args[0]))
    with torch.no_grad():
        layer(x, st_ref)
        layer.fused_fn = fused
        layer(x, st)
        layer.fused_fn = None
    hook.remove()
    assert captured[1].dtype == captured[0].dtype == torch.bfloat16
    _bf16_close(captured[1], captured[0])


def test_refusals_are_named_errors(tk):
    x, p, s = make_inputs(1, tk.MAX_TOKENS + 1, 2, 16, 16, seed=0)
    with pytest.raises(BackendError, match="tokens"):
        run_kernel(tk, x, p, s, -5.0)
    x, p, s = make_inputs(1, 2, 2, 16, 16, seed=0)
    with pytest.raises(BackendError, match="rec must be a contiguous float32"):
        run_kernel(tk, x, p, {**s, "rec": s["rec"].double()}, -5.0)
    with pytest.raises(BackendError, match="f must be"):
        run_kernel(tk, {**x, "f": x["f"][..., :-1]}, p, s, -5.0)
    with pytest.raises(BackendError, match="history buffers hold"):
        st = {k: v.to(DEV) for k, v in s.items()}
        tk.fused_kda(*(x[k].to(DEV) for k in ("qkv", "f", "gate", "b")), p["conv_weight"].to(DEV), st["conv"],
                     p["a_log"].to(DEV), p["dt_bias"].to(DEV), st["rec"], p["norm_weight"].to(DEV), 1e-6, -5.0,
                     torch.float32, torch.zeros(1, *st["conv"].shape, device=DEV),
                     torch.zeros(1, *st["rec"].shape, device=DEV))
    if DEV == "cuda":
        st = {k: v.to(DEV) for k, v in s.items()}
        with pytest.raises(BackendError, match="A_log not on"):
            tk.fused_kda(*(x[k].to(DEV) for k in ("qkv", "f", "gate", "b")), p["conv_weight"].to(DEV), st["conv"],
                         p["a_log"], p["dt_bias"].to(DEV), st["rec"], p["norm_weight"].to(DEV), 1e-6, -5.0,
                         torch.float32)
    for bad in (3, 32, 0):
        with pytest.raises(BackendError, match="V_SPLIT"):
            run_kernel(tk, x, p, s, -5.0, v_split=bad)
    x8, p8, s8 = make_inputs(1, 2, 2, 4, 4, seed=0)            # V = 4: at most 4 programs per head
    with pytest.raises(BackendError, match="V_SPLIT 8"):
        run_kernel(tk, x8, p8, s8, -5.0, v_split=8)
    with pytest.raises(BackendError, match="tickets must be contiguous int32"):
        run_kernel(tk, x, p, s, -5.0, v_split=2, tickets=torch.zeros(2, device=DEV))
    with pytest.raises(BackendError, match="tickets must be contiguous int32"):
        run_kernel(tk, x, p, s, -5.0, v_split=2, tickets=torch.zeros(1, dtype=torch.int32, device=DEV))
    layer = tiny_layer(torch.float32)
    layer.kernel = 3
    with pytest.raises(BackendError, match="short_conv_kernel_size"):
        tk.FusedKDA(layer)


def test_launch_table_lookup_and_default(tk):
    """The launch table: exact GPU name first, then the architecture's default GPU, else none; off CUDA the
    resolved launch is one program per head; the committed table parses and every entry is a legal V_SPLIT."""
    table = {"_arch_defaults": {"sm_90": "GPU A"}, "GPU A": {"k1": {"v_split": 4}}, "GPU B": {"k1": {"v_split": 2}}}
    assert tk.lookup_entry(table, "GPU B", "sm_90", "k1") == ({"v_split": 2}, "tuned for GPU B")
    assert tk.lookup_entry(table, "GPU C", "sm_90", "k1") == ({"v_split": 4}, "sm_90 default (tuned on GPU A)")
    assert tk.lookup_entry(table, "GPU C", "sm_80", "k1") == (None, None)
    assert tk.lookup_entry(table, "GPU A", "sm_90", "k2") == (None, None)
    assert tk.shape_key(1, 32, 128, 128, 4) == "B1_H32_K128_V128_M4"
    if DEV == "cpu":
        vs, nw, src = tk.resolve_launch(1, 32, 128, 128, 1, "cpu")
        assert (vs, nw) == (1, 8) and src.startswith("default")
    import json
    committed = json.loads(tk.CONFIG_PATH.read_text())
    for gpu, entries in committed.items():
        if gpu.startswith("_"):
            continue
        for key, e in entries.items():
            dv = int(key.split("_V")[1].split("_")[0])
            assert tk._check_v_split(e["v_split"], dv, key) == e["v_split"]
            assert e.get("num_warps", 4) in (1, 2, 4, 8, 16)


@needs_triton
def test_prefetch_alignment_rule(tk):
    """The PF path's bulk prefetches (16-byte aligned, multiples of 16 bytes) are on only where every address
    is: aligned bases, power-of-two head dims, 4-float slices, a 2-byte b_proj row of 8-element multiples."""
    def case(h=4, dk=16, dv=16, hid=64, bdtype=torch.bfloat16, rec_off=0, conv_off=0, w_off=0, b_off=0):
        c = 2 * h * dk + h * dv
        rec = torch.zeros(2 * h * dk * dv + 4)[rec_off:rec_off + 2 * h * dk * dv].view(2, h, dk, dv)
        conv = torch.zeros(2 * c * 3 + 4)[conv_off:conv_off + 2 * c * 3].view(2, c, 3)
        cw = torch.zeros(c * 4 + 4)[w_off:w_off + c * 4].view(c, 4)
        bw = torch.zeros(h * hid + 8, dtype=bdtype)[b_off:b_off + h * hid].view(h, hid)
        return rec, cw, conv, bw

    rec, cw, conv, bw = case()
    for vs in (1, 2, 4):
        assert tk.prefetch_aligned(rec, cw, conv, bw, vs) and tk.prefetch_aligned(rec, cw, conv, None, vs)
    assert not tk.prefetch_aligned(rec, cw, conv, bw, 8)                 # 2 state columns per slice: 24-byte windows
    assert not tk.prefetch_aligned(*case(rec_off=1), 1)
    assert not tk.prefetch_aligned(*case(conv_off=2), 1)
    assert not tk.prefetch_aligned(*case(w_off=3), 1)
    assert not tk.prefetch_aligned(*case(b_off=4), 1)
    assert tk.prefetch_aligned(*case(b_off=8), 1)
    assert not tk.prefetch_aligned(*case(hid=60), 1)                     # 120-byte rows
    assert tk.prefetch_aligned(*case(hid=60)[:3], None, 1)               # (no b_proj row without beta_x)
    assert not tk.prefetch_aligned(*case(bdtype=torch.float32), 1)
    assert not tk.prefetch_aligned(*case(dk=12, dv=12), 1)               # not powers of two (masked tiles)


def test_runner_verify_commit_through_fused_kernel(tk):
    """The runner's MTP protocol (``verify`` records, ``commit`` / ``commit_state`` roll back) on the tiny model
    with every KDA layer bound to the fused op, against the same calls through the torch path: prompt, a 4-token
    verify keeping 2 (a device-index commit, as in the captured round), a decode step, a 4-token verify keeping
    all 4, a decode step. Every hidden state and the final KDA states agree to float32 rounding."""
    from bytebound.layers.kda import KDAState, KimiDeltaAttention
    from bytebound.runner.runner import ModelRunner
    model = make_model().to(DEV)
    kda = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    ids = torch.randint(4, model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(0)).to(DEV)

    def run(fused):
        for m in kda:
            m.fused_fn = tk.FusedKDA(m) if fused else None
        r = ModelRunner(model, 64, DEV)
        outs = [r.forward(ids[:6]), r.verify(ids[6:10])]
        r.commit_state(torch.tensor(1, device=DEV))   # keep 2 of the 4, by a device index (the captured round's
        r.commit_length(1)                            # halves: an index into the kernel's history buffers)
        outs += [r.forward(ids[10:11]), r.verify(ids[11:15])]
        r.commit(3)                          # keep all 4
        outs.append(r.forward(ids[15:16]))
        states = [(s.conv.clone(), s.rec.clone()) for s in r.state if isinstance(s, KDAState)]
        return outs, states, r.pos

    ref, ref_st, ref_pos = run(False)
    got, got_st, got_pos = run(True)
    for m in kda:
        m.fused_fn = None
    assert got_pos == ref_pos == 14
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for (c, s), (cr, sr) in zip(got_st, ref_st):
        # the conv windows hold projection outputs, which inherit earlier layers' float32 rounding differences
        torch.testing.assert_close(c, cr, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, sr, rtol=1e-4, atol=1e-5)


def test_backend_resolution_is_named():
    """``kda=triton`` is a CUDA backend: on a CPU device a named BackendError, with ``allow_fallback`` the recorded
    substitution; on CUDA it resolves with its prefill path recorded."""
    from bytebound.kernels.registry import backends, resolve
    assert "triton" in backends("kda")
    if DEV == "cpu":
        with pytest.raises(BackendError, match="needs a CUDA device"):
            resolve("kda", "triton", torch.device("cpu"))
        impl, res = resolve("kda", "triton", torch.device("cpu"), allow_fallback=True)
        assert res.resolved == "torch" and res.fallback_from == "triton"
    else:
        impl, res = resolve("kda", "triton", torch.device("cuda"))
        assert res.resolved == "triton" and "fused kernel" in impl.prefill


def test_history_tensors_are_the_kernel_buffers(tk):
    """After a recorded fused forward, ``KDAState.history_tensors`` returns the kernel's buffers themselves (same
    memory, no stack) with the same values as the list; after a torch-path forward it stacks the clones."""
    layer = tiny_layer(torch.float32)
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(4)).to(DEV)
    st = layer.new_state(1, DEV)
    with torch.no_grad():
        layer.fused_fn = tk.FusedKDA(layer)
        st.history = []
        layer(x, st)
        conv_h, rec_h = st.history_tensors()
        assert rec_h.data_ptr() == st.hist_buf[-1][1].data_ptr() and rec_h.shape[0] == 3
        for i, (c, r) in enumerate(st.history):
            assert torch.equal(conv_h[i], c) and torch.equal(rec_h[i], r)
        layer.fused_fn = None
        st.history = []
        layer(x, st)
        conv_t, rec_t = st.history_tensors()
        assert rec_t.data_ptr() != st.hist_buf[-1][1].data_ptr()
        for i, (c, r) in enumerate(st.history):
            assert torch.equal(conv_t[i], c) and torch.equal(rec_t[i], r)


# ---- beta's b_proj inside the kernel (x and the b_proj weight instead of the b_proj output) ----

@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_fused_beta_from_x_matches_float64(tk, m, in_dtype):
    """With ``x [B, T, HID]`` and the b_proj weight ``[H, HID]`` instead of ``b``: the float64 oracle fed
    ``b = dtype(x W_b^T)`` (the torch path's b_proj output), with history. HID 96 is not a power of two (masked
    tail); the b_proj sums over HID in float32, so its rounding to bf16 may flip against the float64 dot: the bf16
    tolerance is that of one bf16 step of beta's logit."""
    h, dk, hid = 2, 16, 96
    x, p, s = make_inputs(1, m, h, dk, dk, seed=300 + m, in_dtype=in_dtype)
    g = torch.Generator().manual_seed(m)
    xin = (torch.randn(1, m, hid, generator=g)).to(in_dtype)
    wb = (torch.randn(h, hid, generator=g) * 0.2).to(in_dtype)
    x["b"] = (xin.double() @ wb.double().T).to(in_dtype)            # the b_proj output the torch path rounds to
    o64, conv64, recs64, convs64 = reference64(x, p, s, -5.0, h, dk, dk)
    st = {k: v.clone().to(DEV) for k, v in s.items()}
    ch = torch.full((m, *s["conv"].shape), float("nan"), device=DEV)
    rh = torch.full((m, *s["rec"].shape), float("nan"), device=DEV)
    xd = {k: v.to(DEV) for k, v in x.items()}
    pd = {k: v.to(DEV) for k, v in p.items()}
    o = tk.fused_kda(xd["qkv"], xd["f"], xd["gate"], None, pd["conv_weight"], st["conv"], pd["a_log"],
                     pd["dt_bias"], st["rec"], pd["norm_weight"], 1e-6, -5.0, torch.float32, ch, rh,
                     x=xin.to(DEV), b_weight=wb.to(DEV))
    tol = 1e-5 if in_dtype == torch.float32 else 2e-2
    close64(o, o64, tol)
    close64(rh, recs64, tol)
    assert torch.equal(ch.cpu().double(), convs64) and torch.equal(st["conv"].cpu().double(), conv64)
    # and equal, to float32 summation order, to the same call given that b_proj output
    o_b, st_b, _, rh_b = run_kernel(tk, x, p, s, -5.0, hist=True)
    torch.testing.assert_close(o, o_b, rtol=1e-4 if in_dtype == torch.float32 else 2e-2, atol=1e-5)
    if in_dtype == torch.float32:
        torch.testing.assert_close(rh, rh_b, rtol=1e-4, atol=1e-5)


def test_fused_beta_refusals(tk):
    x, p, s = make_inputs(1, 2, 2, 16, 16, seed=0)
    st = {k: v.to(DEV) for k, v in s.items()}
    args = lambda b: (x["qkv"].to(DEV), x["f"].to(DEV), x["gate"].to(DEV), b, p["conv_weight"].to(DEV),  # noqa: E731
                      st["conv"], p["a_log"].to(DEV), p["dt_bias"].to(DEV), st["rec"], p["norm_weight"].to(DEV),
                      1e-6, -5.0, torch.float32)
    xin, wb = torch.randn(1, 2, 32, device=DEV), torch.randn(2, 32, device=DEV)
    with pytest.raises(BackendError, match="either b"):
        tk.fused_kda(*args(x["b"].to(DEV)), x=xin, b_weight=wb)
    with pytest.raises(BackendError, match="either b"):
        tk.fused_kda(*args(None))
    with pytest.raises(BackendError, match="either b"):
        tk.fused_kda(*args(None), x=xin)
    with pytest.raises(BackendError, match=r"b_weight must be a contiguous float \[H=2, 32\]"):
        tk.fused_kda(*args(None), x=xin, b_weight=wb[:, :16])
    with pytest.raises(BackendError, match="quantised"):
        tk.fused_kda(*args(None), x=xin, b_weight=wb.to(torch.float8_e4m3fn))
    with pytest.raises(BackendError, match="x must be"):
        tk.fused_kda(*args(None), x=xin[:, :1], b_weight=wb)


def _count_calls(module):
    calls = []
    return calls, module.register_forward_pre_hook(lambda mod, args: calls.append(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_b_proj_runs_inside_the_fused_kernel(tk, dtype):
    """A plain b_proj (``modules_to_not_convert``, as Ling ships it) is never called on the fused path: beta comes from
    the kernel (``FusedKDA.beta`` says so), with the same outputs and states as the torch path (decode + a 4-token
    verify; the tolerances of test_layer_fused_equals_torch_path_with_rollback)."""
    layer = tiny_layer(dtype)
    fused = tk.FusedKDA(layer)
    assert fused.beta_in_kernel and fused.beta == "b_proj inside the fused kernel"
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(1, n, 64, generator=g).to(dtype).to(DEV) for n in (1, 4)]
    st_ref = layer.new_state(1, DEV)
    st = copy.deepcopy(st_ref)
    calls, hook = _count_calls(layer.b_proj)
    try:
        with torch.no_grad():
            want = [layer(xs[0], st_ref), layer(xs[1], st_ref)]
            assert len(calls) == 2
            layer.fused_fn = fused
            got = [layer(xs[0], st), layer(xs[1], st)]
            layer.fused_fn = None
    finally:
        hook.remove()
    assert len(calls) == 2, "the fused path called b_proj"
    for a, b in zip(got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(st.rec, st_ref.rec, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-5)


def test_layer_fp8_b_proj_keeps_its_own_launch(tk):
    """A checkpoint that stores b_proj in FP8 (not in ``modules_to_not_convert``): the fused op keeps today's path
    (``b_proj(x)`` then the kernel reads b), records why, and matches the layer's torch path."""
    from bytebound.config import tiny_config
    from bytebound.layers.kda import KimiDeltaAttention
    layer = KimiDeltaAttention(tiny_config(), lambda name: "fp8" if name == "b_proj" else "plain")
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_((torch.randn(prm.shape, generator=g) * 0.4).to(prm.dtype))
        layer.b_proj.weight_scale_inv.fill_(0.5)
        layer.o_norm.weight.copy_(torch.rand(layer.o_norm.weight.shape, generator=g) + 0.5)
    layer = layer.to(DEV)
    fused = tk.FusedKDA(layer)
    assert not fused.beta_in_kernel and "FP8" in fused.beta
    x = torch.randn(1, 3, 64, generator=g).to(DEV)
    st_ref = layer.new_state(1, DEV)
    st = copy.deepcopy(st_ref)
    calls, hook = _count_calls(layer.b_proj)
    try:
        with torch.no_grad():
            want = layer(x, st_ref)
            layer.fused_fn = fused
            got = layer(x, st)
            layer.fused_fn = None
    finally:
        hook.remove()
    assert len(calls) == 2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.rec, st_ref.rec, rtol=1e-4, atol=1e-5)


# ---- the runner's shared KDA state: one rollback launch per tensor for all layers ----

@pytest.mark.parametrize("device_index", [False, True])
def test_runner_arena_rollback_equals_per_layer(tk, device_index):
    """With the fused kernel bound to every KDA layer, the runner's state lives in one ``[L, ...]`` pair and the
    verify's history in one ``[L, T, ...]`` pair (``runner.kda_arena``); ``commit_state`` then rolls all layers back
    in one launch per tensor. It must land on exactly the states the per-layer rollback (``KDAState.rollback``) lands
    on, for every accepted count, by int and by device index, and decoding must go on identically."""
    from bytebound.layers.kda import KDAState
    from bytebound.runner.runner import ModelRunner
    model = make_model().to(DEV)
    kda_layers = [m for m in model.modules() if m.__class__.__name__ == "KimiDeltaAttention"]
    assert len(kda_layers) >= 2
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, model.cfg.vocab_size, (9,), generator=g).to(DEV)
    toks = torch.randint(4, model.cfg.vocab_size, (4,), generator=g).to(DEV)
    try:
        for layer in kda_layers:
            layer.fused_fn = tk.FusedKDA(layer)
        for n in range(4):
            runs = []
            for fast in (True, False):
                r = ModelRunner(model, 48)
                kda = [st for st in r.state if isinstance(st, KDAState)]
                assert r._arena is not None and kda[1].rec.data_ptr() == r._arena[1][1].data_ptr()
                r.prefill(prompt)
                r.verify(toks)
                assert r._arena_history()           # the kernel wrote every layer's history into the shared pair
                if not fast:
                    r._hist = None                  # force the per-layer rollback over the same buffers
                nn = torch.tensor(n, device=DEV) if device_index else n
                r.commit_state(nn)
                r.commit_length(n)
                assert all(st.history is None for st in kda)
                st = [t.clone() for s in kda for t in (s.conv, s.rec)]
                nxt = r.logits(r.forward(torch.tensor([5], device=DEV)))
                runs.append((r.pos, st, nxt, [t.clone() for s in kda for t in (s.conv, s.rec)]))
            (pa, sa, la, aa), (pb, sb, lb, ab) = runs
            assert pa == pb
            assert all(torch.equal(x, y) for x, y in zip(sa, sb)), n
            assert torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(aa, ab)), n
            # and the rollback picked token n's state: it differs from the state after every other token
            r = ModelRunner(model, 48)
            r.prefill(prompt)
            r.verify(toks)
            hr = r._hist[1]
            assert all(torch.equal(sa[2 * i + 1], hr[i, n]) for i in range(len(kda_layers)))
            assert any(not torch.equal(sa[1], hr[0, m]) for m in range(4) if m != n)
    finally:
        for layer in kda_layers:
            layer.fused_fn = None


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (5, 4, 3, 7, 11)), (torch.bfloat16, (2, 3, 4100))])
def test_select_slot_copies_the_indexed_history_slot(tk, dtype, shape):
    """The MTP rollback copy (``select_slot``): ``out[l] = src[l, n]`` with ``n`` a device tensor, exactly (a copy),
    for every slot, with element counts that are not a multiple of the kernel's block; bad layouts are named
    errors."""
    g = torch.Generator().manual_seed(3)
    src = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    for n in range(shape[1]):
        out = torch.full((shape[0], *shape[2:]), float("nan"), dtype=dtype, device=DEV)
        tk.select_slot(src, torch.tensor(n, device=DEV), out)
        assert torch.equal(out, src[:, n])
    with pytest.raises(BackendError, match="select_slot"):
        tk.select_slot(src, torch.tensor(0, device=DEV), torch.empty(1, dtype=dtype, device=DEV))
    with pytest.raises(BackendError, match="select_slot"):
        tk.select_slot(src, torch.tensor(0.0, device=DEV), torch.empty_like(src[:, 0]))
