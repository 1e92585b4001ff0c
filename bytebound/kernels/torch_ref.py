"""The ``torch`` backend of every op: plain PyTorch, any device, the numerical reference for the others."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bytebound.kernels.registry import register
from bytebound.layers.lm_head import bf16_logits
from bytebound.layers.moe import swiglu
from bytebound.quant import dequantize_mxfp4, quantize_fp8_token

GATHER_MAX_ROWS = 64        # token x top-k rows up to which the MoE gathers expert weights (sync-free)
MATERIALIZE_MAX_BYTES = 2 << 30


def _expert_weights(ex, idx: torch.Tensor, dtype):
    """Dequantised ``(w13 [n, 2I, H], w2 [n, H, I])`` of experts ``idx`` in ``dtype``."""
    if ex.fmt == "plain" or getattr(ex, "_deq", None) is not None:
        w13, w2 = ex._deq if getattr(ex, "_deq", None) is not None else (ex.w13, ex.w2)
        return w13[idx].to(dtype), w2[idx].to(dtype)
    return (dequantize_mxfp4(ex.w13[idx], ex.w13_scale[idx], dtype, check=False),
            dequantize_mxfp4(ex.w2[idx], ex.w2_scale[idx], dtype, check=False))


def _resident(ex) -> bool:
    """Whether every expert's weights are stored in the compute form (plain, or dequantised once at bind)."""
    return ex.fmt == "plain" or getattr(ex, "_deq", None) is not None


class _PlainExperts:
    """``experts[e] -> (w13[e] [2I, H], w2[e]^T [I, H])`` of plain parameters, indexed at each use (so autograd
    sees the parameters)."""

    def __init__(self, ex):
        self.ex = ex

    def __getitem__(self, e: int):
        return self.ex.w13[e], self.ex.w2[e].t()


