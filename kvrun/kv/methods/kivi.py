"""KIVI (Liu et al., 2024, §3): keys quantized per channel, values per token, the newest
`residual` tokens in full precision. A store part: alone (= full+kivi2) or under a selection
(spec: docs/methods/kivi.md)."""

from __future__ import annotations

from ..spec import Method, Option


class KIVI2(Method):
    name = "kivi2"
    kind = "store"
    summary = "KIVI 2-bit: keys per channel, values per token, fp tail"
    axes = ("none", "all", "uniform", "kivi")
    runs_at = "tail flush"
    bits = Option(2, "code width (16 = no quantization)", choices=(2, 4, 16))
    group = Option(32, "tokens (keys) / channels (values) sharing a scale and zero point", lo=1)
    residual = Option(128, "newest tokens kept in full precision", lo=1)
    lossless = "bits=16"

    @property
    def kivi(self) -> dict:
        return {"bits": self.bits, "group": self.group, "residual": self.residual}


class KIVI4(KIVI2):
    name = "kivi4"
    summary = "KIVI 4-bit: keys per channel, values per token, fp tail"
    bits = KIVI2.bits.copy(default=4)
