"""Decode attention over one dense segment, GQA-native, with log-sum-exp (and optional probs).

A few new queries (Tq <= ~8) attend over T cached keys. One Triton program serves all g
query heads of one KV head, so each K/V tile is read once per group, and the context is
split over programs (one per batch, KV head and split of keys, "split-K"); the splits'
partial (out, lse) are merged exactly by log-sum-exp in a second small kernel.
"""

from __future__ import annotations

import importlib
import math

import torch

from .dispatch import HAVE_TRITON, jit, next_pow2, use_triton

# the kernels below need triton.language as a module global; the references need no triton
tl = importlib.import_module("triton.language") if HAVE_TRITON else None

BLOCK_N = 64  # keys per tile
MAX_ROWS = 128  # g * Tq query rows per program: the kernel is for decode, not prefill
MIN_SPLIT, MAX_SPLIT = 256, 2048  # keys per split-K program


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    """(Hkv, group g, T) after checking the GQA layout of q (B,Hq,Tq,D), k, v (B,Hkv,T,D)."""
    B, Hq, _, D = q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"dense_decode: k {tuple(k.shape)} / v {tuple(v.shape)} vs q {tuple(q.shape)}"
        )
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"dense_decode: {Hq} query heads not a multiple of {Hkv} KV heads")
    return Hkv, Hq // Hkv, k.shape[2]


