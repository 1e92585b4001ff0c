"""Hot-vocabulary draft head (issue 21, ``bytebound.speculative.hot_vocab``): the rows are the target head's rows,
the hot logits are the full head's columns (against a float64 reference), drafts come only from the hot set,
greedy speculative == plain greedy with the hot head on and off (eager and static rounds, bundled model, GSM8K
prompts), the ``draft_hot_rows`` canary passes and fails on tampered rows or scales, and bad input is a named
error. The lossless-sampling chi-square test with a hot draft is in test_spec_sampling.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bytebound.errors import ConfigError
from bytebound.layers.lm_head import LMHead
from bytebound.quant import quantize_fp8_token
from bytebound.speculative import hot_vocab as hv
from bytebound.speculative.hot_vocab import HotHead

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "models" / "ling-nano"
needs_nano = pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano not present")


def small_head(mode: str, v: int = 96, h: int = 32, dtype=torch.float32) -> LMHead:
    g = torch.Generator().manual_seed(3)
    head = LMHead(v, h, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g) * 0.2)
    head.configure(mode)
    return head


def reference_hot_logits(head: LMHead, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float64 logits of the rows ``ids`` from the head's stored values (fp8: E4M3 values x per-channel scale,
    with the per-token activation quantisation the FP8 path applies)."""
    if head.mode == "fp8":
        xq, sx = quantize_fp8_token(x)
        w = head.w_fp8.double()[ids] * head.w_scale.double()[ids, None]
        return (xq.double() * sx.double()[:, None]) @ w.t()
    w = head.weight.detach().double()[ids]
    xd = x.double() if head.mode == "fp32" else x.to(head.weight.dtype).double()
    return xd @ w.t()


@pytest.mark.parametrize("mode", ["bf16", "fp32", "fp8"])
def test_rows_are_the_heads_rows_and_logits_its_columns(mode):
    head = small_head(mode)
    ids = [90, 3, 17, 0, 42, 5]
    hot = HotHead(head, ids)
    assert hot.head is head and hot.mode == mode and hot.ids.tolist() == sorted(ids)
    if mode == "fp8":
        assert torch.equal(hot.w_fp8.view(torch.uint8), head.w_fp8[hot.ids].view(torch.uint8))
        assert torch.equal(hot.w_scale, head.w_scale[hot.ids]) and hot.weight is None
    else:
        assert torch.equal(hot.weight, head.weight.detach()[hot.ids]) and hot.w_fp8 is None
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    got = hot.logits(x)
    ref = reference_hot_logits(head, hot.ids, x)
    assert got.dtype == torch.float32 and got.shape == (5, len(ids))
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    full = head(x)
    assert (got - full[:, hot.ids]).abs().max() <= 1e-5 * full.abs().max()
    # drafts: vocabulary ids of the hot argmax
    assert hot.propose(x).tolist() == hot.ids[ref.argmax(-1)].tolist()
    assert hot.bytes_per_call() * head.weight.shape[0] == head.bytes_per_call() * len(ids)


def test_follows_a_reconfigured_head():
    head = small_head("bf16")
    hot = HotHead(head, [1, 2, 3])
    head.configure("fp8")
    x = torch.randn(2, 32)
    assert torch.allclose(hot.logits(x), head(x)[:, hot.ids], rtol=0, atol=1e-5)
    assert hot.mode == "fp8" and hot.w_scale is not None


@pytest.mark.parametrize("ids, match", [([], "empty"), ([1, 1, 2], "duplicate"), ([0, 96], "outside"),
                                        ([-1, 4], "outside")])
def test_bad_ids_are_named_errors(ids, match):
    with pytest.raises(ConfigError, match=match):
        HotHead(small_head("bf16"), ids)


