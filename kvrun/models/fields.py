"""Checked reads of a model's metadata (a GGUF's keys or a config.json's fields), shared by
ModelConfig's readers (kvrun/models/config.py) and the families' own (kvrun/models/families/)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import KvrunError

MAX_COUNT = 1 << 16  # layers and heads: no model comes near
MAX_SIZE = 1 << 24  # widths, head sizes and vocabularies
MAX_CONTEXT = 1 << 31  # contexts and windows
UNSET = object()


class Fields:
    """Checked reads of a model's metadata: a GGUF's keys (`prefix`: its architecture's) or a
    config.json's fields. A value of the wrong type or out of range is a one-line error that
    names the file and the field."""

    def __init__(self, src: Mapping[str, Any], where: str, prefix: str = "", nest: str = ""):
        # prefix: part of every key (GGUF's); nest: where src lies in its file (for messages)
        self.src, self.where, self.prefix, self.nest = src, where, prefix, nest

    def get(self, key: str, default: Any = None) -> Any:
        return self.src.get(self.prefix + key, default)

    def inner(self, key: str) -> Fields:
        """The object field `key`, as fields of their own."""
        return Fields(self.table(key), self.where, nest=f"{self.nest}{key}.")

    def fail(self, key: str, value: Any, want: str) -> KvrunError:
        shown = "missing" if value is None else f"{value!r:.40}"
        return KvrunError(f"{self.where}: {self.nest}{self.prefix}{key} is {shown}, not {want}")

    def whole(
        self, key: str, default: Any = None, lo: int = 1, hi: int = MAX_SIZE, value: Any = UNSET
    ) -> int:
        """An integer field (or `value`, a fallback standing for it) within [lo, hi]."""
        v = self.get(key, default) if value is UNSET else value
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self.fail(key, v, f"a whole number from {lo:,} to {hi:,}")
        return v

    def real(
        self, key: str, default: Any = None, lo: float = -math.inf, positive: bool = False
    ) -> float:
        """A finite number field, >= lo (> 0 where positive)."""
        v = self.get(key, default)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300
        if not ok or v < lo or (positive and v <= 0):
            raise self.fail(key, v, "a positive number" if positive else f"a number >= {lo}")
        return float(v)

    def reals(self, key: str) -> tuple[float, ...]:
        """A list of finite numbers (LongRoPE's factors)."""
        v = self.get(key)
        if not isinstance(v, list):
            raise self.fail(key, v, "a list of numbers")
        return tuple(
            Fields({key: x}, self.where, nest=self.nest).real(key, positive=True) for x in v
        )

    def table(self, key: str) -> dict:
        """An object field ({} when absent or null)."""
        v = self.get(key)
        if v is not None and not isinstance(v, dict):
            raise self.fail(key, v, "an object")
        return v or {}
