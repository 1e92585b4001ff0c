"""The split kernels' benchmark probes (``bytebound.bench.moe_probe``, ``scripts/bench_moe.py --probe``): each runs
a private copy of ``kernels/triton_moe_split.py`` with one piece swapped, and the production module stays as it is.
The probes' timings need the GPU; their sm_90 code is compiled offline in the lead's checks, not here."""

import pytest

from bytebound.errors import BackendError

split = pytest.importorskip("bytebound.kernels.triton_moe_split")
if split.gluon is None:
    pytest.skip(f"Gluon is not importable: {split.GLUON_ERR}", allow_module_level=True)

from bytebound.bench import moe_probe  # noqa: E402


@pytest.mark.parametrize("kind", moe_probe.PROBES)
def test_probe_copy_swaps_one_piece_and_leaves_production_alone(kind):
    names = ("mxfp4_tile", "frag_dequant", "_moe_gateup_split", "_moe_down_split", "_moe_reduce_swiglu")
    prod = tuple(getattr(split, n) for n in names)
    mod = moe_probe.probe_module(kind)
    assert mod is not split and mod is moe_probe.probe_module(kind)          # built once
    assert tuple(getattr(split, n) for n in names) == prod
    swapped = {"gateup_only": ["_moe_down_split"], "down_only": ["_moe_gateup_split"],
               "load_only": ["mxfp4_tile", "frag_dequant"], "compute_only": ["mxfp4_tile"],
               "gateup_no_ticket": ["_moe_down_split", "_moe_reduce_swiglu"]}[kind]
    for name in names:
        ours = getattr(mod, name)
        if name in swapped:
            assert ours is not getattr(split, name) and ours.__module__ != mod.__name__, name
        else:     # the copy's own function: the same source as production's, not production's object
            assert ours.__module__ == mod.__name__ and ours.fn.__code__.co_code == getattr(split, name).fn.__code__.co_code


def test_probe_refuses_unknown_kinds_and_other_variants():
    with pytest.raises(BackendError, match="expected one of"):
        moe_probe.probe_module("everything")
    with pytest.raises(BackendError, match="instruments the 'split' variant"):
        moe_probe.probe_kernel(None, {"variant": "gluon"}, "load_only")
