"""SpindleKV's fused decode kernel (kernels.codebook_decode) and its use in the manager.

The torch reference is checked against a naive fp64 computation written out here (gather the
codebook rows, scale, RoPE through kvrun.models.rope, materialised masked softmax per query head);
the Triton kernel (interpreted on CPU, compiled on CUDA) against the reference; and the
manager's decode logits through the kernel against its old path (rebuild the slots, SDPA).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from kv_helpers import unfused
from test_kernels import F32, NEG, _dtypes, _tol, assert_partial
from test_kv_methods import config, drive, new_kv, prompt, tiny

import kvrun.kv.methods.spindlekv.store as coded
from kvrun.kernels import codebook_decode as cb
from kvrun.kv.methods.spindlekv.store import Shelf, pack_bits
from kvrun.models.model import Transformer
from kvrun.models.rope import Rope, inverse_frequencies

P = 600  # positions the RoPE tables cover in the kernel tests


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rope(D: int, dtype=torch.float64) -> Rope:
    c = config().replace(head_dim=D)
    return Rope(inverse_frequencies(c), torch.device("cpu"), dtype)


def _tables(D: int, dtype=F32, dev="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE tables (P, D) as SpindleKV passes them."""
    cos, sin = _rope(D, F32).cos_sin(torch.arange(P))
    return cos.to(device=dev, dtype=dtype), sin.to(device=dev, dtype=dtype)


def _slots(Hkv, g, S, D, idx, mask, scope, seed):
    """Random slots (args of codebook_decode after q) and the keep bits (Hkv, S, g).

    idx: int16 | int32 codes, or None for dense slots. scope "layer": one book; "head": one
    book per KV head, concatenated with offsets past the int16 range. mask: None, "partial"
    (some slots seen by some query heads, a padding slot by none) or "blind" (query head 1 of
    head 0 sees nothing, when g > 1; else head 0's only query head)."""
    gen = _gen(seed)
    pos = torch.randint(0, P, (Hkv, S), generator=gen, dtype=torch.int32)
    bits = torch.ones(Hkv, S, g, dtype=torch.bool)
    if mask is not None:
        bits = torch.rand(Hkv, S, g, generator=gen) < 0.6
        if S:
            bits[:, 0] = True  # every query head sees something ...
            bits[-1, -1] = False  # ... and a padding slot is seen by none
        if mask == "blind":
            bits[0, :, min(1, g - 1)] = False
    m = pack_bits(bits) if mask is not None else None
    if idx is None:  # dense pre-RoPE K and V
        k = torch.randn(Hkv, S, D, generator=gen)
        v = torch.randn(Hkv, S, D, generator=gen)
        return (k, None, None, v, None, None, pos, m, None, None), bits
    n = 11  # entries per book

    def unit(rows: int) -> torch.Tensor:  # a book of unit rows
        return torch.nn.functional.normalize(torch.randn(rows, D, generator=gen), dim=1)

    ik = torch.randint(0, n, (Hkv, S), generator=gen).to(idx)
    iv = torch.randint(0, n, (Hkv, S), generator=gen).to(idx)
    mk = 0.5 + 3 * torch.rand(Hkv, S, generator=gen)
    mv = 0.5 + 3 * torch.rand(Hkv, S, generator=gen)
    if scope == "layer":
        return (unit(n), ik, mk, unit(n), iv, mv, pos, m, None, None), bits
    stride = 33000  # row h * stride starts head h's book: offsets beyond int16 indices
    bk, bv = torch.zeros(Hkv * stride, D), torch.zeros(Hkv * stride, D)
    for h in range(Hkv):
        bk[h * stride : h * stride + n], bv[h * stride : h * stride + n] = unit(n), unit(n)
    off = torch.arange(Hkv, dtype=torch.int32) * stride
    return (bk, ik, mk, bv, iv, mv, pos, m, off, off.clone()), bits


def _call(fn, q, slots, cos, sin, **kw):
    bk, ik, mk, bv, iv, mv, pos, m, ok, ov = slots
    return fn(q, bk, ik, mk, bv, iv, mv, pos, cos, sin, m, ok, ov, **kw)


