"""KNorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"): each KV head keeps the keys with the lowest L2 norm at the end of the prefill
(spec: docs/methods/knorm.md)."""

from __future__ import annotations

from ..spec import Method, Option, adaptive


class KNorm(Method):
    name = "knorm"
    summary = "KNorm: the keys with the lowest L2 norm, per KV head, at the end of the prefill"
    axes = ("key norm", "top-k + window", "uniform", "dense")
    runs_at = "prefill-end"
    window = Option(0, "newest tokens always kept", lo=0)
    scope, alpha, critical = adaptive()
    points = frozenset({"prefill"})

    @property
    def newest(self) -> int:
        return self.window

    def score(self, ctx):
        """Low-norm keys draw high attention: the negated L2 norm of each held key (RoPE rotates
        pairs of dimensions, so the post-RoPE norm is the key's own)."""
        return -ctx.keys.float().norm(dim=-1)  # (Hkv, T)
