"""XKV's allocation (§3.2): context tokens per layer from per-layer-normalised window scores,
by a global top-N over all layers (budget mode) or the fewest tokens that keep a target share
of the attention mass (target mode), each layer above a floor."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...spec import Budget
from ...state import Int, ListOf, Str, state


def _ranked(p: list[torch.Tensor], floor: int) -> tuple[list[torch.Tensor], list[int]]:
    """Each layer's p in rank order (score descending, position ascending) and its floor."""
    vals = [torch.sort(x.detach().float().cpu(), descending=True, stable=True).values for x in p]
    return vals, [min(floor, v.numel()) for v in vals]


def _candidates(vals: list[torch.Tensor], f: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-floor entries of all layers in global order: p descending, then lower layer,
    then higher rank (a stable sort over entries listed layer by layer, rank by rank)."""
    cand = torch.cat([v[fi:] for v, fi in zip(vals, f, strict=True)])
    layer = torch.cat(
        [torch.full((v.numel() - fi,), i) for i, (v, fi) in enumerate(zip(vals, f, strict=True))]
    )
    order = torch.sort(cand, descending=True, stable=True).indices
    return cand[order], layer[order]


def _greedy(vals, f, steps: int | None, target: float | None) -> list[int]:
    """Alg. 1 corrected: start at the floors; a wait list holds each layer's next entry (-inf
    once exhausted); take the largest (ties: lower layer) until `steps` are taken or the mean
    retained mass reaches `target`."""
    lists = [v.tolist() for v in vals]
    L, n = len(lists), list(f)
    mass = 0.0
    for v, fi in zip(lists, f, strict=True):
        for x in v[:fi]:
            mass += x
    wait = [v[fi] if fi < len(v) else -math.inf for v, fi in zip(lists, f, strict=True)]
    taken = 0
    while True:
        if (steps is not None and taken == steps) or (target is not None and mass / L >= target):
            break
        best = max(range(L), key=lambda i: (wait[i], -i))
        if wait[best] == -math.inf:
            break  # every layer exhausted
        mass += wait[best]
        n[best] += 1
        taken += 1
        wait[best] = lists[best][n[best]] if n[best] < len(lists[best]) else -math.inf
    return n


def allocate_budget(
    p: list[torch.Tensor], n_ctx: int, floor: int, alloc: str = "topk"
) -> list[int]:
    """Budget mode (Eqs. 17-18): n_i maximising the mean retained mass of p (C_i,), summing to n_ctx
    clamped to [sum f_i, sum C_i], f_i = min(floor, C_i); an exact global top-N (alloc="loop":
    the literal greedy, the reference)."""
    vals, f = _ranked(p, floor)
    C = [v.numel() for v in vals]
    extra = max(sum(f), min(n_ctx, sum(C))) - sum(f)
    if alloc == "loop":
        return _greedy(vals, f, extra, None)
    _, layer = _candidates(vals, f)
    counts = torch.bincount(layer[:extra], minlength=len(p)).tolist()
    return [fi + c for fi, c in zip(f, counts, strict=True)]


def allocate_target(
    p: list[torch.Tensor], target: float, floor: int, alloc: str = "topk"
) -> list[int]:
    """Target mode: from the floors, add entries in global descending p until the mean
    retained mass (1/L) sum_i sum_{top n_i} p_i reaches `target` (everything if it never does)."""
    vals, f = _ranked(p, floor)
    if alloc == "loop":
        return _greedy(vals, f, None, target)
    L = len(p)
    base = 0.0  # the floors' mass, summed in the same order as the greedy loop
    for v, fi in zip(vals, f, strict=True):
        for x in v[:fi].tolist():
            base += x
    cand, layer = _candidates(vals, f)
    mass = torch.cat([torch.tensor([base], dtype=torch.float64), cand.double()]).cumsum(0)
    reached = (mass / L >= target).nonzero()
    m = int(reached[0]) if reached.numel() else cand.numel()
    counts = torch.bincount(layer[:m], minlength=L).tolist()
    return [fi + c for fi, c in zip(f, counts, strict=True)]


def context_budget(
    budget: Budget, n: int, n_layers: int, window: int, rows: int, floor: int, scope: str
) -> int:
    """N, the context tokens to distribute: L*B(n) - L*ows with the window counted in the
    budget (scope total; P = window + floor), or L*B(n) of context alone (scope context)."""
    if scope == "total":
        return n_layers * budget.tokens(n, window + floor) - n_layers * rows
    return n_layers * budget.tokens(n, floor)


def normalise(w: torch.Tensor) -> torch.Tensor:
    """p_i = w_i / sum_j w_i[j] (zeros stay zeros)."""
    total = w.sum()
    return w / total if float(total) > 0 else torch.zeros_like(w)


@state(
    complete=True,
    n=ListOf(Int(0, "T"), "L", exactly=True),
    t=Int(0, "T"),
    window=Int(0, "T"),
    source=Str("two-pass", "deferred", "profile"),
)
@dataclass(slots=True)
class Allocation:
    """Per-layer budgets of one prefill: n[i] context tokens plus `window` window tokens."""

    n: list[int]
    t: int  # tokens (slots) it was made for
    window: int  # observation-window tokens kept on top of n[i] in every layer
    source: str  # "two-pass" | "deferred" | "profile"