def _to(slots, dev, dtype):
    """Slots on a device, books / dense rows and magnitudes in the KV dtype."""
    out = []
    for i, t in enumerate(slots):
        if t is not None:
            t = t.to(dev)
            if i in (0, 2, 3, 5):  # books (or dense K, V) and magnitudes
                t = t.to(dtype)
        out.append(t)
    return out


def naive(q, slots, bits):
    """fp64: gather and scale each head's rows, RoPE at their positions (kvrun.models.rope), then a
    materialised softmax per query head over the slots its bits allow."""
    bk, ik, mk, bv, iv, mv, pos, _, ok, ov = slots
    _, Hq, Tq, D = q.shape
    Hkv, S = pos.shape
    g = Hq // Hkv
    rope = _rope(D)
    out = torch.zeros(1, Hq, Tq, D, dtype=torch.float64)
    lse = torch.full((1, Hq, Tq), NEG, dtype=torch.float64)
    for h in range(Hkv):
        if ik is None:
            k, v = bk[h].double(), bv[h].double()
        else:
            k = bk.double()[int(ok[h]) if ok is not None else 0 :][ik[h].long()]
            v = bv.double()[int(ov[h]) if ov is not None else 0 :][iv[h].long()]
            k, v = k * mk[h].double()[:, None], v * mv[h].double()[:, None]
        kr = rope.apply(k[None, None], pos[h].long())[0, 0]  # (S, D)
        for j in range(g):
            cols = bits[h, :, j]
            if not bool(cols.any()):
                continue
            s = q[0, h * g + j].double() @ kr[cols].T / math.sqrt(D)  # (Tq, n)
            lse[0, h * g + j] = torch.logsumexp(s, -1)
            out[0, h * g + j] = torch.softmax(s, -1) @ v[cols]
    return out, lse


CASES = [  # Hkv, g, Tq, S, D, idx, mask, scope, split
    (2, 4, 1, 1, 64, torch.int16, None, "layer", None),
    (1, 3, 1, 15, 64, torch.int32, "partial", "head", None),  # odd S
    (2, 1, 2, 64, 64, torch.int16, "partial", "layer", 64),  # one whole tile and split
    (1, 3, 2, 65, 96, torch.int16, "blind", "head", 64),  # one past a split; D padded
    (2, 4, 1, 129, 64, torch.int32, "partial", "layer", 64),  # splits of 64, 64, 1
    (1, 4, 1, 128, 96, torch.int32, None, "head", 64),  # exact multiple of the split
    (2, 1, 1, 40, 64, torch.int16, "blind", "layer", None),  # MHA: a head that sees nothing
    (1, 10, 1, 20, 64, torch.int16, "partial", "layer", None),  # two mask bytes per slot
    (2, 3, 1, 0, 64, torch.int16, None, "layer", None),  # no slots
    (2, 3, 2, 33, 64, None, "partial", "dense", None),  # dense slots: the identity gather
    (1, 4, 1, 70, 96, None, "blind", "dense", 64),
]
IDS = [
    f"H{c[0]}g{c[1]}q{c[2]}S{c[3]}D{c[4]}-{c[7]}-{str(c[5])[6:] or 'rows'}-{c[6]}" for c in CASES
]


@pytest.mark.parametrize("Hkv,g,Tq,S,D,idx,mask,scope,split", CASES, ids=IDS)
def test_ref_matches_naive(Hkv, g, Tq, S, D, idx, mask, scope, split):
    q = torch.randn(1, Hkv * g, Tq, D, generator=_gen(1))
    slots, bits = _slots(Hkv, g, S, D, idx, mask, scope, seed=2)
    out, lse = _call(cb.codebook_decode_ref, q, slots, *_tables(D))
    assert out.dtype == lse.dtype == F32
    assert out.shape == (1, Hkv * g, Tq, D) and lse.shape == (1, Hkv * g, Tq)
    assert_partial((out, lse), naive(q, slots, bits), atol=2e-5, rtol=1e-5)
    if mask == "blind":  # a query head that sees nothing: out 0, lse -inf
        row = 0 * g + min(1, g - 1)
        assert bool((out[0, row] == 0).all()) and bool((lse[0, row] == NEG).all())
    if S == 0:
        assert bool((out == 0).all()) and bool((lse == NEG).all())


