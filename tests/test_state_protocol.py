"""The runner's state protocol (``runner.ModelRunner``): ``begin_verify(k)`` / ``verify(ids)`` / ``commit(n)``,
its two halves ``commit_state(n)`` (device; ``n`` may be a 0-d tensor, as in a captured MTP round) and
``commit_length(n)`` (host), and ``snapshot()`` / ``restore(snap)``.

* ``commit(n)`` for every ``n`` of a (k+1)-token verify, k = 1..5, leaves the state that a plain decode of the
  accepted tokens ``0..n`` reaches: every KDA layer's conv window and recurrent state, every MLA cache's committed
  slots and ``pos``. Within the rule of tests/test_mtp_cpu.py (``test_rollback_exact_with_row_wise_linear``):
  with every linear computed row by row, verify and decode do the same float arithmetic except ~1 ulp in the
  vectorised elementwise kernels, so they agree to ``ROW_WISE_TOL``, and every other committed length is at least
  1e3 times further away (an off-by-one rollback cannot pass).
* The device-index commit equals the host-index one bit for bit (both copy the same recorded tensors).
* ``restore(snapshot())`` puts back exactly the snapshot's state, in place, and ends a pending verify.
* Misuse raises a named error (RuntimeError for the protocol order, ValueError for cache room and indices).
"""

from __future__ import annotations

import pytest
import torch

from bytebound.layers.kda import KDAState
from bytebound.runner.runner import ModelRunner

ROW_WISE_TOL = 1e-6          # relative to the state's largest entry: a few float32 ulps (as in test_mtp_cpu)
MAX_LEN = 96


def states(r: ModelRunner) -> list[tuple[str, torch.Tensor]]:
    """Every layer's state (the NEXTN layer's cache included): KDA ``conv`` / ``rec``, MLA ``kv[:, :pos]``."""
    out = []
    for i, st in enumerate(r.state):
        for name, t in st.tensors().items():
            out.append((f"layer {i} {name}", (t[:, :r.pos] if st.positional else t).clone()))
    return out


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()


