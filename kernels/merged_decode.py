"""Decode attention over a MiniCache merged pair with the restore fused (issue 6, item 5).

A paired layer keeps per token and KV head a merged direction E, its own norm n and a few
retained exact rows. Instead of restoring X_hat = E n / ||E|| (retained rows put back) into a
dense scratch and attending over that, the kernel reads E once per tile: the per-key factor
n / ||E|| multiplies the scores (keys) or the probabilities (values), and an override map
swaps the retained rows in. Like dense_decode, one program serves the g query heads of a KV
head and the keys are split over programs, merged by log-sum-exp.
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

# keys per tile and warps: 64 keys or 4 warps spill registers at D = 128 on sm_90 with the
# norms and override gathers in flight (bench/kernels.py --compile 90)
BLOCK_N, NUM_WARPS = 32, 8


def _check(q, e_k, scale_k, e_v, scale_v, ov_k, rows_k, ov_v, rows_v) -> tuple[int, int]:
    """(Hkv, T) after checking q (1,Hq,Tq,D) against the merged pair's layout."""
    if q.dim() != 4 or e_k.dim() != 3:
        raise ValueError(
            f"merged_decode: q {tuple(q.shape)} / E {tuple(e_k.shape)} are not 4-D / 3-D"
        )
    _, Hq, _, D = q.shape
    H, T = e_k.shape[0], e_k.shape[1]
    ok = (
        q.shape[0] == 1 and e_k.shape == e_v.shape and e_k.shape[2] == D and H > 0
        and Hq % H == 0 and scale_k.shape == scale_v.shape == (H, T)
    )  # fmt: skip
    for ov, rows in ((ov_k, rows_k), (ov_v, rows_v)):
        if (ov is None) != (rows is None):
            ok = False
        elif ov is not None:
            ok = ok and ov.shape == (H, T) and ov.dtype == torch.int32
            ok = ok and rows.dim() == 2 and rows.shape[1] == D
    if not ok:
        shapes = [None if t is None else tuple(t.shape) for t in (e_k, scale_k, ov_k, rows_k)]
        raise ValueError(
            f"merged_decode: E, scale, map, rows {shapes} do not fit q {tuple(q.shape)}"
        )
    return H, T


def _factors(e: torch.Tensor, scale: torch.Tensor, unit: bool) -> torch.Tensor:
    """(Hkv, T) fp32 per-row factor: scale / ||E|| (scale where ||E|| = 0: E is 0 there)."""
    f = scale.float()
    if unit:
        n = torch.linalg.vector_norm(e.float(), dim=-1)  # (Hkv, T)
        f = f / torch.where(n > 0, n, 1.0)
    return f


def merged_decode_ref(
    q: torch.Tensor,  # (1, Hq, Tq, D) post-RoPE
    e_k: torch.Tensor,  # (Hkv, T, D) merged key directions E_K
    scale_k: torch.Tensor,  # (Hkv, T) the layer's key norms (unit) or factors
    e_v: torch.Tensor,  # (Hkv, T, D) merged value directions E_V
    scale_v: torch.Tensor,  # (Hkv, T)
    unit: bool,  # True: divide each E row by its own L2 norm
    ov_k: torch.Tensor | None = None,  # (Hkv, T) int32: -1 = restore, else a row of rows_k
    rows_k: torch.Tensor | None = None,  # (N_k, D) exact key rows
    ov_v: torch.Tensor | None = None,  # (Hkv, T) int32: -1 = restore, else a row of rows_v
    rows_v: torch.Tensor | None = None,  # (N_v, D) exact value rows
) -> tuple[torch.Tensor, torch.Tensor]:  # out (1, Hq, Tq, D) fp32, lse (1, Hq, Tq) fp32
    """Attention of q over the restored pair in fp32 torch, without building the restored K, V.

    Key row (h,t) = rows_k[ov_k[h,t]] if ov_k[h,t] >= 0 else E_k[h,t] scale_k[h,t] / (||E_k[h,t]||
    if unit else 1), 0 where ||E|| = 0 (as minicache.direction); values likewise. Every query
    sees every key. The factor scales the scores (K) and the probabilities (V), and only the
    few overridden (h, t) are gathered, so E_K and E_V are each read twice (norm, product).
    """
    H, T = _check(q, e_k, scale_k, e_v, scale_v, ov_k, rows_k, ov_v, rows_v)
    _, Hq, Tq, D = q.shape
    g = Hq // H
    if T == 0 or Tq == 0:
        return empty_partial(1, Hq, Tq, D, q.device)
    qg = q.float().reshape(H, g * Tq, D)  # (Hkv, g*Tq, D): row m = query head h*g + m // Tq
    fk = _factors(e_k, scale_k, unit) / math.sqrt(D)  # (Hkv, T)
    s = torch.bmm(qg, e_k.float().transpose(1, 2)) * fk[:, None, :]  # (Hkv, g*Tq, T)
    if ov_k is not None and rows_k.shape[0]:
        hk, tk = (ov_k >= 0).nonzero(as_tuple=True)  # (N,) each
        rk = rows_k.float()[ov_k[hk, tk].long()]  # (N, D)
        s[hk, :, tk] = torch.einsum("nmd,nd->nm", qg[hk], rk) / math.sqrt(D)  # (N, g*Tq)
    lse = torch.logsumexp(s, dim=-1)  # (Hkv, g*Tq)
    p = torch.exp(s - lse.unsqueeze(-1))  # (Hkv, g*Tq, T)
    fv = _factors(e_v, scale_v, unit)  # (Hkv, T)
    hv = None
    if ov_v is not None and rows_v.shape[0]:
        hv, tv = (ov_v >= 0).nonzero(as_tuple=True)
        fv = fv.index_put((hv, tv), fv.new_zeros(()))  # their E rows do not count
    out = torch.bmm(p * fv[:, None, :], e_v.float())  # (Hkv, g*Tq, D)
    if hv is not None:
        rv = rows_v.float()[ov_v[hv, tv].long()]  # (N, D)
        out.index_add_(0, hv, p[hv, :, tv].unsqueeze(-1) * rv[:, None, :])
    return out.reshape(1, Hq, Tq, D), lse.reshape(1, Hq, Tq)