def test_resolve_draft_vocab(tmp_path):
    assert hv.resolve_draft_vocab(None, NANO, 6144) is None
    assert hv.resolve_draft_vocab(0, NANO, 6144) is None
    assert hv.resolve_draft_vocab("0", NANO, 6144) is None
    ids, prov = hv.resolve_draft_vocab(512, NANO, 6144)
    assert len(ids) == 512 == len(set(ids)) and prov["top_n"] == 512 and 0.5 < prov["coverage"] < 1
    rec = json.loads((NANO / hv.RANKING_FILE).read_text())
    assert ids == rec["ranking"][:512]
    ids99, prov99 = hv.resolve_draft_vocab("0.99", NANO, 6144)
    assert len(ids99) % hv.ALIGN == 0 and prov99["coverage"] == 0.99
    c = torch.tensor(rec["counts"], dtype=torch.float64)
    share = c[:len(ids99)].sum() / c.sum()
    assert share >= 0.99 and c[:len(ids99) - hv.ALIGN].sum() / c.sum() < 0.99    # the smallest aligned N
    f = tmp_path / "ids.json"
    f.write_text(json.dumps({"ids": [5, 9, 7], "source": "hand-picked"}))
    ids_f, prov_f = hv.resolve_draft_vocab(str(f), NANO, 6144)
    assert ids_f == [5, 9, 7] and prov_f["source"] == "hand-picked" and prov_f["file"] == str(f)
    t = tmp_path / "ids.txt"
    t.write_text("3, 4\n5")
    assert hv.resolve_draft_vocab(str(t), NANO, 6144)[0] == [3, 4, 5]


@pytest.mark.parametrize("spec, match", [(6145, "N must be"), (-3, "N must be"), (1.5, "coverage"),
                                         ("nonexistent.json", "cannot read")])
def test_resolve_draft_vocab_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        hv.resolve_draft_vocab(spec, NANO, 6144)


def test_bad_id_file_and_stale_ranking(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"ids": [1, "x"]}))
    with pytest.raises(ConfigError, match="list of integers"):
        hv.resolve_draft_vocab(str(f), NANO, 6144)
    # a ranking counted with another tokenizer is refused, not silently used
    d = tmp_path / "m"
    d.mkdir()
    (d / "tokenizer.json").write_text("{}")
    (d / hv.RANKING_FILE).write_text((NANO / hv.RANKING_FILE).read_text())
    with pytest.raises(ConfigError, match="another tokenizer"):
        hv.resolve_draft_vocab(64, d, 6144)
    with pytest.raises(ConfigError, match="format"):
        hv.resolve_draft_vocab(64, d, 1000)


def test_committed_ranking_provenance():
    """The committed ranking names the files it was counted from, and they are the ones in the tree."""
    rec = json.loads((NANO / hv.RANKING_FILE).read_text())
    prov = rec["provenance"]
    assert rec["format"] == hv.FORMAT and rec["vocab_size"] == 6144
    assert prov["corpus_sha256"] == hv._sha256(ROOT / prov["corpus"])
    assert prov["tokenizer_sha256"] == hv._sha256(NANO / "tokenizer.json")
    assert len(rec["ranking"]) == len(set(rec["ranking"])) == len(rec["counts"]) == prov["distinct_tokens_seen"]
    assert all(a >= b for a, b in zip(rec["counts"], rec["counts"][1:])) and rec["counts"][-1] > 0
    assert sum(rec["counts"]) == prov["tokens_counted"]


def test_count_tokens_against_an_independent_count(monkeypatch):
    """``count_tokens`` on a three-example corpus vs counting the completion tokens by hand."""
    from bytebound.data.gsm8k import chat_messages
    from bytebound.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(NANO)
    pairs = [("What is 2 + 3?", "2 + 3 = 5\n#### 5"), ("Tom has 4 apples and eats 1. How many are left?",
                                                        "4 - 1 = 3\n#### 3"), ("Q?", "#### 0")]
    monkeypatch.setattr(hv, "gsm8k_completion_texts", lambda: pairs)
    counts, info = hv.count_tokens(tok, 6144)
    want = torch.zeros(6144, dtype=torch.long)
    for q, a in pairs:
        for prompt, full in ((tok.apply_chat_template(chat_messages(q)),
                              tok.apply_chat_template(chat_messages(q, a), add_generation_prompt=False)),
                             (f"Question: {q}\nAnswer:", f"Question: {q}\nAnswer: {a}")):
            p, f = tok.encode(prompt), tok.encode(full)
            assert f[:len(p)] == p
            for t in f[len(p):]:
                want[t] += 1
    assert torch.equal(counts, want) and info["tokens_counted"] == int(want.sum())
    assert counts[tok.eos_token_id] >= 3           # each chat completion ends with EOS
    assert hv.ranking_from_counts(counts)[:3] == sorted(range(6144), key=lambda i: (-int(want[i]), i))[:3]


