"""Issue 7: start-up manifest, canaries (each broken on purpose and healthy), --strict, the accept-length
watchdog, and the seed's silent fallback reproduced (draft shares only the FP8 head's weight tensor).

Two tiny checkpoints: ``ckpt`` (random weights, the issue's recipe; drafts badly whatever the sharing) and
``mimic`` (built so that a healthy draft provably accepts): the decoder's residual stream is the token
embedding plus small layer outputs, the LM head row of ``perm[t]`` is embedding ``t``, so the target predicts
``perm[t]`` from the current token alone; the NEXTN ``eh_proj`` is ``[I | 0]`` (it passes the next token's
embedding through), so the draft predicts exactly what the target will. Head rows also carry an outlier
column (dimension 0, never excited: embeddings and every layer output are zero there) whose magnitude sets
the per-row FP8 scale, like the outlier channels of trained heads: 99.5 % of rows have amax 256, 0.5 % have
amax 4. Healthy: accept length ~4 (steps 3). Reading the FP8 values without their scales (the seed's
failure) scales the "quiet" rows up 64x relative to the others, so the draft proposes quiet rows: ~1.0.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from bytebound.checkpoint.synthetic import random_model
from bytebound.checkpoint.writer import save_pretrained
from bytebound.config import QuantConfig, tiny_config
from bytebound.engine.engine import Engine, EngineConfig
from bytebound.errors import VerificationError
from bytebound.quant import dequantize_mxfp4
from bytebound.sampling import SamplingParams
from bytebound.verify import AcceptLengthAlarm, AcceptWatchdog, build_manifest, format_manifest, run_canaries
from bytebound.verify import canaries as C

ROOT = Path(__file__).resolve().parent.parent
NANO = ROOT / "models" / "ling-nano"
QUANT = QuantConfig(method="fp8", modules_to_not_convert=("lm_head", "b_proj"), routed_experts="mxfp4")
OUT_PROJ = ("attention.o_proj.weight", "attention.dense.weight", "mlp.down_proj.weight",
            "shared_experts.down_proj.weight", "experts.w2")
PROMPT = list(range(10, 30))


def tiny_cfg():
    return tiny_config(vocab_size=6144, eos_token_id=3, pad_token_id=0)


def mimic_model(seed: int = 0, quiet: float = 0.005):
    """See the module docstring. Returns ``(model, perm)``: the target predicts ``perm[t]`` after token t."""
    cfg = tiny_cfg()
    m = random_model(cfg, std=0.08)
    g = torch.Generator().manual_seed(seed)
    v, h, n = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
    with torch.no_grad():
        emb = m.model.word_embeddings.weight
        emb.copy_(torch.randn(v, h, generator=g))
        emb[:, 0] = 0
        for name, p in m.named_parameters():
            if name.endswith(OUT_PROJ):          # small layer outputs, never touching dimension 0
                p.mul_(0.05)
                if name.endswith("experts.w2"):
                    p[:, 0, :] = 0
                else:
                    p[0] = 0
        eh = m.model.layers[n].eh_proj.weight
        eh.zero_()
        eh[:, :h] = torch.eye(h)
        perm = torch.randperm(v, generator=g)
        w = torch.empty(v, h)
        w[perm] = emb.clone()
        amax = torch.full((v,), 256.0)
        amax[torch.rand(v, generator=g) < quiet] = 4.0
        w[:, 0] = amax
        m.lm_head.weight.copy_(w)
    return m, perm


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return str(save_pretrained(random_model(tiny_cfg(), std=0.08), d, quant=QUANT, tokenizer_dir=NANO))


@pytest.fixture(scope="module")
def mimic(tmp_path_factory):
    d = tmp_path_factory.mktemp("mimic")
    m, perm = mimic_model()
    return str(save_pretrained(m, d, quant=QUANT, tokenizer_dir=NANO)), perm


def engine(model, **kw) -> Engine:
    kw.setdefault("lm_head", "fp8")
    kw.setdefault("speculative_steps", 3)
    return Engine(EngineConfig(model=model, **kw))


def one(eng, fn) -> C.CanaryResult:
    return C.run_one(fn, eng, C._Ctx(eng))


# ---- healthy start-up --------------------------------------------------------------------------------
def test_healthy_engine_passes_every_canary_and_manifest_is_json(ckpt):
    eng = engine(ckpt)
    res = run_canaries(eng, strict=True)
    assert {r.name for r in res} == {"levers_resolved", "draft_params_loaded", "draft_sharing", "expert_scale_layout",
                                     "moe_vs_reference", "logits_finite", "lm_head_path", "draft_head_bitwise",
                                     "draft_hot_rows", "graph_replay", "spec_vs_plain"}
    assert all(r.passed is not False for r in res), [r.to_dict() for r in res if r.passed is False]
    skipped = {r.name: r.message for r in res if r.passed is None}
    assert skipped == {"graph_replay": "not applicable (eager: no CUDA graph captured)",
                       "draft_hot_rows": "not applicable (full draft head: no --speculative-draft-vocab)"}
    man = json.loads(json.dumps(build_manifest(eng)))
    assert man["status"] == "healthy" and not man["failed"] and not man["problems"]
    lv = man["levers"]
    assert lv["moe"]["requested"] == lv["moe"]["resolved"] == "torch" and lv["moe"]["format"] == "mxfp4"
    assert lv["moe"]["jit_cache"].startswith("n/a") and lv["moe"]["tensors"]["w13_scale"]["shape"] == [16, 64, 2]
    assert lv["lm_head"]["resolved"] == "fp8" and lv["lm_head"]["fp8"]["scale_granularity"] == "per-output-channel"
    assert lv["mtp"]["steps"] == 3 and lv["mtp"]["draft_tokens"] == 4 and lv["mtp"]["verified"] == "pass"
    ds = lv["draft_sharing"]
    assert ds["resolved"] == "module" and ds["lm_head_same_object"] and ds["embedding_same_object"]
    assert lv["cuda_graphs"]["resolved"] == "eager" and lv["cuda_graphs"]["verified"] == "not checked"
    assert any("graph_replay" in s for s in man["not_checked"])      # honest about what was not checked
    assert man["watchdog"]["window"] == 64 and man["watchdog"]["alarm"] is False
    text = format_manifest(man)
    assert "HEALTHY" in text and "draft_sharing" in text


def test_manifest_without_canaries_is_unverified_and_mtp_off(ckpt):
    eng = engine(ckpt, lm_head="fp32", speculative_steps=0)
    man = build_manifest(eng)
    assert man["status"] == "unverified" and man["canaries"] is None and man["watchdog"] is None
    assert man["levers"]["lm_head"]["resolved"] == "fp32" and man["levers"]["mtp"]["resolved"]["on"] is False
    res = run_canaries(eng, strict=True)
    head = next(r for r in res if r.name == "lm_head_path")
    assert head.passed and head.measured["rel_err"] <= 1e-5
    assert build_manifest(eng)["status"] == "healthy"


# ---- each canary broken on purpose -------------------------------------------------------------------
def test_wrong_head_module_fails_sharing_and_bitwise_canaries(ckpt):
    eng = engine(ckpt)
    assert one(eng, C.canary_draft_sharing).passed and one(eng, C.canary_draft_head).passed
    from bytebound.kernels.torch_ref import lm_head_reference
    from bytebound.layers.lm_head import LMHead
    t = eng.model.lm_head
    wrong = LMHead(t.weight.shape[0], t.weight.shape[1], dtype=t.weight.dtype)
    with torch.no_grad():
        wrong.weight.copy_(t.weight)
    wrong.configure("bf16")                     # the draft's own head: BF16 path, target runs FP8
    wrong.fn = lambda x: lm_head_reference(wrong, x)
    eng.drafter.lm_head = wrong
    r = one(eng, C.canary_draft_sharing)
    assert r.passed is False and "not the target's LM-head module" in r.message and "'bf16'" in r.message
    b = one(eng, C.canary_draft_head)
    assert b.passed is False and "differs from the target's" in b.message and b.measured["max_abs_diff"] > 0
    # a deep copy is value-equal but not the same object: identity still refuses it
    eng.drafter.lm_head = copy.deepcopy(t)
    assert one(eng, C.canary_draft_sharing).passed is False


def test_dropped_fp8_scale_fails_head_canary(ckpt):
    eng = engine(ckpt)
    ok = one(eng, C.canary_lm_head)
    assert ok.passed and 0 < ok.measured["max_rel_err"] <= C.FP8_REL_ERR_MAX
    assert len(ok.measured["rel_err_large_norm"]) == len(C.LARGE_NORM_FACTORS)
    head = eng.model.lm_head
    keep = head.w_scale
    head.w_scale = torch.ones_like(keep)        # scales dropped: FP8 values read as if already dequantised
    r = one(eng, C.canary_lm_head)
    assert r.passed is False and "max rel err" in r.message and r.measured["max_rel_err"] > 10
    head.w_scale = None
    r = one(eng, C.canary_lm_head)
    assert r.passed is False and "scale is missing" in r.message
    head.w_scale = keep
    head.mode = "bf16"                          # fp8 requested, but the head quietly runs BF16
    lv = one(eng, C.canary_levers)
    assert lv.passed is False and "lm_head" in lv.lever and "requested 'fp8', resolved 'bf16'" in lv.message


def test_wrong_mxfp4_scale_layout_fails_layout_and_reference_canaries(ckpt):
    eng = engine(ckpt)
    assert one(eng, C.canary_expert_scale_layout).passed and one(eng, C.canary_moe_vs_reference).passed
    ex = eng.model.model.layers[1].mlp.experts
    s = ex.w13_scale.data
    # same shape and values, column-major strides: a kernel reading row-major bytes sees garbage
    ex.w13_scale = torch.nn.Parameter(s.transpose(1, 2).contiguous().transpose(1, 2), requires_grad=False)
    r = one(eng, C.canary_expert_scale_layout)
    assert r.passed is False and "model.layers.1.mlp.experts.w13_scale: strides" in r.message
    ex.w13_scale = torch.nn.Parameter(s, requires_grad=False)
    # the backend's prepared copy decoded the scales with the wrong layout ([E, K/32, N] read as [E, N, K/32])
    scr = s.transpose(1, 2).reshape(s.shape)
    ex._deq = (dequantize_mxfp4(ex.w13, scr, torch.float32), ex._deq[1])
    r = one(eng, C.canary_moe_vs_reference)
    assert r.passed is False and "differs from the dequantised reference" in r.message
    assert r.measured["max_rel_err"] > 0.1


def test_unloaded_draft_parameter_fails_loaded_canary(ckpt):
    eng = engine(ckpt)
    ok = one(eng, C.canary_draft_params_loaded)
    assert ok.passed and ok.measured["checked"] == ok.measured["draft_tensors"] > 100
    L = eng.model.cfg.num_hidden_layers
    with torch.no_grad():
        eng.model.nextn.eh_proj.weight.view(torch.uint8).zero_()        # as if the loader skipped it
    r = one(eng, C.canary_draft_params_loaded)
    assert r.passed is False and f"model.layers.{L}.eh_proj.weight: row 0 in memory differs" in r.message
    eng = engine(ckpt)
    with torch.no_grad():                                                 # one expert's up_proj rows
        eng.model.nextn.mlp.experts.w13[5, 32:].fill_(0x11)
    r = one(eng, C.canary_draft_params_loaded)
    assert r.passed is False and f"model.layers.{L}.mlp.experts.5.up_proj.weight" in r.message
    eng = engine(ckpt)
    eng.model.loaded_names = {"model.word_embeddings.weight"}             # a loader that records what it filled
    eng.model.loaded_tensors -= 1
    r = one(eng, C.canary_draft_params_loaded)
    assert r.passed is False and "not in the loader's loaded set" in r.message


class CpuGraph:
    """A CPU stand-in for ``runner.graphs.DecodeGraph``: static token/position buffers read by the 'captured'
    step; ``stale=True`` forgets to write the position before replay (the captured position stays)."""

    def __init__(self, runner, stale: bool = False):
        self.runner, self.stale = runner, stale
        self.tok = torch.zeros(1, dtype=torch.long)
        self.pos = torch.zeros(1, dtype=torch.long)
        self.captured_shapes = [{"op": "decode", "tokens": 1, "kv_slots": runner.max_len}]

    def replay(self, token, pos):
        self.tok.copy_(token.view(1))
        if not self.stale:
            self.pos.fill_(pos)
        r = self.runner
        return r.model(self.tok.view(1, 1), self.pos, r.state)[0]


class BriefGraph:
    """The ``replay_decode`` / ``eager_decode`` interface, with the same stale-position option."""

    def __init__(self, runner, stale: bool = False):
        self.inner, self.runner = CpuGraph(runner, stale), runner
        self.captured_shapes = [(1,)]

    def replay_decode(self, token):
        r = self.runner
        h = self.inner.replay(torch.tensor([token]), r.pos)
        r.pos += 1
        return r.logits(h)

    def eager_decode(self, token):
        r = self.runner
        return r.logits(r.model(torch.tensor([[token]]), torch.tensor([r.pos]), r.state)[0])


@pytest.mark.parametrize("cls", [CpuGraph, BriefGraph])
def test_stale_position_graph_fails_replay_canary(ckpt, cls):
    eng = engine(ckpt)
    assert one(eng, C.canary_graph_replay).passed is None
    eng.runner.graph = cls(eng.runner)
    ok = one(eng, C.canary_graph_replay)
    assert ok.passed and ok.measured["bit_identical"], ok.message
    man = build_manifest(eng)
    assert man["levers"]["cuda_graphs"]["resolved"] == "captured" and man["levers"]["cuda_graphs"]["captured_shapes"]
    eng.runner.graph = cls(eng.runner, stale=True)
    r = one(eng, C.canary_graph_replay)
    assert r.passed is False and "graph replay differs from eager at position" in r.message
    assert r.measured["position"] == len(C._Ctx(eng).ids)


def test_replay_canary_checks_the_token_graphs_and_leaves_the_runner(ckpt):
    """The graph_replay canary's next-token check (``_token_graphs_vs_eager``) on CPU through the stand-in token
    graphs of tests/test_runner.py (the real ``DecodeGraph.replay_token`` and ``ModelRunner.decode_token``):
    healthy graphs pass with greedy and sampled equal to the eager choice; graphs that never write the request's
    sampling settings fail it by name; and a seeded sampled request after the canary generates what it generated
    before it (runner state, settings buffers, no generator of the request's touched)."""
    from test_runner import CpuTokenGraphs
    eng = engine(ckpt, speculative_steps=0)            # the plain loop: decode_token every step
    eng.runner.graph = CpuTokenGraphs(eng.runner)
    p = SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=3, ignore_eos=True)
    before = eng.generate(PROMPT, p)[0].token_ids
    r = one(eng, C.canary_graph_replay)
    assert r.passed, r.message
    tg = r.measured["token_graphs"]
    assert set(tg) == {"greedy", "sampled"} and all(t["equal"] for t in tg.values()), tg
    assert eng.runner.pos == 0
    assert eng.generate(PROMPT, p)[0].token_ids == before

    class NeverWritten(CpuTokenGraphs):
        def replay_token(self, token, pos, p, gen):      # marks the settings written without writing them
            self._written = (float(p.temperature), float(p.top_p), int(p.top_k))
            return CpuTokenGraphs.replay_token(self, token, pos, p, gen)
    eng.runner.graph = NeverWritten(eng.runner)
    r = one(eng, C.canary_graph_replay)
    assert r.passed is False and "next-token graphs differ" in r.message, r.message
    assert r.measured["token_graphs"]["greedy"]["equal"] and not r.measured["token_graphs"]["sampled"]["equal"]


