"""MiniKV's two-pass prefill attention: the output plus each key's summed probability (H2O).

Queries sit at the last Tq key slots (T-Tq .. T-1) and attend causally. Pass 1 is a flash
attention forward writing O and the fp32 log-sum-exp of every row; pass 2 is a separate
launch over (key blocks, KV heads): each program loops over the group's query heads and the
query blocks that reach its keys causally and sums exp(S - LSE) down the columns. Two
launches, because one launch cannot wait for other programs' LSE rows (docs/methods/minikv.md,
kvrun's decisions); no atomics and a fixed summation order, so the sums are deterministic. The
reference processes blocks of 256 query rows, never holding more than one 256 x T block per
head.
"""

from __future__ import annotations

import importlib
import math

import torch

from .dense_decode import online_step
from .dispatch import HAVE_TRITON, jit, next_pow2, use_triton

# the kernels below need triton.language as a module global; the references need no triton
tl = importlib.import_module("triton.language") if HAVE_TRITON else None

REF_ROWS = 256  # query rows per block of the torch reference (docs/methods/minikv.md step 2, CPU)
BLOCK_M, BLOCK_N = 64, 64  # Triton tiles (docs/methods/minikv.md: 64 x 64)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(Hq, Hkv, Tq, T, D) after checking q (1,Hq,Tq,D), k, v (1,Hkv,T,D), Tq <= T."""
    _, Hq, Tq, D = q.shape
    if q.shape[0] != 1 or k.shape != v.shape or k.shape[0] != 1 or k.shape[3] != D:
        raise ValueError(f"colsum: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hkv, T = k.shape[1], k.shape[2]
    if Hq % Hkv or Tq > T:
        raise ValueError(f"colsum: Hq {Hq} must be a multiple of Hkv {Hkv}, Tq {Tq} <= T {T}")
    return Hq, Hkv, Tq, T, D


def _total_lse(lse: torch.Tensor, other_lse: torch.Tensor | None) -> torch.Tensor:
    """(Hq, Tq) log-sum-exp over these keys and those of other segments (earlier turns)."""
    if other_lse is None:
        return lse
    return torch.logaddexp(lse, other_lse.reshape(lse.shape).to(lse.device, torch.float32))


def colsum_ref(
    q: torch.Tensor,  # (1, Hq, Tq, D) post-RoPE, the queries of key slots T-Tq .. T-1
    k: torch.Tensor,  # (1, Hkv, T, D) post-RoPE
    v: torch.Tensor,  # (1, Hkv, T, D)
    per_head: bool = False,
    other_lse: torch.Tensor | None = None,  # (Hq, Tq) or (1, Hq, Tq): keys held elsewhere
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention out (1,Hq,Tq,D) fp32, lse (Hq,Tq) fp32 and column sums fp32:
    (Hkv, T) summed over each group's query heads and all rows, or (Hq, T) when per_head.

    out and lse cover these T keys only (a Partial for `combine`); with `other_lse` the
    column sums are the true probabilities of a softmax that also runs over other segments.
    """
    Hq, Hkv, Tq, T, D = _check(q, k, v)
    g, off = Hq // Hkv, T - Tq
    other = None if other_lse is None else other_lse.reshape(Hkv, g, Tq).float()
    qg = q[0].float().view(Hkv, g, Tq, D) / math.sqrt(D)
    kf, vf = k[0].float(), v[0].float()  # (Hkv, T, D)
    out = torch.empty(Hkv, g, Tq, D, device=q.device)
    lse = torch.empty(Hkv, g, Tq, device=q.device)
    col = torch.zeros(Hkv, g, T, device=q.device)
    for s in range(0, Tq, REF_ROWS):
        e = min(s + REF_ROWS, Tq)
        end = off + e  # keys any row of the block can see
        sc = torch.einsum("hgqd,htd->hgqt", qg[:, :, s:e], kf[:, :end])  # (Hkv, g, b, end)
        rows = torch.arange(off + s, off + e, device=q.device)
        sc = sc.masked_fill(
            torch.arange(end, device=q.device)[None, :] > rows[:, None], float("-inf")
        )
        lse[:, :, s:e] = torch.logsumexp(sc, dim=-1)
        p = torch.exp(sc - lse[:, :, s:e, None])  # rows are complete: exact softmax
        out[:, :, s:e] = torch.einsum("hgqt,htd->hgqd", p, vf[:, :end])
        if other is not None:  # probabilities of a softmax over every key the rows see
            blk = lse[:, :, s:e]
            p = p * torch.exp(blk - torch.logaddexp(blk, other[:, :, s:e]))[..., None]
        col[:, :, :end] += p.sum(dim=2)
    col = col.view(Hq, T) if per_head else col.sum(1)
    return out.view(1, Hq, Tq, D), lse.view(Hq, Tq), col


def colsum_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    per_head: bool = False,
    other_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of `colsum_ref`: pass 1 (flash forward), then pass 2 (column sums)."""
    Hq, Hkv, Tq, T, D = _check(q, k, v)
    dev, g = q.device, Hq // Hkv
    q = q.to(k.dtype)  # one dot dtype
    out = torch.empty(1, Hq, Tq, D, device=dev, dtype=torch.float32)
    lse = torch.empty(Hq, Tq, device=dev, dtype=torch.float32)
    col = torch.zeros(Hq if per_head else Hkv, T, device=dev, dtype=torch.float32)
    if Tq == 0 or Hq == 0:
        return out, lse, col
    block_d = max(16, next_pow2(D))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    sm_scale = 1.0 / math.sqrt(D)
    qs, ks, vs = q.stride()[1:], k.stride()[1:], v.stride()[1:]
    _attn_fwd_kernel[(-(-Tq // BLOCK_M), Hq)](
        q, k, v, out, lse, *qs, *ks, *vs, Tq, T, D, sm_scale,
        G=g, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_d, PREC=prec, num_warps=4,
    )  # fmt: skip
    _colsum_kernel[(-(-T // BLOCK_N), Hkv)](
        q, k, _total_lse(lse, other_lse), col, *qs, *ks, Tq, T, D, sm_scale,
        G=g, PER_HEAD=per_head, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_d, PREC=prec,
        num_warps=4,
    )  # fmt: skip
    return out, lse, col


def colsum(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    per_head: bool = False,
    other_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatcher: the two Triton launches on CUDA tensors, else the chunked torch reference."""
    fn = colsum_triton if use_triton(q, k, v) else colsum_ref
    return fn(q, k, v, per_head, other_lse)


# ------------------------------------------------------------------------------- kernels
@jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    sqh, sqt, sqd, skh, skt, skd, svh, svt, svd,
    Tq, T, D, sm_scale,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """Pass 1, one (query block, query head): causal flash attention, O and natural-log LSE."""
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows
    hq = tl.program_id(1).to(tl.int64)
    h = hq // G
    off = T - Tq
    i_ok = i < Tq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        q_ptr + hq * sqh + i[:, None] * sqt + d[None, :] * sqd,
        mask=i_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(off + tl.program_id(0) * BLOCK_M + BLOCK_M, T)  # past the block's last row
    for start in range(0, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < T
        kt = tl.load(
            k_ptr + h * skh + n[None, :] * skt + d[:, None] * skd,
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, kt.to(q.dtype), input_precision=PREC) * (sm_scale * 1.4426950408889634)
        vis = n_ok[None, :] & (n[None, :] <= off + i[:, None])
        s = tl.where(vis, s, float("-inf"))
        p, alpha, m_new, l_i = online_step(s, m_i, l_i)
        vt = tl.load(
            v_ptr + h * svh + n[:, None] * svt + d[None, :] * svd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # every valid row sees key 0; padding rows see none
    tl.store(
        o_ptr + (hq * Tq + i[:, None]) * D + d[None, :],
        acc / l_safe[:, None],
        mask=i_ok[:, None] & d_ok[None, :],
    )
    tl.store(lse_ptr + hq * Tq + i, (m_i + tl.log2(l_safe)) * 0.6931471805599453, mask=i_ok)


@jit
def _colsum_kernel(
    q_ptr, k_ptr, lse_ptr, col_ptr,
    sqh, sqt, sqd, skh, skt, skd,
    Tq, T, D, sm_scale,
    G: tl.constexpr, PER_HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Pass 2, one (key block, KV head): sum over the group's heads and the query blocks that
    reach the keys causally of exp(S - LSE), in a fixed order."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # key slots
    h = tl.program_id(1).to(tl.int64)
    off = T - Tq
    n_ok = n < T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    kt = tl.load(
        k_ptr + h * skh + n[None, :] * skt + d[:, None] * skd,
        mask=n_ok[None, :] & d_ok[:, None],
        other=0.0,
    )  # (BLOCK_D, BLOCK_N), read once for all heads and query blocks
    first = (
        tl.maximum(tl.program_id(0) * BLOCK_N - off, 0) // BLOCK_M * BLOCK_M
    )  # first row seeing a key
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in range(0, G):
        hq = h * G + j
        acc = tl.zeros([BLOCK_N], tl.float32)
        for i0 in range(first, Tq, BLOCK_M):
            i = i0 + tl.arange(0, BLOCK_M)
            i_ok = i < Tq
            q = tl.load(
                q_ptr + hq * sqh + i[:, None] * sqt + d[None, :] * sqd,
                mask=i_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # (BLOCK_M, BLOCK_D)
            lse = tl.load(lse_ptr + hq * Tq + i, mask=i_ok, other=0.0) * 1.4426950408889634
            s = tl.dot(q, kt.to(q.dtype), input_precision=PREC) * (sm_scale * 1.4426950408889634)
            vis = i_ok[:, None] & n_ok[None, :] & (n[None, :] <= off + i[:, None])
            p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
            acc += tl.sum(p, 0)
        if PER_HEAD:
            tl.store(col_ptr + hq * T + n, acc, mask=n_ok)
        else:
            total += acc
    if not PER_HEAD:
        tl.store(col_ptr + h * T + n, total, mask=n_ok)
