"""The observation-window scorer and score pooling, shared by SnapKV, PyramidKV, SpindleKV
and XKV's selection (SnapKV §4.2 "voting"; SpindleKV Eq. 2 adds a length normalisation).

`window_scores` is one blocked two-pass computation: each of the last w queries' softmax over
every key it sees (causal, and the model's sliding window), summed over those rows, per
query head. Two passes over key blocks (row log-sum-exp, then probabilities) keep the
scratch at O(Hq * T) instead of an (Hq, w, T) matrix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

KEY_BLOCK = 2048  # keys per block when scoring


def window_scores(
    qw: torch.Tensor,  # (Hq, w, D) post-RoPE queries of the last w slots
    k: torch.Tensor,  # (Hkv, T, D) post-RoPE keys, the last w of them the window's own
    sliding: int | None = None,  # the model's sliding window: keys it cannot see score 0
) -> torch.Tensor:  # (Hq, T - w) fp32
    """sum over the window rows of each query head's attention to the T - w earlier keys.
    Query head q reads KV head q // (Hq / Hkv)."""
    Hq, w, D = qw.shape
    Hkv, T, _ = k.shape
    g = Hq // Hkv
    n_ctx = T - w
    q = qw.float().view(Hkv, g, w, D) / math.sqrt(D)
    rows = torch.arange(T - w, T, device=k.device)  # slot of each window row

    def block(s: int, e: int) -> torch.Tensor:  # (Hkv, g, w, e - s) masked logits
        sc = torch.einsum("hgwd,htd->hgwt", q, k[:, s:e].float())
        diff = rows[:, None] - torch.arange(s, e, device=k.device)[None, :]
        vis = diff >= 0
        if sliding:
            vis &= diff < sliding
        return sc.masked_fill(~vis, float("-inf"))

    lse = torch.full((Hkv, g, w), float("-inf"), device=k.device)
    for s in range(0, T, KEY_BLOCK):
        lse = torch.logaddexp(lse, torch.logsumexp(block(s, min(s + KEY_BLOCK, T)), -1))
    vote = torch.empty(Hkv, g, n_ctx, device=k.device)
    for s in range(0, n_ctx, KEY_BLOCK):
        e = min(s + KEY_BLOCK, n_ctx)
        vote[..., s:e] = torch.exp(block(s, e) - lse[..., None]).sum(2)
    return vote.view(Hq, n_ctx)


def pool(x: torch.Tensor, kind: str, kernel: int) -> torch.Tensor:
    """Pool each row of x (R, C) along C with stride 1 and same padding: 'max', 'avg' (the
    zero pads count, torch's default, so index j still means token j) or 'none'."""
    if kind == "none" or x.shape[-1] == 0:
        return x
    fn = F.max_pool1d if kind == "max" else F.avg_pool1d
    return fn(x.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)


def pool_scores(x: torch.Tensor, text: str) -> torch.Tensor:
    """`pool` from its option text: none, avg:K or max:K (validated by options.pooling)."""
    kind, _, k = text.partition(":")
    return pool(x, kind, int(k) if k else 1)
