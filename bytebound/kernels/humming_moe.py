"""Backend ``humming`` of op ``moe``: humming-kernels (vLLM/inclusionAI "Humming") W4A16 MXFP4 grouped GEMMs with
*our* routing and an on-GPU moe-align.

Per call (any M; the engine's decode, verify and prefill):

1. :func:`moe_align` turns ``ids [M, k]`` into humming's ``indexed`` layout - ``sorted_ids`` (flat slot indices
   ``token*k + j`` grouped by expert, each expert's run padded to the kernel's ``block_m`` with the value
   ``M*k``), ``expert_ids`` (one per ``block_m`` rows) and ``num_tokens_padded`` - with a fixed number of torch
   ops on fixed-size buffers: no Python loop over experts, no ``.item()``/``bincount`` (which would sync), so it
   can be captured in a CUDA graph. Buffers are sized for the worst case ``M*k + min(E, M*k)*(block_m-1)``.
2. gate/up GEMM ``[M, H] -> [M*k, 2I]`` (indexed, top_k=k), SwiGLU (optional clamp) in torch, down GEMM
   ``[M*k, I] -> [M*k, H]`` (indexed, top_k=1), then the routing-weighted sum over k in float32.

Bind cost: two ``HummingLayer`` objects per MoE layer holding humming's repacked copy of the experts
(``transform()``): +1 x the layer's expert bytes of GPU memory (1.6 GB per Ling layer) while the module keeps
its checkpoint-layout tensors for the other backends, plus a short peak during the repack. Kernels are
compiled by NVRTC on first use per (M, GEMM) (the tuning config is humming's heuristic for that M, pinned per
M so the moe-align block size is known); cubins are cached under ``$HUMMING_CACHE_DIR`` (default
``~/.humming/cache``). Version pinned: :data:`HUMMING_VERSION`.
"""

from __future__ import annotations

import torch

from bytebound.errors import BackendError
from bytebound.kernels.registry import cuda_only, pinned_package, register
from bytebound.layers.moe import swiglu

HUMMING_VERSION = "0.1.20"


