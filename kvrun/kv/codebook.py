"""SpindleKV's codebooks: a greedy cover of unit vectors by medoids on the cosine graph.

SpindleKV §3.4 (Alg. 1, corrected). Nodes are unit vectors u; a and b are adjacent when
u_a . u_b > theta (and every node is its own neighbour). While nodes are alive, the node with
the most alive neighbours (lowest index on ties) becomes a codebook entry and takes all its
alive neighbours with it. The N x N graph is never built: degrees come from tiles of
cb_block x cb_block cosines, the neighbours of a pick from one matvec, and the degree updates
from tiles of u_alive . u_removed^T, so the whole build costs about two all-pairs passes and
O(cb_block^2 + N) extra memory. The paper's Alg. 1 sums S (never changing) instead of the
alive degree; the spec's correction is used here.

Decode-time assignment (SpindleKV §3.4, "merge, else rebuild", read one token at a time)
joins the best entry above theta, else appends the vector as a new entry, heads in order so a
later head can join an entry created earlier in the same step.

This module holds the codebooks themselves: the greedy build, decode-time assignment, the
growable books (Shelf, Book) and the coding of a layer's slots against its list of books
(build_books, assign_books). The per-layer store that holds the books with the indices,
magnitudes and dense slots is kvrun.kv.coded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

ROUND = 32  # candidates examined per round of the greedy loop
CPU_TILE = 1024  # on CPU a cb_block tile is split so it stays in cache (same counts, ~3x faster)


@contextmanager
def exact_fp32() -> Iterator[None]:
    """Cosines are fp32 on every path: TF32 matmuls (CUDA) are switched off inside."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def unit_vectors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x (N, d) as fp32 unit vectors u (N, d) and magnitudes m (N,); u = 0 where m = 0."""
    xf = x.float()
    m = torch.linalg.vector_norm(xf, dim=-1)  # (N,)
    u = xf / torch.where(m > 0, m, 1.0)[:, None]  # (N, d)
    return u, m


def _count_above(a: torch.Tensor, b: torch.Tensor, theta: float, block: int) -> torch.Tensor:
    """For each row of a (n, d): how many rows of b (m, d) have cosine > theta -> (n,) int32."""
    out = torch.zeros(a.shape[0], dtype=torch.int32, device=a.device)
    for j in range(0, b.shape[0], block):
        bt = b[j : j + block].T  # (d, <=block)
        for i in range(0, a.shape[0], block):
            out[i : i + block] += (a[i : i + block] @ bt > theta).sum(1, dtype=torch.int32)
    return out


def initial_degrees(u: torch.Tensor, theta: float, block: int) -> torch.Tensor:
    """deg[a] = #{b : u_a . u_b > theta} with G[a, a] = 1 -> (N,) int32, by square tiles.

    Only tiles on and above the diagonal are computed; a tile's column counts give the mirror
    tile's row counts, so the graph the degrees describe is exactly symmetric.
    """
    N = u.shape[0]
    deg = torch.zeros(N, dtype=torch.int32, device=u.device)
    for i in range(0, N, block):
        ui = u[i : i + block]  # (bi, d)
        for j in range(i, N, block):
            tile = ui @ u[j : j + block].T > theta  # (bi, bj)
            if j == i:
                tile.fill_diagonal_(True)
            deg[i : i + block] += tile.sum(1, dtype=torch.int32)
            if j != i:
                deg[j : j + block] += tile.sum(0, dtype=torch.int32)
    return deg