@pytest.mark.parametrize("Hkv,g,Tq,S,D,idx,mask,scope,split", CASES, ids=IDS)
def test_triton_matches_ref(device, Hkv, g, Tq, S, D, idx, mask, scope, split):
    for i, dtype in enumerate(_dtypes(device)):
        if i and device == "cpu" and S not in (15, 65, 129, 33):  # interpreter time
            continue
        q = torch.randn(1, Hkv * g, Tq, D, generator=_gen(3)).to(device=device, dtype=dtype)
        slots, _ = _slots(Hkv, g, S, D, idx, mask, scope, seed=4)
        slots = _to(slots, device, dtype)
        cos, sin = _tables(D, dtype, device)
        got = _call(cb.codebook_decode_triton, q, slots, cos, sin, split=split)
        ref = _call(cb.codebook_decode_ref, q, slots, cos, sin)
        assert got[0].dtype == got[1].dtype == F32 and got[0].shape == ref[0].shape
        assert_partial(got, ref, **_tol(dtype))


def test_splits_agree_with_one_split():
    """Split-K partials merged by log-sum-exp equal one pass over all slots."""
    q = torch.randn(1, 6, 1, 64, generator=_gen(5))
    slots, _ = _slots(2, 3, 300, 64, torch.int16, "partial", "layer", seed=6)
    cos, sin = _tables(64)
    one = _call(cb.codebook_decode_triton, q, slots, cos, sin, split=320)
    many = _call(cb.codebook_decode_triton, q, slots, cos, sin, split=64)
    assert_partial(many, one, atol=1e-5, rtol=1e-5)


def test_strided_inputs_and_positions_at_the_table_end():
    """Views as the manager holds them (a shelf of books with spare capacity, dense slots cut
    from a longer buffer) and positions on the last table rows."""
    Hkv, g, S, D = 2, 2, 37, 64
    q = torch.randn(1, Hkv * g, 1, D, generator=_gen(7))
    slots, bits = _slots(Hkv, g, S, D, torch.int32, "partial", "layer", seed=8)
    slots = list(slots)
    slots[6] = P - 1 - slots[6] % 3  # positions P-3 .. P-1
    spare = torch.randn(slots[0].shape[0] + 9, D, generator=_gen(9))
    spare[: slots[0].shape[0]] = slots[0]
    slots[0] = spare[: slots[0].shape[0]]
    cos, sin = _tables(D)
    want = naive(q, slots, bits)
    for fn in (cb.codebook_decode_ref, cb.codebook_decode_triton):
        assert_partial(_call(fn, q, slots, cos, sin), want, atol=2e-5, rtol=1e-5)
    dense, dbits = _slots(Hkv, g, S, D, None, "partial", "dense", seed=10)
    dense = list(dense)
    buf = torch.randn(Hkv, S + 5, D, generator=_gen(11))
    buf[:, :S] = dense[0]
    dense[0] = buf[:, :S]
    want = naive(q, dense, dbits)
    for fn in (cb.codebook_decode_ref, cb.codebook_decode_triton):
        assert_partial(_call(fn, q, dense, cos, sin), want, atol=2e-5, rtol=1e-5)


def test_rejects_bad_arguments():
    q = torch.zeros(1, 4, 1, 64)
    slots, _ = _slots(2, 2, 5, 64, torch.int16, "partial", "layer", seed=12)
    cos, sin = _tables(64)
    bk, ik, mk, bv, iv, mv, pos, m, _, _ = slots
    with pytest.raises(ValueError, match="all be given"):
        cb.codebook_decode_ref(q, bk, ik, None, bv, iv, mv, pos, cos, sin)
    with pytest.raises(ValueError, match="multiple"):
        cb.codebook_decode_ref(torch.zeros(1, 3, 1, 64), bk, ik, mk, bv, iv, mv, pos, cos, sin)
    with pytest.raises(ValueError, match="mask"):
        cb.codebook_decode_ref(q, bk, ik, mk, bv, iv, mv, pos, cos, sin, m.bool())
    with pytest.raises(ValueError, match="indices"):
        cb.codebook_decode_ref(q, bk, ik.float(), mk, bv, iv, mv, pos, cos, sin)
    with pytest.raises(ValueError, match="dense slots"):
        cb.codebook_decode_ref(q, bk, None, None, bv, None, None, pos, cos, sin)
    with pytest.raises(ValueError, match="block_n"):
        cb.codebook_decode_triton(q, bk, ik, mk, bv, iv, mv, pos, cos, sin, block_n=48)