# ---- engine: greedy parity, drafts from the hot set, canary ------------------------------------------------
@pytest.fixture(scope="module")
def questions():
    from bytebound.data.gsm8k import load_split
    return [r["question"] for r in load_split("test")[:4]]


GREEDY_TOKENS = 40


@needs_nano
@pytest.mark.parametrize("head", ["bf16", "fp8"])
def test_greedy_parity_with_hot_head_on_and_off(questions, head):
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    p = SamplingParams(max_tokens=GREEDY_TOKENS)
    plain = Engine(lm_head=head)
    engines = {"full": Engine(lm_head=head, speculative_steps=3),
               "hot": Engine(lm_head=head, speculative_steps=3, draft_vocab=256),
               "hot-static": Engine(lm_head=head, speculative_steps=3, draft_vocab=256, spec_static_round=True)}
    assert engines["full"].drafter.hot is None and engines["hot"].drafter.hot.n == 256
    drafted = []
    for e in (engines["hot"], engines["hot-static"]):
        real = e.drafter.propose

        def spy(hidden, real=real):
            t = real(hidden)
            drafted.append(t.clone())
            return t
        e.drafter.propose = spy
    accept = {k: [] for k in engines}
    for q in questions:
        want = plain.generate(q, p, chat=True)[0].token_ids
        for name, e in engines.items():
            out = e.generate(q, p, chat=True)[0]
            assert out.token_ids == want, f"{name} ({head} head) diverged from plain greedy"
            accept[name].append(out.spec["accept_length"])
    hot_ids = set(engines["hot"].drafter.hot.ids.tolist())
    got = torch.cat(drafted).tolist()
    assert got and set(got) <= hot_ids, "a draft outside the hot set"
    # the eager and the static round make the same drafts, so the same rounds
    assert accept["hot"] == accept["hot-static"]
    assert min(accept["hot"]) > 1.0


@needs_nano
def test_hot_head_is_a_named_error_without_mtp():
    from bytebound.engine.engine import Engine
    with pytest.raises(ConfigError, match="needs MTP"):
        Engine(draft_vocab=256)


@needs_nano
@pytest.mark.parametrize("head", ["bf16", "fp8"])
def test_hot_rows_canary_passes_and_fails_on_tampering(head):
    from bytebound.engine.engine import Engine
    from bytebound.verify.canaries import _Ctx, canary_draft_hot_rows, canary_draft_sharing, canary_draft_head
    e = Engine(lm_head=head, speculative_steps=3, draft_vocab=0.99)
    ctx = _Ctx(e)
    res = canary_draft_hot_rows(e, ctx)
    assert res.passed is True, res.message
    assert res.measured["n"] == e.drafter.hot.n and res.measured["logit_rel_err"] <= 1e-5
    assert canary_draft_sharing(e, ctx).passed is True          # the draft still holds the whole head module
    assert canary_draft_head(e, ctx).passed is True
    hot = e.drafter.hot
    tensors = ({"w_fp8": hot.w_fp8, "w_scale": hot.w_scale} if head == "fp8" else {"weight": hot.weight})
    for name, t in tensors.items():
        saved = t.clone()
        row = t.shape[0] // 2
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8)[row, 0] ^= 1                    # one bit of one FP8 weight
        else:
            t[row] = t[row] * 2 if t.dim() == 1 else t[row] + 1e-3
        bad = canary_draft_hot_rows(e, ctx)
        assert bad.passed is False and f"{name} rows differ" in bad.message, (name, bad.message)
        t.copy_(saved)
    assert canary_draft_hot_rows(e, ctx).passed is True
    # a head that is not the target's module (an equal copy) is refused too
    import copy
    real = hot.head
    hot.head = copy.deepcopy(real)
    try:
        bad = canary_draft_hot_rows(e, ctx)
        assert bad.passed is False and "not derived from the target's LM-head module" in bad.message
    finally:
        hot.head = real


