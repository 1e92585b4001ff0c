"""Benchmarks: synthetic fixed-length decode, GSM8K 5-shot accuracy + latency, and the one-lever ablation ladder.

``bytebound bench {synthetic,gsm8k,ablation}`` (see :mod:`bytebound.bench.cli`); every run writes
``NAME.json``, ``NAME.md`` and ``NAME*.png`` with the start-up manifest, device, date and git commit embedded
(:mod:`bytebound.bench.report`).
"""
