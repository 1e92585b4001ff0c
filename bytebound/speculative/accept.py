"""Acceptance rules for chain drafts (``docs/references.md`` §2.4; Leviathan et al. 2023, arXiv 2211.17192).

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


def accept_chain_device(target_logits: torch.Tensor, drafts: torch.Tensor, p: SamplingParams,
                        gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance without any host sync: ``target_logits [n+1, V]``, ``drafts [n]`` int64 on the same device.

    Returns 0-d int64 tensors ``(j, bonus)``. Greedy: ``j`` = length of the prefix where draft == target argmax.
    Sampling: one uniform per draft, ``accepted_i = u_i < p_i(x_i)``, ``j`` = leading run of accepts; the bonus is
    drawn from p_j with x_j removed (rejection) or from p_n (all accepted), by inverse CDF.
    """
    n = drafts.shape[0]
    # Indexing with a 0-d tensor (``t[j]``) would turn ``j`` into a Python int: a host sync, which also breaks
    # CUDA-graph capture. ``index_select`` with ``j.view(1)`` stays on the device.
    if p.greedy:
        tgt = target_logits.argmax(-1)                                    # [n+1]
        j = (drafts == tgt[:n]).long().cumprod(0).sum()
        return j, tgt.index_select(0, j.view(1))[0]
    pr = probs(target_logits, p)                                          # [n+1, V]
    u = torch.rand(n, generator=gen, device=pr.device)
    px = pr[:n].gather(1, drafts.view(n, 1))[:, 0]
    j = (u < px).long().cumprod(0).sum()
    row = pr.index_select(0, j.view(1))[0]                                # p_j; for j < n remove the rejected x_j
    x = torch.cat([drafts, drafts.new_full((1,), -1)]).index_select(0, j.view(1))[0]
    row = torch.where(torch.arange(row.numel(), device=row.device) == x, torch.zeros_like(row), row)
    return j, draw(row, gen)


def accept_chain(target_logits: torch.Tensor, drafts: list[int], p: SamplingParams,
                 gen: torch.Generator | None) -> tuple[int, int]:
    """Host-side wrapper of :func:`accept_chain_device` (tests, CPU callers): returns ``(j, bonus)`` as ints."""
    j, bonus = accept_chain_device(target_logits, torch.tensor(drafts, device=target_logits.device), p, gen)
    return int(j), int(bonus)
