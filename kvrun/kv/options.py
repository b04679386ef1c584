"""Declared options of a KV method, described once: they parse `--kv name:key=value`, write
`kvrun kv list` and give a manager its defaults. Torch-free."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import KvrunError


@dataclass(frozen=True, slots=True)
class Option:
    """One typed option: a default, a help text and the checks a value must pass."""

    name: str
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple = ()
    odd: bool = False
    # a rule the fields above cannot say, given ("method:option", value); raises KvrunError
    valid: Callable[[str, Any], None] | None = None

    def parse(self, part: str, text: str) -> Any:
        """The value of `text` for this option, or a one-line error naming what is valid."""
        where = f"{part}:{self.name}"
        d = self.default
        try:
            if isinstance(d, bool):
                if text.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                v: Any = text.lower() in ("true", "1", "yes", "on")
            elif isinstance(d, int):
                v = int(text)
            elif isinstance(d, float):
                v = float(text)
            else:
                v = text
        except ValueError:
            kind = "true or false" if isinstance(d, bool) else type(d).__name__
            raise KvrunError(f"{where}={text} is not valid: expected {kind}") from None
        if self.choices and v not in self.choices:
            raise KvrunError(
                f"{where}={text} is not valid: choose one of {', '.join(map(str, self.choices))}"
            )
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            rng = f"{self.lo if self.lo is not None else '-inf'}..{self.hi if self.hi is not None else 'inf'}"
            raise KvrunError(f"{where}={text} is out of range ({rng})")
        if self.odd and v % 2 == 0:
            raise KvrunError(f"{where}={text} must be odd")
        if self.valid is not None:
            self.valid(where, v)
        return v

    def with_default(self, default: Any) -> Option:
        """This option with another default (a preset of a method, e.g. minikv-pyramid)."""
        return Option(self.name, default, self.help, self.lo, self.hi, self.choices, self.odd,
                      self.valid)  # fmt: skip


def pooling(where: str, text: str) -> None:
    """none, avg:K or max:K with K odd (the score pooling of XKV and SpindleKV)."""
    kind, _, k = text.partition(":")
    if text == "none":
        return
    if kind not in ("avg", "max") or not k.isdigit() or int(k) < 1 or int(k) % 2 == 0:
        raise KvrunError(f"{where}={text} is not valid: use none, avg:K or max:K with K odd")


# the observation-window options shared by SnapKV and PyramidKV (SnapKV §4.2)
SNAP = (
    Option("window", 32, "observation window: the last w prompt queries vote", lo=1),
    Option("kernel", 7, "pooling kernel over the votes", lo=1, odd=True),
    Option("pool", "max", "pooling", choices=("max", "avg")),
    Option("chunked", False, "also compress after every prefill chunk (bounded peak memory)"),
)
# a KIVI layout (KIVI §3): group size and full-precision residual
KIVI = (
    Option("group", 32, "tokens (keys) / channels (values) sharing a scale and zero point", lo=1),
    Option("residual", 128, "newest tokens kept in full precision", lo=1),
)