def dense_decode_ref(
    q: torch.Tensor,  # (B, Hq, Tq, D)
    k: torch.Tensor,  # (B, Hkv, T, D)
    v: torch.Tensor,  # (B, Hkv, T, D)
    lengths: torch.Tensor | None = None,  # (B,) int32: keys at or beyond are ignored
    return_probs: bool = False,
    causal_offset: int | None = None,  # query i sees keys t <= causal_offset + i; None = all
) -> tuple[torch.Tensor, ...]:  # out (B,Hq,Tq,D) fp32, lse (B,Hq,Tq) fp32[, probs (B,Hq,Tq,T)]
    """Attention of q over one dense segment in fp32 torch, with the log-sum-exp of each row.

    Rows that see no key get out 0 and lse -inf (the empty-segment convention of Partial).
    """
    B, Hq, Tq, D = q.shape
    Hkv, g, T = _check(q, k, v)
    qg = q.float().reshape(B, Hkv, g, Tq, D)
    s = torch.einsum("bhgqd,bhtd->bhgqt", qg, k.float()) / math.sqrt(D)  # (B, Hkv, g, Tq, T)
    t = torch.arange(T, device=q.device)
    vis = torch.ones(B, Tq, T, dtype=torch.bool, device=q.device)
    vf = v.float()
    if lengths is not None:
        held = t[None, :] < lengths.to(q.device).long()[:, None]  # (B, T)
        vis &= held[:, None, :]
        # keys past a length may be never-written memory (a static cache's spare room): even
        # NaN there must not reach the output through 0 * NaN
        vf = vf.masked_fill(~held[:, None, :, None], 0.0)
    if causal_offset is not None:
        vis &= t[None, :] <= causal_offset + torch.arange(Tq, device=q.device)[:, None]
    s = s.masked_fill(~vis[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, g, Tq); -inf for an empty row
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # (B, Hkv, g, Tq, T)
    out = torch.einsum("bhgqt,bhtd->bhgqd", p, vf)
    res = (out.reshape(B, Hq, Tq, D), lse.reshape(B, Hq, Tq))
    return (*res, p.reshape(B, Hq, Tq, T)) if return_probs else res


def split_size(T: int, programs: int, device: torch.device, block: int = BLOCK_N) -> int:
    """Keys per split-K program: enough programs to fill the GPU (~4 per SM), 256-2048 keys."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 1
    )
    n_split = max(1, -(-4 * sms // programs))
    size = -(-T // n_split)
    size = min(max(size, MIN_SPLIT), MAX_SPLIT)
    return -(-size // block) * block


def empty_partial(B: int, Hq: int, Tq: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(out 0 (B, Hq, Tq, D), lse -inf (B, Hq, Tq)), fp32: a segment no query sees a key of."""
    out = torch.zeros(B, Hq, Tq, D, device=device, dtype=torch.float32)
    return out, torch.full((B, Hq, Tq), float("-inf"), device=device, dtype=torch.float32)


def check_tiles(name: str, g: int, Tq: int, block_n: int) -> None:
    """The limits every split-K decode kernel shares: query rows per program, tile size."""
    if g * Tq > MAX_ROWS:
        raise ValueError(f"{name}: {g} x {Tq} query rows per KV head exceed {MAX_ROWS}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{name}: block_n {block_n} must be a power of two >= 16")


def split_partials(
    name: str, T: int, programs: int, R: int, D: int, device, block_n: int, split: int | None
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(keys per split, po (S, R, D), pl (S, R)): the split-K partial buffers, fp32, that a
    decode kernel fills (store_partial) and combine_splits merges; S = po.shape[0]."""
    split = split or split_size(T, programs, device, block_n)
    if split % block_n:
        raise ValueError(f"{name}: split {split} is not a multiple of {block_n}")
    n_split = -(-T // split)
    po = torch.empty(n_split, R, D, device=device, dtype=torch.float32)
    return split, po, torch.empty(n_split, R, device=device, dtype=torch.float32)


def combine_splits(po: torch.Tensor, pl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LSE merge of split partials po (S, R, D), pl (S, R) -> out (R, D), lse (R,) fp32."""
    S, R, D = po.shape
    if S == 1:
        return po[0], pl[0]
    out = torch.empty(R, D, device=po.device, dtype=torch.float32)
    lse = torch.empty(R, device=po.device, dtype=torch.float32)
    _combine_kernel[(R,)](po, pl, out, lse, S, R, D, BLOCK_S=next_pow2(S), BLOCK_D=next_pow2(D))
    return out, lse


def dense_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor | None = None,
    return_probs: bool = False,
    causal_offset: int | None = None,
    *,
    split: int | None = None,  # keys per split (a multiple of block_n); None = by GPU size
    block_n: int = BLOCK_N,  # keys per tile (tuning)
    num_warps: int = 4,
) -> tuple[torch.Tensor, ...]:
    """Triton twin of `dense_decode_ref` (same arguments and results; keywords tune it)."""
    B, Hq, Tq, D = q.shape
    Hkv, g, T = _check(q, k, v)
    check_tiles("dense_decode", g, Tq, block_n)
    dev = q.device
    q = q.to(k.dtype)  # one dot dtype (q is tiny)
    probs = None
    if return_probs:
        probs = torch.full((B, Hq, Tq, T), float("-inf"), device=dev, dtype=torch.float32)
    if T == 0 or B * Hq * Tq == 0:
        out, lse = empty_partial(B, Hq, Tq, D, dev)
        return (out, lse, probs) if return_probs else (out, lse)
    R = B * Hq * Tq  # partial rows as (B, Hq, Tq)
    split, po, pl = split_partials("dense_decode", T, B * Hkv, R, D, dev, block_n, split)
    if lengths is not None:
        lengths = lengths.to(device=dev, dtype=torch.int32)
    s_arg = probs if probs is not None else po  # a dummy pointer when no probs are written
    _dense_decode_kernel[(B * Hkv, po.shape[0])](
        q, k, v, lengths if lengths is not None else pl, po, pl, s_arg,
        *q.stride(), *k.stride(), *v.stride(), *(probs.stride() if probs is not None else (0,) * 4),
        Hkv, Tq, T, D, R, split, causal_offset or 0, 1.0 / math.sqrt(D),
        G=g, HAS_LEN=lengths is not None, CAUSAL=causal_offset is not None,
        WRITE_S=probs is not None, BLOCK_M=max(16, next_pow2(g * Tq)), BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(D)), PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )  # fmt: skip
    out, lse = combine_splits(po, pl)
    out, lse = out.view(B, Hq, Tq, D), lse.view(B, Hq, Tq)
    if probs is None:
        return out, lse
    probs.sub_(lse.unsqueeze(-1)).exp_().nan_to_num_(0.0)  # scores -> softmax (0 where empty)
    return out, lse, probs


def dense_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor | None = None,
    return_probs: bool = False,
    causal_offset: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Dispatcher: Triton on CUDA tensors (when triton imports) for up to MAX_ROWS query rows
    per KV head, else the torch reference."""
    rows = q.shape[1] // max(k.shape[1], 1) * q.shape[2]
    fn = dense_decode_triton if rows <= MAX_ROWS and use_triton(q, k, v) else dense_decode_ref
    return fn(q, k, v, lengths, return_probs, causal_offset)


# ------------------------------------------------------------------------------- kernels
# Shared by every attention kernel here (inlined where called): the online-softmax update of
# one tile, and the store of a split's normalised partial.
@jit
def online_step(s, m_i, l_i):
    """Scores s (BLOCK_M, BLOCK_N) in log2 units into the running max m_i and sum l_i (finite
    initial max: no nan): (p, alpha, m_new, l_new), acc then scales by alpha and adds p @ V."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@jit
