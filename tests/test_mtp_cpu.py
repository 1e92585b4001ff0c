"""MTP (NEXTN) speculative decoding on CPU: greedy speculative output == plain greedy output token for token, and
the verify -> commit rollback leaves exactly the state of the committed tokens (KDA conv + recurrent states,
MLA cache slots [0, pos)), also when the committed length lands on a KDA chunk boundary."""

from __future__ import annotations

import random

import pytest
import torch

from bytebound.engine.engine import Engine
from bytebound.layers.kda import KDAState
from bytebound.runner.runner import ModelRunner
from bytebound.sampling import SamplingParams

STEPS = 3
MAX_NEW = 40
G = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)      # greedy; no EOS so every run has MAX_NEW tokens


def prompts(vocab: int) -> list[list[int]]:
    r = random.Random(0)
    return [[r.randrange(4, vocab) for _ in range(n)] for n in (1, 5, 17, 62, 63, 64, 65, 130)]


@pytest.fixture(scope="module")
def engines(quant_ckpt):
    plain = Engine(model=str(quant_ckpt), max_model_len=256)
    spec = Engine(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS)
    return plain, spec


@pytest.fixture(scope="module")
def reference(engines):
    plain, _ = engines
    return {tuple(p): plain.generate(p, G)[0].token_ids for p in prompts(plain.model.cfg.vocab_size)}


def test_greedy_speculative_equals_plain(engines, reference):
    _, spec = engines
    for p, want in reference.items():
        out = spec.generate(list(p), G)[0]
        assert len(want) == MAX_NEW
        assert out.token_ids == want, f"prompt of {len(p)} tokens diverged"
        s = out.spec
        assert s["rounds"] >= 1 and s["committed"] == MAX_NEW - 1   # all but the prefill's token came from rounds
        assert s["rounds"] <= MAX_NEW - 1


class OracleDrafter:
    """Wraps the real drafter (its NEXTN forward still runs and updates the NEXTN cache) but proposes the true
    greedy continuation, corrupted on a seeded schedule, so every accepted count j = 0..steps occurs. Aware of the
    round's padded draft-extend: the row the drafts continue from sits at ``runner.pos - 1``."""

    def __init__(self, runner, real, sequence: list[int], vocab: int, p_wrong: float, seed: int):
        self.runner, self.real, self.steps, self.seq, self.vocab = runner, real, real.steps, sequence, vocab
        self.rng = random.Random(seed)
        self.p_wrong = p_wrong
        self.q = None

    def hidden(self, ids, prev_hidden, positions, state, kv_len=None):
        # the NEXTN at position q (token q+1) predicts the token at q + 2; the extend's selected row is at pos - 1
        self.q = self.runner.pos - 1 if positions.numel() > 1 else int(positions[-1])
        return self.real.hidden(ids, prev_hidden, positions, state, kv_len)

    def logits(self, hidden):
        i = self.q + 2
        tok = self.seq[i] if i < len(self.seq) else 4
        if self.rng.random() < self.p_wrong:
            tok = 4 + (tok + 1) % (self.vocab - 4)
        out = torch.full((1, self.vocab), -1e4)
        out[0, tok] = 0.0
        return out

    def propose(self, hidden):
        return self.logits(hidden).argmax(-1)


@pytest.mark.parametrize("p_wrong", [0.0, 0.25])
def test_accepted_drafts_commit_correctly(engines, reference, p_wrong):
    """With drafts that are often right, rounds accept 0..3 drafts; the output must still equal plain greedy."""
    _, spec = engines
    real = spec.drafter
    vocab = spec.model.cfg.vocab_size
    last_position_accepts = 0
    try:
        for n, (p, want) in enumerate(reference.items()):
            spec.drafter = OracleDrafter(spec.runner, real, list(p) + want, vocab, p_wrong, seed=n)
            out = spec.generate(list(p), G)[0]
            assert out.token_ids == want, f"prompt of {len(p)} tokens diverged"
            acc = out.spec["per_position_accept"]
            if p_wrong == 0.0:
                # every draft is accepted (the tokens are the target's own greedy choices)
                assert acc == [1.0] * STEPS and out.spec["accept_length"] > 3.0
            else:
                assert out.spec["accept_length"] > 1.5
            last_position_accepts += acc[STEPS - 1] > 0
    finally:
        spec.drafter = real
    assert last_position_accepts > 0                   # rounds accepting all 3 drafts happened


