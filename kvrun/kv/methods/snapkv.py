"""SnapKV (Li et al., 2024, §4): the last `window` prompt queries vote for earlier tokens,
votes are pooled, and each KV head keeps its top-k plus the window at the end of the prefill
(spec: docs/methods/snapkv.md)."""

from __future__ import annotations

from ..spec import Method, Option, adaptive


class SnapKV(Method):
    """The observation window's votes, pooled per query head and summed per KV head; the
    window itself is kept. Bytes: sum_l 2 * Hkv * T_l * D * e (a stacked KIVI store by its
    formula). PyramidKV is this selection with its own layer budgets."""

    name = "snapkv"
    summary = "SnapKV: observation-window votes, max-pooled, top-k per KV head"
    axes = ("window", "top-k + window", "uniform", "dense")
    runs_at = "prefill-end"
    window = Option(32, "observation window: the last w prompt queries vote", lo=1)
    kernel = Option(7, "pooling kernel over the votes", lo=1, odd=True)
    pool = Option("max", "pooling", choices=("max", "avg"))
    chunked = Option(False, "also compress after every prefill chunk (bounded peak memory)")
    scope, alpha, critical = adaptive()

    @property
    def points(self) -> frozenset[str]:
        return frozenset({"prefill", "chunk"} if self.chunked else {"prefill"})

    @property
    def queries(self) -> int:
        return self.window

    @property
    def newest(self) -> int:
        return self.window

    def score(self, ctx):
        """Ctx.window_votes (§4.2): pooled per query head, then summed per KV head."""
        return ctx.window_votes(self.pool, self.kernel)
