"""The seed article's cost model (``shared/seeds/000_*.txt``), formula by formula, and its derived numbers.

The seed assumes every active weight is read at ``b_w`` bits and lists the LM head separately (section 4).
Each function below is one formula, with the seed section it comes from. :func:`seed_report` evaluates them
on the seed's inputs (:class:`SeedInputs`) and returns each derived number twice:

* ``value`` — the seed's own arithmetic. The seed reuses its *printed* intermediates as operands: the step
  bytes as printed (3.355 GB, 2.952 GB: GB rounded to the MB) and, for three numbers, a rounded result
  (see ``SeedValue.note``). With these operands every number of the seed is reproduced to its printed digits.
* ``exact`` — the same formula without intermediate rounding.

Units follow the seed: GB = 1e9 B, GB/s = 1e9 B/s, ms, KiB = 1024 B (KV per token), MB = 1e6 B (KV at a
context length), and the seed's "2K / 32K / 256K" contexts are 2,000 / 32,000 / 256,000 tokens (32,768 tokens
would give 264 MB, not the printed 258 MB).
"""

from __future__ import annotations

from dataclasses import dataclass, asdict

from bytebound.analysis.ledger import expected_distinct_experts

GB = 1e9


@dataclass(frozen=True)
class SeedInputs:
    """The seed's inputs: vendor reports [1], product specs [2] and config.json [4] (section numbers in comments)."""

    active_params: float = 5.1e9       # P_act, [1] (sections 1, 4)
    weight_bits: float = 4.0           # b_w, MXFP4 (section 4)
    vocab: int = 157184                # V, [4]
    hidden: int = 2560                 # d, [4]
    head_bits: float = 16.0            # b_lm, BF16 head (baseline)
    head_bits_fp8: float = 8.0         # b_lm after online FP8 (section 7)
    bandwidth_gbs: float = 273.0       # B_spec, DGX Spark nominal [2]
    peak_flops: float = 1e15           # FP4 tensor cores, 1 PFLOP nominal [2]
    tpot_ms: float = 27.71             # baseline TPOT, synthetic [1]
    tpot_humming_ms: float = 25.35     # + Humming [1]
    tpot_fp8_head_ms: float = 22.76    # + FP8 LM head [1]
    tpot_mtp_ms: float = 9.72          # + MTP [1]
    tok_s_base: float = 36.09          # [1]
    tok_s_mtp: float = 102.88          # [1]
    tpot_gsm8k_ms: float = 26.45       # GSM8K baseline [1]
    tpot_gsm8k_all_ms: float = 18.56   # GSM8K all three [1]
    tok_s_gsm8k: float = 37.81         # [1]
    tok_s_gsm8k_all: float = 53.89     # [1]
    accept_length: float = 3.90        # a, synthetic [1]
    accept_length_gsm8k: float = 2.68  # a, GSM8K [1]
    verify_cost: float = 2.26          # c [1]
    draft_tokens: int = 4              # verify window [1]
    num_experts: int = 512             # E [4]
    top_k: int = 8                     # [4]
    mla_layers: int = 7                # [1]
    mla_cache_dim: int = 576           # kv_lora_rank + qk_rope_head_dim [4]
    kv_bytes: int = 2                  # BF16 cache (section 13)
    contexts: tuple[int, ...] = (2000, 32000, 256000)  # "2K / 32K / 256K" (section 13)


# The inputs measured with one model, the Ling-3.0-flash fp4 checkpoint on a DGX Spark [1]: they price that model
# only (the others are the hardware's specs [2] and the config's shapes [4], or the seed's own choices).
MEASURED = ("tpot_ms", "tpot_humming_ms", "tpot_fp8_head_ms", "tpot_mtp_ms", "tok_s_base", "tok_s_mtp",
            "tpot_gsm8k_ms", "tpot_gsm8k_all_ms", "tok_s_gsm8k", "tok_s_gsm8k_all", "accept_length",
            "accept_length_gsm8k", "verify_cost")


# ---- formulas ---------------------------------------------------------------------------------------------
def step_bytes(active_params: float, weight_bits: float, vocab: int, hidden: int, head_bits: float) -> float:
    """Section 4: B_step = P_act b_w / 8 + V d b_lm / 8  [B] (no KV, no scales, no mixed precision)."""
    return active_params * weight_bits / 8 + lm_head_params(vocab, hidden) * head_bits / 8


def lm_head_params(vocab: int, hidden: int) -> int:
    """Section 7: V x d parameters of the LM head (157184 x 2560 = 402.39 M)."""
    return vocab * hidden


