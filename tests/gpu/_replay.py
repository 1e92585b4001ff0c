"""The CUDA-graph replay == eager decode loops shared by the GPU tests (test_engine_gpu, test_fuse_gpu, test_kda_gpu,
test_mla_gpu). Each test keeps its own assertions and messages; these helpers only run the steps.

* :func:`replay_vs_eager`: on one runner with a captured decode graph, each step runs eager from a snapshot of the
  state, restores it and runs the graph replay from the same state (the start-up canary's pattern);
* :func:`greedy_logits`: the logits of greedy decode steps on one runner (eager, or its captured graph if it has
  one), for tests that compare a graph runner's steps with an eager runner's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


def replay_vs_eager(runner, tok: torch.Tensor, steps: int,
                    next_tok: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(eager, replay)`` for ``steps`` decode steps of ``runner`` (a ``ModelRunner`` whose decode graph is
    captured, ``runner.graph``): per step a snapshot of the state, the eager ``forward(tok)`` (graph detached),
    the state restored, then the graph's ``forward(tok)`` from the same state; both outputs cloned (hidden states
    ``[1, H]`` in the model's dtype). The next step's token is ``next_tok(replay)`` (``[1]`` int64), computed when
    the caller asks for the next pair, so a failing assertion stops the loop where it stood. The runner is left
    after the last replay, graph attached.

    Raises:
        ValueError: ``runner`` has no captured decode graph."""
    graph = runner.graph
    if graph is None:
        raise ValueError("replay_vs_eager: capture the runner's decode graph first (runner.graphs.capture_decode)")
    for _ in range(steps):
        snap = runner.snapshot()
        runner.graph = None
        eager = runner.forward(tok).clone()
        runner.restore(snap)
        runner.graph = graph
        replay = runner.forward(tok).clone()
        yield eager, replay
        tok = next_tok(replay)


def greedy_logits(model, runner, tok: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The logits (``model.logits`` of each step's hidden state, ``[1, 1, V]``, cloned) of ``steps`` greedy decode
    steps of ``runner`` from token ``tok`` (int64, one element, e.g. the argmax of the prefill's last
    logits); each step's token is the argmax of the previous step's logits. Eager or through ``runner``'s captured
    decode graph, whichever the runner has."""
    outs = []
    for _ in range(steps):
        lg = model.logits(runner.forward(tok.view(1))[None])
        outs.append(lg.clone())
        tok = lg.argmax(-1).view(1)
    return outs
