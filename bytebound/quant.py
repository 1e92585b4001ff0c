"""Reference quantise/dequantise for the Ling fp4 checkpoint formats (pure torch, CPU or GPU).

Formats (``docs/references.md`` §4; OCP Microscaling spec v1.0 for MX):

* **FP8 block** (dense linears): ``weight`` E4M3 ``[N, K]`` and ``weight_scale_inv`` float32
  ``[ceil(N/128), ceil(K/128)]``; ``W ~= weight * scale_inv`` per 128x128 block. With ``scale_fmt ue8m0``
  every scale is a power of two (DeepSeek-V3 / Ling recipe).
* **MXFP4** (routed experts): E2M1 values packed two per byte (low nibble = even column, high nibble = odd
  column; stored as int8/uint8 ``[N, K/2]``), with an E8M0 scale per 32 consecutive inputs stored as uint8
  ``[N, K/32]`` meaning ``2**(byte - 127)`` (byte 255 = NaN per the spec, rejected here).
* **FP8 per output channel** (online LM head): E4M3 ``[N, K]`` and float32 scale ``[N]`` (SGLang
  ``Fp8LinearMethod`` channelwise, reference section 3.1).
"""

from __future__ import annotations

import math

import torch

from bytebound.errors import QuantFormatError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3FN value
E2M1_MAX = 6.0
# The 16 E2M1 code points: bit 3 is the sign, bits 0-2 index [0, .5, 1, 1.5, 2, 3, 4, 6].
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_BLOCK = 32


_LUT_CACHE: dict = {}


def e2m1_lut(device=None, dtype=torch.float32) -> torch.Tensor:
    """The 16-entry E2M1 decode table ``[16]`` (index = 4-bit code), cached per device/dtype so the hot path
    makes no host-to-device copy (which CUDA-graph capture forbids)."""
    key = (str(torch.device(device or "cpu")), dtype)
    if key not in _LUT_CACHE:
        _LUT_CACHE[key] = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return _LUT_CACHE[key]


