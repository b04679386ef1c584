"""KIVI quantize-and-pack of a block of dense K and V (docs/methods/kivi.md), as the residual
flush needs.

Keys (Hkv, n, D) are quantized per channel over groups of G consecutive tokens and packed
along tokens, kept block-major (a group's channels together: keys_by_group); values per token
over groups of G consecutive channels, packed along channels. Asymmetric min/max in fp32; scale and zero are rounded to the KV dtype first and
the codes computed from the rounded values with round-half-to-even; a flat group (scale 0)
gets code 0. Code i of an int32 word sits at bits [b*i, b*i + b). The Triton kernels are
bit-identical to the reference: both divide with IEEE rounding (div_rn) and round exactly.

The torch half mirrors KIVI's public quantize + pack (tests/kv_helpers.py; the tests hold
them equal, the keys through keys_by_channel); it lives here so that kvrun.kv.stores.kivi imports it without an import cycle.
"""

from __future__ import annotations

import importlib

import torch

from .dispatch import HAVE_TRITON, jit, next_pow2, use_triton

# the kernels below need triton.language as a module global; the references need no triton
tl = importlib.import_module("triton.language") if HAVE_TRITON else None


def _check(k: torch.Tensor, v: torch.Tensor, bits: int, group: int) -> tuple[int, int, int]:
    """(Hkv, n, D) after checking the KIVI layout constraints."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"kivi_pack: k {tuple(k.shape)} and v {tuple(v.shape)} must be (Hkv, n, D)"
        )
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"kivi_pack: bits {bits} must be 1, 2, 4 or 8")
    H, n, D = k.shape
    per = 32 // bits
    if group <= 0 or group % per or n % group or D % group:
        raise ValueError(
            f"kivi_pack: group {group} must be a multiple of {per} dividing n {n} and D {D}"
        )
    return H, n, D


def quantize_groups(
    x: torch.Tensor, bits: int, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max quantize groups of `group` along the last dim: int64 codes, scale, zero (dtype)."""
    *lead, n = x.shape
    xg = x.float().reshape(*lead, n // group, group)  # (..., n/G, G)
    lo, hi = xg.amin(-1), xg.amax(-1)  # (..., n/G)
    zero = lo.to(dtype)
    scale = ((hi - lo) / (2**bits - 1)).to(dtype)
    s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    q = torch.round((xg - z) / torch.where(s == 0, 1.0, s)).clamp_(0, 2**bits - 1)
    q = torch.where(s == 0, 0.0, q)  # flat group (or a scale that underflowed): code 0
    return q.to(torch.int64).reshape(x.shape), scale, zero


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes along the last dim -> int32 words, 32/bits per word, first code in the lowest bits."""
    per = 32 // bits
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    words = (c << shifts).sum(-1)  # (..., W) in [0, 2^32): fields never overlap
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: int64 codes, 32/bits per word along the last dim."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF  # (..., W) unsigned
    shifts = torch.arange(per, device=words.device, dtype=torch.int64) * bits
    c = (w.unsqueeze(-1) >> shifts) & (2**bits - 1)  # (..., W, per)
    return c.reshape(*words.shape[:-1], words.shape[-1] * per)


def keys_by_group(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed keys from KIVI's public layout, (Hkv, D, n*b/32) words and (Hkv, D, n/G) scales
    and zeros, to the store's block-major one (views): words (Hkv, n/G, D, G*b/32), scales and
    zeros (Hkv, n/G, D). A group of G tokens then lies in one place, every channel of it (the
    CPU reads a block as one stream, not D rows far apart); the codes are the same."""
    H, D, W = codes.shape
    wpg = group * bits // 32  # words a group of one channel
    by_group = codes.view(H, D, W // wpg, wpg).transpose(1, 2)
    return by_group, scale.transpose(1, 2), zero.transpose(1, 2)


def keys_by_channel(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`keys_by_group`'s inverse: the public layout (copies where the views cannot be)."""
    H, ng, D, wpg = codes.shape
    return (
        codes.transpose(1, 2).reshape(H, D, ng * wpg),
        scale.transpose(1, 2),
        zero.transpose(1, 2),
    )


def kivi_pack_ref(
    k: torch.Tensor,  # (Hkv, n, D) post-RoPE keys, KV dtype
    v: torch.Tensor,  # (Hkv, n, D) values
    bits: int,
    group: int,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """(k_codes (Hkv,n/G,D,G*b/32) int32, k_scale, k_zero (Hkv,n/G,D), v_codes (Hkv,n,D*b/32)
    int32, v_scale, v_zero (Hkv,n,D/G)): the keys block-major (keys_by_group), contiguous;
    scales and zeros in `dtype` (default k's; the codes come from them rounded). Torch
    reference."""
    _check(k, v, bits, group)
    dt = dtype or k.dtype
    kc, ks, kz = quantize_groups(k.transpose(1, 2), bits, group, dt)  # (Hkv, D, n)
    vc, vs, vz = quantize_groups(v, bits, group, dt)  # (Hkv, n, D)
    keys = keys_by_group(pack_codes(kc, bits), ks, kz, group, bits)
    return (*(t.contiguous() for t in keys), pack_codes(vc, bits), vs, vz)


def kivi_pack_triton(
    k: torch.Tensor, v: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, ...]:
    """Triton twin of `kivi_pack_ref` (bit-identical results); group must be a power of two."""
    H, n, D = _check(k, v, bits, group)
    if group & (group - 1):
        raise ValueError(f"kivi_pack: the Triton kernel needs a power-of-two group, not {group}")
    per, dev, dt = 32 // bits, k.device, k.dtype
    kc = torch.empty(H, n // group, D, group // per, device=dev, dtype=torch.int32)
    ks = torch.empty(H, n // group, D, device=dev, dtype=dt)
    kz = torch.empty_like(ks)
    vc = torch.empty(H, n, D // per, device=dev, dtype=torch.int32)
    vs = torch.empty(H, n, D // group, device=dev, dtype=dt)
    vz = torch.empty_like(vs)
    if H * n == 0:
        return kc, ks, kz, vc, vs, vz
    tl_dt = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dt]
    block_d = next_pow2(D)
    _pack_keys_kernel[(H, n // group)](
        k, kc, ks, kz, *k.stride(), n, D,
        BITS=bits, GROUP=group, BLOCK_D=block_d, DT=tl_dt,
    )  # fmt: skip
    ngp = next_pow2(D // group)
    block_t = max(1, 4096 // (ngp * group))
    _pack_values_kernel[(H, -(-n // block_t))](
        v, vc, vs, vz, *v.stride(), n, D,
        BITS=bits, GROUP=group, NGP=ngp, BLOCK_T=block_t, DT=tl_dt,
    )  # fmt: skip
    return kc, ks, kz, vc, vs, vz


def kivi_pack(
    k: torch.Tensor, v: torch.Tensor, bits: int, group: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, ...]:
    """Dispatcher: Triton on CUDA tensors (power-of-two group, scales in k's dtype), else the
    torch reference."""
    if use_triton(k, v) and not group & (group - 1) and dtype in (None, k.dtype):
        return kivi_pack_triton(k, v, bits, group)
    return kivi_pack_ref(k, v, bits, group, dtype)


# ------------------------------------------------------------------------------- kernels
@jit
def _quantize_tile(x, lo, hi, BITS: tl.constexpr, DT: tl.constexpr):
    """Codes (uint32, x's shape), scale, zero (DT, lo's shape) of x (fp32) given its group
    min and max already broadcastable to x's shape: kivi.quantize's arithmetic exactly."""
    # div_rn does not broadcast: both operands are given the same shape
    zero = lo.to(DT)
    span = hi - lo
    scale = tl.math.div_rn(span, tl.zeros_like(span) + (2**BITS - 1)).to(DT)
    s = scale.to(tl.float32)
    flat = s == 0.0
    num = x - zero.to(tl.float32)  # x's shape
    y = tl.math.div_rn(num, tl.where(flat, 1.0, s) + tl.zeros_like(num))
    # clamp, then round half-to-even exactly: for 0 <= y < 2^23 the fp32 sum y + 2^23
    # rounds y to an integer (nearest, ties to even); clamping first equals clamping after.
    y = tl.minimum(tl.maximum(y, 0.0), (2**BITS - 1) * 1.0)
    y = (y + 8388608.0) - 8388608.0
    codes = tl.where(flat, 0.0, y).to(tl.uint32)
    return codes, scale, zero


@jit
def _pack_keys_kernel(
    k_ptr, kc_ptr, ks_ptr, kz_ptr, skh, skt, skd, n, D,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """One (KV head, token group): per-channel groups of GROUP tokens -> words along tokens,
    block-major (the group's channels together: keys_by_group).

    The tile is (words of the group WPG, codes per word PER, channels): token = w*PER + i.
    """
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GROUP // PER
    h = tl.program_id(0).to(tl.int64)
    gi = tl.program_id(1).to(tl.int64)
    w = tl.arange(0, WPG)
    i = tl.arange(0, PER)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    tok = gi * GROUP + w[:, None, None] * PER + i[None, :, None]  # (WPG, PER, 1)
    x = tl.load(
        k_ptr + h * skh + tok * skt + d[None, None, :] * skd, mask=d_ok[None, None, :], other=0.0
    ).to(tl.float32)  # (WPG, PER, BLOCK_D)
    lo = tl.min(tl.min(x, 1), 0)  # (BLOCK_D,)
    hi = tl.max(tl.max(x, 1), 0)
    codes, scale, zero = _quantize_tile(x, lo[None, None, :], hi[None, None, :], BITS, DT)
    shift = (i * BITS).to(tl.uint32)
    words = tl.sum(codes << shift[None, :, None], 1)  # (WPG, BLOCK_D): disjoint fields, no carry
    row = (h * (n // GROUP) + gi) * D + d  # (BLOCK_D,) the group's channel rows
    tl.store(
        kc_ptr + row[None, :] * WPG + w[:, None],
        words.to(tl.int32, bitcast=True),
        mask=d_ok[None, :],
    )
    tl.store(ks_ptr + row, tl.reshape(scale, (BLOCK_D,)), mask=d_ok)
    tl.store(kz_ptr + row, tl.reshape(zero, (BLOCK_D,)), mask=d_ok)


@jit
def _pack_values_kernel(
    v_ptr, vc_ptr, vs_ptr, vz_ptr, svh, svt, svd, n, D,
    BITS: tl.constexpr, GROUP: tl.constexpr, NGP: tl.constexpr, BLOCK_T: tl.constexpr,
    DT: tl.constexpr,
):  # fmt: skip
    """One (KV head, block of tokens): per-token groups of GROUP channels -> words along channels.

    The tile is (tokens, groups NGP, words of a group WPG, codes per word PER):
    channel = g*GROUP + w*PER + i.
    """
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GROUP // PER
    h = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.arange(0, NGP)
    w = tl.arange(0, WPG)
    i = tl.arange(0, PER)
    ok = (t[:, None] < n) & (g[None, :] < D // GROUP)  # (BLOCK_T, NGP)
    ch = g[None, :, None, None] * GROUP + w[None, None, :, None] * PER + i[None, None, None, :]
    x = tl.load(
        v_ptr + h * svh + t[:, None, None, None] * svt + ch * svd,
        mask=ok[:, :, None, None],
        other=0.0,
    ).to(tl.float32)  # (BLOCK_T, NGP, WPG, PER)
    lo = tl.min(tl.min(x, 3), 2)  # (BLOCK_T, NGP)
    hi = tl.max(tl.max(x, 3), 2)
    codes, scale, zero = _quantize_tile(x, lo[:, :, None, None], hi[:, :, None, None], BITS, DT)
    shift = (i * BITS).to(tl.uint32)
    words = tl.sum(codes << shift[None, None, None, :], 3)  # (BLOCK_T, NGP, WPG)
    Wd = D // PER
    tl.store(
        vc_ptr + (h * n + t[:, None, None]) * Wd + g[None, :, None] * WPG + w[None, None, :],
        words.to(tl.int32, bitcast=True),
        mask=ok[:, :, None],
    )
    Gd = D // GROUP
    sc = tl.reshape(scale, (BLOCK_T, NGP))
    ze = tl.reshape(zero, (BLOCK_T, NGP))
    tl.store(vs_ptr + (h * n + t[:, None]) * Gd + g[None, :], sc, mask=ok)
    tl.store(vz_ptr + (h * n + t[:, None]) * Gd + g[None, :], ze, mask=ok)