CUDA_TORCH = {k: "torch" for k in ("moe", "linear", "lm_head", "kda", "mla")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_tiny_every_canary_passes_with_real_graph(ckpt):
    eng = engine(ckpt, device="cuda", backends=CUDA_TORCH)
    res = {r.name: r for r in run_canaries(eng, strict=True)}
    assert res["graph_replay"].passed and res["graph_replay"].measured["bit_identical"]
    assert build_manifest(eng)["levers"]["cuda_graphs"]["captured_shapes"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a GPU")
def test_stale_position_cuda_graph_fails_replay_canary(ckpt):
    from bytebound.runner.graphs import DecodeGraph

    class StaleDecodeGraph(DecodeGraph):
        def replay(self, token, pos):          # forgets self.pos.fill_(pos)
            g, hidden = self.graphs[self.runner.kv_span(pos + 1)]
            self.tok.copy_(token.view(1), non_blocking=True)
            g.replay()
            return hidden
    eng = engine(ckpt, device="cuda", backends=CUDA_TORCH)
    assert eng.runner.graph is not None
    assert one(eng, C.canary_graph_replay).passed
    eng.runner.graph = StaleDecodeGraph(eng.runner)
    r = one(eng, C.canary_graph_replay)
    assert r.passed is False and "position" in r.message


def test_nonfinite_logits_fail(ckpt):
    eng = engine(ckpt)
    assert one(eng, C.canary_logits_finite).passed
    eng.model.lm_head.w_scale[7] = float("nan")
    r = one(eng, C.canary_logits_finite)
    assert r.passed is False and "non-finite logits" in r.message and r.measured["nonfinite"]["prompt"] > 0


def test_broken_rollback_fails_spec_vs_plain(ckpt):
    eng = engine(ckpt)
    assert one(eng, C.canary_spec_vs_plain).passed
    r = eng.runner
    r.commit_state = lambda n: None                                    # forgets the KDA rollback
    r = one(eng, C.canary_spec_vs_plain)
    assert r.passed is False and "diverges from plain greedy" in r.message
    # the diagnosis: verify fed the plain tokens still matches plain decode (the broken part is the rollback)
    errs = r.measured.get("verify_vs_decode_rel_err")
    assert errs is not None and max(errs) < 1e-4, r.measured


def _swap_experts_when_verifying(eng):
    """In every MoE layer, verify-sized calls (2 <= M <= 4 tokens; not the prefill) route each row to the next
    experts up (ids + 1): route flips with identical router inputs, as routing near-ties broken the other way by
    M = 4 rounding are (here in every layer, so that the output surely changes)."""
    from bytebound.layers.moe import MoE
    for moe in (layer.mlp for layer in eng.model.decoder_layers if isinstance(layer.mlp, MoE)):
        def router(x, _orig=moe.router, _n=moe.experts.n):
            ids, w = _orig(x)
            return ((ids + 1) % _n if 1 < x.shape[0] <= 4 else ids), w
        moe.router = router


def test_routing_near_tie_explains_spec_divergence(ckpt):
    """A divergence that starts where identical router inputs picked different experts passes as a routing near-tie;
    the canary names the position and layer."""
    eng = engine(ckpt)
    _swap_experts_when_verifying(eng)
    r = one(eng, C.canary_spec_vs_plain)
    assert r.measured["spec"] != r.measured["plain"], "the injected flip must change the output for this test"
    assert r.passed is True and "routing near-tie" in r.message, r.message
    flip = r.measured["route_flip"]
    assert flip["input_rel_err"] < 1e-5 and flip["experts_a"] != flip["experts_b"]   # float32: M = 1 vs 4 rounding


def test_route_flip_after_a_real_difference_fails(ckpt):
    """The same flip, but the verify path also changes the hidden state beyond rounding (one layer's attention
    output x1.5 for verify-sized calls): the divergence is not explained, the canary fails and says why."""
    eng = engine(ckpt)
    _swap_experts_when_verifying(eng)
    layer = eng.model.decoder_layers[0]
    orig = layer.attention.forward

    def attention(x, *a, **k):
        y = orig(x, *a, **k)
        return y * 1.5 if 1 < x.shape[1] <= 4 else y
    layer.attention.forward = attention
    try:
        r = one(eng, C.canary_spec_vs_plain)
    finally:
        del layer.attention.forward
    assert r.passed is False and "diverges from plain greedy" in r.message, r.message
    flip = r.measured["route_flip"]
    assert flip is not None and flip["input_rel_err"] > r.measured["route_input_tolerance"], flip
    assert "saw router inputs" in r.message


def test_first_route_flip_orders_positions_then_layers():
    from bytebound.verify.routing import first_route_flip
    x = torch.ones(4)
    a = {5: {1: (x, torch.tensor([1, 2])), 3: (x, torch.tensor([1, 2]))}, 6: {1: (x, torch.tensor([0, 1]))}}
    b = {5: {1: (x, torch.tensor([1, 2])), 3: (x * 1.01, torch.tensor([1, 3]))}, 6: {1: (x, torch.tensor([0, 2]))}}
    f = first_route_flip(a, b, range(5, 7))
    assert (f["position"], f["layer"], f["experts_b"]) == (5, 3, [1, 3]) and abs(f["input_rel_err"] - 0.01) < 1e-6
    assert first_route_flip(a, b, [6])["position"] == 6
    assert first_route_flip(a, a, range(5, 7)) is None and first_route_flip(a, b, [7]) is None


def test_unresolved_backend_lever(ckpt):
    eng = engine(ckpt, backends={"moe": "humming"}, allow_fallback=True)
    r = one(eng, C.canary_levers)
    assert r.passed is False and r.lever == "moe" and "requested 'humming', resolved 'torch'" in r.message
    with pytest.raises(VerificationError, match=r"lever\(s\) moe"):
        engine(ckpt, backends={"moe": "humming"}, allow_fallback=True, verify=True, strict=True)


def test_crashing_canary_is_a_failure_not_a_skip(ckpt):
    eng = engine(ckpt)
    eng.model.lm_head.w_fp8 = None               # fp8 head with no FP8 weight: the forward raises
    r = one(eng, C.canary_logits_finite)
    assert r.passed is False and "canary raised" in r.message


# ---- the seed's failure, refused at start-up ---------------------------------------------------------
def test_weight_only_sharing_refused_at_startup_strict(ckpt):
    with pytest.raises(VerificationError) as ei:
        engine(ckpt, draft_share="weight-only", verify=True, strict=True)
    msg = str(ei.value)
    assert "draft_sharing" in msg and "LM-head module" in msg and "aliases the target's weight tensor" in msg
    assert "'fp8'" in msg and "'bf16'" in msg        # the measured head modes


def test_weight_only_sharing_not_strict_warns_and_marks_manifest(ckpt, capsys):
    eng = engine(ckpt, draft_share="weight-only", verify=True)
    err = capsys.readouterr().err
    assert "WARNING" in err and "draft_sharing" in err and "DEGRADED" in err
    man = build_manifest(eng)
    assert man["status"] == "degraded" and man["levers"]["draft_sharing"]["verified"] == "fail"
    assert {f["canary"] for f in man["failed"]} == {"levers_resolved", "draft_sharing", "draft_head_bitwise"}


def test_weight_only_with_bf16_head_is_still_refused(ckpt):
    """Numerically harmless with a BF16 head, but not the same module: identity refuses it regardless."""
    eng = engine(ckpt, lm_head="bf16", draft_share="weight-only")
    assert one(eng, C.canary_draft_sharing).passed is False


# ---- watchdog ----------------------------------------------------------------------------------------
def test_watchdog_fires_at_window_and_recovers():
    wd = AcceptWatchdog(window=8, threshold=1.05)
    for _ in range(7):
        wd.observe(1)
    assert not wd.alarm and wd.state()["window_full"] is False
    wd.observe(1)
    assert wd.alarm and wd.first_alarm_round == 8 and wd.alarms == 1
    for _ in range(8):
        wd.observe(4)
    assert not wd.alarm and wd.state()["rolling_accept_length"] == 4.0
    st = json.loads(json.dumps(wd.state()))
    assert st["alarms"] == 1 and st["first_alarm_round"] == 8


def test_watchdog_strict_raises_and_threshold_is_inclusive():
    wd = AcceptWatchdog(window=4, threshold=1.25, strict=True)
    for c in (1, 1, 1):
        wd.observe(c)
    with pytest.raises(AcceptLengthAlarm, match="rolling accept length 1.250"):
        wd.observe(2)                         # mean exactly 1.25 -> alarm
    with pytest.raises(ValueError):
        AcceptWatchdog(window=0)


def test_mimic_checkpoint_healthy_draft_accepts(mimic):
    d, perm = mimic
    eng = engine(d, watchdog_window=16)
    out = eng.generate(PROMPT, SamplingParams(max_tokens=96, ignore_eos=True))[0]
    ids = [PROMPT[-1]] + out.token_ids
    assert all(int(perm[a]) == b for a, b in zip(ids, ids[1:]))   # the target predicts perm[t]
    assert out.spec["accept_length"] > 3.5
    assert eng.watchdog.rounds >= 16 and not eng.watchdog.alarm and eng.watchdog.alarms == 0
    assert build_manifest(eng)["watchdog"]["rolling_accept_length"] > 3.5


def test_reproduction_with_checks_off_fires_watchdog_within_window(mimic):
    d, _ = mimic
    n = 16
    eng = engine(d, draft_share="weight-only", watchdog_window=n)      # verify off: nothing at start-up
    out = eng.generate(PROMPT, SamplingParams(max_tokens=2 * n + 8, ignore_eos=True))[0]
    assert out.spec["accept_length"] < 1.05                            # the seed's accept length 1.00
    assert eng.watchdog.first_alarm_round == n                         # fired within N rounds
    man = build_manifest(eng)
    assert man["status"] == "degraded" and man["watchdog"]["alarms"] >= 1
    # strict: the request stops at round N
    eng = engine(d, draft_share="weight-only", watchdog_window=n, strict=True)
    with pytest.raises(AcceptLengthAlarm, match="draft's LM head"):
        eng.generate(PROMPT, SamplingParams(max_tokens=4 * n, ignore_eos=True))
    assert eng.watchdog.rounds == n


def test_reproduction_refused_at_startup_on_mimic(mimic):
    d, _ = mimic
    with pytest.raises(VerificationError, match="draft_sharing"):
        engine(d, draft_share="weight-only", verify=True, strict=True)
    eng = engine(d, verify=True, strict=True)        # healthy: starts, canaries record a high canary accept
    spec = next(r for r in eng.canaries if r.name == "spec_vs_plain")
    assert spec.passed and spec.measured["canary_accept_length"] > 2


@pytest.mark.skipif(not (NANO / "model.safetensors").exists() and not (NANO / "model.safetensors.index.json").exists(),
                    reason="trained ling-nano checkpoint not present")
def test_reproduction_on_trained_nano():
    eng = engine(str(NANO), draft_share="weight-only", watchdog_window=16)
    prompt = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
    eng.generate(prompt, SamplingParams(max_tokens=80, ignore_eos=True))
    good = engine(str(NANO), watchdog_window=16)
    out = good.generate(prompt, SamplingParams(max_tokens=80, ignore_eos=True))[0]
    bad = eng.spec_totals.accept_length
    assert bad < out.spec["accept_length"]
    assert eng.watchdog.alarm or bad > 1.05          # reported either way; must fire when accept collapses


# ---- CLI ---------------------------------------------------------------------------------------------
def test_cli_verify_healthy_and_reproduction(ckpt, tmp_path, capsys):
    from bytebound.cli import main
    out = tmp_path / "m.json"
    rc = main(["verify", "--model", ckpt, "--lm-head", "fp8", "--speculative-algorithm", "NEXTN", "--json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "status=HEALTHY" in cap.out and "lm_head" in cap.out
    man = json.loads(out.read_text())
    assert man["status"] == "healthy" and man["canary_seconds"] > 0
    rc = main(["verify", "--model", ckpt, "--lm-head", "fp8", "--speculative-algorithm", "NEXTN",
               "--draft-share", "weight-only"])
    cap = capsys.readouterr()
    assert rc == 1 and "DEGRADED" in cap.out
    assert "draft_sharing" in cap.err and "LM-head module" in cap.err
    rc = main(["verify", "--model", ckpt, "--lm-head", "fp8", "--speculative-algorithm", "NEXTN",
               "--draft-share", "weight-only", "--strict"])
    cap = capsys.readouterr()
    assert rc == 2 and "refusing to start" in cap.err and "draft_sharing" in cap.err


def test_cli_no_canaries_watch_tokens_fires_watchdog(mimic, capsys):
    from bytebound.cli import main
    d, _ = mimic
    rc = main(["verify", "--model", d, "--lm-head", "fp8", "--speculative-algorithm", "NEXTN", "--no-canaries",
               "--draft-share", "weight-only", "--watchdog-window", "8", "--watch-tokens", "24"])
    cap = capsys.readouterr()
    assert rc == 1 and "alarm=True" in cap.out and "watchdog ALARM" in cap.err


@pytest.mark.skipif(not (NANO / "model.safetensors").exists() and not (NANO / "model.safetensors.index.json").exists(),
                    reason="trained ling-nano checkpoint not present")
def test_cli_verify_bundled_nano(capsys):
    from bytebound.cli import main
    assert main(["verify", "--model", str(NANO), "--lm-head", "fp8", "--speculative-algorithm", "NEXTN"]) == 0
    rc = main(["verify", "--model", str(NANO), "--lm-head", "fp8", "--speculative-algorithm", "NEXTN",
               "--draft-share", "weight-only"])
    assert rc != 0 and "draft_sharing" in capsys.readouterr().err


def test_canary_timings_recorded(ckpt):
    eng = engine(ckpt)
    res = run_canaries(eng)
    assert all(r.seconds >= 0 for r in res)
    assert math.isclose(build_manifest(eng)["canary_seconds"], sum(round(r.seconds, 5) for r in res), abs_tol=1e-3)


# ---- start-up cost at full scale (H200; run with BYTEBOUND_FULLSCALE=1) ------------------------------
def _write_nextn_checkpoint(model, cfg_file: Path, out: Path) -> Path:
    """A checkpoint dir holding only the NEXTN layer's tensors (all that draft_params_loaded reads)."""
    from safetensors.torch import save_file
    from bytebound.checkpoint.layout import expected_tensors
    cfg = model.cfg
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    params = dict(model.named_parameters())
    tensors = {}
    for s in expected_tensors(cfg):
        if not s.name.startswith(prefix):
            continue
        p = params[s.target]
        t = p if s.expert is None else p[s.expert, s.rows[0]:s.rows[1]]
        if s.kind == "mxfp4":
            t = t.view(torch.int8)
        tensors[s.name] = t.detach().contiguous().cpu()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "nextn.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "nextn.safetensors"
                                                                                   for k in tensors}}))
    (out / "config.json").write_text(cfg_file.read_text())
    return out


