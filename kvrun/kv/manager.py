"""CompressedKV: one manager for every recipe, composed from the parts of kvrun.kv.

Its Recipe (kvrun/kv/recipe.py) supplies the parts: the scoring part runs every step's
attention, the selection part (selector + allocator) runs at the points it names
(prefill-chunk ends, end_prefill, decode steps). The store (dense, or KIVI with a dense
staging area during a prefill that selects) holds the kept tokens and attends over its own
segments. No method name appears here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import KvrunError
from .attention import combine
from .cache import KVCache
from .dense import DenseSeg
from .recipe import recipe_of
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
        self.recipe = recipe_of(self.sel, self.opt)
        # prompt-only scores (MiniKV): selection once per turn at end_prefill, then a store
        # that only grows (MiniKV §3.1.1); its budget comes from heavy/recent unless given
        self.prompt_only = self.recipe.scoring.prompt_only
        self.user_budget = spec.budget
        if self.opt.get("colsum") == "triton" and torch.device(device).type != "cuda":
            raise KvrunError(
                f"{spec.name}:colsum=triton needs a CUDA GPU; use colsum=auto or chunked on CPU"
            )
        self.decode_time = "step" in self.recipe.selection.points
        # positions are stored, and counted in nbytes, only where a later step needs them
        # (one row when the selection is the same for every head, as by recency)
        self.pos_rows = self.recipe.selection.position_rows(config.n_kv_heads)
        self.count_pos = self.pos_rows > 0  # rows held only for the debug hook: not counted
        self.on_select = on_select
        if on_select is not None and not self.pos_rows:
            self.pos_rows = config.n_kv_heads  # a debug record outside the cache, not counted
        self.name = spec.name
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        super().reset()
        c, dt, dev = self.config, self.dtype, self.device
        held = self.prompt_only and self.kivi_cfg is None
        self.layers = [
            _Layer(self._dense(), self._kivi(), DenseSeg(c.n_kv_heads, c.head_dim, dt, dev) if held else None)
            for _ in range(c.n_layers)
        ]  # fmt: skip

    def _dense(self) -> DenseSeg:
        """A layer's dense segment: positions where a later step needs them, and column sums
        for the cumulative scorers (per query head with MiniKV's gqa_agg=max)."""
        c = self.config
        per_q = self.prompt_only and self.opt["gqa_agg"] == "max"
        return DenseSeg(c.n_kv_heads, c.head_dim, self.dtype, self.device, self.pos_rows,
                        scores=self.recipe.scoring.scores,
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
        if window and self.seen + T > window and (st.dense.pos is None or self.prompt_only):
            raise KvrunError(
                f"--kv {self.name} cannot run sliding-window attention past {window} tokens "
                "(it keeps no positions); use --kv full, streaming or h2o, or a shorter input"
            )
        return st

    def prefill(self, layer, q, k, v, positions):
        st = self._layer(layer, k.shape[2])
        return self.recipe.scoring.prefill(self, st, q, k, v, positions)

    def decode(self, layer, q, k, v, positions):
        st = self._layer(layer, k.shape[2])
        return self.recipe.scoring.decode(self, st, q, k, v, positions)

    def to_store(self, st: _Layer, q, k, v) -> torch.Tensor:
        """Append to the KIVI store of a stack and attend over it."""
        st.kivi.append(k[0], v[0])
        return combine(st.kivi.partials(q, None, k.shape[2], None), self.dtype)

    # ------------------------------------------------------- compression points
    def begin_prefill(self, n_tokens: int) -> None:
        super().begin_prefill(n_tokens)
        for st in self.layers:
            st.qwin = None

    def at_chunk(self, n_tokens: int) -> None:
        sel = self.recipe.selection
        if "chunk" in sel.points:
            sel.run(self, "chunk")
        if self.layers[0].kivi is not None and sel.keeps_all:
            unit = self.kivi_cfg["residual"]
            for st in self.layers:
                st.kivi.flush(unit)

    def at_prefill(self) -> None:
        if "prefill" in self.recipe.selection.points:
            self.recipe.selection.run(self, "prefill")
        # prompt-only selections (MiniKV) quantize whole groups of the kept tokens (flush unit
        # G); other stacks whole residuals, keeping the newest tokens dense
        unit = self.kivi_cfg["group" if self.prompt_only else "residual"] if self.kivi_cfg else 0
        for st in self.layers:
            st.qwin = None
            if st.kivi is not None and st.dense.length:
                k, v = st.dense.take()  # selected tokens enter the store in position order
                st.kivi.append(k[0], v[0])
                st.kivi.flush(unit)
            elif st.held is not None and st.dense.length:
                st.held.append(*st.dense.take(), torch.empty(0))

    def at_step(self) -> None:
        if "step" in self.recipe.selection.points:
            self.recipe.selection.run(self, "step")
        if self.layers[0].kivi is not None:
            r = self.kivi_cfg["residual"]
            for st in self.layers:
                if st.kivi.tail_len >= r:
                    st.kivi.flush(r)

    def report(self, layer: int, point: str) -> None:
        """The selection debug hook: the positions a layer keeps after a compression point."""
        if self.on_select is not None:
            pos = self.layers[layer].dense.pos
            self.on_select(layer, point, pos.expand(self.config.n_kv_heads, -1).clone())

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
        if self.prompt_only and self.opt["report"] == "paper":
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
