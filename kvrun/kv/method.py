"""A KV method as one declaration: its axes, options, budget rules and how it is built.

Each file in kvrun/kv/methods/ declares one `Method` (two where a preset shares the code);
kvrun/kv/methods/__init__.py lists them. The grammar (kvrun/kv/spec.py), `kvrun kv list`,
budget checks and `kvrun.kv.build` read only these fields, so no method name appears
anywhere else as program logic. Torch-free: managers are imported when built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .options import Option


class Scorer:
    """What a selection scores tokens by (the first axis)."""

    NONE = "none"
    WINDOW = "window"  # the last w prompt queries' attention (SnapKV §4.2)
    CUMULATIVE = "cumulative"  # attention summed over every query so far (H2O §3)
    PROMPT = "cumulative (prompt)"  # summed over the turn's prompt queries only (MiniKV §3)


class Selector:
    """How the kept tokens are picked from the scores."""

    ALL = "all"  # nothing is evicted
    SINKS_RECENT = "sinks+recent"  # by position alone, the same for every head
    TOPK_RECENT = "topk+recent"
    TOPK_WINDOW = "topk+window"
    TOPK_WINDOW_QHEAD = "topk+window (per query head)"
    MERGE_PAIRS = "merge layer pairs, retain distinct rows"  # MiniCache §4: nothing evicted


class Allocator:
    """How many tokens each layer keeps (the second axis)."""

    UNIFORM = "uniform"
    PYRAMID = "pyramid"  # PyramidKV's arithmetic schedule
    MINIKV_PYRAMID = "pyramid (MiniKV)"
    XKV = "xkv"
    SPINDLE = "spindle"


def _zero(opts: Mapping[str, Any]) -> int:
    return 0


def _none(opts: Mapping[str, Any]) -> dict | None:
    return None


def _no_rule(opts: Mapping[str, Any], budget) -> None:
    return None


def manager(module: str, name: str) -> Callable[..., Any]:
    """A `build` making kvrun.kv.<module>.<name>(spec, config, rope, device, dtype, **kw),
    imported on first use (the registry stays torch-free)."""

    def build(spec, config, rope, device, dtype, **kw):
        cls = getattr(importlib.import_module(f"kvrun.kv.{module}"), name)
        return cls(spec, config, rope, device, dtype, **kw)

    return build


# CompressedKV: the manager composed from scorer, selector, allocator and store parts
composed = manager("manager", "CompressedKV")


@dataclass(frozen=True, slots=True)
class Method:
    """One named part of --kv: a selection method ('select') or a store ('store')."""

    name: str
    kind: str  # "select" | "store"
    summary: str
    # the three axes (values of the classes above; `kvrun kv list` shows them as they are, and
    # kvrun/kv/recipe.py turns them into the parts a CompressedKV runs)
    scorer: str = Scorer.NONE
    selector: str = Selector.ALL
    allocator: str = Allocator.UNIFORM
    store: str = "dense"  # dense | kivi | kivi 2-bit | merged | codebook (display only)
    when: str = "never"  # when it compresses (display only; behaviour: evicts_at_decode)
    options: tuple[Option, ...] = ()
    # P: tokens the selection always keeps (sinks + window), the floor of any budget
    protected: Callable[[Mapping[str, Any]], int] = _zero
    # whether --kv-budget means anything (grids run the others once); `budget_refused` is the
    # error when one is given to a method that takes none (empty: the budget is ignored)
    takes_budget: bool = True
    budget_refused: str = ""
    default_budget: str | None = "0.2"  # B when --kv-budget is not given (None: the method's own)
    # cross-option and budget rules beyond each option's own (raises KvrunError)
    rule: Callable[[Mapping[str, Any], Any], None] = _no_rule
    # evicts single tokens at decode steps (a quantized body cannot lose one)
    evicts_at_decode: bool = False
    # a selection that brings its own store: stacking a store part is refused with this text
    own_store: str = ""
    # the KIVI layout {bits, group, residual} this part stores in, or None
    kivi: Callable[[Mapping[str, Any]], dict | None] = _none
    # options under which a budget covering every token (or, with no default budget, the
    # options alone) reproduce the full cache (no quantization, no merging): what
    # tests/test_kv_contract.py checks for every method
    lossless: str = ""
    # (spec, config, rope, device, dtype, **kw) -> the KV manager that runs it (imports lazily)
    build: Callable[..., Any] = composed
    # (spec, manager) -> the bytes the method's spec formula gives from what the cache holds
    # (kvrun/kv/bytes.py): a selection declares it, pricing any store stacked under it, and
    # tests/test_kv_contract.py holds nbytes() to it; a store part leaves it None
    nbytes: Callable[[Any, Any], int] | None = None

    def defaults(self) -> dict:
        return {o.name: o.default for o in self.options}
