"""Backend ``triton`` of op ``moe``, host side: the bound kernel object, its launch-config table and the binding.

:class:`TritonMoE` (registered as ``moe[triton]``) binds each ``RoutedExperts`` (MXFP4 routed experts) to a
:class:`MoEKernel`, the callable every variant runs through for batch-1 decode (M = 1) and MTP verify (M <=
:data:`MAX_M`): it checks the experts, views their packed codes as int32 words (no copy), owns the per-binding
state (the fused variants' atomic workspaces and ticket, the E2M1 lookup table), resolves a launch config per M and
launches the configured variant:

* ``split`` (``kernels.triton_moe_split``, the sm_90 default): two kernels (gate/up, then down) whose hundreds of
  small programs issue all their weight bytes up front; it can run the layer's shared expert as one more slot
  (:meth:`MoEKernel.bind_shared`);
* ``persist`` (``kernels.triton_moe_persist``, sm_90, not a table default): the same maths (routed + shared
  slot, SwiGLU, down, dedup) in ONE cooperative launch of co-resident programs with a grid barrier between gate/up
  and down, and the down weights L2-prefetched during gate/up;
* ``gluon`` and ``tl`` (``kernels.triton_moe_variants``): one fused kernel per call, in Triton's explicit-layout
  dialect and in plain Triton; ``gluon`` is the class default for a GPU with no tuned entry.

Launch configs (variant and tiling) come from ``configs/triton_moe.json`` keyed by shape under the exact GPU
name, else under the architecture's default GPU (every sm_90 part uses the H200's entries), written by
``scripts/bench_moe.py --tune``; anything else uses :data:`DEFAULT_CONFIG`. :func:`resolve_config` also says which
key matched (the manifest records it).

Constraints: M <= :data:`MAX_M` per launch (more raises :class:`BackendError` unless ``fn.prefill`` is set;
``runner.backends.bind_model`` sets it to this kernel over 4-token slices), bf16 activations, E8M0 scale bytes <
255. Graph capture: the callable allocates only its output (caching allocator) and launches one kernel (two in the
partials mode and the ``split`` variant); the atomic workspace and counter belong to the binding. The partials
buffer and the ``split`` scratch are shared by every binding on a device (``kernels.scratch``: allocated, or grown,
on the first call of a shape, which must therefore happen before capture). So MoE calls must not run concurrently
on two streams.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from bytebound.errors import BackendError
from bytebound.kernels import triton_moe_persist, triton_moe_split, triton_moe_variants
from bytebound.kernels.limits import MAX_VERIFY_M as MAX_M     # the one verify-width limit (kernels/limits.py)
from bytebound.kernels.registry import cuda_only, needs_capability, optional_triton, register
from bytebound.kernels.triton_moe_split import lut_tensor

NP = 8                      # token columns of the mma tile (m16n8k16): the fused variants' workspace width
CONFIG_PATH = Path(__file__).resolve().parent / "configs" / "triton_moe.json"
DEFAULT_CONFIG = {"variant": "gluon", "BI": 64, "BK": 128, "BH": 256, "num_warps": 4}   # H200 sweep: best at M=1, 4
TL_DEFAULT_CONFIG = {"variant": "tl", "BI": 32, "BK": 256, "BH": 128, "num_warps": 4, "num_stages": 3}

SHARED_VARIANTS = ("split", "persist")     # the variants that can run the bound shared expert as one more slot
_, _, _TRITON_ERR = optional_triton()      # the reason on machines without Triton, else None


def available(dev) -> str | None:
    """Why ``moe[triton]`` cannot run on ``dev`` (None: it can): a CUDA device of compute capability >= 8.0
    (mma.m16n8k16 bf16) with Triton importable."""
    return cuda_only(dev) or _TRITON_ERR or needs_capability(dev, 8, "mma.m16n8k16 bf16")


def shape_key(e: int, h: int, i: int, k: int, m: int) -> str:
    return f"E{e}_H{h}_I{i}_k{k}_M{m}"


def gpu_name(device=None) -> str:
    """``torch.cuda.get_device_name(device)``, or ``"cpu"`` without CUDA."""
    return torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"


def gpu_arch(device=None) -> str | None:
    """The CUDA architecture of ``device`` as ``"sm_<major><minor>"`` (``torch.cuda.get_device_capability``;
    e.g. ``"sm_90"`` for every Hopper part: H100, H200, H800, H20, GH200), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def load_configs(path: Path = CONFIG_PATH) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}


