"""The declaration language of the KV layer, torch-free: the options a method declares
(`Option`), the method itself (`Method`: its options, budget rules and the callables that run
it), --kv-budget (`Budget`, docs/methods/README.md §2), --kv parsed once into a frozen `KVSpec`.
Grammar: NAME[:key=value,...][+NAME[:key=value,...]...], at most one selection and one store
(`snapkv:window=64+kivi2:group=16`); the rules are the methods' declarations. `--kv` is checked
before torch is imported, so a method module keeps torch out of its top level (a scoring
method needs none; a cache factory imports it)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
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


Opts = Mapping[str, Any]
NEVER: frozenset[str] = frozenset()
_zero: Callable[..., int] = lambda *_: 0  # noqa: E731


@dataclass(frozen=True, slots=True)
class Method:
    """One named part of --kv: a selection method ('select') or a store ('store')."""

    name: str
    kind: str  # "select" | "store"
    summary: str
    # how `kvrun kv list` describes it: (scorer, selector, allocator, store) and when it runs
    axes: tuple[str, str, str, str] = ("none", "all", "uniform", "dense")
    runs_at: str = "never"
    options: tuple[Option, ...] = ()
    # P: tokens the selection always keeps (sinks + window), the floor of any budget
    protected: Callable[[Opts], int] = _zero
    # whether --kv-budget means anything; `budget_refused`: the error if given one (empty: ignored)
    takes_budget: bool = True
    budget_refused: str = ""
    default_budget: str | None = "0.2"  # B when --kv-budget is not given (None: the method's own)
    # cross-option and budget rules beyond each option's own (raises KvrunError)
    rule: Callable[[Opts, Any], None] = lambda o, budget: None
    # a selection with its own store: stacking a store is refused with this text (or f(opts))
    own_store: str | Callable[[Opts], str] = ""
    # the KIVI layout {bits, group, residual} this part stores in, or None
    kivi: Callable[[Opts], dict | None] = lambda o: None
    # options reproducing full with a budget of every token (or alone, with no default budget)
    lossless: str = ""
    # (spec, cache) -> bytes by the spec's formula (kvrun/kv/bytes.py); stores: None
    nbytes: Callable[[Any, Any], int] | None = None

    # score(ctx) -> (Hkv or 1, C) fp32, higher kept, for the C <= T oldest held slots (the newer
    # T - C are kept); one row: the same slots for every KV head. None: nothing is selected
    score: Callable[[Any], Any] | None = None
    # where score() selects: "chunk", "prefill" (turn's end), "step" (positions kept per slot)
    points: Callable[[Opts], frozenset[str]] = lambda o: NEVER
    queries: Callable[[Opts], int] = _zero  # the newest queries of the turn kept for score()
    cumulative: bool = False  # accumulate attention column sums over every query (ctx.attention)
    per_layer: Callable[[Opts], bool] = lambda o: False  # one kept set for every KV head
    sinks: Callable[[Opts], int] = _zero  # first slots always kept
    recent: Callable[[Opts, int], int] = _zero  # (opts, B) -> newest slots always kept
    # (opts, B, T, n_layers) -> per-layer budgets; None: B in every layer
    budgets: Callable[[Opts, int, int, int], list[int]] | None = None
    # (spec, config, rope, device, dtype, **kw) -> a cache of the method's own; None: the driver
    cache: Callable[..., Any] | None = None

    def defaults(self) -> dict:
        return {o.name: o.default for o in self.options}

    def evicts_at_decode(self, opts: Opts) -> bool:
        """Single tokens leave at decode steps (a quantized body cannot lose one)."""
        return "step" in self.points(opts)


@dataclass(frozen=True, slots=True)
class Budget:
    """--kv-budget (docs/methods/README.md §2): an exact fraction of the tokens seen (< 1) or a
    count."""

    value: Fraction
    text: str

    @classmethod
    def parse(cls, text: str | float) -> Budget:
        s = str(text).strip()
        try:
            v = Fraction(s)
        except (ValueError, ZeroDivisionError):
            raise KvrunError(
                f"--kv-budget {s!r} is not a number (use a fraction like 0.25 or a token count like 1024)"
            ) from None
        if v <= 0:
            raise KvrunError(f"--kv-budget must be > 0 (got {s})")
        return cls(v, s)

    @property
    def is_fraction(self) -> bool:
        return self.value < 1

    def tokens(self, n: int, protected: int = 0) -> int:
        """B(n) = min(n, max(P, ceil(b n))) for a fraction, min(n, floor(b)) for a count."""
        if self.is_fraction:
            return min(n, max(protected, math.ceil(self.value * n)))
        return min(n, math.floor(self.value))

    def check(self, protected: int, method: str) -> None:
        """An absolute budget below the method's protected minimum is an error."""
        if not self.is_fraction and math.floor(self.value) < protected:
            raise KvrunError(
                f"--kv-budget {self.text} is below {method}'s protected minimum of {protected} tokens "
                f"(sinks + window); use at least {protected} or a fraction"
            )

    def __str__(self) -> str:
        return self.text


