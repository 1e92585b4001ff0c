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
