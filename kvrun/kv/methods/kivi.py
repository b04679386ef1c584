"""KIVI (Liu et al., 2024, §3): keys quantized per channel, values per token, the newest
`residual` tokens in full precision. A store part: alone (= full+kivi2) or under a selection
(spec: docs/methods/kivi.md)."""

from __future__ import annotations

from dataclasses import replace

from ..spec import KIVI, Method, Option


def _layout(o) -> dict:
    return {"bits": o["bits"], "group": o["group"], "residual": o["residual"]}


KIVI2 = Method(
    "kivi2",
    "store",
    "KIVI 2-bit: keys per channel, values per token, fp tail",
    axes=("none", "all", "uniform", "kivi"),
    runs_at="tail flush",
    options=(Option("bits", 2, "code width (16 = no quantization)", choices=(2, 4, 16)),) + KIVI,
    kivi=_layout,
    lossless="bits=16",
)
KIVI4 = replace(
    KIVI2,
    name="kivi4",
    summary="KIVI 4-bit: keys per channel, values per token, fp tail",
    options=(replace(KIVI2.options[0], default=4),) + KIVI,
)
METHODS = (KIVI2, KIVI4)
