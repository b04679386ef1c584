"""Kernels (DESIGN.md "Kernels"): every Triton kernel against its torch reference, and every
reference against a naive dense computation written out here (materialised softmax in fp64,
dequantize-then-attend, kivi.quantize + pack).

On CPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1 without a
GPU); shapes stay small because the interpreter is slow. Its `tl.dot` on bfloat16 is wrong on
CPU and its fp32 -> bf16 cast truncates, so bf16 runs only on CUDA.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from kv_helpers import pack, quantize

import kvrun.kernels.dispatch as K
from kvrun.errors import KvrunError
from kvrun.kernels import colsum as cs
from kvrun.kernels import dense_decode as dd
from kvrun.kernels import kivi_decode as kd
from kvrun.kernels import kivi_pack as kp
from kvrun.kv.stores.kivi import KiviLayer, dequantize, unpack

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
NEG = float("-inf")


def _dtypes(device: str) -> list[torch.dtype]:
    return [F32, F16, BF16] if device == "cuda" else [F32, F16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int, dtype=F32, device="cpu", scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(device=device, dtype=dtype)


def _tol(dtype: torch.dtype) -> dict:
    """Triton vs reference: fp32 is near exact; half inputs round P (and KIVI's K, V) to half."""
    return {F32: dict(atol=2e-5, rtol=2e-5), F16: dict(atol=3e-3, rtol=3e-3)}.get(
        dtype, dict(atol=2e-2, rtol=2e-2)
    )


# --- naive references (fp64, materialised) ----------------------------------------------------
def naive_attention(q, k, v, visible):
    """q (B,Hq,Tq,D), k/v (B,Hkv,T,D), visible (B,Tq,T) bool -> out, lse, probs (fp64)."""
    B, Hq, Tq, D = q.shape
    g = Hq // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)  # query head h reads KV head h // g
    vv = v.double().repeat_interleave(g, dim=1)
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(D)  # (B, Hq, Tq, T)
    s = s.masked_fill(~visible[:, None], NEG)
    lse = torch.logsumexp(s, -1)
    p = torch.where(visible[:, None], torch.exp(s - lse[..., None]), 0.0)
    return p @ vv, lse, p


def visibility(B, Tq, T, lengths=None, causal_offset=None):
    vis = torch.ones(B, Tq, T, dtype=torch.bool)
    t = torch.arange(T)
    if lengths is not None:
        vis &= (t[None, :] < torch.as_tensor(lengths)[:, None])[:, None]
    if causal_offset is not None:
        vis &= t[None, :] <= causal_offset + torch.arange(Tq)[:, None]
    return vis


def assert_partial(got, ref, **tol):
    """Outputs and lse (and probs) close; -inf lse exactly where the reference has it."""
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.cpu().double(), b.cpu().double(), **tol)


# --- dense decode -----------------------------------------------------------------------------
DENSE_CASES = [  # B, Hkv, g, Tq, T, D, split, lengths, causal_offset
    (1, 2, 4, 1, 1, 64, None, None, None),
    (1, 1, 3, 1, 15, 128, None, None, None),
    (2, 2, 1, 1, 17, 64, 64, [17, 9], None),
    (1, 2, 4, 1, 100, 64, 64, None, None),
    (1, 2, 3, 2, 128, 64, 64, None, None),  # T an exact multiple of the split and tile
    (1, 1, 4, 1, 127, 128, 64, None, None),
    (1, 1, 4, 1, 129, 64, 64, None, None),
    (2, 1, 4, 3, 257, 64, 128, [257, 0], None),  # one sequence with no keys at all
    (1, 2, 2, 4, 70, 64, 64, None, 66),  # causal among 4 new tokens at slots 66..69
    (1, 2, 4, 1, 0, 64, None, None, None),  # empty segment
]


