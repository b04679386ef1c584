"""DuoAttention (Xiao et al., 2024, "DuoAttention: Efficient Long-Context LLM Inference with
Retrieval and Streaming Heads"): retrieval heads keep every token; streaming heads keep the
first `sinks` and the newest `window`; which KV heads retrieve comes from a per-model
calibration (`kvrun calibrate duo`), and --kv-budget picks how many (spec: docs/methods/duo.md)."""

from __future__ import annotations

from ...spec import Method, Option


class Duo(Method):
    """Bytes: per layer, 2 * D * e * (R_l * T + S_l * min(T, sinks + window)) plus an int32
    position per slot and store on a layer with a sliding window."""

    name = "duo"
    summary = "DuoAttention: retrieval heads keep all, streaming heads sinks + window (kvrun calibrate duo)"
    axes = (
        "calibrated head pattern",
        "all, or sinks + window per KV head",
        "head share",
        "dense x2",
    )
    runs_at = "each prefill chunk, each decode step (streaming heads)"
    sinks = Option(16, "first tokens a streaming head keeps", lo=0)
    window = Option(64, "newest tokens a streaming head keeps", lo=1)
    default_budget = "0.5"  # DuoAttention's GQA models keep about half their heads whole
    own_store = "retrieval and streaming heads in stores of their own"
    cache = ".cache:DuoCache"
    calibration = "duo"  # kept per model (kvrun/kv/calib.py), made by `kvrun calibrate duo`

    @property
    def protected(self) -> int:
        """The budget counts heads, not tokens: no token floor."""
        return 0

    def nbytes(self, kv) -> int:
        """From counts: each store's heads times its slots, K and V, plus its positions."""
        c = kv.config
        row = kv.kv_type.row_bytes(c.head_dim) if kv.kv_type else c.head_dim * kv.dtype.itemsize
        total = 0
        for st in kv.layers:
            for seg in (st.ret, st.stream):
                total += seg.n_kv * seg.length * 2 * row
                total += 4 * seg.length if seg.pos is not None else 0
        return total
