"""The KV layer: `check` turns --kv / --kv-budget into a validated KVSpec (once, before a model
loads); `build` makes the cache a spec names for a model. The methods are listed in
kvrun/kv/methods/; the contract between the model and a cache is kvrun/kv/protocol.py and the
driver every method runs under is kvrun/kv/cache.py.

Importing this package does not import torch (the CLI validates --kv before loading one).
"""

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
    if spec.select.cache is not None:
        return spec.select.cache(spec, config, rope, device, dtype, **kw)
    from .cache import KVCache

    return KVCache(spec, config, rope, device, dtype, **kw)


__all__ = ["FULL", "REGISTRY", "Budget", "KVSpec", "build", "check"]
