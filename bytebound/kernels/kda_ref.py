"""Pure-torch KDA (Kimi Delta Attention) in recurrent and chunked form: the CPU path and the test reference.

Recurrence per head (Kimi Linear, arXiv 2510.26692, eq. 1; ``docs/references.md`` §1.5), state ``S [K, V]``:

    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T ,   o_t = S_t^T (q_t / sqrt(K))

with q, k L2-normalised (``x / sqrt(sum x^2 + 1e-6)``, as fla and transformers do) and ``g_t`` the per-channel
log decay. Shapes: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, H, K]``, beta ``[B, T, H]``, state
``[B, H, K, V]`` float32. Everything is computed in float32.
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's form, not ``F.normalize``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent(q, k, v, g, beta, state: torch.Tensor | None = None, normalize_qk: bool = True):
    """Token-by-token KDA. Returns ``(o [B, T, H, V] float32, final state [B, H, K, V] float32)``."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if normalize_qk:
        q, k = l2norm(q), l2norm(k)
    b, t, h, dk = k.shape
    q = q * dk ** -0.5
    s = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=q.device) if state is None else state.float()
    if t == 1:
        # one decode token: the loop body below on [B, H, *, *] views (fewer ops; the same products and order)
        dv = v.shape[-1]
        s = s * g.exp().reshape(b, h, dk, 1)                                 # decay each key channel
        delta = (v.reshape(b, h, 1, dv) - k.reshape(b, h, 1, dk) @ s) * beta.reshape(b, h, 1, 1)  # b (v - S'^T k)
        s = s + k.reshape(b, h, dk, 1) * delta                               # rank-1 update
        return (q.reshape(b, h, 1, dk) @ s).reshape(b, 1, h, dv), s
    decay = g.exp()
    # [B, H, T, 1, K] rows for the matrix-vector products with S (batched matmuls: fewer ops than einsum per token)
    qr, kr = q.transpose(1, 2)[..., None, :], k.transpose(1, 2)[..., None, :]
    outs = []
    for i in range(t):
        s = s * decay[:, i, :, :, None]                                      # decay each key channel
        pred = (kr[:, :, i] @ s)[:, :, 0]                                    # S'^T k
        delta = (v[:, i] - pred) * beta[:, i, :, None]                       # b (v - S'^T k)
        s = s + k[:, i, :, :, None] * delta[:, :, None, :]                   # rank-1 update
        outs.append((qr[:, :, i] @ s)[:, :, 0])
    return torch.stack(outs, 1), s


def kda_chunked(q, k, v, g, beta, state: torch.Tensor | None = None, normalize_qk: bool = True,
                chunk: int = 64):
    """Chunk-parallel KDA (WY form), any T (the last chunk may be short); differentiable.

    Within a chunk starting from state S0, with ``G_t = cumsum(g)`` and ``A_tj = b_t sum_c k_t k_j
    exp(G_t - G_j)`` for ``j < t``:  ``(I + A) D = b V - b (exp(G) * K) S0`` gives the deltas ``D``;
    ``o_t = (exp(G_t) q_t)^T S0 + sum_{j<=t} (q_t . exp(G_t - G_j) k_j) D_j`` and
    ``S_C = exp(G_C) S0 + sum_j (exp(G_C - G_j) k_j) D_j^T``. Exponents are of non-positive differences,
    so nothing overflows. Same result as :func:`kda_recurrent` to float32 rounding.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if normalize_qk:
        q, k = l2norm(q), l2norm(k)
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    q = q * dk ** -0.5
    s = torch.zeros(b, h, dk, dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    # [B, H, T, *] layout for the chunk loop
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    beta = beta.transpose(1, 2)
    outs = []
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        n = c1 - c0
        qc, kc, vc, bc = q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1], beta[:, :, c0:c1]
        gc = g[:, :, c0:c1].cumsum(2)                                        # [B,H,n,K]
        diff = gc[:, :, :, None, :] - gc[:, :, None, :, :]                   # [B,H,n(t),n(j),K]
        tri = torch.ones(n, n, dtype=torch.bool, device=q.device)
        strict = torch.tril(tri, -1)
        incl = torch.tril(tri)
        decay = torch.where(incl[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
        a = torch.einsum("bhtk,bhtjk,bhjk->bhtj", kc, decay, kc) * bc[..., None]
        a = a * strict
        eye = torch.eye(n, device=q.device).expand_as(a)
        rhs = bc[..., None] * (vc - torch.einsum("bhtk,bhkv->bhtv", gc.exp() * kc, s))
        d = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)  # [B,H,n,V]
        qk = torch.einsum("bhtk,bhtjk,bhjk->bhtj", qc, decay, kc)          # causal incl. diagonal
        o = torch.einsum("bhtk,bhkv->bhtv", gc.exp() * qc, s) + qk @ d
        outs.append(o)
        last = gc[:, :, -1:, :]                                              # [B,H,1,K]
        s = last.transpose(2, 3).exp() * s + torch.einsum("bhjk,bhjv->bhkv", (last - gc).exp() * kc, d)
    o = torch.cat(outs, 2).transpose(1, 2)
    return o, s


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
             head_dim: int) -> torch.Tensor:
    """KDA log-decay ``g [.., H, K]`` from the raw ``f_proj`` output ``f [.., H*K]``.

    Safe gate (``kda_safe_gate``, fla ``naive_kda_lowerbound_gate``): ``lower_bound * sigmoid(exp(A_log) * (f +
    dt_bias))`` in (lower_bound, 0); otherwise ``-exp(A_log) * softplus(f + dt_bias)``. A_log ``[H]``,
    dt_bias ``[H*K]``; float32 out.
    """
    h = a_log.shape[0]
    x = (f.float() + dt_bias.float()).view(*f.shape[:-1], h, head_dim)
    rate = a_log.float().exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * torch.nn.functional.softplus(x)
