"""XKV (§4 of the paper): SnapKV-style eviction at the end of prefill, n_i per layer from a
global top-N over per-layer-normalised window scores, planned by a scoring pass that keeps no KV
(plan=two-pass), the prefill itself (deferred) or a profile. With a plan and a one-chunk prefill
each layer evicts right after its attention: the peak is one full layer plus compressed ones."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...attention import group_sum, pool_scores
from ...cache import KVCache
from ...protocol import KVManager, Pass
from ...state import Bool, Int, Into, ListOf, Maybe, New, Nothing, state
from .alloc import Allocation, allocate_budget, allocate_target, context_budget, normalise
from .profile import (
    Profile,
    check_profile,
    fold_profile,
    load_profile,
    profile_budgets,
    save_profile,
)


def window_attention(qw: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """XKV's window attention (§3.1) a_q[j] (Hq, T - w) fp32: the softmax of the w window rows
    (qw (Hq, w, D)) over all T keys (k (Hkv, T, D), causal in the window), averaged over the rows.
    One unblocked softmax, not `window_scores`' two passes: the kept sets are pinned to it."""
    Hq, w, D = qw.shape
    Hkv, T, _ = k.shape
    G = Hq // Hkv
    # contiguous fp32 copies: the scoring pass and the prefill feed equal values in different
    # layouts, and the scores must come out bit-identical (plan equivalence)
    q = qw.float().contiguous().view(Hkv, G * w, D)
    kf = k.float().contiguous()
    logits = torch.bmm(q, kf.transpose(1, 2)).view(Hkv, G, w, T) / math.sqrt(D)
    rows = torch.arange(T - w, T, device=k.device)  # slot of each window row
    future = torch.arange(T, device=k.device)[None, :] > rows[:, None]  # (w, T)
    p = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    return p[..., : T - w].mean(dim=2).reshape(Hq, T - w)  # (1/ows) sum over rows


def layer_scores(
    qw: torch.Tensor, k: torch.Tensor, pool: str
) -> tuple[torch.Tensor, torch.Tensor]:  # w (C,), s (Hkv, C) fp32
    """w_i = pool(mean of a_q over query heads), s_{i,h} = pool(sum over KV head h's group)."""
    a = window_attention(qw, k)  # (Hq, C)
    w = pool_scores(a.mean(dim=0, keepdim=True), pool)[0]
    s = pool_scores(group_sum(a, k.shape[0]), pool)
    return w, s


@state(
    n_tokens=Int(0, "T"),
    first=Bool(),
    evict_now=Bool(),
    done=ListOf(Bool(), "L", exactly=True),
    scores=ListOf(Nothing(), "L", exactly=True),  # spent by the prefill's end
)
@dataclass(slots=True)
class Turn:
    """Where XKV's planning stands within one turn's prefill (a new one at each begin_prefill)."""

    n_tokens: int = 0  # the turn's prompt length
    first: bool = True  # the sequence's first turn: a scoring-pass plan or a profile applies
    # budgets known before the prefill: a one-chunk prefill evicts each layer after attending
    evict_now: bool = False
    done: list[bool] = field(default_factory=list)  # layers evicted during the prefill
    scores: list[torch.Tensor | None] = field(default_factory=list)  # the plan's, until used

    @classmethod
    def start(cls, n_tokens: int, first: bool, n_layers: int) -> Turn:
        return cls(n_tokens, first, False, [False] * n_layers, [None] * n_layers)


