"""Attention over key segments, each giving output and log-sum-exp (fp32) for `combine`, and the
scores several methods share. GQA-native throughout: query head q reads KV head q // G."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Partial:
    """One segment's attention: normalised output and log-sum-exp of its scores."""

    out: torch.Tensor  # (B, Hq, Tq, D) fp32
    lse: torch.Tensor  # (B, Hq, Tq) fp32; -inf where the segment is empty or fully masked


def position_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None
) -> torch.Tensor | None:
    """Keys visible when not in the future (and in the window): (Tq, Tk), or (Hkv, Tq, Tk) for k_pos
    (Hkv, Tk); None when every query sees every key (the common decode case)."""
    if k_pos.numel() == 0:
        return None
    lo, hi = int(k_pos.min()), int(k_pos.max())
    if hi <= int(q_pos.min()) and (window is None or int(q_pos.max()) - lo < window):
        return None
    diff = q_pos[:, None] - k_pos.unsqueeze(-2)  # (..., Tq, Tk)
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def _expand_mask(mask: torch.Tensor | None, group: int) -> torch.Tensor | None:
    if mask is None or mask.dim() == 2:
        return mask
    return mask.repeat_interleave(group, dim=0)


def by_slot(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> bool:
    """Whether queries at q_pos (Tq,) see by slot what they see by the keys' positions k_pos
    ((T,) or (rows, T)): no window, the queries' own tokens the last Tq keys at their positions
    (ascending), every older key at an earlier position. native_attention's causal by slot then
    applies, which builds no mask and compares no positions (a prefill chunk's usual case)."""
    Tq, T = q_pos.numel(), k_pos.shape[-1]
    if window is not None or Tq < 2 or Tq > T:
        return False
    own = k_pos[..., T - Tq :]
    if not torch.equal(own, q_pos.to(own.dtype).expand_as(own)):
        return False
    if not bool((q_pos[1:] > q_pos[:-1]).all()):
        return False
    return T == Tq or int(k_pos[..., : T - Tq].max()) < int(q_pos[0])


def dense_attention(
    q: torch.Tensor,  # (B, Hq, Tq, D) post-RoPE
    k: torch.Tensor,  # (B, Hkv, Tk, D) post-RoPE
    v: torch.Tensor,  # (B, Hkv, Tk, D)
    q_pos: torch.Tensor,  # (Tq,)
    k_pos: torch.Tensor,  # (Tk,) or (Hkv, Tk)
    window: int | None = None,
    kernels=None,
) -> torch.Tensor:  # (B, Hq, Tq, D)
    """Softmax attention over one segment, the fast path; on the native CPU kernels where
    `kernels` are given and apply (native_attention: causal by slot where the positions agree)."""
    if kernels is not None and q.shape[2] > 1 and by_slot(q_pos, k_pos, window):
        part = native_attention(kernels, q, k, v)
    else:
        part = native_attention(kernels, q, k, v, q_pos, k_pos, window)
    if part is not None:
        return part.out
    group = q.shape[1] // k.shape[1]
    mask = _expand_mask(position_mask(q_pos, k_pos, window), group)
    return sdpa(q, k, v, mask)


def native_attention(
    kernels,
    q: torch.Tensor,  # (1, Hq, Tq, D) post-RoPE
    k: torch.Tensor,  # (1, Hkv, T, D) post-RoPE
    v: torch.Tensor,  # (1, Hkv, T, D)
    q_pos: torch.Tensor | None = None,  # (Tq,)
    k_pos: torch.Tensor | None = None,  # (T,) or (1 or Hkv, T)
    window: int | None = None,
    causal: bool = True,
) -> Partial | None:
    """A prefill chunk's attention on the native CPU kernels (attn_colsum, attention alone):
    by positions where k_pos is given (key j seen from row i when k_pos[j] <= q_pos[i], and
    within the window), else causal by slot (q's rows are the last Tq of the T slots), or every
    key seen (causal False). None where they do not apply (no kernels: the exact path and other
    devices keep SDPA, bit for bit as before; one row: the decode kernels' case). 1.3x PyTorch's
    CPU flash attention on a causal 4k chunk (bench/prefill_attention.py)."""
    if (
        kernels is None
        or q.shape[2] < 2
        or q.shape[0] != 1
        or q.is_cuda
        or not (q.dtype == k.dtype == v.dtype == torch.float32)
        or k.stride(-1) != 1
        or v.stride(-1) != 1
    ):
        return None
    scale = q.shape[-1] ** -0.5
    if k_pos is None:
        out, lse, _ = kernels.attn_colsum(q, k, v, scale, mode=2, causal=causal)
    else:
        kp = k_pos.to(torch.int32)
        kp = kp[None] if kp.dim() == 1 else kp
        out, lse, _ = kernels.attn_colsum(q, k, v, scale, kp, q_pos, window or 0, mode=2)
    return Partial(out, lse)


def sdpa(
    q: torch.Tensor,  # (B, Hq, Tq, D)
    k: torch.Tensor,  # (B, Hkv, Tk, D)
    v: torch.Tensor,  # (B, Hkv, Tk, D)
    mask: torch.Tensor | None = None,  # broadcastable to (B, Hq, Tq, Tk), True = visible
) -> torch.Tensor:  # (B, Hq, Tq, D)
    """SDPA with GQA. One unmasked query row stacks each KV head's query heads into rows of one
    call, reading each K/V head once per group, not once per query head (enable_gqa): 0.81x the
    time at 4,000 keys, 0.71x at 8,000 on CPU (bench/attention_decode.py)."""
    B, Hq, Tq, D = q.shape
    Hkv = k.shape[1]
    if Tq == 1 and mask is None and Hq != Hkv:
        out = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, D), k, v)
        return out.view(B, Hq, 1, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def segment_attention(
    q: torch.Tensor,  # (B, Hq, Tq, D)
    k: torch.Tensor,  # (B, Hkv, Tk, D)
    v: torch.Tensor,  # (B, Hkv, Tk, D)
    mask: torch.Tensor | None = None,  # (Tq, Tk) or (Hkv, Tq, Tk) bool, True = visible
) -> Partial:
    """One segment's attention with its log-sum-exp (torch reference, fp32)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if Tk == 0:
        return Partial(
            q.new_zeros(B, Hq, Tq, D, dtype=torch.float32),
            q.new_full((B, Hq, Tq), float("-inf"), dtype=torch.float32),
        )
    g = Hq // Hkv
    qg = q.float().view(B, Hkv, g, Tq, D)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.float()) / math.sqrt(D)  # (B, Hkv, G, Tq, Tk)
    if mask is not None:
        m = mask if mask.dim() == 2 else mask[:, None]  # broadcast over the group
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Tq)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.float())
    return Partial(out.reshape(B, Hq, Tq, D), lse.reshape(B, Hq, Tq))


def combine(parts: list[Partial], dtype: torch.dtype) -> torch.Tensor:
    """Partials merged exactly (docs/methods/README.md §9): out = sum_s exp(lse_s - lse) out_s,
    one cast."""
    if len(parts) == 1:
        return parts[0].out.to(dtype)
    lse = torch.stack([p.lse for p in parts])  # (S, B, Hq, Tq)
    total = torch.logsumexp(lse, dim=0)  # (B, Hq, Tq)
    w = torch.exp(lse - total).nan_to_num(0.0)  # (S, B, Hq, Tq)
    out = sum(w[i].unsqueeze(-1) * p.out for i, p in enumerate(parts))
    return out.to(dtype)


KEY_BLOCK = 2048  # keys per block when scoring
QUERY_BLOCK = 64  # queries per block for attention with column sums


def window_scores(
    qw: torch.Tensor,  # (Hq, w, D) post-RoPE queries of the last w slots
    k: torch.Tensor,  # (Hkv, T, D) post-RoPE keys, the last w of them the window's own
    sliding: int | None = None,  # the model's sliding window: keys it cannot see score 0
    pos: torch.Tensor | None = None,  # (1 or Hkv, T) slot positions (else slot = position)
) -> torch.Tensor:  # (Hq, T - w) fp32
    """Each query head's softmax over the keys it sees, summed over the window rows, for the T - w
    older keys; two passes over key blocks keep the scratch O(Hq * T), never (Hq, w, T)."""
    Hq, w, D = qw.shape
    Hkv, T, _ = k.shape
    g = Hq // Hkv
    n_ctx = T - w
    q = qw.float().view(Hkv, g, w, D) / math.sqrt(D)
    at = torch.arange(T, device=k.device)[None] if pos is None else pos.long()  # (R, T)

    def block(s: int, e: int) -> torch.Tensor:  # (Hkv, g, w, e - s) masked logits
        sc = torch.einsum("hgwd,htd->hgwt", q, k[:, s:e].float())
        diff = (at[:, T - w :, None] - at[:, None, s:e])[:, None]  # (R, 1, w, e - s)
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


def group_sum(x: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(Hq, ...) -> (Hkv, ...), each KV head's query heads summed."""
    return x.view(n_kv_heads, x.shape[0] // n_kv_heads, *x.shape[1:]).sum(1)


def pool(x: torch.Tensor, kind: str, kernel: int) -> torch.Tensor:
    """'max', 'avg' or 'none' pooling of x (R, C) along C, stride 1, same padding (zero pads count
    for avg, torch's default, so index j still means token j)."""
    if kind == "none" or x.shape[-1] == 0:
        return x
    fn = F.max_pool1d if kind == "max" else F.avg_pool1d
    return fn(x.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)


def pool_scores(x: torch.Tensor, text: str) -> torch.Tensor:
    """`pool` from its option text: none, avg:K or max:K (validated by options.pooling)."""
    kind, _, k = text.partition(":")
    return pool(x, kind, int(k) if k else 1)


def attention_colsum(
    q: torch.Tensor,  # (1, Hq, Tq, D) post-RoPE
    k: torch.Tensor,  # (1, Hkv, T, D)
    v: torch.Tensor,  # (1, Hkv, T, D)
    mask: torch.Tensor | None,  # (Tq, T) or (Hkv, Tq, T) bool, True = visible
) -> tuple[torch.Tensor, torch.Tensor]:  # out (1, Hq, Tq, D) fp32, colsum (Hkv, T) fp32
    """Attention that also sums each key's probabilities over query heads and rows (H2O §3)."""
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
