"""The registry of KV methods: one file per method, listed here in `kvrun kv list` order.

A new method is one file declaring a `Method` (kvrun/kv/method.py) and one line below; the
grammar, `kvrun kv list`, budget checks and the contract tests (tests/test_kv_contract.py)
pick it up from here.
"""

from __future__ import annotations

from ..method import Method
from . import full, h2o, kivi, minicache, minikv, pyramidkv, snapkv, spindlekv, streaming, xkv

REGISTRY: dict[str, Method] = {
    m.name: m
    for m in (
        full.METHOD,
        streaming.METHOD,
        h2o.METHOD,
        snapkv.METHOD,
        pyramidkv.METHOD,
        *minikv.METHODS,
        xkv.METHOD,
        minicache.METHOD,
        spindlekv.METHOD,
        *kivi.METHODS,
    )
}
