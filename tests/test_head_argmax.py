"""The greedy token inside the FP8 LM-head kernel (``kernels.triton_fp8.fp8_head_argmax``) against the argmax of the
head's own logits (``fp8_head_logits``, the same float32 values) and of a float64 reference of the FP8 product;
torch's tie rule (the lowest id); the ticket that re-arms itself; and the module-level plumbing
(``layers.lm_head.head_argmax``: the fused path where the bound backend offers it, the logits' argmax otherwise,
and the forward's argmax where hooks change the logits, as tensor parallelism's all-gather does). On a CPU machine
the kernels run in Triton's interpreter; on a GPU they compile for real."""

from __future__ import annotations

import pytest
import torch

from bytebound.layers.lm_head import LMHead, head_argmax
from bytebound.quant import quantize_fp8_channel
from conftest import compiled_in_subprocess, needs_triton, triton_module_fixture

fp8 = triton_module_fixture("fp8", "bytebound.kernels.triton_fp8")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _head(v: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, k, generator=g) * 0.05
    q, s = quantize_fp8_channel(w)
    return q.to(DEV), s.to(DEV)


def _ref_argmax(fp8, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor):
    """float64 FP8 head: per-token E4M3 activations times the E4M3 weight, both scales applied. The activations are
    the kernel's own quantisation (``_fp8_quant_rows``; Triton's interpreter rounds float32 -> E4M3 differently from
    torch, and on the H200 a few codes and the scale's last bit differed from ``quantize_fp8_token``: not what this
    test is about). Returns ``(argmax [M], logits [M, V], scale of the terms [M, V] = sum_k |xq w| * sx * s)``."""
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    sx = torch.empty(m, dtype=torch.float32, device=x.device)
    fp8._fp8_quant_rows[(m,)](x, xq, sx, K=k, BK=1024)
    a, w = xq.cpu().double(), q.cpu().double()
    sc = sx.cpu().double()[:, None] * s.cpu().double()[None, :]
    lg = (a @ w.t()) * sc
    return lg.argmax(-1), lg, (a.abs() @ w.abs().t()) * sc