def _boom(*a, **k):
    raise AssertionError("the other implementation was called")


def test_dispatch_follows_kvrun_kernels(monkeypatch):
    q = torch.randn(1, 4, 1, 64, generator=_gen(13))
    slots, _ = _slots(2, 2, 9, 64, torch.int16, "partial", "layer", seed=14)
    cos, sin = _tables(64)
    monkeypatch.setenv("KVRUN_KERNELS", "torch")
    monkeypatch.setattr(cb, "codebook_decode_triton", _boom)
    _call(cb.codebook_decode, q, slots, cos, sin)
    monkeypatch.undo()
    monkeypatch.setenv("KVRUN_KERNELS", "triton")  # forced: Triton (interpreted on CPU)
    real_ref = cb.codebook_decode_ref
    monkeypatch.setattr(cb, "codebook_decode_ref", _boom)
    _call(cb.codebook_decode, q, slots, cos, sin)
    monkeypatch.setattr(cb, "codebook_decode_ref", real_ref)
    monkeypatch.setattr(cb, "codebook_decode_triton", _boom)
    many = torch.randn(1, 4, 80, 64, generator=_gen(15))  # 160 rows per KV head: not decode
    assert _call(cb.codebook_decode, many, slots, cos, sin)[0].shape == many.shape


@pytest.mark.slow  # a subprocess
def test_import_and_reference_without_triton():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("blocked")
sys.meta_path.insert(0, Block())
import torch
from kvrun.kernels import HAVE_TRITON, codebook_decode as cb
assert not HAVE_TRITON
q, k = torch.randn(1, 4, 1, 64), torch.randn(2, 8, 64)
pos = torch.zeros(2, 8, dtype=torch.int32)
cos, sin = torch.ones(1, 64), torch.zeros(1, 64)
cb.codebook_decode(q, k, None, None, k, None, None, pos, cos, sin)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "KVRUN_KERNELS"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


# --- in the manager: decode through the kernel equals the old path -------------------------------
def test_shelf_books_and_their_table():
    """Per-head books share one buffer: table() rows at the offsets are each book's rows,
    through growth; only the used rows are counted."""
    shelf = Shelf(3, 8, F32, "cpu")
    rows = [torch.randn(n, 8, generator=_gen(30 + n)) for n in (5, 70, 2)]
    for book, r in zip(shelf.books, rows, strict=True):  # 70 rows: every book grows past 64
        book.append(r[:1])
        book.append(r[1:])
    more = torch.randn(1, 8, generator=_gen(40))
    shelf.books[0].append(more)
    rows[0] = torch.cat([rows[0], more])
    table, off = shelf.table()
    assert off.dtype == torch.int32 and table.shape[0] == 3 * int(off[1])
    for book, r, o in zip(shelf.books, rows, off.tolist(), strict=True):
        assert torch.equal(book.rows(), r) and torch.equal(table[o : o + len(r)], r)
        assert book.nbytes() == r.numel() * 4
    one = Shelf(1, 8, F32, "cpu")
    one.books[0].append(rows[1])
    table, off = one.table()
    assert off is None and torch.equal(table[:70], rows[1])


def _decode_both(m, spec, budget, n_prompt, n_decode, monkeypatch, ubatch=32):
    """Logits of one turn with decode through codebook_decode and through the old path (the
    slots rebuilt, SDPA), the same tokens fed; and how many kernel calls the first made."""
    calls = []
    real = coded.codebook_decode

    def counted(*a):
        calls.append(a[2] is not None)  # a coded (True) or a dense (False) segment
        return real(*a)

    monkeypatch.setattr(coded, "codebook_decode", counted)
    ids = prompt(n_prompt, seed=21)
    kv = new_kv(m, spec, budget)
    new = drive(m, kv, ids, ubatch, n_decode=n_decode)
    toks = new[n_prompt - 1 : -1].argmax(-1).tolist()
    old_kv = new_kv(m, spec, budget)
    unfused(old_kv)
    n_new = len(calls)
    old = drive(m, old_kv, ids, ubatch, n_decode=n_decode, tokens=toks)
    assert len(calls) == n_new  # the old path never calls the kernel
    return new, old, kv, calls


