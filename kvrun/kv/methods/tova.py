"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): when the cache is over its
budget, keep the slots the newest query attends to most, averaged over the layer's heads; at
the end of the prefill and after every decode step (spec: docs/methods/tova.md)."""

from __future__ import annotations

from ..bytes import composed
from ..spec import Method, Option


def score(ctx):
    """The newest token's attention to every older slot (the newest itself is always kept,
    as kvpress does), averaged over all query heads, or over each KV head's group."""
    a = ctx.window_scores()  # (Hq, T - 1)
    if ctx.opt["heads"] == "layer":
        return a.mean(0, keepdim=True)  # one kept set for the whole layer: the paper's rule
    return ctx.by_kv_head(a)  # the group's sum ranks as its mean


METHOD = Method(
    "tova",
    "select",
    "TOVA: the newest query's attention, mean over heads, at prefill end and every step",
    axes=("last query", "top-k", "uniform", "dense"),
    runs_at="prefill-end and every step",
    options=(
        Option(
            "heads",
            "layer",
            "layer = one kept set per layer (paper); kv = per KV head",
            choices=("layer", "kv"),
        ),
    ),  # fmt: skip
    protected=lambda o: 1,  # the newest token
    score=score,
    points=lambda o: frozenset({"prefill", "step"}),
    queries=lambda o: 1,
    per_layer=lambda o: o["heads"] == "layer",
    # L * T * (2 * Hkv * D * e + 4 * R): int32 positions, one row (heads=layer) or Hkv rows
    nbytes=composed(lambda c, o: 4 * (1 if o["heads"] == "layer" else c.n_kv_heads)),
)
