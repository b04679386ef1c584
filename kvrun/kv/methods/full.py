"""full: every token, uncompressed (the reference every method is measured against; spec:
docs/methods/README.md)."""

from __future__ import annotations

from ..bytes import composed
from ..spec import Method

METHOD = Method(
    "full",
    "select",
    "every token, uncompressed",
    takes_budget=False,  # a --kv-budget is ignored: nothing is selected
    default_budget=None,
    # 2 * L * Hkv * n * D * e (dense K and V of every token), or the stacked store's formula
    nbytes=composed(),
)
