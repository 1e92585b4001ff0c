"""Greedy parity rule of the GPU tests: speculative output == plain output, or a first difference at a near-tie
of the plain logits (the ``spec_vs_plain`` canary's rule, ``verify.canaries.logit_tie_tolerance``)."""

from __future__ import annotations

import torch


def assert_same_or_near_tie(plain, question: str, want: list[int], got: list[int], what: str) -> None:
    """``got`` (speculative greedy tokens) equals ``want`` (plain greedy), or first differs where the plain decode's
    logits hold a near-tie (``verify.canaries.logit_tie_tolerance``, the ``spec_vs_plain`` canary's rule): the
    M = 4 verify rounds differently from the M = 1 step, so an exact or near tie may break the other way (BF16
    logits tie exactly often). The plain logits are replayed as ``generate`` makes them: prefill, then one decode
    step per token."""
    from bytebound.verify.canaries import logit_tie_tolerance
    if got == want:
        return
    n = min(len(got), len(want))
    k = next((i for i in range(n) if got[i] != want[i]), None)
    assert k is not None, f"{what}: one output is a prefix of the other ({len(want)} vs {len(got)} tokens)"
    r = plain.runner
    r.reset()
    try:
        with torch.inference_mode():
            lg = r.logits(r.prefill(torch.tensor(plain.encode_prompt(question, chat=True)))[-1:])
            for t in want[:k]:
                lg = r.logits(r.forward(torch.tensor([t], device=plain.device)))
        lg = lg[0].float()
        gap = float(lg[want[k]] - lg[got[k]])
        tol = logit_tie_tolerance(lg, plain.model.dtype)
    finally:
        r.reset()
    assert gap <= tol, f"{what}: first differs at token {k} ({want[k]} vs {got[k]}), plain logit gap {gap:.4g} > " \
                       f"near-tie tolerance {tol:.4g}"
