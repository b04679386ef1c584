"""Decode attention over SpindleKV's codebook slots, the gather and RoPE fused
(docs/methods/spindlekv.md).

A slot (h, s) of KV head h holds two indices into codebooks of unit rows, two magnitudes, its
position and g keep bits. Its key is RoPE(C_K[off_k[h] + idx_k] * mag_k, pos), its value
C_V[off_v[h] + idx_v] * mag_v, and query head h*g + j sees it only where bit j of its mask
is set. The Triton kernel gathers a tile's codebook rows, rotates them at their own positions
in registers (rotate-half: the two halves of a row are loaded apart, no permutation, and only
the first half of each cos / sin row, since kvrun.models.rope's rows are cat(ang, ang)), scales the
scores by mag_k and the probabilities by mag_v, so no dense K or V is ever written. As in
dense_decode, one program serves the g query heads of a KV head over one split of the slots
and the splits merge by log-sum-exp. Slots held densely (pre-RoPE K and V: codebook=off, or
decode tokens with decode_codebook=off) take the same kernel with the identity gather
(idx None: row s of head h is book[h, s]), so their keep masks and RoPE are fused too.
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

# the kernels below need triton.language as a module global; the references need no triton
tl = importlib.import_module("triton.language") if HAVE_TRITON else None

# slots per tile: 64 spills registers at D = 128 on sm_90 (bench/kernels.py --compile 90)
BLOCK_N = 32
IDX_DTYPES = (torch.int16, torch.int32, torch.int64)


def _check(q, book_k, idx_k, mag_k, book_v, idx_v, mag_v, pos, cos, sin, mask, off_k, off_v):
    """(Hkv, g, S, coded) after checking every argument against q (1, Hq, Tq, D)."""
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[3] % 2 or pos.dim() != 2:
        raise ValueError(f"codebook_decode: q {tuple(q.shape)} / pos {tuple(pos.shape)}")
    _, Hq, _, D = q.shape
    H, S = pos.shape
    if H == 0 or Hq % H:
        raise ValueError(f"codebook_decode: {Hq} query heads not a multiple of {H} KV heads")
    coded = idx_k is not None
    codes = (idx_k, idx_v, mag_k, mag_v)
    bad = []
    if any((t is None) == coded for t in codes):
        bad.append("idx_k, idx_v, mag_k, mag_v must all be given (codes) or all None")
    elif coded:
        if any(t.shape != (H, S) for t in codes):
            bad.append(f"codes {[tuple(t.shape) for t in codes]}")
        if idx_k.dtype not in IDX_DTYPES or idx_v.dtype not in IDX_DTYPES:
            bad.append(f"indices {idx_k.dtype}, {idx_v.dtype}")
        if book_k.dim() != 2 or book_v.dim() != 2 or book_k.shape[1] != D != book_v.shape[1]:
            bad.append(f"books {tuple(book_k.shape)}, {tuple(book_v.shape)}")
        if any(o is not None and o.shape != (H,) for o in (off_k, off_v)):
            bad.append("offsets must be (Hkv,)")
    elif book_k.shape != (H, S, D) or book_v.shape != (H, S, D):
        bad.append(f"dense slots {tuple(book_k.shape)}, {tuple(book_v.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != D:
        bad.append(f"tables {tuple(cos.shape)}, {tuple(sin.shape)}")
    nb = -(-(Hq // H) // 8)  # mask bytes per slot
    if mask is not None and (mask.dtype != torch.uint8 or mask.shape != (H, S, nb)):
        bad.append(f"mask {tuple(mask.shape)} {mask.dtype}")
    if bad:
        raise ValueError(f"codebook_decode: {'; '.join(bad)} for q {tuple(q.shape)}")
    return H, Hq // H, S, coded


def _rows(book: torch.Tensor, idx: torch.Tensor | None, off: torch.Tensor | None) -> torch.Tensor:
    """(Hkv, S, D) rows of the slots in the book's dtype: book[off[h] + idx[h, s]], or the
    dense slots themselves when idx is None."""
    if idx is None:
        return book
    H, S = idx.shape
    i = idx.long()
    if off is not None:
        i = i + off.long()[:, None]
    return book.index_select(0, i.reshape(-1)).view(H, S, book.shape[1])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor):
    """RoPE of x (Hkv, S, D) at pos (Hkv, S) in fp32, as Rope.apply: x cos + rotate_half(x) sin,
    reading the first half of each table row only (the rows are cat(ang, ang))."""
    H, S, D = x.shape
    h = D // 2
    p = pos.reshape(-1).long()
    c = cos[:, :h].index_select(0, p).view(H, S, h).float()  # (Hkv, S, D/2) at each slot
    s = sin[:, :h].index_select(0, p).view(H, S, h).float()
    xf = x.float()
    lo, hi = xf[..., :h], xf[..., h:]
    out = torch.empty(H, S, D, device=x.device, dtype=torch.float32)
    torch.mul(lo, c, out=out[..., :h]).addcmul_(hi, s, value=-1.0)
    torch.mul(hi, c, out=out[..., h:]).addcmul_(lo, s)
    return out


def _per_row(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bmm of a (H, R, K) and b (H, K, N) one row of a at a time: BLAS takes another kernel
    for one row than for several, and a query head's result must not depend on how many
    heads share its KV head (a model with duplicated heads equals its MHA twin)."""
    if a.shape[1] == 1:
        return torch.bmm(a, b)
    return torch.cat([torch.bmm(a[:, r : r + 1], b) for r in range(a.shape[1])], dim=1)


