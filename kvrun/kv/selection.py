"""Selection parts (which tokens stay, at which compression points) and the Allocator parts
they ask how many tokens each layer keeps. kvrun/kv/recipe.py puts them in a method's Recipe.

A selection part runs at the points it names ("chunk", "prefill", "step") over a cache's
layers; the manager passes itself (`kv`) for the state the part reads: its layers, budget,
options and the tokens seen.
"""

from __future__ import annotations

import math

import torch

from .alloc.minikv import minikv_budgets
from .alloc.spindle import spindle_keep
from .budget import pyramid_budgets
from .merged import merge, retention
from .scores import pool_scores, qhead_scores
from .select import evict_indices, heavy_recent_indices, window_indices
from .select_qhead import select_keep, union_slots


# --- allocation: how many tokens each layer keeps -----------------------------------------------
class Uniform:
    def budgets(self, kv, B: int, T: int) -> list[int]:
        return [B] * kv.config.n_layers


class Pyramid:
    """PyramidKV's arithmetic schedule (§3.2), from B and the window."""

    def budgets(self, kv, B: int, T: int) -> list[int]:
        return pyramid_budgets(B, T, kv.opt["window"], kv.config.n_layers, kv.opt["beta"])


class MiniKVPyramid:
    """MiniKV's heavy hitters per layer (a pyramid, §3.1) and its recent window."""

    def budgets(self, kv, t: int) -> tuple[list[int], int]:
        return minikv_budgets(kv.opt, kv.user_budget, t, kv.config.n_layers)


class SpindleSchedule:
    """SpindleKV's linearly falling per-layer eviction budgets (§3.3, Eq. 5 as corrected):
    k_lambda per layer for a turn of t tokens, B from the turn's own length (later turns
    too); None when every token stays. Cached on the manager per turn length."""

    def keep(self, kv, t: int) -> list[int] | None:
        if kv.plan is None or kv.plan[0] != t:
            B = kv.budget.tokens(t, kv.window)
            L = kv.config.n_layers
            kv.plan = (t, spindle_keep(t, B, kv.window, L, kv.beta, kv.opt["schedule"]))
        return kv.plan[1]


# --- selection: which tokens stay, and when ---------------------------------------------------
class Selection:
    """Keeps every token (a store alone, as `full+kivi2`)."""

    points: frozenset[str] = frozenset()  # the compression points it runs at
    keeps_all = True

    def run(self, kv, point: str) -> None:
        return None

    def position_rows(self, n_kv: int) -> int:
        """Rows of int32 positions the dense segment keeps (and counts): only where a later
        step needs them, as decode-time eviction does (0: none)."""
        return 0


class Evict(Selection):
    """Decode-time eviction (StreamingLLM, H2O) down to B(n) in every layer, after each
    prefill chunk and decode step: sinks, then the top scores and a recent share (H2O), or
    the newest tokens only (StreamingLLM: recent=None)."""

    points = frozenset({"chunk", "step"})
    keeps_all = False

    def __init__(self, by_score: bool):
        self.by_score = by_score

    def position_rows(self, n_kv: int) -> int:
        # by recency alone every head keeps the same slots: one row serves them all
        return n_kv if self.by_score else 1

    def run(self, kv, point: str) -> None:
        n = kv.seen
        B = kv.budget.tokens(n, kv.protected)
        recent = kv.opt["recent"] if self.by_score else None
        for i, st in enumerate(kv.layers):
            d = st.dense
            if d.length > B:
                d.keep(evict_indices(d.pos, d.acc, n, B, kv.opt["sinks"], recent))
            kv.report(i, point)


class WindowTopK(Selection):
    """SnapKV / PyramidKV: each KV head keeps its top votes plus the window, at the end of the
    prefill (and after each chunk with chunked=true)."""

    keeps_all = False

    def __init__(self, allocator, chunked: bool):
        self.allocator = allocator
        self.points = frozenset({"prefill", "chunk"} if chunked else {"prefill"})

    def run(self, kv, point: str) -> None:
        # dense store: select over all slots, budget from all tokens seen; KIVI store: only the
        # new tokens held in staging, with the same rule (kvrun's rule for later chat turns)
        T = kv.layers[0].dense.length
        n = T if kv.layers[0].kivi is not None else kv.seen
        B = kv.budget.tokens(n, kv.protected)
        budgets = self.allocator.budgets(kv, B, T)
        for i, st in enumerate(kv.layers):
            d, Bl = st.dense, budgets[i]
            if d.length > Bl and st.qwin is not None:
                d.keep(window_indices(st.qwin, d.k[0], Bl, kv.opt["kernel"], kv.opt["pool"]))
            kv.report(i, point)


class HeavyRecent(Selection):
    """MiniKV: heavy hitters by the turn's column sums + the recent window, per KV head, once
    per turn at the end of its prefill."""

    points = frozenset({"prefill"})
    keeps_all = False
    allocator = MiniKVPyramid()

    def run(self, kv, point: str) -> None:
        t = kv.layers[0].dense.length
        hh, n_rw = self.allocator.budgets(kv, t)
        norm = kv.opt["score_norm"] == "length"
        for i, st in enumerate(kv.layers):
            if hh[i] + n_rw < t:
                st.dense.keep(
                    heavy_recent_indices(st.dense.acc, hh[i], n_rw, kv.config.n_kv_heads, norm)
                )
            kv.report(i, point)


