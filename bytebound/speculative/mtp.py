"""NEXTN chain drafting (``docs/references.md`` §2.1-2.3): the draft model and the round's metrics.

Round (steps = 3, 4 verified positions), with ``y`` the last committed, not yet processed token at ``pos``:
  1. draft-extend: NEXTN over the tokens committed last round, each paired with the target hidden state of
     the position before it -> draft token d1 (and the NEXTN hidden at ``pos - 1``);
  2. steps - 1 draft decodes, each feeding back the NEXTN's own hidden and token -> d2, d3;
  3. verify: the target runs [y, d1, d2, d3] at pos..pos+3 in one forward (KDA state recorded per token);
  4. accept the longest matching prefix j + one bonus token (``accept.accept_chain_device``, on the device); keep
     j + 1 tokens; the runner rolls the KDA states back to after the last kept one.
The round itself, with static shapes for CPU and CUDA alike, is :mod:`bytebound.speculative.round`.
The draft holds the target's **LM-head module object** and embedding (shared, never copied): whatever path
the head uses (BF16, FP32 logits, online FP8), drafts use the same one. With a hot-vocabulary draft head
(``hot``, :mod:`bytebound.speculative.hot_vocab`) the draft steps score a fixed row subset of that module;
the verify always scores the full head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import bytebound.runner.runner as runner_mod
from bytebound.errors import ConfigError


@dataclass
class SpecStats:
    """Accept-length metrics: committed tokens / verify rounds (SGLang ``accept len``), per-position rates,
    ``verify_s``, the rounds' wall time (seconds; the whole round - draft, verify, rollback - which one graph
    replay does not separate), and ``pipelined``, the rounds launched before the previous one was read."""
    steps: int
    rounds: int = 0
    committed: int = 0
    accepted_at: list[int] = field(default_factory=list)   # accepted drafts per draft position
    tried_at: list[int] = field(default_factory=list)
    verify_s: float = 0.0
    pipelined: int = 0          # rounds launched before the previous round's verdict was read

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.steps
        self.tried_at = self.tried_at or [0] * self.steps

    @property
    def accept_length(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0

    def position_rates(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted_at, self.tried_at)]

    def add_round(self, j: int) -> None:
        """Count one verify round that accepted ``j`` of the ``steps`` drafts (draft position j, if any, was tried
        and rejected). Committed tokens are counted by the caller as they are emitted."""
        self.rounds += 1
        for i in range(min(j + 1, self.steps)):
            self.tried_at[i] += 1
        for i in range(j):
            self.accepted_at[i] += 1

    def add(self, s: "SpecStats") -> None:
        """Accumulate another request's stats into these (engine-lifetime totals)."""
        self.rounds += s.rounds
        self.committed += s.committed
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, s.accepted_at)]
        self.tried_at = [a + b for a, b in zip(self.tried_at, s.tried_at)]
        self.verify_s += s.verify_s
        self.pipelined += s.pipelined

    def to_dict(self) -> dict:
        return {"accept_length": round(self.accept_length, 4), "rounds": self.rounds, "committed": self.committed,
                "per_position_accept": [round(r, 4) for r in self.position_rates()],
                "verify_s": self.verify_s, "pipelined_rounds": self.pipelined}


class MTPDrafter:
    """The NEXTN draft model: the checkpoint's NEXTN layer + the target's embedding and LM-head *modules*.

    ``share="module"`` (the only production mode) holds ``target.lm_head`` itself. ``share="weight-only"`` is a
    test-only reproduction of the seed's silent failure: a separate BF16 head that aliases the target's weight
    *tensor*; with the online FP8 head that tensor holds FP8 bytes which the BF16 path reads without their
    scales (issue 7 must refuse it at start-up).

    ``hot``: an optional :class:`~bytebound.speculative.hot_vocab.HotHead` of ``model.lm_head`` (the draft steps
    take the argmax over its N rows, mapped back to vocabulary ids); None = the full head.

    Raises:
        ConfigError: the model has no NEXTN layer, ``share`` is neither "module" nor "weight-only", or ``hot`` is
            not derived from this model's LM-head module (or combined with ``share="weight-only"``).
    """

    def __init__(self, model, steps: int = 3, share: str = "module", hot=None):
        if model.nextn is None:
            raise ConfigError("the checkpoint has no NEXTN layer (num_nextn_predict_layers = 0): MTP unavailable")
        self.model, self.steps, self.share = model, steps, share
        self.layer = model.nextn
        self.embedding = model.model.word_embeddings
        if share == "module":
            self.lm_head = model.lm_head
        elif share == "weight-only":
            from bytebound.layers.lm_head import LMHead
            head = model.lm_head
            alias = LMHead.__new__(LMHead)
            torch.nn.Module.__init__(alias)
            src = head.w_fp8 if head.w_fp8 is not None and head.mode == "fp8" else head.weight
            alias.weight = torch.nn.Parameter(src, requires_grad=False)   # the tensor, not the module
            alias.mode, alias.fn, alias.backend, alias.w_fp8, alias.w_scale = "bf16", None, "torch", None, None
            self.lm_head = alias
        else:
            raise ConfigError(f"draft_share must be 'module' or 'weight-only', got {share!r}")
        if hot is not None and (share != "module" or hot.head is not model.lm_head):
            raise ConfigError("a hot-vocabulary draft head must be derived from the target's own LM-head module "
                              "(draft_share='module')")
        self.hot = hot

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.share == "weight-only":
            # A BF16 matmul over whatever bytes the aliased tensor holds (FP8 values, scales dropped).
            return torch.nn.functional.linear(hidden.float(), self.lm_head.weight.float())
        return self.lm_head(hidden)

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft tokens ``[..]`` int64 for NEXTN hiddens ``[.., H]``: the argmax of the full head's logits, or of
        the hot rows' (mapped back to vocabulary ids). Stays on the device (no host sync)."""
        if self.hot is not None:
            return self.hot.propose(hidden)
        if self.share == "weight-only":
            return self.logits(hidden).argmax(-1)
        return self.lm_head.argmax(hidden)      # the head module's own argmax (fused into its kernel where it can)

    def hidden(self, ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor, state,
               kv_len: int | None = None) -> torch.Tensor:
        """NEXTN hidden ``[T, H]`` for tokens ``ids [T]`` (t+1) after target hiddens ``prev_hidden [T, H]`` (t).
        ``kv_len``: a static attention span (graph capture); None reads ``positions[-1] + 1`` slots."""
        st = state[self.model.cfg.num_hidden_layers]
        h = self.layer(self.embedding(ids.view(1, -1)), prev_hidden.view(1, *prev_hidden.shape), positions, st,
                       kv_len)
        return h[0]


def _from_rank0(runner, t: torch.Tensor) -> torch.Tensor:
    """Tensor parallel (``runner.tp`` set by the engine): rank 0's ``t`` on every rank, so every rank verifies the
    same drafts and keeps the same tokens; ``t`` itself otherwise."""
    tp = getattr(runner, "tp", None)
    return t if tp is None else tp.from_rank0(t)


def nextn_prefix(drafter, ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor, state) -> None:
    """Fill the NEXTN cache over a prompt prefix (outputs unused), in chunks of ``runner.PREFILL_CHUNK`` tokens
    like the target's prefill, so a long prompt's attention memory stays bounded."""
    step = runner_mod.PREFILL_CHUNK
    for c in range(0, ids.shape[0], step):
        drafter.hidden(ids[c:c + step], prev_hidden[c:c + step], positions[c:c + step], state)
