"""Time-attribution probes of the ``split`` MoE kernels (``scripts/bench_moe.py --probe``): instrumentation, whose
outputs are wrong by construction.

Each probe runs a private copy of ``kernels/triton_moe_split.py`` (executed again from its file, so the production
module and its compiled kernels are untouched) with one piece swapped before anything is compiled; Triton resolves
a kernel's callees through its module's globals at compile time, so the swap reaches the copy's kernels only:

* ``gateup_only`` / ``down_only``: only kernel A / only kernel B is launched;
* ``load_only``: every load (weights, scales, B operand) stays and the dequantisation goes: the weight-tile loader
  (``mxfp4_tile``) keeps the words and scales live with a store that never fires in practice (its mask is a 2^-32
  coincidence, and its target is the tile's own scale bytes: a probe's output is wrong anyway) and the decode
  (``frag_dequant``) returns zeros, so the mma still reads the B operand (memory + overheads);
* ``compute_only``: the weight and scale loads are replaced by register values that differ per element, so no
  decode is merged with another (decode + everything else);
* ``gateup_no_ticket``: only kernel A, run with the config key ``RK`` (each program stores its partial and ends: no
  fence, no ticket, no last program summing the partials and applying SwiGLU) and neither the reduce launch nor
  kernel B: the cost of that serial tail.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from bytebound.errors import BackendError
from bytebound.kernels import triton_moe_split
from bytebound.kernels.limits import MAX_VERIFY_M
from bytebound.kernels.moe_host import MoEKernel
from bytebound.kernels.triton_moe_split import gl, gluon, mxfp4_index, mxfp4_tile

PROBES = ("gateup_only", "down_only", "load_only", "compute_only", "gateup_no_ticket")

if gluon is not None:
    @gluon.jit
    def _tile_kept_alive(w_ptr, s_ptr, row, cb, K: gl.constexpr, WD: gl.constexpr):
        """``load_only``'s ``mxfp4_tile``: the production loads, kept live without a decode."""
        wv, sv = mxfp4_tile(w_ptr, s_ptr, row, cb, K, WD)
        SD: gl.constexpr = gl.SliceLayout(3, WD)
        x = gl.sum(wv, axis=3) + sv.to(gl.int32)
        gl.store(s_ptr + gl.zeros(x.shape, gl.int32, SD), x.to(gl.uint8), mask=x == 0x7EADBEEF)
        return wv, sv

    @gluon.jit
    def _frag_zero(w, s, c0, c1, c2, c3, c4, DA: gl.constexpr, DQ: gl.constexpr = 0):
        """``load_only``'s ``frag_dequant``: a zero A operand of the decoded tile's shape."""
        R: gl.constexpr = w.shape[0]
        NS: gl.constexpr = w.shape[1]
        return gl.zeros([R, NS * 128], gl.bfloat16, DA)

    @gluon.jit
    def _tile_fake(w_ptr, s_ptr, row, cb, K: gl.constexpr, WD: gl.constexpr):
        """``compute_only``'s ``mxfp4_tile``: words and scales computed from the element's index, no memory load."""
        w3, q, _, _ = mxfp4_index(row, cb, K, WD)         # the production tile's indices
        # a value known only at run time (as the expert index is), so the words are not folded into constants
        e = w_ptr.to(gl.int64) >> 4
        wv = (w3[:, :, :, None] * 4 + q[None, None, None, :] + e) * 668265263
        sv = ((w3 >> 2) & 3).to(gl.uint8) + 120
        return wv, sv


class _NotLaunched:
    """Stands in for a kernel the probe leaves out: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


_COPIES: dict[str, object] = {}


def probe_module(kind: str):
    """The private copy of ``kernels.triton_moe_split`` for probe ``kind`` (one of :data:`PROBES`), built once.

    Raises:
        BackendError: an unknown probe, or Gluon is not importable."""
    if kind not in PROBES:
        raise BackendError(f"moe probe {kind!r}: expected one of {', '.join(PROBES)}")
    if gluon is None:
        raise BackendError(f"moe probe {kind!r}: {triton_moe_split.GLUON_ERR}")
    if kind not in _COPIES:
        spec = importlib.util.spec_from_file_location(f"_triton_moe_split_probe_{kind}", triton_moe_split.__file__)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod        # (dataclasses look their module up while the copy executes)
        spec.loader.exec_module(mod)
        if kind == "gateup_only":
            mod._moe_down_split = _NotLaunched()
        elif kind == "down_only":
            mod._moe_gateup_split = _NotLaunched()
        elif kind == "gateup_no_ticket":       # kernel A with RK (probe_kernel), nothing after it
            mod._moe_down_split = mod._moe_reduce_swiglu = _NotLaunched()
        elif kind == "load_only":
            mod.mxfp4_tile, mod.frag_dequant = _tile_kept_alive, _frag_zero
        else:
            mod.mxfp4_tile = _tile_fake
        _COPIES[kind] = mod
    return _COPIES[kind]


def probe_kernel(ex, cfg: dict, kind: str):
    """A callable ``fn(x [M, H] bf16, ids [M, k], w [M, k]) -> [M, H] bf16`` for the MXFP4 experts ``ex`` that
    launches the ``split`` config ``cfg`` (every M) as probe ``kind`` does (module docstring); the output is
    meaningless. Built on a :class:`~bytebound.kernels.moe_host.MoEKernel`, so the binding state and the config
    fitting are the production ones.

    Raises:
        BackendError: ``cfg`` is not a ``split`` config, an unknown probe, or what ``MoEKernel`` raises."""
    if cfg.get("variant") != "split":
        raise BackendError(f"moe probe {kind!r} instruments the 'split' variant, got config {cfg}")
    mod = probe_module(kind)
    if kind == "gateup_no_ticket":
        cfg = dict(cfg, RK=1)
    kern = MoEKernel(ex, {m: cfg for m in range(1, MAX_VERIFY_M + 1)})

    def fn(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = ids.shape
        out = torch.empty(m, kern.h, dtype=torch.bfloat16, device=x.device)
        mod.launch_split(kern, x.contiguous(), ids.contiguous(), w.to(torch.float32).contiguous(), out,
                         kern.config(m, k))
        return out
    return fn
