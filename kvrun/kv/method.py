"""A KV method as one declaration: its options, budget rules and the callables that run it. A
scoring method is a declaration plus one `score(ctx)` (kvpress's shape) that the driver runs; one
that needs more gives `cache`. Torch-free: `--kv` is checked before torch is imported, so a method
module keeps torch out of its top level (its cache factory imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .options import Option

Opts = Mapping[str, Any]
NEVER: frozenset[str] = frozenset()


def _zero(*_) -> int:
    return 0


def _none(_: Opts) -> None:
    return None


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
    kivi: Callable[[Opts], dict | None] = _none
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
