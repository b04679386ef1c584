"""SpindleKV's native decode (kernels/cpu/merged_attn.h, ops codebook_attn and codebook_assign)
against the torch references (kernels.codebook_decode_ref, spindlekv's `assign`) on the shared
shapes, instruction sets and thread counts; and the manager's decode through them against its
torch path (the kernels unset)."""

from __future__ import annotations

import pytest
import torch
from native_attention import HEADS, LENGTHS, isa, needs_native, ops, threads  # noqa: F401
from test_kernels_codebook import _slots, _tables
from test_kv_methods import drive, new_kv, prompt, tiny

from kvrun.kernels.codebook_decode import codebook_decode_ref
from kvrun.kv.methods.spindlekv.store import Shelf, assign, pack_bits

pytestmark = needs_native
F16, F32 = torch.float16, torch.float32

VARIANTS = [  # idx, mask, scope, dtype, Tq
    (torch.int32, None, "layer", F32, 2),
    (torch.int16, "blind", "head", F32, 1),  # per-head books at offsets; a row sees nothing
    (None, "partial", "dense", F32, 1),  # dense slots: the identity gather
    (torch.int16, "partial", "layer", F16, 1),
]


def call(fn, q, slots, cos, sin, *extra):
    bk, ik, mk, bv, iv, mv, pos, m, ok, ov = slots
    return fn(q, bk, ik, mk, bv, iv, mv, pos, cos, sin, m, ok, ov, *extra)


