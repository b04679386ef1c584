"""SpindleKV (spindlekv.md): linearly falling per-layer eviction budgets, per-query-head
selection stored once per KV head with a keep mask per query head, and per-layer codebooks
of pre-RoPE K and V (unit entries, one index and one magnitude per slot).

Per layer the store holds a *coded* segment (codebook indices and magnitudes) and a *dense*
segment (pre-RoPE K and V: codebook=off, or decode tokens with decode_codebook=off), each
with int32 positions and uint8 keep masks, slots padded so every KV head has the same count.
Attention sees K = RoPE(C_K[idx_K] * mag_K, pos) and V = C_V[idx_V] * mag_V and masks query
head j of group h to the slots of head h with bit j set. A decode step attends through
kernels.codebook_decode, which gathers and rotates inside the kernel (Triton on CUDA, a
torch reference elsewhere), one partial per segment merged by log-sum-exp; prefill, and
decode under a sliding window that may mask, rebuild the slots densely for SDPA.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from ..errors import KvrunError
from ..kernels import use_triton
from ..kernels.codebook_decode import codebook_decode
from .alloc.spindle import spindle_keep
from .attention import Partial, combine, dense_attention, position_mask, sdpa
from .base import KVManager
from .codebook import (
    Book,
    CodedLayer,
    assign,
    build_codebook,
    gather_books,
    unit_vectors,
)
from .scores import pool_scores, window_scores
from .select_qhead import pack_bits, select_keep, union_slots, unpack_bits
from .spec import KVSpec

INT16_MAX = 32767  # a codebook with more entries than this switches its layer to int32 indices


# --- steps 2, 4, 5: scores, per-query-head selection, unions with masks ------------------------
def qhead_scores(
    qw: torch.Tensor,  # (Hq, w, D) post-RoPE queries of the turn's last w tokens
    k: torch.Tensor,  # (Hkv, t, D) post-RoPE keys of the turn
    sliding: int | None = None,
    length_norm: bool = True,
) -> torch.Tensor:  # (Hq, t - w) fp32
    """ac_q[a] = sum_b A_q[b, a] / (t - a) over the window rows b (Eq. 2), per query head.

    Softmax in fp32 over every key the row sees (causal; the model's sliding window too, so a
    token the model can never attend to scores 0): kvrun.kv.scores.window_scores.
    """
    vote = window_scores(qw, k, sliding)
    if length_norm:
        t, n_ctx = k.shape[1], vote.shape[1]
        vote = vote / (t - torch.arange(n_ctx, device=k.device)).float()
    return vote


# --- the manager ------------------------------------------------------------------------------------
class SpindleKV(KVManager):
    """SpindleKV on kvrun's manager contract; options are declared in kvrun/kv/methods/spindlekv.py."""

    def __init__(
        self,
        spec: KVSpec,
        config,
        rope,
        device,
        dtype,
        on_select=None,
    ):
        super().__init__(config, rope, device, dtype)
        self.spec, self.name = spec, spec.name
        self.opt = dict(spec.select_opts)
        self.window = self.opt["window"]
        self.budget = spec.budget_or_default()  # checked against the window by the spec
        self.beta = Fraction(str(self.opt["beta"]))
        # accepted for the runtime's signature and unused: per-query-head unions have ragged
        # sizes, which the (Hkv, T) positions of the debug hook cannot carry
        self.on_select = on_select
        self.group = config.n_heads // config.n_kv_heads
        self.ones_mask = pack_bits(
            torch.ones(config.n_kv_heads, 1, self.group, dtype=torch.bool, device=device)
        )  # (Hkv, 1, ceil(g/8)) a decode slot: every query head sees it
        self._fused = True  # decode through kernels.codebook_decode (False: the old path, tests)
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        super().reset()
        c = self.config
        n_books = c.n_kv_heads if self.opt["codebook_scope"] == "head" else 1
        idx = torch.int32 if self.opt["index"] == "int32" else torch.int16
        self.layers = [
            CodedLayer(n_books, c.head_dim, self.dtype, self.device, idx) for _ in range(c.n_layers)
        ]
        self.turn_start, self.turn_len = 0, 0
        self._plan: tuple[int, list[int] | None] | None = None

    def begin_prefill(self, n_tokens: int) -> None:
        super().begin_prefill(n_tokens)
        self.turn_start, self.turn_len = self.seen, n_tokens
        for st in self.layers:
            st.drop_turn()

    def end_prefill(self) -> None:
        for i, st in enumerate(self.layers):
            if st.held_n:  # chunked prefill: every layer compresses here (step 8)
                self._compress(i, st.held_k.data, st.held_v.data, st.qwin)
            st.drop_turn()
        super().end_prefill()

    # ---------------------------------------------------------------- attend
    def attend(self, layer, q, k, v, positions):
        st = self.layers[layer]
        qr = self.rope.apply(q, positions)  # (1, Hq, T, D)
        if not self.in_prefill:
            for i in range(k.shape[2]):  # decode: each token coded, then attended over
                self._append_token(layer, k[0, :, i], v[0, :, i], positions[i : i + 1])
            if self._fuse(st, qr):
                return self._decode_attention(st, qr)
            return self._attention(st, qr, positions)
        T = k.shape[2]
        if st.held_n == 0 and T == self.turn_len:  # the whole turn in one chunk (step 7)
            kp, vp = k[0], v[0]
        else:
            st.hold(k[0], v[0], self.turn_len)
            kp, vp = st.held_k.data, st.held_v.data
        n = kp.shape[1]
        tpos = torch.arange(self.turn_start, self.turn_start + n, device=positions.device)
        kr = self.rope.apply(kp[None], tpos)  # (1, Hkv, n, D) the turn so far, exact
        out = self._attention(st, qr, positions, kr, vp[None], tpos)
        prev = st.qwin if st.qwin is not None else qr.new_empty(qr.shape[1], 0, qr.shape[3])
        st.qwin = torch.cat([prev, qr[0]], dim=1)[:, -self.window :]
        if st.held_n == 0:  # compress now, so the peak is one layer of full KV
            self._compress(layer, kp, vp, st.qwin)
            st.drop_turn()
        return out

    def _fuse(self, st: CodedLayer, qr: torch.Tensor) -> bool:
        """Whether a decode step attends through kernels.codebook_decode: one new token (more
        would need causal masks among themselves); not when the model's sliding window may
        hide a slot (all positions up to the query's must fit in it); not for a layer of dense
        slots only (codebook=off) on the torch path, whose SDPA over the rotated slots equals
        `full` bit for bit (spindlekv.md, test 2)."""
        window = self.config.sliding_window
        if not self._fused or qr.shape[2] != 1:
            return False
        if window is not None and self.seen + 1 > window:
            return False
        return st.pos_c is not None or use_triton(qr)

    def _decode_attention(self, st: CodedLayer, qr: torch.Tensor) -> torch.Tensor:
        """Decode attention of qr (1, Hq, Tq, D) as the log-sum-exp combine of the coded and
        the dense segment's partials, each gathered and rotated inside codebook_decode."""
        cos, sin = self.rope.tables(self.seen + qr.shape[2])
        parts = []
        if st.pos_c is not None:
            (bk, ok), (bv, ov) = st.shelf_k.table(), st.shelf_v.table()
            mask = None if st.all_bits else st.mask_c
            out, lse = codebook_decode(qr, bk, st.idx_k, st.mag_k, bv, st.idx_v, st.mag_v,
                                       st.pos_c, cos, sin, mask, ok, ov)  # fmt: skip
            parts.append(Partial(out, lse))
        if st.pos_d is not None:
            mask = None if st.all_bits else st.mask_d
            out, lse = codebook_decode(qr, st.k_d, None, None, st.v_d, None, None, st.pos_d,
                                       cos, sin, mask)  # fmt: skip
            parts.append(Partial(out, lse))
        return combine(parts, qr.dtype)

    def _attention(self, st: CodedLayer, qr, q_pos, k_new=None, v_new=None, k_pos_new=None):
        """Attention of qr (1, Hq, T, D) over the stored slots (masked per query head) and the
        turn's exact keys k_new (1, Hkv, n, D) post-RoPE, if any."""
        window = self.config.sliding_window
        if st.n_slots == 0:
            return dense_attention(qr, k_new, v_new, q_pos, k_pos_new, window)
        ks, vs, pos, mask = self.materialise(st)
        Hq, Tq = qr.shape[1], qr.shape[2]
        vis = position_mask(q_pos, pos, window)  # (Hkv, Tq, S) or None
        m = None
        if not st.all_bits:
            m = unpack_bits(mask, self.group).transpose(1, 2).reshape(Hq, 1, -1)  # (Hq, 1, S)
        if vis is not None:
            vis = vis.repeat_interleave(self.group, dim=0)  # (Hq, Tq, S)
            m = vis if m is None else m & vis
        if k_new is not None:
            ks, vs = torch.cat([ks, k_new], dim=2), torch.cat([vs, v_new], dim=2)
            mn = position_mask(q_pos, k_pos_new, window)  # (Tq, n) or None
            if m is not None or mn is not None:
                S, n = pos.shape[1], k_pos_new.numel()
                ms = torch.ones(1, 1, 1, dtype=torch.bool, device=qr.device) if m is None else m
                mn = torch.ones(1, 1, dtype=torch.bool, device=qr.device) if mn is None else mn
                m = torch.cat([ms.expand(Hq, Tq, S), mn.expand(Hq, Tq, n)], dim=-1)
        if m is not None:
            m = m.expand(Hq, Tq, ks.shape[2])[None]
        return sdpa(qr, ks, vs, m)

    def materialise(self, st: CodedLayer):
        """The layer's slots rebuilt: K post-RoPE (1, Hkv, S, D), V (1, Hkv, S, D) in the KV
        dtype, positions (Hkv, S) int64 and masks (Hkv, S, nb); coded slots first."""
        kp, vp, pos, mask = [], [], [], []
        if st.pos_c is not None:
            kp.append(gather_books(st.books_k, st.idx_k) * st.mag_k[..., None])
            vp.append(gather_books(st.books_v, st.idx_v) * st.mag_v[..., None])
            pos.append(st.pos_c)
            mask.append(st.mask_c)
        if st.pos_d is not None:
            kp.append(st.k_d), vp.append(st.v_d), pos.append(st.pos_d), mask.append(st.mask_d)

        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

        pos_all = cat(pos).long()
        k = self.rope.apply(cat(kp)[None], pos_all)  # RoPE at each slot's position
        return k, cat(vp)[None], pos_all, cat(mask)

    # ------------------------------------------------------------ compression
    def _keep_plan(self, t: int) -> list[int] | None:
        """k_lambda for a turn of t tokens; B from the turn's own length (later turns too)."""
        if self._plan is None or self._plan[0] != t:
            B = self.budget.tokens(t, self.window)
            L = self.config.n_layers
            self._plan = (t, spindle_keep(t, B, self.window, L, self.beta, self.opt["schedule"]))
        return self._plan[1]

    def _compress(self, layer: int, kp: torch.Tensor, vp: torch.Tensor, qwin) -> None:
        """Steps 2-7 for one layer over the turn's pre-RoPE K, V (Hkv, t, D).

        Later chat turns (methods/README.md): only the new turn's tokens are compressed, with
        the same rule and fractions (B from the turn's length) and a softmax over the turn's
        own keys, as SnapKV does over a KIVI staging area; earlier turns stay as stored. The
        turn's kept vectors get their own greedy build, whose entries are appended to the
        layer's codebook (earlier entries and indices unchanged, as at decode).
        """
        st, o = self.layers[layer], self.opt
        Hkv, t, _ = kp.shape
        plan = self._keep_plan(t)
        if plan is None:
            keep = torch.ones(Hkv, self.group, t, dtype=torch.bool, device=kp.device)
        else:
            tpos = torch.arange(self.turn_start, self.turn_start + t, device=kp.device)
            kr = self.rope.apply(kp[None], tpos)[0]  # (Hkv, t, D) post-RoPE, transient
            sc = qhead_scores(qwin, kr, self.config.sliding_window, o["score_norm"] == "length")
            sc = pool_scores(sc, o["pool"])
            keep = select_keep(sc, plan[layer], t, Hkv, o["gqa"])
        sl = union_slots(keep)
        st.all_bits &= bool(sl.valid.all()) and bool(keep.all(1).eq(keep.any(1)).all())
        pos = torch.where(sl.valid, sl.rel + self.turn_start, 0).to(torch.int32)  # (Hkv, S)
        gather = sl.rel[..., None].expand(-1, -1, kp.shape[2])
        ks, vs = kp.gather(1, gather), vp.gather(1, gather)  # (Hkv, S, D) kept, in slot order
        if not o["codebook"]:
            z = sl.valid[..., None]
            st.append_dense(ks * z, vs * z, pos, sl.mask)  # padding slots hold zeros
            return
        ik, mk = self._build(st.books_k, ks, sl.valid, o["theta_k"])
        iv, mv = self._build(st.books_v, vs, sl.valid, o["theta_v"])
        self._widen(layer, st)
        st.append_coded(ik.to(st.idx_dtype[0]), iv.to(st.idx_dtype[1]), mk, mv, pos, sl.mask)

    def _build(self, books: list[Book], x: torch.Tensor, valid: torch.Tensor, theta: float):
        """Code the valid slots of x (Hkv, S, D): idx (Hkv, S) int64 and magnitudes (Hkv, S)
        in the KV dtype, 0 on padding; new entries appended to the books."""
        idx = torch.zeros(valid.shape, dtype=torch.int64, device=x.device)
        mag = torch.zeros(valid.shape, dtype=self.dtype, device=x.device)
        groups = [(books[0], valid)] if len(books) == 1 else []
        for h, b in enumerate(books if len(books) > 1 else []):
            sel = torch.zeros_like(valid)
            sel[h] = valid[h]
            groups.append((b, sel))
        for book, sel in groups:  # candidates ordered by head, then position
            u, m = unit_vectors(x[sel])
            entries, ix = build_codebook(u, theta, self.opt["cb_block"], self.dtype)
            idx[sel] = ix + book.n
            mag[sel] = m.to(self.dtype)
            book.append(entries)
        return idx, mag

    def _widen(self, layer: int, st: CodedLayer) -> None:
        """Switch a layer's K or V indices to int32 once its codebook exceeds 32767 entries."""
        for i, (books, name) in enumerate(((st.books_k, "key"), (st.books_v, "value"))):
            size = max(b.n for b in books)
            if size <= INT16_MAX or st.idx_dtype[i] == torch.int32:
                continue
            if self.opt["index"] == "int16-strict":
                raise KvrunError(
                    f"spindlekv: layer {layer}'s {name} codebook has {size} entries, more than "
                    "int16 indices address; use spindlekv:index=auto or index=int32"
                )
            st.idx_dtype[i] = torch.int32
            if i == 0 and st.idx_k is not None:
                st.idx_k = st.idx_k.to(torch.int32)
            if i == 1 and st.idx_v is not None:
                st.idx_v = st.idx_v.to(torch.int32)

    def _append_token(self, layer: int, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor):
        """Store one decode token, k and v (Hkv, D) pre-RoPE at position p (1,)."""
        st, Hkv = self.layers[layer], k.shape[0]
        pos = p.to(torch.int32).expand(Hkv, 1)
        o = self.opt
        if not (o["codebook"] and o["decode_codebook"]):
            st.append_dense(k[:, None], v[:, None], pos, self.ones_mask)
            return
        ik, mk = self._assign(st.books_k, k, o["theta_k"])
        iv, mv = self._assign(st.books_v, v, o["theta_v"])
        self._widen(layer, st)
        st.append_coded(
            ik.to(st.idx_dtype[0])[:, None],
            iv.to(st.idx_dtype[1])[:, None],
            mk.to(self.dtype)[:, None],
            mv.to(self.dtype)[:, None],
            pos,
            self.ones_mask,
        )

    @staticmethod
    def _assign(books: list[Book], x: torch.Tensor, theta: float):
        """Decode step 1 for the KV heads in order: idx (Hkv,) and magnitudes (Hkv,) fp32."""
        if len(books) == 1:
            idx, new, m = assign(books[0].rows(), x, theta)
            books[0].append(new)
            return idx, m
        out = [assign(b.rows(), x[h : h + 1], theta) for h, b in enumerate(books)]
        for b, (_, new, _) in zip(books, out, strict=True):
            b.append(new)
        return torch.cat([i for i, _, _ in out]), torch.cat([m for _, _, m in out])

    # ------------------------------------------------------------- accounting
    def nbytes(self) -> int:
        return sum(st.nbytes() for st in self.layers)

    def codebook_sizes(self) -> list[tuple[int, int]]:
        """(|C_K|, |C_V|) per layer (summed over heads with codebook_scope=head)."""
        return [(sum(b.n for b in st.books_k), sum(b.n for b in st.books_v)) for st in self.layers]

    def describe(self) -> dict:
        b = self.budget
        d = {"method": self.name, **self.opt}
        d["budget"] = float(b.value) if b.is_fraction else int(b.value)
        if self.opt["report"] == "paper":
            d["paper"] = self.paper_ratios()
        return d

    def paper_ratios(self) -> dict:
        """The paper's Eq. 15 size r = r1 * r2 * r3 per layer (report=paper; decision 9).

        r1: tokens kept per query head over tokens seen; r2: codebook entries (K and V) over
        the per-query-head vectors they stand for; r3 = (d + int_bits / (elem_bits + 1)) / d.
        It prices indices and magnitudes at the codebook fraction, so it understates bytes.
        """
        c, g = self.config, self.group
        elem_bits = 8 * torch.empty(0, dtype=self.dtype).element_size()
        r1s, r2s, r3s, rs = [], [], [], []
        for st in self.layers:
            masks = [m for m in (st.mask_c, st.mask_d) if m is not None]
            kept = sum(int(unpack_bits(m, g).sum()) for m in masks)
            r1 = kept / (c.n_heads * self.seen) if self.seen else 1.0
            entries = sum(b.n for b in st.books_k + st.books_v)
            r2 = entries / (2 * kept) if self.opt["codebook"] and kept else 1.0
            r3 = 1.0
            if self.opt["codebook"]:
                int_bits = 8 * max(torch.empty(0, dtype=t).element_size() for t in st.idx_dtype)
                r3 = (c.head_dim + int_bits / (elem_bits + 1)) / c.head_dim
            r1s.append(round(r1, 6))
            r2s.append(round(r2, 6))
            r3s.append(round(r3, 6))
            rs.append(r1 * r2 * r3)
        return {"ratio": round(sum(rs) / len(rs), 6), "r1": r1s, "r2": r2s, "r3": r3s}