def effective_bandwidth(nbytes: float, tpot_ms: float) -> float:
    """Section 5: B_eff = B_step / TPOT  [GB/s] (an equivalent figure, not a bus counter)."""
    return nbytes / (tpot_ms * 1e-3) / GB


def utilisation(b_eff_gbs: float, b_spec_gbs: float) -> float:
    """Section 5: U = B_eff / B_spec (dimensionless)."""
    return b_eff_gbs / b_spec_gbs


def floor_ms(nbytes: float, bandwidth_gbs: float) -> float:
    """Sections 5/18: time floor of a step that must read ``nbytes`` at ``bandwidth_gbs``  [ms]."""
    return nbytes / (bandwidth_gbs * GB) * 1e3


def arithmetic_intensity(active_params: float, nbytes: float) -> float:
    """Section 5: I = 2 P_act / B_step  [FLOP/B] (one multiply-add per active weight)."""
    return 2 * active_params / nbytes


def ridge_point(peak_flops: float, bandwidth_gbs: float) -> float:
    """Section 5: ridge = peak FLOP/s / bandwidth  [FLOP/B] (1e15 / 273e9 = 3663)."""
    return peak_flops / (bandwidth_gbs * GB)


def speculative_speedup(accept_length: float, verify_cost: float) -> float:
    """Section 8: S = TPOT_0 / TPOT_1 ~= a / c (c: a round's time over one plain step's time)."""
    return accept_length / verify_cost


def speculative_tpot(tpot_ms: float, accept_length: float, verify_cost: float) -> float:
    """Section 8: TPOT_1 = TPOT_0 c / a  [ms] (22.76 x 2.26 / 3.90 = 13.19)."""
    return tpot_ms * verify_cost / accept_length


def byte_ratio_needed(tpot_mtp_ms: float, b_eff_gbs: float, accept_length: float, nbytes: float) -> float:
    """Section 8: c_B that makes a byte model hit the measured MTP TPOT: c_B = TPOT_mtp B_eff a / B_step."""
    return tpot_mtp_ms * 1e-3 * b_eff_gbs * GB * accept_length / nbytes


def equivalent_bytes(verify_cost: float, nbytes: float, accept_length: float) -> float:
    """Section 10: bytes per accepted token with MTP = c B_step / a  [B]."""
    return verify_cost * nbytes / accept_length


def fallback_tpot(verify_cost: float, tpot_ms: float) -> float:
    """Section 11: silent fallback (a = 1): TPOT = c x TPOT_mid  [ms] (2.26 x 22.76 = 51)."""
    return verify_cost * tpot_ms


def kv_bytes_per_token(mla_layers: int, cache_dim: int, kv_bytes: int) -> int:
    """Section 13: KV_tok = n_MLA x (kv_lora_rank + rope) x bytes  [B] (7 x 576 x 2 = 8064 B = 7.88 KiB)."""
    return mla_layers * cache_dim * kv_bytes


# ---- the seed's numbers -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SeedValue:
    """One derived number: ``value`` (seed arithmetic), ``exact``, how the seed prints it, and where."""

    key: str
    label: str
    value: float
    exact: float
    fmt: str      # format spec of the seed's printed digits
    unit: str
    section: str
    note: str = ""

    @property
    def printed(self) -> str:
        return format(self.value, self.fmt)


