"""KVzap (Jegou and Jeblick, NVIDIA kvpress, 2025): a small scorer per layer, fitted once per
model, predicts KVzip's reconstruction scores (log-scale) from the layer's input, so the
prefill needs no second pass; each KV head keeps its top-k (budget mode) or every slot whose
predicted score exceeds a threshold, plus a recent window (threshold mode, as DMS) (spec:
docs/methods/kvzap.md; the fit: `kvrun calibrate kvzap`)."""

from __future__ import annotations

from ....errors import KvrunError
from ...spec import Method, Option


class KVzap(Method):
    name = "kvzap"
    summary = "KVzap: a fitted per-layer scorer predicts KVzip's scores (kvrun calibrate kvzap)"
    axes = (
        "surrogate of reconstruction attention",
        "top-k or threshold + sinks",
        "uniform",
        "dense",
    )
    runs_at = "prefill-end"
    sinks = Option(4, "first tokens always kept", lo=0)
    mode = Option(
        "budget",
        "budget = top-B per KV head (--kv-budget); threshold = every slot scoring above `threshold`",
        choices=("budget", "threshold"),
    )
    threshold = Option(-4.0, "threshold mode: keep slots whose predicted log-score exceeds it")
    window = Option(0, "newest tokens always kept (threshold mode: DMS's window, try 128)", lo=0)
    scorer = Option("linear", "the fitted scorer used: linear or mlp", choices=("linear", "mlp"))
    points = frozenset({"prefill"})
    cache = ".cache:KVzapCache"
    calibration = "kvzap"  # kept per model (kvrun/kv/calib.py), made by `kvrun calibrate kvzap`

    @property
    def newest(self) -> int:
        return self.window

    @property
    def own_store(self) -> str:
        """Threshold mode pads heads to the layer's largest count, masked by position: dense only."""
        return "padded heads; kvzap:mode=budget stacks" if self.mode == "threshold" else ""

    def check(self, budget) -> None:
        if self.mode == "threshold" and budget is not None:
            raise KvrunError(
                "kvzap:mode=threshold keeps what scores above the threshold and takes no "
                "--kv-budget; give one of them"
            )

    def slot_bytes(self, config) -> int:
        """An int32 position per slot and head in threshold mode (the padding is masked by it)."""
        return 4 * config.n_kv_heads if self.mode == "threshold" else 0
