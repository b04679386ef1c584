"""SpindleKV's per-layer store (codebooks of §3.4, kvrun's layout): CodedLayer holds one layer's
K and V codebooks (kvrun.kv.codebook's Shelf and Book), the coded segment (codebook indices and
magnitudes), the dense segment (pre-RoPE K and V), each with int32 positions and uint8 keep
masks, and the prefill state of the current turn; every tensor is counted by nbytes. It
attends in its own representation (the Store protocol), widens a layer's indices to int32
past 32767 entries (kvrun's rule: the paper gives no index width) and rebuilds its slots
before RoPE; paper_ratios reports the paper's Eq. 15 size (report=paper).
kvrun.kv.spindle is the manager that fills the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import KvrunError
from ..kernels.codebook_decode import codebook_decode
from .attention import Partial, dense_attention, position_mask, sdpa
from .buffer import Buffer
from .codebook import Book, Shelf, assign_books, build_books
from .select_qhead import unpack_bits

if TYPE_CHECKING:
    from .spindle import SpindleKV

INT16_MAX = 32767  # a codebook with more entries than this switches its layer to int32 indices


class _Seg:
    """A stored field of CodedLayer: the occupied slots of its Buffer (slots along dim 1), or
    None before the first append."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, layer: CodedLayer | None, owner=None):
        b = layer.bufs.get(self.name) if layer is not None else None
        return None if b is None else b.data

    def __set__(self, layer: CodedLayer, x: torch.Tensor) -> None:
        """The field's slots become x (a rewrite of every slot, as a permutation)."""
        layer.bufs.pop(self.name, None)
        layer._append(**{self.name: x})


