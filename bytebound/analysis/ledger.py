"""Exact byte ledger of one batch-1 decode step of a BailingMoeV3 model (issue 8).

Every tensor a decode step reads is listed with its shape, storage format and multiplicity, from a
:class:`~bytebound.config.LingConfig` and a :class:`Recipe` (which group is stored in which format; by default
it follows the config's ``quantization_config``). Tensor list and formats: ``docs/references.md``
§1.4-1.6, §2.1 and §4. This is the seed's section-4 formula with its simplifications removed:

    B_step = sum over tensors t read in the step of  count_t x (payload_t + scale_t)      [bytes]

Storage formats (bytes for a linear weight ``[N, K]``, ``n = N K``):

* ``bf16``  2n;  ``fp32`` 4n.
* ``fp8_block``  n + 4 ceil(N/128) ceil(K/128)  (E4M3 + float32 ``weight_scale_inv`` per 128x128 block).
* ``fp8_channel``  n + 4 N  (online FP8 LM head: E4M3 + float32 scale per output channel, spec section 3.1).
* ``mxfp4``  n/2 + N ceil(K/32)  (E2M1 packed two per byte + one E8M0 byte per 32 inputs).
* ``int4_g32``  n/2 + 2 N ceil(K/32)  (the int4 sibling: BF16 scale per 32 inputs).

Units: bytes; GB = 1e9 B. Routed experts count ``top_k`` experts per MoE layer (the per-token mean);
the full embedding table is not read, one row is. The NEXTN layer (``model.layers.{L}``) is not read by a
plain step; :meth:`Ledger.draft_step_bytes` prices it for the speculative round.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path

from bytebound.config import LingConfig
from bytebound.errors import CheckpointError, ConfigError

FORMATS = ("bf16", "fp32", "fp8_block", "fp8_channel", "mxfp4", "int4_g32")
GROUPS = (  # display order of the ledger groups
    "embedding row", "KDA projections", "KDA b_proj", "KDA conv/gates/norm", "MLA projections", "norms",
    "dense MLP", "router", "routed experts x top-k", "shared expert", "LM head",
)


def tensor_bytes(shape: tuple[int, ...], fmt: str, block: tuple[int, int] = (128, 128),
                 group: int = 32) -> tuple[float, float]:
    """(payload, scale) bytes of one tensor of ``shape`` stored as ``fmt`` (formulas in the module docstring)."""
    n = math.prod(shape)
    if fmt == "bf16":
        return 2.0 * n, 0.0
    if fmt == "fp32":
        return 4.0 * n, 0.0
    if len(shape) != 2:
        raise ConfigError(f"format {fmt!r} needs a 2-D [N, K] weight, got shape {shape}")
    N, K = shape
    if fmt == "fp8_block":
        return float(n), 4.0 * math.ceil(N / block[0]) * math.ceil(K / block[1])
    if fmt == "fp8_channel":
        return float(n), 4.0 * N
    if fmt == "mxfp4":
        return n / 2, float(N * math.ceil(K / group))
    if fmt == "int4_g32":
        return n / 2, 2.0 * N * math.ceil(K / group)
    raise ConfigError(f"unknown storage format {fmt!r} (expected one of {FORMATS})")


@dataclass(frozen=True)
class Recipe:
    """Which storage format each tensor group uses.

    Attributes:
        linear: format of quantised linears (attention, dense MLP, shared expert, ``eh_proj``).
        not_converted: module-name suffixes kept in ``plain`` (``quantization_config.modules_to_not_convert``);
            matched on a dot boundary, so ``b_proj`` excludes ``attention.b_proj`` but not ``kv_b_proj``.
        routed: format of the routed experts (``routed_experts_quant_method``).
        router: format of the router weight and expert bias (``router_dtype``).
        head: LM head format: ``bf16`` as stored, or ``fp8_channel`` (online FP8, spec section 3.1).
        plain: format of norms, conv1d weights, embeddings and not-converted linears.
        kda_fp32: KDA parameters kept in float32 (``A_log``, ``dt_bias``).
        block, group: FP8 block and MX group sizes.
    """

    linear: str = "fp8_block"
    not_converted: tuple[str, ...] = ("lm_head", "b_proj")
    routed: str = "mxfp4"
    router: str = "fp32"
    head: str = "bf16"
    plain: str = "bf16"
    kda_fp32: tuple[str, ...] = ("A_log", "dt_bias")
    block: tuple[int, int] = (128, 128)
    group: int = 32

    @classmethod
    def from_config(cls, cfg: LingConfig, head: str = "bf16") -> "Recipe":
        """The recipe the config's ``quantization_config`` describes; ``head`` is ``bf16`` or ``fp8``."""
        q = cfg.quant
        head_fmt = {"bf16": "bf16", "fp8": "fp8_channel"}.get(head, head)
        if head_fmt not in FORMATS:
            raise ConfigError(f"head={head!r}: expected 'bf16' or 'fp8'")
        linear = "fp8_block" if q.method == "fp8" else "bf16"
        routed = {"mxfp4": "mxfp4", "fp8": "fp8_block"}.get(q.routed_experts, linear)
        router = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}.get(cfg.router_dtype)
        if router is None:
            raise ConfigError(f"router_dtype={cfg.router_dtype!r}: expected fp32 or bf16")
        return cls(linear=linear, not_converted=tuple(q.modules_to_not_convert), routed=routed, router=router,
                   head=head_fmt, block=tuple(q.weight_block_size), group=q.routed_group_size)

    def linear_fmt(self, name: str) -> str:
        """Format of the linear module ``name`` (e.g. ``attention.kv_b_proj``)."""
        if any(name == m or name.endswith("." + m) for m in self.not_converted):
            return self.plain
        return self.linear