@needs_triton
@pytest.mark.parametrize("v,k", [(1000, 256), (1024, 384)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_fused_argmax_equals_argmax_of_the_head_logits(fp8, v, k, m):
    """Ragged (1000) and even (1024) vocabularies, M = 1..4, three calls in a row (the ticket re-arms): the fused
    ids equal torch's argmax of ``fp8_head_logits`` exactly, and the row they pick is within the tensor cores'
    accumulation error (2^-10 of the summed term magnitudes, Hopper's FP8 MMA keeps ~14 bits) of the float64
    reference's best logit."""
    q, s = _head(v, k, v + k + m)
    g = torch.Generator().manual_seed(m)
    for trial in range(3):
        x = (torch.randn(m, k, generator=g)).to(torch.bfloat16).to(DEV)
        ids = fp8.fp8_head_argmax(x, q, s)
        logits = fp8.fp8_head_logits(x, q, s)
        assert ids.dtype == torch.int64 and ids.shape == (m,)
        assert torch.equal(ids.cpu(), logits.argmax(-1).cpu())
        want, lg, mag = _ref_argmax(fp8, x, q, s)
        got = ids.cpu()
        rows = torch.arange(m)
        tol = 2.0 ** -10 * mag.max(-1).values
        assert bool((lg[rows, got] >= lg.max(-1).values - tol).all())


@needs_triton
def test_fused_argmax_tie_rule_is_the_lowest_id(fp8):
    """Rows with identical weights give identical logits: the lowest id wins, as torch's argmax picks, also across
    program boundaries (rows 5, 300 and 999 equal, 128 rows per program), and a tie inside one program."""
    v, k = 1000, 256
    q, s = _head(v, k, 3)
    for r in (300, 999):
        q[r], s[r] = q[5], s[5]
    q[6], s[6] = q[5], s[5]
    # make row 5's logit the largest for every token: x along row 5's direction
    x = (q[5].float().cpu() * s[5].cpu()).repeat(3, 1)
    x[1] *= 2.0
    x = x.to(torch.bfloat16).to(DEV)
    ids = fp8.fp8_head_argmax(x, q, s)
    assert ids.cpu().tolist() == [5, 5, 5]
    assert torch.equal(ids.cpu(), fp8.fp8_head_logits(x, q, s).argmax(-1).cpu())


@needs_triton
def test_fused_argmax_refuses_bad_shapes(fp8):
    from bytebound.errors import BackendError
    q, s = _head(256, 128, 1)
    with pytest.raises(BackendError):
        fp8.fp8_head_argmax(torch.zeros(5, 128, dtype=torch.bfloat16, device=DEV), q, s)
    with pytest.raises(BackendError):
        fp8.fp8_head_argmax(torch.zeros(1, 64, dtype=torch.bfloat16, device=DEV), q, s)


def test_head_argmax_uses_the_backend_argmax_and_falls_back():
    """``head_argmax``: the bound ``fn.argmax`` answers where it takes the call, the logits' argmax where it returns
    None or does not exist; a module with a forward hook (tensor parallelism's all-gather) takes its forward."""
    head = LMHead(50, 8, torch.float32)
    torch.nn.init.normal_(head.weight)
    x = torch.randn(2, 3, 8)
    want = head(x).argmax(-1)
    assert torch.equal(head.argmax(x), want)                      # no backend: the torch reference
    calls = []

    def fn(x2):
        return torch.nn.functional.linear(x2, head.weight)
    fn.argmax = lambda x2: calls.append(x2.shape) or torch.full((x2.shape[0],), 7, dtype=torch.long)
    head.fn = fn
    got = head_argmax(head, x)
    assert calls == [(6, 8)] and got.shape == (2, 3) and bool((got == 7).all())
    fn.argmax = lambda x2: None                                    # declines: the logits' argmax
    assert torch.equal(head.argmax(x), want)
    fn.argmax = lambda x2: torch.zeros(x2.shape[0], dtype=torch.long)
    h = head.register_forward_hook(lambda _m, _i, out: -out)       # a hook that changes the logits
    negated = (-fn(x.reshape(-1, 8))).argmax(-1).view(2, 3)
    assert not torch.equal(negated, torch.zeros_like(negated))
    assert torch.equal(head.argmax(x), negated)                    # the hooked forward, not fn.argmax
    h.remove()
    assert bool((head.argmax(x) == 0).all())


@needs_triton
@pytest.mark.parametrize("m", [1, 4])
def test_fused_argmax_maps_rows_to_vocabulary_ids(fp8, m):
    """``index_map``: a row subset of the head (the hot-vocabulary draft head) returns ``index_map[argmax]``, the
    same as gathering after the plain fused argmax; a map of the wrong dtype or length is refused."""
    from bytebound.errors import BackendError
    q, s = _head(640, 256, 11 + m)
    vocab_ids = (torch.randperm(100000, generator=torch.Generator().manual_seed(m))[:640]).sort().values.to(DEV)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).to(DEV)
    rows = fp8.fp8_head_argmax(x, q, s)
    got = fp8.fp8_head_argmax(x, q, s, index_map=vocab_ids)
    assert torch.equal(got.cpu(), vocab_ids.cpu()[rows.cpu()])
    with pytest.raises(BackendError, match="index map"):
        fp8.fp8_head_argmax(x, q, s, index_map=vocab_ids.int())
    with pytest.raises(BackendError, match="index map"):
        fp8.fp8_head_argmax(x, q, s, index_map=vocab_ids[:10])


def test_head_argmax_index_map_on_the_fallback():
    """Without a fused path, ``head_argmax(head, x, index_map)`` gathers the map at the logits' argmax."""
    head = LMHead(40, 8, torch.float32)
    torch.nn.init.normal_(head.weight)
    x = torch.randn(3, 8)
    vmap = torch.arange(40) * 7 + 1
    assert torch.equal(head_argmax(head, x, vmap), vmap[head(x).argmax(-1)])


@pytest.mark.parametrize("has_map", [False, True])
def test_fused_argmax_kernel_compiles_for_sm90(has_map):
    """``_fp8_head_argmax`` at the full head's shape (V 157184, K 2560, M = 4, ragged last rows off) compiles for
    sm_90 with its fence and ticket, and the PTX has the acq_rel ticket and the fence. Runs in a subprocess without
    the interpreter (the CPU session's Triton may be in interpreter mode); no GPU needed."""
    pytest.importorskip("triton")
    if compiled_in_subprocess(__file__, f"test_fused_argmax_kernel_compiles_for_sm90[{has_map}]"):
        return
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bytebound.kernels import triton_fp8 as tf
    fn = tf._fp8_head_argmax
    const = dict(K=2560, M=4, MP=4, BN=128, BK=128, EVEN_N=False, FENCE=True, RB=512, HAS_MAP=has_map)
    types = dict(q_ptr="*fp8e4nv", sx_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", part_ptr="*i64",
                 cnt_ptr="*i32", ids_ptr="*i64", map_ptr="*i64", N="i32", P="i32")
    sig = {n: ("constexpr" if n in const else types[n]) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=4))
    ptx = k.asm["ptx"]
    assert k.asm.get("cubin") and "fence.acq_rel.gpu" in ptx and ".acq_rel.add" in ptx


@pytest.mark.parametrize("value,full,subset", [(None, False, True), ("draft", False, True), ("1", True, True),
                                               ("0", False, False)])
def test_head_argmax_switch(value, full, subset, monkeypatch):
    """``BYTEBOUND_HEAD_ARGMAX``: the default (``draft``) fuses only the draft head's row subset; 1 every FP8 head
    call; 0 none."""
    from bytebound.kernels.triton_fp8 import argmax_fused_enabled
    if value is None:
        monkeypatch.delenv("BYTEBOUND_HEAD_ARGMAX", raising=False)
    else:
        monkeypatch.setenv("BYTEBOUND_HEAD_ARGMAX", value)
    assert argmax_fused_enabled(False) is full and argmax_fused_enabled(True) is subset
