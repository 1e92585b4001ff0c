"""Measured memory bandwidth: the denominator of every floor in this package.

``measure_read_bandwidth(device)`` times a streaming read of a buffer much larger than the caches and
returns GB/s (1e9 B/s). On CUDA it is timed with CUDA events; on CPU with the wall clock. Two kernels:

* ``mode="read"``: ``buf.sum()`` over a float32 buffer; bytes moved = ``nbytes`` (the reduction's output is
  one scalar). This is what a batch-1 decode step does to its weights.
* ``mode="copy"``: ``dst.copy_(src)``; bytes moved = 2 x ``nbytes`` (read + write), the usual "copy
  bandwidth" figure of STREAM-like benchmarks.

Floor of a step (seed section 5): ``t_min [ms] = B_step [B] / (GB/s x 1e9) x 1e3``.

Seen on one H200 (torch 2.11, best of 20): read 4038 GB/s at 1 GiB and 4267 GB/s at 4 GiB; copy 4188 and
4238 GB/s. Small buffers under-read (3296 GB/s at 256 MiB): launch and tail cost are not amortised.
"""

from __future__ import annotations

import time

import torch

from bytebound.errors import BackendError


def cuda_event_times(fn, reps: int, warmup: int = 3) -> list[float]:
    """Device time of each of ``reps`` calls of ``fn`` in seconds, CUDA events around each call, after
    ``warmup`` untimed calls (shared by every benchmark so they all time the same way)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3)
    return out


def measure_read_bandwidth(device: str | torch.device = "cuda", nbytes: int = 1 << 30, iters: int = 20,
                           warmup: int = 3, mode: str = "read") -> float:
    """Best-of-``iters`` streaming bandwidth on ``device`` [GB/s, 1e9 B/s].

    Args:
        device: ``"cuda"``, ``"cuda:1"``, ``"cpu"``...
        nbytes: buffer size in bytes (default 1 GiB; use >= 4x the last-level cache).
        iters: timed repetitions; the fastest is reported (least disturbed by other work).
        warmup: untimed repetitions first.
        mode: ``"read"`` (sum, nbytes moved) or ``"copy"`` (copy, 2 x nbytes moved).

    Raises:
        BackendError: CUDA requested but not available, or an unknown ``mode``.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendError(f"measure_read_bandwidth: device {dev} requested but CUDA is not available")
    if mode not in ("read", "copy"):
        raise BackendError(f"measure_read_bandwidth: mode={mode!r}, expected 'read' or 'copy'")
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src) if mode == "copy" else None
    moved = 4 * n * (2 if mode == "copy" else 1)

    def once():
        if dst is not None:
            dst.copy_(src)
        else:
            src.sum()

    best = float("inf")
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            best = min(cuda_event_times(once, iters, warmup))
    else:
        for _ in range(warmup):
            once()
        for _ in range(iters):
            t = time.perf_counter()
            once()
            best = min(best, time.perf_counter() - t)
    return moved / best / 1e9
