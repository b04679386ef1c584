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
from kvrun.kv.methods.spindlekv.store import Shelf, assign

pytestmark = needs_native
F16, F32 = torch.float16, torch.float32

VARIANTS = [  # idx, mask, scope, dtype, Tq
    (torch.int16, "partial", "layer", F32, 1),
    (torch.int32, None, "layer", F32, 2),
    (torch.int16, "blind", "head", F32, 1),  # per-head books at offsets; a row sees nothing
    (None, "partial", "dense", F32, 1),  # dense slots: the identity gather
    (torch.int16, "partial", "layer", F16, 1),
]


def call(fn, q, slots, cos, sin, *extra):
    bk, ik, mk, bv, iv, mv, pos, m, ok, ov = slots
    return fn(q, bk, ik, mk, bv, iv, mv, pos, cos, sin, m, ok, ov, *extra)


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("S", LENGTHS)
@pytest.mark.parametrize("idx,mask,scope,dtype,Tq", VARIANTS)
def test_codebook_attn_matches_reference(Hq, Hkv, D, S, idx, mask, scope, dtype, Tq, isa, threads):  # noqa: F811
    if scope == "head" and D * Hkv > 256:  # per-head books 33,000 rows apart: keep them small
        pytest.skip("per-head books on the smaller shapes")
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


def test_bad_slots_are_refused():
    slots, _ = _slots(2, 3, 20, 64, torch.int16, "partial", "layer", seed=1)
    q, (cos, sin) = torch.randn(1, 6, 1, 64), _tables(64)
    bk, ik, mk, bv, iv, mv, pos, m, ok, ov = slots
    for bad in (
        (bk, ik + 11, mk, bv, iv, mv, pos, m, ok, ov),  # a row past the book
        (bk, ik, mk, bv, iv, mv, pos + 600, m, ok, ov),  # a position past the tables
        (bk, ik, mk, bv, iv, mv, pos, m[..., :0], ok, ov),  # mask bytes
        (bk, ik, None, bv, iv, mv, pos, m, ok, ov),  # idx without mag
    ):
        with pytest.raises(RuntimeError):
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


def test_assign_refuses_a_full_shelf():
    shelf = Shelf(1, 64, F32, "cpu")
    shelf.reserve(2)
    counts = torch.tensor([shelf.data.shape[1] - 1])
    with pytest.raises(RuntimeError):  # three heads may add three rows
        ops.codebook_assign(torch.randn(3, 64), shelf.data, counts, 0.9)


# --- the manager ------------------------------------------------------------------------------
SPECS = [
    "spindlekv:window=8,theta_k=0.6,theta_v=0.5",
    "spindlekv:window=8,theta_k=0.6,theta_v=0.5,codebook_scope=head",
    "spindlekv:window=8,theta_k=0.6,theta_v=0.5,decode_codebook=off",
    "spindlekv:window=8,codebook=off",
]


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
    calls, real = [], ops.codebook_attn
    for st in kv.layers:  # count the native calls (the kernels object is the store's own)
        st.kernels = type("K", (), {"codebook_attn": None, "codebook_assign": None})()
        st.kernels.codebook_attn = lambda *a: calls.append(1) or real(*a)
        st.kernels.codebook_assign = ops.codebook_assign
    ids = prompt(P, seed=21)
    ref = drive(m, old, ids, 32, n_decode=12)
    got = drive(m, kv, ids, 32, n_decode=12, tokens=ref[P - 1 : -1].argmax(-1).tolist())
    assert not all(st.all_bits for st in kv.layers)  # partial keep bits were used
    per_step = 2 if "decode_codebook=off" in spec else 1  # coded slots (+ dense decode slots)
    assert len(calls) == 12 * len(kv.layers) * per_step
    assert torch.equal(got[:P], ref[:P])
    torch.testing.assert_close(got[P:], ref[P:], rtol=0, atol=1e-4)
    assert [b.n for st in kv.layers for b in st.books_k + st.books_v] == [
        b.n for st in old.layers for b in st.books_k + st.books_v
    ]
    assert kv.nbytes() == old.nbytes()
