"""minicache+kivi4's native decode row (kernels/cpu/kivi_ops.h, op kivi_merged_attn): a pair
layer attends over its merged directions E in the KIVI store, restored inside the products
(n / ||E|| on scores and weights, the retained rows in place). Against the restore it replaces
(E dequantized, X_hat = E / ||E|| * n, retained rows put back, dense attention in float64) on
the shared shapes, instruction sets and thread counts; and the manager's decode through it
against its restore path on the same kernels."""

from __future__ import annotations

import pytest
import torch
from native_attention import HEADS, LENGTHS, isa, needs_native, ops, threads  # noqa: F401
from test_kernels_merged import model6
from test_kv_methods import drive, new_kv, prompt

from kvrun.kv.stores.kivi import KiviLayer

pytestmark = needs_native


def _store(Hkv: int, D: int, T: int, bits: int, G: int, tail: int, g: torch.Generator):
    """A KIVI store of E: whole groups of T - tail tokens packed, `tail` exact rows after them
    (one of them all zeros: a zero direction)."""
    st = KiviLayer(Hkv, D, bits, G, G, torch.float32, "cpu", ops)
    body = (T - tail) // G * G
    e = torch.randn(Hkv, T, D, generator=g)
    e[..., :: max(D // 4, 1)] *= 6.0  # outlier channels, as keys have
    if T - body >= 2:
        e[0, body + 1] = 0.0
    st.append(e[:, :body], torch.randn(Hkv, body, D, generator=g))
    if body:
        st.flush(G)
    st.append(e[:, body:], torch.randn(Hkv, T - body, D, generator=g))
    return st


def _retained(Hkv: int, T: int, D: int, share: float, g: torch.Generator):
    """A half's retained rows as a Half keeps them: (ridx, roff, rows), each head's tokens
    ascending; three Nones when none is drawn."""
    keep = torch.rand(Hkv, T, generator=g) < share
    if not bool(keep.any()):
        return None, None, None
    h, t = keep.nonzero(as_tuple=True)
    roff = torch.zeros(Hkv + 1, dtype=torch.int64)
    roff[1:] = torch.bincount(h, minlength=Hkv).cumsum(0)
    return t.to(torch.int32), roff, torch.randn(len(t), D, generator=g)


def _inv(st: KiviLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """1 / ||E|| of the body's dequantized rows, 0 for a zero row (PairLayer.inverse_norms)."""
    k, v = ops.kivi_dequant(*st.body(), st.bits, st.G, 0, st.body_len)
    out = []
    for x in (k[0], v[0]):
        n = torch.linalg.vector_norm(x, dim=-1)
        out.append(torch.where(n > 0, 1 / n, 0.0))
    return out[0], out[1]


def _restored(e, n, ret) -> torch.Tensor:
    """X_hat (Hkv, T, D) float64: E / ||E|| * n (0 for a zero row), the retained rows exact."""
    e = e.double()
    norm = torch.linalg.vector_norm(e, dim=-1, keepdim=True)
    x = e / torch.where(norm > 0, norm, 1.0) * n.double().unsqueeze(-1)
    ridx, roff, rows = ret
    if ridx is not None:
        for h in range(x.shape[0]):
            for r in range(int(roff[h]), int(roff[h + 1])):
                x[h, int(ridx[r])] = rows[r].double()
    return x


def _reference(q, st, nk, nv, rk, rv, k_new, v_new) -> torch.Tensor:
    ek, ev = st.dequantized()  # (Hkv, T, D): the body dequantized, then the tail
    T = ek.shape[1]
    K = torch.cat([_restored(ek, nk[:, :T], rk), k_new[0].double()], 1)
    V = torch.cat([_restored(ev, nv[:, :T], rv), v_new[0].double()], 1)
    g = q.shape[1] // K.shape[0]
    K, V = K.repeat_interleave(g, 0), V.repeat_interleave(g, 0)
    s = (q[0].double() @ K.transpose(1, 2)) * q.shape[-1] ** -0.5  # (Hq, 1, T + 1)
    return (s.softmax(-1) @ V)[None].float()


def _args(st, nk, nv, kinv, vinv, rk, rv, k_new, v_new, D):
    rooms = st.rooms()
    return (
        *rooms[:6], st.body_len, *rooms[6:], st.tail_len, st.bits, st.G, nk, nv, kinv, vinv,
        *rk, *rv, k_new, v_new, D**-0.5,
    )  # fmt: skip


@pytest.mark.parametrize("bits,G", [(4, 32), (2, 64)])
@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("T", LENGTHS)
def test_matches_the_restore(bits, G, Hq, Hkv, D, T, isa, threads):  # noqa: F811
    g = torch.Generator().manual_seed(T * 7 + D + bits)
    tail = min(T, 5 + T % 13)
    st = _store(Hkv, D, T, bits, G, tail, g)
    nk = torch.rand(Hkv, T + 9, generator=g) * 4 + 0.5  # room beyond the tokens held
    nv = torch.rand(Hkv, T + 9, generator=g) * 4 + 0.5
    rk, rv = _retained(Hkv, T, D, 0.1, g), _retained(Hkv, T, D, 0.15, g)
    q = torch.randn(1, Hq, 1, D, generator=g) * 2
    k_new, v_new = torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
    kinv, vinv = _inv(st)
    out, _ = ops.kivi_merged_attn(q, *_args(st, nk, nv, kinv, vinv, rk, rv, k_new, v_new, D))
    want = _reference(q, st, nk, nv, rk, rv, k_new, v_new)
    torch.testing.assert_close(out, want, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("pos", [0, 1, 77])
def test_rotated_in_the_call_as_before_it(pos):
    """With the RoPE tables, q and k_new pre-RoPE are rotated in the call as rope.apply rotates
    them: the same output as over the rotated ones, and k_new rotated returned."""
    g = torch.Generator().manual_seed(pos)
    Hkv, D, T = 2, 32, 90
    rope = model6().rope.at(0)  # head_dim 32
    st = _store(Hkv, D, T, 4, 32, 7, g)
    nk, nv = torch.rand(Hkv, T, generator=g) + 1, torch.rand(Hkv, T, generator=g) + 1
    rk, rv = _retained(Hkv, T, D, 0.2, g), _retained(Hkv, T, D, 0.2, g)
    q, k = torch.randn(1, 6, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
    v = torch.randn(1, Hkv, 1, D, generator=g)
    kinv, vinv = _inv(st)
    p = torch.tensor([pos])
    qr, kr = rope.apply(q, p), rope.apply(k, p)
    want, _ = ops.kivi_merged_attn(qr, *_args(st, nk, nv, kinv, vinv, rk, rv, kr, v, D))
    cos, ssin = rope.signed_tables(pos + 1)
    args = _args(st, nk, nv, kinv, vinv, rk, rv, k, v, D)
    out, k_rot = ops.kivi_merged_attn(q, *args, cos, ssin, pos)
    torch.testing.assert_close(k_rot, kr, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_a_zero_body_row_weighs_nothing():
    """A body token whose dequantized E is all zeros (kinv 0) scores 0 and adds no value."""
    g = torch.Generator().manual_seed(5)
    Hkv, D, G = 1, 64, 32
    st = KiviLayer(Hkv, D, 4, G, G, torch.float32, "cpu", ops)
    e = torch.randn(Hkv, 64, D, generator=g)
    e[:, 32:] = 0.0  # a whole group of zero keys and values: codes 0, scale 0, zero 0
    st.append(e, e.clone())
    st.flush(G)
    q = torch.randn(1, 2, 1, D, generator=g)
    nk = nv = torch.full((Hkv, 64), 2.0)
    kinv, vinv = _inv(st)
    assert bool((kinv[:, 32:] == 0).all())
    none = (None, None, None)
    kn, vn = torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
    out, _ = ops.kivi_merged_attn(q, *_args(st, nk, nv, kinv, vinv, none, none, kn, vn, D))
    want = _reference(q, st, nk, nv, none, none, kn, vn)
    torch.testing.assert_close(out, want, atol=3e-5, rtol=1e-4)


def test_bad_arguments_are_refused():
    g = torch.Generator().manual_seed(1)
    Hkv, D, T = 2, 64, 70
    st = _store(Hkv, D, T, 4, 32, 6, g)
    nk = nv = torch.ones(Hkv, T)
    kinv, vinv = _inv(st)
    q, kn = torch.randn(1, 4, 1, D), torch.randn(1, Hkv, 1, D)
    none = (None, None, None)
    ridx = torch.tensor([3, 1], dtype=torch.int32)  # head 0: not ascending
    roff = torch.tensor([0, 2, 2])
    rows = torch.randn(2, D)
    bad = [
        ((ridx, roff, rows), "not ascending"),
        ((torch.tensor([1, T], dtype=torch.int32), roff, rows), "not ascending"),  # past the end
        ((ridx.sort().values, torch.tensor([0, 2, 3]), rows), "not ascending"),  # counts off
        ((ridx.sort().values, roff, torch.randn(2, D + 1)), "rows"),
        ((ridx.sort().values, None, rows), "together"),
    ]
    for ret, what in bad:
        with pytest.raises(RuntimeError, match=what):
            ops.kivi_merged_attn(q, *_args(st, nk, nv, kinv, vinv, ret, none, kn, kn, D))
    with pytest.raises(RuntimeError, match="norms"):  # norms shorter than the tokens held
        ops.kivi_merged_attn(q, *_args(st, nk[:, :5], nv, kinv, vinv, none, none, kn, kn, D))
    with pytest.raises(RuntimeError, match="q"):
        ops.kivi_merged_attn(q[:, :3], *_args(st, nk, nv, kinv, vinv, none, none, kn, kn, D))
    with pytest.raises(RuntimeError, match="together"):  # cos without ssin
        args = _args(st, nk, nv, kinv, vinv, none, none, kn, kn, D)
        ops.kivi_merged_attn(q, *args, torch.ones(4, D), None, 0)


# --- the manager ------------------------------------------------------------------------------
SPECS = [
    "minicache:store=kivi4,kivi_residual=32,gamma=0.3",
    "minicache:store=kivi4,kivi_residual=32,gamma=0.2,decode_retain=1",  # retained when decoding
    "minicache:start=0,retain=topk:0.25,retain_rule=paper,store=kivi4,kivi_residual=64",
]


@pytest.fixture
def model_with_kernels():
    """model6 (plain layers 0, 1; pairs (2, 3), (4, 5)) whose RoPE carries the native kernels."""
    m = model6()
    m.rope.kernels = ops
    yield m
    m.rope.kernels = None


def _restore_path(kv):
    """The same manager with the pairs' native row off: E dequantized and restored each step
    (the path before kivi_merged_attn), every other kernel the same."""
    for view in kv.views.values():
        view.attend_kivi_native = lambda *a: None
    return kv


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", SPECS)
def test_decode_equals_the_restore(monkeypatch, model_with_kernels, spec):
    """80 decode steps over a 150-token prompt (the pairs' stores flush twice or more): the
    same logits as the restore, every pair layer's row on the native op."""
    m, P, steps = model_with_kernels, 150, 80
    ref = drive(m, _restore_path(new_kv(m, spec)), prompt(P, seed=3), 32, steps)
    toks = ref[P - 1 : -1].argmax(-1).tolist()
    kv = new_kv(m, spec)
    calls = []
    for view in kv.views.values():
        real = view.attend_kivi_native
        monkeypatch.setattr(view, "attend_kivi_native", lambda *a, r=real: calls.append(1) or r(*a))
    got = drive(m, kv, prompt(P, seed=3), 32, steps, tokens=toks)
    assert len(calls) == 2 * len(kv.pairs) * steps
    assert all(p.kivi.body_len > P // 2 for p in kv.pairs)
    assert any(p.k.ridx.numel() and p.v.ridx.numel() for p in kv.pairs)
    assert torch.equal(got[:P], ref[:P])  # the prefill: the same path
    torch.testing.assert_close(got[P:], ref[P:], atol=1e-4, rtol=1e-4)
    for p in kv.pairs:  # the kept inverse norms cover the body as it stands
        assert p.kivi_inv[0].n == p.kivi_inv[1].n == p.kivi.body_len


@pytest.mark.usefixtures("one_thread")
def test_scope_layer_keeps_the_restore(model_with_kernels):
    """scope=layer (one group per token over every KV head) is not this kernel's layout: its
    rows go through the restore, as before."""
    m = model_with_kernels
    kv = new_kv(m, "minicache:store=kivi4,scope=layer,gamma=0.3,kivi_residual=32")
    drive(m, kv, prompt(70, seed=2), 32, 3)
    assert all(p.kivi_inv is None for p in kv.pairs)


@pytest.mark.usefixtures("one_thread")
def test_forks_and_a_reload_go_on_alike(model_with_kernels):
    """A fork copies the kept inverse norms with the store; a cache that lost them (a .kvc
    file keeps none: they are rebuilt from the body) decodes the same."""
    m, spec = model_with_kernels, SPECS[0]
    kv = new_kv(m, spec)
    drive(m, kv, prompt(100, seed=4), 32, 40)  # past a flush: the inverse norms extended
    n0 = [p.kivi_inv[0].n for p in kv.pairs]
    fork, lost = kv.fork(), kv.fork()
    for p in lost.pairs:
        p.kivi_inv = None
    toks = prompt(30, seed=8)
    outs = []
    for cache in (kv, fork, lost):
        with torch.inference_mode():
            n, rows = cache.seen, []
            for t in toks:
                rows.append(m(torch.tensor([[t]]), torch.tensor([n]), cache)[0])
                cache.end_step()
                n += 1
        outs.append(torch.cat(rows))
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    torch.testing.assert_close(outs[2], outs[0], atol=1e-6, rtol=1e-6)
    assert all(p.kivi_inv[0].n > n for p, n in zip(kv.pairs, n0, strict=True))  # flushed since


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", ["minicache:gamma=0.3", SPECS[0]])
def test_the_rows_reads_are_made_with_the_merge(model_with_kernels, spec):
    """What a pair's native rows read beside its store is made as the prefill's turn is merged,
    not by the first decode step: a dense E's factors for both layers, a KIVI E's inverse
    norms over its body."""
    m = model_with_kernels
    kv = new_kv(m, spec)
    drive(m, kv, prompt(100, seed=6), 32, 0)
    for p in kv.pairs:
        if p.kivi is not None:
            assert [b.n for b in p.kivi_inv] == [p.kivi.body_len] * 2 and p.kivi.body_len
        else:
            assert [b.n for f in (False, True) for b in p.factors[f]] == [p.length] * 4
