"""A selection method's recipe: the parts its cache runs, built from its declaration.

A `Method` (kvrun/kv/methods/) declares its axes as values (scorer, selector, allocator); the
recipe turns them into parts that act:

- a Scoring part decides how each step attends and what the attention records for the
  selector: nothing, the observation window's queries (SnapKV §4.2), column sums over every
  query so far (H2O §3), or over the turn's prompt queries only (MiniKV §3.1.1). Scores
  come out of the same pass that computes attention, so the scorer owns that pass;
- a Selection part (kvrun/kv/selection.py) decides which tokens stay and at which
  compression points it runs ("chunk", "prefill", "step"), asking its Allocator part how
  many tokens each layer keeps (uniform, PyramidKV's arithmetic schedule, MiniKV's pyramid
  of heavy hitters, SpindleKV's falling schedule); MiniCache's part merges layer pairs and
  picks the rows retained exactly;
- the store is the layer's (kvrun/kv/protocol.py): a DenseSeg or the KIVI store of a stack
  (CompressedKV), a CodedLayer (SpindleKV), a pair (MiniCache).

CompressedKV calls `recipe.scoring.prefill/decode` on every step and `recipe.selection.run`
at the points it names; no method name appears in either. SpindleKV and MiniCache attend
through their own stores (pre-RoPE codebooks, merged pairs) and run the same selection
parts at their points. XKV (kvrun/kv/xkv.py) plans its own per-layer budgets: its
selection part hands the point to the XKV manager's planner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.dense_decode import dense_decode
from .attention import combine
from .method import Allocator, Scorer, Selector
from .select import attention_colsum, group_sum, prompt_colsum
from .selection import (
    Evict,
    HeavyRecent,
    MergePairs,
    Planned,
    Pyramid,
    QHeadUnion,
    Selection,
    Uniform,
    WindowTopK,
)


# --- scoring: how a step attends and what it records ------------------------------------------
class Scoring:
    """No scores: append and attend (a stack whose selection keeps all goes straight to its
    store)."""

    scores = False  # the dense segment accumulates column sums
    prompt_only = False  # scores come from the turn's prompt; the store then only grows

    def prefill(self, kv, st, q, k, v, positions) -> torch.Tensor:
        if st.kivi is not None and kv.recipe.selection.keeps_all:  # nothing to select
            return kv.to_store(st, q, k, v)
        self.observe(kv, st, q)
        return self.attend(kv, st, q, k, v, positions)

    def decode(self, kv, st, q, k, v, positions) -> torch.Tensor:
        if st.kivi is not None:  # decode tokens go straight into the store
            return kv.to_store(st, q, k, v)
        return self.attend(kv, st, q, k, v, positions)

    def observe(self, kv, st, q) -> None:
        """What a prefill chunk's queries leave for the selector (nothing here)."""

    def attend(self, kv, st, q, k, v, positions) -> torch.Tensor:
        """Append to the dense segment and attend over it (and the KIVI store's earlier
        tokens, merged by log-sum-exp)."""
        T, window, d = k.shape[2], kv.config.sliding_window, st.dense
        d.append(k, v, positions)
        if st.kivi is not None and st.kivi.length:
            parts = st.kivi.partials(q, positions, 0, window) + d.partials(q, positions, T, window)
            return combine(parts, kv.dtype)
        return d.attend(q, positions, T, window)


class WindowVotes(Scoring):
    """The last `window` prompt queries are kept (per layer) to vote at selection time."""

    def observe(self, kv, st, q) -> None:
        prev = st.qwin if st.qwin is not None else q.new_empty(q.shape[1], 0, q.shape[3])
        st.qwin = torch.cat([prev, q[0]], dim=1)[:, -kv.opt["window"] :]


class Cumulative(Scoring):
    """Attention column sums accumulated over every query (prefill and decode), per KV head."""

    scores = True

    def attend(self, kv, st, q, k, v, positions) -> torch.Tensor:
        T, d = k.shape[2], st.dense
        d.append(k, v, positions)
        mask = d.mask(positions, T, kv.config.sliding_window)
        if T == 1 and mask is None and q.is_cuda:  # a decode step: one kernel, probabilities out
            out, _, p = dense_decode(q, d.k, d.v, return_probs=True)
            d.acc += group_sum(p[0, :, 0], d.k.shape[1])
            return out.to(kv.dtype)
        out, col = attention_colsum(q, d.k, d.v, mask)
        d.acc += col
        return out.to(kv.dtype)


class PromptColsum(Scoring):
    """MiniKV: the turn's tokens staged with column sums over every prompt query, attending
    over earlier turns as stored; decode appends to the store, flushing a full residual
    before attention (§3.1.1, Alg. 1); dense held turns with quant=none."""

    scores = True
    prompt_only = True

    def prefill(self, kv, st, q, k, v, positions) -> torch.Tensor:
        st.dense.append(k, v, positions)
        if st.kivi is not None and st.kivi.length:
            older = st.kivi.partials(q, positions, 0, None)
        elif st.held is not None and st.held.length:
            older = st.held.partials(q, positions, 0, None)
        else:
            older = []
        d = st.dense
        part, col = prompt_colsum(q, d.k, d.v, older, kv.opt["gqa_agg"] == "max",
                                  kv.opt["colsum"])  # fmt: skip
        d.acc += col
        return combine(older + [part], kv.dtype)

    def decode(self, kv, st, q, k, v, positions) -> torch.Tensor:
        if st.kivi is None:
            st.held.append(k, v, positions)
            return combine(st.held.partials(q, positions, k.shape[2], None), kv.dtype)
        st.kivi.append(k[0], v[0])
        r = kv.kivi_cfg["residual"]
        if st.kivi.tail_len >= r:
            st.kivi.flush(r)
        return combine(st.kivi.partials(q, positions, k.shape[2], None), kv.dtype)


# --- the recipe ---------------------------------------------------------------------------------
SCORING = {Scorer.NONE: Scoring(), Scorer.WINDOW: WindowVotes(), Scorer.CUMULATIVE: Cumulative(),
           Scorer.PROMPT: PromptColsum()}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Recipe:
    """A method's parts. Scoring parts are stateless and shared; a selection part is made per
    cache (its allocator is stateless too: per-turn plans live on the cache)."""

    scoring: Scoring
    selection: Selection


def recipe_of(method, opts) -> Recipe:
    """The parts of a selection Method under its validated options."""
    chunked = bool(opts.get("chunked"))
    if method.selector == Selector.ALL:
        selection = Selection()
    elif method.selector == Selector.MERGE_PAIRS:
        selection = MergePairs()
    elif method.evicts_at_decode:
        selection = Evict(by_score=method.selector != Selector.SINKS_RECENT)
    elif method.scorer == Scorer.PROMPT:  # heavy hitters per layer from MiniKV's allocator
        selection = HeavyRecent()
    elif method.allocator == Allocator.XKV:
        selection = Planned(chunked)
    elif method.allocator == Allocator.SPINDLE:  # per query head, a codebook store
        selection = QHeadUnion()
    else:
        alloc = Pyramid() if method.allocator == Allocator.PYRAMID else Uniform()
        selection = WindowTopK(alloc, chunked)
    return Recipe(SCORING[method.scorer], selection)
