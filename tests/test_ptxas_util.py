"""scripts/ptxas_util.load_use: how far a 16-byte load is hoisted above its first use, read from nvdisasm text."""

from __future__ import annotations

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


def test_load_use_ignores_a_load_never_read():
    pu = load_script("ptxas_util")
    assert pu.load_use("/*0000*/ LDG.E.128 R4, [R2.64] ;\n/*0010*/ EXIT ;") == []
