"""Synthetic fixed-length benchmark: random prompt ids of ``input_len``, greedy decode of exactly ``output_len``.

EOS is ignored so every request decodes the full length (the seed's 32K-in / 2K-out workload). The byte floor of
one decode step comes from the exact ledger (:mod:`bytebound.analysis.ledger`) over the bandwidth measured in
the same run (:func:`bytebound.analysis.bandwidth.measure_read_bandwidth`); on CPU the ratio is against the
host's DRAM read bandwidth and says nothing about an accelerator.
"""

from __future__ import annotations

import time

import torch

from bytebound.sampling import SamplingParams


def synthetic_prompt(engine, n: int, seed: int = 0) -> list[int]:
    """``n`` seeded random token ids, avoiding the low special ids and every EOS id."""
    vocab = engine.model.cfg.vocab_size
    avoid = set(engine.stop_ids(SamplingParams())) | {engine.model.cfg.pad_token_id}
    lo = min(16, vocab - 1)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(lo, vocab, (n,), generator=g).tolist()
    return [i if i not in avoid else lo for i in ids]


def timed_request(engine, ids: list[int], params: SamplingParams, bar=None):
    """Run one request; returns ``(RequestOutput, token_times)`` with the arrival time [s] of every token."""
    times: list[float] = []
    out = None
    t0 = time.perf_counter()
    for chunk in engine.stream(ids, params):
        now = time.perf_counter() - t0
        times += [now] * len(chunk.token_ids)
        if bar is not None and chunk.token_ids:
            bar.update(len(chunk.token_ids))
        out = chunk.output or out
    return out, times


def run_synthetic(engine, input_len: int, output_len: int, num_requests: int = 1, warmup: int = 1, seed: int = 0,
                  progress: bool = True) -> dict:
    """Warm up, then ``num_requests`` requests (distinct seeded prompts); returns outputs and token times."""
    from tqdm import tqdm
    if warmup:
        wp = SamplingParams(max_tokens=min(8, output_len), ignore_eos=True)
        for i in range(warmup):
            engine.generate(synthetic_prompt(engine, min(64, input_len), seed - 1 - i), wp)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    outputs, token_times = [], []
    for r in range(num_requests):
        ids = synthetic_prompt(engine, input_len, seed + r)
        with tqdm(total=output_len, desc=f"synthetic {r + 1}/{num_requests}", unit="tok", disable=not progress,
                  mininterval=0.5) as bar:
            out, times = timed_request(engine, ids, params, bar)
            bar.set_postfix(tpot_ms=f"{out.tpot_s * 1e3:.2f}", ttft_s=f"{out.ttft_s:.2f}")
        outputs.append(out)
        token_times.append(times)
    return {"outputs": outputs, "token_times": token_times}


def prefill_flops(cfg, tokens: int) -> dict:
    """Arithmetic of a ``tokens``-token prefill [FLOP]: ``2 x`` the active weights except the LM head (the head
    runs on the last token only) per token, plus causal MLA attention ``QK^T`` and ``PV`` (``2 x T^2 / 2 x heads x
    (qk_nope + qk_rope + v)`` per MLA layer, the expanded form). KDA's chunked recurrence is not counted (its
    arithmetic is linear in T and small beside the weights)."""
    from bytebound.analysis.ledger import build_ledger
    led = build_ledger(cfg)
    weights = 2.0 * (led.params - led.group_params().get("LM head", 0.0)) * tokens
    n_mla = len(cfg.mla_layers)
    attn = float(tokens) ** 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                           + cfg.v_head_dim) * n_mla
    return {"weights": weights, "attention": attn, "total": weights + attn}


def run_ttft(engine, lens: list[int], seed: int = 0) -> list[dict]:
    """Two prefill-only requests (``max_tokens=1``, distinct prompts) per prompt length: the first may compile
    kernels for new shapes (``first_ttft_s``); the second is the warm TTFT [s] (prefill + LM head + first sample, as
    the engine measures it), with the achieved prefill TFLOP/s from :func:`prefill_flops`."""
    rows = []
    p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for n in lens:
        first, = engine.generate([synthetic_prompt(engine, n, seed + 1000 + n)], p)
        out, = engine.generate([synthetic_prompt(engine, n, seed + 2000 + n)], p)
        fl = prefill_flops(engine.model.cfg, n)
        rows.append({"input_len": n, "ttft_s": out.ttft_s, "first_ttft_s": first.ttft_s, "flops": fl,
                     "tflops": fl["total"] / out.ttft_s / 1e12 if out.ttft_s else None})
    return rows


