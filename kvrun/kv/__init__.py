"""The KV layer: `check` turns --kv / --kv-budget into a validated KVSpec (once, before a model
loads); `build` makes the KV manager a spec names for a model. The methods are listed in
kvrun/kv/methods/; the manager contract is kvrun/kv/base.py.

Importing this package does not import torch (the CLI validates --kv before loading one).
"""

from __future__ import annotations

from .methods import REGISTRY
from .spec import FULL, KVSpec, check


def build(spec: KVSpec, config, rope, device, dtype, **kw):
    """The KV manager for `spec` on a model with `config` (kw: debug hooks such as on_select)."""
    if not isinstance(spec, KVSpec):
        raise TypeError(f"build takes a KVSpec from kvrun.kv.check, not {type(spec).__name__}")
    return spec.select.build(spec, config, rope, device, dtype, **kw)


__all__ = ["FULL", "REGISTRY", "KVSpec", "build", "check"]
