"""Kernels per call of a function, from torch.profiler: the "kernels per step" every decode benchmark reports.

:func:`kernel_table` runs ``fn`` once untimed, then ``reps`` times under the profiler (CUDA activity; on CPU the
CPU ops instead), and returns one row per kernel name with its calls, microseconds per call of ``fn`` and per
kernel launch, plus the totals. A CUDA kernel counts when the profiler saw device time for it, so a graph replay
is counted by the kernels inside it. Shared by ``scripts/profile_decode.py``, ``scripts/bench_decode.py``
(``kernels_per_step``) and the GPU kernel-count test, so they all count the same way.
"""

from __future__ import annotations

import torch


def kernel_table(fn, reps: int, cuda: bool = True, name_width: int = 90) -> tuple[list[dict], dict]:
    """Profile ``reps`` calls of ``fn`` (after one untimed call).

    Returns ``(rows, totals)``: rows ``{"name", "calls", "us", "us_per_call"}`` with ``calls`` and ``us``
    (microseconds of device time; CPU time with ``cuda=False``) per call of ``fn``, sorted by ``us``; totals
    ``{"kernels", "kernel_us"}`` per call of ``fn``. Names are cut to ``name_width`` characters.
    """
    from torch.profiler import ProfilerActivity, profile
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = e.self_device_time_total if cuda else e.self_cpu_time_total
        if t <= 0 or (cuda and not str(getattr(e, "device_type", "")).endswith("CUDA")):
            continue
        rows.append({"name": e.key[:name_width], "calls": e.count / reps, "us": t / reps,
                     "us_per_call": t / max(e.count, 1)})
    rows.sort(key=lambda r: -r["us"])
    return rows, {"kernels": sum(r["calls"] for r in rows), "kernel_us": sum(r["us"] for r in rows)}