def nbytes_of(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class CodedLayer:
    """One layer's SpindleKV state (every tensor counted by nbytes), attending in its own
    representation (the Store protocol, kvrun/kv/protocol.py): `partials` through
    kernels.codebook_decode, `attend` over the slots rebuilt for SDPA.

    rope: the model's kvrun.rope.Rope (slots are rotated at their own positions inside the
    attention); group: query heads per KV head (the keep masks hold one bit per query head).
    """

    # coded segment (Hkv, S_c[, nb]): codebook indices, magnitudes, int32 positions, keep masks
    idx_k, idx_v, mag_k, mag_v, pos_c, mask_c = _Seg(), _Seg(), _Seg(), _Seg(), _Seg(), _Seg()
    # dense segment: pre-RoPE K and V (Hkv, S_d, D), positions, masks
    k_d, v_d, pos_d, mask_d = _Seg(), _Seg(), _Seg(), _Seg()

    def __init__(self, n_books: int, d: int, dtype: torch.dtype, device, idx_dtype, rope, group):
        self.rope, self.group, self.dtype = rope, group, dtype
        self.shelf_k = Shelf(n_books, d, dtype, device)
        self.shelf_v = Shelf(n_books, d, dtype, device)
        self.books_k, self.books_v = self.shelf_k.books, self.shelf_v.books
        self.idx_dtype = [idx_dtype, idx_dtype]  # K, V
        self.bufs: dict[str, Buffer] = {}  # the _Seg fields' buffers, made at their first append
        self.all_bits = True  # every slot has every bit set (no padding): attention needs no mask
        # prefill state of the current turn (held state counts in nbytes until freed)
        self.held_k: Buffer | None = None  # (Hkv, T, D) pre-RoPE K of the turn so far
        self.held_v: Buffer | None = None  # (Hkv, T, D) pre-RoPE V
        self.qwin: torch.Tensor | None = None  # (Hq, <=w, D) post-RoPE queries

    @property
    def n_slots(self) -> int:
        return sum(0 if p is None else p.shape[1] for p in (self.pos_c, self.pos_d))

    length = n_slots  # the Store protocol's name (slots per KV head, padding included)

    def hold(self, k: torch.Tensor, v: torch.Tensor, capacity: int) -> None:
        """Keep a prefill chunk's pre-RoPE K and V (Hkv, T, D) until the turn is compressed."""
        if self.held_k is None:  # room for the whole turn at once
            shape = (k.shape[0], 0, k.shape[2])
            self.held_k = Buffer(shape, 1, k.dtype, k.device, capacity)
            self.held_v = Buffer(shape, 1, v.dtype, v.device, capacity)
        self.held_k.append(k)
        self.held_v.append(v)

    @property
    def held_n(self) -> int:
        return 0 if self.held_k is None else self.held_k.n

    def drop_turn(self) -> None:
        self.held_k = self.held_v = self.qwin = None

    def _append(self, **rows: torch.Tensor) -> None:
        """Slots (Hkv, n[, ...]) after the occupied ones of each named field (a decode token
        writes into the buffers' room instead of copying the layer's slots)."""
        for name, x in rows.items():
            b = self.bufs.get(name)
            if b is None:
                b = self.bufs[name] = Buffer((x.shape[0], 0, *x.shape[2:]), 1, x.dtype, x.device)
            b.append(x)

    def append_coded(self, idx_k, idx_v, mag_k, mag_v, pos, mask) -> None:
        self._append(idx_k=idx_k, idx_v=idx_v, mag_k=mag_k, mag_v=mag_v, pos_c=pos, mask_c=mask)

    def append_dense(self, k, v, pos, mask) -> None:
        self._append(k_d=k, v_d=v, pos_d=pos, mask_d=mask)

    def store_turn(self, layer: int, ks, vs, valid, pos, mask, o) -> None:
        """A turn's kept vectors (Hkv, S, D) pre-RoPE, in slot order (valid: real slots, the
        rest padding): coded with a greedy build whose entries are appended to the layer's
        codebooks (earlier entries and indices unchanged, as at decode), or stored dense with
        codebook=off (padding slots hold zeros)."""
        if not o["codebook"]:
            z = valid[..., None]
            self.append_dense(ks * z, vs * z, pos, mask)
            return
        ik, mk = build_books(self.books_k, ks, valid, o["theta_k"], o["cb_block"], self.dtype)
        iv, mv = build_books(self.books_v, vs, valid, o["theta_v"], o["cb_block"], self.dtype)
        self.widen(layer, o["index"] == "int16-strict")
        self.append_coded(ik.to(self.idx_dtype[0]), iv.to(self.idx_dtype[1]), mk, mv, pos, mask)

    def store_token(self, layer: int, k, v, pos, mask, o) -> None:
        """One decode token, k and v (Hkv, D) pre-RoPE at pos (Hkv, 1): assigned to the
        codebooks (new entries where none is within theta), or dense (decode_codebook=off)."""
        if not (o["codebook"] and o["decode_codebook"]):
            self.append_dense(k[:, None], v[:, None], pos, mask)
            return
        ik, mk = assign_books(self.books_k, k, o["theta_k"])
        iv, mv = assign_books(self.books_v, v, o["theta_v"])
        self.widen(layer, o["index"] == "int16-strict")
        self.append_coded(
            ik.to(self.idx_dtype[0])[:, None],
            iv.to(self.idx_dtype[1])[:, None],
            mk.to(self.dtype)[:, None],
            mv.to(self.dtype)[:, None],
            pos,
            mask,
        )

    def widen(self, layer: int, strict: bool) -> None:
        """Switch the layer's K or V indices to int32 once its codebook exceeds 32767 entries
        (kvrun's rule; the paper gives no index width); strict (index=int16-strict) raises."""
        for i, (books, name) in enumerate(((self.books_k, "key"), (self.books_v, "value"))):
            size = max(b.n for b in books)
            if size <= INT16_MAX or self.idx_dtype[i] == torch.int32:
                continue
            if strict:
                raise KvrunError(
                    f"spindlekv: layer {layer}'s {name} codebook has {size} entries, more than "
                    "int16 indices address; use spindlekv:index=auto or index=int32"
                )
            self.idx_dtype[i] = torch.int32
            b = self.bufs.get(("idx_k", "idx_v")[i])
            if b is not None:
                b.replace(b.data.to(torch.int32))

    def slots(self):
        """The layer's slots rebuilt before RoPE: K (Hkv, S, D), V (Hkv, S, D) in the KV dtype,
        positions (Hkv, S) int64 and masks (Hkv, S, nb); coded slots first."""
        kp, vp, pos, mask = [], [], [], []
        if self.pos_c is not None:
            kp.append(gather_books(self.books_k, self.idx_k) * self.mag_k[..., None])
            vp.append(gather_books(self.books_v, self.idx_v) * self.mag_v[..., None])
            pos.append(self.pos_c)
            mask.append(self.mask_c)
        if self.pos_d is not None:
            kp.append(self.k_d), vp.append(self.v_d)
            pos.append(self.pos_d), mask.append(self.mask_d)

        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

        return cat(kp), cat(vp), cat(pos).long(), cat(mask)

    # ------------------------------------------------------------ attention
    def partials(
        self, q: torch.Tensor, q_pos: torch.Tensor, n_new: int, window: int | None
    ) -> list[Partial]:
        """Decode attention of q (1, Hq, 1, D), post-RoPE, over the stored slots: one partial
        per segment (coded, dense), each gathered and rotated inside codebook_decode.

        For one query token that sees every slot (the manager's `_fuse` decides): its own
        token is already stored, so n_new needs no causal mask, and window must not hide a
        slot. q_pos is not read: the driver rotated q at its positions, so the RoPE tables
        already cover them and every slot before them.
        """
        cos, sin = self.rope.tables(0)
        parts = []
        if self.pos_c is not None:
            (bk, ok), (bv, ov) = self.shelf_k.table(), self.shelf_v.table()
            mask = None if self.all_bits else self.mask_c
            out, lse = codebook_decode(q, bk, self.idx_k, self.mag_k, bv, self.idx_v, self.mag_v,
                                       self.pos_c, cos, sin, mask, ok, ov)  # fmt: skip
            parts.append(Partial(out, lse))
        if self.pos_d is not None:
            mask = None if self.all_bits else self.mask_d
            out, lse = codebook_decode(q, self.k_d, None, None, self.v_d, None, None, self.pos_d,
                                       cos, sin, mask)  # fmt: skip
            parts.append(Partial(out, lse))
        return parts

    def attend(self, q, q_pos, window, k_new=None, v_new=None, k_pos_new=None) -> torch.Tensor:
        """Attention of q (1, Hq, T, D) at q_pos (T,) over the stored slots (masked per query
        head) and the turn's exact keys k_new (1, Hkv, n, D) post-RoPE at k_pos_new, if any:
        SDPA over the slots rebuilt (prefill, and decode steps `partials` does not take)."""
        if self.n_slots == 0:
            return dense_attention(q, k_new, v_new, q_pos, k_pos_new, window)
        ks, vs, pos, mask = self.materialise()
        Hq, Tq = q.shape[1], q.shape[2]
        vis = position_mask(q_pos, pos, window)  # (Hkv, Tq, S) or None
        m = None
        if not self.all_bits:
            m = unpack_bits(mask, self.group).transpose(1, 2).reshape(Hq, 1, -1)  # (Hq, 1, S)
        if vis is not None:
            vis = vis.repeat_interleave(self.group, dim=0)  # (Hq, Tq, S)
            m = vis if m is None else m & vis
        if k_new is not None:
            ks, vs = torch.cat([ks, k_new], dim=2), torch.cat([vs, v_new], dim=2)
            mn = position_mask(q_pos, k_pos_new, window)  # (Tq, n) or None
            if m is not None or mn is not None:
                S, n = pos.shape[1], k_pos_new.numel()
                ms = torch.ones(1, 1, 1, dtype=torch.bool, device=q.device) if m is None else m
                mn = torch.ones(1, 1, dtype=torch.bool, device=q.device) if mn is None else mn
                m = torch.cat([ms.expand(Hq, Tq, S), mn.expand(Hq, Tq, n)], dim=-1)
        if m is not None:
            m = m.expand(Hq, Tq, ks.shape[2])[None]
        return sdpa(q, ks, vs, m)

    def materialise(self):
        """The slots rebuilt: K post-RoPE (1, Hkv, S, D), V (1, Hkv, S, D) in the KV dtype,
        positions (Hkv, S) int64 and masks (Hkv, S, nb); coded slots first."""
        k, v, pos, mask = self.slots()
        return self.rope.apply(k[None], pos), v[None], pos, mask  # RoPE at each slot's position

    def nbytes(self) -> int:
        books = sum(b.nbytes() for b in self.books_k + self.books_v)
        stored = (self.idx_k, self.idx_v, self.mag_k, self.mag_v, self.pos_c, self.mask_c,
                  self.k_d, self.v_d, self.pos_d, self.mask_d, self.qwin)  # fmt: skip
        held = 0 if self.held_k is None else self.held_k.nbytes() + self.held_v.nbytes()
        return books + sum(nbytes_of(t) for t in stored) + held


def gather_books(books: list[Book], idx: torch.Tensor) -> torch.Tensor:
    """Codebook rows of idx (Hkv, S) -> (Hkv, S, d); one book per layer or one per KV head."""
    if len(books) == 1:
        return books[0].rows()[idx.long()]
    rows = []
    for h, b in enumerate(books):
        r = b.rows()
        rows.append(r[idx[h].long()] if b.n else r.new_zeros(idx.shape[1], r.shape[1]))
    return torch.stack(rows)


# --- the paper's size report (Eq. 15; report=paper) --------------------------------------------
def paper_ratios(kv: SpindleKV) -> dict:
    """The paper's Eq. 15 size r = r1 * r2 * r3 per layer (report=paper).

    r1: tokens kept per query head over tokens seen; r2: codebook entries (K and V) over
    the per-query-head vectors they stand for; r3 = (d + int_bits / (elem_bits + 1)) / d.
    It prices indices and magnitudes at the codebook fraction, so it understates bytes.
    """
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
