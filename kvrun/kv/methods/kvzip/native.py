"""KVzip's reconstruction pass on the native CPU kernels (attn_colsum, kernels/cpu): the score's
softmax runs over the sinks, the chunk's slots and the pass's own tokens, which are keys the
pass attends to anyway. So one kernel call over those keys gives both their partial attention
and the score (each key's largest probability), and the rest of the cache, seen by every pass
row, goes through the same kernel as attention alone (native_attention: 1.1x PyTorch's flash
attention there, with its log-sum-exp); the partials are combined.
No key is scored twice."""

from __future__ import annotations

import torch

from ...attention import Partial, combine, native_attention
from ...stores.dense import DenseSeg


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
    """q (1, Hq, Tq, D) over k, v (1, Hkv, T, D), every key seen: PyTorch's CPU flash attention,
    each KV head's query heads stacked as rows of one call."""
    _, Hq, Tq, D = q.shape
    Hkv = k.shape[1]
    qs = q.reshape(1, Hkv, Hq // Hkv * Tq, D)  # (1, Hkv, G * Tq, D)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, k, v)
    return Partial(out.reshape(1, Hq, Tq, D), lse.reshape(1, Hq, Tq))


def reconstruct(ops, rec, layer: int, q, d: DenseSeg, own: DenseSeg) -> torch.Tensor:
    """Reconstruct.prefill's attention output and scores for one layer, `d` its owner's store
    (every slot seen: no padding, no window), `own` the pass's tokens so far."""
    o = rec.owner
    base = d.length - o.turn  # the turn's first slot
    a, b = base + rec.a, base + rec.b  # the chunk's slots
    s0 = min(o.opt["sinks"], rec.a)  # the turn's sinks before the chunk
    # each range's rows decoded once (--kv-dtype f16: the ranges partition the cache, so every
    # slot is decoded once per call, not the whole cache per range)
    scored = [d.rows(base, base + s0), d.rows(a, b)]
    kx = torch.cat([k for k, _ in scored] + [own.k], dim=2)
    vx = torch.cat([v for _, v in scored] + [own.v], dim=2)
    # the pass rows are the newest keys: causal by slot; mode 1: each key's largest probability
    out, lse, best = ops.attn_colsum(q, kx, vx, q.shape[-1] ** -0.5, mode=1)
    z = o.scores[layer][:, rec.a : rec.b]
    torch.maximum(z, best[:, s0 : s0 + b - a], out=z)
    parts = [Partial(out, lse)]
    for lo, hi in [(0, base), (base + s0, a), (b, d.length)]:  # the rest of the cache
        if hi > lo:
            k, v = d.rows(lo, hi)
            parts.append(native_attention(ops, q, k, v, causal=False) or flash(q, k, v))
    return combine(parts, rec.dtype)