class Planned(Selection):
    """A selection whose manager plans the per-layer budgets itself (XKV: a scoring pass or a
    deferred allocation, kvrun/kv/xkv.py): the point goes to its planner."""

    keeps_all = False

    def __init__(self, chunked: bool):
        self.points = frozenset({"prefill", "chunk"} if chunked else {"prefill"})

    def run(self, kv, point: str) -> None:
        kv.plan_and_select(point)


class QHeadUnion(Selection):
    """SpindleKV (§3.3): each query head keeps its top tokens by its own window attention
    (pooled); a KV head stores the union of its group's picks once, with a keep mask per
    query head. At the end of a turn's prefill over the layers still held, or layer by layer
    as the prefill attends when the turn is one chunk (the peak is then one layer's KV)."""

    points = frozenset({"prefill"})
    keeps_all = False
    allocator = SpindleSchedule()

    def run(self, kv, point: str) -> None:
        for i, st in enumerate(kv.layers):
            if st.held_n:  # chunked prefill: every layer compresses here (step 8)
                self.compress(kv, i, st.held_k.data, st.held_v.data, st.qwin)
            st.drop_turn()

    def compress(self, kv, layer: int, kp: torch.Tensor, vp: torch.Tensor, qwin) -> None:
        """Steps 2-7 for one layer over the turn's pre-RoPE K, V (Hkv, t, D); the store codes
        what is kept.

        Later chat turns (kvrun's rule for stores that cannot re-select): only the new turn's
        tokens are compressed, with the same rule and fractions (B from the turn's length) and
        a softmax over the turn's own keys, as SnapKV does over a KIVI staging area; earlier
        turns stay as stored.
        """
        st, o = kv.layers[layer], kv.opt
        Hkv, t, _ = kp.shape
        plan = self.allocator.keep(kv, t)
        if plan is None:
            keep = torch.ones(Hkv, kv.group, t, dtype=torch.bool, device=kp.device)
        else:
            tpos = torch.arange(kv.turn_start, kv.turn_start + t, device=kp.device)
            kr = kv.rope.apply(kp[None], tpos)[0]  # (Hkv, t, D) post-RoPE, transient
            sc = qhead_scores(qwin, kr, kv.config.sliding_window, o["score_norm"] == "length")
            sc = pool_scores(sc, o["pool"])
            keep = select_keep(sc, plan[layer], t, Hkv, o["gqa"])
        sl = union_slots(keep)
        st.all_bits &= bool(sl.valid.all()) and bool(keep.all(1).eq(keep.any(1)).all())
        pos = torch.where(sl.valid, sl.rel + kv.turn_start, 0).to(torch.int32)  # (Hkv, S)
        gather = sl.rel[..., None].expand(-1, -1, kp.shape[2])
        ks, vs = kp.gather(1, gather), vp.gather(1, gather)  # (Hkv, S, D) kept, in slot order
        st.store_turn(layer, ks, vs, sl.valid, pos, sl.mask, o)


class MergePairs(Selection):
    """MiniCache (§4): nothing is evicted; each pair (l-1, l) keeps one SLERP-merged direction
    per token (and KV head) and retains its most distinct rows exactly. A turn's tokens are
    merged at the end of its prefill; a decode token once layer l has attended (`merge`)."""

    points = frozenset({"prefill"})

    def run(self, kv, point: str) -> None:
        for p in kv.pairs:
            if p.exact is not None:
                (ka, va), (kb, vb) = p.exact[p.a], p.exact[p.b]
                self.merge(kv, p, ka.data[0], va.data[0], kb.data[0], vb.data[0], prefill=True)
                p.exact = None  # free the exact buffers
            p.release()

    def merge(self, kv, pair, ka, va, kb, vb, prefill: bool) -> None:
        """Merge tokens of layers a and b, (Hkv, n, D) each, and append them to the pair: the
        retention (which rows stay exact) is chosen here, over the turn's tokens at a prefill
        and beyond the prefill threshold at decode (decode_retain)."""
        n, start = ka.shape[1], pair.length
        if n == 0:
            return
        lay = kv.layout
        if pair.k is None:
            never = -math.inf if kv.rule == "paper" else math.inf
            thr = never if kv.decode_retain else None
            args = (pair.kivi is None, thr, kv.dtype, kv.device)
            pair.k, pair.v = lay.half(*args), lay.half(*args)
        dirs = []
        for half, xa, xb in ((pair.k, ka, kb), (pair.v, va, vb)):
            ga, gb = lay.groups(xa), lay.groups(xb)  # (g, n, m)
            e, na, nb, d = merge(ga, gb, kv.t, kv.sin_eps)
            keep = None
            if prefill:  # retention over this turn's tokens
                keep, thr = retention(d, kv.gamma, kv.rule, kv.retain)
                if half.thr is not None:
                    half.thr = thr
            elif half.thr is not None:  # decode_retain: beyond the prefill threshold
                thr = half.thr.unsqueeze(-1)
                keep = d < thr if kv.rule == "paper" else d > thr
            e = lay.heads(e)  # (Hkv, n, D) fp32
            half.append(e, na, nb, keep, ga, gb, start)
            dirs.append(e)
        if pair.kivi is not None:
            pair.kivi.append(dirs[0].to(kv.dtype), dirs[1].to(kv.dtype))
            if prefill:
                pair.kivi.flush(kv.kivi_layout["group"])  # prefill flush unit U = G
        pair.length += n
