"""Batch-1 model runner: one request's state, prefill, decode and the M-token verify forward of MTP.

The runner owns the request's state (the per-layer ``KDAState`` / ``MLAState`` that each layer declares with
``new_state``) and its committed length ``pos``; everything else - graph capture, the MTP round, the canaries,
the benchmarks - goes through its state protocol:

* ``begin_verify(k)`` announces a (k+1)-token verify at ``pos..pos+k`` (room check; KDA layers record the state
  after every token, ``KDAState.history``); ``verify(ids)`` runs it, ``pos`` unchanged.
* ``commit(n)`` keeps the verify's tokens ``0..n``: each KDA state becomes the one recorded after token ``n`` (an
  index into the per-token history the fused kernel writes, no replay); MLA caches are position-indexed, so the
  slots past the new ``pos = start + n + 1`` are simply rewritten later. Split for a captured MTP round into
  ``commit_state(n)`` (device, ``n`` may be a 0-d tensor) and ``commit_length(n)`` (host, after the round's read).
* ``chain_verify(k)`` announces the next round's verify while this one awaits ``commit_length`` (pipelined MTP
  rounds): it begins at the length that commit sets, which the round has already written into ``pos_buf``.
* ``snapshot()`` / ``restore(snap)`` copy the committed state and ``pos`` out and back in place (graph-captured
  buffers keep their addresses).

Positions are committed-length indices; ``pos_buf`` is the device copy of ``pos`` that a verify was begun at
(written by ``begin_verify``, advanced on the device by the MTP round that commits), which a captured MTP round
reads instead of a host value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bytebound.kernels import triton_kda
from bytebound.layers.kda import KDAState
from bytebound.sampling import sample

# Tokens per prefill forward. Long chunks amortise weight reads: the grouped MoE decodes each expert's weights
# about once per chunk, so 8192-token chunks cost about half of four 2048-token ones (docs/perf/moe-prefill-h200.md);
# the activations of one chunk at full scale stay near 1 GB.
PREFILL_CHUNK = 8192


def pow2_buckets(max_len: int, smallest: int = 1024) -> tuple[int, ...]:
    """Attention spans ``smallest, 2*smallest, ...`` below ``max_len``, then ``max_len``: a step reads at most
    twice the slots it needs, for ``log2(max_len / smallest) + 1`` captured decode graphs."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return tuple(out) + (max_len,)


