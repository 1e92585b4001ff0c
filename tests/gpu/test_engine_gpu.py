"""Engine-level GPU checks (issue 4): CUDA-graph replay equals eager bit for bit over 64 decode steps, and
greedy tokens of the bundled trained model on the GPU equal the CPU reference (or diverge at a near-tie)."""

from pathlib import Path

import pytest
import torch

from bytebound.runner.plan import PLAIN_SWITCHES     # the registry backends alone, as bare bind_model bound them

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU: run scripts/gpu_check.sh on the device")]

NANO = Path(__file__).resolve().parents[2] / "models" / "ling-nano"


def _tiny_ckpt(tmp_path):
    from bytebound.checkpoint.synthetic import random_model
    from bytebound.checkpoint.writer import save_pretrained
    from bytebound.config import QuantConfig, tiny_config
    cfg = tiny_config(vocab_size=6144, eos_token_id=3, pad_token_id=0, hidden_size=256, intermediate_size=256,
                      moe_intermediate_size=128, moe_shared_expert_intermediate_size=128, kv_lora_rank=64)
    q = QuantConfig(method="fp8", modules_to_not_convert=("lm_head", "b_proj"), routed_experts="mxfp4")
    return save_pretrained(random_model(cfg, std=0.05), tmp_path / "tiny", quant=q, tokenizer_dir=NANO)


@pytest.mark.parametrize("moe,linear", [("torch", "torch"), ("triton", "torch"), ("triton", "triton")])
def test_graph_replay_equals_eager_64_steps(tmp_path, moe, linear):
    from bytebound.checkpoint.loader import load_model
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.graphs import capture_decode
    from bytebound.runner.runner import ModelRunner
    from _replay import greedy_logits
    path = NANO if (NANO / "config.json").exists() else _tiny_ckpt(tmp_path)
    model = load_model(path, "cuda")
    bind_model(model, BackendPlan.default("cuda", moe=moe, linear=linear, lm_head="torch", **PLAIN_SWITCHES), "cuda",
               "fp8")
    prompt = torch.randint(0, model.cfg.vocab_size, (37,), device="cuda")

    def run(graph: bool) -> list[torch.Tensor]:
        r = ModelRunner(model, 256)
        if graph:
            capture_decode(r)
        h = r.prefill(prompt)
        tok = model.logits(h[-1:]).argmax(-1)
        return greedy_logits(model, r, tok, 64)

    eager, graph = run(False), run(True)
    for i, (a, b) in enumerate(zip(eager, graph)):
        assert torch.equal(a, b), f"step {i}: graph replay differs from eager (max {float((a - b).abs().max())})"


@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
def test_nano_greedy_gpu_matches_cpu():
    from bytebound.data.gsm8k import load_split
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    q = load_split("test")[0]["question"]
    p = SamplingParams(max_tokens=64, ignore_eos=True)
    cpu = Engine(model=str(NANO), device="cpu")
    gpu = Engine(model=str(NANO), device="cuda", backends={"linear": "torch", "lm_head": "torch"})
    a = cpu.generate(q, p, chat=True)[0].token_ids
    b = gpu.generate(q, p, chat=True)[0].token_ids
    if a == b:
        return
    i = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
    # A divergence is acceptable only at a near-tie of the CPU reference's logits at that step.
    ids = cpu.encode_prompt(q, chat=True) + a[:i]
    m = cpu.model
    with torch.inference_mode():
        lg = m.logits(m(torch.tensor([ids])))[0, -1]
    top2 = lg.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < 0.05 * float(lg.abs().max()), f"GPU diverged from CPU at token {i} with a logit gap {gap:.4f}"


@pytest.fixture(scope="module")
def full_width_model():
    """Ling-3.0-flash widths (512 experts, H 2560, MLA 576 latent) with 6 layers (dense, 4 KDA+MoE, MLA+MoE)."""
    from bytebound.checkpoint.synthetic import dummy_model
    from bytebound.config import LING3_FLASH_CONFIG, LingConfig
    import json
    d = json.loads(Path(LING3_FLASH_CONFIG).read_text())
    d["num_hidden_layers"] = 6
    return dummy_model(LingConfig.from_dict(d), "cuda", torch.bfloat16)


