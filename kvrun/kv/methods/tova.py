"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): when the cache is over its
budget, keep the slots the newest query attends to most, averaged over the layer's heads; at
the end of the prefill and after every decode step (spec: docs/methods/tova.md)."""

from __future__ import annotations

from ..spec import ADAPTIVE, SCOPES, Method, adaptive


class TOVA(Method):
    name = "tova"
    summary = "TOVA: the newest query's attention, mean over heads, at prefill end and every step"
    axes = ("last query", "top-k", "uniform", "dense")
    runs_at = "prefill-end and every step"
    # layer = one kept set per layer (the paper's), head = per KV head, adaptive = AdaKV's
    scope, alpha, critical = adaptive(
        "layer", (*SCOPES, ADAPTIVE), was="heads", was_values={"kv": "head"}
    )
    newest = 1  # the newest token
    points = frozenset({"prefill", "step"})
    queries = 1

    def score(self, ctx):
        """The newest token's attention to every older slot (the newest itself is always kept,
        as kvpress does), averaged over all query heads, or over each KV head's group."""
        a = ctx.window_scores()  # (Hq, T - 1)
        if self.scope == "layer":
            return a.mean(0, keepdim=True)  # one kept set for the whole layer: the paper's rule
        return ctx.by_kv_head(a)  # the group's sum ranks as its mean (and compares across heads)

    def slot_bytes(self, config) -> int:
        """L * T * (2 * Hkv * D * e + 4 * R): int32 positions, one row (scope=layer) or Hkv."""
        return 4 * (1 if self.scope == "layer" else config.n_kv_heads)
