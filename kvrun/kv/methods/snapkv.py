"""SnapKV (Li et al., 2024, §4): the last `window` prompt queries vote for earlier tokens,
votes are pooled, and each KV head keeps its top-k plus the window at the end of the prefill
(spec: docs/methods/snapkv.md)."""

from __future__ import annotations

from ..spec import ObservationWindow


class SnapKV(ObservationWindow):
    """The window's votes (ObservationWindow.score); bytes: sum_l 2 * Hkv * T_l * D * e (a
    stacked KIVI store by its formula)."""

    name = "snapkv"
    summary = "SnapKV: observation-window votes, max-pooled, top-k per KV head"
    axes = ("window", "top-k + window", "uniform", "dense")
    runs_at = "prefill-end"
