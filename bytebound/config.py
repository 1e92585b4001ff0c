"""Typed configuration for Ling-3.0 (BailingMoeV3, ``model_type: bailing_hybrid``) checkpoints.

Source of the fields: the checkpoint's ``config.json`` as public engines read it
(``docs/references.md`` §1.1, §1.2 and §4; transformers'
``BailingHybridConfig``). Unknown *optional* keys are kept in ``extra``; missing required keys and
contradictions raise :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, asdict
from pathlib import Path
from typing import Any

from bytebound.errors import ConfigError

MODEL_TYPES = ("bailing_hybrid",)
# The reconstructed full-scale Ling-3.0-flash config (see assets/configs/README.md for its provenance).
LING3_FLASH_CONFIG = Path(__file__).resolve().parent / "assets" / "configs" / "ling-3.0-flash.json"

# Fields a config.json must carry: the model cannot be built without them.
REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "layer_group_size",
)

# Integer fields and their smallest valid value. Widths and counts the model is built from must be >= 1: a 0
# builds empty weights that either fail later inside torch (hidden_size, heads, head_dim, conv kernel) or turn a
# layer into a silent no-op (kv_lora_rank, v_head_dim). 0 is valid where it means "none": num_experts (a dense-only
# model, see is_moe) with num_experts_per_tok 0, first_k_dense_replace, num_shared_experts, and one of the two MLA
# q/k parts (validate checks their sum). The two MLP widths must be >= 1 only where a layer uses them (validate).
INT_FIELDS = {
    "vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 1,
    "kv_lora_rank": 1, "v_head_dim": 1, "short_conv_kernel_size": 1,
    "intermediate_size": 0, "moe_intermediate_size": 0, "num_experts": 0, "num_experts_per_tok": 0,
    "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "first_k_dense_replace": 0, "num_shared_experts": 0,
}
# Sanity ceilings, far above any real model (Ling-3.0-flash: 42 layers, largest dim vocab 157184): they catch a
# typo before the ledger or the model constructor loops over a billion layers or asks torch for an impossible
# tensor. 2**31 - 1 is the int32 index range of the kernels.
MAX_LAYERS = 10_000
MAX_DIM = 2**31 - 1


def _is_int(v) -> bool:
    """A JSON integer: ``True`` and ``64.0`` are not sizes."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class QuantConfig:
    """The checkpoint's ``quantization_config`` (Ling fp4 form, reference section 4).

    Attributes:
        method: ``"fp8"`` (dense linears are E4M3 with block scales) or ``"none"``.
        weight_block_size: FP8 scale block ``(128, 128)`` over ``[N, K]``.
        scale_fmt: ``"ue8m0"`` means every FP8 ``weight_scale_inv`` is a power of two.
        modules_to_not_convert: suffix patterns of linears kept in BF16 (``lm_head``, ``b_proj``).
        routed_experts: ``"mxfp4"`` (E2M1 + E8M0 per 32 inputs), ``"fp8"`` or ``"none"``.
        routed_group_size: MXFP4 scale group along K (32 by the OCP MX spec).
    """

    method: str = "none"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "ue8m0"
    modules_to_not_convert: tuple[str, ...] = ("lm_head",)
    routed_experts: str = "none"
    routed_group_size: int = 32

    def linear_is_fp8(self, name: str) -> bool:
        """Whether the linear module called ``name`` is stored as FP8 block weights."""
        if self.method != "fp8":
            return False
        # Suffix match on a dot boundary: "b_proj" must not catch "kv_b_proj".
        return not any(name == m or name.endswith("." + m) for m in self.modules_to_not_convert)

    def to_json(self) -> dict[str, Any] | None:
        if self.method == "none":
            return None
        d: dict[str, Any] = {
            "quant_method": self.method, "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(self.weight_block_size), "scale_fmt": self.scale_fmt,
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }
        if self.routed_experts != "none":
            d["routed_experts_quant_method"] = self.routed_experts
            d["routed_experts_group_size"] = self.routed_group_size
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> "QuantConfig":
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ConfigError(f"quantization_config={d!r} must be an object (or null), got {type(d).__name__}")
        if not d:
            return cls()
        method = d.get("quant_method", "none")
        if method not in ("fp8", "none"):
            raise ConfigError(f"quantization_config.quant_method={method!r} is not supported (expected 'fp8')")
        if d.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"quantization_config.fmt={d.get('fmt')!r} is not supported (expected 'e4m3')")
        wbs = d.get("weight_block_size") or (128, 128)
        if not isinstance(wbs, (list, tuple)) or len(wbs) != 2 or not all(_is_int(b) and b > 0 for b in wbs):
            raise ConfigError(f"quantization_config.weight_block_size={wbs!r} must be two positive ints")
        routed = d.get("routed_experts_quant_method", method)
        if routed not in ("mxfp4", "none"):
            raise ConfigError(f"quantization_config.routed_experts_quant_method={routed!r} is not supported "
                              "(routed experts must be 'mxfp4', as in Ling-3.0-flash-fp4, or unquantised)")
        gs = d.get("routed_experts_group_size", 32)
        if not _is_int(gs):
            raise ConfigError(f"quantization_config.routed_experts_group_size={gs!r} must be an int")
        if routed == "mxfp4" and gs != 32:
            raise ConfigError(f"quantization_config.routed_experts_group_size={gs}: MXFP4 needs 32")
        skip = d.get("modules_to_not_convert") or ("lm_head",)
        # a bare string would become a tuple of characters and silently quantise lm_head
        if not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) for m in skip):
            raise ConfigError(f"quantization_config.modules_to_not_convert={skip!r} must be a list of names")
        return cls(method=method, weight_block_size=(int(wbs[0]), int(wbs[1])),
                   scale_fmt=d.get("scale_fmt", "ue8m0"),
                   modules_to_not_convert=tuple(skip),
                   routed_experts=routed, routed_group_size=gs)


