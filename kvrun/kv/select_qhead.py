"""Per-query-head selection stored once per KV head (SpindleKV §3.3, Eq. 7):
each query head keeps its own top-k, the KV head stores the union of its group's picks once,
and a keep mask per slot (one bit per query head) restores each head's own set at attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .select import keep_indices


def select_keep(scores: torch.Tensor, k: int, t: int, n_kv: int, gqa: str) -> torch.Tensor:
    """Keep bits (Hkv, g, t): per query head the top k of scores (Hq, t - w), ties to the lower
    position, plus the window; gqa=mean picks once per KV head on the group-mean score."""
    Hq, n_ctx = scores.shape
    g = Hq // n_kv
    if gqa == "mean":
        top = keep_indices(scores.view(n_kv, g, n_ctx).mean(1), None, k).repeat_interleave(g, 0)
    else:
        top = keep_indices(scores, None, k)  # (Hq, k)
    keep = torch.zeros(Hq, t, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, top, True)
    keep[:, n_ctx:] = True
    return keep.view(n_kv, g, t)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., g) bool -> (..., ceil(g/8)) uint8, bit j of byte j // 8 = query head j."""
    g = bits.shape[-1]
    out = torch.zeros(*bits.shape[:-1], -(-g // 8), dtype=torch.uint8, device=bits.device)
    for j in range(g):
        out[..., j // 8] |= bits[..., j].to(torch.uint8) << (j % 8)
    return out


def unpack_bits(mask: torch.Tensor, g: int) -> torch.Tensor:
    """(..., ceil(g/8)) uint8 -> (..., g) bool."""
    j = torch.arange(g, device=mask.device)
    return ((mask[..., j // 8] >> (j % 8).to(torch.uint8)) & 1).bool()


@dataclass
class Slots:
    """A KV-head-major slot layout: each head's union in position order, padded to S."""

    rel: torch.Tensor  # (Hkv, S) int64 token index within the turn; 0 on padding
    valid: torch.Tensor  # (Hkv, S) bool; False on padding
    mask: torch.Tensor  # (Hkv, S, ceil(g/8)) uint8 keep bits; 0 on padding


def union_slots(keep: torch.Tensor) -> Slots:
    """Union over the group of keep bits (Hkv, g, t): each kept token once, with its g bits."""
    Hkv, g, t = keep.shape
    union = keep.any(1)  # (Hkv, t)
    count = union.sum(1)  # (Hkv,)
    S = int(count.max()) if t else 0
    # a stable sort puts each head's kept tokens first, in position order
    order = torch.sort((~union).to(torch.int8), dim=1, stable=True).indices[:, :S]  # (Hkv, S)
    valid = torch.arange(S, device=keep.device)[None, :] < count[:, None]
    rel = torch.where(valid, order, 0)
    bits = keep.gather(2, rel[:, None, :].expand(Hkv, g, S)) & valid[:, None, :]  # (Hkv, g, S)
    return Slots(rel, valid, pack_bits(bits.transpose(1, 2)))