def build_codebook(
    u: torch.Tensor,  # (N, d) fp32 unit (or zero) vectors, in candidate order
    theta: float,
    block: int = 4096,
    dtype: torch.dtype = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor]:  # entries (C, d) in dtype, idx (N,) int64
    """The greedy medoid cover of SpindleKV's Alg. 1 (corrected), blocked; see the module doc."""
    N, d = u.shape
    idx = torch.empty(N, dtype=torch.int64, device=u.device)
    if N == 0:
        return u.new_empty(0, d, dtype=dtype), idx
    if u.device.type == "cpu":
        block = min(block, CPU_TILE)
    with exact_fp32():
        u = u.float().contiguous()
        deg = initial_degrees(u, theta, block)  # (n,) alive degrees; dead rows hold <= 0
        ids = torch.arange(N, device=u.device)  # original index of each row, ascending
        alive = torch.ones(N, dtype=torch.bool, device=u.device)
        ua, n_alive, c = u, N, 0
        picks: list[torch.Tensor] = []  # medoid indices in entry order
        while n_alive:
            n = ua.shape[0]
            # candidates in pick order: degree descending, then index ascending (unique keys)
            key = deg.long() * n - torch.arange(n, device=u.device)
            cand = key.topk(min(ROUND, n)).indices  # (k,)
            cdeg = deg[cand].tolist()
            if cdeg[0] <= 1:  # nothing merges any more: the rest are their own entries
                rest = ids[alive]
                idx[rest] = torch.arange(c, c + rest.numel(), device=u.device)
                picks.append(rest)
                break
            k = next((i for i, dg in enumerate(cdeg) if dg <= 1), len(cdeg))
            cand = cand[:k]
            hit = (ua @ ua[cand].T > theta) & alive[:, None]  # (n, k) alive neighbourhoods
            hit[cand, torch.arange(k, device=u.device)] = True
            # a leading run of candidates whose neighbourhoods are pairwise disjoint are the
            # next picks of the one-at-a-time greedy: removing one leaves the others' degrees
            # unchanged, and every other node's degree can only fall
            hf = hit.float()
            overlap = (hf.T @ hf).tril(-1)  # (k, k) shared neighbours with earlier candidates
            clash = (overlap > 0).any(1).tolist()
            p = clash.index(True) if True in clash else k
            rows, col = hit[:, :p].nonzero(as_tuple=True)  # each row in exactly one column
            idx[ids[rows]] = c + col
            picks.append(ids[cand[:p]])
            c += p
            alive[rows] = False
            deg[rows] = 0
            n_alive -= rows.numel()
            deg -= _count_above(ua, ua[rows], theta, block)
            if n_alive and n_alive * 2 < n:  # compact: dead rows cost matmul time
                ua, ids, deg = ua[alive], ids[alive], deg[alive]
                alive = torch.ones(n_alive, dtype=torch.bool, device=u.device)
        entries = u[torch.cat(picks)].to(dtype)  # (C, d)
    return entries, idx


def assign(
    entries: torch.Tensor,  # (C, d) unit vectors of one codebook
    x: torch.Tensor,  # (H, d) new vectors, one per KV head, in head order
    theta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Code new vectors against a codebook (SpindleKV §3.4, decode-time merging).

    Returns idx (H,) int64 into the codebook after `new` is appended, new entries (M, d) in
    the entries' dtype, and magnitudes (H,) fp32. A vector joins argmax_c cos(u, C_c) (lowest
    index on ties) when that cosine exceeds theta, else becomes a new entry; entries made by
    earlier heads of the same call count for later heads.
    """
    u, m = unit_vectors(x)  # (H, d), (H,)
    H, C = u.shape[0], entries.shape[0]
    stored = u.to(entries.dtype)  # what a new entry holds
    with exact_fp32():
        if C:
            best, arg = (u @ entries.float().T).max(dim=1)  # (H,) first maximum on ties
            best_l, arg_l = best.tolist(), arg.tolist()
        else:
            best_l, arg_l = [float("-inf")] * H, [0] * H
        cross = (u @ stored.float().T).tolist()  # cross[h][h'] = u_h . entry made from head h'
    made: list[int] = []  # heads whose vector became a new entry, in order
    out = []
    for h in range(H):
        b, a = best_l[h], arg_l[h]
        for j, src in enumerate(made):  # strictly greater: ties keep the lower index
            if cross[h][src] > b:
                b, a = cross[h][src], C + j
        if b > theta:
            out.append(a)
        else:
            out.append(C + len(made))
            made.append(h)
    new = stored[made] if made else stored[:0]
    return torch.tensor(out, dtype=torch.int64, device=x.device), new, m


# --- SpindleKV's growable codebooks (the per-layer store is kvrun.kv.coded) --------------------
class Shelf:
    """One layer's K (or V) codebooks, one shared or one per KV head, in one buffer
    (n_books, capacity, d): book h starts at row h * capacity of its flat view, so the decode
    kernel reads per-head books through offsets, with no concatenation (nothing copied per
    step; all books grow together, by doubling, when one is full)."""

    def __init__(self, n_books: int, d: int, dtype: torch.dtype, device):
        self.data = torch.empty(n_books, 0, d, dtype=dtype, device=device)  # (n_books, cap, d)
        self.books = [Book(self, h) for h in range(n_books)]
        self._off: torch.Tensor | None = None  # (n_books,) int32 h * capacity, per capacity

    def reserve(self, n: int) -> None:
        """Room for n rows in every book."""
        cap = self.data.shape[1]
        if n <= cap:
            return
        grown = self.data.new_empty(self.data.shape[0], max(2 * cap, n, 64), self.data.shape[2])
        for b in self.books:
            grown[b.h, : b.n] = self.data[b.h, : b.n]
        self.data, self._off = grown, None

    def table(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every book as rows of one table (n_books * capacity, d) and the first row of each
        book (n_books,) int32 (None for one book): kernels.codebook_decode's book and off."""
        n_books, cap, d = self.data.shape
        if n_books == 1:
            return self.data[0], None
        if self._off is None:
            self._off = torch.arange(n_books, device=self.data.device, dtype=torch.int32) * cap
        return self.data.view(n_books * cap, d), self._off