UNTUNED = "untuned class default"


def resolve_config(e, h, i, k, m, device=None, path: Path | None = None) -> tuple[dict, str]:
    """The launch config for this GPU and shape, and which table key supplied it (recorded in the manifest).

    Lookup order, for the shape key ``E{e}_H{h}_I{i}_k{k}_M{m}`` (:func:`shape_key`):

    1. the entry under the exact device name (``torch.cuda.get_device_name()``) -> ``"tuned for <name>"``;
    2. the architecture default: the table's ``"_arch_defaults"`` maps an architecture (:func:`gpu_arch`, e.g.
       ``"sm_90"``) to the GPU whose entries every part of that architecture uses (all sm_90 GPUs run the H200's
       tuned ``split`` kernels, and with them the fused shared expert) -> ``"sm_90 default (tuned on NVIDIA H200)"``;
       the tuning depends on the memory system and SM count, which differ within an architecture, so a GPU's own
       tuned entries (``scripts/bench_moe.py --tune``) come first;
    3. :data:`DEFAULT_CONFIG` -> ``"untuned class default (...)"``.

    The table is ``configs/triton_moe.json``, or the file named by the environment variable
    ``BYTEBOUND_MOE_CONFIG`` (e.g. a fresh ``bench_moe.py --tune`` table; the source then names the file). The
    environment variable ``BYTEBOUND_MOE_VARIANT`` (gluon | tl | split | persist) forces the implementation after
    the lookup: the entry's tiling carries over between the two implementations of the fused algorithm, a ``split``
    entry to ``split``, a ``persist`` entry to ``persist``; otherwise the forced variant's defaults.

    Returns:
        ``(config dict, source str)``; the config is not yet fitted to the shape (:func:`fit_config`).
    """
    env_path = os.environ.get("BYTEBOUND_MOE_CONFIG")
    path = Path(path or env_path or CONFIG_PATH)
    table = load_configs(path)
    key = shape_key(e, h, i, k, m)
    name, arch = gpu_name(device), gpu_arch(device)
    tuned_on = table.get("_arch_defaults", {}).get(arch) if arch else None
    cfg = dict(DEFAULT_CONFIG)
    if key in table.get(name, {}):
        cfg.update(table[name][key])
        source = f"tuned for {name}"
    elif tuned_on and key in table.get(tuned_on, {}):
        cfg.update(table[tuned_on][key])
        source = f"{arch} default (tuned on {tuned_on})"
    else:
        where = name if arch is None else f"{name} or {arch}"
        source = f"{UNTUNED} (no entry for {where} at {key})"
    if path != CONFIG_PATH:
        source += f", table {path}"
    forced = os.environ.get("BYTEBOUND_MOE_VARIANT")
    if forced == "split":
        cfg = dict(triton_moe_split.SPLIT_DEFAULT, **(cfg if cfg.get("variant") == "split" else {}))
    elif forced == "persist":
        cfg = dict(triton_moe_persist.PERSIST_DEFAULT, **(cfg if cfg.get("variant") == "persist" else {}))
    elif forced:
        # the table entry's tiling carries over only between the two implementations of the fused algorithm
        keep = cfg if cfg.get("variant") in ("gluon", "tl") else {}
        cfg = dict(TL_DEFAULT_CONFIG if forced == "tl" else DEFAULT_CONFIG, **{kk: v for kk, v in keep.items()
                                                                           if kk not in ("variant",)})
        cfg["variant"] = forced
    if forced:
        source += f"; variant forced by BYTEBOUND_MOE_VARIANT={forced}"
    return cfg, source


def lookup_config(e, h, i, k, m, device=None, path: Path | None = None) -> dict:
    """The launch config of :func:`resolve_config` without its source."""
    return resolve_config(e, h, i, k, m, device, path)[0]