def test_accept_counts_cover_all_j(engines, reference):
    """Direct count of the accepted prefix length per round with the 25% corrupted oracle."""
    _, spec = engines
    real = spec.drafter
    vocab = spec.model.cfg.vocab_size
    counts = [0] * (STEPS + 1)
    orig_commit = spec.runner.commit_length

    def commit_length(n):
        counts[n] += 1
        return orig_commit(n)
    spec.runner.commit_length = commit_length
    try:
        for n, (p, want) in enumerate(reference.items()):
            spec.drafter = OracleDrafter(spec.runner, real, list(p) + want, vocab, 0.25, seed=100 + n)
            assert spec.generate(list(p), G)[0].token_ids == want
    finally:
        spec.drafter = real
        del spec.runner.commit_length
    assert all(c > 0 for c in counts), counts


# ---- rollback exactness at the runner level ----------------------------------------------------------------
def states(runner: ModelRunner):
    """Per decoder layer: (conv, rec) of KDA layers, kv[:, :pos] of MLA layers (the NEXTN slot excluded)."""
    out = []
    for st in runner.state[: runner.model.cfg.num_hidden_layers]:
        if isinstance(st, KDAState):
            out.append(("conv", st.conv.clone()))
            out.append(("rec", st.rec.clone()))
        else:
            out.append(("kv", st.kv[:, :runner.pos].clone()))
    return out


def verify_commit(model, prompt, toks, j):
    r = ModelRunner(model, 160)
    r.prefill(prompt)
    r.verify(toks)
    r.commit(j)
    return r


def sequential(model, prompt, toks, j):
    r = ModelRunner(model, 160)
    r.prefill(prompt)
    for t in toks[: j + 1]:
        r.forward(t.view(1))
    return r


@pytest.fixture(scope="module")
def bound_model(engines):
    return engines[0].model            # loaded from the quantised checkpoint, torch backends bound


CASES = [(j, plen) for j in range(STEPS + 1) for plen in ("short", "boundary", "boundary+1")]


def prompt_len(j, kind):
    # committed length after the round = prompt + j + 1: 64 ("boundary") / 65 lands on / past a KDA chunk edge
    return {"short": 12, "boundary": 63 - j, "boundary+1": 64 - j}[kind]


@pytest.mark.parametrize("j, kind", CASES)
def test_rollback_independent_of_rejected_tokens(bound_model, j, kind):
    """Bit-exact: after committing tokens 0..j of 4 verified ones, the state does not depend on the 3-j rejected ones
    (same shapes, so the same arithmetic: any difference would be state leaking from rejected drafts)."""
    g = torch.Generator().manual_seed(j * 7 + len(kind))
    n = prompt_len(j, kind)
    prompt = torch.randint(4, 128, (n,), generator=g)
    toks = torch.randint(4, 128, (STEPS + 1,), generator=g)
    other = toks.clone()
    other[j + 1:] = (other[j + 1:] + 17) % 124 + 4                   # different rejected tail
    a, b = verify_commit(bound_model, prompt, toks, j), verify_commit(bound_model, prompt, other, j)
    assert a.pos == b.pos == n + j + 1
    for (kind_a, x), (_, y) in zip(states(a), states(b)):
        assert torch.equal(x, y), kind_a
    assert all(st.history is None for st in a.state if isinstance(st, KDAState))
    # and continuing from both gives identical logits
    nxt = torch.tensor([5])
    assert torch.equal(a.logits(a.forward(nxt)), b.logits(b.forward(nxt)))