def merged_decode_triton(
    q: torch.Tensor,
    e_k: torch.Tensor,
    scale_k: torch.Tensor,
    e_v: torch.Tensor,
    scale_v: torch.Tensor,
    unit: bool,
    ov_k: torch.Tensor | None = None,
    rows_k: torch.Tensor | None = None,
    ov_v: torch.Tensor | None = None,
    rows_v: torch.Tensor | None = None,
    *,
    split: int | None = None,  # keys per split (a multiple of block_n); None = by GPU size
    block_n: int = BLOCK_N,  # keys per tile (tuning)
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `merged_decode_ref` (same arguments and results; keywords tune it)."""
    H, T = _check(q, e_k, scale_k, e_v, scale_v, ov_k, rows_k, ov_v, rows_v)
    _, Hq, Tq, D = q.shape
    g, dev = Hq // H, q.device
    check_tiles("merged_decode", g, Tq, block_n)
    if T == 0 or Tq == 0:
        return empty_partial(1, Hq, Tq, D, dev)
    R = Hq * Tq  # partial rows as (Hq, Tq)
    split, po, pl = split_partials("merged_decode", T, H, R, D, dev, block_n, split)
    n_split = po.shape[0]
    q = q.to(e_k.dtype)  # one dot dtype (q is tiny)
    has_k = ov_k is not None and rows_k.shape[0] > 0
    has_v = ov_v is not None and rows_v.shape[0] > 0
    # an unused map or row table gets a dummy pointer and zero strides
    ok_, rk_ = (ov_k, rows_k) if has_k else (pl, pl)
    ov_, rv_ = (ov_v, rows_v) if has_v else (pl, pl)
    sok = ov_k.stride() if has_k else (0, 0)
    srk = rows_k.stride() if has_k else (0, 0)
    sov = ov_v.stride() if has_v else (0, 0)
    srv = rows_v.stride() if has_v else (0, 0)
    _merged_decode_kernel[(H, n_split)](
        q, e_k, scale_k, e_v, scale_v, ok_, rk_, ov_, rv_, po, pl,
        *q.stride()[1:], *e_k.stride(), *scale_k.stride(), *e_v.stride(), *scale_v.stride(),
        *sok, *srk, *sov, *srv,
        Tq, T, D, R, split, 1.0 / math.sqrt(D),
        G=g, UNIT=bool(unit), OV_K=has_k, OV_V=has_v,
        BLOCK_M=max(16, next_pow2(g * Tq)), BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)),
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )  # fmt: skip
    out, lse = combine_splits(po, pl)
    return out.view(1, Hq, Tq, D), lse.view(1, Hq, Tq)


def merged_decode(
    q: torch.Tensor,
    e_k: torch.Tensor,
    scale_k: torch.Tensor,
    e_v: torch.Tensor,
    scale_v: torch.Tensor,
    unit: bool,
    ov_k: torch.Tensor | None = None,
    rows_k: torch.Tensor | None = None,
    ov_v: torch.Tensor | None = None,
    rows_v: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: Triton on CUDA tensors (when triton imports) for up to MAX_ROWS query rows
    per KV head, else the torch reference."""
    args = (q, e_k, scale_k, e_v, scale_v, unit, ov_k, rows_k, ov_v, rows_v)
    rows = q.shape[1] // max(e_k.shape[0], 1) * q.shape[2]
    if rows <= MAX_ROWS and use_triton(q, e_k, e_v):
        return merged_decode_triton(*args)
    return merged_decode_ref(*args)


# ------------------------------------------------------------------------------- kernels
@jit
def _merged_decode_kernel(
    q_ptr, ek_ptr, sk_ptr, ev_ptr, sv_ptr, ok_ptr, rk_ptr, ov_ptr, rv_ptr, po_ptr, pl_ptr,
    sqh, sqt, sqd,
    sek_h, sek_t, sek_d,
    ssk_h, ssk_t,
    sev_h, sev_t, sev_d,
    ssv_h, ssv_t,
    sok_h, sok_t,
    srk_r, srk_d,
    sov_h, sov_t,
    srv_r, srv_d,
    Tq, T, D, R, split, sm_scale,
    G: tl.constexpr, UNIT: tl.constexpr, OV_K: tl.constexpr, OV_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One (KV head, split of merged tokens): the G*Tq query rows of the group, online softmax.

    Row m is query head h*G + m // Tq, query m % Tq. Per key t the factor f_t = scale_t /
    ||E_t|| (UNIT) or scale_t multiplies the score (K) or the probability (V); an overridden
    key gathers its exact row and takes f_t = 1.
    """
    h = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    row_ok = m < G * Tq
    hq = h * G + m // Tq  # (BLOCK_M,) query head of each row
    qi = m % Tq  # (BLOCK_M,) query index of each row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        q_ptr + hq[:, None] * sqh + qi[:, None] * sqt + d[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    lo = sp * split
    hi = tl.minimum(lo + split, T)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # running max, log2 units (finite: no nan)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        n64 = n.to(tl.int64)
        # K tile (BLOCK_D channels, BLOCK_N tokens) of E_K and its per-token factor
        kt = tl.load(
            ek_ptr + h * sek_h + n64[None, :] * sek_t + d[:, None] * sek_d,
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)
        fk = tl.load(sk_ptr + h * ssk_h + n64 * ssk_t, mask=n_ok, other=0.0).to(tl.float32)
        if UNIT:
            kf = kt.to(tl.float32)
            nk = tl.sqrt(tl.sum(kf * kf, 0))  # (BLOCK_N,)
            fk = fk / tl.where(nk > 0, nk, 1.0)
        if OV_K:
            ok = tl.load(ok_ptr + h * sok_h + n64 * sok_t, mask=n_ok, other=-1)  # (BLOCK_N,)
            use = ok >= 0
            rk = tl.load(
                rk_ptr + ok.to(tl.int64)[None, :] * srk_r + d[:, None] * srk_d,
                mask=use[None, :] & d_ok[:, None],
                other=0.0,
            )  # (BLOCK_D, BLOCK_N) exact rows where overridden
            kt = tl.where(use[None, :], rk.to(kt.dtype), kt)
            fk = tl.where(use, 1.0, fk)
        s = tl.dot(q, kt.to(q.dtype), input_precision=PREC)  # (BLOCK_M, BLOCK_N)
        s = s * (fk * (sm_scale * 1.4426950408889634))[None, :]  # log2 units for exp2
        s = tl.where(n_ok[None, :] & row_ok[:, None], s, float("-inf"))
        p, alpha, m_new, l_i = online_step(s, m_i, l_i)
        # V tile (BLOCK_N tokens, BLOCK_D channels) of E_V; its factor scales p
        vt = tl.load(
            ev_ptr + h * sev_h + n64[:, None] * sev_t + d[None, :] * sev_d,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        fv = tl.load(sv_ptr + h * ssv_h + n64 * ssv_t, mask=n_ok, other=0.0).to(tl.float32)
        if UNIT:
            vf = vt.to(tl.float32)
            nv = tl.sqrt(tl.sum(vf * vf, 1))  # (BLOCK_N,)
            fv = fv / tl.where(nv > 0, nv, 1.0)
        if OV_V:
            ov = tl.load(ov_ptr + h * sov_h + n64 * sov_t, mask=n_ok, other=-1)
            use_v = ov >= 0
            rv = tl.load(
                rv_ptr + ov.to(tl.int64)[:, None] * srv_r + d[None, :] * srv_d,
                mask=use_v[:, None] & d_ok[None, :],
                other=0.0,
            )  # (BLOCK_N, BLOCK_D)
            vt = tl.where(use_v[:, None], rv.to(vt.dtype), vt)
            fv = tl.where(use_v, 1.0, fv)
        pv = (p * fv[None, :]).to(q.dtype)  # (BLOCK_M, BLOCK_N)
        acc = acc * alpha[:, None] + tl.dot(pv, vt.to(q.dtype), input_precision=PREC)
        m_i = m_new
    row = hq * Tq + qi  # (BLOCK_M,) flat (hq, qi)
    store_partial(po_ptr, pl_ptr, sp, R, D, row, row_ok, d, d_ok, acc, l_i, m_i)