# Pure renames: another spelling of one of our fields -> ours. transformers' ``BailingHybridConfig`` (>= 5.20)
# reads our names through its ``attribute_map`` but ``save_pretrained`` writes its own (the map's right-hand
# side), e.g. ``num_experts_per_token``; its in-memory names (``num_local_experts``...) appear in configs
# written by hand from its docs.
SPELLINGS = {
    "num_experts_per_token": "num_experts_per_tok",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "model_max_length": "max_position_embeddings",
    "num_local_experts": "num_experts",
    "n_shared_experts": "num_shared_experts",
    "num_mtp_layers": "num_nextn_predict_layers",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
    "dtype": "torch_dtype",
}
# transformers' per-layer kind names (``layer_types`` / ``mlp_layer_types``) -> our layer_group_size entries.
HF_ATTN_KINDS = {"linear_attention": 1, "full_attention": 0}
HF_MLP_KINDS = ("dense", "sparse")


def _agree(d: dict, ours: str, theirs: str, value) -> None:
    """Set ``d[ours] = value`` unless ``d`` already gives a different one (ConfigError naming both keys)."""
    if ours in d and d[ours] is not None and d[ours] != value:
        raise ConfigError(f"config fields {ours}={d[ours]!r} and {theirs}={value!r} contradict each other "
                          f"(two spellings of one setting)")
    d[ours] = value


