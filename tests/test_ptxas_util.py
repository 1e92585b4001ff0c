"""scripts/ptxas_util: how far a 16-byte load is hoisted above its first use (read from nvdisasm text), programs per SM
and the register cap rule, checked against the committed kernel A cap (offline compile, no GPU)."""

from __future__ import annotations

import pytest
from conftest import load_script

SASS = """
        /*0000*/                   LDG.E.128 R4, [R2.64] ;
        /*0010*/                   LDG.E.128 R8, [R2.64+0x10] ;
        /*0020*/                   IADD3 R20, R21, 0x1, RZ ;
        /*0030*/              @!P0 LDG.E.128 R12, [R2.64+0x20] ;
        /*0040*/                   LDG.E.128.STRONG.GPU R16, [R2.64+0x30] ;
        /*0050*/                   HMMA.16816.F32.BF16 R24, R7, R30, R24 ;
        /*0060*/                   LOP3.LUT R9, R20, 0xff, RZ, 0xc0, !PT ;
        /*0070*/                   SHF.L.U32 R22, R10, 0x6, RZ ;
        /*0080*/                   STG.E [R2.64], R16 ;
        /*0090*/                   EXIT ;
"""


def test_load_use_counts_distance_and_loads_in_between():
    pu = load_script("ptxas_util")
    # R4..R7: first read by the HMMA (its A operand R7) 5 instructions later, 3 loads issued in between
    # (the predicated one counts; only unpredicated loads are measured). R8..R11: R9 is *written* by the LOP3
    # (not a use), R10 read by the SHF 6 later, with 2 loads in between. R16..R19: read by the store, 4 later.
    # The predicated load R12 is not measured.
    assert pu.load_use(SASS) == [(5, 3), (6, 2), (4, 0)]


def test_resource_fields_reads_every_field_of_the_line():
    pu = load_script("ptxas_util")
    line = "REG:72 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:648 TEXTURE:0 SURFACE:0 SAMPLER:0"
    assert pu.resource_fields(line) == {"REG": 72, "STACK": 0, "SHARED": 1024, "LOCAL": 0, "CONSTANT[0]": 648,
                                        "TEXTURE": 0, "SURFACE": 0, "SAMPLER": 0}


def test_load_use_ignores_a_load_never_read():
    pu = load_script("ptxas_util")
    assert pu.load_use("/*0000*/ LDG.E.128 R4, [R2.64] ;\n/*0010*/ EXIT ;") == []


def test_programs_per_sm_and_the_cap_rule_match_the_measured_kernel_a():
    from bytebound.kernels.triton_moe_persist import programs_per_sm as occupancy
    pu = load_script("ptxas_util")

    def programs_per_sm(regs, warps):         # the occupancy rules cap_rule uses, no shared memory
        return occupancy(regs, 0, warps)

    # kernel A at M = 4 (docs/perf/session27-h100-nr/, ncu): 72 registers, 8 warps -> 3 programs per SM; the cap
    # that keeps 3 is 80 (80 x 256 x 3 = 61,440 <= 65,536; 88 would leave room for 2 only)
    assert programs_per_sm(72, 8) == 3
    assert pu.cap_rule(72, 8) == 80
    assert programs_per_sm(80, 8) == 3 and programs_per_sm(88, 8) == 2
    # M = 1: 61 registers (allocated as 64), 4 programs; the rule's cap is 64, not more
    assert programs_per_sm(61, 8) == 4 and pu.cap_rule(61, 8) == 64
    # the GEMV's o_proj config (110 registers, 8 warps: 2 programs) -> 128, as section 4 of that report predicted
    assert pu.cap_rule(110, 8) == 128
    # the warp limit (64 warps per SM), the block limit (32) and the 255 ceiling
    assert programs_per_sm(16, 1) == 32 and programs_per_sm(32, 4) == 16
    assert pu.cap_rule(200, 4) == 255 and pu.cap_rule(24, 1) == 64
    # small blocks: registers come from each of the 4 sub-partitions' quarter of the file, so 2-warp programs at
    # 33 registers (1,280 per warp: 12 warps a quarter) fit 24 per SM, not the 25 of 65,536 / (1,280 x 2); and at
    # 81-88 registers (10 per SM) the cap can go to 96 and still keep 10
    assert programs_per_sm(33, 2) == 24
    assert programs_per_sm(88, 2) == programs_per_sm(96, 2) == 10 and pu.cap_rule(81, 2) == 96
    with pytest.raises(ValueError, match="fits"):
        pu.cap_rule(200, 32)


@pytest.mark.slow
def test_the_committed_kernel_a_cap_is_the_cap_rule():
    """``scripts/split_ptxas.py --cap-rule`` on the committed M = 4 entry (kernels/configs/triton_moe.json) without its
    ``NR``: ptxas' own count leaves 3 programs per SM, and the cap rule gives the committed NR 80, which keeps 3 and
    holds more 16-byte loads in flight per warp (offline sm_90 compile in a fresh interpreter, no GPU)."""
    import json
    import re
    from conftest import ROOT, run_offline_script
    pytest.importorskip("triton")
    from bytebound.kernels import triton_moe_split as ts
    if ts.gl is None:
        pytest.skip("needs Gluon (triton >= 3.5)")
    entry = json.loads((ROOT / "bytebound/kernels/configs/triton_moe.json").read_text())["NVIDIA H200"][
        "E512_H2560_I768_k8_M4"]
    out = run_offline_script("split_ptxas", "--m", "4", "--cap-rule", "--config", json.dumps(entry))
    free = re.search(r"A without NR: (\d+) registers, stack \d+ B, (\d+) programs per SM, ([\d.]+) loads", out)
    capped = re.search(r"A with NR (\d+) \(cap rule\): (\d+) registers, stack (\d+) B, (\d+) programs per SM, "
                       r"([\d.]+) loads", out)
    assert free and capped, out
    assert int(capped.group(1)) == entry["NR"] == 80, out
    assert int(free.group(2)) == int(capped.group(4)) == 3, out
    assert int(capped.group(3)) == 0 and float(capped.group(5)) > float(free.group(3)), out
