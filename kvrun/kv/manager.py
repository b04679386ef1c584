"""CompressedKV: one manager for every recipe, composed from the parts of kvrun.kv.

Selection (scorer + selector + allocator) runs at the points the recipe names
(prefill-chunk ends, end_prefill, decode steps); the store (dense, or KIVI with a dense
staging area during a prefill that selects) holds the kept tokens and attends over its own
segments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import KvrunError
from ..kernels.dense_decode import dense_decode
from .alloc.minikv import minikv_budgets
from .attention import combine
from .budget import pyramid_budgets
from .cache import KVCache
from .dense import DenseSeg
from .method import Allocator, Scorer, Selector
from .select import (
    attention_colsum,
    evict_indices,
    group_sum,
    heavy_recent_indices,
    prompt_colsum,
    window_indices,
)
from .spec import KVSpec
from .static import StaticDecode

# on_select(layer, point, positions (Hkv, T)): the debug hook reporting the positions kept at
# each compression point (the report lives outside the cache and is not counted in nbytes)
SelectHook = Callable[[int, str, torch.Tensor], None]


@dataclass(slots=True)
class _Layer:
    dense: DenseSeg  # staging (selection pending) or the whole dense store
    kivi: Any  # the KIVI store (KiviLayer) of a stack, or None
    held: DenseSeg | None = None  # MiniKV quant=none: the selected turns, apart from staging
    qwin: torch.Tensor | None = None  # (Hq, <=w, D) last prefill queries (SnapKV)


class CompressedKV(StaticDecode, KVCache):
    """A KV manager built from a validated KVSpec (--kv and --kv-budget)."""

    def __init__(self, spec: KVSpec, config, rope, device, dtype,
                 on_select: SelectHook | None = None):  # fmt: skip
        super().__init__(config, rope, device, dtype)
        self.spec = spec
        self.sel, self.opt = spec.select, spec.select_opts
        self.protected = spec.protected
        self.budget = spec.budget_or_default()  # None: full, or MiniKV's heavy/recent fractions
        self.kivi_cfg = spec.kivi()  # {bits, group, residual} or None
        self.kivi_bits = self.kivi_cfg["bits"] if self.kivi_cfg else 16
        # MiniKV: prompt-only column sums, selection once per turn at end_prefill, then a store
        # that only grows (MiniKV §3.1.1); its budget comes from heavy/recent unless given
        self.minikv = self.sel.scorer == Scorer.PROMPT
        self.user_budget = spec.budget
        if self.minikv and self.opt["colsum"] == "triton" and torch.device(device).type != "cuda":
            raise KvrunError(
                f"{spec.name}:colsum=triton needs a CUDA GPU; use colsum=auto or chunked on CPU"
            )
        self.decode_time = self.sel.evicts_at_decode
        # positions are stored, and counted in nbytes, only where a later step needs them
        # (one row when the selection is the same for every head, as by recency)
        shared = self.sel.selector == Selector.SINKS_RECENT
        self.pos_rows = (1 if shared else config.n_kv_heads) if self.decode_time else 0
        self.count_pos = self.pos_rows > 0
        self.on_select = on_select
        if on_select is not None and not self.pos_rows:
            self.pos_rows = config.n_kv_heads  # a debug record outside the cache, not counted
        self.name = spec.name
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        super().reset()
        c, dt, dev = self.config, self.dtype, self.device
        held = self.minikv and self.kivi_cfg is None
        self.layers = [
            _Layer(self._dense(), self._kivi(), DenseSeg(c.n_kv_heads, c.head_dim, dt, dev) if held else None)
            for _ in range(c.n_layers)
        ]  # fmt: skip

    def _dense(self) -> DenseSeg:
        """A layer's dense segment: positions where a later step needs them, and column sums
        for the cumulative scorers (per query head with MiniKV's gqa_agg=max)."""
        c = self.config
        per_q = self.minikv and self.opt["gqa_agg"] == "max"
        return DenseSeg(c.n_kv_heads, c.head_dim, self.dtype, self.device, self.pos_rows,
                        scores=self.sel.scorer in (Scorer.CUMULATIVE, Scorer.PROMPT),
                        score_rows=c.n_heads if per_q else None,
                        count_pos=self.count_pos)  # fmt: skip

    def _kivi(self):
        if self.kivi_bits == 16:
            return None
        from .kivi import KiviLayer

        return KiviLayer.of(self.kivi_cfg, self.config, self.dtype, self.device, self.spec.name)

    # ------------------------------------------------------------ prefill, decode
    def _layer(self, layer: int, T: int) -> _Layer:
        """The layer's state; methods that keep no positions refuse a sliding window past its
        length (the model would need to mask slots by position)."""
        st, window = self.layers[layer], self.config.sliding_window
        if window and self.seen + T > window and (st.dense.pos is None or self.minikv):
            raise KvrunError(
                f"--kv {self.name} cannot run sliding-window attention past {window} tokens "
                "(it keeps no positions); use --kv full, streaming or h2o, or a shorter input"
            )
        return st

    def prefill(self, layer, q, k, v, positions):
        st = self._layer(layer, k.shape[2])
        if self.minikv:
            return self._prefill_minikv(st, q, k, v, positions)
        if st.kivi is not None and self.sel.selector == Selector.ALL:  # nothing to select
            return self._to_store(st, q, k, v)
        if self.sel.scorer == Scorer.WINDOW:  # the observation window: the last w queries
            prev = st.qwin if st.qwin is not None else q.new_empty(q.shape[1], 0, q.shape[3])
            st.qwin = torch.cat([prev, q[0]], dim=1)[:, -self.opt["window"] :]
        return self._dense_step(st, q, k, v, positions)

    def decode(self, layer, q, k, v, positions):
        st = self._layer(layer, k.shape[2])
        if self.minikv:
            return self._decode_minikv(st, q, k, v, positions)
        if st.kivi is not None:  # decode tokens go straight into the store
            return self._to_store(st, q, k, v)
        return self._dense_step(st, q, k, v, positions)

    def _to_store(self, st: _Layer, q, k, v) -> torch.Tensor:
        st.kivi.append(k[0], v[0])
        return combine(st.kivi.partials(q, None, k.shape[2], None), self.dtype)

    def _dense_step(self, st: _Layer, q, k, v, positions) -> torch.Tensor:
        """Append to the dense segment and attend over it (and the KIVI store's earlier
        tokens): with column sums for the cumulative scorer (H2O)."""
        T, window, d = k.shape[2], self.config.sliding_window, st.dense
        d.append(k, v, positions)
        if self.sel.scorer == Scorer.CUMULATIVE:
            mask = d.mask(positions, T, window)
            if T == 1 and mask is None and q.is_cuda:  # H2O decode: one kernel, probabilities out
                out, _, p = dense_decode(q, d.k, d.v, return_probs=True)
                d.acc += group_sum(p[0, :, 0], d.k.shape[1])
                return out.to(self.dtype)
            out, col = attention_colsum(q, d.k, d.v, mask)
            d.acc += col
            return out.to(self.dtype)
        if st.kivi is not None and st.kivi.length:
            parts = st.kivi.partials(q, positions, 0, window) + d.partials(q, positions, T, window)
            return combine(parts, self.dtype)
        return d.attend(q, positions, T, window)

    def _decode_minikv(self, st: _Layer, q, k, v, positions) -> torch.Tensor:
        """MiniKV decode: append to the store, flushing a full residual before attention
        (§3.1.1, Alg. 1); dense held turns with quant=none."""
        if st.kivi is None:
            st.held.append(k, v, positions)
            return combine(st.held.partials(q, positions, k.shape[2], None), self.dtype)
        st.kivi.append(k[0], v[0])
        r = self.kivi_cfg["residual"]
        if st.kivi.tail_len >= r:
            st.kivi.flush(r)
        return combine(st.kivi.partials(q, positions, k.shape[2], None), self.dtype)

    def _prefill_minikv(self, st: _Layer, q, k, v, positions) -> torch.Tensor:
        """MiniKV prefill: this turn's tokens staged with column sums over every prompt query,
        attending over the earlier turns as stored."""
        st.dense.append(k, v, positions)
        if st.kivi is not None and st.kivi.length:
            older = st.kivi.partials(q, positions, 0, None)
        elif st.held is not None and st.held.length:
            older = st.held.partials(q, positions, 0, None)
        else:
            older = []
        d = st.dense
        part, col = prompt_colsum(q, d.k, d.v, older, self.opt["gqa_agg"] == "max",
                                  self.opt["colsum"])  # fmt: skip
        d.acc += col
        return combine(older + [part], self.dtype)

    # ------------------------------------------------------- compression points
    def begin_prefill(self, n_tokens: int) -> None:
        super().begin_prefill(n_tokens)
        for st in self.layers:
            st.qwin = None

    def at_chunk(self, n_tokens: int) -> None:
        if self.decode_time:
            self._evict("chunk")
        elif self.sel.scorer == Scorer.WINDOW and self.opt.get("chunked"):
            self._select_window("chunk")
        if self.layers[0].kivi is not None and self.sel.selector == Selector.ALL:
            unit = self.kivi_cfg["residual"]
            for st in self.layers:
                st.kivi.flush(unit)

    def at_prefill(self) -> None:
        if self.sel.scorer == Scorer.WINDOW:
            self._select_window("prefill")
        if self.minikv:
            self._select_minikv("prefill")
        # MiniKV quantizes whole groups of the kept tokens (flush unit G); other stacks whole
        # residuals, keeping the newest tokens dense
        unit = self.kivi_cfg["group" if self.minikv else "residual"] if self.kivi_cfg else 0
        for st in self.layers:
            st.qwin = None
            if st.kivi is not None and st.dense.length:
                k, v = st.dense.take()  # selected tokens enter the store in position order
                st.kivi.append(k[0], v[0])
                st.kivi.flush(unit)
            elif st.held is not None and st.dense.length:
                st.held.append(*st.dense.take(), torch.empty(0))

    def at_step(self) -> None:
        if self.decode_time:
            self._evict("step")
        if self.layers[0].kivi is not None:
            r = self.kivi_cfg["residual"]
            for st in self.layers:
                if st.kivi.tail_len >= r:
                    st.kivi.flush(r)

    # -------------------------------------------------------------- selection
    def _report(self, layer: int, point: str) -> None:
        if self.on_select is not None:
            pos = self.layers[layer].dense.pos
            self.on_select(layer, point, pos.expand(self.config.n_kv_heads, -1).clone())

    def _evict(self, point: str) -> None:
        """Decode-time eviction (streaming, h2o) down to B(n) in every layer."""
        n = self.seen
        B = self.budget.tokens(n, self.protected)
        for i, st in enumerate(self.layers):
            d = st.dense
            if d.length > B:
                recent = None if self.sel.selector == Selector.SINKS_RECENT else self.opt["recent"]
                d.keep(evict_indices(d.pos, d.acc, n, B, self.opt["sinks"], recent))
            self._report(i, point)

    def _select_minikv(self, point: str) -> None:
        """Heavy hitters by the turn's column sums + the recent window, per KV head, once."""
        t = self.layers[0].dense.length
        hh, n_rw = minikv_budgets(self.opt, self.user_budget, t, self.config.n_layers)
        norm = self.opt["score_norm"] == "length"
        for i, st in enumerate(self.layers):
            if hh[i] + n_rw < t:
                st.dense.keep(
                    heavy_recent_indices(st.dense.acc, hh[i], n_rw, self.config.n_kv_heads, norm)
                )
            self._report(i, point)

    def _select_window(self, point: str) -> None:
        """SnapKV / PyramidKV selection over the dense slots of every layer."""
        w = self.opt["window"]
        # dense store: select over all slots, budget from all tokens seen; KIVI store: only the
        # new tokens held in staging, with the same rule (kvrun's rule for later chat turns)
        T = self.layers[0].dense.length
        n = T if self.layers[0].kivi is not None else self.seen
        B = self.budget.tokens(n, self.protected)
        L = self.config.n_layers
        pyramid = self.sel.allocator == Allocator.PYRAMID
        budgets = pyramid_budgets(B, T, w, L, self.opt["beta"]) if pyramid else [B] * L
        for i, st in enumerate(self.layers):
            d, Bl = st.dense, budgets[i]
            if d.length > Bl and st.qwin is not None:
                d.keep(window_indices(st.qwin, d.k[0], Bl, self.opt["kernel"], self.opt["pool"]))
            self._report(i, point)

    # ------------------------------------------------------------- accounting
    def nbytes(self) -> int:
        total = 0
        for st in self.layers:
            total += st.dense.nbytes()
            if st.held is not None:
                total += st.held.nbytes()
            if st.kivi is not None:
                total += st.kivi.nbytes()
            if st.qwin is not None:  # SnapKV's saved window queries count while held (0.6)
                total += st.qwin.numel() * st.qwin.element_size()
        return total

    def describe(self) -> dict:
        d = self.spec.describe()
        if self.minikv and self.opt["report"] == "paper":
            # MiniKV App. I: (layers x hidden) bytes per kept or generated token, MHA, 2-bit,
            # residual ignored; logged beside the measured bytes for comparison only
            c = self.config
            d["bytes_paper"] = sum(self.kept_counts()) * c.n_heads * c.head_dim
        if (b := self.budget) is not None:
            d["budget"] = float(b.value) if b.is_fraction else int(b.value)
        return d

    def stores(self) -> list:
        return [s for st in self.layers for s in (st.dense, st.kivi, st.held) if s is not None]

    def kept_counts(self) -> list[int]:
        """Slots held per layer (dense + store), for tests and `kvrun bench`."""
        parts = lambda st: (st.dense, st.kivi, st.held)  # noqa: E731
        return [sum(s.length for s in parts(st) if s is not None) for st in self.layers]
