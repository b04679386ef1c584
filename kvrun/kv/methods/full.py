"""full: every token, uncompressed (the reference every method is measured against)."""

from __future__ import annotations

from ..bytes import composed as composed_bytes
from ..bytes import dense, elem
from ..method import Method, composed


def build(spec, config, rope, device, dtype, **kw):
    """The plain cache; with a store stacked (`kivi2` alone) or a debug hook, the composed
    manager, whose selection then keeps everything."""
    if spec.store is None and not kw:
        from ..full import FullKV

        return FullKV(config, rope, device, dtype)
    return composed(spec, config, rope, device, dtype, **kw)


def nbytes(spec, kv) -> int:
    """2 * L * Hkv * n * D * e (dense K and V of every token), or the stacked store's formula."""
    if spec.store is not None:
        return composed_bytes()(spec, kv)
    return kv.config.n_layers * dense(kv.config, kv.seen, elem(kv))


METHOD = Method(
    "full",
    "select",
    "every token, uncompressed",
    takes_budget=False,  # a --kv-budget is ignored: nothing is selected
    default_budget=None,
    build=build,
    nbytes=nbytes,
)