class Book:
    """A growable codebook (rows of unit vectors) on its shelf; only the n used rows count."""

    def __init__(self, shelf: Shelf, h: int):
        self.shelf, self.h = shelf, h
        self.n = 0

    def rows(self) -> torch.Tensor:  # (n, d)
        return self.shelf.data[self.h, : self.n]

    def append(self, rows: torch.Tensor) -> None:
        m = rows.shape[0]
        self.shelf.reserve(self.n + m)
        self.shelf.data[self.h, self.n : self.n + m] = rows
        self.n += m

    def nbytes(self) -> int:
        return self.n * self.shelf.data.shape[2] * self.shelf.data.element_size()


# --- coding a layer's slots against its books (steps 6-7; Decode 1) ----------------------------
def build_books(
    books: list[Book],
    x: torch.Tensor,  # (Hkv, S, D) kept vectors in slot order
    valid: torch.Tensor,  # (Hkv, S) bool, False on padding slots
    theta: float,
    cb_block: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Code the valid slots of x (Hkv, S, D): idx (Hkv, S) int64 and magnitudes (Hkv, S)
    in dtype (the KV dtype), 0 on padding; new entries appended to the books."""
    idx = torch.zeros(valid.shape, dtype=torch.int64, device=x.device)
    mag = torch.zeros(valid.shape, dtype=dtype, device=x.device)
    groups = [(books[0], valid)] if len(books) == 1 else []
    for h, b in enumerate(books if len(books) > 1 else []):
        sel = torch.zeros_like(valid)
        sel[h] = valid[h]
        groups.append((b, sel))
    for book, sel in groups:  # candidates ordered by head, then position
        u, m = unit_vectors(x[sel])
        entries, ix = build_codebook(u, theta, cb_block, dtype)
        idx[sel] = ix + book.n
        mag[sel] = m.to(dtype)
        book.append(entries)
    return idx, mag


def assign_books(
    books: list[Book], x: torch.Tensor, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode step 1 for the KV heads in order: idx (Hkv,) and magnitudes (Hkv,) fp32."""
    if len(books) == 1:
        idx, new, m = assign(books[0].rows(), x, theta)
        books[0].append(new)
        return idx, m
    out = [assign(b.rows(), x[h : h + 1], theta) for h, b in enumerate(books)]
    for b, (_, new, _) in zip(books, out, strict=True):
        b.append(new)
    return torch.cat([i for i, _, _ in out]), torch.cat([m for _, _, m in out])
