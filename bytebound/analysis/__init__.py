"""``bytebound analyze``: byte ledger, roofline and speculative cost model (issue 8).

* :mod:`.ledger` — exact bytes per decode step from a config + quantisation recipe (or a checkpoint).
* :mod:`.seed` — the seed article's formulas (sections 4, 5, 7, 8, 10, 11, 13), reproducing its numbers.
* :mod:`.bandwidth` — :func:`measure_read_bandwidth`, a timed streaming read (GB/s).
* :mod:`.plots` — ledger bars, roofline, KV vs context, speculative speed-up (PNG, Agg backend).
* :mod:`.cli` — the ``analyze`` subcommand (``add_parser``, ``run``).
"""

from bytebound.analysis.ledger import Ledger, Recipe, build_ledger, expected_distinct_experts, tensor_bytes

__all__ = ["Ledger", "Recipe", "build_ledger", "expected_distinct_experts", "tensor_bytes"]