def check_attn(Hq, Hkv, D, S, idx, mask, scope, dtype, Tq):
    slots, _ = _slots(Hkv, Hq // Hkv, S, D, idx, mask, scope, seed=S * 7 + Hq)
    slots = [t.to(dtype) if i in (0, 2, 3, 5) and t is not None else t for i, t in enumerate(slots)]
    gen = torch.Generator().manual_seed(S + D)
    q = torch.randn(1, Hq, Tq, D, generator=gen)
    cos, sin = _tables(D)
    out, lse = call(ops.codebook_attn, q, slots, cos, sin, D**-0.5)
    ref = call(codebook_decode_ref, q, slots, cos, sin)
    tol = 2e-5 if dtype == F32 else 1e-3
    torch.testing.assert_close(out, ref[0], atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref[1], atol=tol, rtol=tol)  # -inf where a row sees nothing


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("S", LENGTHS)
def test_codebook_attn_matches_reference(Hq, Hkv, D, S, isa, threads):  # noqa: F811
    """Coded slots (int16 indices, one book) with partial keep bits, one query row."""
    check_attn(Hq, Hkv, D, S, torch.int16, "partial", "layer", F32, 1)


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("S", [33, 1027])
@pytest.mark.parametrize("idx,mask,scope,dtype,Tq", VARIANTS)
def test_codebook_attn_variants(Hq, Hkv, D, S, idx, mask, scope, dtype, Tq, isa):  # noqa: F811
    """int32 indices and two query rows, per-head books, dense slots, float16 books."""
    if scope == "head" and D * Hkv > 256:  # per-head books 33,000 rows apart: keep them small
        pytest.skip("per-head books on the smaller shapes")
    check_attn(Hq, Hkv, D, S, idx, mask, scope, dtype, Tq)


def test_bad_slots_are_refused():
    slots, _ = _slots(2, 3, 20, 64, torch.int16, "partial", "layer", seed=1)
    q, (cos, sin) = torch.randn(1, 6, 1, 64), _tables(64)
    bk, ik, mk, bv, iv, mv, pos, m, ok, ov = slots
    one = torch.zeros_like(ik)
    one[-1, 7] = 1  # one slot of the last head out of range, the rest in
    for bad, says in (
        ((bk, ik + 11, mk, bv, iv, mv, pos, m, ok, ov), "outside the book"),  # past the book
        ((bk, ik, mk, bv, iv - one * 999, mv, pos, m, ok, ov), "outside the book"),  # negative
        ((bk, ik, mk, bv, iv.int() + one.int() * 10**6, mv, pos, m, ok, ov), "outside the book"),
        ((bk, ik, mk, bv, iv, mv, pos + 600, m, ok, ov), "outside the tables"),  # past the tables
        ((bk, ik, mk, bv, iv, mv, pos - one.int() * 10**4, m, ok, ov), "outside the tables"),
        ((bk, ik, mk, bv, iv, mv, pos, m[..., :0], ok, ov), "mask"),  # mask bytes
        ((bk, ik, None, bv, iv, mv, pos, m, ok, ov), "idx and mag"),  # idx without mag
    ):
        with pytest.raises(RuntimeError, match=says):
            call(ops.codebook_attn, q, bad, cos, sin, 0.125)


@pytest.mark.parametrize("books", [1, 3])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("rows", [0, 5, 1500])
def test_codebook_assign_matches_assign(books, dtype, rows, isa, threads):  # noqa: F811
    """Each head joins the first best row above theta or adds its own, later heads seeing rows
    earlier heads added: as `assign`, step after step on one growing shelf."""
    H, D, theta = 3, 64, 0.9
    gen = torch.Generator().manual_seed(rows + books)
    base = torch.nn.functional.normalize(torch.randn(max(rows, 1), D, generator=gen), dim=1)
    shelf = Shelf(books, D, dtype, "cpu")
    ref = [b.rows().clone() for b in shelf.books]
    for b in shelf.books:
        b.append(base[:rows].to(dtype))
    ref = [b.rows().clone() for b in shelf.books]
    for step in range(6):
        x = torch.randn(H, D, generator=gen)
        if step % 2 and rows:  # near a row already there, or near each other
            x = 3 * base[torch.randint(0, rows, (H,), generator=gen)] + 0.05 * x
        if step == 4:
            x[2] = 2 * x[0] + 0.01 * x[1]  # joins the row head 0 adds
        if step == 5:
            x[1] = 0  # a zero vector: a zero row
        want = []
        for b in range(books):
            xs = x if books == 1 else x[b : b + 1]
            i, new, m = assign(ref[b], xs, theta)
            ref[b] = torch.cat([ref[b], new])
            want.append((i, m))
        shelf.reserve(max(b.n for b in shelf.books) + H)
        counts = torch.tensor([b.n for b in shelf.books])
        idx, mag = ops.codebook_assign(x, shelf.data, counts, theta)
        for b, n in zip(shelf.books, counts.tolist(), strict=True):
            b.n = n
        assert torch.equal(idx, torch.cat([i for i, _ in want]))
        torch.testing.assert_close(mag, torch.cat([m for _, m in want]), atol=1e-6, rtol=1e-6)
        for b, r in zip(shelf.books, ref, strict=True):
            torch.testing.assert_close(b.rows(), r, atol=0, rtol=1e-6)


@pytest.mark.parametrize("books", [1, 3])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("masked,unseen", [(True, False), (False, True)])
def test_codebook_step_codes_stores_and_attends(books, dtype, masked, unseen, isa, threads):  # noqa: F811
    """One decode token: coded as `assign` codes it (the search rides along the attention;
    rows no slot points at, `unseen`, searched apart), written as the next slot (position,
    every keep bit), and attended over with the rest as codebook_decode_ref does."""
    H, g, D, C, n, cap = 3, 3, 64, 150, 200, 205
    gen = torch.Generator().manual_seed(books * 10 + masked + 2 * unseen)
    unit = lambda m: torch.nn.functional.normalize(torch.randn(m, D, generator=gen), dim=1)  # noqa: E731
    shelves = [torch.zeros(books, C + 8, D, dtype=dtype) for _ in range(2)]
    for sh in shelves:
        sh[:, :C] = unit(books * C).view(books, C, D).to(dtype)
    hi = C - 20 if unseen else C  # the last rows no slot points at
    idx = [torch.randint(0, hi, (H, cap), generator=gen, dtype=torch.int16) for _ in range(2)]
    for ix in idx:  # every row below hi is some slot's, in each head's book
        ix[:, :hi] = torch.arange(hi, dtype=torch.int16)
    mags = [(0.5 + 3 * torch.rand(H, cap, generator=gen)).to(dtype) for _ in range(2)]
    pos = torch.randint(0, 250, (H, cap), generator=gen, dtype=torch.int32)
    bits = torch.rand(H, cap, g, generator=gen) < 0.6
    mask = pack_bits(bits)
    x = [torch.randn(H, D, generator=gen) for _ in range(2)]
    for xi, sh in zip(x, shelves, strict=True):  # head 0 near a row, head 2 near head 1
        xi[0] = 2 * sh[0, 5].float() + 0.01 * xi[0]
        if unseen:  # head 1 near a row no slot points at
            xi[1] = 2 * sh[1 if books > 1 else 0, C - 3].float() + 0.01 * xi[1]
        xi[2] = 3 * xi[1] + 0.01 * xi[2]
    q = torch.randn(1, H * g, 1, D, generator=gen)
    cos, sin = _tables(D)
    # the reference: assign per book, the slot appended, attention over n + 1 slots
    want, cols = [s.clone() for s in shelves], []
    for ws, xi, th in zip(want, x, (0.9, 0.8), strict=True):
        ids, ms = [], []
        for b in range(books):
            rows = ws[b, : C + 8][: int((ws[b].abs().sum(-1) > 0).sum())]
            i, new, m = assign(rows, xi if books == 1 else xi[b : b + 1], th)
            ws[b, len(rows) : len(rows) + len(new)] = new
            ids.append(i)
            ms.append(m)
        cols.append((torch.cat(ids), torch.cat(ms)))
    ref_idx = [ix.clone() for ix in idx]
    ref_mag = [m.clone() for m in mags]
    for ri, rm, (i, m) in zip(ref_idx, ref_mag, cols, strict=True):
        ri[:, n], rm[:, n] = i.to(ri.dtype), m.to(rm.dtype)
    ref_pos, ref_mask = pos.clone(), mask.clone()
    ref_pos[:, n], ref_mask[:, n] = 17, pack_bits(torch.ones(H, 1, g, dtype=torch.bool))[:, 0]
    off = None if books == 1 else torch.arange(H, dtype=torch.int32) * (C + 8)
    table = [w[0] if books == 1 else w.view(-1, D) for w in want]
    sl = slice(0, n + 1)
    ref = codebook_decode_ref(
        q, table[0], ref_idx[0][:, sl], ref_mag[0][:, sl], table[1], ref_idx[1][:, sl],
        ref_mag[1][:, sl], ref_pos[:, sl], cos, sin, ref_mask[:, sl] if masked else None, off, off,
    )  # fmt: skip
    out, *counts = ops.codebook_step(
        q, x[0], x[1], 17, shelves[0], [C] * books, 0.9, shelves[1], [C] * books, 0.8, idx[0],
        idx[1], mags[0], mags[1], pos, mask, n, masked, cos, sin, D**-0.5,
    )  # fmt: skip
    if unseen:  # found only by the search apart
        assert cols[0][0][1] == C - 3
    tol = 2e-5 if dtype == F32 else 1e-3
    torch.testing.assert_close(out, ref[0], atol=tol, rtol=tol)
    for got, w in zip(shelves, want, strict=True):  # new rows: u = x / ||x|| summed apart
        torch.testing.assert_close(got, w, atol=0, rtol=1e-6)
    for i in range(2):
        assert torch.equal(idx[i], ref_idx[i])
        torch.testing.assert_close(mags[i], ref_mag[i], atol=0, rtol=1e-6)
    assert torch.equal(pos, ref_pos) and torch.equal(mask, ref_mask)
    assert counts == [[int((w[b].abs().sum(-1) > 0).sum()) for b in range(books)] for w in want]


@pytest.mark.parametrize("dtype", [F32, F16])
def test_codebook_search_near_theta_is_exact(dtype, isa, threads):  # noqa: F811
    """The search passes over rows that cannot exceed theta (a bound from each row's first
    half): on a book crowded around the tokens, with dots from below theta to 1 and rows whose
    likeness sits in their second half, each head still joins the first best row, as `assign`."""
    H, D, theta = 3, 64, 0.95
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(H, D, generator=gen)
    u = torch.nn.functional.normalize(x, dim=1)
    near = []
    for h in range(H):
        for eps in torch.linspace(0.05, 0.6, 400):
            near.append(u[h] + eps * torch.randn(D, generator=gen) / D**0.5)
        second = torch.cat([0.3 * torch.randn(D // 2, generator=gen), u[h, D // 2 :]])
        near += [second] * 3  # alike in the second half only; a repeat ties with the first
    book = torch.nn.functional.normalize(torch.stack(near), dim=1)
    book = book[torch.randperm(len(book), generator=gen)]
    x[1] = 5 * torch.cat([0.01 * x[1, : D // 2], u[1, D // 2 :]])  # its likeness in the second half
    shelf = Shelf(1, D, dtype, "cpu")
    shelf.books[0].append(book.to(dtype))
    want, _, _ = assign(shelf.books[0].rows().clone(), x, theta)
    shelf.reserve(shelf.books[0].n + H)
    idx, _ = ops.codebook_assign(x, shelf.data, torch.tensor([shelf.books[0].n]), theta)
    assert torch.equal(idx, want)
    dots = torch.nn.functional.normalize(x, dim=1) @ book.T
    assert ((dots > theta - 0.05) & (dots <= theta)).sum() > 10  # rows just under theta, too


@pytest.mark.parametrize("books", [1, 3])
def test_codebook_step_rotates_a_pre_rope_query(books, isa, threads):  # noqa: F811
    """With the signed-sin table, q comes pre-RoPE and is rotated in the call as `rope` rotates
    it: the same output, books and slots, bit for bit, as rotating q first."""
    H, g, D, C, n, cap = 3, 3, 64, 150, 200, 205
    gen = torch.Generator().manual_seed(books)
    shelf = torch.nn.functional.normalize(torch.randn(books, C + 8, D, generator=gen), dim=-1)
    shelf[:, C:] = 0
    state = [
        shelf.clone(), shelf.clone(),
        torch.randint(0, C, (H, cap), generator=gen, dtype=torch.int16),
        torch.randint(0, C, (H, cap), generator=gen, dtype=torch.int16),
        0.5 + torch.rand(H, cap, generator=gen), 0.5 + torch.rand(H, cap, generator=gen),
        torch.randint(0, 250, (H, cap), generator=gen, dtype=torch.int32),
        pack_bits(torch.rand(H, cap, g, generator=gen) < 0.6),
    ]  # fmt: skip
    k, v = torch.randn(H, D, generator=gen), torch.randn(H, D, generator=gen)
    q = torch.randn(1, H * g, 1, D, generator=gen)
    cos, sin = _tables(D)
    half = sin[:, : D // 2]
    ssin = torch.cat([-half, half], dim=-1)
    outs = []
    for pre in (False, True):
        sh_k, sh_v, ik, iv, mk, mv, pos, mask = [t.clone() for t in state]
        qq = q if pre else ops.rope(q, cos[17:18][None], ssin[17:18][None])
        out, ck, cv = ops.codebook_step(
            qq, k, v, 17, sh_k, [C] * books, 0.9, sh_v, [C] * books, 0.8, ik, iv, mk, mv, pos,
            mask, n, True, cos, sin, D**-0.5, ssin if pre else None,
        )  # fmt: skip
        outs.append([out, sh_k, sh_v, ik, iv, mk, mv, pos, mask, torch.tensor(ck + cv)])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="cos and ssin"):
        ops.codebook_step(
            q, k, v, 17, shelf.clone(), [C] * books, 0.9, shelf.clone(), [C] * books, 0.8,
            *[t.clone() for t in state[2:]], n, True, cos, sin, D**-0.5, ssin[:, :8],
        )  # fmt: skip


def test_assign_refuses_a_full_shelf():
    shelf = Shelf(1, 64, F32, "cpu")
    shelf.reserve(2)
    counts = torch.tensor([shelf.data.shape[1] - 1])
    with pytest.raises(RuntimeError):  # three heads may add three rows
        ops.codebook_assign(torch.randn(3, 64), shelf.data, counts, 0.9)


# --- the manager ------------------------------------------------------------------------------
class Counted:
    """The native ops, with the calls of the attention ones counted."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, name):
        real = getattr(ops, name)
        if name not in ("codebook_attn", "codebook_step"):
            return real
        return lambda *a: self.calls.append(name) or real(*a)


SPECS = [
    "spindlekv:window=8,theta_k=0.6,theta_v=0.5",
    "spindlekv:window=8,theta_k=0.6,theta_v=0.5,codebook_scope=head",
    "spindlekv:window=8,theta_k=0.6,theta_v=0.5,decode_codebook=off",
    "spindlekv:window=8,codebook=off",
]


@pytest.mark.usefixtures("sdpa_prefill")
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", SPECS)
def test_decode_equals_the_torch_path(monkeypatch, spec):
    """fp32 logits within 1e-4 over 12 decode steps (partial keep bits, g = 3, codebooks
    growing at decode), every layer's step through codebook_attn."""
    m, P = tiny(6), 100
    m.rope.kernels = ops  # managers built now attend natively; the model itself stays torch
    try:
        kv = new_kv(m, spec, "0.3")
        old = new_kv(m, spec, "0.3")
    finally:
        m.rope.kernels = None
    for st in old.layers:
        st.kernels = None
    calls = []
    for st in kv.layers:  # count the native calls (the kernels object is the store's own)
        st.kernels = Counted(calls)
    ids = prompt(P, seed=21)
    ref = drive(m, old, ids, 32, n_decode=12)
    got = drive(m, kv, ids, 32, n_decode=12, tokens=ref[P - 1 : -1].argmax(-1).tolist())
    assert not all(st.all_bits for st in kv.layers)  # partial keep bits were used
    if "codebook=off" in spec:  # slots of each kind attended apart, the token kept dense
        per_step = 2 if "decode_codebook=off" in spec else 1
        assert calls == ["codebook_attn"] * 12 * len(kv.layers) * per_step
    else:  # the token coded, stored and attended over in one call
        assert calls == ["codebook_step"] * 12 * len(kv.layers)
    assert torch.equal(got[:P], ref[:P])
    torch.testing.assert_close(got[P:], ref[P:], rtol=0, atol=1e-4)
    assert [b.n for st in kv.layers for b in st.books_k + st.books_v] == [
        b.n for st in old.layers for b in st.books_k + st.books_v
    ]
    assert kv.nbytes() == old.nbytes()


@pytest.mark.usefixtures("one_thread")
def test_multi_token_decode_calls():
    """Decode calls of several tokens at once (each coded by codebook_assign, the slots
    attended by codebook_attn) equal the torch path."""
    m, P, spec = tiny(6), 60, "spindlekv:window=8,theta_k=0.6,theta_v=0.5"
    m.rope.kernels = ops
    try:
        kvs = [new_kv(m, spec, "0.3"), new_kv(m, spec, "0.3")]
    finally:
        m.rope.kernels = None
    for st in kvs[1].layers:
        st.kernels = None
    outs = []
    for kv in kvs:
        drive(m, kv, prompt(P, seed=8), 32)
        n, logits = P, []
        with torch.inference_mode():
            for span in (2, 3, 1, 2):
                ids = torch.tensor([prompt(span, seed=n)])
                logits.append(m(ids, torch.arange(n, n + span), kv)[0])
                kv.end_step()
                n += span
        outs.append(torch.cat(logits))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)
    books = [[b.n for st in kv.layers for b in st.books_k + st.books_v] for kv in kvs]
    assert books[0] == books[1]


# --- the prefill's codebook build (op codebook_build) ----------------------------------------
@pytest.mark.parametrize("n,block", [(10000, 512), (777, 100), (50, 1024)])
def test_native_build_equals_dense_reference(n, block):
    """codebook_build's greedy gives the dense one-pick-at-a-time reference's entries and
    indices (exact dot products: test_spindlekv's clustered vectors), as the torch blocks do."""
    from test_spindlekv import clustered, dense_greedy

    from kvrun.kv.methods.spindlekv.store import build_codebook

    u = clustered(max(n, 60), 32, seed=n)[:n]
    theta = (round(0.98 * 2**16) + 0.5) / 2**16  # halfway between representable dot products
    picks, ref_idx = dense_greedy(u, theta)
    entries, idx = build_codebook(u, theta, block=block, dtype=torch.float32, kernels=ops)
    assert idx.tolist() == ref_idx.tolist()
    assert torch.equal(entries, u[picks])
    assert 0 < entries.shape[0] < n // 2  # real merging
    blocks = build_codebook(u, theta, block=block, dtype=torch.float16)  # the torch path
    got = build_codebook(u, theta, block=block, dtype=torch.float16, kernels=ops)
    assert torch.equal(got[0], blocks[0]) and torch.equal(got[1], blocks[1])


def test_native_build_edge_cases():
    """Self loops and zero vectors (theta below 0: the zero row takes every row), no merging at
    all (theta above 1), no rows, and a graph over its edge bound (empty: the torch path runs,
    so build_codebook still answers)."""
    from test_spindlekv import angles

    from kvrun.kv.methods.spindlekv import store

    u = torch.stack([angles(0)[0], angles(180)[0], torch.zeros(8)])
    order, idx = ops.codebook_build(u, -0.5, 2, 100)
    assert order.tolist() == [2] and idx.tolist() == [0, 0, 0]
    u = angles(0, 5, 10, 60, 62, 120)
    order, idx = ops.codebook_build(u, 1.01, 4, 100)
    assert order.tolist() == list(range(6)) and idx.tolist() == list(range(6))
    order, idx = ops.codebook_build(u, 0.98, 4, 100)
    assert order.tolist() == [0, 3, 5] and idx.tolist() == [0, 0, 0, 1, 1, 2]
    order, idx = ops.codebook_build(torch.zeros(0, 8), 0.5, 4, 100)
    assert order.numel() == idx.numel() == 0
    order, idx = ops.codebook_build(u, -2.0, 4, 3)  # 15 edges > 3
    assert order.numel() == idx.numel() == 0
    bound = store.MAX_EDGES
    try:
        store.MAX_EDGES = 3
        entries, idx = store.build_codebook(u, -2.0, block=4, dtype=torch.float32, kernels=ops)
    finally:
        store.MAX_EDGES = bound
    assert idx.tolist() == [0] * 6 and entries.shape == (1, 8)
    with pytest.raises(RuntimeError, match="codebook_build"):
        ops.codebook_build(torch.zeros(4), 0.5, 4, 100)


@pytest.mark.usefixtures("sdpa_prefill")
def test_prefill_builds_natively_as_the_torch_path(monkeypatch):
    """The manager's prefill codes its turn through codebook_build where the kernels are set:
    the same books, indices and magnitudes as with the kernels unset."""
    from kvrun.kv.methods.spindlekv import store

    m = tiny()
    calls = []
    real = ops.codebook_build

    class Counting:
        def __getattr__(self, name):
            return getattr(ops, name)

        def codebook_build(self, *a):
            calls.append(1)
            return real(*a)

    kvs = []
    for kernels in (Counting(), None):
        m.rope.kernels = kernels
        try:
            kv = new_kv(m, "spindlekv", 0.3)
            drive(m, kv, prompt(90, seed=2), 32)
        finally:
            m.rope.kernels = None
        kvs.append(kv)
    assert calls  # the native build ran
    for a, b in zip(kvs[0].layers, kvs[1].layers, strict=True):
        for x, y in zip(a.books_k + a.books_v, b.books_k + b.books_v, strict=True):
            assert torch.equal(x.rows(), y.rows())
    assert store is not None
