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


def test_a_replay_that_strongly_prefers_the_speculative_token_is_a_bug():
    # plain decoding chose 5, its replay puts 9 ten logits above: the replay disagrees with plain decoding itself
    f = mtp_accept.margin_facts(_logits({5: 2.0, 9: 12.0}), 5, 9, torch.bfloat16)
    assert f["margin"] < -f["tie_tolerance"] and f["near_tie"] is False


def test_a_third_token_far_above_both_is_no_tie():
    # 5 and 9 are close to each other but far below the replay's top token 20
    f = mtp_accept.margin_facts(_logits({5: 4.0, 9: 3.95, 20: 12.0}), 5, 9, torch.bfloat16)
    assert abs(f["margin"]) <= f["tie_tolerance"] and f["replayed_argmax"] == 20 and f["near_tie"] is False


class _Engine:
    """What ``plain_margin`` uses of an engine: the prompt's ids, the stop ids and the model dtype."""
    class model:
        dtype = torch.bfloat16

    def encode_prompt(self, question, chat):
        return [1, 2, 3]

    def stop_ids(self, p):
        return {7, 40}


def test_an_output_ending_early_is_judged_by_the_stop_token(monkeypatch):
    """One output stopped on an end-of-sequence token where the other went on: the replayed logit of the likeliest
    stop id (token_ids do not hold it) against the other output's token there."""
    import bytebound.verify.canaries as canaries
    seen = []

    def replay(engine, prompt, tokens):
        seen.append(list(tokens))
        return _logits({40: 9.0, 11: 8.96, 7: 1.0})
    monkeypatch.setattr(canaries, "replay_plain_logits", replay)
    f = mtp_accept.plain_margin(_Engine(), "q", [4, 5], [4, 5, 11, 12], 2)     # plain stopped, spec went on
    assert seen == [[4, 5]] and f["stop_token"] == 40 and (f["plain_tok"], f["spec_tok"]) == (40, 11)
    assert f["near_tie"] is True
    f = mtp_accept.plain_margin(_Engine(), "q", [4, 5, 11], [4, 5], 2)         # the other way round
    assert (f["plain_tok"], f["spec_tok"]) == (11, 40)
    same = mtp_accept.plain_margin(_Engine(), "q", [4, 5], [4, 5], 2)
    assert same["near_tie"] is False and same["margin"] is None
