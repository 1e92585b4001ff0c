"""Lossless speculative sampling: MTP chain acceptance reproduces the target's (T, top-k, top-p) distribution.

A Markov-chain target (logits of token t+1 depend on token t) and a deliberately wrong deterministic draft run
through the real ``accept_chain`` round after round; the first two emitted tokens must follow
p(t1 | y) p(t2 | t1) exactly. Chi-square goodness of fit against the exact target probabilities (p > 0.01),
at 10^5 draws (issue 6).
"""

import torch

from bytebound.sampling import SamplingParams, probs
from bytebound.speculative.accept import accept_chain

V, STEPS, N = 40, 3, 100_000


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value, cells with expected < 5 merged into one."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep].double(), exp[keep].double()
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def first_two_tokens(table: torch.Tensor, draft, p: SamplingParams, y: int, gen: torch.Generator):
    """``N`` speculative decodes from token ``y`` through the real ``accept_chain``, each until two tokens are
    emitted: rounds of ``STEPS`` chain drafts ``draft(cur, i)`` (the ``i``-th draft after token ``cur``), verified
    against the Markov target ``table`` (``[V, V]`` logits of the next token given this one). Returns the counts
    of the first and of the second emitted token (``[V]`` int64 each) and the number of accepted drafts."""
    first = torch.zeros(V, dtype=torch.long)
    second = torch.zeros(V, dtype=torch.long)
    accepted = 0
    for _ in range(N):
        out, last = [], y
        while len(out) < 2:
            drafts, cur = [], last
            for _ in range(STEPS):                               # chain drafting, each draft after the previous
                cur = draft(cur, len(drafts))
                drafts.append(cur)
            j, bonus = accept_chain(table[[last] + drafts], drafts, p, gen)
            accepted += j
            out += drafts[:j] + [bonus]
            last = out[-1]
        first[out[0]] += 1
        second[out[1]] += 1
    return first, second, accepted


def assert_follow_target(first: torch.Tensor, second: torch.Tensor, target: torch.Tensor, y: int) -> None:
    """The counts of :func:`first_two_tokens` fit p(t1 | y) and p(t2 | y) = sum_t1 p(t1 | y) p(t2 | t1) (chi-square
    p > 0.01 each), and the first token's total variation distance from p(t1 | y) is below 0.02."""
    exp1 = target[y] * N
    exp2 = (target[y][:, None] * target).sum(0) * N             # marginal of t2 = sum_t1 p(t1|y) p(t2|t1)
    p1, p2 = chi2_pvalue(first, exp1), chi2_pvalue(second, exp2)
    assert p1 > 0.01, p1
    assert p2 > 0.01, p2
    tv1 = 0.5 * (first.double() / N - target[y].double()).abs().sum()
    assert tv1 < 0.02, tv1


def test_chain_acceptance_is_lossless():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 2.5                 # target logits of the next token given this one
    wrong = torch.randn(V, V, generator=g) * 2.5                 # draft: argmax of an unrelated table
    p = SamplingParams(temperature=0.6, top_p=0.95, top_k=29)
    target = probs(table, p)                                     # [V, V] exact next-token distributions
    y = 7
    gen = torch.Generator().manual_seed(1)
    first, second, accepted = first_two_tokens(
        table, lambda cur, i: int(wrong[cur].argmax()) if i % 2 == 0 else int(table[cur].argmax()), p, y, gen)
    assert accepted > 0.05 * N, "the test must exercise both acceptance and rejection"
    assert_follow_target(first, second, target, y)


def test_greedy_acceptance_longest_prefix_and_bonus():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 5, 1, 8]):
        logits[i, t] = 5.0
    p = SamplingParams()
    assert accept_chain(logits, [3, 5, 1], p, None) == (3, 8)
    assert accept_chain(logits, [3, 4, 1], p, None) == (1, 5)
    assert accept_chain(logits, [0, 5, 1], p, None) == (0, 3)


def test_biased_sampler_would_fail():
    """The statistic has power: a sampler that always accepts the draft is rejected."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 2.5
    p = SamplingParams(temperature=0.6, top_p=0.95, top_k=29)
    target = probs(table, p)
    y, n = 7, 20_000
    draft = int(table[y].argmax())
    counts = torch.zeros(V, dtype=torch.long)
    gen = torch.Generator().manual_seed(2)
    for _ in range(n):                                           # wrong rule: accept the draft w.p. 0.9
        counts[draft if torch.rand(1, generator=gen) < 0.9 else int(torch.multinomial(target[y], 1, generator=gen))] += 1
    assert chi2_pvalue(counts, target[y] * n) < 1e-6


def test_chain_acceptance_is_lossless_with_a_hot_vocabulary_draft():
    """The hot-vocabulary draft head (``speculative.hot_vocab.HotHead``) proposes only hot tokens: q = delta(x)
    with x the argmax over the hot set, so q = 0 on every cold token. The unchanged acceptance rule must still
    emit exactly the target's distribution, the cold tokens coming only from the residual / bonus draws. The
    drafts are the real HotHead's over an LMHead whose rows score a per-token hidden state (a stand-in NEXTN)."""
    from bytebound.layers.lm_head import LMHead
    from bytebound.speculative.hot_vocab import HotHead
    g = torch.Generator().manual_seed(5)
    table = torch.randn(V, V, generator=g) * 2.5
    p = SamplingParams(temperature=0.6, top_p=0.95, top_k=29)
    target = probs(table, p)
    h = 16
    head = LMHead(V, h)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, h, generator=g))
    head.configure("fp32")
    hot_ids = torch.randperm(V, generator=g)[:12]
    hot = HotHead(head, hot_ids)
    hidden = torch.randn(V, h, generator=g)                       # the draft's hidden state after token t
    nxt = hot.propose(hidden).tolist()                            # the hot draft after each token, all at once
    hot_set = set(hot.ids.tolist())
    assert set(nxt) <= hot_set
    y = 7
    cold_mass = float(target[y][[t for t in range(V) if t not in hot_set]].sum())
    assert cold_mass > 0.2, "the target must put real mass outside the hot set"
    gen = torch.Generator().manual_seed(6)
    first, second, accepted = first_two_tokens(table, lambda cur, i: nxt[cur], p, y, gen)
    assert accepted > 0.05 * N, "the test must exercise both acceptance and rejection"
    cold = [t for t in range(V) if t not in hot_set]
    assert int(first[cold].sum()) > 0.15 * N                      # cold tokens do appear (residual draws)
    assert_follow_target(first, second, target, y)