@pytest.mark.skipif(not (torch.cuda.is_available() and os.environ.get("BYTEBOUND_FULLSCALE")),
                    reason="full-scale canary timing: set BYTEBOUND_FULLSCALE=1 on a GPU with ~100 GB free")
def test_full_scale_canary_cost(tmp_path):
    from bytebound.config import LING3_FLASH_CONFIG
    cfg_file = Path(LING3_FLASH_CONFIG)
    layers = os.environ.get("BYTEBOUND_FULLSCALE_LAYERS")        # fewer decoder layers, full widths (quick run)
    if layers:
        d = json.loads(cfg_file.read_text())
        d["num_hidden_layers"] = int(layers)
        cfg_file = tmp_path / "config.json"
        cfg_file.write_text(json.dumps(d))
    t0 = time.perf_counter()
    # BYTEBOUND_FULLSCALE_ENGINE: JSON EngineConfig overrides, e.g. {"fused_router": true} (gpu_check "bisect")
    eng = Engine(EngineConfig(model=str(cfg_file), load_format="dummy", device="cuda", lm_head="fp8",
                              speculative_steps=3, backends=json.loads(os.environ.get("BYTEBOUND_FULLSCALE_BACKENDS",
                                                                                      "{}")),
                              **json.loads(os.environ.get("BYTEBOUND_FULLSCALE_ENGINE", "{}"))))
    torch.cuda.synchronize()
    report = {"load_s": time.perf_counter() - t0, "backends": {k: v.resolved for k, v in
                                                                eng.plan.resolutions.items()}, "device": torch.cuda.get_device_name(), "runs": [],
              "num_hidden_layers": eng.model.cfg.num_hidden_layers}
    for _ in range(2):
        t = time.perf_counter()
        res = run_canaries(eng)
        report["runs"].append({"total_s": time.perf_counter() - t,
                               "canaries": {r.name: [r.status, round(r.seconds, 4)] for r in res},
                               "failed": {r.name: r.message for r in res if r.passed is False}})
    t = time.perf_counter()
    d = _write_nextn_checkpoint(eng.model, cfg_file, tmp_path / "nextn")
    report["write_nextn_s"] = time.perf_counter() - t
    eng.config.model, eng.config.load_format = str(d), "auto"
    r = one(eng, C.canary_draft_params_loaded)
    report["draft_params_loaded"] = [r.status, round(r.seconds, 4), r.measured.get("checked"), r.message[:200]]
    report["manifest"] = build_manifest(eng)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if os.environ.get("BYTEBOUND_TIMING_OUT"):
        Path(os.environ["BYTEBOUND_TIMING_OUT"]).write_text(text)
    assert r.passed
    assert not report["runs"][-1]["failed"], report["runs"][-1]["failed"]


