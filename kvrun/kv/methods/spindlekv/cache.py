"""SpindleKV (§3.3-3.4 of the paper): linearly falling per-layer eviction budgets, per-query-head
selection stored once per KV head with a keep mask per query head, and per-layer codebooks of
pre-RoPE K and V. Attention sees K = RoPE(C_K[idx_K] * mag_K, pos), V = C_V[idx_V] * mag_V, query
head j of group h masked to head h's slots with bit j set. Here: routing, selection (Eq. 2-7)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from ....kernels import use_triton
from ...attention import combine, native_attention, pool_scores, sdpa, window_scores
from ...cache import keep_indices
from ...protocol import KVManager
from ...state import Int, ListInto, state
from .store import CodedLayer, pack_bits, unpack_bits
from .window import ring, stale, trim


def endpoints(r_c: Fraction, beta: Fraction) -> tuple[Fraction, Fraction]:
    """(r_c(0), r_c(L-1)) of Eq. 5 (§3.2) as corrected by the spec (kvrun's decision; §3.3): the
    paper prints rL = 1 - 2 r_c and a hard-coded 0.05; 2 r_c - 1 and beta keep their mean at r_c."""
    alpha = (1 + beta) / 2
    if r_c >= 1:
        return Fraction(1), Fraction(1)
    if r_c <= beta:
        flat = max(r_c, Fraction(0))
        return flat, flat
    if r_c <= alpha:
        return 2 * r_c - beta, beta
    return Fraction(1), 2 * r_c - 1


def layer_ratios(
    r_c: Fraction, n_layers: int, beta: Fraction, schedule: str = "linear"
) -> list[Fraction]:
    """r_c(lambda) for every layer (Eq. 6), exact; their mean is r_c (0 <= r_c <= 1)."""
    if schedule == "flat" or n_layers == 1:  # one layer: Eq. 6 is 0/0, the mean is r_c itself
        return [min(max(r_c, Fraction(0)), Fraction(1))] * n_layers
    r0, rl = endpoints(r_c, beta)
    return [r0 + (rl - r0) * Fraction(lam, n_layers - 1) for lam in range(n_layers)]


def spindle_keep(
    t: int, budget: int, window: int, n_layers: int, beta: Fraction, schedule: str = "linear"
) -> list[int] | None:
    """k_lambda = floor(r_c(lambda) * n_ctx) context tokens per query head (Eq. 7), or None when
    everything is kept (n_ctx <= 0 or r_c >= 1). budget = B(t), window included."""
    n_ctx = t - window
    if n_ctx <= 0:
        return None
    r_c = Fraction(budget - window, n_ctx)
    if r_c >= 1:
        return None
    return [math.floor(r * n_ctx) for r in layer_ratios(r_c, n_layers, beta, schedule)]


def qhead_scores(qw, k, sliding: int | None = None, length_norm: bool = True) -> torch.Tensor:
    """Eq. 2: ac_q[a] = sum_b A_q[b, a] / (t - a) over window rows b -> (Hq, t - w); qw (Hq, w, D)
    and k (Hkv, t, D) the turn's post-RoPE window queries and keys."""
    vote = window_scores(qw, k, sliding)
    if length_norm:
        t, n_ctx = k.shape[1], vote.shape[1]
        vote = vote / (t - torch.arange(n_ctx, device=k.device)).float()
    return vote


def select_keep(
    scores: torch.Tensor, k: int, t: int, n_kv: int, gqa: str, first: int = 0
) -> torch.Tensor:
    """Keep bits (Hkv, g, t): per query head the top k of scores (Hq, t - w), ties to the lower
    position, plus the window; gqa=mean picks once per KV head on the group-mean score. Only
    tokens from `first` on are candidates (a sliding window's newest): k is cut to their count."""
    Hq, n_ctx = scores.shape
    g = Hq // n_kv
    if first:
        scores = scores.clone()
        scores[:, :first] = float("-inf")
        k = min(k, max(n_ctx - first, 0))
    if gqa == "mean":
        top = keep_indices(scores.view(n_kv, g, n_ctx).mean(1), None, k).repeat_interleave(g, 0)
    else:
        top = keep_indices(scores, None, k)  # (Hq, k)
    keep = torch.zeros(Hq, t, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, top, True)
    keep[:, n_ctx:] = True
    keep[:, :first] = False  # an observation window longer than the sliding one
    return keep.view(n_kv, g, t)


@dataclass
class Slots:
    """A KV-head-major slot layout: each head's union in position order, padded to S."""

    rel: torch.Tensor  # (Hkv, S) int64 token index within the turn; 0 on padding
    valid: torch.Tensor  # (Hkv, S) bool; False on padding
    mask: torch.Tensor  # (Hkv, S, ceil(g/8)) uint8 keep bits; 0 on padding


def union_slots(keep: torch.Tensor) -> Slots:
    """§3.3, Eq. 7: keep bits (Hkv, g, t) as each KV head's union, a token once with its g bits."""
    Hkv, g, t = keep.shape
    union = keep.any(1)  # (Hkv, t)
    count = union.sum(1)  # (Hkv,)
    S = int(count.max()) if t else 0
    # a stable sort puts each head's kept tokens first, in position order
    order = torch.sort((~union).to(torch.int8), dim=1, stable=True).indices[:, :S]  # (Hkv, S)
    valid = torch.arange(S, device=keep.device)[None, :] < count[:, None]
    rel = torch.where(valid, order, 0)
    bits = keep.gather(2, rel[:, None, :].expand(Hkv, g, S)) & valid[:, None, :]  # (Hkv, g, S)
    return Slots(rel, valid, pack_bits(bits.transpose(1, 2)))


# the coded layers and where the last turn began; the kept-count memo is made again
@state(layers=ListInto(), turn_start=Int(0, "T"), turn_len=Int(0, "T"))
class SpindleKVCache(KVManager):
    """SpindleKV on the cache contract; no kept positions for the debug hook (ragged unions)."""

    # the model's keys arrive before RoPE: the store rotates at each slot's own position
    keys_pre_rope = True

    def __init__(self, spec, config, rope, device, dtype, on_select=None):
        super().__init__(config, rope, device, dtype, on_select)
        self.spec, self.name = spec, spec.name
        self.opt = dict(spec.select_opts)
        self.window = self.opt["window"]
        self.budget = spec.budget_or_default()  # checked against the window by the spec
        self.beta = Fraction(str(self.opt["beta"]))
        self.group = config.n_heads // config.n_kv_heads
        # --kv-dtype: f16 (the CPU's default) halves the books, magnitudes and dense slots, as
        # MiniCache's pairs; the codebook is built and searched in fp32 and rounds after it
        self.kv_type = self.f16_kv_type(spec, dtype, device, "codebooks")
        self.store_dtype = self.kv_type.storage if self.kv_type else dtype
        self.ones_mask = pack_bits(
            torch.ones(config.n_kv_heads, 1, self.group, dtype=torch.bool, device=device)
        )  # (Hkv, 1, ceil(g/8)) a decode slot: every query head sees it
        self.reset()

    def reset(self) -> None:
        super().reset()
        c = self.config
        n_books = c.n_kv_heads if self.opt["codebook_scope"] == "head" else 1
        idx = torch.int32 if self.opt["index"] == "int32" else torch.int16
        self.layers = [
            CodedLayer(
                n_books,
                c.head_dim,
                self.store_dtype,
                self.device,
                idx,
                self.rope.at(i),
                self.group,
                self.rope.kernels,
            )
            for i in range(c.n_layers)
        ]
        self.turn_start, self.turn_len = 0, 0
        self._counts: tuple[int, list[int] | None] | None = None  # kept counts, per turn length

    def begin_prefill(self, n_tokens: int, select: bool = True) -> None:
        super().begin_prefill(n_tokens, select)
        self.turn_start, self.turn_len = self.seen, n_tokens
        for st in self.layers:
            st.drop_turn()

    def keep_counts(self, t: int) -> list[int] | None:
        """k_lambda per layer for a turn of t tokens, B from its length (None: all stay)."""
        if not self.select_turn:
            return None
        if self._counts is None or self._counts[0] != t:
            B = self.budget.tokens(t, self.window)
            L = self.config.n_layers
            self._counts = (t, spindle_keep(t, B, self.window, L, self.beta, self.opt["schedule"]))
        return self._counts[1]

    def end_prefill(self) -> None:
        """Layers still held (a chunked prefill) are compressed here."""
        super().end_prefill()
        for i, st in enumerate(self.layers):
            if st.turn_n:
                self.compress(i, st.turn_k.data, st.turn_v.data, st.qwin)
            st.drop_turn()

    def compress(self, layer: int, kp: torch.Tensor, vp: torch.Tensor, qwin) -> None:
        """Steps 2-7 for one layer over the turn's pre-RoPE K, V (Hkv, t, D). Later turns (kvrun's
        rule for stores that cannot re-select): only the turn's tokens, B from its length, a
        softmax over its own keys (as SnapKV over a KIVI staging area); earlier turns stay."""
        st, o = self.layers[layer], self.opt
        Hkv, t, _ = kp.shape
        plan = self.keep_counts(t)
        sw = self.config.window(layer)
        # a sliding window: only its newest sw tokens are candidates (kvrun's decision: the
        # budget's tokens the window forbids are not given to other layers or positions)
        first = max(t - sw, 0) if sw else 0
        if plan is None:
            keep = torch.ones(Hkv, self.group, t, dtype=torch.bool, device=kp.device)
            keep[..., :first] = False
        else:
            tpos = torch.arange(self.turn_start, self.turn_start + t, device=kp.device)
            kr = self.rope.at(layer).apply(kp[None], tpos)[0]  # (Hkv, t, D) post-RoPE, transient
            sc = qhead_scores(qwin, kr, sw, o["score_norm"] == "length")
            sc = pool_scores(sc, o["pool"])
            keep = select_keep(sc, plan[layer], t, Hkv, o["gqa"], first)
        sl = union_slots(keep)
        st.all_bits &= bool(sl.valid.all()) and bool(keep.all(1).eq(keep.any(1)).all())
        pos = torch.where(sl.valid, sl.rel + self.turn_start, 0).to(torch.int32)  # (Hkv, S)
        gather = sl.rel[..., None].expand(-1, -1, kp.shape[2])
        ks, vs = kp.gather(1, gather), vp.gather(1, gather)  # (Hkv, S, D) kept, in slot order
        st.store_turn(layer, ks, vs, sl.valid, pos, sl.mask, o)
        if sw:  # earlier turns' slots the window no longer sees go (the newest sw stay)
            self.bound(layer, self.turn_start + t - 1)

    def bound(self, layer: int, last: int) -> None:
        """A windowed layer keeps the newest `window` positions up to `last` (trim), where it
        holds more or holds an older one."""
        st, window = self.layers[layer], self.config.window(layer)
        lo = last - window + 1
        if st.n_slots > window or stale(st, lo):
            trim(st, lo)

    def attend(self, layer, q, k, v, positions):
        """A decode row on the native kernels in one call where it can be (q and k pre-RoPE:
        q rotated, the token coded and stored, q attending, all in codebook_step); the rest
        as KVManager.attend says."""
        st = self.layers[layer]
        if (
            st.kernels is not None
            and not self.in_prefill
            and not self.static
            and k.shape[2] == 1
            and k.shape[0] == 1
            and not self.config.any_window  # windowed models: `decode`'s ring and bounds
        ):
            pos = self.rope.position(positions)
            out = st.step_native(q, k, v, pos, self.opt, pre_rope=True)
            if out is not None:
                return out
        return super().attend(layer, q, k, v, positions)

    def decode(self, layer, qr, k, v, positions):
        """A decode token; on a windowed layer at the window, written over each head's oldest
        slot (`ring`), else stored, attended, and the layer trimmed back to the window."""
        st, window = self.layers[layer], self.config.window(layer)
        if window and k.shape[2] == 1 and st.n_slots >= window:
            p = int(positions[0])
            lo = p - window + 1
            if ring(st, layer, k[0, :, 0], v[0, :, 0], p, lo, self.ones_mask, self.opt, window):
                return st.attend(qr, positions, window)
        out = self._decode(st, layer, qr, k, v, positions)
        if window and st.n_slots > window:
            self.bound(layer, int(positions[-1]))
        return out

    def _decode(self, st: CodedLayer, layer, qr, k, v, positions):
        if st.kernels is not None and k.shape[2] == 1 and self._fuse(st, qr):
            pos = self.rope.position(positions)  # coded and attended in one native call
            out = st.step_native(qr, k[0, :, 0], v[0, :, 0], pos, self.opt)
            if out is not None:
                return out
        for i in range(k.shape[2]):  # each token coded, then attended over
            pos = positions[i : i + 1].to(torch.int32).expand(k.shape[1], 1)
            st.store_token(layer, k[0, :, i], v[0, :, i], pos, self.ones_mask, self.opt)
        if self._fuse(st, qr):  # the store's partials: gathered and rotated in the kernel
            return combine(st.partials(qr, positions, k.shape[2], None), qr.dtype)
        return st.attend(qr, positions, self.config.window(layer))

    def prefill(self, layer, qr, k, v, positions):
        st, T = self.layers[layer], k.shape[2]
        if st.turn_n == 0 and T == self.turn_len:  # the whole turn in one chunk (step 7)
            kp, vp = k[0], v[0]
        else:
            st.stage(k[0], v[0], self.turn_len)
            kp, vp = st.turn_k.data, st.turn_v.data
        n = kp.shape[1]
        tpos = torch.arange(self.turn_start, self.turn_start + n, device=positions.device)
        kr = self.rope.at(layer).apply(kp[None], tpos)  # (1, Hkv, n, D) the turn so far, exact
        window = self.config.window(layer)
        if st.n_slots == 0 and not (window and n > window):  # the turn alone, causal
            # the mask position_mask gives, built from the slots (the chunk is the turn's last T)
            part = native_attention(st.kernels, qr, kr, vp[None])  # causal by slot
            if part is not None:
                out = part.out
            else:
                rows = torch.arange(n - T, n, device=kr.device)[:, None]
                mask = torch.arange(n, device=kr.device)[None, :] <= rows if T > 1 else None
                out = sdpa(qr, kr, vp[None], mask)
        else:
            out = st.attend(qr, positions, window, kr, vp[None], tpos)
        prev = st.qwin if st.qwin is not None else qr.new_empty(qr.shape[1], 0, qr.shape[3])
        st.qwin = torch.cat([prev, qr[0]], dim=1)[:, -self.window :]  # the window's queries
        if st.turn_n == 0:  # compress now, so the peak is one layer of full KV
            self.compress(layer, kp, vp, st.qwin)
            st.drop_turn()
        return out

    def _fuse(self, st: CodedLayer, qr: torch.Tensor) -> bool:
        """Whether a decode step uses codebook_decode (codebook_attn natively): one token, no
        window hiding a slot, and not dense slots only on the torch path (there SDPA equals
        `full` bit for bit, as tested)."""
        window = self.config.sliding_window
        if qr.shape[2] != 1:
            return False
        if window is not None and self.seen + 1 > window:
            return False
        return st.kernels is not None or "pos_c" in st.bufs or use_triton(qr)

    def nbytes(self) -> int:
        return sum(st.nbytes() for st in self.layers)

    def kept_counts(self) -> list[int]:
        """Slots held per layer (per KV head, padding included), as KVCache.kept_counts."""
        return [st.n_slots for st in self.layers]

    def stores(self) -> list:
        return list(self.layers)

    def describe(self) -> dict:
        b = self.budget
        d = {"method": self.name, **self.opt}
        d["budget"] = float(b.value) if b.is_fraction else int(b.value)
        if self.opt["report"] == "paper":
            d["paper"] = paper_ratios(self)
        return d


def paper_ratios(kv: SpindleKVCache) -> dict:
    """Eq. 15's r = r1 * r2 * r3 per layer: r1 tokens kept per query head / seen, r2 codebook
    entries / vectors they stand for, r3 = (d + int_bits / (elem_bits + 1)) / d. It prices indices
    and magnitudes at the codebook fraction, so it understates bytes."""
    c, g = kv.config, kv.group
    elem_bits = 8 * torch.empty(0, dtype=kv.dtype).element_size()
    r1s, r2s, r3s, rs = [], [], [], []
    for st in kv.layers:
        masks = [m for m in (st.mask_c, st.mask_d) if m is not None]
        kept = sum(int(unpack_bits(m, g).sum()) for m in masks)
        r1 = kept / (c.n_heads * kv.seen) if kv.seen else 1.0
        entries = sum(b.n for b in st.books_k + st.books_v)
        r2 = entries / (2 * kept) if kv.opt["codebook"] and kept else 1.0
        r3 = 1.0
        if kv.opt["codebook"]:
            int_bits = 8 * max(torch.empty(0, dtype=t).element_size() for t in st.idx_dtype)
            r3 = (c.head_dim + int_bits / (elem_bits + 1)) / c.head_dim
        r1s.append(round(r1, 6))
        r2s.append(round(r2, 6))
        r3s.append(round(r3, 6))
        rs.append(r1 * r2 * r3)
    return {"ratio": round(sum(rs) / len(rs), 6), "r1": r1s, "r2": r2s, "r3": r3s}
