"""Head-adaptive budgets (AdaKV: scope=adaptive) and CriticalKV's refinement (critical=1), for
every scoring method the driver runs (docs/methods/adaptive.md)."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from .stores.dense import PAD, DenseSeg


def keep_adaptive(
    d: DenseSeg, scores: torch.Tensor, budget: int, alpha: float, first: int = 0, last: int = 0
) -> None:
    """AdaKV's selection (docs/methods/adaptive.md) in one layer held with a position per slot
    and head: scores (Hkv or 1, C) fp32 for the C oldest slots (the newer ones kept). Each KV
    head first keeps its floor(alpha * budget) best (the safeguard), its `first` oldest and `last`
    newest held tokens always among what it keeps; the rest of the layer's Hkv * budget slots go
    to the best (head, slot) pairs of the whole layer, raw scores compared across heads (as
    AdaKV and kvpress do). Heads then hold different counts: each is padded at its front to the
    largest, the padding zeros at position PAD (no query sees it; counted in nbytes). Ties go to
    the lower position, then the lower head."""
    Hkv, T = d.n_kv, d.length
    if scores.shape[1] < T:
        pad = scores.new_full((scores.shape[0], T - scores.shape[1]), float("inf"))
        scores = torch.cat([scores, pad], dim=1)
    pos = d.pos.long().expand(Hkv, -1)
    real = pos != PAD
    # every head in position order, its padding first: column j is the head's j-th slot
    order = torch.where(real, pos, -1).argsort(dim=1, stable=True)
    s = scores.float().expand(Hkv, -1).gather(1, order)
    r = real.gather(1, order)
    n_real = r.sum(1, keepdim=True)  # (Hkv, 1)
    rank = torch.arange(T, device=s.device)[None] - (T - n_real)  # among the head's tokens
    protect = r & ((rank < first) | (rank >= n_real - last))
    s = s.masked_fill(protect, float("inf")).masked_fill(~r, float("-inf"))
    total = min(Hkv * budget, int(n_real.sum()))
    keep = torch.zeros_like(r)
    floor = min(budget, math.floor(Fraction(str(alpha)) * budget))  # exact, as B(n) is
    if floor:
        best = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :floor]
        keep.scatter_(1, best, True)
        keep &= r
    left = total - int(keep.sum())
    if left > 0:  # slot-major: ties to the lower position, then the lower head
        flat = s.masked_fill(keep, float("-inf")).t().reshape(-1)
        pick = torch.sort(flat, descending=True, stable=True).indices[:left]
        kt = keep.t().contiguous().view(-1)
        kt[pick] = True
        keep = kt.view(T, Hkv).t()
    count = keep.sum(1)  # (Hkv,)
    S = int(count.max())
    col = torch.arange(T, device=s.device)[None].expand(Hkv, -1)
    # per head: S - count dropped slots (to become padding), then the kept in position order
    chosen = torch.where(keep, col, -1).argsort(dim=1, stable=True)[:, T - S :]
    d.keep(order.gather(1, chosen))
    padding = torch.arange(S, device=s.device)[None] < (S - count)[:, None]  # (Hkv, S)
    d.pos.masked_fill_(padding, PAD)
    d.zero(padding)
    if d.acc is not None:
        d.acc.masked_fill_(padding.repeat_interleave(len(d.acc) // Hkv, dim=0), 0)


class OutProj:
    """The model's attention output projection, lent to a cache for CriticalKV (critical=1):
    `modules(layer)` is the layer's o_proj, dense or packed; its weight per query head is read
    once per layer by projecting the identity (whatever form the module keeps it in) and
    shared by every fork of the cache."""

    shared_by_forks = True

    def __init__(self, modules, n_heads: int, head_dim: int):
        self.modules, self.n_heads, self.head_dim = modules, n_heads, head_dim
        self._w: dict[int, torch.Tensor] = {}

    def weights(self, layer: int, dtype, device) -> torch.Tensor:
        """(Hq, D, dim) fp32: W_o's block that head h's output goes through."""
        w = self._w.get(layer)
        if w is None:
            n = self.n_heads * self.head_dim
            with torch.inference_mode():
                w = self.modules(layer)(torch.eye(n, dtype=dtype, device=device)[None])[0]
            w = self._w[layer] = w.float().view(self.n_heads, self.head_dim, -1)
        return w


CRITICAL_EPS = 1e-4  # kvpress CriticalKVPress's epsilon
CRITICAL_FIRST = Fraction(1, 2)  # its first_stage_ratio: the share of B chosen by raw scores


def critical_scores(
    W: torch.Tensor, d: DenseSeg, scores: torch.Tensor, B: int, adaptive: bool
) -> torch.Tensor:
    """CriticalKV's refinement (§3; kvpress CriticalKVPress.score) of scores (Hkv or 1, C)
    for the C oldest slots: each KV head's floor(B / 2) best by the scores rank first; the
    others by (score + 1e-4) * ||W_o v||_1, the L1 norm of the slot's value through each
    query head's block of the output projection (W (Hq, D, dim), OutProj.weights), averaged
    over the group."""
    Hkv, C = d.n_kv, scores.shape[1]
    v = d.v[0, :, :C].float()  # (Hkv, C, D)
    G = W.shape[0] // Hkv
    norm = torch.stack([(v[h // G] @ W[h]).abs().sum(-1) for h in range(W.shape[0])])
    s = scores.float().expand(Hkv, -1)
    if adaptive:  # padding is no slot: never among the first stage
        s = s.masked_fill(d.pos[:, :C] == PAD, float("-inf"))
    first = math.floor(CRITICAL_FIRST * B)
    best = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :first]
    out = (s + CRITICAL_EPS) * norm.view(Hkv, G, C).mean(1)
    out = torch.where(torch.isinf(s), s, out)  # protected (inf) stays, even on a zero value
    return out.scatter(1, best, float("inf"))