# ---------------------------------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------------------------------
def _e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values already scaled into [-6, 6] to the nearest E2M1 code (ties to even mantissa).

    Returns uint8 codes 0..15, same shape.
    """
    a = x.abs().clamp(max=E2M1_MAX)
    # Midpoints between the magnitudes [0,.5,1,1.5,2,3,4,6]; ties go to the even code (OCP round-half-even).
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=x.device)
    mid = (mags[1:] + mags[:-1]) / 2  # [7]
    idx = torch.bucketize(a, mid, right=False)  # a <= mid -> lower code
    # bucketize(right=False) puts a tie in the lower bucket; move odd lower codes up to make ties even.
    tie = (idx < 7) & (a == mid[idx.clamp(max=6)]) & (idx % 2 == 1)
    idx = idx + tie.to(idx.dtype)
    sign = ((x < 0) & (idx > 0)).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def quantize_mxfp4(w: torch.Tensor, scale_rule: str = "ocp") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` ``[N, K]`` (any float dtype, K % 32 == 0) to MXFP4.

    Scale per 32-block, ``scale_rule="ocp"``: E8M0 ``2**(floor(log2(amax)) - 2)`` (OCP MX v1.0 section 6.3: the
    shared exponent is the block's largest exponent minus E2M1's emax = 2), so the largest element lands in
    [4, 8) and saturates to 6 at most. ``scale_rule="mse"``: per block, that exponent or the next one up
    (largest element in [2, 4): no saturation, half the resolution), whichever gives the smaller squared error.
    Either way the bytes are plain MXFP4; only the choice of the shared exponent differs.

    Returns:
        packed ``uint8 [N, K/2]`` (low nibble = even column) and scales ``uint8 [N, K/32]`` (E8M0 bytes).
    Raises:
        QuantFormatError: K not a multiple of 32, or non-finite input.
    """
    if w.dim() != 2 or w.shape[1] % MX_BLOCK:
        raise QuantFormatError(f"MXFP4 needs a 2-D weight with K % 32 == 0, got {tuple(w.shape)}")
    wf = w.float()
    if not torch.isfinite(wf).all():
        raise QuantFormatError("MXFP4 quantisation of a non-finite tensor")
    n, k = wf.shape
    blocks = wf.view(n, k // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(-1)
    # floor(log2(amax)) exactly, from the float's own exponent: a float32 log2 rounds values just below a power
    # of two up to it (e.g. log2(2^20 - 1ulp) == 20.0), which would pick the next shared exponent.
    _, e2 = torch.frexp(amax)                                # amax = m * 2^e2, m in [0.5, 1)
    exp = torch.where(amax > 0, (e2 - 1 - 2).to(torch.float32), torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    if scale_rule == "mse":
        up = (exp + 1).clamp(max=127)
        lut = e2m1_lut(blocks.device)
        err = [((lut[_e2m1_encode(blocks / torch.exp2(e)[..., None]).long()] * torch.exp2(e)[..., None]
                 - blocks) ** 2).sum(-1) for e in (exp, up)]
        exp = torch.where(err[1] < err[0], up, exp)
    elif scale_rule != "ocp":
        raise QuantFormatError(f"MXFP4 scale_rule must be 'ocp' or 'mse', got {scale_rule!r}")
    scale = torch.exp2(exp)
    codes = _e2m1_encode(blocks / scale[..., None]).view(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float32, check: bool = True
                     ) -> torch.Tensor:
    """Decode MXFP4 ``packed [.., N, K/2]`` (uint8 or int8) with E8M0 ``scales [.., N, K/32]`` to ``[.., N, K]``.

    ``check=False`` skips the value check (a host sync), for hot paths and CUDA-graph capture.

    Raises:
        QuantFormatError: shapes disagree, wrong dtypes, or a scale byte 255 (E8M0 NaN).
    """
    if packed.dtype not in (torch.uint8, torch.int8):
        raise QuantFormatError(f"MXFP4 weight must be uint8/int8, got {packed.dtype}")
    if scales.dtype == torch.float8_e8m0fnu:
        scales = scales.view(torch.uint8)
    if scales.dtype != torch.uint8:
        raise QuantFormatError(f"MXFP4 scale must be uint8 (E8M0 bytes), got {scales.dtype}")
    k = packed.shape[-1] * 2
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * MX_BLOCK != k:
        raise QuantFormatError(
            f"MXFP4 scale shape {tuple(scales.shape)} does not match weight {tuple(packed.shape)} (one per 32 inputs)")
    p = packed.view(torch.uint8)
    lut = e2m1_lut(packed.device, torch.float32)
    lo = lut[(p & 0xF).long()]
    hi = lut[(p >> 4).long()]
    vals = torch.stack((lo, hi), dim=-1).flatten(-2)  # [.., N, K], even column from the low nibble
    s = scales.to(torch.float32)
    if check and (scales == 255).any():
        raise QuantFormatError("MXFP4 scale byte 255 (E8M0 NaN)")
    sc = torch.exp2(s - 127.0)
    out = vals.view(*vals.shape[:-1], k // MX_BLOCK, MX_BLOCK) * sc[..., None]
    return out.view(vals.shape).to(dtype)


# ---------------------------------------------------------------------------------------------------
# FP8 E4M3, 128x128 blocks
# ---------------------------------------------------------------------------------------------------
def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128), pow2: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w [N, K]`` to E4M3 with one float32 ``scale_inv`` per ``block`` tile.

    ``scale_inv = amax / 448`` rounded **up** to a power of two when ``pow2`` (``scale_fmt: ue8m0``), so
    ``w / scale_inv`` never exceeds 448. Edge tiles are partial (shape ``ceil(N/bn) x ceil(K/bk)``).

    Returns:
        ``(weight float8_e4m3fn [N, K], weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)])``.
    """
    if w.dim() != 2:
        raise QuantFormatError(f"FP8 block quantisation needs a 2-D weight, got {tuple(w.shape)}")
    wf = w.float()
    if not torch.isfinite(wf).all():
        raise QuantFormatError("FP8 quantisation of a non-finite tensor")
    n, k = wf.shape
    bn, bk = block
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    pad = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    pad[:n, :k] = wf
    tiles = pad.view(nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    s = (amax / FP8_MAX).clamp(min=2.0 ** -126)
    if pow2:
        e = torch.ceil(torch.log2(s))
        # amax / 448 and log2 both round in float32; settle e exactly: the smallest e with amax <= 448 * 2^e.
        e = e + (amax > FP8_MAX * torch.exp2(e)).float()
        e = e - ((amax <= FP8_MAX * torch.exp2(e - 1)) & (e > -126)).float()
        s = torch.exp2(e.clamp(min=-126))
    q = (tiles / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:n, :k]
    return q.to(FP8).contiguous(), s.float().contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                         dtype=torch.float32) -> torch.Tensor:
    """``W = q * scale_inv`` broadcast over ``block`` tiles; ``q [N, K]`` E4M3, ``scale_inv [ceil(N/bn), ceil(K/bk)]``.

    Raises:
        QuantFormatError: wrong dtypes or a scale grid that does not cover ``q``.
    """
    if q.dtype != FP8:
        raise QuantFormatError(f"FP8 weight must be float8_e4m3fn, got {q.dtype}")
    if scale_inv.dtype != torch.float32:
        raise QuantFormatError(f"weight_scale_inv must be float32, got {scale_inv.dtype}")
    n, k = q.shape
    bn, bk = block
    want = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale_inv.shape) != want:
        raise QuantFormatError(f"weight_scale_inv shape {tuple(scale_inv.shape)} != {want} for weight {(n, k)} "
                               f"with block {block}")
    s = scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (q.float() * s).to(dtype)


# ---------------------------------------------------------------------------------------------------
# FP8 E4M3 per output channel (online LM head)
# ---------------------------------------------------------------------------------------------------
def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel E4M3: ``scale[n] = amax(|w[n, :]|) / 448``.

    Returns ``(q float8_e4m3fn [N, K], scale float32 [N])`` with ``w ~= q * scale[:, None]``.
    """
    wf = w.float()
    s = (wf.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    q = (wf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), s.contiguous()


def quantize_fp8_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token (per-row) E4M3 for activations ``x [M, K]``: returns ``(q [M, K], scale [M])``."""
    xf = x.float()
    s = (xf.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    return (xf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fp8_channel_matmul_ref(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Reference FP8 x FP8 product with per-token activation and per-channel weight scales.

    ``x [M, K]`` -> logits float32 ``[M, N]`` = ``(xq * sx) @ (q * sw).T`` computed in float32.
    """
    xq, sx = quantize_fp8_token(x)
    return (xq.float() @ q.float().t()) * sx[:, None] * w_scale[None, :]


def round_up_pow2(s: torch.Tensor) -> torch.Tensor:
    """Positive normal float32 ``s`` rounded up to the next power of two (exact: on the float's bits, no log2).

    Adding ``2**23 - 1`` to the bits carries into the exponent unless the mantissa is zero; masking the mantissa
    off then leaves ``2**ceil(log2(s))`` (the ``ue8m0`` scale rule of the DeepSeek-V3 recipe)."""
    bits = s.float().contiguous().view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def quantize_fp8_group(x: torch.Tensor, group: int = 128, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic E4M3 per token and per ``group`` consecutive columns (the 1x128 activation scales of DeepSeek-V3,
    arXiv 2412.19437 sec. 3.3.2), the torch reference of ``kernels.triton_fp8.quantize_fp8_groups``.

    ``s[m, g] = max(amax(|x[m, g*group:(g+1)*group]|) / 448, 1e-12)`` (rounded up to a power of two when
    ``pow2``), ``q = e4m3(clamp(x / s, -448, 448))`` rounded to nearest even. The last group may be partial.

    Args:
        x: ``[M, K]`` any float dtype.
    Returns:
        ``(q float8_e4m3fn [M, K], s float32 [M, ceil(K / group)])`` with ``x ~= q * s`` per group.
    Raises:
        QuantFormatError: ``x`` not 2-D or ``group`` not positive.
    """
    if x.dim() != 2 or group <= 0:
        raise QuantFormatError(f"per-group FP8 quantisation needs a 2-D input and group > 0, got "
                               f"{tuple(x.shape)} and group {group}")
    xf = x.float()
    m, k = xf.shape
    kb = math.ceil(k / group)
    pad = torch.zeros(m, kb * group, dtype=torch.float32, device=x.device)
    pad[:, :k] = xf
    s = (pad.view(m, kb, group).abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    if pow2:
        s = round_up_pow2(s)
    q = (pad.view(m, kb, group) / s[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, kb * group)[:, :k]
    return q.to(FP8).contiguous(), s.contiguous()


def fp8_block_matmul_ref(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                         block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """float64 ``(xq * sx) @ (wq * sw).T``: the exact product of per-group quantised activations (``xq`` E4M3
    ``[M, K]``, ``sx`` float32 ``[M, ceil(K / block[1])]``) and an FP8 block weight (``wq [N, K]``, ``sw``
    ``[ceil(N / block[0]), ceil(K / block[1])]``). Every input is dequantised exactly, so a kernel computing the
    same product differs from this only by its accumulation order and output rounding. Returns float64 ``[M, N]``.
    """
    bk = block[1]
    xd = xq.double() * sx.double().repeat_interleave(bk, 1)[:, :xq.shape[1]]
    return xd @ dequantize_fp8_block(wq, sw, block, torch.float64).t()