def profile_prefill(engine, n: int, seed: int = 0, top: int = 15) -> dict:
    """Device time by kernel of one ``n``-token prefill (``torch.profiler``, after a warm-up of the same length):
    ``{"wall_s", "device_s", "kernels", "rows": [{"name", "calls", "device_ms", "share"}]}``, the ``top`` largest."""
    from torch.profiler import ProfilerActivity, profile
    ids = torch.tensor(synthetic_prompt(engine, n, seed + 7), device=engine.device)
    r = engine.runner
    r.reset()
    r.prefill(ids)
    r.reset()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        r.prefill(ids)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    r.reset()
    ev = [e for e in prof.key_averages() if getattr(e, "device_type", None) is not None
          and str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
    tot = sum(e.self_device_time_total for e in ev) or 1.0
    ev.sort(key=lambda e: -e.self_device_time_total)
    rows = [{"name": e.key[:90], "calls": e.count, "device_ms": e.self_device_time_total / 1e3,
             "share": e.self_device_time_total / tot} for e in ev[:top]]
    return {"tokens": n, "wall_s": wall, "device_s": tot / 1e6, "kernels": sum(e.count for e in ev), "rows": rows}


def measure_bandwidth(device, spec: str = "auto") -> tuple[float | None, str]:
    """``spec``: ``auto`` (measure here), ``none`` (skip) or a number in GB/s. Returns (GB/s or None, note)."""
    if spec == "none":
        return None, "bandwidth not measured (--bandwidth none): no byte-floor ratio"
    if spec != "auto":
        return float(spec), f"bandwidth given on the command line ({float(spec):.1f} GB/s)"
    try:
        from bytebound.analysis.bandwidth import measure_read_bandwidth
    except ImportError as e:
        return None, f"bytebound.analysis.bandwidth.measure_read_bandwidth unavailable ({e}): no byte-floor ratio"
    dev = torch.device(device)
    if dev.type == "cuda":
        return measure_read_bandwidth(dev), f"streaming read measured in this run on {dev}"
    gbs = measure_read_bandwidth(dev, nbytes=1 << 28, iters=5, warmup=1)
    return gbs, ("CPU run: the ratio is against this host's DRAM streaming read measured in this run, "
                 "not an accelerator floor")


def byte_floor(engine, bandwidth_gbs: float | None, context: int, accept_length: float | None = None) -> dict:
    """Bytes of one plain decode step (exact ledger of the config's storage recipe, head as configured, plus
    KDA state and the MLA cache at ``context``) and the floor in ms at ``bandwidth_gbs``. With MTP also the
    per-token floor of a round: (verify(k+1) + k draft steps) / accept length."""
    try:
        from bytebound.analysis.ledger import build_ledger
    except ImportError as e:
        return {"note": f"bytebound.analysis.ledger unavailable ({e})"}
    cfg = engine.model.cfg
    head = "fp8" if getattr(engine.model.lm_head, "mode", "bf16") == "fp8" else "bf16"
    led = build_ledger(cfg, head=head)
    extra = led.state_bytes() + led.kv_bytes_per_token() * context
    out = {"ledger_head": head, "weight_bytes": led.bytes, "state_kv_bytes": extra, "step_bytes": led.bytes + extra,
           "context": context, "bandwidth_gbs": bandwidth_gbs,
           "note": "ledger of the config's storage recipe (BF16 dense, FP8 blocks, MXFP4 experts); a model run in float32 reads more than this"}
    if bandwidth_gbs:
        out["floor_ms"] = out["step_bytes"] / (bandwidth_gbs * 1e9) * 1e3
    k = engine.config.speculative_steps
    if k and accept_length:
        rb = led.round_bytes(k + 1, k) + extra
        out["mtp_round_bytes"] = rb
        out["accept_length"] = accept_length
        if bandwidth_gbs:
            out["mtp_floor_ms_per_token"] = rb / accept_length / (bandwidth_gbs * 1e9) * 1e3
    return out


def floor_ratio(floor: dict, tpot_ms: float | None) -> float | None:
    """Measured TPOT / byte floor (the MTP per-token floor when speculating)."""
    f = floor.get("mtp_floor_ms_per_token") or floor.get("floor_ms")
    return tpot_ms / f if f and tpot_ms else None


def draw_token_times(token_times, title: str):
    """Inter-token latency along the decode (rolling mean over 32 tokens) and its histogram."""
    import numpy as np

    def draw(fig):
        a1, a2 = fig.subplots(1, 2)
        for i, t in enumerate(token_times):
            d = np.diff(np.asarray(t)) * 1e3
            if d.size == 0:
                continue
            w = min(32, d.size)
            roll = np.convolve(d, np.ones(w) / w, mode="valid")
            a1.plot(np.arange(roll.size) + w, roll, label=f"request {i + 1}")
            a2.hist(d, bins=40, alpha=0.6)
        a1.set_xlabel("output token"), a1.set_ylabel("ms per token (rolling mean, 32)"), a1.set_title(title)
        a2.set_xlabel("inter-token time [ms]"), a2.set_ylabel("tokens"), a2.set_title("inter-token time")
        a2.set_yscale("log")
    return draw