def available(dev) -> str | None:
    why = cuda_only(dev) or pinned_package("humming-kernels", HUMMING_VERSION)
    if why:
        return why
    try:
        import humming  # noqa: F401
        from humming.layer import HummingLayer  # noqa: F401
    except Exception as exc:
        return f"humming is not importable: {exc}"
    return None


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indexed-GEMM layout of ``ids [M, k]`` for blocks of ``block_m`` rows, on the device, without host sync.

    Returns ``(sorted_ids int32 [P], expert_ids int32 [P // block_m], num_tokens_padded int32 [1])`` with ``P =
    M*k + min(E, M*k) * (block_m - 1)`` rounded up to a multiple of ``block_m``; rows past
    ``num_tokens_padded`` hold the pad value ``M*k`` and their blocks point at the last expert (never run).
    """
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    t = flat.numel()
    cap = t + min(num_experts, t) * (block_m - 1)
    cap = -(-cap // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)                                  # inclusive end of each expert's run
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    sorted_e, order = torch.sort(flat, stable=True)
    rank = torch.arange(t, device=dev) - cnt_start[sorted_e]
    dest = pad_start[sorted_e] + rank
    sorted_ids = torch.full((cap,), t, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_row = torch.arange(0, cap, block_m, device=dev)
    expert_ids = torch.searchsorted(pad_end, block_row, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    num_tokens_padded = pad_end[-1:].to(torch.int32)
    return sorted_ids, expert_ids, num_tokens_padded


class HummingMoE:
    """The bound callable: two transformed ``HummingLayer``s (w13, w2) plus per-M tuning configs."""

    def __init__(self, ex):
        """Repack ``ex``'s MXFP4 experts into humming's layout (two ``HummingLayer``s).

        Raises:
            BackendError: experts not MXFP4 or not on a CUDA device, or the GPU out of memory for the repack
                (named, with the layer's bytes and the free memory)."""
        if ex.fmt != "mxfp4":
            raise BackendError(f"moe[humming] needs MXFP4 experts, got fmt={ex.fmt!r}")
        if ex.w13.device.type != "cuda":
            raise BackendError("moe[humming] needs the experts on a CUDA device")
        from humming.layer import HummingLayer
        self.e, self.h, self.i, self.limit = ex.n, ex.hidden, ex.inter, ex.limit
        dev = ex.w13.device
        oom = None
        try:
            with torch.cuda.device(dev), torch.device(dev):
                self.l13 = HummingLayer(shape_n=2 * self.i, shape_k=self.h, weight_config={"quant_method": "mxfp4"},
                                        num_experts=self.e, torch_dtype=torch.bfloat16)
                self.l13.load_from_tensors({"weight": ex.w13.data, "weight_scale": ex.w13_scale.data})
                self.l13.transform()
                self.l2 = HummingLayer(shape_n=self.h, shape_k=self.i, weight_config={"quant_method": "mxfp4"},
                                       num_experts=self.e, torch_dtype=torch.bfloat16)
                self.l2.load_from_tensors({"weight": ex.w2.data, "weight_scale": ex.w2_scale.data})
                self.l2.transform()
        except torch.OutOfMemoryError as exc:
            oom = str(exc).split(". ")[0]      # leave the except block first: its traceback holds the partial repack
        if oom is not None:
            self.l13 = self.l2 = None          # the half-built layers: free them before the error travels up
            need = sum(t.numel() * t.element_size() for t in (ex.w13, ex.w13_scale, ex.w2, ex.w2_scale))
            free, total = torch.cuda.mem_get_info(dev)
            raise BackendError(f"moe[humming]: out of GPU memory repacking a layer's experts ({oom}); humming keeps "
                               f"its own copy beside the checkpoint layout, {need / 2**30:.2f} GiB a layer, with "
                               f"{free / 2**30:.2f} of {total / 2**30:.2f} GiB free on {dev}")
        self.device = dev
        self._cfg: dict[tuple[int, str], dict] = {}

    def tuning(self, m: int, which: str) -> dict:
        """humming's heuristic config for ``m`` tokens (indexed), pinned per M so block_m is known."""
        key = (m, which)
        if key not in self._cfg:
            from humming.tune import get_heuristics_config
            layer = self.l13 if which == "w13" else self.l2
            self._cfg[key] = get_heuristics_config(layer.humming_config, shape_m=m, gemm_type="indexed",
                                                   device=self.device)
        return self._cfg[key]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = ids.shape
        if x.dtype != torch.bfloat16:
            raise BackendError(f"moe[humming] needs bf16 activations, got {x.dtype}")
        c13, c2 = self.tuning(m, "w13"), self.tuning(m, "w2")
        bm13, bm2 = c13["block_shape"][0], c2["block_shape"][0]
        compute = {"gemm_type": "indexed"}
        sid, eid, ntp = moe_align(ids, self.e, bm13)
        h = self.l13(x.contiguous(), sorted_ids=sid, expert_ids=eid, num_tokens_padded=ntp, top_k=k,
                     compute_config=compute, tuning_config=c13)                       # [M*k, 2I]
        a = swiglu(h[:, :self.i], h[:, self.i:], self.limit).contiguous()            # [M*k, I]
        if bm2 != bm13:
            sid, eid, ntp = moe_align(ids, self.e, bm2)
        o = self.l2(a, sorted_ids=sid, expert_ids=eid, num_tokens_padded=ntp, top_k=1,
                    compute_config=compute, tuning_config=c2)                          # [M*k, H]
        return (o.view(m, k, self.h).float() * w.float()[..., None]).sum(1).to(x.dtype)


@register("moe", "humming", available)
class HummingMoEBackend:
    """humming-kernels MXFP4 W4A16 (indexed grouped GEMM) with on-GPU moe-align; any M."""
    name = "humming"

    def bind(self, ex, dtype):
        if dtype != torch.bfloat16:
            raise BackendError(f"moe[humming] runs in bf16, model dtype is {dtype}")
        return HummingMoE(ex)
