"""MiniCache's native decode attention (kernels/cpu/merged_attn.h, op merged_attn) against the
torch reference kernels.merged_decode_ref, on the shared shapes, instruction sets and thread
counts; and the manager's decode through it against its torch path (the kernels unset)."""

from __future__ import annotations

import math

import pytest
import torch
from native_attention import HEADS, LENGTHS, isa, needs_native, ops, threads  # noqa: F401
from test_kernels_merged import model6, pair_inputs
from test_kv_methods import drive, new_kv, prompt

import kvrun.kv.methods.minicache.store as restore_mod
from kvrun.kernels.merged_decode import merged_decode_ref
from kvrun.kv.attention import segment_attention

pytestmark = needs_native
F16, F32 = torch.float16, torch.float32


def sorted_rows(ov: torch.Tensor | None, rows: torch.Tensor | None):
    """An override map (Hkv, T) and its rows -> merged_attn's (ridx, roff, rows): each head's
    retained tokens ascending, the rows in that order (a Half's layout)."""
    if ov is None or not bool((ov >= 0).any()):
        return None, None, None
    h, t = (ov >= 0).nonzero(as_tuple=True)  # row-major: by head, then token
    roff = torch.zeros(ov.shape[0] + 1, dtype=torch.int64)
    roff[1:] = torch.bincount(h, minlength=ov.shape[0]).cumsum(0)
    return t.to(torch.int32), roff, rows[ov[h, t].long()]


def native(args, k_new=None, v_new=None):
    q, ek, sk, ev, sv, unit, ovk, rk, ovv, rv = args
    return ops.merged_attn(
        q, ek, sk.float(), ev, sv.float(), unit, *sorted_rows(ovk, rk), *sorted_rows(ovv, rv),
        1, k_new, v_new, q.shape[-1] ** -0.5,
    )  # fmt: skip


def close(got, ref, dtype=F32):
    tol = 2e-5 if dtype == F32 else 1e-3
    torch.testing.assert_close(got[0], ref[0], atol=tol, rtol=tol)
    torch.testing.assert_close(got[1], ref[1], atol=tol, rtol=tol)


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("T", LENGTHS)
def test_merged_attn_matches_reference(Hq, Hkv, D, T, isa, threads):  # noqa: F811
    """One query row and two (a chunk), unit norms or plain factors, with and without retained
    rows (K only, V only, both), a zero E row, float32 and float16 E (float16 with plain
    factors: the streamed path, merged_heads_stream)."""
    g = Hq // Hkv
    for i, (Tq, unit, over, dtype) in enumerate(
        [(1, True, True, F32), (1, False, False, F32), (2, True, False, F32), (1, True, True, F16),
         (1, False, True, F16), (2, False, True, F16), (1, False, False, F16)]
    ):  # fmt: skip
        args = pair_inputs(Hkv, g, Tq, T, D, unit, over, seed=T * 31 + Hq + i, dtype=dtype)
        args[0] = args[0].float()  # q is float32 on the native path
        close(native(args), merged_decode_ref(*args), dtype)