@pytest.mark.parametrize("moe,linear,kda", [("torch", "torch", "torch"), ("torch", "torch", "fla"),
                                            ("triton", "torch", "fla"), ("torch", "triton", "fla"),
                                            ("triton", "triton", "fla"), ("humming", "triton", "fla")])
@torch.inference_mode()
def test_graph_replay_interleaved_with_eager_full_width(full_width_model, moe, linear, kda):
    """The start-up canary's pattern on one runner: eager step from a state, restore, graph replay from it.
    Bisects which backend (if any) makes the captured step differ from the eager one at the real widths."""
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.graphs import capture_decode
    from bytebound.runner.runner import ModelRunner
    from _replay import replay_vs_eager
    model = full_width_model
    bind_model(model, BackendPlan.default("cuda", moe=moe, linear=linear, kda=kda, **PLAIN_SWITCHES), "cuda", "bf16")
    r = ModelRunner(model, 256)
    capture_decode(r)
    h = r.prefill(torch.randint(0, model.cfg.vocab_size, (24,), device="cuda"))
    tok = model.logits(h[-1:]).argmax(-1).view(1)
    errs = []
    next_tok = lambda y: model.logits(y.float().to(model.dtype)).argmax(-1).view(1)         # noqa: E731
    for eager, replay in replay_vs_eager(r, tok, 3, next_tok):
        eager, replay = eager.float(), replay.float()
        errs.append(float((replay - eager).norm() / eager.norm()))
    assert max(errs) <= 1e-2, f"moe={moe} linear={linear} kda={kda}: replay vs eager rel err per step {errs}"


@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
def test_captured_mtp_round_equals_plain_greedy():
    """MTP with the whole round in one CUDA graph (speculative.round) and the same round run eagerly: greedy output
    == plain greedy on the GPU, up to a first difference at a near-tie of the plain logits
    (:func:`assert_same_or_near_tie`)."""
    from bytebound.data.gsm8k import load_split
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    from _parity import assert_same_or_near_tie
    p = SamplingParams(max_tokens=64)
    kw = dict(model=str(NANO), device="cuda")
    plain = Engine(**kw)
    eager = Engine(**kw, speculative_steps=3)
    graph = Engine(**kw, speculative_steps=3, spec_static_round=True)
    assert graph.spec_round is not None and graph.spec_round.graphs
    for r in load_split("test")[:5]:
        want = plain.generate(r["question"], p, chat=True)[0].token_ids
        a = eager.generate(r["question"], p, chat=True)[0]
        b = graph.generate(r["question"], p, chat=True)[0]
        assert_same_or_near_tie(plain, r["question"], want, b.token_ids, "captured MTP rounds vs plain greedy")
        assert_same_or_near_tie(plain, r["question"], want, a.token_ids, "eager MTP rounds vs plain greedy")
        assert b.spec["accept_length"] > 1.2
    # information only (speed is measured in benchmarks): the last prompt's TPOT per mode, trained nano model
    print(f"\nnano TPOT ms: plain {plain.generate(r['question'], p, chat=True)[0].tpot_s * 1e3:.2f}, "
          f"MTP eager {eager.generate(r['question'], p, chat=True)[0].tpot_s * 1e3:.2f}, "
          f"MTP graph round {graph.generate(r['question'], p, chat=True)[0].tpot_s * 1e3:.2f}; "
          f"accept length {b.spec['accept_length']:.2f}")


SAMPLED = [dict(temperature=0.6, top_p=0.95, top_k=29), dict(temperature=1.0),
           dict(temperature=0.3, top_k=5, top_p=0.8)]


