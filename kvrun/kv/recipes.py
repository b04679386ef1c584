"""Named KV recipes and the --kv grammar: NAME[:key=value,...][+NAME[:key=value,...]...].

Each name is a part on the three axes (methods/README.md): a selection part (which tokens,
how many per layer, when) and/or a store part (how they are stored). Options attach to
the part they follow: `snapkv:window=64+kivi2:group=16`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import KvrunError


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple = ()
    odd: bool = False

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
        return v


@dataclass(frozen=True, slots=True)
class Part:
    """One named part: a selection recipe or a store."""

    name: str
    kind: str  # "select" | "store"
    summary: str
    scorer: str = "none"  # none | window | cumulative
    selector: str = "all"  # all | sinks+recent | topk+recent | topk+window
    allocator: str = "uniform"  # uniform | pyramid
    store: str = "dense"  # dense | kivi
    when: str = "never"  # never | prefill-end | every chunk and step | tail flush
    options: tuple[Option, ...] = ()

    def defaults(self) -> dict:
        return {o.name: o.default for o in self.options}


_SNAP = (
    Option("window", 32, "observation window: the last w prompt queries vote", lo=1),
    Option("kernel", 7, "pooling kernel over the votes", lo=1, odd=True),
    Option("pool", "max", "pooling", choices=("max", "avg")),
    Option("chunked", False, "also compress after every prefill chunk (bounded peak memory)"),
)
_KIVI = (
    Option("group", 32, "tokens (keys) / channels (values) sharing a scale and zero point", lo=1),
    Option("residual", 128, "newest tokens kept in full precision", lo=1),
)

PARTS: dict[str, Part] = {
    p.name: p
    for p in [
        Part("full", "select", "every token, uncompressed"),
        Part(
            "streaming",
            "select",
            "StreamingLLM: attention sinks + recent window",
            selector="sinks+recent",
            when="every chunk and step",
            options=(Option("sinks", 4, "first tokens always kept", lo=0),),
        ),
        Part(
            "h2o",
            "select",
            "H2O: heavy hitters by cumulative attention + recent window",
            scorer="cumulative",
            selector="topk+recent",
            when="every chunk and step",
            options=(
                Option(
                    "recent", 0.5, "share of the budget for the most recent tokens", lo=0.0, hi=1.0
                ),
                Option("sinks", 0, "first tokens always kept", lo=0),
            ),
        ),
        Part(
            "snapkv",
            "select",
            "SnapKV: observation-window votes, max-pooled, top-k per KV head",
            scorer="window",
            selector="topk+window",
            when="prefill-end",
            options=_SNAP,
        ),
        Part(
            "pyramidkv",
            "select",
            "PyramidKV: SnapKV with linearly decreasing layer budgets",
            scorer="window",
            selector="topk+window",
            allocator="pyramid",
            when="prefill-end",
            options=_SNAP + (Option("beta", 20, "last layer gets 1/beta of the mean", lo=1),),
        ),
        Part(
            "kivi2",
            "store",
            "KIVI 2-bit: keys per channel, values per token, fp tail",
            store="kivi",
            when="tail flush",
            options=(Option("bits", 2, "code width (16 = no quantization)", choices=(2, 4, 16)),)
            + _KIVI,
        ),
        Part(
            "kivi4",
            "store",
            "KIVI 4-bit: keys per channel, values per token, fp tail",
            store="kivi",
            when="tail flush",
            options=(Option("bits", 4, "code width (16 = no quantization)", choices=(2, 4, 16)),)
            + _KIVI,
        ),
    ]
}


@dataclass(frozen=True, slots=True)
class KVSpec:
    """A parsed --kv: one selection part and one store part, each with its options."""

    select: Part
    select_opts: dict = field(default_factory=dict)
    store: Part | None = None
    store_opts: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        names = [] if self.select.name == "full" and self.store else [self.select.name]
        return "+".join(names + ([self.store.name] if self.store else []))

    @property
    def is_full(self) -> bool:
        return self.select.name == "full" and self.store is None

    def describe(self) -> dict:
        out = {"method": self.name, **self.select_opts}
        if self.store:
            out.update(self.store_opts)
        return out


def parse_kv(text: str) -> KVSpec:
    """Parse --kv; unknown names or options and incompatible stacks raise KvrunError."""
    select: tuple[Part, dict] | None = None
    store: tuple[Part, dict] | None = None
    for raw in text.split("+"):
        name, _, opts_text = raw.strip().partition(":")
        name = name.strip().lower()
        part = PARTS.get(name)
        if part is None:
            raise KvrunError(
                f"unknown KV method {name!r} (available: {', '.join(PARTS)}; see `kvrun kv list`)"
            )
        opts = part.defaults()
        known = {o.name: o for o in part.options}
        for item in filter(None, (s.strip() for s in opts_text.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip()
            if key not in known:
                valid = ", ".join(known) or "none"
                raise KvrunError(f"unknown option {key!r} for {name} (valid: {valid})")
            if not eq:
                raise KvrunError(f"option {name}:{key} needs a value ({key}=...)")
            opts[key] = known[key].parse(name, value.strip())
        slot = (part, opts)
        if part.kind == "select":
            if select is not None:
                raise KvrunError(
                    f"cannot stack two selection methods ({select[0].name} and {name}); "
                    "stack one of full/streaming/h2o/snapkv/pyramidkv with one store (kivi2/kivi4)"
                )
            select = slot
        else:
            if store is not None:
                raise KvrunError(f"cannot stack two stores ({store[0].name} and {name})")
            store = slot
    sel_part, sel_opts = select or (PARTS["full"], {})
    if store and sel_part.when == "every chunk and step" and store[1]["bits"] != 16:
        raise KvrunError(
            f"{sel_part.name}+{store[0].name} is not supported: decode-time eviction cannot remove "
            "single tokens from a quantized body; use snapkv or pyramidkv with a KIVI store"
        )
    if store:
        o = store[1]
        if o["bits"] != 16:
            per_word = 32 // o["bits"]
            if o["residual"] % o["group"]:
                raise KvrunError(
                    f"{store[0].name}: residual ({o['residual']}) must be a multiple of group ({o['group']})"
                )
            if o["group"] % per_word:
                raise KvrunError(
                    f"{store[0].name}: group ({o['group']}) must be a multiple of {per_word} at {o['bits']} bits"
                )
    return KVSpec(sel_part, sel_opts, *(store or (None, {})))


def protected_tokens(spec: KVSpec) -> int:
    """P: tokens a selection always keeps (sinks + window), the floor of any budget."""
    s, o = spec.select, spec.select_opts
    if s.name == "streaming":
        return o["sinks"] + 1
    if s.name == "h2o":
        return o["sinks"] + 1
    if s.scorer == "window":
        return o["window"]
    return 0