@pytest.mark.parametrize("args, flag", [
    (["--watchdog-window", "0"], "--watchdog-window"),
    (["--watchdog-window", "-3"], "--watchdog-window"),
    (["--watchdog-threshold", "nan"], "--watchdog-threshold"),
    (["--watchdog-threshold", "-1"], "--watchdog-threshold"),
    (["--watch-tokens", "-1"], "--watch-tokens"),
    (["--watch-tokens", "5000"], "--watch-tokens"),          # more than --max-model-len 4096 holds
])
def test_cli_bad_watchdog_flags_rejected_before_the_engine(ckpt, monkeypatch, capsys, args, flag):
    from bytebound.cli import main
    import bytebound.engine.engine as engine_mod

    def no_engine(*a, **kw):
        raise AssertionError("the engine was started before the flags were checked")
    monkeypatch.setattr(engine_mod, "Engine", no_engine)
    rc = main(["verify", "--model", ckpt, "--speculative-algorithm", "NEXTN", "--no-canaries", *args])
    err = capsys.readouterr().err
    assert rc == 2 and "ConfigError" in err and flag in err, err


def test_cli_watch_tokens_without_mtp_rejected_before_the_engine(ckpt, monkeypatch, capsys):
    """--watch-tokens without --speculative-algorithm NEXTN: no drafter, so no accept length to watch. It used to
    be skipped silently (exit 0); now a named ConfigError before the model loads, exit 2."""
    from bytebound.cli import main
    import bytebound.engine.engine as engine_mod

    def no_engine(*a, **kw):
        raise AssertionError("the engine was started before the flags were checked")
    monkeypatch.setattr(engine_mod, "Engine", no_engine)
    rc = main(["verify", "--model", ckpt, "--no-canaries", "--watch-tokens", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and "ConfigError" in err and "--watch-tokens needs MTP" in err \
        and "--speculative-algorithm NEXTN" in err, err


def test_cli_refused_watch_run_exits_2(ckpt, tmp_path, capsys):
    """--watch-tokens that passes the flag check but does not fit with the prompt: the engine's RequestError is
    printed and the exit status says so (it used to be 0); the manifest JSON is still written."""
    from bytebound.cli import main
    out = tmp_path / "m.json"
    rc = main(["verify", "--model", ckpt, "--speculative-algorithm", "NEXTN", "--no-canaries", "--max-model-len", "64",
               "--watch-tokens", "60", "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "RequestError" in err and "--watch-tokens 60" in err, err
    assert json.loads(out.read_text())["status"]


def test_moe_canary_checks_a_fused_shared_expert(ckpt):
    """With the shared expert run inside the routed kernels (``MoEKernel.bind_shared``; here a CPU stand-in that
    claims it), ``moe_vs_reference`` compares against routed + shared: a backend that includes it passes, one that
    claims it but leaves it out fails (the layer would then drop the shared expert silently)."""
    from bytebound.kernels.torch_ref import moe_reference, shared_expert_reference
    from bytebound.layers.moe import RoutedExperts
    eng = engine(ckpt)
    mods = [m for m in eng.model.modules() if isinstance(m, RoutedExperts)]
    parents = {id(m.experts): m for m in eng.model.modules() if hasattr(m, "experts") and hasattr(m, "shared_experts")}

    class Claims:
        def __init__(self, ex, add):
            self.ex, self.add, self.mlp = ex, add, parents[id(ex)].shared_experts

        def __call__(self, x, ids, w):
            y = moe_reference(self.ex, x, ids, w)
            return y + shared_expert_reference(self.mlp, x).to(y.dtype) if self.add else y

        def shared_for(self, m, k):
            return True

    saved = [m.fn for m in mods]
    try:
        for add in (True, False):
            for m in mods:
                m.fn = Claims(m, add)
            r = one(eng, C.canary_moe_vs_reference)
            assert r.passed is add, r.message
    finally:
        for m, f in zip(mods, saved):
            m.fn = f


def test_replay_plain_logits_gives_generates_next_token(ckpt):
    """replay_plain_logits (the parity checks' plain logits at a mismatch) replays what generate ran: after the
    prompt and the first k greedy tokens its argmax is greedy token k, for every k; the runner is left reset."""
    from bytebound.sampling import SamplingParams
    eng = engine(ckpt, speculative_steps=0)
    want = eng.generate("Janet's ducks", SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    ids = eng.encode_prompt("Janet's ducks")
    for k in range(len(want)):
        lg = C.replay_plain_logits(eng, ids, want[:k])
        assert lg.dtype == torch.float32 and lg.shape == (eng.model.cfg.vocab_size,)
        assert int(lg.argmax()) == want[k], k
    assert eng.runner.pos == 0