SPECS = [
    "spindlekv:window=8,theta_k=0.6,theta_v=0.5",
    "spindlekv:window=8,theta_k=0.6,theta_v=0.5,codebook_scope=head",
    "spindlekv:window=8,theta_k=0.6,theta_v=0.5,decode_codebook=off",
    "spindlekv:window=8,theta_k=0.6,theta_v=0.5,decode_codebook=off,codebook_scope=head",
    "spindlekv:window=8,codebook=off",
]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", SPECS)
def test_decode_through_kernel_equals_old_path(monkeypatch, spec):
    """fp32 logits within 1e-4 over 12 decode steps, with partial keep bits (per-query-head
    unions, g = 3) and codebooks growing at decode."""
    m = tiny(6)
    monkeypatch.setenv("KVRUN_KERNELS", "torch")
    new, old, kv, calls = _decode_both(m, spec, "0.3", 100, 12, monkeypatch)
    assert not all(st.all_bits for st in kv.layers)  # masks with partial bits were used
    if ",codebook=off" in spec:  # dense only: SDPA on the torch path (bit for bit with full)
        assert calls == []
        assert torch.equal(new, old)
        return
    dense = "decode_codebook=off" in spec
    per_step = 2 if dense else 1  # coded prefill slots (+ dense decode slots)
    assert len(calls) == 12 * 3 * per_step and calls.count(False) == 12 * 3 * (per_step - 1)
    torch.testing.assert_close(new, old, rtol=0, atol=1e-4)
    assert new[100:].abs().max() > 1e-2


@pytest.mark.usefixtures("one_thread")
def test_second_turn_decodes_through_kernel_as_old_path(monkeypatch):
    """A later chat turn appends slots (and book entries) after decode slots: still equal."""
    m = tiny(6)
    monkeypatch.setenv("KVRUN_KERNELS", "torch")
    spec = "spindlekv:window=8,theta_k=0.6,theta_v=0.5,codebook_scope=head"
    runs = []
    for fused in (True, False):
        kv = new_kv(m, spec, "0.3")
        if not fused:
            unfused(kv)
        first = drive(m, kv, prompt(80, seed=22), 32, n_decode=4, tokens=[1, 2, 3, 4])
        second = drive(m, kv, prompt(40, seed=23), 16, n_decode=6, tokens=[5, 6, 7, 8, 9, 10])
        runs.append(torch.cat([first, second]))
    assert kv.layers[0].pos_c.shape[1] > 80 * 0.3
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=1e-4)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("sliding,fused", [(4096, True), (24, False)])
def test_sliding_window_keeps_the_old_path_where_it_masks(monkeypatch, sliding, fused):
    base = tiny(6)
    m = Transformer.from_weights(config(6).replace(sliding_window=sliding), base.state_dict())
    monkeypatch.setenv("KVRUN_KERNELS", "torch")
    spec = "spindlekv:window=8,theta_k=0.6,theta_v=0.5"
    new, old, _, calls = _decode_both(m, spec, "0.3", 60, 5, monkeypatch)
    assert bool(calls) is fused
    torch.testing.assert_close(new, old, rtol=0, atol=1e-4)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "spec",
    [
        "spindlekv:window=8,theta_k=0.6,theta_v=0.5,codebook_scope=head",
        "spindlekv:window=8,codebook=off",
        "spindlekv:window=8,theta_k=0.6,theta_v=0.5,decode_codebook=off",
    ],
)
def test_decode_through_triton_equals_old_path(monkeypatch, spec):
    """KVRUN_KERNELS=triton (the interpreter on CPU): the Triton kernel inside the manager,
    dense-only layers included."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    monkeypatch.setenv("KVRUN_KERNELS", "triton")
    new, old, _, calls = _decode_both(tiny(6), spec, "0.3", 70, 3, monkeypatch, ubatch=35)
    assert len(calls) >= 3 * 3
    torch.testing.assert_close(new, old, rtol=0, atol=1e-4)