@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
def test_captured_sampled_mtp_round_equals_eager_round():
    """Sampling requests replay the captured sampled MTP round (speculative.round; settings and uniforms in device
    buffers): with a seed, token for token the output of the same round body run eagerly (``round=eager``), on the
    trained nano model, GSM8K prompts, three settings; one round object serves them all. TPOT printed."""
    from bytebound.data.gsm8k import load_split
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    kw = dict(model=str(NANO), device="cuda")
    plain = Engine(**kw)
    eager = Engine(**kw, speculative_steps=3, backends={"round": "eager"})
    graph = Engine(**kw, speculative_steps=3)
    rnd = graph.spec_round_sampled
    assert eager.spec_round_sampled is None and rnd is not None and rnd.graphs
    assert {s["sampling"] for s in rnd.captured_shapes} == {"sampled"}
    assert {s["sampling"] for s in graph.spec_round.captured_shapes} == {"greedy"}

    def no_eager_body(*a, **k):
        raise AssertionError("the captured sampled round ran its body eagerly")
    rnd._body = no_eager_body                     # every sampled round of the graph engine must be a replay
    qs = [r["question"] for r in load_split("test")[:3]]
    accepted = rounds = 0
    for i, q in enumerate(qs):
        for s in SAMPLED:
            p = SamplingParams(max_tokens=64, ignore_eos=True, seed=100 + i, **s)
            rnd.last = None
            b = graph.generate(q, p, chat=True)[0]
            a = eager.generate(q, p, chat=True)[0]
            assert rnd.last is not None
            assert b.token_ids == a.token_ids, f"captured sampled round diverged from the eager round ({s})"
            assert b.spec == {**a.spec, "verify_s": b.spec["verify_s"]}
            accepted, rounds = accepted + b.spec["committed"], rounds + b.spec["rounds"]
    again = graph.generate(qs[0], SamplingParams(max_tokens=64, ignore_eos=True, seed=100, **SAMPLED[0]), chat=True)
    first = eager.generate(qs[0], SamplingParams(max_tokens=64, ignore_eos=True, seed=100, **SAMPLED[0]), chat=True)
    assert again[0].token_ids == first[0].token_ids                       # seeded: reproducible after other requests
    assert accepted > 1.2 * rounds, "drafts must be accepted for the acceptance tests to matter"
    # information only (speed is measured in benchmarks): TPOT of the first prompt at the first setting
    p = SamplingParams(max_tokens=64, ignore_eos=True, seed=7, **SAMPLED[0])
    t = {name: e.generate(qs[0], p, chat=True)[0] for name, e in (("plain", plain), ("eager", eager),
                                                                    ("graph", graph))}
    print(f"\nnano sampled {SAMPLED[0]} TPOT ms: plain {t['plain'].tpot_s * 1e3:.2f}, MTP eager round "
          f"{t['eager'].tpot_s * 1e3:.2f}, MTP captured round {t['graph'].tpot_s * 1e3:.2f}; accept length "
          f"{t['graph'].spec['accept_length']:.2f}")


