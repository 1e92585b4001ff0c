"""Batch-1 model runner: one request's state, prefill, decode and the M-token verify forward of MTP.

Positions are committed-length indices. MLA caches are position-indexed (no rollback needed); KDA states are
rolled back from per-token history recorded during verify (``KDAState.history``).
"""

from __future__ import annotations

import torch

from bytebound.layers.kda import KDAState

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


class ModelRunner:
    """Holds the model, one request's state and its committed length ``pos``.

    Args:
        model: a loaded ``BailingMoeV3ForCausalLM``. max_len: cache slots (prompt + output + draft room).
    """

    def __init__(self, model, max_len: int, device=None, kv_buckets: tuple[int, ...] | None = None):
        self.model, self.max_len = model, max_len
        self.device = torch.device(device or model.lm_head.weight.device)
        self.state = model.new_state(max_len, device=self.device)
        self.pos = 0
        # On CUDA every step attends over a static span of cache slots, masked by position: the same kernels as
        # the captured graph (bit-identical replay) and no host sync for the cache length. On CPU, slice instead.
        # The span is the smallest of ``kv_buckets`` that holds the sequence (default: one bucket, ``max_len``),
        # so a short sequence need not read all ``max_len`` slots; one decode graph is captured per bucket.
        self.static_kv = self.device.type == "cuda"
        self.kv_buckets = tuple(sorted({b for b in (kv_buckets or ()) if b < max_len} | {max_len}))
        self.graph = None       # a DecodeGraph once captured (runner.graphs)

    def reset(self) -> None:
        """Zero every state for a new request (buffers reused)."""
        for st in self.state:
            if isinstance(st, KDAState):
                st.conv.zero_()
                st.rec.zero_()
                st.history = None
        self.pos = 0

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

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Run ``ids [T]`` at positions ``pos..pos+T-1``, advance ``pos``; returns final-normed hidden ``[T, H]``."""
        t = ids.shape[0]
        self._check_room(t)
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
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole prompt in chunks of ``PREFILL_CHUNK`` tokens (the chunked KDA form inside each)."""
        outs = [self.forward(ids[i:i + PREFILL_CHUNK]) for i in range(0, ids.shape[0], PREFILL_CHUNK)]
        return torch.cat(outs, 0)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    @torch.inference_mode()
    def verify(self, ids: torch.Tensor) -> torch.Tensor:
        """Verify forward of ``ids [M]`` recording KDA state after each token; pair with :meth:`commit`."""
        for st in self.state:
            if isinstance(st, KDAState):
                st.history = []
        return self.forward(ids)

    def commit(self, n: int, verified: int) -> None:
        """Keep the first ``n`` of the last ``verified`` tokens: ``pos`` moves back and KDA states roll back to
        the state after token ``n - 1``; MLA slots past ``pos`` are simply overwritten later."""
        self.pos -= verified - n
        for st in self.state:
            if isinstance(st, KDAState):
                st.rollback(n - 1)
