"""MiniKV (Sharma et al., 2024, §3-4): heavy hitters by the prompt's cumulative attention
plus a recent window, selected once per turn at the end of the prefill, stored in 2-bit
KIVI (group 16, residual 128); `minikv-pyramid` gives lower layers more heavy hitters
(spec: docs/methods/minikv.md)."""

from __future__ import annotations

from ...bytes import composed, dense_slot
from ...spec import Method, Option


class MiniKV(Method):
    name = "minikv"
    summary = "MiniKV: H2O heavy hitters over the prompt + recent window, 2-bit KIVI (G 16, R 128)"
    axes = ("cumulative (prompt)", "top-k + recent", "uniform", "kivi 2-bit")
    runs_at = "prefill-end; then tail flushes"
    heavy = Option(
        0.25, "heavy-hitter share x of the prompt (a --kv-budget overrides)", lo=0.0, hi=1.0
    )
    recent = Option(
        0.25, "recent-window share of the prompt (a --kv-budget overrides)", lo=0.0, hi=1.0
    )
    alloc = Option("uniform", "heavy-hitter budgets per layer", choices=("uniform", "pyramid"))
    depth = Option(7, "pyramid depth delta: the smallest layer gets x/delta", lo=1)
    pyramid_dir = Option("down", "down = more budget in lower layers", choices=("down", "up"))
    quant = Option("kivi2", "store: 2-bit KIVI or dense", choices=("kivi2", "none"))
    group = Option(16, "KIVI group size", lo=1)
    residual = Option(128, "KIVI fp residual flush length", lo=1)
    colsum = Option(
        "auto",
        "column sums: triton on CUDA, native kernels (else chunked torch) on CPU; dense = reference",
        choices=("auto", "chunked", "dense", "triton"),
    )
    gqa_agg = Option("sum", "KV-head score from its query heads", choices=("sum", "max"))
    score_norm = Option("none", "length = divide A[j] by (t - j)", choices=("none", "length"))
    align = Option(
        0, "16 = round heavy hitters down so the kept count is a multiple of 16", choices=(0, 16)
    )
    report = Option(
        "exact", "paper = also report the paper's App. I size", choices=("exact", "paper")
    )
    points = frozenset({"prefill"})  # selects once per turn (the cache's own select)
    default_budget = None  # heavy + recent shares of the prompt unless --kv-budget
    own_store = "2-bit KIVI; minikv:quant=none for dense, minikv:group=,residual= for its layout"
    lossless = "quant=none,recent=1.0"  # with no --kv-budget: the window is the prompt
    cache = ".cache:MiniKVCache"

    @property
    def kivi(self) -> dict | None:
        if self.quant != "kivi2":
            return None
        return {"bits": 2, "group": self.group, "residual": self.residual}

    def nbytes(self, kv) -> int:
        """sum_l Hkv * d * (n_q * (1/2 + e/4) + 2e * n_r) (§I of the paper's appendix, exact:
        the 2-bit KIVI store by its formula); quant=none: 2 * Hkv * T_l * d * e, held turns
        included (e: --kv-dtype's, as every dense store). Gemma 3's local layers: their window,
        dense with an int32 position per slot."""
        slot = dense_slot(kv)  # held turns and windows in --kv-dtype's type, as every dense store
        held = sum(
            h.length * (slot + (4 if i in kv.local else 0))
            for i, h in enumerate(kv.held)
            if h is not None
        )
        return composed(kv) + held


class MiniKVPyramid(MiniKV):
    name = "minikv-pyramid"
    summary = (
        "MiniKV with pyramid heavy-hitter budgets, more to lower layers (= minikv:alloc=pyramid)"
    )
    axes = ("cumulative (prompt)", "top-k + recent", "pyramid (MiniKV)", "kivi 2-bit")
    alloc = MiniKV.alloc.copy(default="pyramid")
    own_store = "2-bit KIVI; minikv-pyramid:quant=none for dense"
