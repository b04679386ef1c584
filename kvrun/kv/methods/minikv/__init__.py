"""MiniKV (Sharma et al., 2024, §3-4): heavy hitters by the prompt's cumulative attention
plus a recent window, selected once per turn at the end of the prefill, stored in 2-bit
KIVI (group 16, residual 128); `minikv-pyramid` gives lower layers more heavy hitters
(spec: docs/methods/minikv.md)."""

from __future__ import annotations

from dataclasses import replace

from ...bytes import composed, dense, elem
from ...spec import Method, Option

OPTIONS = (
    Option("heavy", 0.25, "heavy-hitter fraction x of the prompt (a --kv-budget overrides)", lo=0.0, hi=1.0),
    Option("recent", 0.25, "recent-window fraction of the prompt (a --kv-budget overrides)", lo=0.0, hi=1.0),
    Option("alloc", "uniform", "heavy-hitter budgets per layer", choices=("uniform", "pyramid")),
    Option("depth", 7, "pyramid depth delta: the smallest layer gets x/delta", lo=1),
    Option("pyramid_dir", "down", "down = more budget in lower layers", choices=("down", "up")),
    Option("quant", "kivi2", "store: 2-bit KIVI or dense", choices=("kivi2", "none")),
    Option("group", 16, "KIVI group size", lo=1),
    Option("residual", 128, "KIVI fp residual flush length", lo=1),
    Option("colsum", "auto", "column sums: triton on CUDA, chunked on CPU; dense = reference",
           choices=("auto", "chunked", "dense", "triton")),
    Option("gqa_agg", "sum", "KV-head score from its query heads", choices=("sum", "max")),
    Option("score_norm", "none", "length = divide A[j] by (t - j)", choices=("none", "length")),
    Option("align", 0, "16 = round heavy hitters down so the kept count is a multiple of 16",
           choices=(0, 16)),
    Option("report", "exact", "paper = also report the paper's App. I size", choices=("exact", "paper")),
)  # fmt: skip


def _layout(o) -> dict | None:
    kivi2 = {"bits": 2, "group": o["group"], "residual": o["residual"]}
    return kivi2 if o["quant"] == "kivi2" else None


def nbytes(spec, kv) -> int:
    """sum_l Hkv * d * (n_q * (1/2 + e/4) + 2e * n_r) (§I of the paper's appendix, exact: the
    2-bit KIVI store by its formula); quant=none: 2 * Hkv * T_l * d * e, held turns included."""
    held = sum(dense(kv.config, h.length, elem(kv)) for h in kv.held if h is not None)
    return composed()(spec, kv) + held


def make_cache(spec, config, rope, device, dtype, **kw):
    from .cache import MiniKV

    return MiniKV(spec, config, rope, device, dtype, **kw)


METHOD = Method(
    "minikv",
    "select",
    "MiniKV: H2O heavy hitters over the prompt + recent window, 2-bit KIVI (G 16, R 128)",
    axes=("cumulative (prompt)", "top-k + recent", "uniform", "kivi 2-bit"),
    runs_at="prefill-end; then tail flushes",
    options=OPTIONS,
    default_budget=None,  # heavy + recent fractions of the prompt unless --kv-budget
    own_store="2-bit KIVI; minikv:quant=none for dense, minikv:group=,residual= for its layout",
    kivi=_layout,
    lossless="quant=none,recent=1.0",  # with no --kv-budget: the window is the prompt
    nbytes=nbytes,
    cache=make_cache,
)
PYRAMID = replace(
    METHOD,
    name="minikv-pyramid",
    summary="MiniKV with pyramid heavy-hitter budgets, more to lower layers (= minikv:alloc=pyramid)",
    axes=("cumulative (prompt)", "top-k + recent", "pyramid (MiniKV)", "kivi 2-bit"),
    options=tuple(replace(o, default="pyramid") if o.name == "alloc" else o for o in OPTIONS),
    own_store="2-bit KIVI; minikv-pyramid:quant=none for dense",
)
METHODS = (METHOD, PYRAMID)