def test_probs_device_equals_probs_on_cuda():
    """The captured sampled round's target distribution (``sampling.probs_device``, settings in device tensors)
    equals ``sampling.probs`` bit for bit on CUDA too, where dividing by the Python temperature is a multiply by
    its float32 reciprocal (the reason probs_device multiplies there)."""
    from bytebound.sampling import SamplingBuffers, SamplingParams, probs, probs_device
    g = torch.Generator(device="cuda").manual_seed(0)
    v = 157184                                                    # a full-size vocabulary: the sorts' real width
    xs = [torch.randn(4, v, device="cuda", generator=g) * 3,
          (torch.randn(4, v, device="cuda", generator=g) * 4).round() / 4]          # many ties
    b = SamplingBuffers("cuda")
    for x in xs:
        for t in (1e-7, 0.3, 0.6, 1.0, 1.7, 100.0):
            for k in (0, 1, 29, v - 1, v):
                for tp in (1.0, 0.95, 0.5, 1e-300):
                    p = SamplingParams(temperature=t, top_k=k, top_p=tp)
                    b.write(p)
                    assert torch.equal(probs_device(x, b), probs(x, p)), (t, k, tp)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_token_graphs_equal_eager_head_and_sampling(kind):
    """``runner.decode_token`` through the captured decode + next-token graphs (``DecodeGraph.replay_token``)
    gives the tokens, hidden states and generator draws of the eager step (``forward`` + ``logits`` +
    ``sampling.sample``) bit for bit, over 64 steps crossing the kv-span edges, greedy and at the seed's sampling
    (T 0.6 / top-p 0.95 / top-k 29): trained ling-nano with the engine's CUDA backends."""
    from bytebound.checkpoint.loader import load_model
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.graphs import capture_decode
    from bytebound.runner.runner import ModelRunner
    from bytebound.sampling import SamplingParams
    if not (NANO / "model.safetensors").exists():
        pytest.skip("trained ling-nano weights not present")
    model = load_model(NANO, "cuda")
    bind_model(model, BackendPlan.default("cuda"), "cuda", "fp8")
    prompt = torch.randint(0, model.cfg.vocab_size, (37,), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(5))
    p = (SamplingParams(temperature=0.0) if kind == "greedy" else
         SamplingParams(temperature=0.6, top_p=0.95, top_k=29, seed=7))

    def run(graph: bool):
        r = ModelRunner(model, 256, kv_buckets=(64, 128))
        if graph:
            capture_decode(r)
            assert {(s["kv_slots"], s["sampling"]) for s in r.graph.captured_shapes if s["op"] == "decode_token"} \
                == {(n, k) for n in (64, 128, 256) for k in ("greedy", "sampled")}
        gen = torch.Generator(device="cuda").manual_seed(7)
        with torch.inference_mode():
            tok = model.logits(r.prefill(prompt)[-1:]).argmax(-1).view(1)
            toks, hs = [], []
            for _ in range(64):
                tok, h = r.decode_token(tok, p, gen)
                toks.append(int(tok[0]))
                hs.append(h.clone())
        return toks, hs, float(torch.rand(1, generator=gen, device="cuda"))

    (te, he, ue), (tg, hg, ug) = run(False), run(True)
    assert tg == te, f"{kind}: first differing step {next(i for i, (a, b) in enumerate(zip(tg, te)) if a != b)}"
    assert all(torch.equal(a, b) for a, b in zip(he, hg)), f"{kind}: hidden states differ"
    assert ue == ug, f"{kind}: the generator advanced differently (the graphs drew other uniforms)"
    if kind == "sampled":
        assert len(set(tg)) > 8, "sampling produced a near-constant sequence: the test could not see a wrong draw"