@dataclass(frozen=True)
class Item:
    """One tensor kind of the ledger: ``count`` copies read per decode step (layers x experts)."""

    name: str
    group: str
    shape: tuple[int, ...]
    fmt: str
    count: float
    payload: float  # bytes per copy
    scale: float    # scale bytes per copy
    elems: float | None = None  # parameters per copy when not prod(shape) (packed or scale tensors)

    @property
    def params(self) -> float:
        return (math.prod(self.shape) if self.elems is None else self.elems) * self.count

    @property
    def bytes(self) -> float:
        return (self.payload + self.scale) * self.count


def _linear(r: Recipe, name: str, group: str, n_out: int, n_in: int, count: float, fmt: str | None = None) -> Item:
    f = fmt or r.linear_fmt(name)
    return Item(name, group, (n_out, n_in), f, count, *tensor_bytes((n_out, n_in), f, r.block, r.group))


def _plain(r: Recipe, name: str, group: str, shape: tuple[int, ...], count: float, fmt: str | None = None) -> Item:
    f = fmt or r.plain
    return Item(name, group, shape, f, count, *tensor_bytes(shape, f))


def _mla(cfg: LingConfig, r: Recipe, n: float) -> list[Item]:
    """Gated MLA (spec 1.4): q_proj d->H(nope+rope), kv_a d->r+rope, kv_a_layernorm [r], kv_b r->H(nope+v),
    g_proj d->H, dense H v->d."""
    d, H, g = cfg.hidden_size, cfg.num_attention_heads, "MLA projections"
    return [
        _linear(r, "mla.attention.q_proj", g, H * cfg.qk_head_dim, d, n),
        _linear(r, "mla.attention.kv_a_proj_with_mqa", g, cfg.mla_cache_dim, d, n),
        _plain(r, "mla.attention.kv_a_layernorm", g, (cfg.kv_lora_rank,), n),
        _linear(r, "mla.attention.kv_b_proj", g, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, n),
        _linear(r, "mla.attention.g_proj", g, H, d, n),
        _linear(r, "mla.attention.dense", g, d, H * cfg.v_head_dim, n),
    ]


def _moe(cfg: LingConfig, r: Recipe, n: float) -> list[Item]:
    """Router [E, d] + bias [E]; top_k routed SwiGLU experts (gate/up I x d, down d x I); shared expert."""
    d, E, I, S = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_intermediate
    k = cfg.num_experts_per_tok
    items = [_plain(r, "mlp.gate", "router", (E, d), n, r.router),
             _plain(r, "mlp.gate.expert_bias", "router", (E,), n, "fp32")]
    for p, (o, i) in (("gate_proj", (I, d)), ("up_proj", (I, d)), ("down_proj", (d, I))):
        items.append(_linear(r, f"mlp.experts.{p}", "routed experts x top-k", o, i, n * k, r.routed))
    if S:
        for p, (o, i) in (("gate_proj", (S, d)), ("up_proj", (S, d)), ("down_proj", (d, S))):
            items.append(_linear(r, f"mlp.shared_experts.{p}", "shared expert", o, i, n))
    return items


