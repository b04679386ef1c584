"""The observation-window scorers and score pooling, shared by SnapKV, PyramidKV, SpindleKV
and XKV's selection (SnapKV §4.2 "voting"; SpindleKV Eq. 2 adds a length normalisation;
XKV §3.1 averages the rows: `window_attention`).

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


def qhead_scores(
    qw: torch.Tensor,  # (Hq, w, D) post-RoPE queries of the turn's last w tokens
    k: torch.Tensor,  # (Hkv, t, D) post-RoPE keys of the turn
    sliding: int | None = None,
    length_norm: bool = True,
) -> torch.Tensor:  # (Hq, t - w) fp32
    """SpindleKV's scores (Eq. 2): ac_q[a] = sum_b A_q[b, a] / (t - a) over the window rows
    b, per query head: `window_scores` with the length normalisation."""
    vote = window_scores(qw, k, sliding)
    if length_norm:
        t, n_ctx = k.shape[1], vote.shape[1]
        vote = vote / (t - torch.arange(n_ctx, device=k.device)).float()
    return vote


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


def window_attention(qw: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """XKV's window attention (§3.1): a_q[j] (Hq, T - w) fp32, the softmax of the w window
    rows over all T keys (causal inside the window), averaged over the rows, for the T - w
    context keys. One unblocked softmax, not `window_scores`' two passes: XKV's scoring pass
    and its prefill must give bit-identical scores, and its kept sets are pinned to this
    computation.

    qw (Hq, w, D) post-RoPE queries of the last w tokens; k (Hkv, T, D) post-RoPE keys, the
    last w of them the window's own. Query head q reads KV head q // G.
    """
    Hq, w, D = qw.shape
    Hkv, T, _ = k.shape
    G = Hq // Hkv
    # contiguous fp32 copies: the scoring pass and the prefill feed equal values in different
    # layouts, and the scores must come out bit-identical (plan equivalence)
    q = qw.float().contiguous().view(Hkv, G * w, D)
    kf = k.float().contiguous()
    logits = torch.bmm(q, kf.transpose(1, 2)).view(Hkv, G, w, T) / math.sqrt(D)
    rows = torch.arange(T - w, T, device=k.device)  # slot of each window row
    future = torch.arange(T, device=k.device)[None, :] > rows[:, None]  # (w, T)
    p = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    return p[..., : T - w].mean(dim=2).reshape(Hq, T - w)  # (1/ows) sum over rows
