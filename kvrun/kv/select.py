"""Scorers and the top-k selector, GQA-native: scores are per KV head (query heads summed).

Ties rank by position ascending (kvrun's rule on every path): slots are always held in position
order, so a stable descending sort over slots is that rule.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from ..kernels.colsum import colsum, colsum_ref, colsum_triton
from . import scores
from .attention import Partial

QUERY_BLOCK = 64  # queries per block for attention with column sums


def keep_indices(scores: torch.Tensor, protected: torch.Tensor | None, k: int) -> torch.Tensor:
    """Slots to keep (H, k), ascending: protected ones first, then the best scores.

    scores (H, T) fp32; protected (H, T) bool or None.
    """
    if protected is not None:
        scores = scores.masked_fill(protected, float("inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=-1).values


def evict_indices(
    pos: torch.Tensor,  # (1 or Hkv, T) int32 positions of the slots
    acc: torch.Tensor | None,  # (Hkv, T) fp32 cumulative attention (H2O), or None
    n: int,  # tokens seen
    B: int,  # slots to keep
    sinks: int,  # the first positions, always kept
    recent: float | None,  # H2O: the budget's share for the newest tokens; None: StreamingLLM
) -> torch.Tensor:
    """Decode-time eviction down to B slots: StreamingLLM (§3.2) keeps the sinks and the
    newest positions; H2O (§3) the sinks, a recent window of W = floor(recent * B) tokens
    (exact from the decimal, as B(n) is, never in floats) and the heaviest cumulative scores."""
    p = pos.long()
    protected = p < sinks
    if recent is None:
        return keep_indices(p.float(), protected, B)  # newest positions win
    W = math.floor(Fraction(str(recent)) * B)
    return keep_indices(acc, protected | (p >= n - W), B)


def heavy_recent_indices(
    acc: torch.Tensor,  # (Hkv or Hq, t) fp32 column sums over the turn's prompt queries
    heavy: int,
    recent: int,
    n_kv_heads: int,
    length_norm: bool,
) -> torch.Tensor:
    """MiniKV's selection (§3.1, once per turn): the `recent` newest tokens plus the `heavy`
    best by column sums, per KV head (Hq rows: gqa_agg=max, the best query head of each
    group); length_norm divides A[j] by the t - j queries that could see token j."""
    t = acc.shape[1]
    j = torch.arange(t, device=acc.device)
    if len(acc) != n_kv_heads:
        acc = acc.view(n_kv_heads, -1, t).amax(1)
    if length_norm:
        acc = acc / (t - j).float()
    protected = (j >= t - recent)[None].expand(n_kv_heads, t)
    return keep_indices(acc, protected, heavy + recent)


def window_indices(
    qwin: torch.Tensor,  # (Hq, w, D) post-RoPE queries of the last w slots
    k: torch.Tensor,  # (Hkv, T, D) post-RoPE keys of every slot
    keep: int,
    kernel: int,
    pool: str,
) -> torch.Tensor:
    """SnapKV / PyramidKV (§4.2): the window's own slots plus the best-voted earlier ones."""
    votes = window_votes(qwin, k, kernel, pool)
    scores = torch.cat([votes, votes.new_full((votes.shape[0], qwin.shape[1]), float("inf"))], 1)
    return keep_indices(scores, None, keep)


def group_sum(x: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(Hq, ...) -> (Hkv, ...): sum the query heads of each KV head."""
    return x.view(n_kv_heads, x.shape[0] // n_kv_heads, *x.shape[1:]).sum(1)


def window_votes(
    qw: torch.Tensor,  # (Hq, w, D) post-RoPE queries of the last w slots
    k: torch.Tensor,  # (Hkv, T, D) post-RoPE keys, the last w of them the window's own
    kernel: int,
    pool: str,
) -> torch.Tensor:  # (Hkv, T - w) fp32
    """SnapKV's votes (§4.2): window attention summed over rows, pooled per query head, then
    summed per KV head (pool first, then sum the group)."""
    return group_sum(scores.pool(scores.window_scores(qw, k), pool, kernel), k.shape[0])


def attention_colsum(
    q: torch.Tensor,  # (1, Hq, Tq, D) post-RoPE
    k: torch.Tensor,  # (1, Hkv, T, D)
    v: torch.Tensor,  # (1, Hkv, T, D)
    mask: torch.Tensor | None,  # (Tq, T) or (Hkv, Tq, T) bool, True = visible
) -> tuple[torch.Tensor, torch.Tensor]:  # out (1, Hq, Tq, D) fp32, colsum (Hkv, T) fp32
    """Attention that also sums each key's probabilities over all query heads and rows (H2O)."""
    _, Hq, Tq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    g = Hq // Hkv
    kf, vf = k[0].float(), v[0].float()
    out = torch.empty(Hkv, g, Tq, D, device=q.device)
    col = torch.zeros(Hkv, T, device=q.device)
    qg = q[0].float().view(Hkv, g, Tq, D) / math.sqrt(D)
    for s in range(0, Tq, QUERY_BLOCK):
        e = min(s + QUERY_BLOCK, Tq)
        sc = torch.einsum("hgqd,htd->hgqt", qg[:, :, s:e], kf)  # (Hkv, G, b, T)
        if mask is not None:
            m = mask[s:e] if mask.dim() == 2 else mask[:, None, s:e]
            sc = sc.masked_fill(~m, float("-inf"))
        p = torch.softmax(sc, dim=-1)
        out[:, :, s:e] = torch.einsum("hgqt,htd->hgqd", p, vf)
        col += p.sum(dim=(1, 2))
    return out.view(1, Hq, Tq, D), col


def prompt_colsum(
    q: torch.Tensor,  # (1, Hq, Tq, D) post-RoPE prompt queries
    k: torch.Tensor,  # (1, Hkv, T, D) the turn's keys so far
    v: torch.Tensor,
    older: list[Partial],  # attention over earlier turns, as stored (their LSE joins the rows')
    per_head: bool,  # column sums per query head (gqa_agg=max) or summed per KV head
    mode: str,  # colsum option: auto | chunked | dense | triton
) -> tuple[Partial, torch.Tensor]:
    """MiniKV's prompt attention with column sums (§3.1): A[j] summed over every prompt query
    of the turn, each row normalised over everything it sees (earlier turns included)."""
    if mode == "dense" and not older:
        return dense_colsum(q, k, v, per_head)
    # two launches on CUDA (Triton), blocks of 256 query rows in torch elsewhere
    fn = {"triton": colsum_triton, "chunked": colsum_ref}.get(mode, colsum)
    other = torch.logsumexp(torch.stack([p.lse for p in older]), 0) if older else None
    out, lse, col = fn(q, k, v, per_head, other)
    return Partial(out, lse[None]), col


def dense_colsum(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_head: bool = False
) -> tuple[Partial, torch.Tensor]:
    """The materialised reference of kernels.colsum (MiniKV's colsum=dense; small prompts)."""
    _, Hq, Tq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    kf = k[0].float().repeat_interleave(Hq // Hkv, dim=0)  # (Hq, T, D)
    vf = v[0].float().repeat_interleave(Hq // Hkv, dim=0)
    s = torch.einsum("hqd,htd->hqt", q[0].float(), kf) / math.sqrt(D)  # (Hq, Tq, T)
    rows = torch.arange(T - Tq, T, device=q.device)
    s = s.masked_fill(torch.arange(T, device=q.device)[None, :] > rows[:, None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("hqt,htd->hqd", p, vf)
    col = p.sum(1)  # (Hq, T)
    part = Partial(out[None], lse[None])
    return part, (col if per_head else group_sum(col, Hkv))