def largest_remainder(shares: list[Fraction], total: int) -> list[int]:
    """Integers with floor(shares) plus one for the largest remainders (ties: lower index)."""
    base = [math.floor(s) for s in shares]
    left = total - sum(base)
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return base


@dataclass(frozen=True, slots=True)
class KVSpec:
    """A validated --kv: one selection and at most one store, with options, and the --kv-budget."""

    select: Method
    select_opts: Mapping[str, Any] = field(default_factory=dict)
    store: Method | None = None
    store_opts: Mapping[str, Any] = field(default_factory=dict)
    budget: Budget | None = None

    def __post_init__(self):  # options are read-only once validated
        for name in ("select_opts", "store_opts"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    @property
    def keeps_all(self) -> bool:
        """The selection keeps every token as the driver stores it (full)."""
        return self.select.score is None and self.select.cache is None

    @property
    def name(self) -> str:
        names = [] if self.keeps_all and self.store else [self.select.name]  # kivi2 = full+kivi2
        return "+".join(names + ([self.store.name] if self.store else []))

    @property
    def is_full(self) -> bool:
        return self.keeps_all and self.store is None

    @property
    def takes_budget(self) -> bool:
        """Whether --kv-budget means anything here (grids run the others once)."""
        return self.select.takes_budget

    @property
    def protected(self) -> int:
        """P: tokens the selection always keeps (sinks + window), the floor of any budget."""
        return self.select.protected(self.select_opts)

    def budget_or_default(self) -> Budget | None:
        """The budget the selection runs at: --kv-budget, else the method's default."""
        if self.budget is not None:
            return self.budget
        d = self.select.default_budget
        return Budget.parse(d) if d is not None else None

    def kivi(self) -> dict | None:
        """KIVI layout {bits, group, residual} (a stacked store's over the selection's), or None
        where nothing is quantized (none, or bits=16)."""
        kv = self.store.kivi(self.store_opts) if self.store else self.select.kivi(self.select_opts)
        return kv if kv is not None and kv["bits"] != 16 else None

    def with_budget(self, budget: str | float | Budget | None) -> KVSpec:
        """This spec at another --kv-budget, checked against the method's budget rules."""
        b = budget if budget is None or isinstance(budget, Budget) else Budget.parse(budget)
        sel = self.select
        if b is not None and not sel.takes_budget:
            if sel.budget_refused:
                raise KvrunError(sel.budget_refused)
            b = None  # nothing is selected: the budget is ignored
        sel.rule(self.select_opts, b)
        if b is not None:
            b.check(self.protected, sel.name)
        return dataclasses.replace(self, budget=b)

    def describe(self) -> dict:
        out = {"method": self.name, **self.select_opts}
        if self.store:
            out.update(self.store_opts)
        return out


def parse(text: str, registry: Mapping[str, Method], budget=None) -> KVSpec:
    """--kv (and --kv-budget) validated against the registry, errors as one-line KvrunErrors; a
    spec naming no selection runs the registry's first (full)."""
    select: tuple[Method, dict] | None = None
    store: tuple[Method, dict] | None = None
    for raw in str(text).split("+"):
        name, _, opts_text = raw.strip().partition(":")
        name = name.strip().lower()
        part = registry.get(name)
        if part is None:
            raise KvrunError(
                f"unknown KV method {name!r} (available: {', '.join(registry)}; see `kvrun kv list`)"
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
        if part.kind == "select":
            if select is not None:
                names = lambda kind: [m.name for m in registry.values() if m.kind == kind]  # noqa: E731
                raise KvrunError(
                    f"cannot stack two selection methods ({select[0].name} and {name}); stack "
                    f"one selection ({', '.join(names('select'))}) with one store "
                    f"({'/'.join(names('store'))})"
                )
            select = (part, opts)
        else:
            if store is not None:
                raise KvrunError(f"cannot stack two stores ({store[0].name} and {name})")
            store = (part, opts)
    sel, sel_opts = select or (next(iter(registry.values())), {})
    own = sel.own_store(sel_opts) if callable(sel.own_store) else sel.own_store
    if store and own:
        raise KvrunError(
            f"{sel.name} cannot be stacked with {store[0].name}: it has its own store ({own})"
        )
    if store and sel.evicts_at_decode(sel_opts) and store[0].kivi(store[1])["bits"] != 16:
        raise KvrunError(
            f"{sel.name}+{store[0].name} is not supported: decode-time eviction cannot remove "
            "single tokens from a quantized body; use snapkv or pyramidkv with a KIVI store"
        )
    spec = KVSpec(sel, sel_opts, *(store or (None, {})))
    _check_layout(spec)
    return spec.with_budget(budget)


def _check_layout(spec: KVSpec) -> None:
    """A KIVI layout must tile: whole groups in the residual, whole words in a group."""
    kv = spec.kivi()
    if kv is None:
        return
    where = spec.store.name if spec.store else spec.select.name
    per_word = 32 // kv["bits"]
    if kv["residual"] % kv["group"]:
        raise KvrunError(
            f"{where}: residual ({kv['residual']}) must be a multiple of group ({kv['group']})"
        )
    if kv["group"] % per_word:
        raise KvrunError(
            f"{where}: group ({kv['group']}) must be a multiple of {per_word} at {kv['bits']} bits"
        )
