"""ModelRunner attention spans: the CUDA path attends over a static number of cache slots masked by position
(graph-capturable, no host sync); with ``kv_buckets`` the span is the smallest bucket holding the sequence.
Every span must give the logits of the sliced (exact-length) CPU path."""

from __future__ import annotations

import pytest
import torch

from bytebound.runner.runner import ModelRunner, pow2_buckets
from conftest import make_model


def test_span_past_the_cache_is_a_named_error():
    r = ModelRunner(make_model(), 300, "cpu", kv_buckets=(64,))
    with pytest.raises(ValueError, match="exceeds the cache"):
        r.kv_span(301)


def test_pow2_buckets_and_span_choice():
    assert pow2_buckets(4096) == (1024, 2048, 4096)
    assert pow2_buckets(5000) == (1024, 2048, 4096, 5000)
    assert pow2_buckets(512) == (512,)
    model = make_model()
    r = ModelRunner(model, 300, "cpu", kv_buckets=(64, 128, 1000))
    assert r.kv_buckets == (64, 128, 300)                     # spans past max_len are dropped; max_len is kept
    assert [r.kv_span(n) for n in (1, 64, 65, 128, 129, 300)] == [64, 64, 128, 128, 300, 300]


@torch.inference_mode()
def test_static_spans_match_sliced_attention_across_bucket_edges():
    model = make_model()
    prompt = torch.randint(4, model.cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(0))

    spans = set()

    def run(static: bool, buckets):
        r = ModelRunner(model, 200, "cpu", kv_buckets=buckets)
        r.static_kv = static
        span = r.kv_span
        r.kv_span = lambda end: spans.add(span(end)) or span(end)
        h = r.prefill(prompt)
        tok = model.logits(h[-1:]).argmax(-1)
        out = []
        for _ in range(40):                                  # 50 + 40 tokens: crosses the 64 edge
            lg = model.logits(r.forward(tok.view(1)))
            out.append(lg)
            tok = lg.argmax(-1)
        return torch.cat(out)

    sliced = run(False, None)
    one_span = run(True, None)                               # all 200 slots every step (the CUDA default)
    spans.clear()
    buckets = run(True, (64, 128))                           # 64 slots, then 128 after the 64th token
    assert spans == {64, 128}
    torch.testing.assert_close(one_span, sliced, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buckets, sliced, rtol=1e-5, atol=1e-5)


def test_fused_kda_projections_equal_separate_ones(quant_ckpt, tmp_path):
    """bind_model fuses each KDA layer's q|k|v|f|g FP8 projections into one (linear.fuse_rows): outputs equal the
    five separate projections, no memory is added (the parts become row views), and the state dict, hence a
    re-written checkpoint, is unchanged."""
    from bytebound.checkpoint.loader import load_model
    from bytebound.checkpoint.writer import save_pretrained
    from bytebound.layers.kda import KimiDeltaAttention
    from bytebound.runner.backends import BackendPlan, bind_model
    model = load_model(quant_ckpt, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bind_model(model, BackendPlan.default("cpu"), "cpu")
    kdas = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    assert kdas and all(m.proj_fn is not None for m in kdas)
    # the parts are not bound on their own (no second dequantised copy of their weights)
    assert all(p.fn is None and p.backend.endswith("(fused)") for m in kdas
               for p in (m.q_proj, m.k_proj, m.v_proj, m.f_proj, m.g_proj))
    m0 = kdas[0]
    assert m0.q_proj.weight.data_ptr() + m0.q_proj.weight.numel() * m0.q_proj.weight.element_size() \
        == m0.k_proj.weight.data_ptr()                                          # rows of one tensor
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    ids = torch.randint(4, model.cfg.vocab_size, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        fused = model(ids)
        for m in kdas:
            m.proj_fn = None
        separate = model(ids)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)
    out = save_pretrained(model, tmp_path / "again", quant=model.cfg.quant, float_dtype=torch.float32)
    again = load_model(out, "cpu")
    assert all(torch.equal(again.state_dict()[k], before[k]) for k in before)


@torch.inference_mode()
def test_decode_vs_verify_agree_and_leave_the_state():
    """``verify.canaries.decode_vs_verify`` (the GPU test and scripts/verify_vs_decode.py use it): on the CPU
    float32 path a 4-token verify gives the logits of 4 decode steps, and the runner's state is restored."""
    from bytebound.verify.canaries import decode_vs_verify
    model = make_model()
    r = ModelRunner(model, 200, "cpu")
    h = r.prefill(torch.randint(4, model.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(1)))
    tok = model.logits(h[-1:]).argmax(-1)
    pos, rec = r.pos, [s.rec.clone() for s in r.state if hasattr(s, "rec")]
    seq, ver = decode_vs_verify(r, tok, 4)
    assert seq.shape == ver.shape == (4, model.cfg.vocab_size)
    assert torch.equal(seq.argmax(-1), ver.argmax(-1))
    torch.testing.assert_close(ver, seq, rtol=1e-4, atol=1e-4)
    assert r.pos == pos
    assert all(torch.equal(a, s.rec) for a, s in zip(rec, [s for s in r.state if hasattr(s, "rec")]))
    assert int(seq[0].argmax()) == int(model.logits(r.forward(tok.view(1))).argmax())   # first step == a fresh step


def test_parse_overrides():
    """The scripts' ``--backends op=name,...``: parsed into a dict; a malformed item or unknown op is named."""
    import pytest
    from bytebound.errors import ConfigError
    from bytebound.runner.backends import parse_overrides
    assert parse_overrides("moe=torch,linear=triton") == {"moe": "torch", "linear": "triton"}
    assert parse_overrides("") == {}
    assert parse_overrides("moe=torch,router=torch,kv=exact") == {"moe": "torch", "router": "torch", "kv": "exact"}
    for bad in ("moe", "moe=", "moe=torch,foo=bar"):
        with pytest.raises(ConfigError, match="expected ENTRY=NAME"):
            parse_overrides(bad)