def _moe_rows_cpu(ex, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """CPU form of the few-row routed sum: one GEMV pair per (token, slot) on *views* of the resident expert
    weights, accumulated in slot order. Gathering the chosen experts first (the sync-free CUDA form) copies
    ``k * 3 * H * I`` weights per call, which on a CPU costs more than the products themselves, while reading the
    expert ids on the host costs nothing there. Same maths as the gather form: per row SwiGLU of ``x W13^T``, then
    ``W2``, then the float32 sum over the k slots weighted by ``w``. ``x [M, H]``, ``ids [M, k]`` int64,
    ``w [M, k]`` float32 -> ``[M, H]`` in x's dtype. Each row's arithmetic is independent of M."""
    deq = getattr(ex, "_deq", None)
    if deq is not None:             # per-expert (w13 [2I, H], w2^T [I, H]) views of the bind-time copy, built once
        views = ex.__dict__.get("_cpu_views")
        if views is None or views[0] is not deq:
            views = ex.__dict__["_cpu_views"] = (deq, [(deq[0][e], deq[1][e].t()) for e in range(ex.n)])
        experts = views[1]
    else:                           # plain parameters (may be trained): index them per call
        experts = _PlainExperts(ex)
    dtype, limit = x.dtype, ex.limit
    rows = []
    for t, (row_ids, row_w) in enumerate(zip(ids.tolist(), w.tolist())):
        xt = x if len(ids) == 1 else x[t:t + 1]
        acc = None
        for e, we in zip(row_ids, row_w):
            w13, w2t = experts[e]
            g, u = F.linear(xt, w13).chunk(2, -1)
            a = swiglu(g, u, limit)
            if dtype == torch.float32:
                # acc + w * (a W2^T) in one product (w: a float32 value, exact as a Python float); with beta = 0
                # the first slot ignores the input tensor it is handed for its shape
                acc = torch.addmm(xt if acc is None else acc, a, w2t, beta=0 if acc is None else 1, alpha=we)
            else:
                o = (a @ w2t).float() * we
                acc = o if acc is None else acc + o
        rows.append(acc)
    return (rows[0] if len(rows) == 1 else torch.cat(rows, 0)).to(dtype)


def _moe_rows_traced(ex, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The few-row routed sum in a form torch.compile traces without host syncs: the chosen experts' rows are
    indexed inside elementwise products reduced over the input dimension, which inductor fuses into one loop that
    reads the rows in place (no gathered copy, no ``.tolist()``). ``x [M, H]``, ``ids [M, k]`` int64, ``w [M, k]``
    float32 -> ``[M, H]`` in x's dtype. Same maths as :func:`_moe_rows_cpu`; the summation order differs."""
    # ``_traced_deq``: the resident experts in bfloat16 where that is exact (E2M1 x E8M0 values; runner.cpu_compile),
    # half the bytes of the float32 copy for the same products
    deq = getattr(ex, "_traced_deq", None) or getattr(ex, "_deq", None)
    w13, w2 = deq if deq is not None else (ex.w13, ex.w2)
    h = (w13[ids].to(x.dtype) * x[:, None, None, :]).sum(-1)              # [M, k, 2I]
    a = swiglu(h[..., :ex.inter], h[..., ex.inter:], ex.limit)            # [M, k, I]
    o = (w2[ids].to(x.dtype) * a[:, :, None, :]).sum(-1)                   # [M, k, H]
    return (o.float() * w[..., None]).sum(1).to(x.dtype)


def moe_reference(ex, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Routed-expert sum ``y[m] = sum_j w[m, j] * SwiGLU_{ids[m, j]}(x[m])``; ``x [M, H]`` -> ``[M, H]``.

    Few rows (decode/verify): gather the chosen experts and batch them (no host sync, graph-capturable).
    Many rows (prefill/training): loop over the experts that were hit, each once (differentiable).
    """
    m, k = ids.shape
    inter = ex.inter
    if m * k <= GATHER_MAX_ROWS and x.device.type == "cpu" and _resident(ex):
        if torch.compiler.is_compiling():
            return _moe_rows_traced(ex, x, ids, w)
        return _moe_rows_cpu(ex, x, ids, w)
    if m * k <= GATHER_MAX_ROWS:
        w13, w2 = _expert_weights(ex, ids.reshape(-1), x.dtype)            # [Mk,2I,H], [Mk,H,I]
        xs = x.repeat_interleave(k, 0)
        h = torch.bmm(w13, xs[:, :, None])[..., 0]
        a = swiglu(h[:, :inter], h[:, inter:], ex.limit)
        o = torch.bmm(w2, a[:, :, None])[..., 0].view(m, k, -1)
        return (o.float() * w[..., None]).sum(1).to(x.dtype)
    y = torch.zeros(m, x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids)
    counts = torch.bincount(flat_ids, minlength=ex.n).tolist()
    tok = (order // k)
    wt = w.reshape(-1)[order]
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        t = tok[start:start + c]
        w13, w2 = _expert_weights(ex, torch.tensor([e], device=x.device), x.dtype)
        h = x[t] @ w13[0].t()
        a = swiglu(h[:, :inter], h[:, inter:], ex.limit)
        y = y.index_add(0, t, (a @ w2[0].t()).float() * wt[start:start + c, None])
        start += c
    return y.to(x.dtype)


def shared_expert_reference(mlp, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The shared expert ``down(SwiGLU(gate x, up x))`` (``layers.moe.DenseMLP``) from its dequantised weights in
    ``dtype``, bypassing any bound linear backend: ``x [M, H]`` -> ``[M, H]`` in ``dtype``. The reference for a
    shared expert run inside the routed kernels (float32: the start-up canary; float64: the kernel tests)."""
    xd = x.to(dtype)
    g, u, d = (lin.dequantized(dtype) for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    return swiglu(xd @ g.t(), xd @ u.t(), mlp.limit) @ d.t()


def lm_head_reference(head, x: torch.Tensor) -> torch.Tensor:
    """LM head per ``head.mode``: ``x [M, H]`` -> float32 logits ``[M, V]``."""
    if head.mode == "fp32":
        return F.linear(x.float(), head.weight.float())
    if head.mode == "fp8":
        xq, sx = quantize_fp8_token(x)
        if x.is_cuda:
            # FP8 tensor-core product (cuBLASLt, sm89+) with unit tensor-wise scales and a float32 output; the
            # per-token and per-channel scales are applied after. (cuBLASLt's row-wise scaling would force a
            # bf16 output, i.e. logits rounded to 3 significant digits - enough to flip near-ties.)
            one = torch.ones((), dtype=torch.float32, device=x.device)
            raw = torch._scaled_mm(xq, head.w_fp8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            return raw * sx[:, None].float() * head.w_scale[None, :].float()
        return (xq.float() @ head.w_fp8.float().t()) * sx[:, None] * head.w_scale[None, :]
    return bf16_logits(head.weight, x)


# ---- registered backends ------------------------------------------------------------------------
def traced_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x W^T`` as an elementwise product reduced over the input dimension, for torch.compile on a CPU: inductor
    turns it into one vectorised loop that reads ``w`` in its own dtype (bfloat16: half the bytes of float32) and
    multiplies and sums in float32. ``x [..., K]`` float32, ``w [N, K]`` -> ``[..., N]`` float32. With ``w`` holding
    exactly the values of the float32 weight, only the summation order differs from ``F.linear``."""
    return (x[..., None, :] * w.float()).sum(-1)


class BoundLinear:
    """The torch backend's bound projection: ``F.linear(x, weight)`` with ``weight [out, in]`` prepared once.

    ``traced``: None, or the same values in bfloat16 (set by ``runner.cpu_compile`` where the conversion is exact,
    e.g. dequantised E4M3 x power-of-two scales); the compiled CPU decode step then reads it through
    :func:`traced_linear`. Eager calls always use ``weight``."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.traced = weight, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.traced is not None and torch.compiler.is_compiling():
            return traced_linear(x, self.traced)
        return F.linear(x, self.weight)


class TorchLinear:
    """Dequantises FP8 block weights once to the compute dtype and calls ``F.linear`` (:class:`BoundLinear`)."""
    name = "torch"

    def bind(self, lin, dtype):
        return BoundLinear(lin.dequantized(dtype).contiguous())


class TorchMoE:
    """Gather/loop reference; small layers keep a dequantised copy (CPU speed), large ones dequantise per call."""
    name = "torch"

    def bind(self, ex, dtype):
        if ex.fmt == "mxfp4" and ex.n * 3 * ex.hidden * ex.inter * torch.finfo(dtype).bits // 8 <= MATERIALIZE_MAX_BYTES:
            ex._deq = (dequantize_mxfp4(ex.w13, ex.w13_scale, dtype), dequantize_mxfp4(ex.w2, ex.w2_scale, dtype))
        return lambda x, ids, w: moe_reference(ex, x, ids, w)


class TorchLMHead:
    name = "torch"

    def bind(self, head, dtype):
        return lambda x: lm_head_reference(head, x)


class TorchKDA:
    name = "torch"

    def bind(self, layer, dtype):
        from bytebound.layers.kda import torch_kda
        return torch_kda


class TorchMLA:
    name = "torch"

    def bind(self, layer, dtype):
        return None     # the layer's own absorbed/expanded torch code


class TorchSampling:
    name = "torch"

    def bind(self, *_):
        return None


register("linear", "torch")(TorchLinear)
register("moe", "torch")(TorchMoE)
register("lm_head", "torch")(TorchLMHead)
register("kda", "torch")(TorchKDA)
register("mla", "torch")(TorchMLA)
register("sampling", "torch")(TorchSampling)