@state(
    allocation=Maybe(New(Allocation)),
    layer_budgets=Maybe(ListOf(Int(0, "T"), "L", exactly=True)),
    turn=Into(),
)
class XKVCache(KVCache):
    """XKV on the driver: its own allocator, scores and planning over the driver's store."""

    def __init__(self, spec, config, rope, device, dtype, on_select=None):
        o = spec.select_opts  # target mode and a --kv-budget were refused by the spec
        super().__init__(spec, config, rope, device, dtype, on_select)
        self.window = o["window"]
        self.floor = o["window"] if o["min_tokens"] < 0 else o["min_tokens"]
        self.target = o["target"]
        self.pool = o["pool"]
        self.profile_path = Path(o["profile"]) if o["profile"] else None
        self._usable_profile()  # a bad profile fails now, before any prefill

    def reset(self) -> None:
        super().reset()
        self.allocation: Allocation | None = None
        # a scoring pass's allocation and selection scores, for the prefill that follows it
        self.pending: tuple[Allocation, list[torch.Tensor]] | None = None
        self.turn = Turn.start(0, True, self.config.n_layers)
        self.layer_budgets: list[int] | None = None  # n_i + ows after the last prefill

    def planning_pass(self, when, ids, tokenizer) -> list[Pass]:
        """Pass 1 of plan=two-pass before a one-chunk first prefill (a chunked one keeps every
        layer exact to its last chunk, kvrun's rule); none with a usable profile or a window."""
        if when != "before":
            return []
        self.pending = None
        n_tokens, sw = len(ids), self.config.sliding_window
        if (
            self.opt["plan"] != "two-pass"
            or self.seen > 0
            or n_tokens <= self.window
            or (sw and n_tokens > sw)
            or self._usable_profile() is not None
        ):
            return []
        return [Pass(list(ids), _ScoringPass(self), self.seen, whole=True)]

    def _usable_profile(self) -> Profile | None:
        """The profile to load instead of planning (FILE exists, profile_update off)."""
        p = self.profile_path
        if p is None or self.opt["profile_update"] or not p.exists():
            return None
        return self._checked(load_profile(p))

    def _checked(self, prof: Profile, units: str | None = None) -> Profile:
        """A profile for this model, window and pooling (and units when folding), or an error."""
        c = self.config
        check_profile(prof, self.profile_path, c.n_layers, c.name, self.window, self.pool, units)
        return prof

    def _allocate(
        self, w: list[torch.Tensor], n: int, rows: int, source: str, t: int
    ) -> Allocation:
        p = [normalise(x) for x in w]
        alloc = self.opt["alloc"]
        if self.target > 0:
            counts = allocate_target(p, self.target, self.floor, alloc)
        else:
            L = self.config.n_layers
            N = context_budget(
                self.budget, n, L, self.window, rows, self.floor, self.opt["budget_scope"]
            )
            counts = allocate_budget(p, N, self.floor, alloc)
        return Allocation(counts, t, rows, source)

    def _adopt_plan(self, w: list[torch.Tensor], sel: list[torch.Tensor], t: int) -> None:
        """End of pass 1: allocate, keep the selection scores for the real prefill."""
        a = self._allocate(w, t, min(self.window, t), "two-pass", t)
        self.allocation = a
        self.pending = (a, sel)
        self._record_profile(a)

    def _record_profile(self, a: Allocation) -> None:
        """Write (or fold into) profile=FILE after planning the first prefill."""
        if self.profile_path is None:
            return
        units = self.opt["profile_units"]
        values = [x / a.t if units == "fractions" else float(x) for x in a.n]
        old = None
        if self.profile_path.exists():
            old = self._checked(load_profile(self.profile_path), units)
        prof = fold_profile(
            old, values, model=self.config.name, window=self.window, pool=self.pool, units=units
        )
        save_profile(self.profile_path, prof)

    def begin_prefill(self, n_tokens: int, select: bool = True) -> None:
        super().begin_prefill(n_tokens, select)
        L = self.config.n_layers
        turn = self.turn = Turn.start(n_tokens, self.seen == 0, L)
        plan, self.pending = self.pending, None
        self.allocation = None
        if not turn.first:
            return  # later turns: deferred over the slots held (as snapkv)
        if plan is not None and plan[0].t == n_tokens:
            self.allocation, turn.scores = plan[0], list(plan[1])
            turn.evict_now = True
            return
        prof = self._usable_profile()
        if prof is not None:
            rows = min(self.window, n_tokens)
            C = n_tokens - rows
            N = context_budget(
                self.budget, n_tokens, L, self.window, rows, self.floor, self.opt["budget_scope"]
            )
            n = profile_budgets(
                prof.values, prof.units, n_tokens, N, self.floor, C, self.target > 0
            )
            self.allocation = Allocation(n, n_tokens, rows, "profile")
            turn.evict_now = True

    def prefill(self, layer, q, k, v, positions):
        out = super().prefill(layer, q, k, v, positions)
        turn = self.turn
        if turn.evict_now and k.shape[2] == turn.n_tokens:
            # one-chunk prefill with budgets known: this layer is final, evict it now
            st = self.layers[layer]
            score = turn.scores[layer]
            if score is None:
                score = self._selection_score(st)
            self._keep(st, score, self.allocation.n[layer])
            turn.scores[layer], st.queries = None, None
            turn.done[layer] = True
        return out

    def _selection_score(self, st) -> torch.Tensor:
        """s_{i,h} (Hkv, C), or w_i (1, C) for scope=layer."""
        w, s = layer_scores(st.queries, st.dense.k[0], self.pool)
        return w[None] if self.opt["scope"] == "layer" else s

    def _keep(self, st, score: torch.Tensor, n_ctx: int) -> None:
        """The top-n_ctx context slots by score (ties: lower position) plus the window."""
        d, C = st.dense, score.shape[1]
        if n_ctx < C:
            d.keep(self.top(score, d.length, n_ctx + d.length - C))

    def select(self, point: str) -> None:
        """At end_prefill: deferred scoring, allocation and eviction of the layers not done."""
        turn, L = self.turn, self.config.n_layers
        todo = [i for i, done in enumerate(turn.done) if not done]
        if todo:
            kivi = self.layers[0].kivi is not None
            # dense store: all slots held, budget from all tokens seen; KIVI: this turn only
            n = max(st.dense.length for st in self.layers) if kivi else self.seen
            scores = {}
            for i in todo:
                st = self.layers[i]
                if st.queries is not None and st.dense.length > st.queries.shape[1]:
                    scores[i] = layer_scores(st.queries, st.dense.k[0], self.pool)
            qwin = self.layers[todo[0]].queries
            rows = qwin.shape[1] if qwin is not None else 0
            if self.allocation is None and scores:
                w = [scores[i][0] if i in scores else torch.zeros(0) for i in range(L)]
                self.allocation = self._allocate(w, n, rows, "deferred", n)
                if turn.first:
                    self._record_profile(self.allocation)
            elif self.allocation is None:  # nothing to evict: the turn fits in the window
                C = [st.dense.length - rows for st in self.layers]
                self.allocation = Allocation(C, n, rows, "deferred")
            for i in scores:
                w, s = scores[i]
                sel = w[None] if self.opt["scope"] == "layer" else s
                self._keep(self.layers[i], sel, self.allocation.n[i])
        a = self.allocation
        self.layer_budgets = [n + a.window for n in a.n]
        turn.scores = [None] * L
        turn.evict_now = False
        for i, st in enumerate(self.layers):
            if st.dense.pos is not None:
                self.report(i, point, st.dense.pos)

    def nbytes(self) -> int:
        """Cache bytes plus the plan's selection scores while held across calls (0.6)."""
        held = list(self.turn.scores)
        if self.pending is not None:
            held += self.pending[1]
        return super().nbytes() + sum(x.numel() * x.element_size() for x in held if x is not None)

    def describe(self) -> dict:
        d = super().describe()
        if self.target > 0:
            d.pop("budget", None)
        if self.layer_budgets is not None and self.allocation is not None:
            d["layer_budgets"] = list(self.layer_budgets)
            d["plan_used"] = self.allocation.source
        return d


