"""Where do two runs of the same tokens (speculative and plain greedy) first route differently?

Why this exists: the verify (M = 4) and decode (M = 1) kernels round differently, so their hidden states differ at
the dtype's rounding (BF16: up to a few 1e-2 relative after many layers, float32: ~1e-6). Top-k routing turns such
a difference into a different expert whenever two experts' scores are closer than it, and with random ("dummy")
weights one swapped expert changes a MoE block's output by ~50 %: every later layer and token then differs. A
greedy divergence that starts at such a flip is rounding meeting a routing near-tie, not a bug in the MTP
machinery. A divergence whose first route flip sees router inputs that already differ beyond rounding, or that
shows no route flip at all, is something else. :func:`position_routes` records the routes of a run by absolute
position; :func:`first_route_flip` compares two such records.
"""

from __future__ import annotations

import contextlib

import torch

from bytebound.layers.moe import MoE


@contextlib.contextmanager
def position_routes(runner):
    """Record the routed experts of every token the runner's decoder layers process, by absolute position.

    Yields a dict ``position -> {layer index: (router input float32 [H], sorted expert ids int64 [k])}``. A later
    forward over the same position overwrites it, so after an MTP run each position holds the row of the round
    that committed it (rejected rows are always re-run by the next round). The NEXTN layer (the draft) is not
    recorded. The captured decode graph is detached meanwhile (a replay runs no Python; the ``graph_replay``
    canary checks replay == eager) and reattached afterwards."""
    routes: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    start = [0]
    moes = [(i, layer.mlp) for i, layer in enumerate(runner.model.decoder_layers) if isinstance(layer.mlp, MoE)]

    def record(i, x, ids):         # layer i routed rows x [M, H] to experts ids [M, k]
        xs, ss = x.float(), ids.sort(-1).values
        for r in range(x.shape[0]):
            routes.setdefault(start[0] + r, {})[i] = (xs[r].clone(), ss[r].clone())

    def wrap_router(i, m):
        orig = m.router

        def router(x):
            ids, w = orig(x)
            record(i, x, ids)
            return ids, w
        return router

    def wrap_fold(i, m):           # the post-attention add + norm folded into the router launch
        orig = m.gemv_add_norm_fn  # (MoE.add_norm_forward): its routing never calls m.router

        def fold(*args, **kw):
            ids, w, x, h = orig(*args, **kw)
            record(i, x, ids)
            return ids, w, x, h
        return fold

    def at_pos(orig):              # a forward or a verify starts at the committed length
        def call(*args, **kw):
            start[0] = runner.pos
            return orig(*args, **kw)
        return call

    # Wrappers are instance attributes; whatever instance attribute was there before (another wrapper) comes back
    # afterwards, else deleting ours re-exposes the class's method.
    folded = [(i, m) for i, m in moes if getattr(m, "gemv_add_norm_fn", None) is not None]
    saved = [(obj, name, obj.__dict__.get(name))
             for obj, name in [(runner, "forward"), (runner, "verify")] + [(m, "router") for _, m in moes]
             + [(m, "gemv_add_norm_fn") for _, m in folded]]
    graph, runner.graph = runner.graph, None
    runner.forward, runner.verify = at_pos(runner.forward), at_pos(runner.verify)
    for i, m in moes:
        m.router = wrap_router(i, m)
    for i, m in folded:
        m.gemv_add_norm_fn = wrap_fold(i, m)
    try:
        yield routes
    finally:
        for obj, name, prev in saved:
            if prev is None:
                del obj.__dict__[name]
            else:
                setattr(obj, name, prev)
        runner.graph = graph


def first_route_flip(a: dict, b: dict, positions) -> dict | None:
    """The first position (in ``positions`` order), then layer, where records ``a`` and ``b`` of
    :func:`position_routes` chose different experts: ``{"position", "layer", "input_rel_err"`` (of ``b``'s router
    input against ``a``'s), ``"experts_a", "experts_b"}``; None when all agree. Positions missing from either record
    are skipped."""
    for q in positions:
        if q not in a or q not in b:
            continue
        for layer in sorted(a[q]):
            if layer not in b[q]:
                continue
            (xa, ia), (xb, ib) = a[q][layer], b[q][layer]
            if not torch.equal(ia, ib):
                err = float((xb - xa).norm() / xa.norm().clamp(min=1e-30))
                return {"position": q, "layer": layer, "input_rel_err": err,
                        "experts_a": ia.tolist(), "experts_b": ib.tolist()}
    return None
