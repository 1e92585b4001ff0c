"""Acceptance rules for chain drafts (``ling3-reference.md`` section 2.4; Leviathan et al. 2023, arXiv 2211.17192).

Drafts are the draft model's argmax (top-k 1), i.e. a one-hot proposal q = delta(x). Then:
* greedy target: accept draft i iff it equals the target argmax at its position; the target argmax at the
  first mismatch (or after the last draft) is the bonus/correction token.
* sampling target (T, top-k, top-p applied to p): accept x with probability min(1, p(x)/q(x)) = p(x); on
  rejection sample from norm(max(0, p - q)) = p with x removed, renormalised; if all accepted, sample the
  bonus from p at the last position. The emitted distribution equals the target's exactly.
"""

from __future__ import annotations

import torch

from bytebound.sampling import SamplingParams, draw, probs


def _draw(pr: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(draw(pr, gen))


def accept_chain(target_logits: torch.Tensor, drafts: list[int], p: SamplingParams,
                 gen: torch.Generator | None) -> tuple[int, int]:
    """``target_logits [n+1, V]`` at the verified positions (last committed token, then the n drafts).

    Returns ``(j, bonus)``: the first j drafts are accepted and ``bonus`` is the token after them.
    """
    n = len(drafts)
    if p.greedy:
        tgt = target_logits.argmax(-1).tolist()
        j = 0
        while j < n and drafts[j] == tgt[j]:
            j += 1
        return j, tgt[j]
    pr = probs(target_logits, p)                                          # [n+1, V]
    u = torch.rand(n, generator=gen, device=pr.device) if gen is not None else torch.rand(n, device=pr.device)
    for j in range(n):
        x = drafts[j]
        if u[j] < pr[j, x]:
            continue
        resid = pr[j].clone()
        resid[x] = 0.0
        return j, _draw(resid, gen)
    return n, _draw(pr[n], gen)
