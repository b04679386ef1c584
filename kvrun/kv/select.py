"""Scorers and the top-k selector, GQA-native: scores are per KV head (query heads summed).

Ties rank by position ascending (baselines.md 0.7): slots are always held in position
order, so a stable descending sort over slots is that rule.
"""

from __future__ import annotations

import math

import torch

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
