"""XKV (§3-4 of the paper): observation-window attention scores per layer, per-layer budgets
by a global greedy allocation (budget mode) or the fewest tokens keeping a target share of
the attention mass (target mode), planned by a scoring pass or at the end of the prefill
(spec: docs/methods/xkv.md)."""

from __future__ import annotations

from ....errors import KvrunError
from ...spec import SCOPES, Method, Option, pooling


class XKV(Method):
    """Bytes: sum_i 2 * Hkv * D * e * (n_i + ows + n_gen) (a KIVI store by its formula)."""

    name = "xkv"
    summary = "XKV: observation-window scores, per-layer budgets by global greedy allocation"
    axes = ("window", "top-k + window", "xkv", "dense")
    runs_at = "prefill-end"
    window = Option(8, "observation-window queries, always kept", lo=1)
    pool = Option("avg:7", "pooling of the scores: avg:K, max:K or none", valid=pooling)
    min_tokens = Option(-1, "per-layer floor on context tokens (-1 = the window)", lo=-1)
    plan = Option(
        "two-pass",
        "two-pass = scoring pass then evicting prefill; deferred = one prefill",
        choices=("two-pass", "deferred"),
    )
    profile = Option("", "JSON allocation profile: load it if it exists, else write it")
    profile_update = Option(False, "always plan and fold the new fractions into the profile")
    target = Option(
        0.0, "target-retention mode: keep this attention mass (0 = budget mode)", lo=0.0, hi=1.0
    )
    alloc = Option(
        "topk",
        "topk = global top-N; loop = the literal greedy (reference)",
        choices=("topk", "loop"),
    )
    scope = Option(
        "head", "head = per KV head; layer = one set per layer", choices=SCOPES, was="select"
    )
    budget_scope = Option(
        "total", "total = window tokens count toward the budget", choices=("total", "context")
    )
    profile_units = Option("fractions", "what a profile stores", choices=("fractions", "tokens"))
    points = frozenset({"prefill"})
    cache = ".cache:XKVCache"

    @property
    def queries(self) -> int:
        return self.window

    @property
    def protected(self) -> int:
        """The window plus the per-layer floor in budget mode; the floor alone in context scope."""
        floor = self.window if self.min_tokens < 0 else self.min_tokens
        return floor + (self.window if self.budget_scope == "total" else 0)

    def check(self, budget) -> None:
        if self.target > 0 and budget is not None:
            raise KvrunError(
                "xkv:target=R keeps a share of the attention mass and takes no --kv-budget; "
                "give one of them"
            )