def kda_arena(states: list) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Put the KDA layers' states into two shared tensors, ``conv [L, B, C, k-1]`` and ``rec [L, B, H, K, V]``: each
    ``KDAState`` keeps ``conv``/``rec`` as its (contiguous) slice, so the layers and every copy, snapshot and graph
    see the same per-layer tensors, while a reset or a rollback of all layers is one launch per tensor. Returns the
    pair, or None (and changes nothing) with fewer than two layers or layers of different shapes or devices."""
    if len(states) < 2:
        return None
    c0, r0 = states[0].conv, states[0].rec
    if any(st.conv.shape != c0.shape or st.rec.shape != r0.shape or st.conv.dtype != c0.dtype
           or st.rec.dtype != r0.dtype or st.conv.device != c0.device or st.rec.device != r0.device for st in states):
        return None
    conv = torch.stack([st.conv for st in states])
    rec = torch.stack([st.rec for st in states])
    for i, st in enumerate(states):
        st.conv, st.rec = conv[i], rec[i]
    return conv, rec


class RunnerSnapshot(NamedTuple):
    """A copy of a runner's committed state: ``pos`` and, per layer, clones of its state tensors (positional
    tensors - MLA caches - only their slots ``[0, pos)``)."""
    pos: int
    tensors: list


class ModelRunner:
    """Holds the model, one request's state and its committed length ``pos``.

    Args:
        model: a loaded ``BailingMoeV3ForCausalLM``. max_len: cache slots (prompt + output + draft room).
    """

    def __init__(self, model, max_len: int, device=None, kv_buckets: tuple[int, ...] | None = None):
        self.model, self.max_len = model, max_len
        self.device = torch.device(device or model.lm_head.weight.device)
        self.state = model.new_state(max_len, device=self.device)
        self._kda = [st for st in self.state if isinstance(st, KDAState)]
        self._arena = kda_arena(self._kda)
        self._hist = None   # (conv [L, T, B, C, k-1], rec [L, T, B, H, K, V]): the layers' verify history
        self.pos = 0
        self.pos_buf = torch.zeros((), dtype=torch.long, device=self.device)   # pos at begin_verify, on device
        self._verify: tuple[int, int] | None = None     # (start, tokens) of the verify awaiting its commit
        self._chained: int | None = None    # tokens of a verify announced behind it (chain_verify)
        # On CUDA every step attends over a static span of cache slots, masked by position: the same kernels as
        # the captured graph (bit-identical replay) and no host sync for the cache length. On CPU, slice instead.
        # The span is the smallest of ``kv_buckets`` that holds the sequence (default: one bucket, ``max_len``),
        # so a short sequence need not read all ``max_len`` slots; one decode graph is captured per bucket.
        self.static_kv = self.device.type == "cuda"
        self.kv_buckets = tuple(sorted({b for b in (kv_buckets or ()) if b < max_len} | {max_len}))
        self.graph = None       # a DecodeGraph once captured (runner.graphs)

    def reset(self, length: int = 0) -> None:
        """Zero every KDA state for a new request (buffers reused) and end any verify. ``length``: the committed
        length to start from, 0 for a request; benchmarks and graph warm-up start at a synthetic context (the
        cache slots keep whatever they hold).

        Raises:
            ValueError: ``length`` outside ``[0, max_len]``.
        """
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside the cache (0..{self.max_len} slots)")
        for t in (self._arena or [x for st in self._kda for x in (st.conv, st.rec)]):
            t.zero_()
        self._end_verify()
        self.pos = length

    def kv_span(self, end: int) -> int:
        """Static attention span (cache slots) for a sequence of ``end`` tokens: the smallest bucket >= ``end``.
        Raises ValueError past ``max_len``."""
        for b in self.kv_buckets:
            if b >= end:
                return b
        raise ValueError(f"sequence of {end} tokens exceeds the cache ({self.max_len} slots)")

    def _check_room(self, n: int) -> None:
        if self.pos + n > self.max_len:
            raise ValueError(f"sequence of {self.pos + n} tokens exceeds the cache ({self.max_len} slots)")

    def _check_step(self, t: int) -> None:
        """What a forward of ``t`` tokens needs: no verify awaiting its commit (RuntimeError), room in the cache
        (ValueError)."""
        if self._verify is not None:
            raise RuntimeError(f"a {self._verify[1]}-token verify at position {self._verify[0]} awaits commit(n) "
                               "(or restore) before the next forward")
        self._check_room(t)

    def _end_verify(self) -> None:
        self._verify = None
        self._chained = None
        for st in self._kda:
            st.history = None

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Run ``ids [T]`` at positions ``pos..pos+T-1``, advance ``pos``; returns final-normed hidden ``[T, H]``.

        Raises:
            ValueError: the sequence would exceed ``max_len``. RuntimeError: a verify awaits its commit.
        """
        t = ids.shape[0]
        self._check_step(t)
        if t == 1 and self.graph is not None:
            h = self.graph.replay(ids.view(1), self.pos)
            self.pos += 1
            return h
        positions = torch.arange(self.pos, self.pos + t, device=self.device)
        kv_len = self.kv_span(self.pos + t) if self.static_kv else None
        h = self.model(ids.view(1, t).to(self.device), positions, self.state, kv_len)
        self.pos += t
        return h[0]

    @torch.inference_mode()
    def decode_token(self, tok: torch.Tensor, p, gen) -> tuple[torch.Tensor, torch.Tensor]:
        """One plain decode step of ``tok [1]`` int64 and the token that follows it: ``(next [1] int64 on the
        device, hidden [1, H])``, ``pos`` advanced by one. With a captured decode graph that has token graphs
        (``DecodeGraph.replay_token``) the LM head and the choice (argmax, or ``p``'s sampling with generator
        ``gen``) replay inside graphs and the outputs are static buffers (clone what you keep past the next step);
        else ``forward``, ``logits`` and ``sampling.sample``, the same values.

        Raises:
            ValueError: the sequence would exceed ``max_len``. RuntimeError: a verify awaits its commit."""
        g = self.graph
        if g is not None and getattr(g, "token_graphs", None) and getattr(self, "tp", None) is None:
            self._check_step(1)
            nxt, h = g.replay_token(tok.view(1), self.pos, p, gen)
            self.pos += 1
            return nxt, h
        h = self.forward(tok.view(1))
        return sample(self.logits(h), p, gen).view(1), h

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole prompt in chunks of ``PREFILL_CHUNK`` tokens (the chunked KDA form inside each)."""
        outs = [self.forward(ids[i:i + PREFILL_CHUNK]) for i in range(0, ids.shape[0], PREFILL_CHUNK)]
        return torch.cat(outs, 0)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    # ---- the verify protocol -------------------------------------------------------------------------------
    def begin_verify(self, k: int) -> None:
        """Announce a verify of ``k + 1`` tokens at positions ``pos..pos+k``: checks the room, writes ``pos``
        into ``pos_buf`` and turns on per-token state recording in every KDA layer.

        Raises:
            ValueError: ``k < 0`` or the verify would exceed ``max_len``. RuntimeError: the last verify is not
                committed.
        """
        if self._verify is not None:
            raise RuntimeError(f"a {self._verify[1]}-token verify at position {self._verify[0]} awaits commit(n)")
        if k < 0:
            raise ValueError(f"a verify needs k >= 0 drafts, got {k}")
        self._check_room(k + 1)
        self._verify = (self.pos, k + 1)
        self.pos_buf.fill_(self.pos)
        for st in self._kda:
            st.history = []
        if self._arena is not None and (self._hist is None or self._hist[1].shape[1] < k + 1):
            # the fused KDA kernel writes each token's state into the layer's last history buffers
            # (kernels.triton_kda.history_buffers): make those views of one [L, T, ...] pair, so that commit_state
            # rolls every layer back in one launch per tensor. Earlier buffers stay referenced (a captured graph
            # may still write them).
            conv, rec = self._arena
            hc = torch.zeros(conv.shape[0], k + 1, *conv.shape[1:], dtype=conv.dtype, device=conv.device)
            hr = torch.zeros(rec.shape[0], k + 1, *rec.shape[1:], dtype=rec.dtype, device=rec.device)
            self._hist = (hc, hr)
            for i, st in enumerate(self._kda):
                st.hist_buf = (st.hist_buf or []) + [(hc[i], hr[i])]

    def can_chain(self, k: int) -> bool:
        """Whether :meth:`chain_verify` ``(k)`` has room: a ``(k+1)``-token verify after the pending one keeps every
        one of its tokens (the worst case) still fits in ``max_len``."""
        return self._verify is not None and self._verify[0] + self._verify[1] + k + 1 <= self.max_len

    def chain_verify(self, k: int) -> None:
        """Announce the next ``(k+1)``-token verify while the pending one still awaits :meth:`commit_length`
        (pipelined MTP rounds: the next round is launched before the host has read this one's verdict). It begins
        at the committed length that the pending verify's ``commit_length`` sets, which the device already holds:
        the round that runs the pending verify advances ``pos_buf`` by its own kept tokens, so nothing is written
        here. KDA recording is the round's own business (its ``verify`` turns it on, its ``commit_state`` off).
        After that ``commit_length``, the chained verify is the pending one.

        Raises:
            RuntimeError: no verify is pending, or one is already chained. ValueError: ``k < 0``, or no room in
                the worst case (:meth:`can_chain`).
        """
        if self._verify is None or self._chained is not None:
            raise RuntimeError("chain_verify needs exactly one pending verify (begin_verify first; one chained "
                               "verify at a time)")
        if k < 0:
            raise ValueError(f"a verify needs k >= 0 drafts, got {k}")
        if not self.can_chain(k):
            start, width = self._verify
            raise ValueError(f"a chained {k + 1}-token verify after the {width}-token verify at {start} may need "
                             f"{start + width + k + 1} slots; the cache has {self.max_len}")
        self._chained = k + 1

    @torch.inference_mode()
    def verify(self, ids: torch.Tensor, positions: torch.Tensor | None = None,
               kv_len: int | None = None) -> torch.Tensor:
        """The verify forward of ``ids [M]`` int64, every KDA layer recording its state after each token; ``pos``
        stays until :meth:`commit`. Begins the verify (``begin_verify(M - 1)``) unless one of ``M`` tokens was
        begun. Returns final-normed hidden ``[M, H]``.

        ``positions [M]`` int64 on the device (default ``pos..pos+M-1``) and ``kv_len`` (default: the static span
        on CUDA, None on CPU) are given by a captured MTP round, which reads its positions from ``pos_buf``.

        Raises:
            ValueError: the verify would exceed ``max_len``. RuntimeError: a verify of another width is pending.
        """
        m = ids.shape[0]
        if self._verify is None:
            self.begin_verify(m - 1)
        start, width = self._verify
        if width != m:
            raise RuntimeError(f"begin_verify({width - 1}) announced {width} tokens, verify got {m}")
        for st in self._kda:           # (again: a captured round's body runs this at each capture call)
            st.history = []
        if positions is None:
            positions = torch.arange(start, start + m, device=self.device)
        if kv_len is None and self.static_kv:
            kv_len = self.kv_span(start + m)
        return self.model(ids.view(1, m).to(self.device), positions, self.state, kv_len)[0]

    def commit_state(self, n) -> None:
        """The device half of :meth:`commit`: every KDA state becomes the one recorded after verify token ``n``
        (int, or 0-d int64 tensor on the device: no host read, so a CUDA graph can capture it); recording stops.
        MLA caches need nothing (position-indexed).

        Raises:
            RuntimeError: no verify is pending. ValueError: an int ``n`` outside ``[0, M)``.
        """
        if self._verify is None:
            raise RuntimeError("commit without a verify (begin_verify / verify first)")
        if not isinstance(n, torch.Tensor) and not 0 <= n < self._verify[1]:
            raise ValueError(f"commit({n}): the verify has tokens 0..{self._verify[1] - 1}")
        if self._arena_history():
            # every layer's history is its slice of the shared [L, T, ...] buffers: one copy (an int n) or one
            # index_select (a device n) per tensor for all layers, instead of two or four launches per layer
            conv, rec = self._arena
            hc, hr = self._hist
            if isinstance(n, torch.Tensor) and hr.is_cuda and triton_kda.triton is not None:
                # a streaming copy of slot n (read on the device): about half the time of a one-index index_select
                triton_kda.select_slot(hc, n, conv)
                triton_kda.select_slot(hr, n, rec)
            elif isinstance(n, torch.Tensor):
                sel = n.view(1)
                torch.index_select(hc, 1, sel, out=conv.unsqueeze(1))
                torch.index_select(hr, 1, sel, out=rec.unsqueeze(1))
            else:
                conv.copy_(hc[:, n])
                rec.copy_(hr[:, n])
            for st in self._kda:
                st.history = None
            return
        for st in self._kda:
            st.rollback(n)

    def _arena_history(self) -> bool:
        """Whether the pending verify's history of every KDA layer lies in the shared buffers (the fused kernel
        wrote it there: ``state.history`` holds views of ``_hist``), so one launch can roll them all back. The
        torch path records clones instead, which each layer copies back itself."""
        if self._arena is None or self._hist is None:
            return False
        hc, hr = self._hist
        return all(st.history and len(st.history) <= hr.shape[1] and st.history[0][1].data_ptr() == hr[i].data_ptr()
                   and st.history[0][0].data_ptr() == hc[i].data_ptr() for i, st in enumerate(self._kda))

    def commit_length(self, n: int) -> None:
        """The host half of :meth:`commit`: the committed length becomes ``start + n + 1`` and the verify ends.

        Raises:
            RuntimeError: no verify is pending. ValueError: ``n`` outside ``[0, M)``.
        """
        if self._verify is None:
            raise RuntimeError("commit without a verify (begin_verify / verify first)")
        start, width = self._verify
        if not 0 <= n < width:
            raise ValueError(f"commit({n}): the verify has tokens 0..{width - 1}")
        chained = self._chained
        self._end_verify()
        self.pos = start + n + 1
        if chained is not None:         # the chained verify (already launched) now awaits its own commit
            self._verify = (self.pos, chained)

    def commit(self, n: int) -> None:
        """Keep the verify's tokens ``0..n`` (``n`` = accepted drafts: the bonus token's input ``y`` and ``n``
        drafts): KDA states roll back to the state after token ``n``, ``pos`` moves to ``start + n + 1``."""
        self.commit_state(n)
        self.commit_length(n)

    # ---- snapshots -----------------------------------------------------------------------------------------
    def snapshot(self) -> RunnerSnapshot:
        """Copies of the committed state (per layer its ``tensors()``; positional ones, the MLA caches, only the
        slots ``[0, pos)``) and ``pos``. Raises RuntimeError while a verify awaits its commit."""
        if self._verify is not None:
            raise RuntimeError("snapshot during a verify: commit first")
        pos = self.pos
        return RunnerSnapshot(pos, [{k: (v[:, :pos] if st.positional else v).clone()
                                     for k, v in st.tensors().items()} for st in self.state])

    def restore(self, snap: RunnerSnapshot) -> None:
        """Put ``snap`` back in place (the tensors keep their addresses, so captured graphs stay valid) and end
        any pending verify."""
        for st, saved in zip(self.state, snap.tensors):
            for k, v in st.tensors().items():
                (v[:, :snap.pos] if st.positional else v).copy_(saved[k])
        self._end_verify()
        self.pos = snap.pos
