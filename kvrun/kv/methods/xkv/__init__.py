"""XKV (§3-4 of the paper): observation-window attention scores per layer, per-layer budgets
by a global greedy allocation (budget mode) or the fewest tokens keeping a target share of
the attention mass (target mode), planned by a scoring pass or at the end of the prefill
(spec: docs/methods/xkv.md)."""

from __future__ import annotations

from ....errors import KvrunError
from ...bytes import composed
from ...spec import Method, Option, pooling

OPTIONS = (
    Option("window", 8, "observation-window queries, always kept", lo=1),
    Option("pool", "avg:7", "pooling of the scores: avg:K, max:K or none", valid=pooling),
    Option("min_tokens", -1, "per-layer floor on context tokens (-1 = the window)", lo=-1),
    Option("plan", "two-pass", "two-pass = scoring pass then evicting prefill; deferred = one prefill",
           choices=("two-pass", "deferred")),
    Option("profile", "", "JSON allocation profile: load it if it exists, else write it"),
    Option("profile_update", False, "always plan and fold the new fractions into the profile"),
    Option("target", 0.0, "target-retention mode: keep this attention mass (0 = budget mode)",
           lo=0.0, hi=1.0),
    Option("alloc", "topk", "topk = global top-N; loop = the literal greedy (reference)",
           choices=("topk", "loop")),
    Option("select", "head", "head = per KV head; layer = one set per layer", choices=("head", "layer")),
    Option("budget_scope", "total", "total = window tokens count toward the budget",
           choices=("total", "context")),
    Option("profile_units", "fractions", "what a profile stores", choices=("fractions", "tokens")),
)  # fmt: skip


def protected(o) -> int:
    """The window plus the per-layer floor in budget mode; the floor alone in context scope."""
    floor = o["window"] if o["min_tokens"] < 0 else o["min_tokens"]
    return floor + (o["window"] if o["budget_scope"] == "total" else 0)


def rule(o, budget) -> None:
    if o["target"] > 0 and budget is not None:
        raise KvrunError(
            "xkv:target=R keeps a share of the attention mass and takes no --kv-budget; "
            "give one of them"
        )


def make_cache(spec, config, rope, device, dtype, **kw):
    from .cache import XKV

    return XKV(spec, config, rope, device, dtype, **kw)


METHOD = Method(
    "xkv",
    "select",
    "XKV: observation-window scores, per-layer budgets by global greedy allocation",
    axes=("window", "top-k + window", "xkv", "dense"),
    runs_at="prefill-end",
    options=OPTIONS,
    protected=protected,
    rule=rule,
    points=lambda o: frozenset({"prefill"}),
    queries=lambda o: o["window"],
    nbytes=composed(),  # sum_i 2 * Hkv * D * e * (n_i + ows + n_gen) (a KIVI store by its formula)
    cache=make_cache,
)
