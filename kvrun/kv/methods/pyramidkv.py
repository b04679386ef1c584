"""PyramidKV (Cai et al., 2024, §3): SnapKV's selection with layer budgets decreasing
linearly from the first layer to the last (arithmetic schedule, same mean)."""

from __future__ import annotations

from ..bytes import composed
from ..method import Allocator, Method, Scorer, Selector
from ..options import SNAP, Option

METHOD = Method(
    "pyramidkv",
    "select",
    "PyramidKV: SnapKV with linearly decreasing layer budgets",
    scorer=Scorer.WINDOW,
    selector=Selector.TOPK_WINDOW,
    allocator=Allocator.PYRAMID,
    when="prefill-end",
    options=SNAP + (Option("beta", 20, "last layer gets 1/beta of the mean", lo=1),),
    protected=lambda o: o["window"],
    nbytes=composed(),  # sum_l 2 * Hkv * T_l * D * e (a stacked KIVI store by its formula)
)