def _items(cfg: LingConfig, r: Recipe) -> list[Item]:
    """The tensors one plain decode step reads (spec sections 1.2-1.6), merged over layers."""
    d, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    nk, nm = len(cfg.kda_layers), len(cfg.mla_layers)
    n_dense = sum(1 for i in range(L) if not cfg.is_moe(i))
    D, H, ck = cfg.kda_dim, cfg.num_attention_heads, cfg.short_conv_kernel_size
    items = [_plain(r, "word_embeddings (1 row)", "embedding row", (d,), 1)]
    g = "KDA projections"
    items += [_linear(r, f"kda.attention.{p}", g, D, d, nk) for p in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj")]
    items.append(_linear(r, "kda.attention.o_proj", g, d, D, nk))
    b = _linear(r, "kda.attention.b_proj", g, H, d, nk)
    items.append(replace(b, group="KDA b_proj") if b.fmt == r.plain else b)
    g = "KDA conv/gates/norm"
    items += [_plain(r, f"kda.attention.{p}_conv1d", g, (D, 1, ck), nk) for p in ("q", "k", "v")]
    items.append(_plain(r, "kda.attention.A_log", g, (H,), nk, "fp32" if "A_log" in r.kda_fp32 else None))
    items.append(_plain(r, "kda.attention.dt_bias", g, (D,), nk, "fp32" if "dt_bias" in r.kda_fp32 else None))
    items.append(_plain(r, "kda.attention.o_norm", g, (cfg.head_dim,), nk))
    items += _mla(cfg, r, nm)
    items.append(_plain(r, "input/post_attention_layernorm", "norms", (d,), 2 * L))
    items.append(_plain(r, "model.norm", "norms", (d,), 1))
    if n_dense:
        I = cfg.intermediate_size
        for p, (o, i) in (("gate_proj", (I, d)), ("up_proj", (I, d)), ("down_proj", (d, I))):
            items.append(_linear(r, f"mlp.{p}", "dense MLP", o, i, n_dense))
    if L - n_dense:
        items += _moe(cfg, r, L - n_dense)
    items.append(_linear(r, "lm_head", "LM head", V, d, 1, r.head))
    return items


def _nextn_items(cfg: LingConfig, r: Recipe) -> list[Item]:
    """The NEXTN layer ``model.layers.{L}`` (spec 2.1): enorm, hnorm, eh_proj 2d->d, MLA + MoE, final_layernorm."""
    if not cfg.num_nextn_predict_layers:
        return []
    d = cfg.hidden_size
    items = [_plain(r, "nextn.enorm/hnorm/final_layernorm", "NEXTN layer", (d,), 3),
             _plain(r, "nextn.input/post_attention_layernorm", "NEXTN layer", (d,), 2),
             _linear(r, "nextn.eh_proj", "NEXTN layer", d, 2 * d, 1)]
    inner = _mla(cfg, r, 1) + _moe(cfg, r, 1)
    return items + [replace(it, name="nextn." + it.name, group="NEXTN layer") for it in inner]


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """E [1 - (1 - top_k/E)^k]: expected distinct experts hit by ``tokens`` independent top-k routings
    (seed section 8: 512 [1 - (1 - 8/512)^4] = 31.3). Assumes uniform, independent routing."""
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass
class Ledger:
    """The exact ledger: ``items`` (plain decode step) and ``nextn`` (the draft layer)."""

    cfg: LingConfig
    recipe: Recipe
    items: list[Item]
    nextn: list[Item] = field(default_factory=list)

    @property
    def params(self) -> float:
        """Active parameters of a plain decode step (one embedding row, top-k experts, LM head included)."""
        return sum(it.params for it in self.items)

    @property
    def bytes(self) -> float:
        """Bytes one plain decode step reads from weights [B] (no KV/state: see :meth:`state_bytes`)."""
        return sum(it.bytes for it in self.items)

    def group_bytes(self) -> dict[str, float]:
        """Bytes per tensor group, in :data:`GROUPS` order (empty groups dropped)."""
        out = {g: 0.0 for g in GROUPS}
        for it in self.items:
            out[it.group] = out.get(it.group, 0.0) + it.bytes
        return {g: v for g, v in out.items() if v}

    def group_params(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for it in self.items:
            out[it.group] = out.get(it.group, 0.0) + it.params
        return out

    @property
    def head_bytes(self) -> float:
        return sum(it.bytes for it in self.items if it.group == "LM head")

    @property
    def routed_bytes(self) -> float:
        return sum(it.bytes for it in self.items if it.group == "routed experts x top-k")

    def with_head(self, head: str) -> "Ledger":
        """The same ledger with the LM head stored as ``head`` (``bf16`` or ``fp8`` = per-channel FP8)."""
        fmt = {"bf16": "bf16", "fp8": "fp8_channel"}.get(head, head)
        r = replace(self.recipe, head=fmt)
        c = self.cfg
        items = [it for it in self.items if it.group != "LM head"]
        items.append(_linear(r, "lm_head", "LM head", c.vocab_size, c.hidden_size, 1, fmt))
        return Ledger(c, r, items, self.nextn)

    def verify_bytes(self, k: int) -> float:
        """Weight bytes of one target verify step over ``k`` tokens [B]: everything is read once except the
        routed experts, which grow from top_k to E[1 - (1 - top_k/E)^k] per MoE layer (seed section 8)."""
        c = self.cfg
        if not c.num_experts_per_tok:
            return self.bytes
        grow = expected_distinct_experts(c.num_experts, c.num_experts_per_tok, k) / c.num_experts_per_tok
        return self.bytes - self.routed_bytes + self.routed_bytes * grow

    def draft_step_bytes(self) -> float:
        """Bytes of one NEXTN draft step [B]: the NEXTN layer, one embedding row and the shared LM head."""
        emb = sum(it.bytes for it in self.items if it.group == "embedding row")
        return sum(it.bytes for it in self.nextn) + emb + self.head_bytes

    def round_bytes(self, draft_tokens: int, draft_steps: int) -> float:
        """Bytes of one speculative round [B]: one verify over ``draft_tokens`` plus ``draft_steps`` draft steps.

        Each draft step is priced as one token; SGLang's draft-extend over the accepted tokens touches a few more
        NEXTN experts (E[1 - (1 - top_k/E)^a] instead of top_k, under 1 % of a round for Ling-3.0-flash): not modelled."""
        return self.verify_bytes(draft_tokens) + draft_steps * self.draft_step_bytes()

    def kv_bytes_per_token(self, kv_bytes: int = 2, with_nextn: bool = False) -> float:
        """MLA latent cache per token [B]: (kv_lora_rank + rope) x kv_bytes per MLA layer (seed section 13);
        ``with_nextn`` adds the NEXTN layer's MLA cache (written while speculating)."""
        n = len(self.cfg.mla_layers) + (1 if with_nextn and self.cfg.num_nextn_predict_layers else 0)
        return n * self.cfg.mla_cache_dim * kv_bytes

    def state_bytes(self, state_bytes: int = 4, conv_bytes: int = 2) -> float:
        """KDA state read per step [B], constant in context length: per KDA layer the recurrent state
        H x K x V (float32 by default, SGLang ``KimiLinearStateShape``) and 3 conv states D x (kernel - 1)."""
        c = self.cfg
        per = c.num_attention_heads * c.head_dim * c.head_dim * state_bytes
        per += 3 * c.kda_dim * (c.short_conv_kernel_size - 1) * conv_bytes
        return len(c.kda_layers) * per

    def to_json(self) -> dict:
        return {
            "recipe": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.recipe.__dict__.items()},
            "active_params": self.params, "bytes_per_step": self.bytes,
            "groups": {g: {"bytes": b, "params": self.group_params()[g]} for g, b in self.group_bytes().items()},
            "items": [{"name": it.name, "group": it.group, "shape": list(it.shape), "fmt": it.fmt, "count": it.count,
                       "params": it.params, "payload_bytes": it.payload * it.count,
                       "scale_bytes": it.scale * it.count, "bytes": it.bytes} for it in self.items + self.nextn],
        }


def build_ledger(cfg: LingConfig, recipe: Recipe | None = None, head: str = "bf16") -> Ledger:
    """The exact ledger of ``cfg`` under ``recipe`` (default: the config's quantization_config, ``head`` BF16/FP8)."""
    r = recipe or Recipe.from_config(cfg, head=head)
    return Ledger(cfg, r, _items(cfg, r), _nextn_items(cfg, r))


# ---- ledger of a loaded model or checkpoint --------------------------------------------------------------
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U8": 1, "I8": 1, "BOOL": 1, "BF16": 2, "F16": 2,
               "I16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}
_LAYER = re.compile(r"layers\.(\d+)\.")
# "dense": the KDA output projection as transformers' save_pretrained names it (checkpoint/layout.py aliases)
_KDA_PROJ = ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj", "o_proj", "dense")


def _classify(cfg: LingConfig, name: str) -> tuple[str, float] | None:
    """(group, copies read per plain step) of checkpoint tensor ``name``; None if a plain step skips it."""
    m = _LAYER.search(name)
    i = int(m.group(1)) if m else -1
    nextn = i >= cfg.num_hidden_layers
    if "embed" in name or "word_embeddings" in name:
        return None if nextn else ("embedding row", 1.0 / cfg.vocab_size)
    if "lm_head" in name or "shared_head" in name:
        return None if nextn else ("LM head", 1.0)
    if nextn:
        frac = cfg.num_experts_per_tok / cfg.num_experts if ".experts." in name else 1.0
        return "NEXTN layer", frac
    if ".experts." in name:  # routed experts, per expert or fused [E, ...]: top_k / E of them per token
        return "routed experts x top-k", cfg.num_experts_per_tok / cfg.num_experts
    if re.search(r"mlp\.gate\.(weight|expert_bias|e_score_correction_bias)$", name):
        return "router", 1.0
    if "shared_expert" in name:
        return "shared expert", 1.0
    if ".mlp." in name:
        return "dense MLP", 1.0
    if ".attention." in name:
        if cfg.is_mla(i):
            return "MLA projections", 1.0
        leaf = name.split(".attention.", 1)[1].split(".")[0]
        if leaf == "b_proj":
            return "KDA b_proj", 1.0
        return ("KDA projections" if leaf in _KDA_PROJ else "KDA conv/gates/norm"), 1.0
    if "norm" in name:
        return "norms", 1.0
    return "other", 1.0


def ledger_from_specs(cfg: LingConfig, specs: dict[str, tuple[tuple[int, ...], str]]) -> Ledger:
    """Exact ledger of a loaded model or checkpoint from ``{name: (shape, dtype)}`` (safetensors dtype names).

    Bytes are the stored bytes of each tensor times the copies a plain step reads (:func:`_classify`):
    one embedding row (1/V of the table), top_k/E of each routed-expert tensor, everything else once.
    Parameters: ``*scale*`` tensors count none; packed 4-bit expert weights (int8/uint8) count two per byte.
    """
    plain, nextn = [], []
    for name, (shape, dtype) in sorted(specs.items()):
        cls = _classify(cfg, name)
        if cls is None:
            continue
        dtype = str(dtype).replace("torch.", "").upper()
        dtype = {"FLOAT8_E4M3FN": "F8_E4M3", "BFLOAT16": "BF16", "FLOAT32": "F32", "UINT8": "U8", "INT8": "I8",
                 "FLOAT16": "F16", "INT32": "I32", "INT64": "I64", "FLOAT8_E8M0FNU": "F8_E8M0"}.get(dtype, dtype)
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"tensor {name}: unknown dtype {dtype!r}")
        n = math.prod(shape)
        is_scale = "scale" in name
        elems = 0.0 if is_scale else (2.0 * n if ".experts." in name and dtype in ("I8", "U8") else float(n))
        b = float(n * DTYPE_BYTES[dtype])
        it = Item(name, cls[0], tuple(shape), dtype, cls[1], 0.0 if is_scale else b, b if is_scale else 0.0, elems)
        (nextn if cls[0] == "NEXTN layer" else plain).append(it)
    return Ledger(cfg, Recipe.from_config(cfg), plain, nextn)


