"""SnapKV (Li et al., 2024, §4): the last `window` prompt queries vote for earlier tokens,
votes are pooled, and each KV head keeps its top-k plus the window at the end of the prefill
(spec: docs/methods/snapkv.md)."""

from __future__ import annotations

from ..bytes import composed
from ..spec import SNAP, Method


def score(ctx):
    """Ctx.window_votes (§4.2); the window itself is kept."""
    return ctx.window_votes(ctx.opt["pool"], ctx.opt["kernel"])


METHOD = Method(
    "snapkv",
    "select",
    "SnapKV: observation-window votes, max-pooled, top-k per KV head",
    axes=("window", "top-k + window", "uniform", "dense"),
    runs_at="prefill-end",
    options=SNAP,
    protected=lambda o: o["window"],
    score=score,
    points=lambda o: frozenset({"prefill", "chunk"} if o["chunked"] else {"prefill"}),
    queries=lambda o: o["window"],
    nbytes=composed(),  # sum_l 2 * Hkv * T_l * D * e (a stacked KIVI store by its formula)
)