def seed_report(s: SeedInputs = SeedInputs()) -> dict[str, SeedValue]:
    """Every derived number of the seed, keyed by name (see the module docstring for value vs exact)."""
    out: dict[str, SeedValue] = {}

    def put(key, label, value, exact, fmt, unit, section, note=""):
        out[key] = SeedValue(key, label, value, exact, fmt, unit, section, note)

    head = lm_head_params(s.vocab, s.hidden)
    act = s.active_params * s.weight_bits / 8
    b16x = step_bytes(s.active_params, s.weight_bits, s.vocab, s.hidden, s.head_bits)
    b8x = step_bytes(s.active_params, s.weight_bits, s.vocab, s.hidden, s.head_bits_fp8)
    b16, b8 = round(b16x / GB, 3) * GB, round(b8x / GB, 3) * GB  # the seed's printed operands
    h16, h8 = head * s.head_bits / 8, head * s.head_bits_fp8 / 8
    put("active_bytes_gb", f"active weights at {s.weight_bits:g} bit", act / GB, act / GB, ".2f", "GB", "4")
    put("lm_head_params_m", "LM head parameters", head / 1e6, head / 1e6, ".2f", "M", "7")
    put("lm_head_bf16_gb", "LM head BF16", h16 / GB, h16 / GB, ".3f", "GB", "4, 7")
    put("lm_head_fp8_gb", "LM head FP8", h8 / GB, h8 / GB, ".3f", "GB", "4, 7")
    put("step_bytes_bf16_gb", "step bytes, BF16 head", b16 / GB, b16x / GB, ".3f", "GB", "4")
    put("step_bytes_fp8_gb", "step bytes, FP8 head", b8 / GB, b8x / GB, ".3f", "GB", "4")
    put("lm_head_share_bf16_pct", "LM head share, BF16", 100 * h16 / b16, 100 * h16 / b16x, ".1f", "%", "7")
    put("lm_head_share_fp8_pct", "LM head share, FP8", 100 * h8 / b8, 100 * h8 / b8x, ".1f", "%", "7")
    put("floor_bf16_ms", "floor at B_spec, BF16 head", floor_ms(b16, s.bandwidth_gbs),
        floor_ms(b16x, s.bandwidth_gbs), ".2f", "ms", "5")
    beff, beffx = effective_bandwidth(b16, s.tpot_ms), effective_bandwidth(b16x, s.tpot_ms)
    put("b_eff_gbs", f"B_eff at {s.tpot_ms} ms", beff, beffx, ".1f", "GB/s", "5")
    put("utilisation", f"U on {s.bandwidth_gbs:g} GB/s", utilisation(beff, s.bandwidth_gbs),
        utilisation(beffx, s.bandwidth_gbs), ".2f", "", "5")
    hx = effective_bandwidth(b16x, s.tpot_humming_ms)
    put("b_eff_humming_gbs", f"B_eff at {s.tpot_humming_ms} ms", round(beff, 1) * s.tpot_ms / s.tpot_humming_ms,
        hx, ".1f", "GB/s", "6, derivations",
        "seed scales the printed 121.1 GB/s by 27.71/25.35; 3.355 GB / 25.35 ms is 132.3 (as section 7 prints)")
    hum = effective_bandwidth(b16, s.tpot_humming_ms)
    put("b_eff_humming_s7_gbs", "B_eff at Humming (section 7 operand)", hum, hx, ".1f", "GB/s", "7")
    put("fp8_head_cf_saving_ms", "FP8 head saving at baseline B_eff", (h16 - h8) / (beff * GB) * 1e3,
        (h16 - h8) / (beffx * GB) * 1e3, ".2f", "ms", "7")
    put("fp8_head_cf_tpot_ms", "FP8 head TPOT from baseline B_eff", b8 / (beff * GB) * 1e3,
        b8x / (beffx * GB) * 1e3, ".2f", "ms", "7", "from the printed 2.952 GB (unrounded operands give 24.39)")
    pred, predx = b8 / (round(hum, 1) * GB) * 1e3, b8x / (hx * GB) * 1e3
    put("fp8_head_pred_tpot_ms", "FP8 head TPOT from Humming B_eff", pred, predx, ".2f", "ms", "7")
    put("fp8_head_pred_err_pct", "prediction vs 22.76 ms", 100 * (pred / s.tpot_fp8_head_ms - 1),
        100 * (predx / s.tpot_fp8_head_ms - 1), ".1f", "%", "7")
    put("ai_flop_per_byte", "arithmetic intensity", arithmetic_intensity(s.active_params, b16),
        arithmetic_intensity(s.active_params, b16x), ".2f", "FLOP/B", "5")
    r = ridge_point(s.peak_flops, s.bandwidth_gbs)
    put("ridge_flop_per_byte", "ridge point", r, r, ".0f", "FLOP/B", "5")
    ne = expected_distinct_experts(s.num_experts, s.top_k, s.draft_tokens)
    put("distinct_experts", f"distinct experts for {s.draft_tokens} tokens", ne, ne, ".1f", "", "8")
    sp = speculative_speedup(s.accept_length, s.verify_cost)
    put("spec_speedup", f"S = a/c (a={s.accept_length:.2f}, c={s.verify_cost})", sp, sp, ".2f", "x", "8")
    t1 = speculative_tpot(s.tpot_fp8_head_ms, s.accept_length, s.verify_cost)
    put("spec_tpot_ms", "MTP TPOT predicted by a/c", t1, t1, ".2f", "ms", "8")
    sg = speculative_speedup(s.accept_length_gsm8k, s.verify_cost)
    put("spec_speedup_gsm8k", f"S = a/c (a={s.accept_length_gsm8k})", sg, sg, ".2f", "x", "14")
    put("byte_ratio_needed", "c_B needed for 9.72 ms", byte_ratio_needed(s.tpot_mtp_ms, beff, s.accept_length, b8),
        byte_ratio_needed(s.tpot_mtp_ms, beffx, s.accept_length, b8x), ".2f", "", "8")
    eq = equivalent_bytes(s.verify_cost, b8, s.accept_length)
    eqx = equivalent_bytes(s.verify_cost, b8x, s.accept_length)
    put("equiv_bytes_gb", "bytes per accepted token, MTP", eq / GB, eqx / GB, ".3f", "GB", "10")
    put("equiv_bytes_factor", "bytes factor", b16 / eq, b16x / eqx, ".2f", "x", "10")
    e2, e2x = effective_bandwidth(eq, s.tpot_mtp_ms), effective_bandwidth(eqx, s.tpot_mtp_ms)
    put("b_eff_mtp_gbs", "B_eff with MTP", e2, e2x, ".1f", "GB/s", "10")
    put("b_eff_factor", "bandwidth factor", e2 / beff, e2x / beffx, ".2f", "x", "10")
    put("decomposed_speedup", "bytes x bandwidth factors", (b16 / eq) * (e2 / beff), (b16x / eqx) * (e2x / beffx),
        ".2f", "x", "10")
    put("measured_speedup", "measured 102.88/36.09", s.tok_s_mtp / s.tok_s_base, s.tok_s_mtp / s.tok_s_base,
        ".2f", "x", "10")
    gq = equivalent_bytes(s.verify_cost, b8, s.accept_length_gsm8k)
    gqx = equivalent_bytes(s.verify_cost, b8x, s.accept_length_gsm8k)
    put("gsm8k_equiv_bytes_gb", "GSM8K bytes per accepted token", gq / GB, gqx / GB, ".3f", "GB", "10",
        "from the printed 2.952 GB (unrounded operands give 2.490)")
    put("gsm8k_bytes_factor", "GSM8K bytes factor", b16 / gq, b16x / gqx, ".2f", "x", "10")
    g0, g0x = effective_bandwidth(b16, s.tpot_gsm8k_ms), effective_bandwidth(b16x, s.tpot_gsm8k_ms)
    g1, g1x = effective_bandwidth(gq, s.tpot_gsm8k_all_ms), effective_bandwidth(gqx, s.tpot_gsm8k_all_ms)
    put("gsm8k_b_eff_gbs", "GSM8K baseline B_eff", g0, g0x, ".1f", "GB/s", "10")
    put("gsm8k_b_eff_all_gbs", "GSM8K all-three B_eff", g1, g1x, ".1f", "GB/s", "10")
    put("gsm8k_b_eff_factor", "GSM8K bandwidth factor", g1 / g0, g1x / g0x, ".2f", "x", "10")
    put("gsm8k_measured_speedup", "GSM8K measured 53.89/37.81", s.tok_s_gsm8k_all / s.tok_s_gsm8k,
        s.tok_s_gsm8k_all / s.tok_s_gsm8k, ".2f", "x", "10")
    fb = fallback_tpot(s.verify_cost, s.tpot_fp8_head_ms)
    put("fallback_tpot_ms", "fallback TPOT (a = 1)", fb, fb, ".0f", "ms", "11")
    put("fallback_tok_s", "fallback throughput", 1e3 / round(fb), 1e3 / fb, ".0f", "tok/s", "11",
        "seed divides by the rounded 51 ms (1000/51.44 = 19.4)")
    put("fallback_vs_base_pct", "fallback vs 36.09 tok/s", 100 * round(1e3 / round(fb)) / s.tok_s_base,
        100 * (1e3 / fb) / s.tok_s_base, ".0f", "%", "11", "seed uses the rounded 20 tok/s (exact 53.9 %)")
    kv = kv_bytes_per_token(s.mla_layers, s.mla_cache_dim, s.kv_bytes)
    put("kv_per_token_kib", "KV per token", kv / 1024, kv / 1024, ".2f", "KiB", "13")
    for n in s.contexts:
        tag = f"{n // 1000}K"
        mb = n * kv / 1e6
        if mb < 1000:
            put(f"kv_{tag}", f"KV at {tag}", mb, mb, ".0f", "MB", "13")
        else:
            put(f"kv_{tag}", f"KV at {tag}", mb / 1e3, mb / 1e3, ".2f", "GB", "13")
        put(f"kv_{tag}_pct", f"KV at {tag} / step bytes", 100 * n * kv / b16, 100 * n * kv / b16x, ".1f", "%", "13")
    return out


def as_json(rep: dict[str, SeedValue]) -> dict:
    return {k: {**asdict(v), "printed": v.printed} for k, v in rep.items()}
