"""full: every token, uncompressed (the reference every method is measured against; spec:
docs/methods/README.md)."""

from __future__ import annotations

from ..spec import Method


class Full(Method):
    """Every token as the driver stores it: nothing scored, nothing evicted. Bytes:
    2 * L * Hkv * n * D * e (dense K and V of every token), or the stacked store's formula."""

    name = "full"
    summary = "every token, uncompressed"
    takes_budget = False  # a --kv-budget is ignored: nothing is selected
    default_budget = None