@pytest.mark.parametrize("head", ["fp8", "fp32"])
def test_token_graphs_one_pool_across_requests_and_spans(head):
    """All token graphs (every span, greedy and sampled) sit in one memory pool (graphs.py, ``1a05551``) and,
    replayed in an order that is not the capture order - requests alternating greedy and sampled, each sampled one
    changing one setting only (the ``SamplingBuffers`` cache key ``_written``), each crossing the 64 and 128 span
    edges, every step's input the previous step's static output, as the engine's plain loop passes it - give the
    tokens and generator draws of the eager step (``forward`` + ``logits`` + ``sample``) bit for bit; with the
    FP32-logits head too (the head whose weight-sized temporary the shared pool holds once). Trained ling-nano."""
    from bytebound.checkpoint.loader import load_model
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.graphs import capture_decode
    from bytebound.runner.runner import ModelRunner
    from bytebound.sampling import SamplingParams, sample
    if not (NANO / "model.safetensors").exists():
        pytest.skip("trained ling-nano weights not present")
    model = load_model(NANO, "cuda")
    bind_model(model, BackendPlan.default("cuda"), "cuda", head)
    prompt = torch.randint(0, model.cfg.vocab_size, (37,), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(5))
    base = dict(temperature=0.9, top_p=1.0, top_k=0)
    greedy = SamplingParams(temperature=0.0)
    requests = [greedy, SamplingParams(**base), SamplingParams(**dict(base, top_k=29)), greedy,
                SamplingParams(**dict(base, top_k=29, top_p=0.5)), SamplingParams(**dict(base, top_k=29,
                                                                                         temperature=0.3)),
                SamplingParams(**base)]
    graph_r = ModelRunner(model, 256, kv_buckets=(64, 128))
    capture_decode(graph_r)
    pools = {tuple(tg.pool()) for tg, _ in graph_r.graph.token_graphs.values()}
    assert len(graph_r.graph.token_graphs) == 6 and len(pools) == 1, pools
    eager_r = ModelRunner(model, 256, kv_buckets=(64, 128))
    for i, p in enumerate(requests):
        out = {}
        for name, r in (("graph", graph_r), ("eager", eager_r)):
            r.reset()
            gen = torch.Generator(device="cuda").manual_seed(100 + i)
            with torch.inference_mode():
                tok = sample(model.logits(r.prefill(prompt)[-1:]), p, gen).view(1)
                toks = []
                for _ in range(100):                    # 37 + 100 tokens: spans 64, 128, 256
                    tok, _ = r.decode_token(tok, p, gen)
                    toks.append(int(tok[0]))
            out[name] = (toks, float(torch.rand(1, generator=gen, device="cuda")))
        (tg, ug), (te, ue) = out["graph"], out["eager"]
        first = next((j for j, (a, b) in enumerate(zip(tg, te)) if a != b), None)
        assert tg == te, f"request {i} ({p}): first differing step {first}"
        assert ug == ue, f"request {i} ({p}): the generator advanced differently"
        if p.temperature >= 0.9 and p.top_p == 1.0:
            assert len(set(tg)) > 8, f"request {i}: a near-constant sequence could hide a stale setting"


def test_graph_replay_equals_eager_across_kv_buckets():
    """One decode graph per attention span (runner.kv_buckets): replay == eager bit for bit while the sequence
    crosses span edges (37-token prompt, 64 steps, spans 64 / 128 / 256)."""
    from bytebound.checkpoint.loader import load_model
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.graphs import capture_decode
    from bytebound.runner.runner import ModelRunner
    from _replay import greedy_logits
    model = load_model(NANO, "cuda")
    bind_model(model, BackendPlan.default("cuda", **PLAIN_SWITCHES), "cuda", "fp8")
    prompt = torch.randint(0, model.cfg.vocab_size, (37,), device="cuda")

    def run(graph: bool) -> list[torch.Tensor]:
        r = ModelRunner(model, 256, kv_buckets=(64, 128))
        if graph:
            capture_decode(r)
            assert [s["kv_slots"] for s in r.graph.captured_shapes if s["op"] == "decode"] == [64, 128, 256]
        h = r.prefill(prompt)
        tok = model.logits(h[-1:]).argmax(-1)
        with torch.inference_mode():
            return greedy_logits(model, r, tok, 64)

    for i, (a, b) in enumerate(zip(run(False), run(True))):
        assert torch.equal(a, b), f"step {i}: graph replay differs from eager"


@pytest.mark.parametrize("path", ["engine_defaults", "no_fused", "fused_moe", "fused_router", "fused_norm", "fused_shared",
                                  "router_gemv", "router_fold", "kv_buckets", "mla_triton"])