def store_partial(po_ptr, pl_ptr, sp, R, D, row, row_ok, d, d_ok, acc, l_i, m_i):
    """Split sp's normalised output into po (S, R, D) and its lse (natural log) into pl (S, R)
    at flat rows `row`; a row that saw no key stores out 0, lse -inf."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(pl_ptr + sp * R + row, lse, mask=row_ok)
    tl.store(
        po_ptr + (sp * R + row)[:, None] * D + d[None, :],
        out,
        mask=row_ok[:, None] & d_ok[None, :],
    )


@jit
def _dense_decode_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, po_ptr, pl_ptr, s_ptr,
    sqb, sqh, sqt, sqd,
    skb, skh, skt, skd,
    svb, svh, svt, svd,
    ssb, ssh, sst, ssn,
    Hkv, Tq, T, D, R, split, causal_off, sm_scale,
    G: tl.constexpr, HAS_LEN: tl.constexpr, CAUSAL: tl.constexpr, WRITE_S: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One (batch, KV head, split): the G*Tq query rows of the group against the split's keys.

    Row m is query head h*G + m // Tq, query m % Tq. Writes the split's normalised output and
    lse (natural log) into po (S, B*Hq*Tq, D), pl (S, B*Hq*Tq); scores into s when WRITE_S.
    """
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = (pid // Hkv).to(tl.int64)
    h = (pid % Hkv).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    row_ok = m < G * Tq
    hq = h * G + m // Tq  # (BLOCK_M,) query head of each row
    qi = m % Tq  # (BLOCK_M,) query index of each row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        q_ptr + b * sqb + hq[:, None] * sqh + qi[:, None] * sqt + d[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    n_keys = T
    if HAS_LEN:
        n_keys = tl.minimum(tl.load(len_ptr + b), T)
    lo = sp * split
    hi = tl.minimum(lo + split, n_keys)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # running max, log2 units (finite: no nan)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kt = tl.load(
            k_base + n[None, :] * skt + d[:, None] * skd,
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, kt.to(q.dtype), input_precision=PREC) * sm_scale  # (BLOCK_M, BLOCK_N)
        vis = n_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            vis = vis & (n[None, :] <= causal_off + qi[:, None])
        s = tl.where(vis, s, float("-inf"))
        if WRITE_S:
            tl.store(
                s_ptr + b * ssb + hq[:, None] * ssh + qi[:, None] * sst + n[None, :] * ssn,
                s,
                mask=row_ok[:, None] & n_ok[None, :],
            )
        s = s * 1.4426950408889634  # log2(e): exp2 below
        p, alpha, m_new, l_i = online_step(s, m_i, l_i)
        vt = tl.load(
            v_base + n[:, None] * svt + d[None, :] * svd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        m_i = m_new
    row = (b * Hkv * G + hq) * Tq + qi  # (BLOCK_M,) flat (b, hq, qi)
    store_partial(po_ptr, pl_ptr, sp, R, D, row, row_ok, d, d_ok, acc, l_i, m_i)


@jit
def _combine_kernel(
    po_ptr, pl_ptr, out_ptr, lse_ptr, S, R, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Row r: lse = logsumexp_s pl[s, r], out = sum_s exp(pl[s, r] - lse) po[s, r] (fixed order)."""
    r = tl.program_id(0).to(tl.int64)
    si = tl.arange(0, BLOCK_S)
    ls = tl.load(pl_ptr + si * R + r, mask=si < S, other=float("-inf"))
    mx = tl.max(ls, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # every split empty: weights all 0
    tot = tl.sum(tl.exp(ls - mx), 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, S):
        w = tl.exp(tl.load(pl_ptr + s * R + r) - mx)
        acc += w * tl.load(po_ptr + (s * R + r) * D + d, mask=d_ok, other=0.0)
    seen = tot > 0
    tot_safe = tl.where(seen, tot, 1.0)
    tl.store(out_ptr + r * D + d, tl.where(seen, acc / tot_safe, 0.0), mask=d_ok)
    tl.store(lse_ptr + r, tl.where(seen, mx + tl.log(tot_safe), float("-inf")))
