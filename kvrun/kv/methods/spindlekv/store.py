"""SpindleKV's store (§3.4, kvrun's layout): the codebooks and CodedLayer, one layer's store,
which attends in its own representation (the Store protocol); spindlekv/cache.py fills it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ....errors import KvrunError
from ....kernels.codebook_decode import codebook_decode
from ...attention import Partial, dense_attention, position_mask, sdpa
from ...state import Bool, Buf, Dtype, Int, Into, Like, ListInto, ListOf, Record, state
from ...stores.buffer import Buffer

ROUND = 32  # candidates examined per round of the greedy loop
CPU_TILE = 1024  # on CPU a cb_block tile is split so it stays in cache (same counts, ~3x faster)
MAX_EDGES = 1 << 24  # the native build's graph (8 bytes an edge); a denser one takes the blocks


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
    """deg[a] = #{b : u_a . u_b > theta}, G[a, a] = 1 -> (N,) int32; tiles on and above the
    diagonal only, mirrored, so the graph the degrees describe is exactly symmetric."""
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
    kernels=None,
) -> tuple[torch.Tensor, torch.Tensor]:  # entries (C, d) in dtype, idx (N,) int64
    """The greedy medoid cover of Alg. 1, with the spec's correction (alive degrees, where the paper
    sums the fixed S): u_a, u_b adjacent when u_a . u_b > theta (each node its own neighbour); the
    node with the most alive neighbours (lowest index on ties) becomes an entry and takes them.
    Blocked, never the N x N graph: about two all-pairs passes, O(block^2 + N) memory. With the
    native CPU kernels (`kernels`), codebook_build: the graph's edges made once in the same tiles
    and kept as lists, then the same greedy one pick at a time (where the edges stay under
    MAX_EDGES; else this path)."""
    N, d = u.shape
    idx = torch.empty(N, dtype=torch.int64, device=u.device)
    if N == 0:
        return u.new_empty(0, d, dtype=dtype), idx
    if u.device.type == "cpu":
        block = min(block, CPU_TILE)
        if kernels is not None:
            u = u.float().contiguous()
            order, made = kernels.codebook_build(u, theta, block, MAX_EDGES)
            if order.numel():
                return u[order].to(dtype), made
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
            # leading candidates with pairwise disjoint neighbourhoods are the greedy's next picks:
            # removing one leaves the others' degrees unchanged (any other degree only falls)
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
    """Decode-time merging (§3.4): idx (H,) int64 into the codebook with `new` (M, d) appended, and
    magnitudes (H,) fp32. A vector joins its best entry (lowest index on ties) if above theta, else
    becomes a new entry that later heads of the call can join ("merge, else rebuild", per token)."""
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


@state(data=Like({1: "cap"}), books=ListInto())
class Shelf:
    """One layer's K (or V) codebooks, shared or one per KV head, in one (n_books, cap, d) buffer:
    the decode kernel reads book h at flat row h * cap, nothing copied per step."""

    def __init__(self, n_books: int, d: int, dtype: torch.dtype, device):
        self.data = torch.empty(n_books, 0, d, dtype=dtype, device=device)  # (n_books, cap, d)
        self.books = [Book(self, h) for h in range(n_books)]
        self._off: torch.Tensor | None = None  # (n_books,) int32 h * capacity, per capacity

    def kvc_check(self, loader) -> str | None:
        """Every book's rows on the shelf (kvrun.kv.state)."""
        if any(b.n > self.data.shape[1] for b in self.books):
            return f"a book holds more rows than the shelf's {self.data.shape[1]}"
        return None

    def reserve(self, n: int) -> None:
        """Room for n rows in every book."""
        cap = self.data.shape[1]
        if n <= cap:
            return
        # zeros, not empty: the spare rows go into a .kvc file with the shelf (no stray memory)
        grown = self.data.new_zeros(self.data.shape[0], max(2 * cap, n, 64), self.data.shape[2])
        for b in self.books:
            grown[b.h, : b.n] = self.data[b.h, : b.n]
        self.data, self._off = grown, None

    def table(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """codebook_decode's book (n_books * cap, d) and off (n_books,) int32 (None: one book)."""
        n_books, cap, d = self.data.shape
        if n_books == 1:
            return self.data[0], None
        if self._off is None:
            self._off = torch.arange(n_books, device=self.data.device, dtype=torch.int32) * cap
        return self.data.view(n_books * cap, d), self._off


@state(n=Int(0))  # its rows; the shelf and the head are the run's
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


def build_books(
    books: list[Book],
    x: torch.Tensor,  # (Hkv, S, D) kept vectors in slot order
    valid: torch.Tensor,  # (Hkv, S) bool, False on padding slots
    theta: float,
    cb_block: int,
    dtype: torch.dtype,
    kernels=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 6-7, new entries into the books: idx (Hkv, S) int64, magnitudes (Hkv, S) in dtype
    (the build natively where `kernels`)."""
    idx = torch.zeros(valid.shape, dtype=torch.int64, device=x.device)
    mag = torch.zeros(valid.shape, dtype=dtype, device=x.device)
    groups = [(books[0], valid)] if len(books) == 1 else []
    for h, b in enumerate(books if len(books) > 1 else []):
        sel = torch.zeros_like(valid)
        sel[h] = valid[h]
        groups.append((b, sel))
    for book, sel in groups:  # candidates ordered by head, then position
        u, m = unit_vectors(x[sel])
        entries, ix = build_codebook(u, theta, cb_block, dtype, kernels)
        idx[sel] = ix + book.n
        mag[sel] = m.to(dtype)
        book.append(entries)
    return idx, mag


def assign_books(
    books: list[Book], x: torch.Tensor, theta: float, kernels=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode step 1 for the KV heads in order: idx (Hkv,) and magnitudes (Hkv,) fp32; with the
    native kernels in one call that writes the new entries onto the shelf (codebook_assign)."""
    if kernels is not None:
        shelf = books[0].shelf
        shelf.reserve(max(b.n for b in books) + (x.shape[0] if len(books) == 1 else 1))
        counts = torch.tensor([b.n for b in books], dtype=torch.int64)
        idx, m = kernels.codebook_assign(x, shelf.data, counts, theta)
        for b, n in zip(books, counts.tolist(), strict=True):
            b.n = n
        return idx, m
    if len(books) == 1:
        idx, new, m = assign(books[0].rows(), x, theta)
        books[0].append(new)
        return idx, m
    out = [assign(b.rows(), x[h : h + 1], theta) for h, b in enumerate(books)]
    for b, (_, new, _) in zip(books, out, strict=True):
        b.append(new)
    return torch.cat([i for i, _, _ in out]), torch.cat([m for _, _, m in out])


INT16_MAX = 32767  # a codebook with more entries than this switches its layer to int32 indices


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Keep masks (Eq. 7): (..., g) bool -> (..., ceil(g/8)) uint8, bit j % 8 of byte j // 8."""
    g = bits.shape[-1]
    out = torch.zeros(*bits.shape[:-1], -(-g // 8), dtype=torch.uint8, device=bits.device)
    for j in range(g):
        out[..., j // 8] |= bits[..., j].to(torch.uint8) << (j % 8)
    return out


def unpack_bits(mask: torch.Tensor, g: int) -> torch.Tensor:
    """(..., ceil(g/8)) uint8 -> (..., g) bool."""
    j = torch.arange(g, device=mask.device)
    return ((mask[..., j // 8] >> (j % 8).to(torch.uint8)) & 1).bool()


class _Seg:
    """A CodedLayer field: its Buffer's occupied slots (dim 1), None before the first append."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, layer: CodedLayer | None, owner=None):
        b = layer.bufs.get(self.name) if layer is not None else None
        return None if b is None else b.data

    def __set__(self, layer: CodedLayer, x: torch.Tensor) -> None:
        layer.bufs.pop(self.name, None)
        layer._append(**{self.name: x})


def nbytes_of(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


_MASK = "(group + 7) // 8"  # mask bytes per slot: a bit per query head of the group
CODED = ("idx_k", "idx_v", "mag_k", "mag_v", "pos_c", "mask_c")
DENSE = ("k_d", "v_d", "pos_d", "mask_d")


# a .kvc file holds the books, the segments' buffers and the index widths; a prefill's turn
# buffers are gone between turns, and RoPE, the group and the dtype are the run's
@state(
    shelf_k=Into(),
    shelf_v=Into(),
    idx_dtype=ListOf(Dtype("int16", "int32"), 2, exactly=True),
    all_bits=Bool(),
    bufs=Record(
        idx_k=Buf(("int16", "int32"), ("H", "sc"), 1),
        idx_v=Buf(("int16", "int32"), ("H", "sc"), 1),
        mag_k=Buf("kv", ("H", "sc"), 1),
        mag_v=Buf("kv", ("H", "sc"), 1),
        pos_c=Buf("int32", ("H", "sc"), 1),
        mask_c=Buf("uint8", ("H", "sc", _MASK), 1),
        k_d=Buf("kv", ("H", "sd", "D"), 1),
        v_d=Buf("kv", ("H", "sd", "D"), 1),
        pos_d=Buf("int32", ("H", "sd"), 1),
        mask_d=Buf("uint8", ("H", "sd", _MASK), 1),
    ),
)
class CodedLayer:
    """One layer's SpindleKV state, every tensor in nbytes; rope rotates slots at their own
    positions inside attention; group: query heads per KV head (a mask bit each)."""

    # coded segment (Hkv, S_c[, nb]): codebook indices, magnitudes, int32 positions, keep masks
    idx_k, idx_v, mag_k, mag_v, pos_c, mask_c = _Seg(), _Seg(), _Seg(), _Seg(), _Seg(), _Seg()
    # dense segment: pre-RoPE K and V (Hkv, S_d, D), positions, masks
    k_d, v_d, pos_d, mask_d = _Seg(), _Seg(), _Seg(), _Seg()

    def __init__(
        self, n_books: int, d: int, dtype: torch.dtype, device, idx_dtype, rope, group, kernels=None
    ):
        self.rope, self.group, self.dtype = rope, group, dtype
        # the model's native CPU step kernels (kvrun.models.rope.Rope.kernels): decode tokens are coded
        # and attended over natively (codebook_assign, codebook_attn); None: the torch path
        self.kernels = kernels
        self.shelf_k = Shelf(n_books, d, dtype, device)
        self.shelf_v = Shelf(n_books, d, dtype, device)
        self.books_k, self.books_v = self.shelf_k.books, self.shelf_v.books
        self.idx_dtype = [idx_dtype, idx_dtype]  # K, V
        self.bufs: dict[str, Buffer] = {}  # the _Seg fields' buffers, made at their first append
        self.all_bits = True  # every slot has every bit set (no padding): attention needs no mask
        # prefill state of the current turn (held state counts in nbytes until freed)
        self.turn_k: Buffer | None = None  # (Hkv, T, D) pre-RoPE K of the turn so far
        self.turn_v: Buffer | None = None  # (Hkv, T, D) pre-RoPE V
        self.qwin: torch.Tensor | None = None  # (Hq, <=w, D) post-RoPE queries

    def kvc_check(self, loader) -> str | None:
        """Whole segments, indices of the width declared and each inside its book."""
        for part in (CODED, DENSE):
            if 0 < sum(n in self.bufs for n in part) < len(part):
                return f"a segment with only some of {list(part)}"
        for i, (name, books) in enumerate((("idx_k", self.books_k), ("idx_v", self.books_v))):
            b = self.bufs.get(name)
            if b is None:
                continue
            if b.buf.dtype != self.idx_dtype[i]:
                return f"{name} is {b.buf.dtype}, not the {self.idx_dtype[i]} it declares"
            idx = b.data.long()
            for h in range(idx.shape[0]):
                rows = max(books[h if len(books) > 1 else 0].n, 1)
                if idx[h].numel() and (int(idx[h].min()) < 0 or int(idx[h].max()) >= rows):
                    return f"{name} names a codebook row outside the book's {rows}"
        return None

    @property
    def n_slots(self) -> int:
        return sum(0 if p is None else p.shape[1] for p in (self.pos_c, self.pos_d))

    length = n_slots  # the Store protocol's name (slots per KV head, padding included)

    def stage(self, k: torch.Tensor, v: torch.Tensor, capacity: int) -> None:
        """Keep a prefill chunk's pre-RoPE K and V (Hkv, T, D) until the turn is compressed."""
        if self.turn_k is None:  # room for the whole turn at once
            shape = (k.shape[0], 0, k.shape[2])
            self.turn_k = Buffer(shape, 1, k.dtype, k.device, capacity)
            self.turn_v = Buffer(shape, 1, v.dtype, v.device, capacity)
        self.turn_k.append(k)
        self.turn_v.append(v)

    @property
    def turn_n(self) -> int:
        return 0 if self.turn_k is None else self.turn_k.n

    def drop_turn(self) -> None:
        self.turn_k = self.turn_v = self.qwin = None

    def _append(self, **rows: torch.Tensor) -> None:
        for name, x in rows.items():
            b = self.bufs.get(name)
            if b is None:
                b = self.bufs[name] = Buffer((x.shape[0], 0, *x.shape[2:]), 1, x.dtype, x.device)
            b.append(x)

    def append_coded(self, idx_k, idx_v, mag_k, mag_v, pos, mask) -> None:
        self._append(idx_k=idx_k, idx_v=idx_v, mag_k=mag_k, mag_v=mag_v, pos_c=pos, mask_c=mask)

    def append_dense(self, k, v, pos, mask) -> None:
        self._append(k_d=k.to(self.dtype), v_d=v.to(self.dtype), pos_d=pos, mask_d=mask)

    def store_turn(self, layer: int, ks, vs, valid, pos, mask, o) -> None:
        """A turn's kept pre-RoPE vectors (Hkv, S, D), coded into the books (earlier entries kept)
        or dense with codebook=off (padding zeroed)."""
        if not o["codebook"]:
            z = valid[..., None]
            self.append_dense(ks * z, vs * z, pos, mask)
            return
        args = (o["cb_block"], self.dtype, self.kernels)
        ik, mk = build_books(self.books_k, ks, valid, o["theta_k"], *args)
        iv, mv = build_books(self.books_v, vs, valid, o["theta_v"], *args)
        self.widen(layer, o["index"] == "int16-strict")
        self.append_coded(ik.to(self.idx_dtype[0]), iv.to(self.idx_dtype[1]), mk, mv, pos, mask)

    def store_token(self, layer: int, k, v, pos, mask, o) -> None:
        """One decode token, k, v (Hkv, D) pre-RoPE at pos (Hkv, 1), coded or dense."""
        if not (o["codebook"] and o["decode_codebook"]):
            self.append_dense(k[:, None], v[:, None], pos, mask)
            return
        ik, mk = assign_books(self.books_k, k, o["theta_k"], self.kernels)
        iv, mv = assign_books(self.books_v, v, o["theta_v"], self.kernels)
        self.widen(layer, o["index"] == "int16-strict")
        self.append_coded(
            ik.to(self.idx_dtype[0])[:, None],
            iv.to(self.idx_dtype[1])[:, None],
            mk.to(self.dtype)[:, None],
            mv.to(self.dtype)[:, None],
            pos,
            mask,
        )

    def step_native(self, q, k, v, pos: int, o, pre_rope: bool = False) -> torch.Tensor | None:
        """`store_token` and attention over the slots in one native call (codebook_step): k, v
        (Hkv, D), or the row's (1, Hkv, 1, D), pre-RoPE at position pos coded into the books and
        stored as the next coded slot, q (1, Hq, 1, D) attending over every slot -> (1, Hq, 1,
        D); q post-RoPE, or `pre_rope` (rotated in the call, as the layer's `rope.apply` rotates
        it). None where it does not apply: no kernels, dense slots, decode tokens kept dense, or
        int16 indices that a new entry may outgrow (the Python path widens them). Lean: it runs
        per layer per step."""
        bufs = self.bufs
        if (
            self.kernels is None
            or "pos_c" not in bufs
            or "pos_d" in bufs
            or not (o["codebook"] and o["decode_codebook"])
            or q.dtype != torch.float32
        ):
            return None
        H = k.shape[-3] if k.dim() == 4 else k.shape[0]
        books_k, books_v = self.books_k, self.books_v
        nk, nv = [b.n for b in books_k], [b.n for b in books_v]
        room = H if len(nk) == 1 else 1  # new rows a step may add to a book
        top_k, top_v = max(nk) + room, max(nv) + room
        for top, dt in ((top_k, self.idx_dtype[0]), (top_v, self.idx_dtype[1])):
            if dt == torch.int16 and top > INT16_MAX:
                return None
        cols = [bufs[name] for name in CODED]
        n = cols[0].n
        if cols[0].buf.shape[1] <= n:  # the six columns grow together
            for b in cols:
                b.reserve(n + 1)
        if self.shelf_k.data.shape[1] < top_k:
            self.shelf_k.reserve(top_k)
        if self.shelf_v.data.shape[1] < top_v:
            self.shelf_v.reserve(top_v)
        cos, sin = self.rope.tables(pos + 1)
        ssin = self.rope.signed_tables(pos + 1)[1] if pre_rope else None
        out, nk, nv = self.kernels.codebook_step(
            q, k, v, pos, self.shelf_k.data, nk, o["theta_k"], self.shelf_v.data, nv,
            o["theta_v"], *[b.buf for b in cols], n, not self.all_bits, cos, sin,
            q.shape[-1] ** -0.5, ssin,
        )  # fmt: skip
        for b in cols:
            b.n = n + 1
        for b, m in zip(books_k, nk, strict=True):
            b.n = m
        for b, m in zip(books_v, nv, strict=True):
            b.n = m
        return out

    def widen(self, layer: int, strict: bool) -> None:
        """Indices int32 past 32767 entries (kvrun's rule: no width in the paper); strict raises."""
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
        """Slots rebuilt pre-RoPE, coded first: K, V (Hkv, S, D), pos (Hkv, S) int64, masks."""
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

    def partials(
        self, q: torch.Tensor, q_pos: torch.Tensor, n_new: int, window: int | None
    ) -> list[Partial]:
        """Decode attention of q (1, Hq, 1, D) post-RoPE, a partial per segment, gathered and
        rotated in codebook_decode; only where the query sees every slot (the cache's `_fuse`)."""
        cos, sin = self.rope.tables(0)
        parts = []
        if self.pos_c is not None:
            (bk, ok), (bv, ov) = self.shelf_k.table(), self.shelf_v.table()
            mask = None if self.all_bits else self.mask_c
            args = (q, bk, self.idx_k, self.mag_k, bv, self.idx_v, self.mag_v, self.pos_c)
            parts.append(Partial(*self._decode(*args, cos, sin, mask, ok, ov)))
        if self.pos_d is not None:
            mask = None if self.all_bits else self.mask_d
            args = (q, self.k_d, None, None, self.v_d, None, None, self.pos_d)
            parts.append(Partial(*self._decode(*args, cos, sin, mask, None, None)))
        return parts

    def _decode(self, q, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """codebook_decode's (out, lse), natively where the kernels are set (codebook_attn)."""
        if self.kernels is not None and q.dtype == torch.float32 and not q.is_cuda:
            return tuple(self.kernels.codebook_attn(q, *args, q.shape[-1] ** -0.5))
        return codebook_decode(q, *args)

    def attend(self, q, q_pos, window, k_new=None, v_new=None, k_pos_new=None) -> torch.Tensor:
        """SDPA of q (1, Hq, T, D) over the rebuilt slots, masked per query head, and the turn's
        exact post-RoPE k_new (1, Hkv, n, D) at k_pos_new, if any."""
        if self.n_slots == 0:
            return dense_attention(q, k_new, v_new, q_pos, k_pos_new, window)
        ks, vs, pos, mask = self.materialise(q.dtype)
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

    def materialise(self, dtype: torch.dtype | None = None):
        """`slots` with K rotated and a batch dim: K, V (1, Hkv, S, D), positions, masks; in
        `dtype` where given (an f16 store's rows are rotated in the query's type)."""
        k, v, pos, mask = self.slots()
        if dtype is not None:
            k, v = k.to(dtype), v.to(dtype)
        return self.rope.apply(k[None], pos), v[None], pos, mask  # RoPE at each slot's position

    def nbytes(self) -> int:
        books = sum(b.nbytes() for b in self.books_k + self.books_v)
        stored = (
            self.idx_k,
            self.idx_v,
            self.mag_k,
            self.mag_v,
            self.pos_c,
            self.mask_c,
            self.k_d,
            self.v_d,
            self.pos_d,
            self.mask_d,
            self.qwin,
        )
        held = 0 if self.turn_k is None else self.turn_k.nbytes() + self.turn_v.nbytes()
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