@torch.inference_mode()
def test_verify_equals_sequential_decode_full_width(full_width_model, path):
    """The MTP verify forward (4 tokens, KDA states recorded) gives the logits of 4 sequential decode steps, at
    Ling-3.0-flash widths: with the engine's CUDA defaults (fused router and RMSNorm, the router GEMV + routing as
    one kernel, the shared expert inside the MoE kernels, kv buckets, the committed MoE table, whose H200 entries are the two-kernel ``split`` variant), with
    none of the fused paths, with the
    one-launch fused MoE kernel (int64 atomics) at M = 1 and 4 instead, with each fused path alone, and with the
    triton MLA decode/verify backend (``mla_triton``). ``router_fold``: the router GEMV with the triton norm, the
    one pair that folds the post-attention add+RMSNorm into the router launch, and nothing else.

    BF16, so not bit equality. The bar is the same argmax and an error no larger than the yardstick measured in
    the same test: the same 4 decode steps (same state, same tokens) with the torch MoE and torch linears, two
    correct implementations that round differently (3.07e-2 at 6 layers on the H200, docs/perf/gpu-tests-h200.md).
    The bar holds up to the first position where the two forwards route a token to different experts; from there
    on, random weights turn one swapped expert into a ~50 % change. The exceptions are the start-up canary
    ``spec_vs_plain``'s: an argmax may differ where decode's top two logits are a near-tie, and a route flip
    passes only if the router inputs there agree to the dtype's rounding (``verify.routing``), i.e. two near-equal
    expert scores met M = 1 vs M = 4 rounding."""
    from bytebound.layers.moe import RoutedExperts
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.runner import ModelRunner
    from bytebound.verify.canaries import _rtol, logit_tie_tolerance
    from bytebound.verify.routing import first_route_flip, position_routes
    model = full_width_model
    # the plan's switches per path (moe_shared None: the CUDA default, fused wherever the MoE backend can)
    fused = dict(router="gemv" if path in ("engine_defaults", "router_gemv", "router_fold") else
                 "triton" if path == "fused_router" else "torch",
                 norm="triton" if path in ("engine_defaults", "fused_norm", "router_fold") else "torch",
                 moe_shared=None if path in ("engine_defaults", "fused_shared") else "separate")
    bind_model(model, BackendPlan.default("cuda", mla="triton" if path == "mla_triton" else None, **fused), "cuda",
               "fp8")
    saved = {}
    if path == "fused_moe":      # the one-launch fused kernel (int64 fixed-point atomics) instead of 'split'
        from bytebound.kernels.moe_host import DEFAULT_CONFIG
        for m in model.modules():
            if isinstance(m, RoutedExperts):
                saved[id(m.fn)] = (m.fn, {mm: m.fn.configs.get(mm) for mm in (1, 4)})   # None: from the table
                m.fn.configs.update({1: dict(DEFAULT_CONFIG), 4: dict(DEFAULT_CONFIG)})
    buckets = (64, 128) if path in ("engine_defaults", "kv_buckets") else None
    r = ModelRunner(model, 256, kv_buckets=buckets)
    try:
        h = r.prefill(torch.randint(0, model.cfg.vocab_size, (61,), device="cuda"))   # verify crosses slot 64
        snap = r.snapshot()
        tok = model.logits(h[-1:]).argmax(-1)
        p0 = r.pos
        with position_routes(r) as dec_routes:      # decode_vs_verify, with each half's routes recorded
            toks, seq = [tok.view(1)], []
            for _ in range(4):
                lg = model.logits(r.forward(toks[-1])).float()
                seq.append(lg[0])
                toks.append(lg.argmax(-1).view(1))
        seq = torch.stack(seq)
        r.restore(snap)
        with position_routes(r) as ver_routes:
            ver = model.logits(r.verify(torch.cat(toks[:4]))).float()
        r.restore(snap)
        bind_model(model, BackendPlan.default("cuda", moe="torch", linear="torch", **fused), "cuda", "fp8")
        r.restore(snap)
        toks = [int(tok)] + seq[:3].argmax(-1).tolist()
        yard = torch.cat([model.logits(r.forward(torch.tensor([t], device="cuda"))).float() for t in toks])
        r.restore(snap)
        rel = lambda a, b: float((a - b).norm() / b.norm())                                   # noqa: E731
        errs = [rel(ver[i], seq[i]) for i in range(4)]
        bar = max(rel(yard[i], seq[i]) for i in range(4))
        same = [int(seq[i].argmax()) == int(ver[i].argmax())       # or a near-tie of decode's logits
                or float(seq[i].max() - seq[i][ver[i].argmax()]) <= logit_tie_tolerance(seq[i], model.dtype)
                for i in range(4)]
        flip = first_route_flip(dec_routes, ver_routes, range(p0, p0 + 4))
        upto = 4 if flip is None else flip["position"] - p0       # positions before the first route flip
        msg = (f"path {path}: verify vs decode rel err {errs} (yardstick {bar:.3g}), argmax equal {same}, "
               f"first route flip {flip}")
        assert all(same[:upto]) and max(errs[:upto], default=0.0) <= bar, msg
        if flip is not None:
            assert flip["input_rel_err"] <= _rtol(model.dtype), "route flip without a near-tie: " + msg
    finally:
        for fn, cfgs in saved.values():
            for mm, cfg in cfgs.items():
                if cfg is None:
                    fn.configs.pop(mm, None)
                else:
                    fn.configs[mm] = cfg
        bind_model(model, BackendPlan.default("cuda", **PLAIN_SWITCHES), "cuda", "bf16")     # shared fixture: reset