def _prompt_and_tokens(model, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    v = model.cfg.vocab_size
    return torch.randint(4, v, (21,), generator=g), torch.randint(4, v, (k + 1,), generator=g)


@torch.inference_mode()
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_commit_n_equals_plain_decode_of_the_accepted_tokens(tiny_model, row_wise, k):
    prompt, toks = _prompt_and_tokens(tiny_model, k, seed=10 + k)
    plain = {}
    for n in range(-1, k + 1):                    # n + 1 decode steps (n = -1: the prompt alone)
        r = ModelRunner(tiny_model, MAX_LEN)
        r.prefill(prompt)
        for t in toks[: n + 1]:
            r.forward(t.view(1))
        plain[n] = (r.pos, states(r))
    for n in range(k + 1):
        r = ModelRunner(tiny_model, MAX_LEN)
        r.prefill(prompt)
        r.begin_verify(k)
        r.verify(toks)
        assert r.pos == len(prompt)               # a verify does not move the committed length
        r.commit(n)
        pos, want = plain[n]
        assert r.pos == pos == len(prompt) + n + 1
        got = states(r)
        assert [a for a, _ in got] == [a for a, _ in want]
        for (name, x), (_, y) in zip(got, want):
            assert x.shape == y.shape, name
            assert rel(x, y) <= ROW_WISE_TOL, (n, name, rel(x, y))
        kda = [i for i, (name, _) in enumerate(got) if name.endswith(("conv", "rec"))]
        for m, (_, other) in plain.items():       # every other boundary is far away
            if m != n:
                assert max(rel(got[i][1], other[i][1]) for i in kda) > 1e3 * ROW_WISE_TOL, (n, m)
        assert all(st.history is None for st in r.state if isinstance(st, KDAState))


@torch.inference_mode()
@pytest.mark.parametrize("n", range(4))
def test_device_index_commit_equals_host_commit(tiny_model, n):
    """``commit_state(tensor n)`` + ``commit_length(n)`` (the captured round's halves) == ``commit(n)``, bit for
    bit, and the next step continues identically."""
    prompt, toks = _prompt_and_tokens(tiny_model, 3, seed=40 + n)
    runs = []
    for device_index in (False, True):
        r = ModelRunner(tiny_model, MAX_LEN)
        r.prefill(prompt)
        r.verify(toks)
        if device_index:
            r.commit_state(torch.tensor(n))
            r.commit_length(n)
        else:
            r.commit(n)
        runs.append((r.pos, states(r), r.logits(r.forward(torch.tensor([5])))))
    (pa, sa, la), (pb, sb, lb) = runs
    assert pa == pb
    for (name, x), (_, y) in zip(sa, sb):
        assert torch.equal(x, y), name
    assert torch.equal(la, lb)


@torch.inference_mode()
def test_snapshot_restore_in_place(tiny_model):
    prompt, toks = _prompt_and_tokens(tiny_model, 3, seed=7)
    r = ModelRunner(tiny_model, MAX_LEN)
    r.prefill(prompt)
    before, ptrs = states(r), [t.data_ptr() for st in r.state for t in st.tensors().values()]
    snap = r.snapshot()
    r.forward(toks[:1])
    r.verify(toks)                               # a pending verify is ended by restore
    r.restore(snap)
    assert r.pos == len(prompt)
    assert [t.data_ptr() for st in r.state for t in st.tensors().values()] == ptrs
    for (name, x), (_, y) in zip(states(r), before):
        assert torch.equal(x, y), name
    assert all(st.history is None for st in r.state if isinstance(st, KDAState))
    fresh = ModelRunner(tiny_model, MAX_LEN)
    fresh.prefill(prompt)
    assert torch.equal(r.logits(r.forward(toks[:1])), fresh.logits(fresh.forward(toks[:1])))


@torch.inference_mode()
def test_begin_verify_sets_the_device_position(tiny_model):
    r = ModelRunner(tiny_model, MAX_LEN)
    r.prefill(torch.arange(4, 17))
    r.begin_verify(2)
    assert int(r.pos_buf) == r.pos == 13
    assert all(st.history == [] for st in r.state if isinstance(st, KDAState))
    r.verify(torch.tensor([4, 5, 6]), r.pos_buf + torch.arange(3))     # positions from the device copy
    r.commit(2)
    assert r.pos == 16


@torch.inference_mode()
def test_protocol_misuse_is_named(tiny_model):
    r = ModelRunner(tiny_model, 16)
    r.prefill(torch.arange(4, 14))
    with pytest.raises(RuntimeError, match="commit without a verify"):
        r.commit(0)
    with pytest.raises(ValueError, match="exceeds the cache"):
        r.begin_verify(6)                        # 10 + 7 > 16 slots
    with pytest.raises(ValueError, match="k >= 0"):
        r.begin_verify(-1)
    r.begin_verify(2)
    with pytest.raises(RuntimeError, match="awaits commit"):
        r.begin_verify(2)
    with pytest.raises(RuntimeError, match="announced 3 tokens, verify got 4"):
        r.verify(torch.tensor([4, 5, 6, 7]))
    r.verify(torch.tensor([4, 5, 6]))
    with pytest.raises(RuntimeError, match="awaits commit"):
        r.forward(torch.tensor([4]))
    with pytest.raises(RuntimeError, match="snapshot during a verify"):
        r.snapshot()
    with pytest.raises(ValueError, match=r"tokens 0\.\.2"):
        r.commit(3)
    r.commit(0)
    assert r.pos == 11
    with pytest.raises(ValueError, match="outside the cache"):
        r.reset(17)
    r.reset(5)
    assert r.pos == 5 and all(not st.rec.any() for st in r.state if isinstance(st, KDAState))


@torch.inference_mode()
def test_chained_verify_begins_where_the_pending_one_commits(tiny_model):
    """Pipelined MTP rounds: ``chain_verify(k)`` announces the next verify before the pending one's
    ``commit_length``; that commit makes it the pending one, at the committed length. Room is checked for the
    worst case (every pending token kept); order misuse and no room are named errors; ``reset`` ends both."""
    r = ModelRunner(tiny_model, 24)
    r.prefill(torch.arange(4, 14))               # pos 10
    with pytest.raises(RuntimeError, match="exactly one pending verify"):
        r.chain_verify(3)
    r.begin_verify(3)                            # tokens 10..13
    assert r.can_chain(9) and not r.can_chain(10)    # 14 + 10 <= 24 slots < 14 + 11
    with pytest.raises(ValueError, match="may need 26 slots; the cache has 24"):
        r.chain_verify(11)
    with pytest.raises(ValueError, match="k >= 0"):
        r.chain_verify(-1)
    r.chain_verify(3)
    with pytest.raises(RuntimeError, match="exactly one pending verify"):
        r.chain_verify(3)
    r.commit_length(1)                           # kept 2 tokens: the chained verify starts at 12
    assert r.pos == 12 and r._verify == (12, 4)
    with pytest.raises(RuntimeError, match="awaits commit"):
        r.forward(torch.tensor([4]))
    r.commit_length(3)
    assert r.pos == 16 and r._verify is None
    r.begin_verify(1)
    r.chain_verify(1)
    r.reset(3)
    assert r._verify is None and r._chained is None and r.pos == 3