@pytest.mark.parametrize("j, kind", CASES)
def test_rollback_matches_sequential_decode(bound_model, j, kind):
    """verify(4) + commit(j) vs j+1 single-token decode steps. Not bit-exact on CPU: the 4-row verify and the
    1-row decode run the same projections as GEMMs of different shapes (different BLAS accumulation order), so
    states differ at the float32 rounding level (~1e-6); see test_rollback_exact_with_row_wise_linear."""
    g = torch.Generator().manual_seed(100 + j * 7 + len(kind))
    n = prompt_len(j, kind)
    prompt = torch.randint(4, 128, (n,), generator=g)
    toks = torch.randint(4, 128, (STEPS + 1,), generator=g)
    a, b = verify_commit(bound_model, prompt, toks, j), sequential(bound_model, prompt, toks, j)
    assert a.pos == b.pos == n + j + 1
    for (name, x), (_, y) in zip(states(a), states(b)):
        assert x.shape == y.shape
        assert (x - y).abs().max() <= 1e-5 * max(1.0, y.abs().max().item()), name
    # the rolled-back states are those after token j, not after the last verified token
    c = sequential(bound_model, prompt, toks, STEPS) if j < STEPS else None
    if c is not None:
        far = max((x - y).abs().max().item() for (_, x), (_, y) in zip(states(a)[:2], states(c)[:2]))
        assert far > 1e-3
    # continuing decode from both: same next-token logits to float32 rounding, same greedy continuation
    ta, tb = [], []
    la = a.logits(a.forward(torch.tensor([7])))
    lb = b.logits(b.forward(torch.tensor([7])))
    assert ((la - lb).abs().max() / lb.abs().max()) < 1e-5
    for _ in range(6):
        ta.append(int(la.argmax()))
        tb.append(int(lb.argmax()))
        la = a.logits(a.forward(torch.tensor([ta[-1]])))
        lb = b.logits(b.forward(torch.tensor([tb[-1]])))
    assert ta == tb


ROW_WISE_TOL = 1e-6          # relative to the state's largest entry: a few float32 ulps


@pytest.mark.parametrize("j", range(STEPS + 1))
def test_rollback_exact_with_row_wise_linear(bound_model, row_wise, j):
    """With every linear computed one row at a time (so verify and decode do identical float arithmetic in the
    projections), the first KDA layer's conv + recurrent state and the first MLA layer's cache after
    verify + commit(j) equal those of j+1 decode steps to float32 rounding, and every other committed length
    (-1..3 steps, the off-by-one rollbacks included) is at least 1e3 times further away - checked here, so a
    rollback to the wrong boundary cannot pass. Not bit-equality: the elementwise kernels (sigmoid, exp)
    vectorise a 4-token verify differently from a 1-token decode on some CPUs (AVX2: the 1-token tensors fall
    in the scalar tail), about 1 ulp; bit-exactness of the mechanism itself, where shapes match, is
    test_rollback_independent_of_rejected_tokens. (``row_wise``: the conftest fixture.)"""
    g = torch.Generator().manual_seed(200 + j)
    prompt = torch.randint(4, 128, (63 - j,), generator=g)
    toks = torch.randint(4, 128, (STEPS + 1,), generator=g)
    a = verify_commit(bound_model, prompt, toks, j)
    seq = {k: states(sequential(bound_model, prompt, toks, k)) for k in range(-1, STEPS + 1)}  # k+1 steps

    def rel(x, y):
        return ((x - y).abs().max() / y.abs().max()).item()
    sa = states(a)
    assert a.pos == len(prompt) + j + 1
    assert [n for n, _ in sa[:3]] == ["conv", "rec", "kv"]           # layer 0 KDA, layer 1 MLA
    for (name, x), (_, y) in zip(sa[:3], seq[j][:3]):
        assert x.shape == y.shape
        assert rel(x, y) <= ROW_WISE_TOL, name
    for k, other in seq.items():                                     # the wrong boundaries are far away
        if k != j:
            assert max(rel(x, y) for (_, x), (_, y) in zip(sa[:2], other[:2])) > 1e3 * ROW_WISE_TOL, k


def test_runner_refuses_overflow(bound_model):
    r = ModelRunner(bound_model, 8)
    r.prefill(torch.arange(4, 10))
    with pytest.raises(ValueError, match="exceeds the cache"):
        r.verify(torch.tensor([4, 5, 6]))