class _ScoringPass(KVManager):
    """Pass 1 of plan=two-pass: exact attention, nothing kept; w_i and s_{i,h} go to its XKV."""

    name = "xkv-scoring-pass"

    def __init__(self, owner: XKVCache):
        super().__init__(owner.config, owner.rope, owner.device, owner.dtype)
        L = owner.config.n_layers
        self.owner = owner
        self.w: list[torch.Tensor | None] = [None] * L  # (C,) allocation scores
        self.sel: list[torch.Tensor | None] = [None] * L  # (Hkv or 1, C) selection scores

    def prefill(self, layer, qr, kr, v, positions):
        o = self.owner
        seg = o._dense()  # the same segment (and mask) the real prefill attends with
        seg.append(kr, v, positions)
        T = kr.shape[2]
        out = seg.attend(qr, positions, T, self.config.window(layer))
        rows = min(o.window, T)
        qw = torch.cat([qr.new_empty(qr.shape[1], 0, qr.shape[3]), qr[0]], dim=1)[:, -rows:]
        w, s = layer_scores(qw, seg.k[0], o.pool)
        self.w[layer] = w
        self.sel[layer] = w[None] if o.opt["scope"] == "layer" else s
        return out

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.w + self.sel if x is not None)

    def end_prefill(self) -> None:
        super().end_prefill()
        self.owner._adopt_plan(self.w, self.sel, self.seen)
