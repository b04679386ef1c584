"""KIVI store (baselines.md section 5): quantizer, bit packing, layout, flushing, attention, bytes."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from kv_helpers import pack, quantize

from kvrun.kernels.kivi_pack import keys_by_channel
from kvrun.kv.attention import combine, segment_attention
from kvrun.kv.stores.kivi import KiviLayer, dequantize, unpack

F16, F32 = torch.float16, torch.float32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kv(H: int, T: int, D: int, dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys with a few outlier channels (as KIVI observes) and random values."""
    g = _gen(seed)
    k = torch.randn(H, T, D, generator=g)
    k[..., :: max(D // 4, 1)] *= 8.0
    return k.to(dtype), torch.randn(H, T, D, generator=g).to(dtype)


# --- quantizer ------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [F16, F32])
def test_round_trip_error_bound(bits, dtype):
    G = 32
    x = (torch.randn(3, 64, 256, generator=_gen(bits)) * 4 + 1).to(dtype)  # (H, D, T)
    codes, scale, zero = quantize(x, bits, -1, G, dtype)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scale.shape == zero.shape == (3, 64, 256 // G) and scale.dtype == zero.dtype == dtype
    assert int(codes.min()) >= 0 and int(codes.max()) <= 2**bits - 1
    x_hat = dequantize(codes, scale, zero, -1, G)
    s = scale.float().repeat_interleave(G, -1)
    z = zero.float().repeat_interleave(G, -1)
    err = (x.float() - x_hat).abs()
    if dtype == F16:
        bound = s / 2 + 2**-10 * (z.abs() + (2**bits - 1) * s)
    else:
        bound = s / 2 * (1 + 1e-5) + 1e-6 * (z.abs() + (2**bits - 1) * s)
    assert bool((err <= bound).all()), float((err - bound).max())


def test_quantize_along_other_dim_matches_last():
    x = torch.randn(2, 64, 48, generator=_gen(3)).to(F16)  # (H, T, D), groups along T
    c1, s1, z1 = quantize(x, 2, 1, 16, F16)
    c2, s2, z2 = quantize(x.transpose(1, 2), 2, -1, 16, F16)
    assert s1.shape == (2, 4, 48)
    assert torch.equal(c1, c2.transpose(1, 2)) and torch.equal(s1, s2.transpose(1, 2))
    assert torch.equal(z1, z2.transpose(1, 2))


@pytest.mark.parametrize("dtype", [F16, F32])
def test_flat_group_is_exact(dtype):
    x = torch.randn(2, 96, generator=_gen(4)).to(dtype)
    x[0, :32] = 1.7
    x[1, 32:64] = 0.0
    codes, scale, zero = quantize(x, 2, -1, 32, dtype)
    x_hat = dequantize(codes, scale, zero, -1, 32)
    assert not torch.isnan(x_hat).any()
    assert torch.equal(x_hat[0, :32], x[0, :32].float())
    assert torch.equal(x_hat[1, 32:64], x[1, 32:64].float())
    assert int(codes[0, :32].max()) == 0 and int(codes[1, 32:64].max()) == 0


# --- packing --------------------------------------------------------------------------
def test_pack_golden_words():
    two = pack(torch.tensor([0, 1, 2, 3] * 4, dtype=torch.uint8), 2)
    assert two.dtype == torch.int32 and two.tolist() == [-454761244]  # 0xE4E4E4E4
    four = pack(torch.arange(8, dtype=torch.uint8), 4)
    assert four.tolist() == [0x76543210]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_unpack_inverts_pack(bits):
    c = torch.randint(0, 2**bits, (3, 5, 64), generator=_gen(bits), dtype=torch.int64).to(
        torch.uint8
    )
    words = pack(c, bits)
    assert words.shape == (3, 5, 64 * bits // 32)
    assert torch.equal(unpack(words, bits), c)


# --- layout and flushing --------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_layout_shapes_and_contents(bits):
    H, D, G, R = 3, 64, 32, 128
    layer = KiviLayer(H, D, bits, G, R, F16, "cpu")
    k, v = _kv(H, 300, D, F16, seed=5)
    layer.append(k, v)
    assert layer.flush(R) == 256 and (layer.body_len, layer.tail_len, layer.length) == (
        256,
        44,
        300,
    )
    kq, ks, kz, vq, vs, vz = layer.body()
    assert kq.shape == (H, 256 // G, D, G * bits // 32) and kq.dtype == torch.int32
    assert ks.shape == kz.shape == (H, 256 // G, D) and ks.dtype == F16
    kq, ks, kz = keys_by_channel(kq, ks, kz)  # block-major: the public layout's codes
    assert vq.shape == (H, 256, D * bits // 32) and vq.dtype == torch.int32
    assert vs.shape == vz.shape == (H, 256, D // G) and vs.dtype == F16
    # keys quantized per channel along tokens, values per token along channels
    kc, ks2, kz2 = quantize(k[:, :256].transpose(1, 2), bits, -1, G, F16)
    vc, vs2, vz2 = quantize(v[:, :256], bits, -1, G, F16)
    assert torch.equal(kq, pack(kc, bits)) and torch.equal(ks, ks2) and torch.equal(kz, kz2)
    assert torch.equal(vq, pack(vc, bits)) and torch.equal(vs, vs2) and torch.equal(vz, vz2)
    tk, tv = layer.tail()
    assert torch.equal(tk, k[:, 256:]) and torch.equal(tv, v[:, 256:])
    K, V = layer.dequantized()
    assert K.shape == V.shape == (H, 300, D) and K.dtype == F32
    assert torch.equal(K[:, 256:], k[:, 256:].float())


def test_flushes_concatenate_along_tokens():
    k, v = _kv(2, 160, 32, F16, seed=6)
    one, two = (KiviLayer(2, 32, 2, 16, 32, F16, "cpu") for _ in range(2))
    one.append(k, v)
    one.flush(32)  # all 160 at once
    two.append(k[:, :70], v[:, :70])
    two.flush(32)  # 64, then the other 96 after the second append
    two.append(k[:, 70:], v[:, 70:])
    two.flush(16)
    assert one.body_len == two.body_len == 160 and one.tail_len == two.tail_len == 0
    for a, b in zip(one.body(), two.body(), strict=True):
        assert torch.equal(a, b)


def _check_invariants(layer: KiviLayer) -> None:
    kq, ks, _, vq, vs, _ = layer.body()
    Tq, G = layer.body_len, layer.G
    assert 0 <= layer.tail_len < layer.R and Tq % G == 0
    assert kq.shape[1] * G == Tq == vq.shape[1] == vs.shape[1] == ks.shape[1] * G


def test_tr_sequence_unit_g():
    """Spec example: n_p = 1000, U = G = 16, R = 128; Tr = (n_p mod G + n_gen) mod R."""
    H, D, G, R, n_p = 1, 16, 16, 128, 1000
    layer = KiviLayer(H, D, 2, G, R, F32, "cpu")
    k, v = _kv(H, n_p + 130, D, F32, seed=7)
    layer.append(k[:, :n_p], v[:, :n_p])
    layer.flush(G)
    assert layer.tail_len == 8
    _check_invariants(layer)
    for step in range(1, 130):
        t = n_p + step - 1
        layer.append(k[:, t : t + 1], v[:, t : t + 1])
        if layer.tail_len == R:
            assert layer.flush(R) == R
        _check_invariants(layer)
        assert layer.tail_len == (n_p % G + step) % R
        if step == 119:
            assert layer.tail_len == 127
        if step == 120:
            assert layer.tail_len == 0
    assert layer.length == n_p + 129


def test_chunked_prefill_unit_r():
    H, D, G, R = 1, 32, 32, 128
    layer = KiviLayer(H, D, 2, G, R, F32, "cpu")
    k, v = _kv(H, 1200, D, F32, seed=8)
    for start in range(0, 1200, 300):
        layer.append(k[:, start : start + 300], v[:, start : start + 300])
        layer.flush(R)
        n = start + 300
        assert layer.body_len == R * (n // R) and layer.tail_len == n % R
        _check_invariants(layer)


def test_short_prompt_unit_r_is_full_attention():
    """With U = R and n < R nothing is quantized, and attention equals full attention."""
    H, D, Tn = 2, 32, 100
    layer = KiviLayer(H, D, 2, 32, 128, F32, "cpu")
    k, v = _kv(H, Tn, D, F32, seed=9)
    layer.append(k, v)
    q = torch.randn(1, 2 * H, Tn, D, generator=_gen(10))
    parts = layer.partials(q, None, Tn, None)
    assert layer.flush(128) == 0 and layer.body_len == 0
    causal = torch.ones(Tn, Tn, dtype=torch.bool).tril()
    ref = segment_attention(q, k[None], v[None], causal)
    assert len(parts) == 1 and torch.equal(combine(parts, F32), ref.out)


# --- attention --------------------------------------------------------------------------
def _reference(layer: KiviLayer, q: torch.Tensor, n_new: int):
    """Dense attention over dequantized() K, V with the own tokens causal."""
    K, V = layer.dequantized()
    Tq, n = q.shape[2], layer.length
    j = torch.arange(n) - (n - n_new)
    mask = j[None, :] <= torch.arange(Tq)[:, None] if n_new else None
    return segment_attention(q, K[None], V[None], mask)


def _check_attend(layer: KiviLayer, q: torch.Tensor, n_new: int, dtype) -> None:
    parts = layer.partials(q, None, n_new, None)
    assert len(parts) == (2 if layer.body_len else 1)
    ref = _reference(layer, q, n_new)
    out = combine(parts, F32)
    lse = torch.logsumexp(torch.stack([p.lse for p in parts]), 0)
    rtol, atol = (1e-5, 1e-5) if dtype == F32 else (1e-3, 1e-3)
    torch.testing.assert_close(out, ref.out, rtol=rtol, atol=atol)
    torch.testing.assert_close(lse, ref.lse, rtol=rtol, atol=atol)
    if layer.body_len:  # the fused body segment alone equals dequantize-then-attend
        K, V = layer.dequantized()
        Tb, own0 = layer.body_len, layer.length - n_new
        j = torch.arange(Tb) - own0
        mask = j[None, :] <= torch.arange(q.shape[2])[:, None] if n_new and Tb > own0 else None
        body = segment_attention(q, K[None, :, :Tb], V[None, :, :Tb], mask)
        torch.testing.assert_close(parts[0].out, body.out, rtol=rtol, atol=atol)
        torch.testing.assert_close(parts[0].lse, body.lse, rtol=rtol, atol=atol)


@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_attend_matches_dense_over_dequantized(gqa, dtype):
    H, D, G, R = 2, 32, 16, 32
    Hq = H * gqa
    layer = KiviLayer(H, D, 2, G, R, dtype, "cpu")
    k, v = _kv(H, 400, D, dtype, seed=11 + gqa)
    qs = torch.randn(1, Hq, 400, D, generator=_gen(12)).to(dtype)
    # empty body: a first prefill chunk of odd length
    layer.append(k[:, :83], v[:, :83])
    _check_attend(layer, qs[:, :, :83], 83, dtype)
    layer.flush(R)  # body 64, tail 19
    # a second odd chunk sees the first through the body
    layer.append(k[:, 83:120], v[:, 83:120])
    _check_attend(layer, qs[:, :, 83:120], 37, dtype)
    layer.flush(G)
    assert (layer.body_len, layer.tail_len) == (112, 8)
    t, empty_tail_seen = 120, False
    while t < 190:  # decode, flushing whenever the tail reaches R
        layer.append(k[:, t : t + 1], v[:, t : t + 1])
        _check_attend(layer, qs[:, :, t : t + 1], 1, dtype)
        if layer.tail_len == R:
            layer.flush(R)
            empty_tail_seen = True  # the next query sees a body and an empty tail
            parts = layer.partials(qs[:, :, t + 1 : t + 2], None, 0, None)
            assert len(parts) == 2 and bool(torch.isneginf(parts[1].lse).all())
            _check_attend(layer, qs[:, :, t + 1 : t + 2], 0, dtype)
        t += 1
    assert empty_tail_seen


def test_own_tokens_in_body_are_causal():
    """Flush-before-attention (MiniKV order): the chunk's own tokens may sit in the body."""
    H, D = 1, 32
    layer = KiviLayer(H, D, 4, 16, 32, F32, "cpu")
    k, v = _kv(H, 90, D, F32, seed=13)
    layer.append(k[:, :40], v[:, :40])
    layer.flush(16)
    layer.append(k[:, 40:], v[:, 40:])
    layer.flush(16)  # body 80 (own tokens 40..79 among them), tail 10
    q = torch.randn(1, 4, 50, D, generator=_gen(14))
    _check_attend(layer, q, 50, F32)


def test_attend_rejects_bad_n_new():
    layer = KiviLayer(1, 32, 2, 16, 32, F32, "cpu")
    layer.append(*_kv(1, 5, 32, F32, seed=15))
    with pytest.raises(ValueError, match="n_new"):
        layer.partials(torch.randn(1, 1, 3, 32), None, 2, None)


# --- bytes ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [F16, F32])
def test_nbytes_formula(bits, dtype):
    H, D, G, R = 3, 64, 32, 128
    e = torch.empty(0, dtype=dtype).element_size()
    layer = KiviLayer(H, D, bits, G, R, dtype, "cpu")
    k, v = _kv(H, 700, D, dtype, seed=16)
    assert layer.nbytes() == 0
    t = 0
    for chunk, unit in [(50, R), (200, R), (90, G), (300, R), (60, G)]:
        layer.append(k[:, t : t + chunk], v[:, t : t + chunk])
        t += chunk
        layer.flush(unit)
        Tq, Tr = layer.body_len, layer.tail_len
        want = H * D * (Tq * (Fraction(bits, 4) + Fraction(4 * e, G)) + 2 * e * Tr)
        assert layer.nbytes() == want, (Tq, Tr)
    assert layer.body_len > 0 and layer.tail_len > 0


def test_default_model_bytes_per_token():
    """SmolLM2-135M (L=30, Hkv=3, D=64), kivi2 G=32: 4.2 KiB per token vs 22.5 KiB full."""
    L, H, D = 30, 3, 64
    layer = KiviLayer(H, D, 2, 32, 128, F16, "cpu")
    layer.append(*_kv(H, 512, D, F16, seed=17))
    layer.flush(128)
    assert layer.tail_len == 0
    per_token = L * layer.nbytes() // layer.body_len
    assert per_token == 4320 and round(per_token / 1024, 1) == 4.2
    assert 2 * L * H * D * 2 / 1024 == 22.5


# --- validation -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "word"),
    [
        ((64, 2, 32, 100), "residual"),  # R % G
        ((64, 2, 8, 128), "group"),  # G % (32/b)
        ((48, 2, 32, 128), "head_dim"),  # D % G
        ((64, 3, 32, 128), "bits"),
    ],
)
def test_rejects_bad_options(args, word):
    D, bits, G, R = args
    with pytest.raises(ValueError, match=word):
        KiviLayer(2, D, bits, G, R, F16, "cpu")
    layer = KiviLayer(2, 64, 2, 32, 128, F16, "cpu")
    with pytest.raises(ValueError, match="unit"):
        layer.flush(48)
