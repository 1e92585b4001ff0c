"""``scripts/mtp_accept.py``'s verdict on a greedy mismatch: the start-up canary's near-tie rule
(``verify.canaries.logit_tie_tolerance``) applied to the replayed plain logits at the first differing token."""

from __future__ import annotations

import torch

from tests.conftest import load_script

mtp_accept = load_script("mtp_accept", "mtp_accept_script")


def _logits(values: dict[int, float], v: int = 64) -> torch.Tensor:
    lg = torch.linspace(-3.0, 3.0, v)
    for i, x in values.items():
        lg[i] = x
    return lg


def test_one_bf16_step_is_a_near_tie():
    # the H200 ladder's mismatch of 2026-12-07: 0.0625 apart at |logit| 12.375 (one BF16 step), rank 1
    f = mtp_accept.margin_facts(_logits({5: 12.375, 9: 12.3125}), 5, 9, torch.bfloat16)
    assert f["near_tie"] is True and f["spec_tok_rank"] == 1 and f["replayed_argmax"] == 5
    assert abs(f["rel_margin"] - 0.0625 / 12.375) < 1e-6
    assert abs(f["tie_tolerance"] - 2e-2 * 12.375) < 1e-6


def test_a_wide_margin_is_not_a_near_tie():
    # relative margin 0.105, as the ninth session's unexplained prompt 23: a bug, not rounding
    f = mtp_accept.margin_facts(_logits({5: 6.57, 9: 5.88}), 5, 9, torch.bfloat16)
    assert f["near_tie"] is False and f["margin"] > f["tie_tolerance"]


def test_float32_rule_is_tighter():
    lg = _logits({5: 12.375, 9: 12.3125})
    assert mtp_accept.margin_facts(lg, 5, 9, torch.float32)["near_tie"] is False


def test_replay_preferring_the_speculative_token_counts_as_a_tie():
    # a negative margin: replaying the plain decode picks the speculative token, so the plain run's own choice was
    # the rounding side of a tie
    f = mtp_accept.margin_facts(_logits({5: 10.0, 9: 10.0625}), 5, 9, torch.bfloat16)
    assert f["margin"] < 0 and f["near_tie"] is True