@torch.inference_mode()
def test_prefill_equals_sequential_decode_full_width(full_width_model):
    """A 40-token prefill (one forward: the grouped MoE GEMM, chunked KDA, expanded MLA, dequantised FP8 GEMMs)
    against 40 sequential decode steps (split MoE kernels, recurrent KDA, absorbed MLA, FP8 GEMVs) at
    Ling-3.0-flash widths with the engine's CUDA defaults. BF16, different algorithms, and random weights, where one
    expert swapped at a routing near-tie changes everything after it: so the test compares every MoE layer's router
    input, position by position, up to the first place where either comparison routes differently, against a
    yardstick measured in the same test (the same decode steps with the torch MoE and torch linears, two correct
    implementations that round differently). A wrong token order, a missing expert or shared expert, or a wrong
    state gives errors of order 1, far above the bound."""
    from bytebound.runner.backends import BackendPlan, bind_model
    from bytebound.runner.runner import ModelRunner
    from bytebound.verify.routing import first_route_flip, position_routes
    model = full_width_model
    fused = dict(router="gemv", norm="triton")     # the CUDA defaults (moe_shared: fused where the backend can)
    n = 40
    prompt = torch.randint(0, model.cfg.vocab_size, (n,), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(5))
    r = ModelRunner(model, 256)
    try:
        bind_model(model, BackendPlan.default("cuda", **fused), "cuda", "fp8")
        assert type(model.decoder_layers[-1].mlp.experts.fn.prefill).__name__ == "GroupedMoE"
        with position_routes(r) as pre:
            r.prefill(prompt)
        r.reset()
        with position_routes(r) as dec:
            for i in range(n):
                r.forward(prompt[i:i + 1])
        bind_model(model, BackendPlan.default("cuda", moe="torch", linear="torch", **fused), "cuda", "fp8")
        r.reset()
        with position_routes(r) as yard:
            for i in range(n):
                r.forward(prompt[i:i + 1])
    finally:
        bind_model(model, BackendPlan.default("cuda", **PLAIN_SWITCHES), "cuda", "bf16")     # shared fixture: reset
    rel = lambda a, b: float((a - b).norm() / b.norm())                   # noqa: E731
    stops = [f for f in (first_route_flip(dec, pre, range(n)), first_route_flip(dec, yard, range(n))) if f]
    pairs = []
    for q in range(n):
        for layer in sorted(dec[q]):
            pairs.append((q, layer))            # a flip's own router input is still comparable: it ends the walk
            if any((f["position"], f["layer"]) == (q, layer) for f in stops):
                break
        else:
            continue
        break
    e_pre = [rel(pre[q][lay][0], dec[q][lay][0]) for q, lay in pairs]
    e_yard = [rel(yard[q][lay][0], dec[q][lay][0]) for q, lay in pairs]
    bound = max(2 * max(e_yard), 3e-2)
    msg = (f"router inputs at {len(pairs)} (position, layer) pairs up to the first route flip {stops[:1]}: prefill vs "
           f"decode max rel err {max(e_pre):.3g} (mean {sum(e_pre) / len(e_pre):.3g}), yardstick max {max(e_yard):.3g}; "
           f"bound {bound:.3g}")
    print(msg)
    assert len(pairs) >= 2, msg
    assert max(e_pre) <= bound, msg


