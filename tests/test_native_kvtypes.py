"""--kv-dtype's rows on the native kernels (kernels/cpu/kvrows.h, qops.cpp kv_encode, kv_decode,
attn_typed, rope_append_attend) against what they must equal: llama.cpp's q8_0 / q4_0 blocks as
gguf.quants writes and reads them, torch's f16 / bf16 casts, kvrun's torch fallbacks
(kvrun.kv.stores.kvtypes), and attention over the same rows decoded to float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from native_attention import HEADS, LENGTHS, isa, needs_native, ops, threads  # noqa: F401

from kvrun.kv.attention import segment_attention
from kvrun.kv.stores.kvtypes import TYPES

pytestmark = needs_native
GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
TOL = {"atol": 2e-6, "rtol": 1e-5}


def rows(shape, seed: int) -> torch.Tensor:
    """Keys as a model makes them: mostly small, a few large channels, exact zeros, ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., :3] *= 4  # outlier channels (a score stays moderate: the tolerance is float32's)
    x[..., 5] = 0
    if x.shape[-1] >= 64:
        x[..., 32:64] = 0  # a block of zeros: scale 0
        x[..., 40] = 0.5  # a tie at a half step
    return x


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("D", [32, 64, 128, 256])
def test_blocks_are_gguf_quants_bytes(name, D, isa):  # noqa: F811
    """kv_encode writes the bytes gguf.quants.quantize writes; kv_decode reads them as
    gguf.quants.dequantize; the torch fallback is bit for bit the same both ways."""
    x = rows((3, 17, D), D)
    t = TYPES[name]
    got = ops.kv_encode(x, t.code)
    want = quants.quantize(x.numpy(), GGML[name])
    assert np.array_equal(got.numpy(), want)
    assert torch.equal(t.encode(x), got)  # the torch fallback
    back = ops.kv_decode(got, t.code, D)
    assert np.array_equal(back.numpy(), quants.dequantize(want, GGML[name]))
    assert torch.equal(t.decode(got, D), back)


@pytest.mark.parametrize("name", ["f16", "bf16"])
def test_float_rows_are_torch_casts(name, isa):  # noqa: F811
    x = rows((2, 9, 64), 7)
    t = TYPES[name]
    got = ops.kv_encode(x, t.code)
    assert got.dtype == t.storage and torch.equal(got, x.to(t.storage))
    assert torch.equal(ops.kv_decode(got, t.code, 64), x.to(t.storage).float())


@pytest.mark.parametrize("name", ["f16", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("T", [0, *LENGTHS])
def test_attn_typed_is_attention_over_the_decoded_rows(name, Hq, Hkv, D, T, isa, threads):  # noqa: F811
    """The stored rows read in the kernel's loads (f16) or a tile at a time (bf16, q8_0,
    q4_0) give the attention of the torch path over the same rows decoded to float32, for one
    query row and a chunk's rows."""
    t = TYPES[name]
    for Tq in (1, 3):
        g = torch.Generator().manual_seed(Hq * 100 + T + Tq)
        q = torch.randn(1, Hq, Tq, D, generator=g)
        k, v = rows((1, Hkv, T, D), T), torch.randn(1, Hkv, T, D, generator=g)
        kt, vt = ops.kv_encode(k, t.code), ops.kv_encode(v, t.code)
        out, lse = ops.attn_typed(q, kt, vt, D**-0.5, t.code)
        ref = segment_attention(q, ops.kv_decode(kt, t.code, D), ops.kv_decode(vt, t.code, D))
        torch.testing.assert_close(out, ref.out, **TOL)
        torch.testing.assert_close(lse, ref.lse, **TOL)


@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("n", [0, 7, 300])
def test_rope_append_attend_stores_the_encoded_rotated_row(name, n, isa):  # noqa: F811
    """The fused decode row writes slot n as kv_encode(rope(k)) and kv_encode(v), touches no
    other slot, and attends as attn_typed over slots 0..n."""
    Hq, Hkv, D, code = 6, 2, 64, TYPES[name].code
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, h, 1, D, generator=g) for h in (Hq, Hkv, Hkv))
    enc = (lambda x: x) if code == 0 else (lambda x: ops.kv_encode(x, code))
    kb, vb = enc(rows((1, Hkv, n + 4, D), 3)), enc(rows((1, Hkv, n + 4, D), 4))
    before = kb.clone(), vb.clone()
    cos, ssin = torch.randn(n + 5, D, generator=g), torch.randn(n + 5, D, generator=g)
    out = ops.rope_append_attend(q, k, v, cos, ssin, n + 2, kb, vb, n, D**-0.5, code)
    c, s = cos[n + 2][None, None], ssin[n + 2][None, None]
    assert torch.equal(kb[:, :, n : n + 1], enc(ops.rope(k, c, s)))
    assert torch.equal(vb[:, :, n : n + 1], enc(v))
    others = [i for i in range(n + 4) if i != n]
    assert torch.equal(kb[:, :, others], before[0][:, :, others])
    assert torch.equal(vb[:, :, others], before[1][:, :, others])
    want, _ = ops.attn_typed(ops.rope(q, c, s), kb[:, :, : n + 1], vb[:, :, : n + 1], D**-0.5, code)
    torch.testing.assert_close(out, want, **TOL)


def test_bad_rows_are_refused():
    q, k = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 5, 64)
    with pytest.raises(RuntimeError, match="do not match"):
        ops.attn_typed(q, ops.kv_encode(k, 8)[..., :-1], ops.kv_encode(k, 8)[..., :-1], 0.1, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.kv_encode(torch.randn(2, 48), 2)
