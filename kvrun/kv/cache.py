"""KVCache: the driver every method runs under, naming none, with a dense or KIVI store per
(sequence, layer). Static decode (CUDA graphs): a token goes to slot position + (end - seen) of
its decode segment, a Python constant between compressions (a KIVI body's length changes only at
a flush, so a graph is recaptured once per R steps)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvrunError
from ..kernels.dense_decode import dense_decode
from .adaptive import OutProj, critical_scores, keep_adaptive
from .attention import attention_colsum, combine, dense_attention, group_sum
from .protocol import Ctx, KVManager, StaticSegment
from .spec import ADAPTIVE, KVSpec
from .state import Into, ListInto, Maybe, Tensor, state
from .stores import kvtypes
from .stores.dense import PAD, DenseSeg
from .stores.kivi import KiviLayer
from .stores.kvtypes import KVType


def keep_indices(scores: torch.Tensor, protected: torch.Tensor | None, k: int) -> torch.Tensor:
    """Kept slots (H, k), ascending, of scores (H, T) fp32: protected (H or 1, T) first, then the
    best, ties to the lower slot (position order: a stable sort is the rule of
    docs/methods/README.md §8)."""
    if protected is not None:
        scores = scores.masked_fill(protected, float("inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=-1).values


@state(dense=Into(), kivi=Into(), queries=Maybe(Tensor("kv", ("Hq", "w", "D"))))
@dataclass(slots=True, eq=False)
class Layer:
    """One layer of one sequence."""

    dense: DenseSeg  # the dense store, or a KIVI stack's staging area
    kivi: KiviLayer | None  # the KIVI store, or None
    queries: torch.Tensor | None = None  # (Hq, <=w, D) the newest queries, for score()
    probs: torch.Tensor | None = None  # (Hq, T) the step's attention, where kept (Ctx.probs)


@state(layers=ListInto())
class KVCache(KVManager):
    """The cache of a validated KVSpec (--kv and --kv-budget)."""

    def __init__(self, spec: KVSpec, config, rope, device, dtype, on_select=None, out_proj=None):
        super().__init__(config, rope, device, dtype, on_select)
        m, o = spec.select, spec.select_opts
        # CriticalKV (critical=1): the model's output projection, `out_proj(layer)` its o_proj
        self.out_proj = None
        if m.critical:
            if out_proj is None:
                raise KvrunError(
                    f"--kv {spec.name}:critical=1 needs the model's output projection "
                    "(kvrun.kv.build(..., out_proj=...); Runtime.new_kv passes it)"
                )
            self.out_proj = OutProj(out_proj, config.n_heads, config.head_dim)
        self.spec, self.name, self.method, self.opt = spec, spec.name, m, o
        self.protected = spec.protected
        self.budget = spec.budget_or_default()  # None: full, or a method's own default
        self.kivi_layout = spec.kivi()
        self.kv_type = self._kv_type(spec, dtype, device)
        # KIVI's scales, zeros and (on the CPU) tail in the KV dtype: f16 under auto
        self.kivi_scale_dtype = self.kivi_scales(spec, dtype, device)
        self.selects = not spec.keeps_all
        self.points = m.points
        self.n_queries = m.queries
        self.adaptive = m.scope == ADAPTIVE  # heads hold different counts (keep_adaptive)
        # full keeps every token at its position (slot = position), except under a sliding
        # window, whose layers hold at most the window's tokens (a ring, positions kept)
        self.slot_positions = spec.keeps_all and self.kivi_layout is None and not config.any_window
        self.pos_rows = self.position_rows()
        # the position rows a selection keeps only to mask (a sliding window, padded heads),
        # counted by Method.nbytes beyond the method's own slot_bytes
        self.window_rows = 0 if m.evicts_at_decode else self.pos_rows
        self.count_pos = self.pos_rows > 0  # rows held only for the debug hook: not counted
        if on_select is not None and not self.pos_rows:
            self.pos_rows = config.n_kv_heads
        self._cap = 0
        # decode rows that only store and attend (`attend`'s one-call path where it applies)
        one_call = self.kivi_layout is None and not config.any_window and not self.keys_pre_rope
        step_scores = m.cumulative or (self.n_queries == 1 and "step" in self.points)
        self._plain_decode = one_call and not step_scores
        # ... or that also keep the probabilities they attend with (a step's scores, cumulative
        # sums); not over padded heads (scope=adaptive): those native calls see every slot
        self._scored_decode = one_call and step_scores and not self.adaptive
        self.layers: list[Layer] = []
        self.reset()

    def attend(self, layer, q, k, v, positions):
        """A plain dense decode row (`plain_decode`) goes to the store in one native call;
        everything else as KVManager.attend says."""
        out = self.plain_decode(layer, q, k, v, positions)
        return out if out is not None else super().attend(layer, q, k, v, positions)

    def plain_decode(self, layer, q, k, v, positions, pos: int | None = None):
        """One decode row (q, k pre-RoPE) rotated, stored and attended in one native call
        (kvrun.kv.stores.dense.DenseSeg.rotate_append_attend), where that is all the step
        asks: native step kernels, no store, no scores or positions held, no per-step queries
        or sliding window (in any --kv-dtype); or where the step's probabilities are all it adds
        (a step's scores, cumulative sums: `rotate_append_probs`, float32 stores); or a KIVI
        store's row, where the step only appends to its tail (KiviLayer.rotate_append_attend).
        None where it does not apply."""
        st = self.layers[layer]
        if st.kivi is not None:
            return self._kivi_row(st, layer, q, k, v, positions, pos)
        d = st.dense
        if (
            d.kernels is None
            or k.shape[2] != 1
            or k.shape[0] != 1
            or self.in_prefill
            or self.static
            or q.dtype != torch.float32
        ):
            return None
        plain = self._plain_decode and d.pos is None and d.acc is None
        if not plain and not (self._scored_decode and d.native_scores(q)):
            return None
        if pos is None:
            pos = self.rope.position(positions)
        if plain:  # the store's own type (--kv-dtype) read natively
            return d.rotate_append_attend(self.rope.at(layer), q, k, v, pos)
        out, p, qr = d.rotate_append_probs(self.rope.at(layer), q, k, v, pos)
        if self.n_queries:  # the step's query and its probabilities score the step (select)
            st.queries, st.probs = qr[0], p
        return out  # float32, the model's dtype (native_scores)

    def _kivi_row(self, st: Layer, layer: int, q, k, v, positions, pos: int | None):
        """`decode`'s KIVI step (`_to_store`) in one native call where it applies."""
        if (
            st.kivi.kernels is None
            or k.shape[2] != 1
            or k.shape[0] != 1
            or q.dtype != torch.float32
            or self.in_prefill
            or self.static
            or self.keys_pre_rope
            or not self._store_row_ok(st)
        ):
            return None
        self._layer(layer, 1)  # a sliding window past the length is refused as in `decode`
        if pos is None:
            pos = self.rope.position(positions)
        return st.kivi.rotate_append_attend(self.rope.at(layer), q, k, v, pos)  # float32

    def _store_row_ok(self, st: Layer) -> bool:
        """Whether a decode row only appends to the layer's KIVI tail before it attends (a
        manager that flushes first says when it does)."""
        return True

    def position_rows(self) -> int:
        """Rows of int32 positions per slot (0, 1 or Hkv), held and counted only for decode-time
        eviction; a subclass that masks by position (padding) overrides it."""
        m = self.method
        rows = 1 if m.per_layer else self.config.n_kv_heads
        if self.adaptive:  # the padding of shorter heads is masked by position
            return rows
        if m.evicts_at_decode:
            return rows
        # a sliding window (Mistral's, Gemma 3's local layers) masks by position: a cache
        # whose slots are not positions keeps them too, counted (`window_rows`)
        return rows if self.config.any_window and not self.slot_positions else 0

    def reset(self) -> None:
        super().reset()
        old = self.layers  # dense buffers are rewound, not reallocated (a graph reads them)
        # Gemma 3's local layers hold no KIVI store: its body cannot mask a window by position,
        # so they stay dense, masked by their positions (the global layers quantize)
        local = set(self.config.local_layers or ()) if self.config.sliding_window else set()
        self.layers = [
            Layer(old[i].dense if old else self._dense(), None if i in local else self._kivi())
            for i in range(self.config.n_layers)
        ]
        for st in old:
            st.dense.rewind()

    def _kv_type(self, spec: KVSpec, dtype, device) -> KVType | None:
        """The dense store's element type under --kv-dtype (None: the model's dtype); a KIVI
        stack stages its turn in it too, as its tail is kept (half float32's peak on the CPU)."""
        return self.dense_kv_type(spec, dtype, device)

    def _dense(self) -> DenseSeg:
        c = self.config
        return DenseSeg(
            c.n_kv_heads,
            c.head_dim,
            self.dtype,
            self.device,
            self.pos_rows,
            scores=self.method.cumulative,
            count_pos=self.count_pos,
            kernels=self.rope.kernels,
            kv_type=self.kv_type,
        )

    def _kivi(self) -> KiviLayer | None:
        lay = self.kivi_layout
        return lay and KiviLayer.of(
            lay, self.config, self.dtype, self.device, self.name, self.rope.kernels,
            self.kivi_scale_dtype,
        )  # fmt: skip

    def _layer(self, layer: int, T: int) -> Layer:
        """The layer's state; a sliding window past the length needs positions to mask by."""
        st, window = self.layers[layer], self.config.window(layer)
        if window and self.seen + T > window and not self._window_ok(st):
            raise KvrunError(
                f"--kv {self.name} cannot run sliding-window attention past {window} tokens "
                "(it keeps no positions); use --kv full, streaming or h2o, or a shorter input"
            )
        return st

    def _window_ok(self, st: Layer) -> bool:
        """Whether the layer can mask a window: positions (or slot = position), no KIVI body."""
        return (st.dense.pos is not None or self.slot_positions) and st.kivi is None

    def prefill(self, layer, q, k, v, positions):
        st = self._layer(layer, k.shape[2])
        if st.kivi is not None and not self.selects:  # a store alone: nothing to select
            return self._to_store(st, q, k, v)
        if self.n_queries:  # the newest queries vote at selection (a window across chunks)
            prev = st.queries if st.queries is not None else q.new_empty(q.shape[1], 0, q.shape[3])
            st.queries = torch.cat([prev, q[0]], dim=1)[:, -self.n_queries :]
        return self._attend(st, q, k, v, positions, layer)

    def decode(self, layer, q, k, v, positions):
        st = self._layer(layer, k.shape[2])
        if st.kivi is not None:  # decode tokens go straight into the store
            return self._to_store(st, q, k, v)
        if self.n_queries and "step" in self.points:
            st.queries = q[0]  # (Hq, 1, D) the step's query scores the step's eviction
            native = st.dense.native_scores(q) and not self.adaptive  # padding: masked below
            if self.config.window(layer) is None and native:
                d = st.dense  # natively, the step's own probabilities score it (no 2nd pass)
                d.append(k, v, positions)
                out, st.probs = d.attend_probs(q)
                return out.to(self.dtype)
        window, d = self.config.window(layer), st.dense
        if window and d.pos is not None and d.length >= window and not self.method.cumulative:
            # the window's ring: the token takes the slot of the oldest position (out of the
            # window from this step on), so the layer never holds more than the window
            d.overwrite(d.pos.argmin(dim=1), k, v, int(positions[0]))
            return d.attend(q, positions, 1, window)
        return self._attend(st, q, k, v, positions, layer)

    def _to_store(self, st: Layer, q, k, v) -> torch.Tensor:
        st.kivi.append(k[0], v[0])
        return combine(st.kivi.partials(q, None, k.shape[2], None), self.dtype)

    def _attend(self, st: Layer, q, k, v, positions, layer: int) -> torch.Tensor:
        """Dense (and KIVI) attention; cumulative: each key's probabilities summed (H2O §3)."""
        T, window, d = k.shape[2], self.config.window(layer), st.dense
        d.append(k, v, positions)
        if self.method.cumulative:
            if d.native_scores(q) and not self.adaptive:  # output and probabilities in one pass
                return self._attend_native(d, q, positions, window).to(self.dtype)
            mask = d.mask(positions, T, window)
            if T == 1 and mask is None and q.is_cuda:  # one kernel, probabilities out
                out, _, p = dense_decode(q, d.k, d.v, return_probs=True)
                d.acc += group_sum(p[0, :, 0], d.k.shape[1])
                return out.to(self.dtype)
            out, col = attention_colsum(q, d.k, d.v, mask)
            d.acc += col
            return out.to(self.dtype)
        if st.kivi is not None and st.kivi.length:
            parts = st.kivi.partials(q, positions, 0, window) + d.partials(q, positions, T, window)
            return combine(parts, self.dtype)
        if window and self.slot_positions:  # slot = position: mask the window by position
            k_pos = torch.arange(d.length, device=positions.device)
            return dense_attention(q, d.k, d.v, positions, k_pos, window, d.kernels)
        return d.attend(q, positions, T, window)

    def _attend_native(self, d: DenseSeg, q, positions, window: int | None) -> torch.Tensor:
        """`_attend`'s cumulative scores on the native kernels: a decode row (every held
        position older, no window) adds its probabilities to acc as it attends; a chunk
        attends causally by position (or slot) with its column sums."""
        if q.shape[2] == 1 and window is None and not self.in_prefill:
            return d.attend_probs(q)[0]
        out, _, col = d.kernels.attn_colsum(
            q, d.k, d.v, q.shape[-1] ** -0.5, d.pos, positions, window or 0
        )
        d.acc += col
        return out

    def begin_prefill(self, n_tokens: int, select: bool = True) -> None:
        super().begin_prefill(n_tokens, select)
        for st in self.layers:
            st.queries = st.probs = None

    bound_in_prefill = True  # False: a method that reads the whole turn bounds after selecting

    def bound_windows(self) -> None:
        """Layers with a sliding window keep at most its tokens: the newest positions of each
        KV head (what the window can still see), in position order."""
        for i, st in enumerate(self.layers):
            window, d = self.config.window(i), st.dense
            if window and d.pos is not None and d.length > window:
                at = torch.where(d.pos == PAD, -1, d.pos)  # padding (scope=adaptive) is oldest
                newest, slots = at.topk(window, dim=1)  # (R, window) positions, slots
                d.keep(slots.gather(1, newest.argsort(dim=1)))  # in position order

    def end_chunk(self, n_tokens: int) -> None:
        super().end_chunk(n_tokens)
        if "chunk" in self.points and self.select_turn:
            self.select("chunk")
        if self.bound_in_prefill:
            self.bound_windows()
        if self.kivi_layout is not None and not self.selects:
            for st in self.layers:
                if st.kivi is not None:
                    st.kivi.flush(self.kivi_layout["residual"])

    def end_prefill(self) -> None:
        super().end_prefill()
        if "prefill" in self.points and self.select_turn:
            self.select("prefill")
        if self.bound_in_prefill:
            self.bound_windows()
        for st in self.layers:  # the turn's kept tokens enter the store in position order
            st.queries = None
            if st.kivi is not None and st.dense.length:
                k, v = st.dense.take()
                st.kivi.append(k[0], v[0])
                st.kivi.flush(self._flush_unit())

    def _flush_unit(self) -> int:
        """Tokens quantized at once at a prefill's end: whole residuals (the newest stay dense)."""
        return self.kivi_layout["residual"]

    def end_step(self) -> None:
        super().end_step()
        if "step" in self.points:
            self.select("step")
            for st in self.layers:
                st.queries = st.probs = None
        self.bound_windows()
        if self.kivi_layout is not None:
            r = self.kivi_layout["residual"]
            for st in self.layers:
                if st.kivi is not None and st.kivi.tail_len >= r:
                    st.kivi.flush(r)

    def select(self, point: str) -> None:
        """Each layer's top B_l slots by score, per KV head; under KIVI over the turn's staged
        tokens with B from the turn (kvrun's rule for later chat turns)."""
        m, o, L = self.method, self.opt, self.config.n_layers
        T = max(st.dense.length for st in self.layers)  # local layers hold at most a window
        B = self.budget.tokens(T if self.kivi_layout else self.seen, self.protected)
        budgets = m.budgets(B, T, L)
        recent = {Bl: m.kept_recent(Bl) for Bl in set(budgets)}  # once per budget, not layer
        for i, st in enumerate(self.layers):
            d, Bl = st.dense, budgets[i]
            if d.length > Bl and (st.queries is not None or not self.n_queries):
                held = (d, st.queries, d.pos, d.acc)
                at = (self.seen, Bl, st.probs, self.adaptive, self.rope.at(i))
                scores = m.score(Ctx(i, o, self.config, *held, *at))
                if self.out_proj is not None:
                    scores = self.critical(i, d, scores, Bl)
                if self.adaptive:
                    keep_adaptive(d, scores, Bl, m.alpha, m.sinks, recent[Bl])
                # one in, one out (a decode step at the budget): written over, not compacted
                elif not (d.length == Bl + 1 and d.evict_one(scores, m.sinks, recent[Bl])):
                    d.keep(self.top(scores, d.length, Bl, None if d.in_order() else d.pos))
            if d.pos is not None:  # the hook sees position order, whatever the slots' order
                at = torch.where(d.pos == PAD, -1, d.pos) if self.adaptive else d.pos
                self.report(i, point, at if self.on_select is None else at.sort(1).values)

    def critical(self, layer: int, d: DenseSeg, scores: torch.Tensor, B: int) -> torch.Tensor:
        """CriticalKV's refinement of a layer's scores (kvrun/kv/adaptive.py)."""
        W = self.out_proj.weights(layer, self.dtype, self.device)  # (Hq, D, dim)
        return critical_scores(W, d, scores, B, self.adaptive)

    def top(
        self, scores: torch.Tensor, T: int, k: int, pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Kept slots (H, k) by scores (H, C) of the C oldest; newer ones, sinks, recent kept.
        pos (1 or Hkv, T): slots out of position order, ranked in it (`DenseSeg.evict_one`)."""
        if scores.shape[1] < T:
            pad = scores.new_full((scores.shape[0], T - scores.shape[1]), float("inf"))
            scores = torch.cat([scores, pad], dim=1)
        order = None
        if pos is not None:  # slots by position: the rule below reads position order
            order = pos.argsort(dim=1).expand(max(len(pos), len(scores)), -1)
            scores = scores.expand(len(order), -1).gather(1, order)
        first, last = self.method.sinks, self.method.kept_recent(k)
        protected = None
        if first or last:
            j = torch.arange(T, device=scores.device)
            protected = ((j < first) | (j >= T - last))[None]
        idx = keep_indices(scores, protected, k)
        return idx if order is None else order.gather(1, idx)

    def decode_segment(self, i: int) -> StaticSegment:
        """The store layer i's decode tokens go to: what the static (CUDA-graph) step writes
        and attends (a subclass that keeps decode tokens elsewhere overrides it)."""
        st = self.layers[i]
        return st.kivi if st.kivi is not None else st.dense

    def static_unsupported(self) -> str | None:
        if "step" in self.points:
            return f"{self.name} evicts at every decode step"
        seg = self.decode_segment(0)
        if isinstance(seg, DenseSeg) and (seg.pos is not None or seg.acc is not None):
            return f"{self.name} keeps positions or scores per slot"
        return None

    def static_step_ok(self) -> bool:
        """Whether the next decode step can be the static one (else it runs eagerly)."""
        return True

    @property
    def capacity(self) -> int:
        return self._cap

    def make_static(self, capacity: int) -> None:
        self._cap = max(self._cap, capacity)
        for i in range(len(self.layers)):
            self.decode_segment(i).room(self._cap - self.seen)  # positions up to cap - 1
        self.rope.reserve(self._cap)
        self.static = True

    def static_buffers(self) -> tuple:
        segs = (self.decode_segment(i) for i in range(len(self.layers)))
        return (self._cap, *(seg.static_key() + (seg.end - self.seen,) for seg in segs))

    def after_static_step(self) -> None:
        for i in range(len(self.layers)):  # the step wrote its token at the segment's end
            self.decode_segment(i).advance()

    def decode_static(self, layer, q, k, v, positions) -> torch.Tensor:
        seg = self.decode_segment(layer)
        slot = positions + (seg.end - self.seen)  # (1,) this token's slot in the segment
        return combine(seg.attend_static(q, k, v, slot), self.dtype)

    def stores(self) -> list:
        return [s for st in self.layers for s in (st.dense, st.kivi) if s is not None]

    def nbytes(self) -> int:
        total = sum(s.nbytes() for s in self.stores())
        for st in self.layers:  # saved queries count while held across calls (0.6)
            if st.queries is not None:
                total += st.queries.numel() * st.queries.element_size()
        return total

    def kept_counts(self) -> list[int]:
        """Slots held per layer (every store), for tests and `kvrun bench`."""
        return [st.dense.length + (st.kivi.length if st.kivi else 0) for st in self.layers]

    def describe(self) -> dict:
        d = self.spec.describe()
        if (b := self.budget) is not None:
            d["budget"] = float(b.value) if b.is_fraction else int(b.value)
        t = self.held_kv_type()
        d["kv_dtype"] = t.name if t else kvtypes.of(None, self.dtype).name
        return d
