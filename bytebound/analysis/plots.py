"""PNG plots of an ``analyze`` report (matplotlib, Agg backend): ledger bars, roofline, KV vs context, speed-up.

Each function takes the report dict of :func:`bytebound.analysis.cli.build_report` and a path, and writes one PNG.
Units: GB = 1e9 B, GB/s, FLOP/B, tokens.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

GB = 1e9


def _seed(rep, key):
    return rep["seed"][key]["value"]


def ledger_bars(rep: dict, path: Path) -> None:
    """Stacked bars of bytes per decode step: seed mode (active weights at b_w + head) vs the exact ledger
    by tensor group, each with a BF16 and an FP8 LM head (seed section 4)."""
    fig, ax = plt.subplots(figsize=(10, 4.2))
    bars = [("seed, BF16 head", {"active weights @4 bit": _seed(rep, "active_bytes_gb"),
                                  "LM head": _seed(rep, "lm_head_bf16_gb")}),
            ("seed, FP8 head", {"active weights @4 bit": _seed(rep, "active_bytes_gb"),
                                 "LM head": _seed(rep, "lm_head_fp8_gb")})]
    if rep["ledger"]:
        for tag, key in (("exact, BF16 head", "bf16_head"), ("exact, FP8 head", "fp8_head")):
            d: dict[str, float] = {}
            groups = rep["ledger"][key]["groups"]
            total = sum(v["bytes"] for v in groups.values())
            for g, v in groups.items():
                # groups under 0.5 % of the step share one segment; the LM head always has its own (last)
                name = g if g == "LM head" or v["bytes"] > 0.005 * total else "small (norms, conv, b_proj, ...)"
                d[name] = d.get(name, 0.0) + v["bytes"] / GB
            if "LM head" in d:
                d["LM head"] = d.pop("LM head")
            bars.append((tag, d))
    names = list(dict.fromkeys(g for _, d in bars for g in d))
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
               "tab:cyan", "gold", "navy", "lime"]
    rest = [g for g in names if g not in ("LM head", "active weights @4 bit")]
    colors = {g: palette[i % len(palette)] for i, g in enumerate(rest)}
    colors["LM head"], colors["active weights @4 bit"] = "tab:red", "tab:gray"
    for y, (label, d) in enumerate(bars):
        left = 0.0
        for g, w in d.items():
            ax.barh(y, w, left=left, color=colors[g], edgecolor="white", label=g)
            left += w
        ax.text(left + 0.03, y, f"{left:.3f} GB", va="center", fontsize=9)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlabel("bytes read per decode step [GB = 1e9 B], KV excluded")
    ax.set_xlim(0, max(sum(d.values()) for _, d in bars) * 1.22)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("byte ledger of one batch-1 decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def roofline(rep: dict, path: Path) -> None:
    """Roofline: attainable FLOP/s = min(peak, I x bandwidth); points at the operating intensity
    I = 2 P_act / B_step with the achieved 2 P_act / TPOT (seed section 5)."""
    inp = rep["inputs"]
    peak, bw = inp["peak_flops"], inp["bandwidth_gbs"] * GB
    x = np.logspace(-1, 5, 200)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(x, np.minimum(peak, x * bw), "k-", lw=1.5, label=f"roof: {bw / GB:g} GB/s, {peak / 1e12:g} TFLOP/s")
    ridge = peak / bw
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.text(ridge * 1.1, peak / 30, f"ridge {ridge:.0f} FLOP/B", fontsize=8, color="gray")
    pts = [("seed", inp["active_params"], _seed(rep, "step_bytes_bf16_gb") * GB, "tab:blue", True)]
    if rep["exact"]:
        e = rep["exact"]
        # achieved only at a TPOT measured on this model (cli.exact_values leaves B_eff out otherwise)
        pts.append(("exact", e["active_params_b"] * GB, e["step_bytes_bf16_gb"] * GB, "tab:red", "b_eff_gbs" in e))
    for name, p, b, col, timed in pts:
        ai, achieved = 2 * p / b, 2 * p / (inp["tpot_ms"] * 1e-3)
        ax.plot([ai], [ai * bw], "o", mfc="none", color=col, ms=8, label=f"{name}: bandwidth bound at I={ai:.2f}")
        if timed:
            ax.plot([ai], [achieved], "o", color=col, label=f"{name}: achieved at {inp['tpot_ms']:g} ms")
    ax.set_xlabel("arithmetic intensity [FLOP/B]")
    ax.set_ylabel("FLOP/s")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("roofline, batch-1 decode (BF16 head)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def kv_context(rep: dict, path: Path) -> None:
    """KV read per step vs context: N x KV_tok (MLA latent, seed section 13) against the weight bytes,
    plus the KDA state, constant in N (exact ledger)."""
    inp = rep["inputs"]
    kv_tok = inp["mla_layers"] * inp["mla_cache_dim"] * inp["kv_bytes"]
    n = np.logspace(3, 6, 200)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(n, n * kv_tok / GB, "tab:purple", label=f"MLA KV, {kv_tok / 1024:.2f} KiB/token")
    ax.axhline(_seed(rep, "step_bytes_bf16_gb"), color="tab:blue", ls="--", label="seed weights, BF16 head")
    if rep["exact"]:
        e = rep["exact"]
        ax.axhline(e["step_bytes_bf16_gb"], color="tab:red", ls="--", label="exact weights, BF16 head")
        ax.axhline(e["kda_state_mb"] / 1e3, color="tab:green", ls=":", label="KDA state (any length)")
    for c in inp["contexts"]:
        ax.plot([c], [c * kv_tok / GB], "o", color="tab:purple")
        ax.annotate(f"{c // 1000}K", (c, c * kv_tok / GB), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("context length [tokens]")
    ax.set_ylabel("bytes read per decode step [GB]")
    ax.legend(fontsize=8)
    ax.set_title("KV / state read vs context (batch 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def speculative(rep: dict, path: Path) -> None:
    """Speed-up S = a / c over accept length a and round cost c (seed section 8), with the S = 1 contour and
    the operating points (seed c, GSM8K a, exact byte ratio c_B, fallback a = 1)."""
    inp = rep["inputs"]
    a, c = np.meshgrid(np.linspace(0.8, 4.5, 200), np.linspace(1, 3, 200))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cs = ax.contourf(a, c, a / c, levels=np.arange(0.25, 4.6, 0.25), cmap="RdYlGn")
    fig.colorbar(cs, ax=ax, label="S = a / c")
    ax.contour(a, c, a / c, levels=[1.0], colors="k", linewidths=1.5)
    pts = [("synthetic", inp["accept_length"], inp["verify_cost"], "o"),
           ("GSM8K", inp["accept_length_gsm8k"], inp["verify_cost"], "s"),
           ("fallback a=1", 1.0, inp["verify_cost"], "X")]
    if rep["exact"] and "spec_speedup" in rep["exact"]:       # a measured on this model
        pts.append(("exact c_B", inp["accept_length"], rep["exact"]["byte_ratio"], "D"))
    pts.append((f"reported {inp['tpot_mtp_ms']:g} ms", inp["accept_length"],
                inp["accept_length"] * inp["tpot_mtp_ms"] / inp["tpot_fp8_head_ms"], "^"))
    for name, x, y, m in pts:
        ax.plot([x], [y], m, color="k", mfc="white", ms=8)
        right = x > 2
        ax.annotate(f"{name}: S={x / y:.2f}", (x, y), textcoords="offset points", xytext=(-8 if right else 8, 6),
                    fontsize=8, ha="right" if right else "left")
    ax.set_xlabel("accept length a [tokens per round]")
    ax.set_ylabel("c = round cost / plain step")
    ax.set_title("speculative speed-up, S = a / c (black: S = 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PLOTS = {"ledger.png": ledger_bars, "roofline.png": roofline, "kv_context.png": kv_context,
         "speculative.png": speculative}


def save_all(rep: dict, outdir: str | Path) -> list[Path]:
    """Write the four PNGs into ``outdir``; returns their paths."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fn in PLOTS.items():
        fn(rep, out / name)
        paths.append(out / name)
    return paths
