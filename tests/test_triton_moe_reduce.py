"""The ``partials`` mode's reduce kernel (``kernels.triton_moe_variants._moe_reduce_partials``) against a float64 sum over
the slots that own their expert. On a CPU machine it runs in Triton's interpreter (TRITON_INTERPRET=1) when Triton
is installed; CI has no Triton and skips with that reason. The fused kernel that writes the partials needs a GPU
(tests/gpu/test_kernels_gpu.py, ``partials`` cases)."""

from __future__ import annotations

import pytest
import torch

from conftest import needs_triton, triton_module_fixture

pytestmark = needs_triton
moe = triton_module_fixture("moe", "bytebound.kernels.triton_moe_variants")


@pytest.mark.parametrize("m,k,nj,h,bhr", [(1, 8, 3, 64, 32), (4, 8, 2, 64, 4), (3, 2, 4, 96, 16), (4, 8, 3, 64, 8)])
def test_reduce_partials_sums_owner_slots(moe, m, k, nj, h, bhr):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(m * 100 + k)
    s = m * k
    mv = 1 if m == 1 else 4
    ids = torch.randint(0, 6, (m, k), generator=g, dtype=torch.int32)      # few experts: many duplicates
    part = torch.randn(nj, s, h, mv, generator=g)
    flat = ids.flatten().tolist()
    owner = [i for i, e in enumerate(flat) if e not in flat[:i]]
    assert len(owner) < s, "the case must contain duplicate slots"
    poisoned = part.clone()
    dups = [i for i in range(s) if i not in owner]
    poisoned[:, dups] = float("nan")            # the fused kernel never writes duplicate slots
    out = torch.empty(m, h, dtype=torch.bfloat16, device=dev)
    moe._moe_reduce_partials[(h // bhr,)](poisoned.to(dev).contiguous(), ids.to(dev).contiguous(), out, H=h, S=s,
                                          SP=max(32, 1 << (s - 1).bit_length()), NJ=nj, M=m, MV=mv, BHR=bhr)
    ref = part.double()[:, owner, :, :m].sum(dim=(0, 1)).T                # [m, h]
    assert torch.isfinite(out.float()).all(), "a duplicate slot was read"
    torch.testing.assert_close(out.double().cpu(), ref.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)
