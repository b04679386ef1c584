"""SpindleKV on a layer with a sliding window (Gemma 3's local layers, Mistral's window): the layer
holds at most the window's W slots per KV head, as llama.cpp's SWA cache does (issue 47). A turn's
compression keeps only the newest W positions (`trim`), a decode token takes the slot of its
head's oldest position (`ring`), and codebook rows no slot names any more are dropped
(`drop_unused_rows`), so the books stay bounded too (spec: docs/methods/spindlekv.md)."""

from __future__ import annotations

import torch

from .store import CODED, DENSE, CodedLayer, assign_books, unpack_bits

OLDEST = torch.iinfo(torch.int64).max  # the sort key of a slot not kept: after every kept one


def held(st: CodedLayer) -> list[tuple[str, ...]]:
    """The segments the layer holds (CODED, DENSE), each a tuple of its field names."""
    return [names for names in (CODED, DENSE) if names[-2] in st.bufs]


def live(st: CodedLayer, names: tuple[str, ...], lo: int) -> torch.Tensor:
    """(Hkv, S) bool: a real slot (a mask bit set, not padding) at a position >= lo."""
    pos, mask = st.bufs[names[-2]].data, st.bufs[names[-1]].data
    return mask.ne(0).any(-1) & (pos >= lo)


def stale(st: CodedLayer, lo: int) -> bool:
    """Whether the layer holds a real slot at a position < lo."""
    return any(bool((~live(st, n, lo) & live(st, n, -1)).any()) for n in held(st))


def trim(st: CodedLayer, lo: int) -> None:
    """Keep only the real slots at positions >= lo (the newest W, what the window still sees):
    each segment compacted to its largest head, each head's slots in position order, then
    padding. Two segments (decode_codebook=off) stay within W together: the dense one holds
    decode tokens, which every KV head holds alike, so a head's coded slots plus them are
    distinct positions of the window whichever head is the widest."""
    for names in held(st):
        compact(st, names, live(st, names, lo))
    masks = [st.bufs[names[-1]].data for names in held(st)]
    st.all_bits = all(bool(unpack_bits(m, st.group).all()) for m in masks)
    drop_unused_rows(st)


def compact(st: CodedLayer, names: tuple[str, ...], keep: torch.Tensor) -> None:
    """The segment's kept slots (Hkv, S) first, in position order, padded (zeros) to the
    largest head's count; a segment left empty is dropped."""
    count = keep.sum(1)  # (Hkv,)
    width = int(count.max()) if count.numel() else 0
    if width == 0:
        for name in names:
            st.bufs.pop(name)
        return
    pos = st.bufs[names[-2]].data
    order = torch.where(keep, pos.long(), OLDEST).argsort(dim=1, stable=True)[:, :width]
    valid = torch.arange(width, device=pos.device)[None, :] < count[:, None]  # (Hkv, width)
    for name in names:
        x = st.bufs[name].data  # (Hkv, S, ...)
        tail = [1] * (x.dim() - 2)
        ix = order.view(*order.shape, *tail).expand(-1, -1, *x.shape[2:])
        pad = ~valid.view(*valid.shape, *tail)
        st.bufs[name].replace(x.gather(1, ix).masked_fill(pad, 0))


def drop_unused_rows(st: CodedLayer) -> None:
    """Codebook rows that no real coded slot names are removed, the others keep their order
    (indices remapped, so every decision over the books reads them as before); the freed rows
    are zeroed (a .kvc file holds the shelf whole)."""
    coded = "pos_c" in st.bufs
    real = st.mask_c.ne(0).any(-1) if coded else None  # (Hkv, S_c)
    for books, shelf, name in (
        (st.books_k, st.shelf_k, "idx_k"),
        (st.books_v, st.shelf_v, "idx_v"),
    ):
        idx = st.bufs[name].data if coded else None
        for h, book in enumerate(books):
            rows = slice(None) if len(books) == 1 else slice(h, h + 1)
            used = torch.zeros(book.n, dtype=torch.bool, device=shelf.data.device)
            if coded:
                used[idx[rows][real[rows]].long()] = True
            n = int(used.sum())
            if n == book.n:
                continue
            kept = used.nonzero().squeeze(1)
            shelf.data[book.h, :n] = shelf.data[book.h, kept]
            shelf.data[book.h, n : book.n] = 0
            if coded:  # old row -> its new row; padding names row 0, as it did
                new = (used.cumsum(0) - 1).to(idx.dtype)
                idx[rows] = torch.where(real[rows], new[idx[rows].long()], 0)
            book.n = n


def ring(st: CodedLayer, layer: int, k, v, position: int, lo: int, mask, o, limit: int) -> bool:
    """One decode token k, v (Hkv, D) pre-RoPE written over each head's oldest slot that no
    query sees any more (padding first, then positions < lo) in the segment it belongs to,
    instead of appended. False (nothing written) where some head has no such slot there (a
    prefill-coded segment beside dense decode tokens): the caller appends, then trims."""
    coded = o["codebook"] and o["decode_codebook"]
    names = CODED if coded else DENSE
    if names[-2] not in st.bufs:
        return False
    pos = st.bufs[names[-2]].data  # (Hkv, S)
    real = st.bufs[names[-1]].data.ne(0).any(-1)
    dead = ~real | (pos < lo)
    if not bool(dead.any(1).all()):
        return False
    key = torch.where(real, pos.long(), -1).masked_fill(~dead, OLDEST)
    slot = key.argmin(dim=1)  # (Hkv,) the oldest dead slot of each head
    heads = torch.arange(pos.shape[0], device=pos.device)
    if coded:
        ik, mk = assign_books(st.books_k, k, o["theta_k"], st.kernels)
        iv, mv = assign_books(st.books_v, v, o["theta_v"], st.kernels)
        st.widen(layer, o["index"] == "int16-strict")
        rows = (ik.to(st.idx_dtype[0]), iv.to(st.idx_dtype[1]), mk.to(st.dtype), mv.to(st.dtype))
    else:
        rows = (k, v)
    rows += (torch.full_like(slot, position, dtype=torch.int32), mask[:, 0])
    for name, x in zip(names, rows, strict=True):
        st.bufs[name].data[heads, slot] = x
    if coded:  # a book holds at most 2 * limit rows per head it serves, plus one step's
        per_book = pos.shape[0] if len(st.books_k) == 1 else 1
        if max(b.n for b in st.books_k + st.books_v) > 2 * limit * per_book:
            drop_unused_rows(st)
    return True
