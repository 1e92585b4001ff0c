"""The environment switches that change what the engine runs, with their defaults, so a run that sets one says so.

Each switch is read where it acts (the kernel module, the engine); this registry only names them for the start-up
manifest (:func:`bytebound.verify.manifest.build_manifest`, key ``switches``), which lists every switch set to a value
other than its default. A switch is an A/B lever for measurement (``scripts/profile_decode.py --ab``,
``scripts/gpu_check.sh``), so a benchmark run under one must not pass for the defaults: the manifest travels in
every ``bytebound bench`` report. ``tests/test_switches.py`` checks that every ``BYTEBOUND_*`` name the package reads
is here (or in :data:`NOT_SWITCHES`) and that each default matches the one its reader falls back to.
"""

from __future__ import annotations

import os

# name -> (the value in effect when unset; None: unset means "use the committed table / nothing forced"), what it does
SWITCHES: dict[str, tuple[str | None, str]] = {
    "BYTEBOUND_PDL": ("1", "0: plain launches instead of programmatic dependent launch (kernels/pdl.py)"),
    "BYTEBOUND_PDL_PREFETCH": ("", "kernels (router, kda) that stream their weights into L2 before their PDL wait"),
    "BYTEBOUND_ROUTER_NORM_FOLD": ("1", "0: the MoE's post-attention add + RMSNorm as a launch of its own"),
    "BYTEBOUND_ROUTER_SPLIT_TAIL": ("1", "0: one router program routes all M rows of a verify"),
    "BYTEBOUND_ROUTER_SEG": ("1", "0: the one-segment routing tail (a cross-warp reduction per pick)"),
    "BYTEBOUND_ROUTER_BATCH_ROWS": ("1", "0: the router loads and normalises a verify's rows one by one"),
    "BYTEBOUND_NORM_FOLD": ("0", "1: the decoder's input add + RMSNorm inside the attention's FP8 projection"),
    "BYTEBOUND_HEAD_ARGMAX": ("draft", "which LM heads fuse the greedy argmax: draft, 1 (all) or 0 (none)"),
    "BYTEBOUND_KDA_INPLACE": ("1", "0: fla-core's KDA decode returns a new state instead of updating in place"),
    "BYTEBOUND_MOE_DQ": ("1", "0: the MoE kernels decode E2M1 through the PRMT tables whatever the config says"),
    "BYTEBOUND_MOE_CONFIG": (None, "a JSON MoE launch table instead of the committed one"),
    "BYTEBOUND_MOE_VARIANT": (None, "forces an MoE kernel variant (split, persist, ...) over the table's"),
    "BYTEBOUND_GEMV_CONFIG": (None, "a JSON FP8 GEMV launch table instead of the committed one"),
    "BYTEBOUND_KDA_CONFIG": (None, "a JSON fused-KDA launch table (V_SPLIT, num_warps) instead of the committed one"),
    "BYTEBOUND_MLA_CFG": (None, "a JSON object of MLA decode tiling keys over the committed tiling"),
    "BYTEBOUND_ADAPTIVE_WARMUP": ("1", "0: adaptive speculation's NEXTN catch-up is not compiled at start-up"),
    "BYTEBOUND_SKIP_MEMORY_CHECK": (None, "1: load a checkpoint without the free-memory check"),
}

# BYTEBOUND_* names the package reads that are not switches: they label a run, they change nothing it runs
NOT_SWITCHES = frozenset({"BYTEBOUND_COMMIT", "BYTEBOUND_GIT_COMMIT"})


def overrides(environ=None) -> dict[str, dict]:
    """The switches set to something other than their default in ``environ`` (default ``os.environ``):
    ``{name: {"value": str, "default": str | None, "what": str}}``, in name order; empty when the run uses the
    defaults. Raises nothing: an unknown ``BYTEBOUND_*`` variable is not a switch and is not listed."""
    env = os.environ if environ is None else environ
    out = {}
    for name in sorted(SWITCHES):
        default, what = SWITCHES[name]
        value = env.get(name)
        if value is not None and value != (default or ""):
            out[name] = {"value": value, "default": default, "what": what}
    return out
