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

from bytebound.sampling import SamplingParams, inverse_cdf, probs


def chain_uniforms(gen: torch.Generator | None, u: torch.Tensor, u_draw: torch.Tensor) -> None:
    """Fill the uniforms one sampled acceptance consumes, from ``gen`` in this order: ``u [n]`` float32 (one per
    draft's test), then ``u_draw [1, 1]`` float64 (the bonus / correction draw, :func:`~bytebound.sampling.draw`'s
    uniform). The same calls as ``torch.rand`` makes, so a round that draws them into buffers before a graph
    replay consumes the generator exactly as one that draws them inside (:func:`accept_chain_device`)."""
    u.uniform_(0, 1, generator=gen)
    u_draw.uniform_(0, 1, generator=gen)


def accept_sampled(pr: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor, u_draw: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling rule with its uniforms given: ``pr [n+1, V]`` float32 target distributions (``probs``),
    ``drafts [n]`` int64, ``u [n]`` float32 and ``u_draw [1, 1]`` float64 uniforms in [0, 1) (:func:`chain_uniforms`).

    Returns 0-d int64 ``(j, bonus)``: ``accepted_i = u_i < p_i(x_i)``, ``j`` = the leading run of accepts; the
    bonus is drawn by inverse CDF with ``u_draw`` from p_j with x_j removed (rejection) or from p_n (all accepted).
    No host read (CUDA-graph capturable)."""
    n = drafts.shape[0]
    # Indexing with a 0-d tensor (``t[j]``) would turn ``j`` into a Python int: a host sync, which also breaks
    # CUDA-graph capture. ``index_select`` with ``j.view(1)`` stays on the device.
    px = pr[:n].gather(1, drafts.view(n, 1))[:, 0]
    j = (u < px).long().cumprod(0).sum()
    row = pr.index_select(0, j.view(1))[0]                                # p_j; for j < n remove the rejected x_j
    x = torch.cat([drafts, drafts.new_full((1,), -1)]).index_select(0, j.view(1))[0]
    row = torch.where(torch.arange(row.numel(), device=row.device) == x, torch.zeros_like(row), row)
    return j, inverse_cdf(row, u_draw)


def accept_greedy(target_ids: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy rule from the target's argmax tokens: ``target_ids [n+1]`` int64 (position i's argmax),
    ``drafts [n]`` int64. Returns 0-d int64 ``(j, bonus)``: ``j`` = the leading run where draft == target, the
    bonus the target token at ``j``. No host read (CUDA-graph capturable)."""
    n = drafts.shape[0]
    j = (drafts == target_ids[:n]).long().cumprod(0).sum()
    return j, target_ids.index_select(0, j.view(1))[0]


def accept_chain_device(target_logits: torch.Tensor, drafts: torch.Tensor, p: SamplingParams,
                        gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance without any host sync: ``target_logits [n+1, V]``, ``drafts [n]`` int64 on the same device.

    Returns 0-d int64 tensors ``(j, bonus)``. Greedy: ``j`` = length of the prefix where draft == target argmax.
    Sampling: :func:`accept_sampled` on ``probs(target_logits, p)`` with ``n + 1`` uniforms drawn from ``gen``
    (:func:`chain_uniforms`).
    """
    n = drafts.shape[0]
    if p.greedy:
        return accept_greedy(target_logits.argmax(-1), drafts)
    pr = probs(target_logits, p)                                          # [n+1, V]
    u = torch.empty(n, dtype=torch.float32, device=pr.device)
    u_draw = torch.empty(1, 1, dtype=torch.float64, device=pr.device)
    chain_uniforms(gen, u, u_draw)
    return accept_sampled(pr, drafts, u, u_draw)


def accept_chain(target_logits: torch.Tensor, drafts: list[int], p: SamplingParams,
                 gen: torch.Generator | None) -> tuple[int, int]:
    """Host-side wrapper of :func:`accept_chain_device` (tests, CPU callers): returns ``(j, bonus)`` as ints."""
    j, bonus = accept_chain_device(target_logits, torch.tensor(drafts, device=target_logits.device), p, gen)
    return int(j), int(bonus)
