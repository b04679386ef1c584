"""Decode attention over a KIVI-packed body with the dequantization fused (docs/methods/kivi.md).

The body is what KiviLayer.body() holds: keys per channel in groups of G tokens, packed
along tokens and kept block-major (a group's channels together, kivi_pack.keys_by_group);
values per token in groups of G channels, packed along channels. The Triton
kernel unpacks each tile's codes and applies its scales and zeros in registers, so K and V
are never written out in fp16/fp32. Like dense_decode, one program serves the g query heads
of a KV head and the tokens are split over programs, merged by log-sum-exp.
"""

from __future__ import annotations

import importlib
import math

import torch

from .dense_decode import (
    MAX_ROWS,
    check_tiles,
    combine_splits,
    empty_partial,
    online_step,
    split_partials,
    store_partial,
)
from .dispatch import HAVE_TRITON, jit, next_pow2, use_triton
from .kivi_pack import keys_by_channel, unpack_codes

# the kernels below need triton.language as a module global; the references need no triton
tl = importlib.import_module("triton.language") if HAVE_TRITON else None


def _check(
    q: torch.Tensor, body: tuple[torch.Tensor, ...], bits: int, group: int
) -> tuple[int, int]:
    """(Hkv, Tb) after checking q (1,Hq,Tq,D) against the packed body's layout."""
    kq, ks, kz, vq, vs, vz = body
    _, Hq, _, D = q.shape
    H, Tb = vq.shape[0], vq.shape[1]
    per = 32 // bits
    ok = (
        q.shape[0] == 1 and Hq % H == 0 and Tb % group == 0 and D % group == 0
        and kq.shape == (H, Tb // group, D, group // per) and vq.shape == (H, Tb, D // per)
        and ks.shape == kz.shape == (H, Tb // group, D) and vs.shape == vz.shape == (H, Tb, D // group)
    )  # fmt: skip
    if not ok:
        shapes = [tuple(t.shape) for t in body]
        raise ValueError(
            f"kivi_decode: body {shapes} does not fit q {tuple(q.shape)}, {bits} bits, G {group}"
        )
    return H, Tb


def kivi_decode_ref(
    q: torch.Tensor,  # (1, Hq, Tq, D) post-RoPE
    k_codes: torch.Tensor,  # (Hkv, Tb/G, D, G*b/32) int32, block-major
    k_scale: torch.Tensor,  # (Hkv, Tb/G, D) KV dtype
    k_zero: torch.Tensor,  # (Hkv, Tb/G, D)
    v_codes: torch.Tensor,  # (Hkv, Tb, D*b/32) int32
    v_scale: torch.Tensor,  # (Hkv, Tb, D/G)
    v_zero: torch.Tensor,  # (Hkv, Tb, D/G)
    bits: int,
    group: int,
    causal_offset: int | None = None,  # query i sees body slots t <= causal_offset + i; None = all
) -> tuple[torch.Tensor, torch.Tensor]:  # out (1, Hq, Tq, D) fp32, lse (1, Hq, Tq) fp32
    """Body attention with dequantization fused into the math (KiviLayer._attend_body, fp32).

    score_t = (1/sqrt(D)) sum_c q[c] (sK[c,g(t)] kq[t,c] + zK[c,g(t)]),
    out[c] = sum_t p_t (sV[t,g(c)] vq[t,c] + zV[t,g(c)]).
    """
    body = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    H, Tb = _check(q, body, bits, group)
    _, Hq, Tq, D = q.shape
    G = group
    k_codes, k_scale, k_zero = keys_by_channel(k_codes, k_scale, k_zero)  # (Hkv, D, ...)
    # contiguous: the products below then sum in one order whatever views the body came as
    k_scale, k_zero = k_scale.float().contiguous(), k_zero.float().contiguous()
    qg = q.float().reshape(H, Hq // H, Tq, D)  # (Hkv, g, Tq, D)
    kc = unpack_codes(k_codes, bits).float().view(H, D, Tb // G, G)  # (Hkv, D, Tb/G, G)
    sk = (kc * k_scale[..., None]).view(H, D, Tb)  # (Hkv, D, Tb) per-call temporary
    s = torch.einsum("hgqc,hct->hgqt", qg, sk)  # (Hkv, g, Tq, Tb)
    qz = torch.einsum("hgqc,hcn->hgqn", qg, k_zero)  # (Hkv, g, Tq, Tb/G): q . zK
    s = (s + qz.repeat_interleave(G, dim=-1)) / math.sqrt(D)
    if causal_offset is not None:
        t = torch.arange(Tb, device=q.device)
        vis = t[None, :] <= causal_offset + torch.arange(Tq, device=q.device)[:, None]
        s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (Hkv, g, Tq); -inf when Tb = 0
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # (Hkv, g, Tq, Tb)
    vc = unpack_codes(v_codes, bits).float().view(H, Tb, D // G, G)  # (Hkv, Tb, D/G, G)
    sv = (vc * v_scale.float()[..., None]).view(H, Tb, D)  # (Hkv, Tb, D)
    out = torch.einsum("hgqt,htc->hgqc", p, sv)  # (Hkv, g, Tq, D)
    pz = torch.einsum("hgqt,htn->hgqn", p, v_zero.float())  # (Hkv, g, Tq, D/G): sum_t p zV
    out = out + pz.repeat_interleave(G, dim=-1)
    return out.reshape(1, Hq, Tq, D), lse.reshape(1, Hq, Tq)


def triton_supported(bits: int, group: int) -> bool:
    """Whether the Triton kernel takes this layout: power-of-two group (block shapes)."""
    return bits in (1, 2, 4, 8) and group > 0 and not group & (group - 1)


def kivi_decode_triton(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    bits: int,
    group: int,
    causal_offset: int | None = None,
    *,
    split: int | None = None,  # tokens per split (a multiple of the tile); None = by GPU size
    block_n: int = 64,  # tokens per tile (tuning): raised to the group when smaller
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `kivi_decode_ref` (same arguments and results; keywords tune it)."""
    body = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    H, Tb = _check(q, body, bits, group)
    if not triton_supported(bits, group):
        raise ValueError(f"kivi_decode: the Triton kernel needs a power-of-two group, not {group}")
    _, Hq, Tq, D = q.shape
    g, dev = Hq // H, q.device
    block_n = max(next_pow2(block_n), group)  # token tile: whole key groups and code words
    check_tiles("kivi_decode", g, Tq, block_n)
    if Tb == 0 or Hq * Tq == 0:
        return empty_partial(1, Hq, Tq, D, dev)
    R = Hq * Tq  # partial rows as (Hq, Tq)
    split, po, pl = split_partials("kivi_decode", Tb, H, R, D, dev, block_n, split)
    n_split = po.shape[0]
    # scale and zero of K (and of V) share strides in KiviLayer; make them so otherwise
    if k_scale.stride() != k_zero.stride():
        k_scale, k_zero = k_scale.contiguous(), k_zero.contiguous()
    if v_scale.stride() != v_zero.stride():
        v_scale, v_zero = v_scale.contiguous(), v_zero.contiguous()
    block_d = max(16, next_pow2(D))
    _kivi_decode_kernel[(H, n_split)](
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, po, pl,
        *q.stride()[1:], *k_codes.stride(), k_scale.stride(0), k_scale.stride(2), k_scale.stride(1),
        *v_codes.stride(), *v_scale.stride(),
        Tq, Tb, D, R, split, causal_offset or 0, 1.0 / math.sqrt(D),
        G=g, BITS=bits, GROUP=group, CAUSAL=causal_offset is not None,
        BLOCK_M=max(16, next_pow2(g * Tq)), BLOCK_N=block_n, BLOCK_D=block_d,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )  # fmt: skip
    out, lse = combine_splits(po, pl)
    return out.view(1, Hq, Tq, D), lse.view(1, Hq, Tq)


def kivi_decode(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    bits: int,
    group: int,
    causal_offset: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: Triton on CUDA tensors (power-of-two group, up to MAX_ROWS query rows per
    KV head), else the torch reference."""
    args = (q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits, group, causal_offset)
    rows = q.shape[1] // max(k_codes.shape[0], 1) * q.shape[2]
    if rows <= MAX_ROWS and triton_supported(bits, group) and use_triton(q, k_codes, v_codes):
        return kivi_decode_triton(*args)
    return kivi_decode_ref(*args)


# ------------------------------------------------------------------------------- kernels
@jit
def _kivi_decode_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, po_ptr, pl_ptr,
    sqh, sqt, sqd,
    skc_h, skc_g, skc_d, skc_w,
    sks_h, sks_d, sks_g,
    svc_h, svc_t, svc_w,
    svs_h, svs_t, svs_g,
    Tq, Tb, D, R, split, causal_off, sm_scale,
    G: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One (KV head, split of body tokens): the G*Tq query rows of the group, online softmax.

    Row m is query head h*G + m // Tq, query m % Tq. Codes are unpacked by broadcasting each
    word over its PER fields (shift, mask) and reshaping (word, field) into consecutive
    tokens (keys) or channels (values); scales and zeros are broadcast over their GROUP.
    """
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GROUP // PER  # words a key group of one channel
    MASK: tl.constexpr = (1 << BITS) - 1
    h = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    row_ok = m < G * Tq
    hq = h * G + m // Tq
    qi = m % Tq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        q_ptr + hq[:, None] * sqh + qi[:, None] * sqt + d[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    shift = tl.arange(0, PER) * BITS  # (PER,)
    tw = tl.arange(0, BLOCK_N // PER)  # key words in a tile
    tg = tl.arange(0, BLOCK_N // GROUP)  # key groups in a tile
    dw = tl.arange(0, BLOCK_D // PER)  # value words of a token
    dg = tl.arange(0, BLOCK_D // GROUP)  # value groups of a token
    dw_ok = dw < D // PER
    dg_ok = dg < D // GROUP
    lo = sp * split
    hi = tl.minimum(lo + split, Tb)  # a multiple of GROUP, hence of PER
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        # K tile (BLOCK_D channels, BLOCK_N tokens) from words packed along tokens, block-major
        w = start // PER + tw
        wo = (w // WPG) * skc_g + (w % WPG) * skc_w  # the word's group, then its place in it
        kw = tl.load(
            kc_ptr + h * skc_h + d[:, None] * skc_d + wo[None, :],
            mask=d_ok[:, None] & (w < hi // PER)[None, :],
            other=0,
        )  # (BLOCK_D, BLOCK_N/PER) int32
        kq = tl.reshape((kw[:, :, None] >> shift[None, None, :]) & MASK, (BLOCK_D, BLOCK_N))
        gk = start // GROUP + tg
        koff = h * sks_h + d[:, None] * sks_d + gk[None, :] * sks_g
        kmask = d_ok[:, None] & (gk < hi // GROUP)[None, :]
        ks = tl.load(ks_ptr + koff, mask=kmask, other=0.0).to(
            tl.float32
        )  # (BLOCK_D, BLOCK_N/GROUP)
        kz = tl.load(kz_ptr + koff, mask=kmask, other=0.0).to(tl.float32)
        ks = tl.reshape(
            tl.broadcast_to(ks[:, :, None], (BLOCK_D, BLOCK_N // GROUP, GROUP)), (BLOCK_D, BLOCK_N)
        )
        kz = tl.reshape(
            tl.broadcast_to(kz[:, :, None], (BLOCK_D, BLOCK_N // GROUP, GROUP)), (BLOCK_D, BLOCK_N)
        )
        k_hat = kq.to(tl.float32) * ks + kz  # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, k_hat.to(q.dtype), input_precision=PREC) * sm_scale  # (BLOCK_M, BLOCK_N)
        n = start + tl.arange(0, BLOCK_N)
        vis = (n < hi)[None, :] & row_ok[:, None]
        if CAUSAL:
            vis = vis & (n[None, :] <= causal_off + qi[:, None])
        s = tl.where(vis, s * 1.4426950408889634, float("-inf"))  # log2 units for exp2
        p, alpha, m_new, l_i = online_step(s, m_i, l_i)
        # V tile (BLOCK_N tokens, BLOCK_D channels) from words packed along channels
        n_ok = n < hi
        vw = tl.load(
            vc_ptr + h * svc_h + n[:, None] * svc_t + dw[None, :] * svc_w,
            mask=n_ok[:, None] & dw_ok[None, :],
            other=0,
        )  # (BLOCK_N, BLOCK_D/PER) int32
        vq = tl.reshape((vw[:, :, None] >> shift[None, None, :]) & MASK, (BLOCK_N, BLOCK_D))
        voff = h * svs_h + n[:, None] * svs_t + dg[None, :] * svs_g
        vmask = n_ok[:, None] & dg_ok[None, :]
        vs = tl.load(vs_ptr + voff, mask=vmask, other=0.0).to(
            tl.float32
        )  # (BLOCK_N, BLOCK_D/GROUP)
        vz = tl.load(vz_ptr + voff, mask=vmask, other=0.0).to(tl.float32)
        vs = tl.reshape(
            tl.broadcast_to(vs[:, :, None], (BLOCK_N, BLOCK_D // GROUP, GROUP)), (BLOCK_N, BLOCK_D)
        )
        vz = tl.reshape(
            tl.broadcast_to(vz[:, :, None], (BLOCK_N, BLOCK_D // GROUP, GROUP)), (BLOCK_N, BLOCK_D)
        )
        v_hat = vq.to(tl.float32) * vs + vz  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v_hat.to(q.dtype), input_precision=PREC)
        m_i = m_new
    row = hq * Tq + qi  # (BLOCK_M,) flat (hq, qi)
    store_partial(po_ptr, pl_ptr, sp, R, D, row, row_ok, d, d_ok, acc, l_i, m_i)
