"""CUDA-graph capture of the whole batch-1 decode step (embedding -> 42 layers -> final norm).

Static buffers: the input token and the position live in device tensors the graph reads; the runner writes
them before each replay (``copy_``), so no host-computed position is baked into the graph. KDA states and MLA
caches are updated in place by the captured kernels. Attention spans a static number of slots (one graph per
span in ``runner.kv_buckets``; by default one span, ``max_len``) masked by
position, exactly as the eager CUDA path does, so replay equals eager bit for bit.
"""

from __future__ import annotations

import torch


def capture_graph(fn, warmup: int = 2, between=None):
    """Capture one call of ``fn()`` in a CUDA graph. ``warmup`` calls run first on a side stream (Triton JIT and
    autotuning must not happen inside a capture), each followed by ``between()`` when given (e.g. restoring the
    buffers ``fn`` advances). Returns ``(graph, output of the captured call)``; the output is the graph's static
    buffer, rewritten by each ``graph.replay()``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(warmup):
            fn()
            if between is not None:
                between()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.inference_mode():
        out = fn()
    return g, out


class DecodeGraph:
    """The captured decode step, one graph per attention span in ``runner.kv_buckets``. ``replay(token [1], pos)``
    -> final-normed hidden ``[1, H]`` (a static buffer of the bucket's graph).

    ``captured_shapes`` lists what was captured, for the start-up manifest.
    """

    def __init__(self, runner, warmup: int = 2):
        self.runner = runner
        dev = runner.device
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        snap = runner.snapshot()      # the warm-up and capture calls advance the states: put them back after each
        model = runner.model
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        for span in runner.kv_buckets:
            self.graphs[span] = capture_graph(lambda: self._body(model, span), warmup)
            runner.restore(snap)
        self.captured_shapes = [{"op": "decode", "tokens": 1, "kv_slots": span} for span in self.graphs]

    def _body(self, model, span: int):
        h = model(self.tok.view(1, 1), self.pos, self.runner.state, span)
        return h[0]

    def replay(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        g, hidden = self.graphs[self.runner.kv_span(pos + 1)]
        self.tok.copy_(token.view(1), non_blocking=True)
        self.pos.fill_(pos)
        g.replay()
        return hidden


def capture_decode(runner) -> DecodeGraph:
    """Capture the decode step of ``runner`` (CUDA only) and install it (``runner.graph``)."""
    if runner.device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    runner.graph = None
    g = DecodeGraph(runner)
    runner.graph = g
    return g
