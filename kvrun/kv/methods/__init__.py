"""The registry of KV methods, in `kvrun kv list` order; a new method is one module declaring a
`Method` and one line below ("Writing a KV method" in docs/)."""

from __future__ import annotations

from ..spec import Method
from . import (
    full,
    h2o,
    kivi,
    knorm,
    kvzip,
    minicache,
    minikv,
    pyramidkv,
    snapkv,
    spindlekv,
    streaming,
    tova,
    xkv,
)

REGISTRY: dict[str, Method] = {
    m.name: m
    for m in (
        full.METHOD,
        streaming.METHOD,
        h2o.METHOD,
        snapkv.METHOD,
        pyramidkv.METHOD,
        tova.METHOD,
        knorm.METHOD,
        kvzip.METHOD,
        *minikv.METHODS,
        xkv.METHOD,
        minicache.METHOD,
        spindlekv.METHOD,
        *kivi.METHODS,
    )
}
