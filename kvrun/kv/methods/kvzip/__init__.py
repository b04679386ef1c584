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


METHOD = Method(
    "kvzip",
    "select",
    "KVzip: query-agnostic, scored by a context-reconstruction pass (prefill takes ~2x)",
    axes=("reconstruction attention", "top-k + sinks", "uniform", "dense"),
    runs_at="prefill-end, after a second pass",
    options=OPTIONS,
    protected=lambda o: o["sinks"],
    # heads=layer pads heads to the layer's largest count, masked by position: dense only
    own_store=lambda o: "padded heads; kvzip:heads=uniform stacks" * (o["heads"] == "layer"),
    points=lambda o: frozenset({"prefill"}),
    # + an int32 position per slot and head with heads=layer (the padding is masked by it)
    nbytes=composed(lambda c, o: 4 * c.n_kv_heads * (o["heads"] == "layer")),
    cache=make_cache,
)