@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_pipelined_plain_decoding_equals_plain_on_cuda(kind):
    """``EngineConfig.pipeline_decode`` on CUDA (token graphs, the next step launched before the host reads the
    token, a pinned copy per token): the same text and token ids as the plain loop over a 5-shot GSM8K prompt,
    greedy and at the seed's sampling, to max_tokens and at the few-shot stop string. TPOT of both printed
    (information only; the measurement belongs in a benchmark)."""
    from bytebound.bench.gsm8k import gsm8k_requests
    from bytebound.data.gsm8k import FEW_SHOT_STOP
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    prompt = gsm8k_requests(1)[0]["prompt"]
    p = (SamplingParams(max_tokens=128, stop=FEW_SHOT_STOP) if kind == "greedy" else
         SamplingParams(max_tokens=128, temperature=0.6, top_p=0.95, top_k=29, seed=3, stop=FEW_SHOT_STOP))
    outs = {}
    for pipe in (False, True):
        eng = Engine(model=str(NANO), device="cuda", pipeline_decode=pipe)
        eng.generate(prompt, p)                              # warm-up: graphs, the prompt length's kernels
        outs[pipe] = eng.generate(prompt, p)[0]
        del eng
    a, b = outs[False], outs[True]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
    print(f"\nnano {kind} TPOT ms: plain {a.tpot_s * 1e3:.3f}, pipelined {b.tpot_s * 1e3:.3f} "
          f"({a.completion_tokens} tokens, {a.finish_reason})")


@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_pipelined_mtp_rounds_equal_unpipelined_on_cuda(kind):
    """Captured MTP rounds, pipelined (each round launched before the host reads the one before it; the round
    advances the device's committed length itself) and not: the same text, token ids, rounds and accept length
    over a 5-shot GSM8K prompt, greedy and at the seed's sampling (a chained round replays the graph of the span
    the unpipelined one would, so the kernels are the same). TPOT of both printed (information only)."""
    from bytebound.bench.gsm8k import gsm8k_requests
    from bytebound.data.gsm8k import FEW_SHOT_STOP
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    prompt = gsm8k_requests(1)[0]["prompt"]
    p = (SamplingParams(max_tokens=128, stop=FEW_SHOT_STOP) if kind == "greedy" else
         SamplingParams(max_tokens=128, temperature=0.6, top_p=0.95, top_k=29, seed=3, stop=FEW_SHOT_STOP))
    outs = {}
    for pipe in (False, True):
        eng = Engine(model=str(NANO), device="cuda", speculative_steps=3, pipeline_decode=pipe)
        assert eng.spec_round.graphs and eng.spec_round_sampled.graphs
        eng.generate(prompt, p)
        outs[pipe] = eng.generate(prompt, p)[0]
        del eng
    a, b = outs[False], outs[True]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
    assert (b.spec["rounds"], b.spec["committed"]) == (a.spec["rounds"], a.spec["committed"])
    assert a.spec["pipelined_rounds"] == 0 and b.spec["pipelined_rounds"] > 0
    print(f"\nnano MTP {kind} TPOT ms: rounds {a.tpot_s * 1e3:.3f}, pipelined rounds {b.tpot_s * 1e3:.3f} "
          f"({a.completion_tokens} tokens, accept length {a.spec['accept_length']:.2f})")