def fit_config(cfg: dict, h: int, i: int) -> dict:
    """Fit a config to this model's H and I (tiny test models): ``triton_moe_split.fit_split_config`` for a
    ``split`` config, ``triton_moe_persist.fit_persist_config`` for ``persist``, else
    ``triton_moe_variants.fit_fused_config``.

    Raises:
        BackendError: no tiling of the variant fits the shape."""
    if cfg.get("variant") == "split":
        return triton_moe_split.fit_split_config(cfg, h, i)
    if cfg.get("variant") == "persist":
        return triton_moe_persist.fit_persist_config(cfg, h, i)
    return triton_moe_variants.fit_fused_config(cfg, h, i)


class MoEKernel:
    """The bound callable for one ``RoutedExperts``: owns the fused variants' atomic workspaces ``[H, 8]`` (int64
    and float32), the ticket counter, the E2M1 lookup table and the per-M configs; ``__call__(x, ids, w)`` launches
    the configured variant (module docstring).

    Raises:
        BackendError: the experts are not MXFP4 with uint8 E8M0 scales, contiguous, on a CUDA device."""

    max_tokens = MAX_M

    def __init__(self, ex, configs: dict[int, dict] | None = None):
        if ex.fmt != "mxfp4":
            raise BackendError(f"moe[triton] needs MXFP4 experts, got fmt={ex.fmt!r} (use moe backend 'torch')")
        dev = ex.w13.device
        if dev.type != "cuda":
            raise BackendError("moe[triton] needs the experts on a CUDA device")
        self.ex = ex
        self.e, self.h, self.i = ex.n, ex.hidden, ex.inter
        if ex.w13_scale.dtype != torch.uint8 or ex.w2_scale.dtype != torch.uint8:
            raise BackendError("moe[triton]: scales must be uint8 E8M0 bytes")
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            if not getattr(ex, name).is_contiguous():
                raise BackendError(f"moe[triton]: experts.{name} must be contiguous")
        # int32 word views of the packed codes (no copy)
        self.w13w = ex.w13.data.view(torch.uint8).view(torch.int32)
        self.w2w = ex.w2.data.view(torch.uint8).view(torch.int32)
        self.s13 = ex.w13_scale.data
        self.s2 = ex.w2_scale.data
        # one workspace per accumulation mode (int64 fixed point: deterministic; float32: the atomics' order)
        self.ws = {True: torch.zeros(self.h, NP, dtype=torch.int64, device=dev),
                   False: torch.zeros(self.h, NP, dtype=torch.float32, device=dev)}
        self.cnt = torch.zeros(1, dtype=torch.int32, device=dev)
        self.lut = lut_tensor(dev)
        # the split kernels' shift decode needs every E8M0 byte <= 128 (a scale <= 2: real weights' scales are far
        # below); larger ones keep the table decode (config_source says which)
        self.scale_max = int(torch.maximum(ex.w13_scale.max(), ex.w2_scale.max()))
        self.shift_decode = self.scale_max <= triton_moe_split.SHIFT_DECODE_MAX_E8M0
        self.sm90 = torch.cuda.get_device_capability(dev)[0] >= 9     # PDL (the 'split' variant's kernel B)
        self.limit = ex.limit
        self.configs = dict(configs or {})
        self._fitted: dict[int, tuple] = {}  # m -> (the config it was fitted from, fitted to (H, I), its source)
        # Delegate for M > MAX_M (bind_model sets it to this kernel over 4-token slices; humming or torch also
        # fit); None -> BackendError, as the registry contract asks.
        self.prefill = None
        self.shared = None     # SharedFP8: the layer's shared expert, inside the 'split' / 'persist' kernels

    def bind_shared(self, mlp) -> None:
        """Run the layer's shared expert (``mlp``, a ``layers.moe.DenseMLP`` with FP8 128x128-block projections)
        inside the ``split`` kernels (or the ``persist`` one), as one more slot: ``__call__`` then returns routed +
        shared for the token counts whose config is one of :data:`SHARED_VARIANTS` (:meth:`shared_for`), and the
        layer skips its own shared expert there. The gate and up weights are copied once into one ``[2I, H]``
        tensor (3.9 MB per Ling-3.0-flash layer); the block scales become BF16x2 factors ``scale x 2^120`` (see
        ``triton_moe_split._ASM_FP8X4``).

        Raises:
            BackendError: the projections are not FP8 with 128x128 blocks, the shared intermediate size differs
                from the routed one, or a block scale is not a power of two of at most 2^7 (the checkpoint's
                ``scale_fmt: ue8m0``; ``scale x 2^120`` must be a normal BF16)."""
        self.shared = triton_moe_split.shared_fp8(mlp, self.h, self.i)

    def shared_for(self, m: int, k: int) -> bool:
        """Whether ``__call__`` with ``m`` tokens of top-``k`` routing includes the shared expert (bound, and a
        ``split`` or ``persist`` config for ``m``)."""
        return self.shared is not None and m <= MAX_M and self.config(m, k)["variant"] in SHARED_VARIANTS

    def config(self, m: int, k: int) -> dict:
        """The launch config for ``m`` tokens: a caller-given one (``configs``) or the table's, fitted to this
        model's shape once."""
        return self._config(m, k)[1]

    def config_source(self, m: int, k: int) -> str:
        """Which table key supplied :meth:`config` for ``m`` tokens (:func:`resolve_config`'s source, or
        ``"given by the caller"``), prefixed with the variant: e.g. ``"split, sm_90 default (tuned on NVIDIA
        H200)"``."""
        _, cfg, source = self._config(m, k)
        if cfg["variant"] == "split":
            dq, why = triton_moe_split.launch_dq(self, cfg)
            return f"split, {source}, {'shift' if dq else 'table'} decode" + (f" ({why})" if why else "")
        return f"{cfg['variant']}, {source}"

    def _config(self, m: int, k: int) -> tuple:
        src = self.configs.get(m)
        done = self._fitted.get(m)
        if done is None or done[0] is not src:       # (the cache holds src, so identity cannot be recycled)
            if src is None:
                cfg, source = resolve_config(self.e, self.h, self.i, k, m, self.cnt.device)
            else:
                cfg, source = src, "given by the caller"
            done = (src, fit_config(cfg, self.h, self.i), source)
            self._fitted[m] = done
        return done

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, shared: bool = True) -> torch.Tensor:
        """Routed sum ``[M, H]`` bf16, plus the bound shared expert when ``shared`` and :meth:`shared_for` (the
        prefill delegate calls with ``shared=False``: there the layer adds its dense shared expert itself)."""
        m, k = ids.shape
        if m > MAX_M:
            if self.prefill is not None:
                return self.prefill(x, ids, w)
            raise BackendError(f"moe[triton] handles at most {MAX_M} tokens per call (got {m}); "
                               "bind 'humming' or 'torch' for prefill (or set fn.prefill)")
        if x.dtype != torch.bfloat16:
            raise BackendError(f"moe[triton] needs bf16 activations, got {x.dtype}")
        cfg = self.config(m, k)
        x = x.contiguous()
        ids = ids.contiguous()
        w = w.to(torch.float32).contiguous()
        out = torch.empty(m, self.h, dtype=torch.bfloat16, device=x.device)
        if cfg["variant"] == "split":
            triton_moe_split.launch_split(self, x, ids, w, out, cfg, self.shared if shared else None)
        elif cfg["variant"] == "persist":
            triton_moe_persist.launch_persist(self, x, ids, w, out, cfg, self.shared if shared else None)
        else:
            triton_moe_variants.launch_fused(self, x, ids, w, out, cfg)
        return out

    def weight_bytes(self, n_experts: int) -> int:
        """Bytes of weights + scales read for ``n_experts`` distinct experts."""
        per = (self.ex.w13[0].numel() + self.ex.w13_scale[0].numel() + self.ex.w2[0].numel()
               + self.ex.w2_scale[0].numel())
        return n_experts * per


@register("moe", "triton", available)
class TritonMoE:
    """MXFP4 routed MoE for M <= 4 (decode and MTP verify): binds each ``RoutedExperts`` to a :class:`MoEKernel`
    (module docstring). ``configs``: ``{M: config}`` overriding the table for those token counts."""
    name = "triton"

    def __init__(self, configs: dict[int, dict] | None = None):
        self.configs = configs

    def bind(self, ex, dtype):
        if dtype != torch.bfloat16:
            raise BackendError(f"moe[triton] runs in bf16, model dtype is {dtype}")
        return MoEKernel(ex, self.configs)
