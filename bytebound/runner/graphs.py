"""CUDA-graph capture of the whole batch-1 decode step (embedding -> 42 layers -> final norm), and of the token
that follows it (LM head -> argmax, or the request's sampling).

Static buffers: the input token and the position live in device tensors the graph reads; the runner writes
them before each replay (``copy_``), so no host-computed position is baked into the graph. KDA states and MLA
caches are updated in place by the captured kernels. Attention spans a static number of slots (one graph per
span in ``runner.kv_buckets``; by default one span, ``max_len``) masked by
position, exactly as the eager CUDA path does, so replay equals eager bit for bit.

**The next token, captured too** (:meth:`DecodeGraph.replay_token`). A plain decode step used to leave the LM head
and the sampling to eager torch: at batch 1 that is two dozen small launches per token (softmax, sorts, cumsums,
the inverse-CDF draw), host time the GPU waits for. Per span two more graphs read the step's hidden buffer: the
head and ``argmax`` (greedy), and the head, ``sampling.probs_device`` (the settings in ``SamplingBuffers``) and
``sampling.inverse_cdf`` with its uniform in a buffer (sampling). The uniform is drawn from the request's
generator by the same call ``sampling.draw`` makes, just before the replay, so a token equals the eager
``sample(logits(h), p, gen)`` bit for bit (``probs_device`` equals ``probs``: tests/gpu/test_engine_gpu.py).
"""

from __future__ import annotations

import torch

from bytebound.sampling import SamplingBuffers, SamplingParams, inverse_cdf, probs_device


def capture_graph(fn, warmup: int = 2, between=None, pool=None):
    """Capture one call of ``fn()`` in a CUDA graph. ``warmup`` calls run first on a side stream (Triton JIT and
    autotuning must not happen inside a capture), each followed by ``between()`` when given (e.g. restoring the
    buffers ``fn`` advances). ``pool``: a memory pool (``torch.cuda.graph_pool_handle()``) shared with other
    graphs that never replay concurrently, so their temporaries reuse one allocation. Returns ``(graph, output of
    the captured call)``; the output is the graph's static buffer, rewritten by each ``graph.replay()``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(warmup):
            fn()
            if between is not None:
                between()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool), torch.inference_mode():
        out = fn()
    return g, out


class DecodeGraph:
    """The captured decode step, one graph per attention span in ``runner.kv_buckets``. ``replay(token [1], pos)``
    -> final-normed hidden ``[1, H]`` (a static buffer of the bucket's graph); :meth:`replay_token` also runs the
    captured head and token choice (module docstring).

    Args:
        runner: the ``ModelRunner`` (CUDA). warmup: eager calls before each capture. tokens: also capture the
            greedy and sampled token graphs per span (off: hidden states only, e.g. benchmarks of the step).

    ``captured_shapes`` lists what was captured, for the start-up manifest.
    """

    def __init__(self, runner, warmup: int = 2, tokens: bool = True):
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
        # the token graphs: (span, "greedy" | "sampled") -> (graph, next token [1] int64, a static buffer)
        self.sp = SamplingBuffers(dev)
        self.u = torch.zeros(1, 1, dtype=torch.float64, device=dev)
        self._written: tuple | None = None          # the settings in ``sp`` (written when a request changes them)
        self.token_graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if tokens:
            # one pool for every token graph: they replay one at a time, and a head whose logits path makes a
            # weight-sized temporary (the FP32-logits head: 1.6 GB at full scale) holds it once, not per graph
            pool = torch.cuda.graph_pool_handle()
            for span, (_, hidden) in self.graphs.items():
                self.token_graphs[span, "greedy"] = capture_graph(
                    lambda: model.lm_head.argmax(hidden).view(1), warmup, pool=pool)
                self.token_graphs[span, "sampled"] = capture_graph(
                    lambda: inverse_cdf(probs_device(model.logits(hidden), self.sp), self.u).view(1), warmup,
                    pool=pool)
            self.captured_shapes += [{"op": "decode_token", "sampling": kind, "kv_slots": span}
                                     for span, kind in self.token_graphs]

    def _body(self, model, span: int):
        h = model(self.tok.view(1, 1), self.pos, self.runner.state, span)
        return h[0]

    def replay(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        g, hidden = self.graphs[self.runner.kv_span(pos + 1)]
        self.tok.copy_(token.view(1), non_blocking=True)
        self.pos.fill_(pos)
        g.replay()
        return hidden

    def replay_token(self, token: torch.Tensor, pos: int, p: SamplingParams,
                     gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step of ``token [1]`` at ``pos`` and the token after it: ``(next [1] int64, hidden [1, H])``,
        both static buffers, no host read: valid until the next call, of any span or kind (the token graphs share
        one pool, so a graph captured later may keep its output where an earlier one keeps temporaries). ``token``
        may be the previous call's ``next``: it is copied in before any graph replays. Sampling draws its one
        float64 uniform from ``gen`` as ``sampling.draw`` does.

        Raises:
            KeyError: the token graphs were not captured (``tokens=False``)."""
        span = self.runner.kv_span(pos + 1)
        kind = "greedy" if p.greedy else "sampled"
        tg, nxt = self.token_graphs[span, kind]
        if kind == "sampled":
            key = (float(p.temperature), float(p.top_p), int(p.top_k))
            if key != self._written:
                self.sp.write(p)
                self._written = key
            self.u.copy_(torch.rand(1, 1, generator=gen, device=self.u.device, dtype=torch.float64))
        hidden = self.replay(token, pos)
        tg.replay()
        return nxt, hidden


def capture_decode(runner, tokens: bool = True) -> DecodeGraph:
    """Capture the decode step of ``runner`` (CUDA only) and install it (``runner.graph``); ``tokens``: also the
    next-token graphs (``DecodeGraph``; off for a benchmark that times the step alone)."""
    if runner.device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    runner.graph = None
    g = DecodeGraph(runner, tokens=tokens)
    runner.graph = g
    return g