@needs_nano
def test_hot_rows_canary_not_applicable_without_hot_head():
    from bytebound.engine.engine import Engine
    from bytebound.verify.canaries import _Ctx, canary_draft_hot_rows
    e = Engine(speculative_steps=3)
    r = canary_draft_hot_rows(e, _Ctx(e))
    assert r.passed is None and "full draft head" in r.message


@needs_nano
def test_manifest_records_the_hot_head():
    from bytebound.engine.engine import Engine
    from bytebound.verify import build_manifest, run_canaries
    e = Engine(lm_head="fp8", speculative_steps=3, draft_vocab=1024)
    run_canaries(e, strict=True, warn=False)
    man = build_manifest(e)
    dv = man["levers"]["mtp"]["draft_vocab"]
    assert dv["n"] == 1024 and dv["head_mode"] == "fp8" and dv["provenance"]["top_n"] == 1024
    assert dv["bytes_per_draft_step"] == 1024 * 256 + 4 * 1024
    assert man["levers"]["draft_sharing"]["verified"] == "pass"
    plain = Engine(speculative_steps=3)
    run_canaries(plain, strict=True, warn=False)
    m2 = build_manifest(plain)
    assert m2["levers"]["mtp"]["draft_vocab"] is None and m2["levers"]["draft_sharing"]["verified"] == "pass"


def test_cli_flag_reaches_the_engine_config():
    import argparse
    from bytebound.cli import add_engine_args, engine_config
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    cfg = engine_config(ap.parse_args(["--speculative-algorithm", "NEXTN", "--speculative-draft-vocab", "0.99"]))
    assert cfg.draft_vocab == "0.99" and cfg.speculative_steps == 3
    with pytest.raises(ConfigError, match="needs --speculative-algorithm NEXTN"):
        engine_config(ap.parse_args(["--speculative-draft-vocab", "512"]))


def test_round_body_with_hot_head_has_no_host_sync(quant_ckpt, monkeypatch):
    """The static round with a hot head (as captured on CUDA) reads no device data on the host: its body runs on
    the ``meta`` device, where any such read raises (as test_mtp_static's check of the full-head round)."""
    import bytebound.kernels.torch_ref as torch_ref
    from bytebound.engine.engine import Engine
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.runner import ModelRunner
    from bytebound.sampling import SamplingParams
    from bytebound.speculative.mtp import MTPDrafter
    from bytebound.speculative.round import StaticRound
    monkeypatch.setattr(torch_ref, "MATERIALIZE_MAX_BYTES", 0)
    model = Engine(model=str(quant_ckpt), max_model_len=128).model.to("meta")
    bind_model(model, BackendPlan.default("cpu"), torch.device("meta"), "fp8")
    for mod in model.modules():
        if hasattr(mod, "_absorbed"):
            mod.prepare(model.dtype)
    runner = ModelRunner(model, 128, "meta")
    runner.static_kv = True
    hot = HotHead(model.lm_head, list(range(0, model.cfg.vocab_size, 3)))
    assert hot.w_fp8.device.type == "meta"
    rnd = StaticRound(runner, MTPDrafter(model, 3, hot=hot), SamplingParams())
    with torch.inference_mode():
        rnd._body(rnd.span())
    assert rnd.out.device.type == "meta"


@needs_nano
def test_sampled_requests_run_with_the_hot_head(questions):
    """Sampling with the hot head goes through the same acceptance (the chi-square test proves it lossless):
    seeded runs reproduce, every emitted id is in the vocabulary, and rounds accept drafts."""
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    e = Engine(speculative_steps=3, draft_vocab=512)
    p = SamplingParams(max_tokens=24, temperature=0.6, top_p=0.95, top_k=29, seed=11, ignore_eos=True)
    a = e.generate(questions[0], p, chat=True)[0]
    b = e.generate(questions[0], p, chat=True)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    assert all(0 <= t < e.model.cfg.vocab_size for t in a.token_ids)
    assert a.spec["accept_length"] > 1.0