def specs_from_safetensors(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype)}`` from the headers of every ``*.safetensors`` file in ``path`` (no data read)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p} (expected a folder of .safetensors files or one file)")
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files:
        raise CheckpointError(f"no .safetensors files at {p}")
    out = {}
    for f in files:
        header = _safetensors_header(f)
        for k, v in header.items():
            if k == "__metadata__":
                continue
            try:
                out[k] = (tuple(int(x) for x in v["shape"]), str(v["dtype"]))
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{f}: header entry {k!r} has no valid shape/dtype: {v!r:.80}") from None
    return out


def _safetensors_header(f: Path) -> dict:
    """The JSON header of one safetensors file: 8 bytes little-endian length, then that many bytes of JSON.
    Anything else (a directory, an empty or foreign file, a header longer than the file) is a CheckpointError."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{f}: not a safetensors file ({size} bytes, no 8-byte header length)")
            n = struct.unpack("<Q", head)[0]
            # checked before reading: random bytes give lengths up to 2**64 (OverflowError / a huge allocation)
            if n > size - 8:
                raise CheckpointError(f"{f}: not a safetensors file or truncated (header length {n}, file {size} B)")
            header = json.loads(fh.read(n))
    except OSError as e:                 # a directory called *.safetensors, no permission...
        raise CheckpointError(f"{f}: cannot read ({type(e).__name__}: {e.strerror or e})") from e
    except ValueError as e:              # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{f}: safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{f}: safetensors header is not a JSON object")
    return header


def specs_from_module(module) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype)}`` of a loaded ``torch.nn.Module``'s parameters and buffers."""
    named = list(module.named_parameters()) + list(module.named_buffers())
    return {k: (tuple(t.shape), str(t.dtype)) for k, t in named}
