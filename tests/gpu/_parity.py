"""Greedy parity rule of the GPU tests: speculative output == plain output, or a first difference at a near-tie
of the plain logits (the ``spec_vs_plain`` canary's rule, ``verify.canaries.logit_tie_tolerance``)."""

from __future__ import annotations


def assert_same_or_near_tie(plain, question: str, want: list[int], got: list[int], what: str) -> None:
    """``got`` (speculative greedy tokens) equals ``want`` (plain greedy), or first differs where the plain decode's
    logits hold a near-tie (``verify.canaries.logit_tie_tolerance``, the ``spec_vs_plain`` canary's rule): the
    M = 4 verify rounds differently from the M = 1 step, so an exact or near tie may break the other way (BF16
    logits tie exactly often). The plain logits are replayed as ``generate`` makes them
    (``verify.canaries.replay_plain_logits``)."""
    from bytebound.verify.canaries import logit_tie_tolerance, replay_plain_logits
    if got == want:
        return
    n = min(len(got), len(want))
    k = next((i for i in range(n) if got[i] != want[i]), None)
    assert k is not None, f"{what}: one output is a prefix of the other ({len(want)} vs {len(got)} tokens)"
    lg = replay_plain_logits(plain, plain.encode_prompt(question, chat=True), want[:k])
    gap = float(lg[want[k]] - lg[got[k]])
    tol = logit_tie_tolerance(lg, plain.model.dtype)
    assert gap <= tol, f"{what}: first differs at token {k} ({want[k]} vs {got[k]}), plain logit gap {gap:.4g} > " \
                       f"near-tie tolerance {tol:.4g}"
