"""The KV layer: `check` turns --kv / --kv-budget into a KVSpec (once, before a model loads),
`build` makes its cache. Importing it does not import torch."""

from __future__ import annotations

from .methods import REGISTRY
from .spec import Budget, KVSpec, parse


def check(text: str, budget=None) -> KVSpec:
    """--kv (and --kv-budget) checked against the registry; errors are one-line KvrunErrors."""
    return parse(text, REGISTRY, budget)


FULL = check("full")  # the uncompressed cache (references, baselines)


def build(spec: KVSpec, config, rope, device, dtype, **kw):
    """The cache for `spec` on a model with `config` (kw: the debug hook on_select)."""
    if not isinstance(spec, KVSpec):
        raise TypeError(f"build takes a KVSpec from kvrun.kv.check, not {type(spec).__name__}")
    if spec.select.cache:
        return spec.select.make_cache(spec, config, rope, device, dtype, **kw)
    from .cache import KVCache

    return KVCache(spec, config, rope, device, dtype, **kw)


__all__ = ["FULL", "REGISTRY", "Budget", "KVSpec", "build", "check"]
