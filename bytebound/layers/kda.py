"""Kimi Delta Attention layer (Ling-3.0 linear-attention layers; ``docs/references.md`` §1.5).

    q, k, v = SiLU(causal_conv_k4(q_proj x | k_proj x | v_proj x))     # depthwise, per channel
    g       = lower_bound * sigmoid(exp(A_log) * (f_proj x + dt_bias))  # safe gate, log decay in (lb, 0)
    beta    = sigmoid(b_proj x)
    o       = KDA(l2norm q, l2norm k, v, g, beta)                       # delta rule, state [H, K, V] fp32
    out     = o_proj(RMSNormGated(o, g_proj x))

Per-request state (batch 1): ``conv [B, 3*H*K, kernel-1]`` float32 (the last inputs of the convolution) and
``rec [B, H, K, V]`` float32. The op itself (chunked prefill / recurrent decode) comes from the ``kda``
backend bound at load; unbound it uses the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bytebound.kernels.kda_ref import kda_chunked, kda_gate, kda_recurrent
from bytebound.layers.linear import QLinear
from bytebound.layers.norm import RMSNormGated

CONV_WINDOW_MAX_T = 8       # CPU: up to this many tokens the short conv runs as window products (short_conv)


@dataclass
class KDAState:
    """Recurrent state of one KDA layer: ``conv [B, 3D, kernel-1]`` and ``rec [B, H, K, V]``, both float32.

    The runner owns it (``runner.ModelRunner``: ``begin_verify`` / ``commit`` / ``snapshot``); the layer only
    reads and updates it in its forward.
    """
    conv: torch.Tensor
    rec: torch.Tensor
    # Set to a list by the runner for a verify forward: the layer appends the state after *each* token, so a
    # rejected draft rolls back to an exact committed boundary without replaying anything.
    history: list | None = None
    _conv_before: torch.Tensor | None = None   # conv window before a recorded forward (rebuilds per-token windows)
    # Per-token history buffers ``[(conv [N, B, 3D, k-1], rec [N, B, H, K, V]), ...]`` (last pair current) that
    # the fused kernel writes (``kernels.triton_kda.history_buffers``); ``history`` then holds views, not clones.
    hist_buf: list | None = None
    positional = False      # not indexed by position: a snapshot copies the whole tensors

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state proper (what a snapshot copies): ``{"conv": conv, "rec": rec}``."""
        return {"conv": self.conv, "rec": self.rec}

    def clone(self) -> "KDAState":
        return KDAState(self.conv.clone(), self.rec.clone())

    def rollback(self, i) -> None:
        """Restore the state recorded after token ``i`` of the last recorded forward, and stop recording.

        ``i``: an int, or a 0-d int64 tensor on the state's device (an MTP round's accepted count: then the copy
        is an ``index_select`` into :meth:`history_tensors`, with no host read, so it can be graph-captured)."""
        if isinstance(i, torch.Tensor):
            conv_h, rec_h = self.history_tensors()
            sel = i.view(1)
            conv, rec = conv_h.index_select(0, sel)[0], rec_h.index_select(0, sel)[0]
        else:
            conv, rec = self.history[i]
        self.conv.copy_(conv)
        self.rec.copy_(rec)
        self.history = None

    def history_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded per-token states as ``(conv [T, B, 3D, k-1], rec [T, B, H, K, V])``: the fused kernel's
        history buffers themselves when it wrote them (no copy; rollback is then an index into them), else a stack
        of the recorded clones."""
        n = len(self.history)
        if self.hist_buf and n:
            c, r = self.hist_buf[-1]
            if n <= r.shape[0] and self.history[0][1].data_ptr() == r.data_ptr():
                return c[:n], r[:n]
        return torch.stack([c for c, _ in self.history]), torch.stack([s for _, s in self.history])

    def copy_(self, other: "KDAState") -> None:
        self.conv.copy_(other.conv)
        self.rec.copy_(other.rec)


class ConvWeight(nn.Module):
    """Holder of one depthwise conv weight ``[D, 1, kernel]`` float32 (applied in :meth:`KimiDeltaAttention.short_conv`)."""

    def __init__(self, dim: int, kernel: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, 1, kernel, dtype=torch.float32, device=device))


def torch_kda(q, k, v, g, beta, state):
    """Reference op: chunked form for T > 1, recurrent for one token. Returns ``(o float32, state)``."""
    if q.shape[1] == 1:
        return kda_recurrent(q, k, v, g, beta, state)
    return kda_chunked(q, k, v, g, beta, state)


class KimiDeltaAttention(nn.Module):
    """One KDA layer. ``lin_fmt(name)`` gives each projection's storage format ("plain"/"fp8")."""

    def __init__(self, cfg, lin_fmt, dtype=torch.float32, device=None):
        super().__init__()
        h, d, hid = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.heads, self.head_dim, self.dim = h, d, h * d
        self.kernel = cfg.short_conv_kernel_size
        self.lower_bound = cfg.kda_lower_bound if cfg.kda_safe_gate else None
        blk = cfg.quant.weight_block_size

        def lin(name, i, o):
            return QLinear(i, o, lin_fmt(name), blk, dtype, device)
        self.q_proj, self.k_proj, self.v_proj = lin("q_proj", hid, self.dim), lin("k_proj", hid, self.dim), \
            lin("v_proj", hid, self.dim)
        self.f_proj, self.g_proj = lin("f_proj", hid, self.dim), lin("g_proj", hid, self.dim)
        self.b_proj = lin("b_proj", hid, h)
        self.o_proj = lin("o_proj", self.dim, hid)
        # Separate q/k/v depthwise convs, as the checkpoint stores them (``attention.q_conv1d.weight [D, 1, 4]``).
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ConvWeight(self.dim, self.kernel, device) for _ in range(3))
        self.A_log = nn.Parameter(torch.zeros(h, dtype=torch.float32, device=device))
        self.dt_bias = nn.Parameter(torch.zeros(self.dim, dtype=torch.float32, device=device))
        self.o_norm = RMSNormGated(d, cfg.rms_norm_eps)
        self.kda_fn = torch_kda
        self.proj_fn = None          # fused q|k|v|f|g projection, set by runner.backends.bind_model
        # the decoder's input add + norm may run inside proj_fn (its ``add_norm``; bind_model sets this with the
        # fused norms): models.bailing_moe_v3.DecoderLayer reads it
        self.fold_input_norm = False
        # decode/verify (T <= fused_fn.max_tokens, with a state): conv, gates, beta (b_proj included), recurrence
        # and gated norm in one kernel (kda backend 'triton', kernels.triton_kda.FusedKDA); None: the path below
        self.fused_fn = None

    def new_state(self, batch: int, device) -> KDAState:
        return KDAState(torch.zeros(batch, 3 * self.dim, self.kernel - 1, device=device),
                        torch.zeros(batch, self.heads, self.head_dim, self.head_dim, device=device))

    def conv_weight(self) -> torch.Tensor:
        """Depthwise weights of the concatenated q|k|v channels: ``[3D, 1, kernel]`` float32."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0).float()

    def _stepwise(self, q, k, v, g, beta, state: KDAState, qkv):
        """Token-by-token recurrence that records (conv, rec) after every token into ``state.history``.
        ``state.conv`` already holds the post-forward conv window; the per-token windows are rebuilt from
        the pre-forward window (saved by :meth:`short_conv`) and the new inputs."""
        t = q.shape[1]
        full = torch.cat([state._conv_before, qkv.float().transpose(1, 2)], -1)   # [B, 3D, k-1+T]
        outs, rec = [], state.rec
        state.history = []
        for i in range(t):
            o, rec = self.kda_fn(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1], beta[:, i:i + 1], rec)
            outs.append(o)
            state.history.append((full[..., i + 1:i + self.kernel].clone(), rec.clone()))
        state.rec.copy_(rec)
        return torch.cat(outs, 1)

    def short_conv(self, x: torch.Tensor, state: KDAState | None) -> torch.Tensor:
        """Causal depthwise conv + SiLU over ``x [B, T, 3D]``; updates ``state.conv`` in place."""
        xt = x.float().transpose(1, 2)                                        # [B, 3D, T]
        t = xt.shape[-1]
        if state is not None:
            if state.history is not None:
                state._conv_before = state.conv.clone()
            full = torch.cat([state.conv, xt], -1)                           # [B, 3D, k-1+T]
            state.conv.copy_(full[..., -(self.kernel - 1):])
        else:
            full = F.pad(xt, (self.kernel - 1, 0))
        if t <= CONV_WINDOW_MAX_T and not full.is_cuda:
            # CPU decode/verify: products over each token's window, summed over the kernel taps. Three small ops
            # where F.conv1d costs far more on a CPU at T = 1, and every output element is reduced the same way
            # whatever T is, so a decode step reproduces the matching row of a verify forward.
            y = (full.unfold(-1, self.kernel, 1) * self.conv_weight()).sum(-1)   # [B, 3D, T, kernel] -> [B, 3D, T]
        else:
            y = F.conv1d(full, self.conv_weight(), groups=3 * self.dim)[..., -t:]
        return F.silu(y).transpose(1, 2)

    def forward(self, x: torch.Tensor, state: KDAState | None = None, y: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, T, hidden]`` (normed) -> ``[B, T, hidden]``; with ``state`` continues and updates it. ``y``: the
        fused projection's output ``proj_fn(x)`` when the caller already has it (the input norm folded into it)."""
        b, t, _ = x.shape
        if y is not None or self.proj_fn is not None:   # q|k|v|f|g in one GEMV/GEMM (bind_model: linear.fuse_rows)
            y = self.proj_fn(x) if y is None else y
            qkv, f, gate = y[..., :3 * self.dim], y[..., 3 * self.dim:4 * self.dim], y[..., 4 * self.dim:]
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
            f, gate = self.f_proj(x), self.g_proj(x)
        if self.fused_fn is not None and state is not None and t <= self.fused_fn.max_tokens:
            # beta's b_proj runs inside the fused kernel when it can (kernels.triton_kda.FusedKDA.beta)
            return self.o_proj(self.fused_fn(qkv, f, gate, x, state, x.dtype))
        q, k, v = self.short_conv(qkv, state).split(self.dim, -1)
        shape = (b, t, self.heads, self.head_dim)
        g = kda_gate(f, self.A_log, self.dt_bias, self.lower_bound, self.head_dim)
        beta = torch.sigmoid(self.b_proj(x).float())
        q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        if state is not None and state.history is not None:
            o = self._stepwise(q, k, v, g, beta, state, qkv)
        else:
            o, new = self.kda_fn(q, k, v, g, beta, None if state is None else state.rec)
            if state is not None:
                state.rec.copy_(new)
        o = self.o_norm(o, gate.reshape(shape)).to(x.dtype)
        return self.o_proj(o.reshape(b, t, self.dim))
