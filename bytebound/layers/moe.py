"""MoE block of Ling-3.0: sigmoid router with expert bias and group-limited top-k, routed + shared experts.

Routing (DeepSeek-V3 ``noaux_tc``; ``docs/references.md`` §1.6, transformers ``DeepseekV3TopkRouter``):

    s     = sigmoid(x W_gate^T)            (float32: router_dtype fp32)
    sb    = s + expert_bias                (the bias only *selects*)
    group = sum of the top-2 sb per group; keep topk_group groups; ids = top-k of sb inside them
    w     = s[ids] / (sum s[ids] + 1e-20)  (when norm_topk_prob)  * routed_scaling_factor
    y     = sum_k w_k SwiGLU_{ids_k}(x) + SwiGLU_shared(x)         (shared expert unscaled)

SwiGLU with an optional clamp L (``expert_swiglu_limit_list``): ``silu(gate).clamp(max=L) * up.clamp(-L, L)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bytebound.layers.linear import QLinear


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with ``limit``: ``silu(gate).clamp(max=limit) * up.clamp(-limit, limit)``."""
    a = F.silu(gate)
    if limit is not None:
        a = a.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return a * up


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
          norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited sigmoid routing. ``logits [M, E]`` float32 -> ``(ids [M, k] int64, weights [M, k] float32)``."""
    s = torch.sigmoid(logits.float())
    sb = s + bias.float() if bias is not None else s
    m, e = sb.shape
    if n_group > 1:
        grp = sb.view(m, n_group, e // n_group).topk(2, -1).values.sum(-1)   # [M, G]
        keep = grp.topk(topk_group, -1, sorted=False).indices
        gmask = torch.zeros_like(grp, dtype=torch.bool).scatter_(1, keep, True)
        sb = sb.masked_fill(~gmask.repeat_interleave(e // n_group, 1), float("-inf"))
    ids = sb.topk(top_k, -1, sorted=False).indices
    w = s.gather(1, ids)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scale


class _AfterNorm:
    """``add_norm_forward``: a decoder block's MLP with the residual add and norm before it."""

    def add_norm_forward(self, norm, delta: torch.Tensor | None, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x, h' = norm.add_norm(delta, h)`` then this MLP on x: returns ``(h', mlp(x))``, all ``[..., H]``
        (``layers.norm.RMSNorm.add_norm``; :class:`MoE` may fold the add and norm into its router launch)."""
        x, h = norm.add_norm(delta, h)
        return h, self(x)


class DenseMLP(_AfterNorm, nn.Module):
    """SwiGLU MLP ``down(silu(gate x) * up x)``: dense layers (intermediate 6144) and the shared expert (768)."""

    def __init__(self, hidden: int, inter: int, lin_fmt, block, dtype, device, limit: float | None = None):
        super().__init__()
        self.gate_proj = QLinear(hidden, inter, lin_fmt("gate_proj"), block, dtype, device)
        self.up_proj = QLinear(hidden, inter, lin_fmt("up_proj"), block, dtype, device)
        self.down_proj = QLinear(inter, hidden, lin_fmt("down_proj"), block, dtype, device)
        self.limit = limit
        # gate|up as one projection (rows of one weight, ``linear.fuse_rows``), bound at load on CPU by
        # ``runner.backends.bind_model``: one product of the shared input instead of two; None: two projections
        self.gate_up_fn = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_fn is not None:
            gate, up = self.gate_up_fn(x).chunk(2, -1)
            return self.down_proj(swiglu(gate, up, self.limit))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class RoutedExperts(nn.Module):
    """All routed experts of one layer, stacked (loaded from per-expert checkpoint tensors).

    ``fmt == "mxfp4"``: ``w13 uint8 [E, 2I, H/2]`` (rows 0..I-1 = gate_proj, I..2I-1 = up_proj),
    ``w13_scale uint8 [E, 2I, H/32]`` (E8M0), ``w2 uint8 [E, H, I/2]``, ``w2_scale uint8 [E, H, I/32]``.
    ``fmt == "plain"``: ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in the model dtype.
    The math runs in the ``moe`` backend bound at load (``self.fn``); unbound it is the torch reference.
    """

    def __init__(self, n: int, hidden: int, inter: int, fmt: str, dtype, device, limit: float | None):
        super().__init__()
        self.n, self.hidden, self.inter, self.fmt, self.limit = n, hidden, inter, fmt, limit
        if fmt == "mxfp4":
            u8 = dict(dtype=torch.uint8, device=device)
            self.w13 = nn.Parameter(torch.zeros(n, 2 * inter, hidden // 2, **u8), requires_grad=False)
            self.w13_scale = nn.Parameter(torch.full((n, 2 * inter, hidden // 32), 127, **u8), requires_grad=False)
            self.w2 = nn.Parameter(torch.zeros(n, hidden, inter // 2, **u8), requires_grad=False)
            self.w2_scale = nn.Parameter(torch.full((n, hidden, inter // 32), 127, **u8), requires_grad=False)
        elif fmt == "plain":
            self.w13 = nn.Parameter(torch.empty(n, 2 * inter, hidden, dtype=dtype, device=device))
            self.w2 = nn.Parameter(torch.empty(n, hidden, inter, dtype=dtype, device=device))
        else:
            raise ValueError(f"routed expert format {fmt!r} is not supported (mxfp4 or plain)")
        self.fn = None
        self.backend: str | None = None

    def shared_in(self, m: int, k: int) -> bool:
        """Whether the bound backend's output for ``m`` tokens (top-``k``) already includes the layer's shared
        expert (``MoEKernel.bind_shared``: the ``split`` kernels run it as one more slot), so the layer must not
        add it again."""
        f = getattr(self.fn, "shared_for", None)
        return f is not None and f(m, k)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [M, H]``, ``ids [M, k]``, ``w [M, k]`` float32 -> weighted routed sum ``[M, H]`` in x's dtype (plus
        the shared expert where :meth:`shared_in` says so)."""
        if self.fn is not None:
            return self.fn(x, ids, w)
        from bytebound.kernels.torch_ref import moe_reference
        return moe_reference(self, x, ids, w)


