"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
LLM Inference in Resource-Constrained Environments"): each KV head keeps the keys least like its
mean key direction, at the end of the prefill; query-agnostic (spec: docs/methods/keydiff.md)."""

from __future__ import annotations

from ..spec import Method, Option, adaptive


class KeyDiff(Method):
    name = "keydiff"
    summary = (
        "KeyDiff: the keys least aligned with the head's mean key (cosine), at the prefill end"
    )
    axes = ("key diversity", "top-k + window", "uniform", "dense")
    runs_at = "prefill-end"
    window = Option(0, "newest tokens always kept", lo=0)
    scope, alpha, critical = adaptive()
    points = frozenset({"prefill"})

    @property
    def newest(self) -> int:
        return self.window

    def score(self, ctx):
        """-cos(k_j, anchor), the anchor the mean of the head's unit keys (§3.1; kvpress's
        KeyDiffPress): a key pointing away from what the head mostly holds is kept. Post-RoPE
        keys, as the cache holds them. Zero padding (scope=adaptive) scales the anchor only, so
        leaves every cosine as it was (the padding itself is never kept)."""
        k = ctx.keys.float()  # (Hkv, T, D)
        unit = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        anchor = unit.mean(dim=1, keepdim=True)  # (Hkv, 1, D)
        cos = (unit * anchor).sum(-1) / anchor.norm(dim=-1).clamp_min(1e-12)
        return -cos  # (Hkv, T)