def hidden(mask: torch.Tensor, g: int) -> torch.Tensor:
    """Keep bits (Hkv, S, ceil(g/8)) uint8 -> (Hkv, g, S) bool, True where query head j of the
    group does not see the slot (bit j % 8 of byte j // 8 clear, as SpindleKV's pack_bits)."""
    j = torch.arange(g, device=mask.device)
    if mask.shape[-1] == 1:  # g <= 8: one byte per slot, broadcast over the group
        byte = mask[..., 0][:, None, :]  # (Hkv, 1, S)
    else:
        byte = mask[..., j // 8].transpose(1, 2)  # (Hkv, g, S)
    return ((byte >> (j % 8).to(torch.uint8)[:, None]) & 1) == 0


def codebook_decode_ref(
    q: torch.Tensor,  # (1, Hq, Tq, D) post-RoPE
    book_k: torch.Tensor,  # (Nk, D) unit rows; (Hkv, S, D) pre-RoPE keys when idx_k is None
    idx_k: torch.Tensor | None,  # (Hkv, S) int16 | int32 rows of book_k (from off_k[h])
    mag_k: torch.Tensor | None,  # (Hkv, S) key magnitudes
    book_v: torch.Tensor,  # (Nv, D) unit rows; (Hkv, S, D) values when idx_v is None
    idx_v: torch.Tensor | None,  # (Hkv, S)
    mag_v: torch.Tensor | None,  # (Hkv, S)
    pos: torch.Tensor,  # (Hkv, S) int32 position of each slot
    cos: torch.Tensor,  # (P, D) kvrun.models.rope's tables (rows cat(ang, ang)), P > every position
    sin: torch.Tensor,  # (P, D)
    mask: torch.Tensor | None = None,  # (Hkv, S, ceil(g/8)) uint8 keep bits; None = all see all
    off_k: torch.Tensor | None = None,  # (Hkv,) first row of head h's key book; None = 0
    off_v: torch.Tensor | None = None,  # (Hkv,)
) -> tuple[torch.Tensor, torch.Tensor]:  # out (1, Hq, Tq, D) fp32, lse (1, Hq, Tq) fp32
    """Attention of every query over the slots in fp32 torch, with its log-sum-exp.

    idx_k, idx_v, mag_k and mag_v are given all together (codebook slots) or not at all (dense
    slots). The magnitudes scale the scores and the probabilities, not the rows; rows that
    see no slot get out 0 and lse -inf (the empty-segment convention of Partial).
    """
    H, g, S, _ = _check(q, book_k, idx_k, mag_k, book_v, idx_v, mag_v, pos, cos, sin, mask,
                        off_k, off_v)  # fmt: skip
    _, Hq, Tq, D = q.shape
    if S == 0:
        return empty_partial(1, Hq, Tq, D, q.device)
    R = g * Tq
    k = _rotate(_rows(book_k, idx_k, off_k), cos, sin, pos)  # (Hkv, S, D) fp32, transient
    qr = q.float().reshape(H, R, D)  # row j*Tq + t of KV head h: query head h*g + j, query t
    s = _per_row(qr, k.transpose(1, 2))  # (Hkv, R, S)
    scale = 1.0 / math.sqrt(D)
    s.mul_(scale if mag_k is None else mag_k.float()[:, None, :] * scale)
    if mask is not None:
        s.view(H, g, Tq, S).masked_fill_(hidden(mask, g)[:, :, None, :], float("-inf"))
    mx = s.amax(-1, keepdim=True)  # (Hkv, R, 1)
    mx.masked_fill_(mx == float("-inf"), 0.0)  # a row that sees nothing: exp gives 0 below
    p = s.sub_(mx).exp_()  # (Hkv, R, S) unnormalised, in place of the scores
    total = p.sum(-1, keepdim=True)  # (Hkv, R, 1)
    lse = (mx + total.log()).squeeze(-1)  # (Hkv, R); -inf where a row sees nothing
    if mag_v is not None:
        p.mul_(mag_v.float()[:, None, :])
    out = _per_row(p, _rows(book_v, idx_v, off_v).float())  # (Hkv, R, D)
    out.div_(torch.where(total > 0, total, 1.0))  # normalised after the product: R x D, not S
    return out.view(1, Hq, Tq, D), lse.view(1, Hq, Tq)


def codebook_decode_triton(
    q: torch.Tensor,
    book_k: torch.Tensor,
    idx_k: torch.Tensor | None,
    mag_k: torch.Tensor | None,
    book_v: torch.Tensor,
    idx_v: torch.Tensor | None,
    mag_v: torch.Tensor | None,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None = None,
    off_k: torch.Tensor | None = None,
    off_v: torch.Tensor | None = None,
    *,
    split: int | None = None,  # slots per split (a multiple of block_n); None = by GPU size
    block_n: int = BLOCK_N,  # slots per tile (tuning)
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `codebook_decode_ref` (same arguments and results; keywords tune it)."""
    H, g, S, coded = _check(q, book_k, idx_k, mag_k, book_v, idx_v, mag_v, pos, cos, sin,
                            mask, off_k, off_v)  # fmt: skip
    _, Hq, Tq, D = q.shape
    dev = q.device
    check_tiles("codebook_decode", g, Tq, block_n)
    if S == 0 or Hq * Tq == 0:
        return empty_partial(1, Hq, Tq, D, dev)
    R = Hq * Tq  # partial rows as (Hq, Tq)
    split, po, pl = split_partials("codebook_decode", S, H, R, D, dev, block_n, split)
    n_split = po.shape[0]
    q = q.to(book_k.dtype)  # one dot dtype, the KV dtype (q is tiny)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if coded:  # a row is off[h] + idx[h, s] of a shared (N, D) table: no head stride
        bk_s, bv_s = (0, *book_k.stride()), (0, *book_v.stride())
        codes = (idx_k, idx_v, mag_k, mag_v)
        c_s = [x for t in codes for x in t.stride()]
    else:  # a row is book[h, s]
        bk_s, bv_s = book_k.stride(), book_v.stride()
        codes, c_s = (pl,) * 4, [0] * 8  # dummy pointers, never read
    m_s = mask.stride() if mask is not None else (0, 0, 0)
    _codebook_decode_kernel[(H, n_split)](
        q, book_k, book_v, *codes, pos, cos, sin,
        mask if mask is not None else pl, off_k if off_k is not None else pl,
        off_v if off_v is not None else pl, po, pl,
        *q.stride()[1:], *bk_s, *bv_s, *c_s, *pos.stride(), *cos.stride(), *m_s,
        Tq, S, D, R, split, 1.0 / math.sqrt(D),
        G=g, CODED=coded, HAS_MASK=mask is not None, OFF_K=off_k is not None,
        OFF_V=off_v is not None, BLOCK_M=max(16, next_pow2(g * Tq)), BLOCK_N=block_n,
        BLOCK_H=max(16, next_pow2(D // 2)), BLOCK_D=max(16, next_pow2(D)),
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )  # fmt: skip
    out, lse = combine_splits(po, pl)
    return out.view(1, Hq, Tq, D), lse.view(1, Hq, Tq)


def codebook_decode(
    q: torch.Tensor,
    book_k: torch.Tensor,
    idx_k: torch.Tensor | None,
    mag_k: torch.Tensor | None,
    book_v: torch.Tensor,
    idx_v: torch.Tensor | None,
    mag_v: torch.Tensor | None,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor | None = None,
    off_k: torch.Tensor | None = None,
    off_v: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: Triton on CUDA tensors (up to MAX_ROWS query rows per KV head), else the
    torch reference."""
    args = (q, book_k, idx_k, mag_k, book_v, idx_v, mag_v, pos, cos, sin, mask, off_k, off_v)
    rows = q.shape[1] // max(pos.shape[0], 1) * q.shape[2]
    if rows <= MAX_ROWS and use_triton(q, book_k, book_v, pos):
        return codebook_decode_triton(*args)
    return codebook_decode_ref(*args)


# ------------------------------------------------------------------------------- kernels
@jit
def _codebook_decode_kernel(
    q_ptr, bk_ptr, bv_ptr, ik_ptr, iv_ptr, mk_ptr, mv_ptr, pos_ptr, cos_ptr, sin_ptr,
    msk_ptr, ok_ptr, ov_ptr, po_ptr, pl_ptr,
    sqh, sqt, sqd,
    sbk_h, sbk_r, sbk_d,
    sbv_h, sbv_r, sbv_d,
    sik_h, sik_s, siv_h, siv_s, smk_h, smk_s, smv_h, smv_s,
    sp_h, sp_s,
    sc_p, sc_d,
    sm_h, sm_s, sm_b,
    Tq, S, D, R, split, sm_scale,
    G: tl.constexpr, CODED: tl.constexpr, HAS_MASK: tl.constexpr, OFF_K: tl.constexpr,
    OFF_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One (KV head, split of slots): the G*Tq query rows of the group, online softmax.

    Row m is query head h*G + m // Tq, query m % Tq. A tile's key rows are loaded as their
    low and high halves (BLOCK_H, BLOCK_N), rotated with the first halves of the cos / sin
    rows of their positions and dotted with the matching halves of q; scores are scaled by
    mag_k, probabilities by mag_v before the dot with the value rows. Writes the split's
    normalised output and lse (natural log) into po (S, Hq*Tq, D), pl (S, Hq*Tq).
    """
    h = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    half = D // 2
    m = tl.arange(0, BLOCK_M)
    row_ok = m < G * Tq
    j = m // Tq  # (BLOCK_M,) query head within the group
    hq = h * G + j
    qi = m % Tq
    dh = tl.arange(0, BLOCK_H)
    dh_ok = dh < half
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_row = q_ptr + hq[:, None] * sqh + qi[:, None] * sqt
    q_ok = row_ok[:, None] & dh_ok[None, :]
    q_lo = tl.load(q_row + dh[None, :] * sqd, mask=q_ok, other=0.0)  # (BLOCK_M, BLOCK_H)
    q_hi = tl.load(q_row + (dh[None, :] + half) * sqd, mask=q_ok, other=0.0)
    k_base = bk_ptr + h * sbk_h
    v_base = bv_ptr + h * sbv_h
    off_k = 0
    off_v = 0
    if OFF_K:
        off_k = tl.load(ok_ptr + h).to(tl.int64)
    if OFF_V:
        off_v = tl.load(ov_ptr + h).to(tl.int64)
    lo = sp * split
    hi = tl.minimum(lo + split, S)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # running max, log2 units (finite: no nan)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        n64 = n.to(tl.int64)
        if CODED:
            rk = off_k + tl.load(ik_ptr + h * sik_h + n64 * sik_s, mask=n_ok, other=0).to(tl.int64)
            rv = off_v + tl.load(iv_ptr + h * siv_h + n64 * siv_s, mask=n_ok, other=0).to(tl.int64)
        else:
            rk = n64
            rv = n64
        p_n = tl.load(pos_ptr + h * sp_h + n64 * sp_s, mask=n_ok, other=0).to(tl.int64)
        # K tile as two halves (BLOCK_H, BLOCK_N), rotated at each slot's position
        kt_ok = dh_ok[:, None] & n_ok[None, :]
        k_row = k_base + rk[None, :] * sbk_r
        t_off = p_n[None, :] * sc_p + dh[:, None] * sc_d  # first half of the table rows
        k_lo = tl.load(k_row + dh[:, None] * sbk_d, mask=kt_ok, other=0.0).to(tl.float32)
        k_hi = tl.load(k_row + (dh[:, None] + half) * sbk_d, mask=kt_ok, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t_off, mask=kt_ok, other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_N)
        sn = tl.load(sin_ptr + t_off, mask=kt_ok, other=0.0).to(tl.float32)
        r_lo = k_lo * c - k_hi * sn  # rotate_half: (x_lo, x_hi) -> (-x_hi, x_lo)
        r_hi = k_hi * c + k_lo * sn
        s = tl.dot(q_lo, r_lo.to(q_lo.dtype), input_precision=PREC)  # (BLOCK_M, BLOCK_N)
        s += tl.dot(q_hi, r_hi.to(q_hi.dtype), input_precision=PREC)
        if CODED:
            mk = tl.load(mk_ptr + h * smk_h + n64 * smk_s, mask=n_ok, other=0.0).to(tl.float32)
            s = s * mk[None, :]
        vis = n_ok[None, :] & row_ok[:, None]
        if HAS_MASK:
            byte = tl.load(
                msk_ptr + h * sm_h + n64[None, :] * sm_s + (j // 8)[:, None] * sm_b,
                mask=vis,
                other=0,
            ).to(tl.int32)  # (BLOCK_M, BLOCK_N) the byte holding each row's bit
            vis = vis & (((byte >> (j % 8)[:, None]) & 1) != 0)
        s = tl.where(vis, s * (sm_scale * 1.4426950408889634), float("-inf"))  # log2 units
        p, alpha, m_new, l_i = online_step(s, m_i, l_i)
        vt = tl.load(
            v_base + rv[:, None] * sbv_r + d[None, :] * sbv_d,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        if CODED:
            mv = tl.load(mv_ptr + h * smv_h + n64 * smv_s, mask=n_ok, other=0.0).to(tl.float32)
            p = p * mv[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        m_i = m_new
    row = hq * Tq + qi  # (BLOCK_M,) flat (hq, qi)
    store_partial(po_ptr, pl_ptr, sp, R, D, row, row_ok, d, d_ok, acc, l_i, m_i)
