"""SpindleKV (§3 of the paper): per-query-head observation-window scores, per-layer eviction
ratios growing linearly with depth, and per-layer codebooks that replace kept keys and values
by an index when a codeword is similar enough (spec: docs/methods/spindlekv.md)."""

from __future__ import annotations

from ...bytes import elem
from ...spec import Method, Option, pooling


class SpindleKV(Method):
    name = "spindlekv"
    summary = "SpindleKV: linear per-layer eviction budgets + per-layer codebooks of K and V"
    axes = ("window", "top-k + window (per query head)", "spindle", "codebook")
    runs_at = "prefill-end; decode tokens coded"
    window = Option(32, "observation-window queries, always kept", lo=1)
    beta = Option(0.05, "smallest layer ratio; alpha = (1 + beta)/2", lo=0.0, hi=1.0)
    schedule = Option("linear", "per-layer ratios", choices=("linear", "flat"))
    pool = Option("none", "pooling of the scores: none, avg:K or max:K", valid=pooling)
    score_norm = Option("length", "length = divide by (t - a)", choices=("length", "none"))
    gqa = Option(
        "qhead",
        "qhead = per query head, union + mask; mean = per KV head",
        choices=("qhead", "mean"),
    )
    codebook = Option(True, "off = store the kept pre-RoPE K and V densely")
    theta_k = Option(0.98, "cosine threshold for keys", lo=-1.0, hi=2.0)
    theta_v = Option(0.95, "cosine threshold for values", lo=-1.0, hi=2.0)
    codebook_scope = Option(
        "layer", "one codebook per layer or per KV head", choices=("layer", "head")
    )
    index = Option("auto", "index width", choices=("auto", "int16-strict", "int32"))
    cb_block = Option(4096, "tile size of the similarity blocks", lo=1)
    decode_codebook = Option(True, "off = decode tokens stored densely")
    report = Option("exact", "paper = also report r1*r2*r3", choices=("exact", "paper"))
    own_store = "codebook; spindlekv:codebook=off for dense"
    lossless = "codebook=off"
    cache = ".cache:SpindleKVCache"

    @property
    def newest(self) -> int:
        return self.window

    def nbytes(self, kv) -> int:
        """sum over layers of e * d * (|C_K| + |C_V|) + Hkv * S_c * (i_K + i_V + 2e + 4 + nb)
        + Hkv * S_d * (2e * d + 4 + nb): codebook entries, then per coded slot two indices (2 or
        4 bytes, the int32 switch) and two magnitudes, per dense slot pre-RoPE K and V, and per
        slot an int32 position and ceil(g/8) mask bytes; padding slots count."""
        c, e = kv.config, elem(kv)
        nb = -(-(c.n_heads // c.n_kv_heads) // 8)
        total = 0
        for st in kv.layers:
            s_c = 0 if st.pos_c is None else st.pos_c.shape[1]
            s_d = 0 if st.pos_d is None else st.pos_d.shape[1]
            i_k, i_v = (t.itemsize for t in st.idx_dtype)
            total += e * c.head_dim * sum(b.n for b in st.books_k + st.books_v)
            total += c.n_kv_heads * s_c * (i_k + i_v + 2 * e + 4 + nb)
            total += c.n_kv_heads * s_d * (2 * e * c.head_dim + 4 + nb)
        return total
