"""KIVI (Liu et al., 2024, §3): keys quantized per channel, values per token, the newest
`residual` tokens in full precision. A store part: alone (= full+kivi2) or under a selection."""

from __future__ import annotations

from ..method import Method
from ..options import KIVI, Option


def _layout(o) -> dict:
    return {"bits": o["bits"], "group": o["group"], "residual": o["residual"]}


def _kivi(bits: int) -> Method:
    return Method(
        f"kivi{bits}",
        "store",
        f"KIVI {bits}-bit: keys per channel, values per token, fp tail",
        axes=("none", "all", "uniform", "kivi"),
        runs_at="tail flush",
        options=(Option("bits", bits, "code width (16 = no quantization)", choices=(2, 4, 16)),)
        + KIVI,
        kivi=_layout,
        lossless="bits=16",
    )


METHODS = (_kivi(2), _kivi(4))