def resolve_spellings(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of a parsed ``config.json`` with transformers' ``BailingHybridConfig`` spellings turned into ours.

    ``BailingHybridForCausalLM.save_pretrained`` (transformers >= 5.20, ``configuration_bailing_hybrid.py``)
    writes the :data:`SPELLINGS` on the left and, from its ``__post_init__``:

    * ``linear_head_dim`` (the KDA head width, our ``head_dim``) with ``head_dim`` set to the MLA rope width
      (``qk_rope_head_dim``); ``linear_num_heads`` (the KDA heads: ours are ``num_attention_heads``);
    * ``rope_parameters`` (``rope_type``, ``rope_theta`` and the YaRN keys), which its rotary embedding reads
      instead of the top-level ``rope_theta`` (left at the class default 6e6 in a saved file, so ignored here);
    * ``layer_types`` (``linear_attention`` = KDA / ``full_attention`` = MLA per layer), which its model reads
      instead of ``layer_group_size``; ``mlp_layer_types`` (``dense`` / ``sparse``), read instead of
      ``first_k_dense_replace``;
    * ``qk_head_dim`` (nope + rope), ``hidden_act`` (``silu``), ``attention_bias`` (false): checked, not stored.

    Their keys are consumed (not kept in ``extra``), so :meth:`LingConfig.to_dict` writes our spelling only.

    Raises:
        ConfigError: two spellings of one setting disagree, or a transformers setting has no bytebound
            equivalent (``linear_num_heads`` != ``num_attention_heads``, a dense layer after a sparse one,
            ``hidden_act`` other than silu, ``attention_bias`` true, an unknown layer kind).
    """
    d = dict(d)
    for theirs, ours in SPELLINGS.items():
        if theirs in d:
            _agree(d, ours, theirs, d.pop(theirs))
    if "linear_head_dim" in d:
        # transformers' form: head_dim is the rope width, linear_head_dim the KDA head width
        rope_w, kda_w = d.get("head_dim"), d.pop("linear_head_dim")
        if rope_w is not None and "qk_rope_head_dim" in d and rope_w != d["qk_rope_head_dim"]:
            raise ConfigError(f"config field head_dim={rope_w!r} must equal qk_rope_head_dim="
                              f"{d['qk_rope_head_dim']!r} when linear_head_dim is given (transformers' "
                              "BailingHybridConfig spelling: head_dim is the MLA rope width)")
        d["head_dim"] = kda_w
    if "linear_num_heads" in d:
        n = d.pop("linear_num_heads")
        if n != d.get("num_attention_heads"):
            raise ConfigError(f"config field linear_num_heads={n!r} must equal num_attention_heads="
                              f"{d.get('num_attention_heads')!r} (KDA and MLA layers share the head count)")
    rp = d.pop("rope_parameters", None)
    if rp is not None:
        if not isinstance(rp, dict):
            raise ConfigError(f"rope_parameters={rp!r} must be an object (or null)")
        rp = dict(rp)
        rt = rp.pop("rope_type", rp.pop("type", "default"))
        if "rope_theta" in rp:
            d["rope_theta"] = rp.pop("rope_theta")
        if rt == "default":
            if d.get("rope_scaling"):
                raise ConfigError(f"rope_parameters.rope_type='default' contradicts rope_scaling="
                                  f"{d['rope_scaling']!r}")
        else:
            # rope_scaling's form: rope_type plus the scaling keys (validate checks the type and the keys)
            d["rope_scaling"] = {"rope_type": rt, **rp}
    lt = d.pop("layer_types", None)
    if lt is not None:
        if not isinstance(lt, list) or any(x not in HF_ATTN_KINDS for x in lt):
            raise ConfigError(f"layer_types={lt!r} must be a list of {' / '.join(HF_ATTN_KINDS)}")
        kinds = tuple(HF_ATTN_KINDS[x] for x in lt)
        g = d.get("layer_group_size")
        derived = (tuple(int((i + 1) % g != 0) for i in range(len(kinds)))
                   if _is_int(g) and g >= 1 else None)
        # keep the int form where it says the same (the usual case); otherwise the per-layer list
        d["layer_group_size"] = g if derived == kinds else list(kinds)
    mt = d.pop("mlp_layer_types", None)
    if mt is not None:
        if not isinstance(mt, list) or any(x not in HF_MLP_KINDS for x in mt):
            raise ConfigError(f"mlp_layer_types={mt!r} must be a list of {' / '.join(HF_MLP_KINDS)}")
        k = mt.count("dense")
        if mt[:k] != ["dense"] * k:
            raise ConfigError(f"mlp_layer_types={mt!r}: a dense layer after a sparse one is not supported "
                              "(dense layers must be the first ones, first_k_dense_replace)")
        _agree(d, "first_k_dense_replace", "mlp_layer_types", k)
    qk = d.pop("qk_head_dim", None)
    if qk is not None and qk != (d.get("qk_nope_head_dim") or 0) + (d.get("qk_rope_head_dim") or 0):
        raise ConfigError(f"config field qk_head_dim={qk!r} must equal qk_nope_head_dim + qk_rope_head_dim")
    act = d.pop("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r} is not supported (Ling-3.0 uses silu / SwiGLU)")
    if d.pop("attention_bias", False):
        raise ConfigError("attention_bias=true is not supported (Ling-3.0 projections have no bias)")
    return d


@dataclass(frozen=True)
class LingConfig:
    """Architecture of a BailingMoeV3 model; one field per ``config.json`` key the engine reads.

    Layer kinds: with an int ``layer_group_size`` g, layer i is MLA iff ``(i + 1) % g == 0`` (SGLang
    ``is_linear_layer``, HF ``layer_types``); a list gives one entry per layer, 1 = KDA (linear), 0 = MLA.
    Layers ``i < first_k_dense_replace`` use a dense SwiGLU MLP, the rest the routed MoE.
    The NEXTN layer is ``model.layers.{num_hidden_layers}`` (MLA + MoE).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    layer_group_size: int | tuple[int, ...]
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    first_k_dense_replace: int = 0
    num_shared_experts: int = 1
    moe_shared_expert_intermediate_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    router_dtype: str = "fp32"
    expert_swiglu_limit_list: tuple[float | None, ...] | None = None
    share_expert_swiglu_limit_list: tuple[float | None, ...] | None = None
    q_lora_rank: int | None = None
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_scaling: dict | None = None
    max_position_embeddings: int = 131072
    gated_attention_proj_granularity_type: str = "head_wise"
    short_conv_kernel_size: int = 4
    no_kda_lora: bool = True
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    num_nextn_predict_layers: int = 0
    pad_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    bos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    quant: QuantConfig = field(default_factory=QuantConfig)
    architectures: tuple[str, ...] = ("BailingMoeV3ForCausalLM",)
    extra: dict = field(default_factory=dict)

    # ---- derived -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """MLA query/key width per head: nope + rope (128 + 64 = 192 for Ling-3.0-flash)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        """KDA projection width: heads x head_dim (32 x 128 = 4096)."""
        return self.num_attention_heads * self.head_dim

    @property
    def mla_cache_dim(self) -> int:
        """Latent KV values cached per token per MLA layer: kv_lora_rank + qk_rope_head_dim (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate(self) -> int:
        base = self.moe_shared_expert_intermediate_size or self.moe_intermediate_size
        return base * self.num_shared_experts

    def is_mla(self, i: int) -> bool:
        """True when layer ``i`` is gated MLA (the NEXTN layer, ``i >= num_hidden_layers``, always is)."""
        if i >= self.num_hidden_layers:
            return True
        g = self.layer_group_size
        if isinstance(g, tuple):
            return g[i] == 0
        return (i + 1) % g == 0

    def is_moe(self, i: int) -> bool:
        """True when layer ``i`` uses routed experts (NEXTN layer included)."""
        return i >= self.first_k_dense_replace and self.num_experts > 0

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_mla(i)]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_mla(i)]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, tuple) else (int(e),)

    def swiglu_limit(self, i: int, shared: bool = False) -> float | None:
        """Per-layer SwiGLU clamp from ``expert_swiglu_limit_list`` (None: no clamp)."""
        lst = self.share_expert_swiglu_limit_list if shared else self.expert_swiglu_limit_list
        if not lst or i >= len(lst):
            return None
        v = lst[i]
        return None if v is None or v <= 0 else float(v)

    # ---- I/O -----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LingConfig":
        """Build from a parsed ``config.json``.

        Raises:
            ConfigError: wrong ``model_type``, a missing required field, a wrong type, or a contradiction
                (e.g. ``n_group`` not dividing ``num_experts``, ``layer_group_size`` list of the wrong length).
        """
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must be a JSON object {{...}}, got {json.dumps(d, default=repr)[:40]}")
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise ConfigError(f"model_type={mt!r} is not supported (expected one of {MODEL_TYPES})")
        # Other readers' spellings of the same model type (resolved before the required-field check).
        d = resolve_spellings(d)
        missing = [k for k in REQUIRED if k not in d or d[k] is None]
        if missing:
            raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}")
        names = {f.name for f in fields(cls)} - {"quant", "extra"}
        kw: dict[str, Any] = {}
        for k in names:
            if k in d:
                v = d[k]
                if isinstance(v, list):
                    v = tuple(v)
                kw[k] = v
        kw["quant"] = QuantConfig.from_json(d.get("quantization_config"))
        kw["extra"] = {k: v for k, v in d.items() if k not in names and k not in ("quantization_config", "model_type")}
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "LingConfig":
        """Read ``config.json`` (a file or a checkpoint directory). Raises ConfigError on bad JSON."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        elif p.is_file() and p.name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".pt", ".gguf")):
            # a weight file or index where the model's folder (or its config.json) belongs
            raise ConfigError(f"{p} is a weights file, not a model: give the checkpoint folder ({p.parent}), which "
                              "holds config.json and the weights")
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"no config.json at {p}" if p.name == "config.json" else f"no config file at {p}") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: invalid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: must be a JSON object {{...}}, got {json.dumps(d, default=repr)[:40]}")
        return cls.from_dict(d)

    def validate(self) -> None:
        """Check contradictions between fields; raise ConfigError naming them."""
        def bad(msg: str) -> None:
            raise ConfigError(msg)
        for name, low in INT_FIELDS.items():
            v = getattr(self, name)
            if not _is_int(v) or v < low:
                bad(f"config field {name}={v!r} must be " + ("a positive int" if low else "a non-negative int"))
            if v > MAX_DIM:
                bad(f"config field {name}={v} is larger than {MAX_DIM} (a typo?)")
        if self.num_hidden_layers > MAX_LAYERS:
            bad(f"config field num_hidden_layers={self.num_hidden_layers} is larger than {MAX_LAYERS} (a typo?)")
        if self.qk_nope_head_dim + self.qk_rope_head_dim < 1:
            bad("qk_nope_head_dim + qk_rope_head_dim must be >= 1 (MLA query/key width)")
        if (self.first_k_dense_replace > 0 or not self.num_experts) and self.intermediate_size < 1:
            bad(f"intermediate_size={self.intermediate_size} must be >= 1: the model has dense MLP layers "
                f"(first_k_dense_replace={self.first_k_dense_replace}, num_experts={self.num_experts})")
        if self.num_experts and self.moe_intermediate_size < 1:
            bad(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1 when num_experts > 0")
        g = self.layer_group_size
        if isinstance(g, tuple):
            if len(g) != self.num_hidden_layers:
                bad(f"layer_group_size list has {len(g)} entries, num_hidden_layers={self.num_hidden_layers}")
            if any(x not in (0, 1) for x in g):
                bad("layer_group_size list entries must be 1 (KDA/linear) or 0 (MLA)")
        elif not isinstance(g, int) or g < 1:
            bad(f"layer_group_size={g!r} must be a positive int or a per-layer list")
        if self.num_experts:
            if self.num_experts_per_tok > self.num_experts:
                bad(f"num_experts_per_tok={self.num_experts_per_tok} > num_experts={self.num_experts}")
            if self.n_group < 1 or self.num_experts % self.n_group:
                bad(f"n_group={self.n_group} must divide num_experts={self.num_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                bad(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            per_group = self.num_experts // self.n_group
            if self.topk_group * per_group < self.num_experts_per_tok:
                bad(f"topk_group={self.topk_group} groups of {per_group} experts cannot hold "
                    f"num_experts_per_tok={self.num_experts_per_tok}")
            if self.n_group > 1 and per_group < 2:
                bad("group-limited routing scores each group by its top-2 experts: need >= 2 experts per group")
        for name, low in (("rms_norm_eps", 0.0), ("rope_theta", 0.0), ("routed_scaling_factor", 0.0),
                          ("max_position_embeddings", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > low or v != v:
                bad(f"config field {name}={v!r} must be a number > {low}")
        if isinstance(self.kda_lower_bound, bool) or not isinstance(self.kda_lower_bound, (int, float)) \
                or not self.kda_lower_bound < 0:
            bad(f"kda_lower_bound={self.kda_lower_bound!r} must be a negative number (log-space decay bound)")
        if self.num_experts and self.num_experts_per_tok < 1:
            bad(f"num_experts_per_tok={self.num_experts_per_tok} must be >= 1 when num_experts > 0")
        if self.score_function != "sigmoid":
            bad(f"score_function={self.score_function!r} is not supported (Ling-3.0 uses 'sigmoid')")
        if self.q_lora_rank is not None:
            bad("q_lora_rank must be null: Ling-3.0 MLA has no q-LoRA")
        if not self.no_kda_lora:
            bad("no_kda_lora=false (low-rank KDA gates) is not supported")
        if self.gated_attention_proj_granularity_type != "head_wise":
            bad(f"gated_attention_proj_granularity_type={self.gated_attention_proj_granularity_type!r}: "
                "only 'head_wise' is supported")
        if self.qk_rope_head_dim % 2:
            bad(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.first_k_dense_replace > self.num_hidden_layers:
            bad(f"first_k_dense_replace={self.first_k_dense_replace} > num_hidden_layers")
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            bad(f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads")
        if self.tie_word_embeddings:
            bad("tie_word_embeddings=true: Ling-3.0 has an untied LM head")
        if self.num_nextn_predict_layers not in (0, 1):
            bad(f"num_nextn_predict_layers={self.num_nextn_predict_layers}: only 0 or 1 supported")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            bad(f"rope_scaling={self.rope_scaling!r} must be an object (or null)")
        if self.rope_scaling:
            rt = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rt not in ("yarn", "default"):
                bad(f"rope_scaling.rope_type={rt!r} is not supported (yarn or default)")
            if rt == "yarn" and "original_max_position_embeddings" not in self.rope_scaling:
                bad("rope_scaling yarn needs original_max_position_embeddings")
        for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            lst = getattr(self, name)
            if lst is not None and len(lst) not in (self.num_hidden_layers, self.num_hidden_layers + 1):
                bad(f"{name} has {len(lst)} entries, expected num_hidden_layers (+1 for NEXTN)")
        for i in self.eos_ids:
            if not 0 <= i < self.vocab_size:
                bad(f"eos_token_id {i} outside vocab_size={self.vocab_size}")

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` form (round-trips through :meth:`from_dict`)."""
        d = {}
        for f in fields(self):
            if f.name in ("quant", "extra"):
                continue
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        d["model_type"] = "bailing_hybrid"
        q = self.quant.to_json()
        if q:
            d["quantization_config"] = q
        for k, v in self.extra.items():
            d.setdefault(k, v)
        return d

    def replace(self, **kw) -> "LingConfig":
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(kw)
        cfg = LingConfig(**d)
        cfg.validate()
        return cfg


def tiny_config(**overrides) -> LingConfig:
    """A small random-test config: 4 layers (KDA, MLA, KDA, MLA), hidden 64, 16 experts in 4 groups.

    Matches the acceptance shape of issue 2 (layer_group_size 2, top-4, topk_group 2, one NEXTN layer).
    """
    base = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
        intermediate_size=96, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, layer_group_size=2, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, rope_theta=10000.0, num_nextn_predict_layers=1, pad_token_id=0,
        eos_token_id=1, max_position_embeddings=4096,
    )
    base.update(overrides)
    quant = base.pop("quant", QuantConfig())
    d = {k: (tuple(v) if isinstance(v, list) else v) for k, v in base.items()}
    cfg = LingConfig(quant=quant, **d)
    cfg.validate()
    return cfg


def dumps(cfg: LingConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=2)


__all__ = ["LingConfig", "QuantConfig", "tiny_config", "dumps", "asdict"]
