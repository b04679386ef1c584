"""SpindleKV's per-layer store (codebooks of §3.4, kvrun's layout): CodedLayer holds one layer's
K and V codebooks (kvrun.kv.codebook's Shelf and Book), the coded segment (codebook indices and
magnitudes), the dense segment (pre-RoPE K and V), each with int32 positions and uint8 keep
masks, and the prefill state of the current turn; every tensor is counted by nbytes. It also
widens a layer's indices to int32 (decision 8) and rebuilds its slots before RoPE;
paper_ratios reports the paper's Eq. 15 size over a manager's layers (report=paper).
kvrun.kv.spindle is the manager that fills the store and attends over it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import KvrunError
from .buffer import Buffer
from .codebook import Book, Shelf
from .select_qhead import unpack_bits

if TYPE_CHECKING:
    from .spindle import SpindleKV

INT16_MAX = 32767  # a codebook with more entries than this switches its layer to int32 indices


def cat_rows(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=1)


def nbytes_of(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class CodedLayer:
    """One layer's SpindleKV state (every tensor counted by nbytes)."""

    def __init__(self, n_books: int, d: int, dtype: torch.dtype, device, idx_dtype):
        self.shelf_k = Shelf(n_books, d, dtype, device)
        self.shelf_v = Shelf(n_books, d, dtype, device)
        self.books_k, self.books_v = self.shelf_k.books, self.shelf_v.books
        self.idx_dtype = [idx_dtype, idx_dtype]  # K, V
        # coded segment, (Hkv, S_c[, nb])
        self.idx_k = self.idx_v = self.mag_k = self.mag_v = None
        self.pos_c = self.mask_c = None
        # dense segment: pre-RoPE K and V (Hkv, S_d, D), positions, masks
        self.k_d = self.v_d = self.pos_d = self.mask_d = None
        self.all_bits = True  # every slot has every bit set (no padding): attention needs no mask
        # prefill state of the current turn (held state counts in nbytes until freed)
        self.held_k: Buffer | None = None  # (Hkv, T, D) pre-RoPE K of the turn so far
        self.held_v: Buffer | None = None  # (Hkv, T, D) pre-RoPE V
        self.qwin: torch.Tensor | None = None  # (Hq, <=w, D) post-RoPE queries

    @property
    def n_slots(self) -> int:
        return sum(0 if p is None else p.shape[1] for p in (self.pos_c, self.pos_d))

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

    def append_coded(self, idx_k, idx_v, mag_k, mag_v, pos, mask) -> None:
        self.idx_k, self.idx_v = cat_rows(self.idx_k, idx_k), cat_rows(self.idx_v, idx_v)
        self.mag_k, self.mag_v = cat_rows(self.mag_k, mag_k), cat_rows(self.mag_v, mag_v)
        self.pos_c, self.mask_c = cat_rows(self.pos_c, pos), cat_rows(self.mask_c, mask)

    def append_dense(self, k, v, pos, mask) -> None:
        self.k_d, self.v_d = cat_rows(self.k_d, k), cat_rows(self.v_d, v)
        self.pos_d, self.mask_d = cat_rows(self.pos_d, pos), cat_rows(self.mask_d, mask)

    def widen(self, layer: int, strict: bool) -> None:
        """Switch the layer's K or V indices to int32 once its codebook exceeds 32767 entries
        (decision 8); strict (index=int16-strict) raises instead."""
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
            if i == 0 and self.idx_k is not None:
                self.idx_k = self.idx_k.to(torch.int32)
            if i == 1 and self.idx_v is not None:
                self.idx_v = self.idx_v.to(torch.int32)

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
    """The paper's Eq. 15 size r = r1 * r2 * r3 per layer (report=paper; decision 9).

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