class MoE(_AfterNorm, nn.Module):
    """Router + routed experts + shared expert of one layer (names follow the checkpoint: ``mlp.gate``,
    ``mlp.experts``, ``mlp.shared_experts``)."""

    def __init__(self, cfg, layer: int, lin_fmt, dtype, device):
        super().__init__()
        h = cfg.hidden_size
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.gate = nn.Module()
        # router_dtype fp32 (the Ling checkpoints): the router weight stays float32 whatever the model dtype, as
        # stored, so routing decisions are not made on BF16-rounded weights and no per-call up-cast is needed.
        gdt = torch.float32 if str(cfg.router_dtype).lower() in ("fp32", "float32") else dtype
        self.gate.weight = nn.Parameter(torch.empty(cfg.num_experts, h, dtype=gdt, device=device))
        # Bound at load by runner.backends.bind_model (the plan's ``router`` entry): a routing kernel after the GEMV
        # (``route_fn``, kernels.triton_router.fused_route) or the GEMV and the routing in one kernel
        # (``gemv_route_fn``, gemv_route), for calls of at most ``route_m`` rows (decode, verify); wider calls
        # (prefill) and an unbound layer run the torch GEMV and :func:`route`.
        self.route_fn = None
        self.gemv_route_fn = None
        self.route_m = 0
        # the same with the post-attention residual add + RMSNorm folded in (kernels.triton_router.
        # gemv_route_add_norm), bound with the fused norms and the router GEMV: add_norm_forward
        self.gemv_add_norm_fn = None
        self.gate.expert_bias = (nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32, device=device))
                                 if cfg.moe_router_enable_expert_bias else None)
        fmt = {"mxfp4": "mxfp4"}.get(cfg.quant.routed_experts, "plain")
        self.experts = RoutedExperts(cfg.num_experts, h, cfg.moe_intermediate_size, fmt, dtype, device,
                                     cfg.swiglu_limit(layer))
        self.shared_experts = (DenseMLP(h, cfg.shared_intermediate, lin_fmt, cfg.quant.weight_block_size, dtype,
                                        device, cfg.swiglu_limit(layer, shared=True))
                               if cfg.num_shared_experts else None)

    def router(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [M, H]`` -> ``(ids [M, k], weights [M, k])``; logits in float32. For M <= ``route_m`` the bound
        ``gemv_route_fn`` replaces the GEMV and the routing together, or ``route_fn`` replaces :func:`route` (the
        binding sets at most one and ``route_m``; this is the one place that chooses by M)."""
        fast = x.shape[0] <= self.route_m
        if fast and self.gemv_route_fn is not None:
            return self.gemv_route_fn(x, self.gate.weight, self.gate.expert_bias, self.top_k, self.n_group,
                                      self.topk_group, self.norm, self.scale)
        logits = F.linear(x.float(), self.gate.weight.float())      # .float(): no-op for an fp32 router
        fn = self.route_fn if (fast and self.route_fn is not None) else route
        return fn(logits, self.gate.expert_bias, self.top_k, self.n_group, self.topk_group, self.norm, self.scale)

    def add_norm_forward(self, norm, delta: torch.Tensor | None, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``_AfterNorm.add_norm_forward`` (``(h', moe(norm(h')))`` with ``h' = h + delta``); with
        ``gemv_add_norm_fn`` bound and at most ``route_m`` rows the add and the norm run inside the router's
        launch, which also writes h' and the normed x for the experts."""
        fn, d = self.gemv_add_norm_fn, h.shape[-1]
        if fn is None or delta is None or delta.shape != h.shape or delta.dtype != h.dtype \
                or h.numel() > self.route_m * d:
            return super().add_norm_forward(norm, delta, h)
        ids, w, x, h2 = fn(delta.reshape(-1, d), h.reshape(-1, d), norm.weight, norm.eps, self.gate.weight,
                           self.gate.expert_bias, self.top_k, self.n_group, self.topk_group, self.norm, self.scale)
        return h2.view(h.shape), self(x.view(h.shape), (ids, w))

    def forward(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``; ``routing``: ``(ids, w)`` already computed for x's rows (by the router
        launch of :meth:`add_norm_forward`), else :meth:`router` runs."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        ids, w = self.router(x2) if routing is None else routing
        y = self.experts(x2, ids, w)
        if self.shared_experts is not None and not self.experts.shared_in(x2.shape[0], self.top_k):
            y = y + self.shared_experts(x2)
        return y.view(shape)
