"""SnapKV (Li et al., 2024, §4): the last `window` prompt queries vote for earlier tokens,
votes are pooled, and each KV head keeps its top-k plus the window at the end of the prefill."""

from __future__ import annotations

from ..bytes import composed
from ..method import Method, Scorer, Selector
from ..options import SNAP

METHOD = Method(
    "snapkv",
    "select",
    "SnapKV: observation-window votes, max-pooled, top-k per KV head",
    scorer=Scorer.WINDOW,
    selector=Selector.TOPK_WINDOW,
    when="prefill-end",
    options=SNAP,
    protected=lambda o: o["window"],
    nbytes=composed(),  # sum_l 2 * Hkv * T_l * D * e (a stacked KIVI store by its formula)
)
