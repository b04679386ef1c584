"""The declaration language of the KV layer, torch-free: a method is a class (`Method`) whose
options are typed class attributes (`Option`); --kv-budget is a `Budget`
(docs/methods/README.md §2); --kv is parsed once into a frozen `KVSpec` holding the configured
methods. Grammar: NAME[:key=value,...][+NAME[:key=value,...]...], at most one selection and one
store (`snapkv:window=64+kivi2:group=16`); the rules are the methods' declarations. `--kv` is
checked before torch is imported, so a method module keeps torch out of its top level (a
scoring method needs none; a cache of its own is named by `Method.cache` and imported when
built)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any

from ..errors import KvrunError
from .bytes import composed


class Option:
    """One typed option of a method, declared as a class attribute of the method:

        window = Option(32, "observation window: the last w prompt queries vote", lo=1)

    On a configured method (an instance) the attribute is the option's value; on the class it
    is this declaration. The type is the default's (bool, int, float or str); `lo`/`hi`,
    `choices`, `odd` and `valid` (a rule the others cannot say, given ("method:option", value),
    raising KvrunError) are checked when --kv is parsed. `was` is an older name still accepted
    for one release, with `was_values` mapping its older values."""

    __slots__ = (
        "name",
        "default",
        "help",
        "lo",
        "hi",
        "choices",
        "odd",
        "valid",
        "was",
        "was_values",
    )

    def __init__(
        self,
        default: Any,
        help: str,
        *,
        lo: float | None = None,
        hi: float | None = None,
        choices: tuple = (),
        odd: bool = False,
        valid: Callable[[str, Any], None] | None = None,
        was: str = "",
        was_values: Mapping[str, str] | None = None,
    ):
        self.name = ""
        self.default, self.help, self.lo, self.hi = default, help, lo, hi
        self.choices, self.odd, self.valid = tuple(choices), odd, valid
        self.was, self.was_values = was, dict(was_values or {})

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else obj._values[self.name]

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"{self.name} is fixed once --kv is parsed (use .replace())")

    def __repr__(self) -> str:
        return f"Option({self.name}={self.default!r})"

    def copy(self, **changes) -> Option:
        """This declaration with some fields changed (a subclass's other default)."""
        fields = {k: getattr(self, k) for k in self.__slots__ if k != "name"}
        return Option(**{**fields, **changes})

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


# `scope`, the one name for "one kept set (or statistic) per KV head, or one for the layer"
SCOPES = ("head", "layer")
# scope=adaptive (AdaKV): the layer's Hkv * B slots go to its best (head, slot) pairs, so heads
# hold different counts (padded to the layer's largest, masked by position: adaptive.keep_adaptive)
ADAPTIVE = "adaptive"


def adaptive(default: str = "head", choices: tuple[str, ...] = ("head", ADAPTIVE), **kw):
    """The `scope`, `alpha` and `critical` options of a scoring method that offers AdaKV's
    head-adaptive budgets and CriticalKV's refinement (docs/methods/adaptive.md):
    `scope, alpha, critical = adaptive()` in the class body."""
    scope = Option(
        default,
        "head = B per KV head; adaptive = the layer's Hkv * B to its best (head, slot) pairs "
        "(AdaKV)"
        + ("; layer = one kept set per layer" if "layer" in choices else "")
        + ("; model = one kept set for the whole model" if "model" in choices else ""),
        choices=choices,
        **kw,
    )
    alpha = Option(
        0.2, "scope=adaptive: each KV head keeps at least alpha * B (AdaKV)", lo=0.0, hi=1.0
    )
    critical = Option(
        False, "CriticalKV: half of B by the scores, the rest weighted by ||W_o v||_1 per head"
    )
    return scope, alpha, critical


NEVER: frozenset[str] = frozenset()


class Method:
    """One named part of --kv: a selection method (kind "select") or a store ("store").

    A method is a class; its options are `Option` class attributes, and an instance is the
    method configured by one --kv (`SnapKV(window=64)`: `.window` is 64). Constants are class
    attributes; what depends on the options is a property or a method of the same name. The
    driver (kvrun/kv/cache.py) runs a selection from `score` and the attributes below it; a
    method with a cache of its own names it in `cache`. Declarations import no torch: `--kv` is
    checked, and `kvrun kv list` printed, before torch loads."""

    name: str = ""
    kind: str = "select"
    summary: str = ""
    # how `kvrun kv list` describes it: (scorer, selector, allocator, store) and when it runs
    axes: tuple[str, str, str, str] = ("none", "all", "uniform", "dense")
    runs_at: str = "never"
    options: tuple[Option, ...] = ()  # every Option of the class and its bases, in order

    # --kv-budget: whether it means anything; the error if given where it does not ("":
    # ignored); B when none is given (None: the method's own)
    takes_budget: bool = True
    budget_refused: str = ""
    default_budget: str | None = "0.2"
    # a selection with its own store: stacking a store is refused with this text
    own_store: str = ""
    # the KIVI layout {bits, group, residual} this part stores in, or None
    kivi: dict | None = None
    # options reproducing full with a budget of every token (or alone, with no default budget)
    lossless: str = ""
    # "module:Class" of a cache of the method's own, relative to the declaring package ("":
    # the driver, KVCache)
    cache: str = ""

    # -- what the driver runs (KVCache) --
    # score(ctx) -> (Hkv or 1, C) fp32, higher kept, for the C <= T oldest held slots (the newer
    # T - C are kept); one row: the same slots for every KV head. None: nothing is selected
    score: Callable[[Any], Any] | None = None
    # where score() selects: "chunk", "prefill" (turn's end), "step" (positions kept per slot)
    points: frozenset[str] = NEVER
    queries: int = 0  # the newest queries of the turn kept for score() (ctx.queries)
    cumulative: bool = False  # accumulate attention column sums over every query (ctx.attention)
    scope: str = "head"  # "layer": one kept set for every KV head of a layer
    critical: bool = False  # CriticalKV's refinement of the scores (needs the model's W_o)
    sinks: int = 0  # first slots always kept
    newest: int = 0  # newest slots always kept, whatever the budget

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        found: dict[str, Option] = {}
        for klass in reversed(cls.__mro__):
            for key, value in vars(klass).items():
                if isinstance(value, Option):
                    found[key] = value
                elif key in found:  # a subclass turned the option into a constant
                    del found[key]
        cls.options = tuple(found.values())

    def __init__(self, **values):
        known = {o.name: o for o in self.options}
        unknown = set(values) - set(known)
        if unknown:
            raise TypeError(f"{self.name} has no option {', '.join(sorted(unknown))}")
        object.__setattr__(self, "_values", {k: values.get(k, o.default) for k, o in known.items()})

    @classmethod
    def defaults(cls) -> dict:
        return {o.name: o.default for o in cls.options}

    def values(self) -> Mapping[str, Any]:
        """The options' values, read-only."""
        return MappingProxyType(self._values)

    def replace(self, **changes) -> Method:
        return type(self)(**{**self._values, **changes})

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._values == self._values

    def __hash__(self) -> int:
        return hash((type(self), tuple(self._values.items())))

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"{type(self).__name__}({opts})"

    # -- derived from the above unless a method says otherwise --
    @property
    def protected(self) -> int:
        """P: tokens the selection always keeps (sinks + newest), the floor of any budget."""
        return self.sinks + self.newest

    @property
    def evicts_at_decode(self) -> bool:
        """Single tokens leave at decode steps (a quantized body cannot lose one)."""
        return "step" in self.points

    @property
    def per_layer(self) -> bool:
        return self.scope == "layer"

    def kept_recent(self, budget: int) -> int:
        """The newest slots kept at a layer budget (by default the `newest` always kept)."""
        return self.newest

    def budgets(self, budget: int, n: int, n_layers: int) -> list[int]:
        """Per-layer budgets for a mean `budget` over `n` slots (an allocator overrides it)."""
        return [budget] * n_layers

    def check(self, budget) -> None:
        """Rules across options and the budget beyond each option's own (raises KvrunError)."""

    def slot_bytes(self, config) -> int:
        """Bytes per held slot beyond dense K and V (positions, scores), for `nbytes`."""
        return 0

    def nbytes(self, kv) -> int:
        """The spec's byte formula from what `kv` holds (counts, never its tensors): per layer,
        dense slots at 2 * Hkv * D * e + slot_bytes, a KIVI store by its formula. A method
        with a cache of its own overrides it (kvrun/kv/bytes.py has the parts)."""
        return composed(kv, self.slot_bytes(kv.config) + 4 * getattr(kv, "window_rows", 0))

    def make_cache(self, spec: KVSpec, config, rope, device, dtype, **kw):
        """The method's own cache (`cache`), built for `spec`."""
        import importlib
        import sys

        module, _, cls = self.cache.partition(":")
        anchor = sys.modules[type(self).__module__].__package__
        return getattr(importlib.import_module(module, anchor), cls)(
            spec, config, rope, device, dtype, **kw
        )


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
    """A validated --kv: one selection and at most one store, each a configured Method, and
    the --kv-budget."""

    select: Method
    store: Method | None = None
    budget: Budget | None = None
    # --kv-dtype: the dense store's element type (f32 f16 bf16 q8_0 q4_0), "auto" (f16 on the
    # CPU as llama.cpp's cache, the model's dtype elsewhere) or None (the model's dtype)
    dtype: str | None = None

    @property
    def select_opts(self) -> Mapping[str, Any]:
        return self.select.values()

    @property
    def store_opts(self) -> Mapping[str, Any]:
        return self.store.values() if self.store else MappingProxyType({})

    @property
    def keeps_all(self) -> bool:
        """The selection keeps every token as the driver stores it (full)."""
        return self.select.score is None and not self.select.cache

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
        return self.select.protected

    def budget_or_default(self) -> Budget | None:
        """The budget the selection runs at: --kv-budget, else the method's default."""
        if self.budget is not None:
            return self.budget
        d = self.select.default_budget
        return Budget.parse(d) if d is not None else None

    def kivi(self) -> dict | None:
        """KIVI layout {bits, group, residual} (a stacked store's over the selection's), or None
        where nothing is quantized (none, or bits=16)."""
        kv = self.store.kivi if self.store else self.select.kivi
        return kv if kv is not None and kv["bits"] != 16 else None

    def with_budget(self, budget: str | float | Budget | None) -> KVSpec:
        """This spec at another --kv-budget, checked against the method's budget rules."""
        b = budget if budget is None or isinstance(budget, Budget) else Budget.parse(budget)
        sel = self.select
        if b is not None and not sel.takes_budget:
            if sel.budget_refused:
                raise KvrunError(sel.budget_refused)
            b = None  # nothing is selected: the budget is ignored
        sel.check(b)
        if b is not None:
            b.check(self.protected, sel.name)
        return dataclasses.replace(self, budget=b)

    def with_dtype(self, dtype: str | None) -> KVSpec:
        """This spec with --kv-dtype (checked: one of kvtypes.NAMES, or auto)."""
        if dtype is not None and dtype != "auto":
            from .stores.kvtypes import parse as parse_dtype

            dtype = parse_dtype(dtype)
        return dataclasses.replace(self, dtype=dtype)

    def dtype_on(self, device) -> str | None:
        """The element type the dense store keeps on `device` (None: the model's dtype); auto
        is f16 on the CPU, the model's dtype on CUDA (its kernels read the model's dtype)."""
        if self.dtype != "auto":
            return self.dtype
        return "f16" if str(device).startswith("cpu") else None

    def describe(self) -> dict:
        out = {"method": self.name, **self.select_opts}
        if self.store:
            out.update(self.store_opts)
        return out


def _options(cls: type[Method], name: str, text: str) -> dict:
    """NAME's `key=value,...` as option values (older spellings mapped to the current ones)."""
    known = {o.name: o for o in cls.options}
    older = {o.was: o for o in cls.options if o.was}
    values = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key in older:  # accepted for one release: `kvrun kv list` shows the current name
            opt = older[key]
            key, value = opt.name, opt.was_values.get(value, value)
        if key not in known:
            valid = ", ".join(known) or "none"
            raise KvrunError(f"unknown option {key!r} for {name} (valid: {valid})")
        if not eq:
            raise KvrunError(f"option {name}:{key} needs a value ({key}=...)")
        values[key] = known[key].parse(name, value)
    return values


def parse(text: str, registry: Mapping[str, type[Method]], budget=None) -> KVSpec:
    """--kv (and --kv-budget) validated against the registry, errors as one-line KvrunErrors; a
    spec naming no selection runs the registry's first (full)."""
    select: Method | None = None
    store: Method | None = None
    for raw in str(text).split("+"):
        name, _, opts_text = raw.strip().partition(":")
        name = name.strip().lower()
        cls = registry.get(name)
        if cls is None:
            raise KvrunError(
                f"unknown KV method {name!r} (available: {', '.join(registry)}; see `kvrun kv list`)"
            )
        part = cls(**_options(cls, name, opts_text))
        if part.kind == "select":
            if select is not None:
                names = lambda kind: [m.name for m in registry.values() if m.kind == kind]  # noqa: E731
                raise KvrunError(
                    f"cannot stack two selection methods ({select.name} and {name}); stack "
                    f"one selection ({', '.join(names('select'))}) with one store "
                    f"({'/'.join(names('store'))})"
                )
            select = part
        else:
            if store is not None:
                raise KvrunError(f"cannot stack two stores ({store.name} and {name})")
            store = part
    sel = select or next(iter(registry.values()))()
    if store and sel.own_store:
        raise KvrunError(
            f"{sel.name} cannot be stacked with {store.name}: it has its own store ({sel.own_store})"
        )
    if sel.critical and sel.scope == "layer":
        raise KvrunError(
            f"{sel.name}:critical=1 weighs each KV head's values: use scope=head or adaptive"
        )
    if store and sel.scope == ADAPTIVE:
        raise KvrunError(
            f"{sel.name}:scope=adaptive cannot be stacked with {store.name}: its heads hold "
            "different counts, padded and masked by position, which a KIVI body cannot mask; "
            f"use {sel.name}:scope=head+{store.name}"
        )
    if store and sel.evicts_at_decode and store.kivi["bits"] != 16:
        raise KvrunError(
            f"{sel.name}+{store.name} is not supported: decode-time eviction cannot remove "
            "single tokens from a quantized body; use snapkv or pyramidkv with a KIVI store"
        )
    spec = KVSpec(sel, store)
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
