"""KVzip (Kim et al., 2025, "Query-Agnostic KV Cache Compression with Context Reconstruction"):
a slot scores the most attention a teacher-forced reconstruction of the turn gives it; each KV
head keeps its top-k (spec: docs/methods/kvzip.md)."""

from __future__ import annotations

from ...bytes import composed
from ...spec import Method, Option

OPTIONS = (
    Option("sinks", 4, "first tokens always kept", lo=0),
    Option("chunk", 2048, "tokens reconstructed per pass", lo=16),
    Option("heads", "uniform", "uniform = B per KV head; layer = the layer's Hkv * B to its best "
           "(head, slot) pairs", choices=("uniform", "layer")),
)  # fmt: skip


def make_cache(spec, config, rope, device, dtype, **kw):
    from .cache import KVzip

    return KVzip(spec, config, rope, device, dtype, **kw)


def own_store(o) -> str:
    """heads=layer pads heads to the layer's largest count, masked by position: dense only."""
    return (
        "padded heads masked by position; kvzip:heads=uniform stacks"
        if o["heads"] == "layer"
        else ""
    )


def positions_per_head(c, o) -> int:
    """heads=layer keeps an int32 position per slot and head (the padding is masked by it)."""
    return 4 * c.n_kv_heads if o["heads"] == "layer" else 0


METHOD = Method(
    "kvzip",
    "select",
    "KVzip: query-agnostic, scored by a context-reconstruction pass (prefill takes ~2x)",
    axes=("reconstruction attention", "top-k + sinks", "uniform", "dense"),
    runs_at="prefill-end, after a second pass",
    options=OPTIONS,
    protected=lambda o: o["sinks"],
    own_store=own_store,
    points=lambda o: frozenset({"prefill"}),
    nbytes=composed(positions_per_head),
    cache=make_cache,
)