@pytest.mark.parametrize("B,Hkv,g,Tq,T,D,lengths,causal", [c[:6] + c[7:] for c in DENSE_CASES])
def test_dense_decode_ref_matches_naive(B, Hkv, g, Tq, T, D, lengths, causal):
    q = _randn(B, Hkv * g, Tq, D, seed=1)
    k, v = _randn(B, Hkv, T, D, seed=2), _randn(B, Hkv, T, D, seed=3)
    L = torch.tensor(lengths, dtype=torch.int32) if lengths else None
    out, lse, probs = dd.dense_decode_ref(q, k, v, L, True, causal)
    assert out.dtype == lse.dtype == probs.dtype == F32
    assert out.shape == (B, Hkv * g, Tq, D) and probs.shape == (B, Hkv * g, Tq, T)
    ref = naive_attention(q, k, v, visibility(B, Tq, T, lengths, causal))
    assert_partial((out, lse, probs), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B,Hkv,g,Tq,T,D,split,lengths,causal", DENSE_CASES)
def test_dense_decode_triton_matches_ref(device, B, Hkv, g, Tq, T, D, split, lengths, causal):
    for i, dtype in enumerate(_dtypes(device)):
        if i and device == "cpu" and T not in (17, 129, 257):  # interpreter time: a few shapes
            continue
        q = _randn(B, Hkv * g, Tq, D, seed=4, dtype=dtype, device=device)
        k = _randn(B, Hkv, T, D, seed=5, dtype=dtype, device=device)
        v = _randn(B, Hkv, T, D, seed=6, dtype=dtype, device=device)
        L = torch.tensor(lengths, dtype=torch.int32, device=device) if lengths else None
        probs = i == 0 or device == "cuda"
        got = dd.dense_decode_triton(q, k, v, L, probs, causal, split=split)
        ref = dd.dense_decode_ref(q, k, v, L, probs, causal)
        assert got[0].shape == ref[0].shape and got[0].dtype == F32
        assert_partial(got, ref, **_tol(dtype))


def test_dense_decode_ignores_nan_past_the_length(device):
    """A static cache's spare room is never-written memory: NaN there must not leak (the
    reference masks values as well as scores; the kernel never loads past the length)."""
    q = _randn(1, 4, 1, 64, seed=10, device=device)
    k, v = (
        _randn(1, 2, 200, 64, seed=11, device=device),
        _randn(1, 2, 200, 64, seed=12, device=device),
    )
    k[:, :, 77:], v[:, :, 77:] = float("nan"), float("nan")
    L = torch.tensor([77], dtype=torch.int32, device=device)
    want = dd.dense_decode_ref(q, k[:, :, :77], v[:, :, :77])
    for fn in (dd.dense_decode_ref, dd.dense_decode_triton):
        assert_partial(fn(q, k, v, L), want, atol=1e-5, rtol=1e-5)


def test_dense_decode_splits_agree_with_one_split():
    """Split-K partials merged by log-sum-exp equal one pass over all keys."""
    q = _randn(1, 8, 1, 64, seed=7)
    k, v = _randn(1, 2, 300, 64, seed=8, scale=2.0), _randn(1, 2, 300, 64, seed=9)
    one = dd.dense_decode_triton(q, k, v, split=320)
    many = dd.dense_decode_triton(q, k, v, split=64)
    assert_partial(many, one, atol=1e-5, rtol=1e-5)


# --- KIVI pack --------------------------------------------------------------------------------
def _kv_with_edge_cases(H, n, D, G, bits, dtype, device, seed):
    """Keys with outlier channels, values, flat groups and exact half-step ties."""
    k = _randn(H, n, D, seed=seed, scale=2.0)
    k[..., :: max(D // 8, 1)] *= 8.0
    v = _randn(H, n, D, seed=seed + 1)
    k[0, :G, 3] = 1.25  # a flat key group (one channel, G tokens)
    v[0, 1, :G] = -0.5  # a flat value group
    levels = 2**bits - 1  # lo = 0, hi = levels: scale 1, so x = j + 0.5 is a tie
    tie = torch.arange(G, dtype=F32) % levels + 0.5
    tie[0], tie[1] = 0.0, float(levels)
    if n >= 2 * G:
        k[-1, G : 2 * G, 0] = tie
    if D >= 2 * G:
        v[-1, 0, G : 2 * G] = tie
    return k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)


@pytest.mark.parametrize("bits,G", [(2, 32), (2, 16), (4, 32)])
@pytest.mark.parametrize("dtype", [F16, F32])
def test_kivi_pack_ref_equals_kivi_quantize_pack(bits, G, dtype):
    k, v = _kv_with_edge_cases(2, 4 * G, 128, G, bits, dtype, "cpu", seed=10)
    got = kp.kivi_pack_ref(k, v, bits, G)
    kc, ks, kz = quantize(k.transpose(1, 2), bits, -1, G, dtype)
    vc, vs, vz = quantize(v, bits, -1, G, dtype)
    want = (pack(kc, bits), ks, kz, pack(vc, bits), vs, vz)
    public = (*kp.keys_by_channel(*got[:3]), *got[3:])  # the keys block-major, the same codes
    assert got[0].shape == (2, 4, 128, G * bits // 32) and got[1].shape == (2, 4, 128)
    for a, b in zip(public, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    by_group = kp.keys_by_group(*want[:3], G, bits)
    assert all(torch.equal(a, b) for a, b in zip(by_group, got[:3], strict=True))
    assert torch.equal(kp.unpack_codes(public[0], bits), kc.long())  # unpack inverts pack
    assert int(kp.pack_codes(torch.tensor([0, 1, 2, 3] * 4), 2)) == -454761244  # 0xE4E4E4E4


@pytest.mark.parametrize(
    "H,n,D,bits,G",
    [(2, 64, 64, 2, 32), (1, 32, 128, 4, 32), (3, 48, 64, 2, 16), (1, 96, 96, 4, 32)],
)
def test_kivi_pack_triton_is_bit_identical(device, H, n, D, bits, G):
    for dtype in _dtypes(device):
        k, v = _kv_with_edge_cases(H, n, D, G, bits, dtype, device, seed=11 + n)
        # a view with capacity beyond n, as KiviLayer's tail is
        kbuf, vbuf = torch.cat([k, k[:, :5]], 1), torch.cat([v, v[:, :5]], 1)
        got = kp.kivi_pack_triton(kbuf[:, :n], vbuf[:, :n], bits, G)
        ref = kp.kivi_pack_ref(k, v, bits, G)
        for a, b in zip(got, ref, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.cpu(), b.cpu()), (dtype, (a != b).sum())


def test_kivi_pack_rejects_bad_layout():
    k = torch.zeros(1, 40, 64)
    with pytest.raises(ValueError, match="group"):
        kp.kivi_pack_ref(k, k, 2, 32)  # 40 tokens are not whole groups
    with pytest.raises(ValueError, match="power-of-two"):
        kp.kivi_pack_triton(torch.zeros(1, 48, 96), torch.zeros(1, 48, 96), 2, 48)


# --- KIVI decode ------------------------------------------------------------------------------
def _body(H, Tb, D, bits, G, dtype, device, seed):
    """A packed body of Tb tokens as strided views, as KiviLayer.body() returns them: a longer
    block packed by kvrun.kv.stores.kivi, cut to its first Tb tokens (groups are independent)."""
    k, v = _kv_with_edge_cases(H, Tb + 2 * G, D, G, bits, dtype, device, seed)
    kc, ks, kz = quantize(k.transpose(1, 2), bits, -1, G, dtype)
    vc, vs, vz = quantize(v, bits, -1, G, dtype)
    full = (*kp.keys_by_group(pack(kc, bits), ks, kz, G, bits), pack(vc, bits), vs, vz)
    return _cut(full, Tb, bits, G), (k[:, :Tb], v[:, :Tb])


def _cut(body, Tb, bits, G):
    """The first Tb tokens of a body."""
    kq, ks, kz, vq, vs, vz = body
    return (kq[:, : Tb // G], ks[:, : Tb // G], kz[:, : Tb // G],
            vq[:, :Tb], vs[:, :Tb], vz[:, :Tb])  # fmt: skip


def naive_kivi(q, body, bits, G, causal_offset=None):
    """Dequantize the body with kvrun.kv.stores.kivi, then materialised fp64 attention."""
    kq, ks, kz, vq, vs, vz = body
    kq, ks, kz = kp.keys_by_channel(kq, ks, kz)
    k = dequantize(unpack(kq, bits), ks, kz, -1, G).transpose(1, 2)  # (Hkv, Tb, D)
    v = dequantize(unpack(vq, bits), vs, vz, -1, G)
    Tq, Tb = q.shape[2], k.shape[1]
    out, lse, _ = naive_attention(
        q.cpu(), k[None].cpu(), v[None].cpu(), visibility(1, Tq, Tb, None, causal_offset)
    )
    return out, lse


KIVI_CASES = [  # Hkv, g, Tq, Tb, D, bits, G, split, causal_offset
    (2, 4, 1, 32, 64, 2, 32, None, None),
    (1, 3, 1, 64, 128, 4, 32, None, None),  # one whole tile
    (2, 1, 2, 96, 64, 2, 16, 64, None),  # a split of 64 and a part tile
    (1, 4, 1, 192, 64, 4, 16, 128, None),  # split edge: 128 + 64
    (1, 4, 1, 128, 64, 2, 32, 64, None),  # exact multiple of the split
    (2, 2, 3, 64, 64, 2, 32, None, 61),  # causal: queries at slots 61..63
    (1, 2, 1, 64, 96, 2, 32, None, None),  # D padded to 128 in the kernel
]


@pytest.mark.parametrize("Hkv,g,Tq,Tb,D,bits,G,causal", [c[:7] + c[8:] for c in KIVI_CASES])
def test_kivi_decode_ref_matches_dequantize_then_attend(Hkv, g, Tq, Tb, D, bits, G, causal):
    body, (k, v) = _body(Hkv, Tb, D, bits, G, F32, "cpu", seed=20)
    q = _randn(1, Hkv * g, Tq, D, seed=21)
    out, lse = kd.kivi_decode_ref(q, *body, bits, G, causal)
    assert_partial((out, lse), naive_kivi(q, body, bits, G, causal), atol=1e-4, rtol=1e-4)
    # KiviLayer attends its body through this kernel: Tq own tokens at the end of the body
    # are causal_offset = Tb - Tq, older slots (n_new = 0) are all visible
    layer = KiviLayer(Hkv, D, bits, G, G, F32, "cpu")
    layer.append(k, v)
    layer.flush(G)
    assert causal is None or causal == Tb - Tq
    p = layer._attend_body(q, 0 if causal is None else Tq)
    assert torch.equal(p.out, out) and torch.equal(p.lse, lse)


@pytest.mark.parametrize("Hkv,g,Tq,Tb,D,bits,G,split,causal", KIVI_CASES)
def test_kivi_decode_triton_matches_ref(device, Hkv, g, Tq, Tb, D, bits, G, split, causal):
    for i, dtype in enumerate(_dtypes(device)):
        if i and device == "cpu" and Tb not in (96, 192):  # interpreter time: a few shapes
            continue
        body, _ = _body(Hkv, Tb, D, bits, G, dtype, device, seed=22)
        q = _randn(1, Hkv * g, Tq, D, seed=23, dtype=dtype, device=device)
        got = kd.kivi_decode_triton(q, *body, bits, G, causal, split=split)
        ref = kd.kivi_decode_ref(q, *body, bits, G, causal)
        assert got[0].dtype == got[1].dtype == F32
        assert_partial(got, ref, **_tol(dtype))


def test_kivi_decode_empty_body(device):
    body, _ = _body(2, 32, 64, 2, 32, F32, device, seed=24)
    empty = _cut(body, 0, 2, 32)
    q = _randn(1, 8, 1, 64, seed=25, device=device)
    for fn in (kd.kivi_decode_ref, kd.kivi_decode_triton):
        out, lse = fn(q, *empty, 2, 32)
        assert out.shape == (1, 8, 1, 64) and bool((out == 0).all())
        assert bool((lse == NEG).all())


# --- column sums (MiniKV) ---------------------------------------------------------------------
def naive_colsum(q, k, v, per_head):
    Hq, Tq, _ = q.shape[1:]
    Hkv, T = k.shape[1], k.shape[2]
    out, lse, p = naive_attention(q, k, v, visibility(1, Tq, T, None, T - Tq))
    col = p[0].sum(1)  # (Hq, T)
    col = col if per_head else col.view(Hkv, Hq // Hkv, T).sum(1)
    return out, lse[0], col


@pytest.mark.parametrize(
    "Hkv,g,Tq,T,per_head",
    [
        (2, 4, 300, 300, False),  # two reference blocks of 256 rows
        (1, 3, 17, 600, True),
        (2, 1, 1, 5, False),
        (1, 1, 1000, 1000, False),
        (1, 4, 260, 4097, True),  # a late chunk of a long prompt
    ],
)
def test_colsum_ref_matches_naive(Hkv, g, Tq, T, per_head):
    q = _randn(1, Hkv * g, Tq, 64, seed=30)
    k, v = _randn(1, Hkv, T, 64, seed=31, scale=2.0), _randn(1, Hkv, T, 64, seed=32)
    got = cs.colsum_ref(q, k, v, per_head)
    assert_partial(got, naive_colsum(q, k, v, per_head), atol=1e-5, rtol=1e-4)


COLSUM_CASES = [  # Hkv, g, Tq, T, D, per_head
    (1, 4, 1, 1, 64, False),
    (2, 1, 15, 15, 64, False),
    (1, 4, 17, 17, 128, True),
    (2, 3, 64, 64, 64, False),  # one tile exactly
    (1, 4, 65, 65, 64, True),
    (1, 3, 100, 100, 64, False),
    (1, 2, 40, 129, 128, False),  # a chunk: queries at slots 89..128
    (1, 1, 63, 127, 64, True),
    (1, 2, 128, 133, 64, False),  # rows 59..63 of query block 0 reach key block 1
    (1, 1, 1000, 1000, 64, False),
]


@pytest.mark.parametrize("Hkv,g,Tq,T,D,per_head", COLSUM_CASES)
def test_colsum_triton_matches_ref(device, Hkv, g, Tq, T, D, per_head):
    for i, dtype in enumerate(_dtypes(device)):
        if i and device == "cpu" and T not in (17, 100, 129):  # interpreter time: a few shapes
            continue
        q = _randn(1, Hkv * g, Tq, D, seed=33, dtype=dtype, device=device)
        k = _randn(1, Hkv, T, D, seed=34, dtype=dtype, device=device, scale=2.0)
        v = _randn(1, Hkv, T, D, seed=35, dtype=dtype, device=device)
        got = cs.colsum_triton(q, k, v, per_head)
        ref = cs.colsum_ref(q, k, v, per_head)
        assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in ref]
        tol = _tol(dtype) if dtype != F32 else dict(atol=1e-5, rtol=1e-4)
        assert_partial(got, ref, **tol)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_colsum_with_keys_held_elsewhere(device, impl):
    """With other_lse (earlier turns' keys, all visible), out/lse cover these keys only and
    the column sums are those of one softmax over both segments."""
    fn = cs.colsum_ref if impl == "ref" else cs.colsum_triton
    Hkv, g, To, Tq, T, D = 2, 2, 70, 30, 100, 64
    q = _randn(1, Hkv * g, Tq, D, seed=45, device=device)
    ko, vo = (
        _randn(1, Hkv, To, D, seed=46, device=device),
        _randn(1, Hkv, To, D, seed=47, device=device),
    )
    k, v = (
        _randn(1, Hkv, T, D, seed=48, device=device),
        _randn(1, Hkv, T, D, seed=49, device=device),
    )
    _, other, _ = naive_attention(q.cpu(), ko.cpu(), vo.cpu(), visibility(1, Tq, To))
    vis = torch.cat(
        [torch.ones(1, Tq, To, dtype=torch.bool), visibility(1, Tq, T, None, T - Tq)], -1
    )
    _, _, p = naive_attention(
        q.cpu(), torch.cat([ko, k], 2).cpu(), torch.cat([vo, v], 2).cpu(), vis
    )
    own_out, own_lse, _ = naive_attention(
        q.cpu(), k.cpu(), v.cpu(), visibility(1, Tq, T, None, T - Tq)
    )
    out, lse, col = fn(q, k, v, True, other.float().to(device))
    want = p[0, :, :, To:].sum(1)  # (Hq, T)
    assert_partial((out, lse, col), (own_out, own_lse[0], want), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_colsum_invariants(device, impl):
    """Sum over keys = g * Tq per KV head; the last key's sum is the last row's own
    probability; the output equals causal SDPA; the sums are deterministic."""
    fn = cs.colsum_ref if impl == "ref" else cs.colsum_triton
    Hkv, g, T, D = 2, 3, 90, 64
    q = _randn(1, Hkv * g, T, D, seed=36, device=device)
    k, v = (
        _randn(1, Hkv, T, D, seed=37, device=device),
        _randn(1, Hkv, T, D, seed=38, device=device),
    )
    out, lse, col = fn(q, k, v)
    torch.testing.assert_close(
        col.sum(-1).cpu(), torch.full((Hkv,), float(g * T)), rtol=1e-3, atol=0
    )
    _, _, per = fn(q, k, v, per_head=True)
    torch.testing.assert_close(per.view(Hkv, g, T).sum(1), col, rtol=1e-6, atol=1e-6)
    kk = k.repeat_interleave(g, dim=1)
    s_last = (q[0, :, -1] * kk[0, :, -1]).sum(-1) / math.sqrt(D)  # (Hq,) own-token score
    torch.testing.assert_close(per[:, -1], torch.exp(s_last - lse[:, -1]), rtol=1e-5, atol=1e-6)
    sdpa = F.scaled_dot_product_attention(q, kk, v.repeat_interleave(g, dim=1), is_causal=True)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)
    assert torch.equal(fn(q, k, v)[2], col)


# --- dispatchers ------------------------------------------------------------------------------
def _boom(*a, **k):
    raise AssertionError("the other implementation was called")


def test_dispatch_follows_kvrun_kernels(monkeypatch):
    q, k = _randn(1, 4, 1, 64, seed=40), _randn(1, 2, 16, 64, seed=41)
    real_ref = dd.dense_decode_ref
    monkeypatch.setenv("KVRUN_KERNELS", "torch")
    monkeypatch.setattr(dd, "dense_decode_triton", _boom)
    monkeypatch.setattr(cs, "colsum_triton", _boom)
    dd.dense_decode(q, k, k)
    cs.colsum(q, k, k)
    monkeypatch.setenv("KVRUN_KERNELS", "auto")  # CPU tensors: the reference
    assert K.use_triton(q, k) is (K.HAVE_TRITON and q.is_cuda)
    monkeypatch.undo()
    monkeypatch.setenv("KVRUN_KERNELS", "triton")  # forced: Triton (interpreted on CPU)
    monkeypatch.setattr(dd, "dense_decode_ref", _boom)
    monkeypatch.setattr(kd, "kivi_decode_ref", _boom)
    monkeypatch.setattr(kp, "kivi_pack_ref", _boom)
    dd.dense_decode(q, k, k)
    kk, vv = _randn(2, 32, 64, seed=42), _randn(2, 32, 64, seed=43)
    body = kp.kivi_pack(kk, vv, 2, 32)
    kd.kivi_decode(q, *body, 2, 32)
    monkeypatch.setattr(dd, "dense_decode_ref", real_ref)
    monkeypatch.setattr(dd, "dense_decode_triton", _boom)
    many = _randn(1, 4, 80, 64, seed=44)  # 160 query rows per KV head: prefill, not decode
    out, _ = dd.dense_decode(many, k, k)  # the reference, despite KVRUN_KERNELS=triton
    assert out.shape == many.shape
    monkeypatch.setenv("KVRUN_KERNELS", "fast")
    with pytest.raises(KvrunError, match="auto, torch or triton"):
        dd.dense_decode(q, k, k)
    monkeypatch.setattr(K, "triton", None)
    monkeypatch.setenv("KVRUN_KERNELS", "triton")
    with pytest.raises(KvrunError, match="not installed"):
        K.use_triton(q)
    monkeypatch.setenv("KVRUN_KERNELS", "auto")
    assert K.use_triton(q) is False


@pytest.mark.slow  # a subprocess
def test_import_and_references_without_triton():
    """kvrun.kernels imports and every dispatcher answers from its reference with no triton."""
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("blocked")
sys.meta_path.insert(0, Block())
import torch
from kvrun.kernels import HAVE_TRITON, colsum, dense_decode, kivi_decode, kivi_pack
assert not HAVE_TRITON
q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 32, 64)
dense_decode.dense_decode(q, k, k)
body = kivi_pack.kivi_pack(k[0], k[0], 2, 32)
kivi_decode.kivi_decode(q, *body, 2, 32)
colsum.colsum(q, k, k)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "KVRUN_KERNELS"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
