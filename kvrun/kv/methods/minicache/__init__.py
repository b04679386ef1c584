"""MiniCache (Liu et al., 2024, §3): layer pairs from the middle of the model up share one
SLERP-merged direction per token, each layer keeping its own norms; the most distinct
tokens are retained unmerged. It keeps every token, so it takes no token budget
(spec: docs/methods/minicache.md)."""

from __future__ import annotations

from ....errors import KvrunError
from ...bytes import dense, elem, kivi_of
from ...spec import SCOPES, Method, Option


def check_retain(where: str, r: str) -> None:
    if r == "range":
        return
    kind, _, f = r.partition(":")
    try:
        ok = kind == "topk" and 0.0 <= float(f) <= 1.0
    except ValueError:
        ok = False
    if not ok:
        raise KvrunError(f"{where}={r} is not valid: use range or topk:F with F in 0..1")


class MiniCache(Method):
    name = "minicache"
    summary = (
        "MiniCache: cross-layer SLERP merge of layer pairs from the middle up, norms per layer"
    )
    axes = ("none", "merge layer pairs, retain distinct rows", "uniform", "merged")
    runs_at = "prefill-end; decode pairs merged"
    start = Option(-1, "first merged layer S (-1 = L//2): pairs (l-1, l), odd l >= S", lo=-1)
    slerp_t = Option(0.6, "SLERP weight of the later layer", lo=0.0, hi=1.0)
    gamma = Option(0.05, "retention threshold, a fraction of the distance range", lo=0.0, hi=1.0)
    retain_rule = Option(
        "distinct",
        "distinct = keep the most distinct; paper = as printed",
        choices=("distinct", "paper"),
    )
    retain = Option(
        "range",
        "range (gamma rule) or topk:F (a fixed fraction F of the prompt)",
        valid=check_retain,
    )
    scope = Option(
        "head",
        "norm/angle per (token, KV head), or per token for the layer",
        choices=SCOPES,
        was="granularity",
        was_values={"token": "layer"},
    )
    decode_retain = Option(False, "retain decode tokens above the prefill threshold")
    sin_eps = Option(1e-6, "SLERP to LERP fallback threshold", lo=0.0)
    store = Option(
        "fp16",
        "kivi4 = the paper's 4-bit store under the merge (= minicache+kivi4)",
        choices=("fp16", "kivi4"),
    )
    kivi_group = Option(32, "KIVI group with store=kivi4", lo=1)
    kivi_residual = Option(128, "KIVI residual with store=kivi4", lo=1)
    takes_budget = False
    budget_refused = (
        "minicache has no token budget (it merges layers, it keeps every token); drop "
        "--kv-budget, or stack a store (minicache+kivi4) for more compression"
    )
    default_budget = None
    lossless = "retain=topk:1.0,decode_retain=true"  # every token retained unmerged
    cache = ".cache:MiniCacheKV"

    @property
    def kivi(self) -> dict | None:
        if self.store != "kivi4":
            return None
        return {"bits": 4, "group": self.kivi_group, "residual": self.kivi_residual}

    def nbytes(self, kv) -> int:
        """The spec's total: unpaired layers as stored (dense K, V or KIVI); per pair and per K
        and V, E (dense, or one KIVI store for E_K and E_V), both layers' norms (g, T), the
        retained rows (an int32 index and the exact rows of both layers, m wide each) with the
        int64 group offsets, and with decode_retain the fp32 prefill threshold per group."""
        c, e, layout = kv.config, elem(kv), kv.kivi_layout  # the KIVI store of E, or None
        total = 0
        for i, st in kv.plain.items():  # a window's layers keep dense K, V under store=kivi4
            total += (
                kivi_of(c, e, layout, st) if layout and not c.window(i) else dense(c, st.length, e)
            )
        for p in kv.pairs:
            if p.k is None:  # nothing merged yet
                continue
            if p.kivi is not None:
                total += kivi_of(c, e, layout, p.kivi)
            for h in (p.k, p.v):
                total += 0 if p.kivi is not None else dense(c, p.length, e) // 2
                total += 2 * kv.layout.g * p.length * e
                total += h.ridx.numel() * (4 + 2 * kv.layout.m * e) + 8 * (kv.layout.g + 1)
                total += 4 * kv.layout.g if h.thr is not None else 0
        return total