@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 128)])
def test_sparse_retained_rows_between_dense_runs(Hq, Hkv, D, isa, threads):  # noqa: F811
    """The streamed path (f16 E, plain factors) with retained tokens as MiniCache keeps them,
    few and apart: the whole blocks between them go through the dense cache's loop, a block
    holding one (or a cluster) through the block path. Gaps of 0, 1, 15, 16, 17, 127, 128 and
    300 tokens, K only, V only and both in turn; the first and last tokens."""
    T = 1400
    args = pair_inputs(Hkv, Hq // Hkv, 1, T, D, False, False, seed=D + Hq, dtype=F16)
    args[0] = args[0].float()
    gen = torch.Generator().manual_seed(7)
    ovk = torch.full((Hkv, T), -1, dtype=torch.int32)
    ovv = ovk.clone()
    for h in range(Hkv):
        t, ks, vs = h, [], []
        for i, gap in enumerate([0, 1, 15, 16, 17, 127, 128, 300, 0, 16, 1]):
            if t >= T:
                break
            (ks if i % 3 != 1 else vs).append(t)  # K, V, both in turn
            if i % 3 == 2:
                vs.append(t)
            t += gap + 1
        ks.append(T - 1)
        for t in ks:
            ovk[h, t] = int((ovk >= 0).sum())
        for t in vs:
            ovv[h, t] = int((ovv >= 0).sum())
    nk, nv = int((ovk >= 0).sum()), int((ovv >= 0).sum())
    args[6:] = [ovk, 3 * torch.randn(nk, D, generator=gen).half(), ovv,
                3 * torch.randn(nv, D, generator=gen).half()]  # fmt: skip
    close(native(args), merged_decode_ref(*args), F16)


@pytest.mark.parametrize("Hq,Hkv,D", HEADS[:4])
@pytest.mark.parametrize("Tq", [1, 3])
@pytest.mark.parametrize("T", [0, 1, 250])
def test_own_tokens_fold_in_causally(Hq, Hkv, D, Tq, T, isa, threads):  # noqa: F811
    """The step's own exact tokens after the merged ones: the merged partial and the own one
    (causal among themselves) merged by log-sum-exp."""
    args = pair_inputs(Hkv, Hq // Hkv, Tq, T, D, True, True, seed=Tq + T)
    gen = torch.Generator().manual_seed(D)
    kn, vn = torch.randn(2, 1, Hkv, Tq, D, generator=gen)
    out, lse = native(args, kn, vn)
    a = merged_decode_ref(*args)
    causal = torch.ones(Tq, Tq, dtype=torch.bool).tril()
    b = segment_attention(args[0], kn, vn, causal)
    total = torch.logaddexp(a[1], b.lse)
    ref = (torch.exp(a[1] - total)[..., None].nan_to_num(0) * a[0]
           + torch.exp(b.lse - total)[..., None] * b.out)  # fmt: skip
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, total, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("dtype", [F32, F16])
def test_retained_rows_per_token(Hq, Hkv, D, dtype, isa):  # noqa: F811
    """scope=layer: one group of retained tokens, a row of Hkv * D per token, the factors given
    whole (unit off): as Layout.override maps them for the reference."""
    T, gen = 77, torch.Generator().manual_seed(Hq * D)
    q = torch.randn(1, Hq, 1, D, generator=gen)
    ek, ev = torch.randn(2, Hkv, T, D, generator=gen).to(dtype)
    sk, sv = (0.5 + torch.rand(2, T, generator=gen)).expand(Hkv, 2, T).transpose(0, 1)
    idx = torch.tensor([0, 5, 6, 40, T - 1], dtype=torch.int32)
    rk, rv = torch.randn(2, len(idx), Hkv * D, generator=gen).to(dtype)
    ov = torch.full((Hkv, T), -1, dtype=torch.int32)
    r = torch.arange(len(idx), dtype=torch.int32)
    ov[:, idx.long()] = r[None, :] * Hkv + torch.arange(Hkv, dtype=torch.int32)[:, None]
    ref = merged_decode_ref(q, ek, sk, ev, sv, False, ov, rk.reshape(-1, D), ov, rv.reshape(-1, D))
    roff = torch.tensor([0, len(idx)])
    got = ops.merged_attn(
        q, ek, sk, ev, sv, False, idx, roff, rk, idx, roff, rv, 0, None, None, D**-0.5
    )
    close(got, ref, dtype)


def test_bad_arguments_are_refused():
    args = pair_inputs(2, 3, 1, 20, 64, True, True, seed=1)
    q, ek, sk, ev, sv, unit, ovk, rk, ovv, rv = args
    ridx, roff, rows = sorted_rows(ovk, rk)
    for bad in (
        (ridx.flip(0), roff, rows),  # not ascending
        (ridx + 20, roff, rows),  # outside T
        (ridx, roff[:-1], rows),  # roff too short
        (ridx, roff, rows[:, :32]),  # rows too narrow
    ):
        with pytest.raises(RuntimeError):
            ops.merged_attn(q, ek, sk, ev, sv, True, *bad, None, None, None, 1, None, None, 0.1)
    with pytest.raises(RuntimeError):  # E_K and E_V of two dtypes
        ops.merged_attn(q, ek, sk, ev.half(), sv, True, *[None] * 6, 1, None, None, 0.1)


@pytest.mark.parametrize("t,sin_eps", [(0.6, 1e-6), (0.5, 1e-6), (1.0, 0.0), (0.3, 0.5)])
def test_minicache_merge_matches_merge(t, sin_eps):
    """The SLERP merge, LERP fallback and degenerate rows (zero, parallel, antipodal) as
    minicache.store.merge computes them."""
    gen = torch.Generator().manual_seed(int(10 * t))
    xa = torch.randn(3, 300, 64, generator=gen)
    xb = 0.5 * xa + torch.randn(3, 300, 64, generator=gen)
    xb[0, 0] = 0  # zero rows
    xa[1, 1] = 0
    xb[2, 2] = -xa[2, 2]  # antipodal
    xb[2, 3] = 2 * xa[2, 3]  # parallel
    xb[2, 4] = xa[2, 4] + 1e-4 * xb[2, 4]  # sin(Omega) ~ 0: LERP
    got = ops.minicache_merge(xa, xb, t, sin_eps)
    want = restore_mod.merge(xa, xb, t, sin_eps)
    for g_, w in zip(got[:4], want, strict=True):
        torch.testing.assert_close(g_, w, atol=1e-5, rtol=1e-5)
    norm = torch.linalg.vector_norm(want[0], dim=-1)  # merged_attn's factors n / ||E||
    inv = 1 / torch.where(norm > 0, norm, 1.0)
    torch.testing.assert_close(got[4], want[1] * inv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[5], want[2] * inv, atol=1e-5, rtol=1e-5)
    assert all(bool(x.isfinite().all()) for x in got)


# --- the manager ------------------------------------------------------------------------------
SPECS = [
    "minicache:gamma=0.3",
    "minicache:gamma=0.3,scope=layer",
    "minicache:gamma=0.2,decode_retain=1",  # retained rows also added while decoding
    "minicache:start=0,retain=topk:0.25,retain_rule=paper",
]


@pytest.fixture
def model_with_kernels():
    """model6 whose RoPE carries the native kernels (as Transformer.use_native_step sets them
    on a GGUF model): managers built on it attend natively, the model itself stays torch."""
    m = model6()
    m.rope.kernels = ops
    yield m
    m.rope.kernels = None


def torch_path(kv):
    """The same manager with the kernels unset: today's torch path."""
    kv.kernels = None
    for st in kv.stores():
        st.kernels = None
    return kv


def count_native(monkeypatch, kv) -> list:
    """Calls of a pair layer's native decode (a row rotated in the op on the pair's buffers
    (minicache_step) or on views of them, or several tokens rotated before it)."""
    calls = []
    for view in kv.views.values():
        for name in ("attend_native", "rope_attend_native"):
            real = getattr(view, name)
            monkeypatch.setattr(view, name, lambda *a, r=real: calls.append(1) or r(*a))
    step = kv._step

    def counted(*a):
        out = step(*a)
        if out is not None:
            calls.append(1)
        return out

    monkeypatch.setattr(kv, "_step", counted)
    return calls


@pytest.mark.usefixtures("sdpa_prefill")
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", SPECS)
def test_decode_equals_the_torch_path(monkeypatch, model_with_kernels, spec):
    m, P, steps = model_with_kernels, 75, 6
    old = torch_path(new_kv(m, spec))
    ref = drive(m, old, prompt(P, seed=3), 32, steps)
    toks = ref[P - 1 : -1].argmax(-1).tolist()
    kv = new_kv(m, spec)
    calls = count_native(monkeypatch, kv)
    got = drive(m, kv, prompt(P, seed=3), 32, steps, tokens=toks)
    assert len(calls) == 2 * len(kv.pairs) * steps  # every paired layer, every step
    assert any(p.k.ridx.numel() for p in kv.pairs)  # retained rows were put back
    assert torch.equal(got[:P], ref[:P])  # prefill: the same path
    torch.testing.assert_close(got[P:], ref[P:], atol=1e-4, rtol=1e-4)
    assert kv.nbytes() == old.nbytes()
    lay = kv.layout
    for p in kv.pairs:  # the kept factors, extended step by step, as made afresh
        for second in (False, True):
            for half, kept in zip((p.k, p.v), p.factors[second], strict=True):
                e = lay.groups(half.e.data)
                norm = torch.linalg.vector_norm(e, dim=-1)
                n = (half.nb if second else half.na).data
                want = n / torch.where(norm > 0, norm, 1.0)
                torch.testing.assert_close(kept.data, want, atol=1e-6, rtol=1e-5)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", SPECS[:3])
def test_f16_pairs_decode_as_the_torch_path(monkeypatch, model_with_kernels, spec):
    """--kv-dtype f16 (the CPU's default): E, norms, retained rows and the plain layers held
    in f16, read natively by merged_attn, against the torch path over the same f16 store;
    about half the f32 store's bytes."""
    from kvrun.kv import build, check

    m, P, steps = model_with_kernels, 75, 6

    def f16(kernels: bool):
        kv = build(check(spec).with_dtype("f16"), m.config, m.rope, "cpu", torch.float32)
        return kv if kernels else torch_path(kv)

    old = f16(False)
    ref = drive(m, old, prompt(P, seed=3), 32, steps)
    toks = ref[P - 1 : -1].argmax(-1).tolist()
    kv = f16(True)
    calls = count_native(monkeypatch, kv)
    got = drive(m, kv, prompt(P, seed=3), 32, steps, tokens=toks)
    assert len(calls) == 2 * len(kv.pairs) * steps
    assert all(p.k.e.data.dtype == torch.float16 == p.k.ra.dtype for p in kv.pairs)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
    f32 = new_kv(m, spec)
    drive(m, f32, prompt(P, seed=3), 32, steps, tokens=toks)
    assert 0.45 < kv.nbytes() / f32.nbytes() < 0.6


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("spec", [SPECS[0], SPECS[1], SPECS[3]])
def test_step_on_the_buffers_as_the_views(monkeypatch, model_with_kernels, spec, dtype):
    """minicache_step (a pair layer's decode row on the pair's buffers, layer b's merge in the
    same call) gives bit for bit what rope_merged_attn over views and minicache_merge_into
    give: the logits and every buffer of every pair; it runs for every paired layer from the
    first step on (the kept factors are made as the prefill's turn is merged)."""
    from kvrun.kv import build, check

    m, P, steps = model_with_kernels, 75, 6

    def run(fast: bool):
        kv = build(check(spec).with_dtype(dtype), m.config, m.rope, "cpu", torch.float32)
        if not fast:
            monkeypatch.setattr(kv, "_step", lambda *a: None)
        hits = count_native(monkeypatch, kv) if fast else []
        views = [0]
        for view in kv.views.values():
            real = view.rope_attend_native
            monkeypatch.setattr(
                view,
                "rope_attend_native",
                lambda *a, r=real: views.__setitem__(0, views[0] + 1) or r(*a),
            )
        return kv, drive(m, kv, prompt(P, seed=3), 32, steps), len(hits), views[0]

    fast, got, hits, views = run(True)
    slow, ref, _, slow_views = run(False)
    assert torch.equal(got, ref)
    assert slow_views == hits == 2 * len(fast.pairs) * steps  # every paired layer, every step
    assert views == 0  # no row on views: minicache_step from the first step
    for a, b in zip(fast.pairs, slow.pairs, strict=True):
        assert a.length == b.length
        for ha, hb in ((a.k, b.k), (a.v, b.v)):
            for x, y in ((ha.e, hb.e), (ha.na, hb.na), (ha.nb, hb.nb)):
                assert torch.equal(x.data, y.data)
            assert torch.equal(ha.ridx, hb.ridx) and torch.equal(ha.ra, hb.ra)
        for second in (False, True):
            for x, y in zip(a.factors[second], b.factors[second], strict=True):
                assert torch.equal(x.data, y.data)


def test_step_refuses_bad_buffers(model_with_kernels):
    """minicache_step checks what it is handed: ten buffers, room for n, layer a's rows at b."""
    H, D, cap = 2, 64, 8
    q, k, v = torch.randn(1, 4, 1, D), torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
    cos, ssin = torch.randn(16, D), torch.randn(16, D)
    bufs = [torch.randn(H, cap, D) for _ in range(2)] + [torch.rand(H, cap) for _ in range(8)]
    args = (None,) * 6 + (1, H, 0.6, 1e-6, D**-0.5)
    out, kr = ops.minicache_step(q, k, v, cos, ssin, 3, bufs, 5, False, None, None, *args)
    assert out.shape == q.shape and kr.shape == k.shape
    for bad, msg in [
        ((bufs[:9], 5, False, None), "10 buffers"),
        ((bufs, cap + 1, False, None), "cap >= n"),
        ((bufs, 5, True, None), "layer a's k and v"),
    ]:
        with pytest.raises(RuntimeError, match=msg):
            b, n, second, ka = bad
            ops.minicache_step(q, k, v, cos, ssin, 3, b, n, second, ka, ka, *args)


@pytest.mark.usefixtures("one_thread")
def test_multi_token_decode_calls(model_with_kernels):
    """Decode calls of several tokens at once (the pending slot holds them; own tokens
    causal) equal the torch path."""
    m, P = model_with_kernels, 40
    kvs = [new_kv(m, "minicache:gamma=0.3"), torch_path(new_kv(m, "minicache:gamma=0.3"))]
    outs = []
    for kv in kvs:
        drive(m, kv, prompt(P, seed=6), 64)
        n, logits = P, []
        with torch.inference_mode():
            for span in (2, 3, 1):
                ids = torch.tensor([prompt(span, seed=n)])
                logits.append(m(ids, torch.arange(n, n + span), kv)[0])
                kv.end_step()
                n += span
        outs.append(torch.cat(logits))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    assert math.isfinite(float(outs[0].abs().max()))


@pytest.mark.parametrize("spec,budget", [("minicache", None), ("spindlekv", "0.1")])
def test_default_model_greedy_tokens_agree(default_runtime, spec, budget):
    """The default model (float32 weights, torch's products) after a real prompt: its stores on
    the native ops (the kernels handed to them) and on the torch path decode the same greedy
    tokens, logits within 1e-3. (On the GGUF path the products quantize their activations to
    8 bits, so a last-bit difference can move a logit by ~0.1: there only near-ties differ.)"""
    from kvrun.kv import check
    from kvrun.run.sampling import SamplingConfig
    from kvrun.run.session import Session

    rt = default_runtime
    with open("/usr/share/common-licenses/GPL-3") as f:
        ids = rt.tokenizer.encode(f.read()[:1200])
    runs = []
    for native in (True, False):
        rt.model.rope.kernels = ops if native else None  # the stores take the kernels built
        try:
            kv = rt.new_kv(check(spec, budget))
        finally:
            rt.model.rope.kernels = None
        s = Session(rt.model, rt.tokenizer, kv)
        toks = s.generate(ids, 12, SamplingConfig(temp=0), seed=0).tokens
        with torch.inference_mode():
            logits = torch.stack([s.decode(t) for t in toks[-2:]])
        runs.append((toks, logits, kv))
    (a, la, kv), (b, lb, _) = runs
    assert len(a) == 12 and a == b
    torch.testing.assert_close(la, lb, atol=1e-3, rtol=0)
    assert all(getattr(st, "kernels", ops) is ops for st in kv.stores())  # native throughout


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("token", [False, True])
def test_merge_into_writes_what_merge_and_appends_store(dtype, token):
    """minicache_merge_into (a decode token, K and V in one call) puts into slot n of the
    pair's buffers exactly what minicache_merge's outputs appended would: E and the norms in
    the store's dtype, the factors float32; groups per head or one per token."""
    H, D, cap, n = 3, 64, 9, 5
    g, m = (1, H * D) if token else (H, D)
    gen = torch.Generator().manual_seed(H + token)
    xa, xb = torch.randn(2, 2, H, 1, D, generator=gen)  # [K, V] of layers a, b
    xa[1, 2] = 0  # a zero row
    e = [torch.zeros(H, cap, D, dtype=dtype) for _ in range(2)]
    na, nb = ([torch.zeros(g, cap, dtype=dtype) for _ in range(2)] for _ in range(2))
    fa, fb = ([torch.zeros(g, cap) for _ in range(2)] for _ in range(2))
    d = ops.minicache_merge_into(list(xa), list(xb), g, 0.6, 1e-6, e, na, nb, fa, fb, n)
    for h in range(2):
        ga = xa[h].transpose(0, 1).reshape(1, 1, -1) if token else xa[h]  # Layout.groups
        gb = xb[h].transpose(0, 1).reshape(1, 1, -1) if token else xb[h]
        want_e, want_na, want_nb, want_d, want_fa, want_fb = ops.minicache_merge(ga, gb, 0.6, 1e-6)
        heads = want_e.reshape(1, H, D).transpose(0, 1) if token else want_e  # Layout.heads
        assert torch.equal(e[h][:, n : n + 1], heads.to(dtype))
        assert torch.equal(na[h][:, n], want_na[:, 0].to(dtype))
        assert torch.equal(nb[h][:, n], want_nb[:, 0].to(dtype))
        assert torch.equal(fa[h][:, n], want_fa[:, 0]) and torch.equal(fb[h][:, n], want_fb[:, 0])
        assert torch.equal(d[h], want_d[:, 0])
        assert not e[h][:, :n].any() and not e[h][:, n + 1 :].any()  # nothing else written
    with pytest.raises(RuntimeError):  # no room for slot n
        ops.minicache_merge_into(list(xa), list(xb), g, 0.6, 1e-6, e, na, nb, fa, fb, cap)
