"""KVzip (Kim et al., 2025, "Query-Agnostic KV Cache Compression with Context Reconstruction"):
a slot scores the most attention a teacher-forced reconstruction of the turn gives it; each KV
head keeps its top-k, or each layer or the whole model its best (spec: docs/methods/kvzip.md)."""

from __future__ import annotations

from ...spec import ADAPTIVE, SCOPES, Method, Option, adaptive

# the model's L * Hkv * B slots to its best (layer, head, slot) triples: layers hold different
# counts too (kvpress's KVzipPress ranks so by default)
MODEL = "model"


class KVzip(Method):
    name = "kvzip"
    summary = "KVzip: query-agnostic, scored by a context-reconstruction pass (prefill takes ~2x)"
    axes = ("reconstruction attention", "top-k + sinks", "uniform", "dense")
    runs_at = "prefill-end, after a second pass"
    sinks = Option(4, "first tokens always kept", lo=0)
    chunk = Option(2048, "tokens reconstructed per pass", lo=16)
    # layer = the layer's Hkv * B to its best (head, slot) pairs with no floor (adaptive, alpha=0);
    # model = the model's L * Hkv * B to its best (layer, head, slot) triples (kvpress's ranking)
    scope, alpha, critical = adaptive(
        "head", (*SCOPES, ADAPTIVE, MODEL), was="heads", was_values={"uniform": "head"}
    )
    points = frozenset({"prefill"})
    cache = ".cache:KVzipCache"

    @property
    def own_store(self) -> str:
        """scope=layer and adaptive pad heads to the layer's largest count, masked by position:
        dense only."""
        return "padded heads; kvzip:scope=head stacks" if self.scope != "head" else ""
