"""kernels.merged_decode (MiniCache's restore fused into decode attention) and its use.

The reference is checked against a naive computation written here: the pair restored densely
(minicache.restore, exact rows put back by hand) and a materialised fp64 softmax. The Triton
kernel (interpreted on CPU, compiled on CUDA) is checked against the reference, and the
manager's decode logits through merged_decode against its restore-then-SDPA path.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from kv_helpers import restore, unfused
from test_kernels import _dtypes, _tol, assert_partial
from test_kv_methods import drive, new_kv, prompt, random_transformer

import kvrun.kv.methods.minicache.store as restore_mod
from kvrun.kernels import merged_decode as md
from kvrun.models.config import ModelConfig

F16, F32 = torch.float16, torch.float32


# --- inputs and the naive reference -------------------------------------------------------------
def pair_inputs(H, g, Tq, T, D, unit, over, seed, dtype=F32, device="cpu"):
    """Arguments of merged_decode: random E with a zero row, norms (unit) or factors, and
    with `over` some (head, token) overridden for K only, some for V only, some for both."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = rnd(1, H * g, Tq, D)
    ek, ev = rnd(H, T, D), rnd(H, T, D)
    if T > 2:
        ek[0, 1] = 0  # ||E|| = 0 restores to 0
        ev[-1, 2] = 0
    sk = 0.5 + 2 * torch.rand(H, T, generator=gen)
    sv = 0.5 + 2 * torch.rand(H, T, generator=gen)
    args = [q, ek, sk, ev, sv, unit, None, None, None, None]
    if over:
        ovk = torch.full((H, T), -1, dtype=torch.int32)
        ovv = ovk.clone()
        cells = torch.randperm(H * T, generator=gen)[: max(1, H * T // 5)]  # ~20% of the cells
        for j, c in enumerate(cells.tolist()):
            h, t = divmod(c, T)
            if j % 3 != 1:  # K only (0), both (2)
                ovk[h, t] = int((ovk >= 0).sum())
            if j % 3 != 0:  # V only (1), both (2)
                ovv[h, t] = int((ovv >= 0).sum())
        nk, nv = int((ovk >= 0).sum()), int((ovv >= 0).sum())
        # the rows table is not in map order: maps point at a permutation of it
        pk, pv = torch.randperm(nk, generator=gen), torch.randperm(nv, generator=gen)
        ovk[ovk >= 0] = pk[ovk[ovk >= 0].long()].int()
        ovv[ovv >= 0] = pv[ovv[ovv >= 0].long()].int()
        args[6:] = [ovk, 3 * rnd(nk, D), ovv, 3 * rnd(nv, D)]
    cast = lambda x: x.to(device, dtype) if x.is_floating_point() else x.to(device)  # noqa: E731
    return [cast(a) if isinstance(a, torch.Tensor) else a for a in args]


def naive_merged(q, ek, sk, ev, sv, unit, ovk=None, rk=None, ovv=None, rv=None):
    """The pair restored densely, exact rows put back, then materialised fp64 attention."""
    H, T, D = ek.shape
    g = q.shape[1] // H
    xs = []
    for e, s, ov, rows in ((ek, sk, ovk, rk), (ev, sv, ovv, rv)):
        x = restore(e, s) if unit else e.float() * s.float()[..., None]  # (H, T, D)
        x = x.double()
        if ov is not None:
            for h in range(H):
                for t in range(T):
                    if ov[h, t] >= 0:
                        x[h, t] = rows[int(ov[h, t])].double()
        xs.append(x.repeat_interleave(g, 0))  # query head h reads KV head h // g
    s = q[0].double() @ xs[0].transpose(1, 2) / math.sqrt(D)  # (Hq, Tq, T)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    return (p @ xs[1])[None], lse[None]


CASES = [  # Hkv, g, Tq, T, D, split, over
    (2, 4, 1, 1, 64, None, False),
    (1, 3, 1, 15, 96, None, True),
    (2, 1, 2, 17, 64, 64, True),
    (2, 4, 1, 64, 64, 64, True),  # T = one tile = one split
    (1, 3, 2, 128, 96, 64, True),  # T an exact multiple of the split and tile
    (2, 4, 1, 129, 64, 64, False),  # one key into a new split
    (1, 4, 2, 191, 64, 128, True),  # odd, two tiles per split
    (2, 3, 1, 0, 64, None, True),  # no merged token at all
]


@pytest.mark.parametrize("unit", [True, False])
@pytest.mark.parametrize("H,g,Tq,T,D,over", [c[:5] + c[6:] for c in CASES])
def test_ref_matches_naive(H, g, Tq, T, D, over, unit):
    for dtype in (F32, F16):
        args = pair_inputs(H, g, Tq, T, D, unit, over, seed=T + 7 * g, dtype=dtype)
        out, lse = md.merged_decode_ref(*args)
        assert out.dtype == lse.dtype == F32
        assert out.shape == (1, H * g, Tq, D) and lse.shape == (1, H * g, Tq)
        if T == 0:
            assert (out == 0).all() and (lse == float("-inf")).all()
            continue
        assert_partial((out, lse), naive_merged(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H,g,Tq,T,D,split,over", CASES)
def test_triton_matches_ref(device, H, g, Tq, T, D, split, over):
    for i, dtype in enumerate(_dtypes(device)):
        if i and device == "cpu" and T not in (17, 128, 191):  # interpreter time: a few shapes
            continue
        for unit in (True, False) if i == 0 or device == "cuda" else (T % 2 == 1,):
            args = pair_inputs(
                H, g, Tq, T, D, unit, over, seed=3 * T + g, dtype=dtype, device=device
            )
            got = md.merged_decode_triton(*args, split=split)
            ref = md.merged_decode_ref(*args)
            assert got[0].shape == ref[0].shape and got[0].dtype == F32
            assert_partial(got, ref, **_tol(dtype))


def test_splits_agree_with_one_split():
    """Split-K partials merged by log-sum-exp equal one pass over all merged tokens."""
    args = pair_inputs(2, 3, 1, 300, 64, True, True, seed=11)
    one = md.merged_decode_triton(*args, split=320)
    many = md.merged_decode_triton(*args, split=64)
    assert_partial(many, one, atol=2e-6, rtol=2e-6)


def test_bad_layouts_are_refused():
    args = pair_inputs(2, 2, 1, 8, 64, True, True, seed=1)
    bad = [
        (1, args[1][:1]),  # E_K of one head, E_V of two
        (2, args[2][:, :4]),  # a scale shorter than E
        (6, args[6].long()),  # an int64 map
        (7, None),  # a map without its rows
    ]
    for i, x in bad:
        wrong = list(args)
        wrong[i] = x
        with pytest.raises(ValueError, match="merged_decode"):
            md.merged_decode_ref(*wrong)


def _boom(*a, **k):
    raise AssertionError("the other implementation was called")


def test_dispatch_follows_kvrun_kernels(monkeypatch):
    args = pair_inputs(1, 2, 1, 20, 64, True, True, seed=2)
    monkeypatch.setenv("KVRUN_KERNELS", "torch")
    monkeypatch.setattr(md, "merged_decode_triton", _boom)
    ref = md.merged_decode(*args)
    monkeypatch.undo()
    monkeypatch.setenv("KVRUN_KERNELS", "triton")  # forced: Triton (interpreted on CPU)
    monkeypatch.setattr(md, "merged_decode_ref", _boom)
    assert_partial(md.merged_decode(*args), ref, **_tol(F32))


# --- the manager: merged_decode in place of restore-then-SDPA -----------------------------------
HKV, D = 2, 32


@functools.lru_cache(maxsize=1)
def model6():
    """6 layers (0, 1 plain; pairs (2, 3), (4, 5)), 6 query heads on 2 KV heads (g = 3)."""
    c = ModelConfig(
        arch="llama", n_layers=6, dim=64, n_heads=6, n_kv_heads=HKV, head_dim=D, ffn_dim=128,
        vocab_size=256, context_length=4096,
    )  # fmt: skip
    return random_transformer(c, 91)


def count_calls(monkeypatch) -> list:
    """Count the pair store's merged_decode calls (the new path ran)."""
    calls, real = [], restore_mod.merged_decode
    monkeypatch.setattr(restore_mod, "merged_decode", lambda *a: calls.append(1) or real(*a))
    return calls


E2E = [
    "minicache:gamma=0.3",
    "minicache:gamma=0.3,scope=layer",
    "minicache:gamma=0.2,decode_retain=1",  # retained rows also added while decoding
    "minicache:start=0,retain=topk:0.25,retain_rule=paper",
]


def stretch_e(kv):
    """A hook for drive: after prefill, scale every stored E row by a random factor in
    [0.5, 2.5): restore divides by ||E||, so what attention sees must not change."""

    def after(point):
        if point == "prefill":
            gen = torch.Generator().manual_seed(0)
            for p in kv.pairs:
                for h in (p.k, p.v):
                    e = h.e.data  # (Hkv, T, D)
                    e.mul_(0.5 + 2 * torch.rand(e.shape[:2], generator=gen)[..., None])

    return after


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", E2E)
def test_decode_logits_equal_the_restore_path(monkeypatch, spec):
    m, P, steps = model6(), 75, 6
    old = new_kv(m, spec)
    unfused(old)
    ref = drive(m, old, prompt(P, seed=3), 32, steps, after=stretch_e(old))
    toks = ref[P - 1 : -1].argmax(-1).tolist()
    calls = count_calls(monkeypatch)
    kv = new_kv(m, spec)
    got = drive(m, kv, prompt(P, seed=3), 32, steps, tokens=toks, after=stretch_e(kv))
    n_pairs = len(kv.pairs)
    assert len(calls) == 2 * n_pairs * steps  # every paired layer, every step
    for p in kv.pairs:  # retained rows were there to put back, K and V
        assert p.k.ridx.numel() > 0 and p.v.ridx.numel() > 0
        assert p.k.ridx.numel() < kv.layout.g * p.length  # and merged rows to restore
    assert torch.equal(got[:P], ref[:P])  # prefill: the same path
    torch.testing.assert_close(got[P:], ref[P:], atol=1e-4, rtol=1e-4)
    assert kv.nbytes() == old.nbytes()  # the maps are scratch, not cache


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", ["minicache:gamma=0.3", "minicache:gamma=0.3,scope=layer"])
def test_decode_with_triton_kernels(monkeypatch, spec):
    """KVRUN_KERNELS=triton: merged_decode and dense_decode in Triton (interpreted on CPU)."""
    m, P, steps = model6(), 40, 2
    old = new_kv(m, spec)
    unfused(old)
    ref = drive(m, old, prompt(P, seed=4), 64, steps, after=stretch_e(old))
    toks = ref[P - 1 : -1].argmax(-1).tolist()
    monkeypatch.setenv("KVRUN_KERNELS", "triton")
    monkeypatch.setattr(md, "merged_decode_ref", _boom)
    kv = new_kv(m, spec)
    got = drive(m, kv, prompt(P, seed=4), 64, steps, tokens=toks, after=stretch_e(kv))
    torch.testing.assert_close(got[P:], ref[P:], atol=1e-4, rtol=1e-4)


def feed_both(spec: str, window: int | None, P: int, steps: list[int], seed: int = 5):
    """Two managers (merged_decode, restore path) fed the same random q, k, v directly:
    a prefill of P tokens, then decode calls of steps[i] tokens each; yields each call's
    paired-layer outputs of both."""
    from kvrun.kv import build, check
    from kvrun.models.rope import Rope, inverse_frequencies

    c = ModelConfig(
        arch="llama", n_layers=4, dim=64, n_heads=6, n_kv_heads=HKV, head_dim=D, ffn_dim=128,
        vocab_size=256, context_length=4096, sliding_window=window,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    n = P + sum(steps)
    q = torch.randn(1, 6, n, D, generator=gen)
    k = torch.randn(4, 1, HKV, n, D, generator=gen)
    k[1:] = k[:-1] + 0.5 * k[1:]  # neighbouring layers alike
    v = torch.randn(4, 1, HKV, n, D, generator=gen)
    rope = Rope(inverse_frequencies(c), torch.device("cpu"), F32)
    kvs = [build(check(spec), c, rope, torch.device("cpu"), F32) for _ in range(2)]
    unfused(kvs[1])
    spans, a = [], P
    for s in steps:
        spans.append((a, a + s))
        a += s
    for kv in kvs:
        kv.begin_prefill(P)
        for ly in range(4):
            kv.attend(ly, q[..., :P, :], k[ly, ..., :P, :], v[ly, ..., :P, :], torch.arange(P))
        kv.end_chunk(P)
        kv.end_prefill()
    for a, b in spans:
        outs = []
        for kv in kvs:
            pos = torch.arange(a, b)
            outs.append([kv.attend(ly, q[..., a:b, :], k[ly, ..., a:b, :], v[ly, ..., a:b, :], pos)
                         for ly in range(4)])  # fmt: skip
            kv.seen += b - a  # a decode call of b - a tokens
        yield a, outs[0][2:], outs[1][2:]


def test_multi_token_decode_and_sliding_window(monkeypatch):
    """Decode calls of several tokens (own tokens causal) match the restore path; a call whose
    window masks a merged token runs the restore path (merged_decode is not called), and after
    it the pair holds only what the next query sees (the window's bound), so calls fuse again."""
    calls = count_calls(monkeypatch)
    for a, got, ref in feed_both("minicache:start=2,gamma=0.3", 40, 30, [2, 3, 4, 2, 1]):
        for x, y in zip(got, ref, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        if a == 35:  # tokens 35..38: 39 <= window 40, the last fused call
            assert len(calls) == 2 * 3
    # 39..40: 39 + 2 > 40, position 40 no longer sees 0: restore and mask; then the pair drops
    # what the window hides (it holds 39) and 41 fuses again
    assert len(calls) == 2 * 4


def test_kivi_store_keeps_the_restore_path(monkeypatch):
    """minicache+kivi4: fusing KIVI dequantization with the restore is not done."""
    calls = count_calls(monkeypatch)
    for _, got, ref in feed_both("minicache:store=kivi4,start=2", None, 40, [1, 1]):
        for x, y in zip(got, ref, strict=True):
            assert torch.equal(x, y)
    assert not calls
