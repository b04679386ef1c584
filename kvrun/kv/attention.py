"""Dense attention over one segment of keys, masked by the tokens' original positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None
) -> torch.Tensor | None:
    """Boolean (Tq, Tk) mask: key visible when not in the future (and within a sliding window).

    None when every key is visible to every query (one decode token, no window cut).
    """
    if q_pos.numel() == 1 and (window is None or int(q_pos[0] - k_pos.min()) < window):
        if int(k_pos.max()) <= int(q_pos[0]):
            return None
    diff = q_pos[:, None] - k_pos[None, :]  # (Tq, Tk)
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def dense_attention(
    q: torch.Tensor,  # (B, Hq, Tq, D) post-RoPE
    k: torch.Tensor,  # (B, Hkv, Tk, D) post-RoPE
    v: torch.Tensor,  # (B, Hkv, Tk, D)
    q_pos: torch.Tensor,  # (Tq,)
    k_pos: torch.Tensor,  # (Tk,)
    window: int | None = None,
) -> torch.Tensor:  # (B, Hq, Tq, D)
    """Softmax attention with GQA (query head h reads KV head h // G)."""
    mask = position_mask(q_pos, k_pos, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
