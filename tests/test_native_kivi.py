"""The KIVI store's native kernels (kernels/cpu/kivi_attn.h, kivi_ops.h) against the torch path:
the flush bit for bit (kivi_pack_ref), body attention (kivi_decode_ref) for one query row and a
prefill chunk's, the tail and its causal rows, the fused decode row, and greedy generation."""

from __future__ import annotations

import pytest
import torch
from native_attention import HEADS, LENGTHS, isa, needs_native, ops, threads  # noqa: F401

from kvrun.kernels.kivi_decode import kivi_decode_ref
from kvrun.kernels.kivi_pack import kivi_pack_ref
from kvrun.kv.attention import combine
from kvrun.kv.stores.kivi import KiviLayer

pytestmark = needs_native
F32, F16 = torch.float32, torch.float16


def _kv(H: int, T: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with outlier channels (as KIVI observes), values, and a few flat groups."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(H, T, D, generator=g)
    k[..., :: max(D // 4, 1)] *= 8.0
    v = torch.randn(H, T, D, generator=g)
    if T >= 32:
        k[:, :32, 0] = 1.25  # a flat key group (scale 0)
        v[:, 3, :32] = -0.5  # a flat value group
    return k, v


def _whole(T: int, G: int) -> int:
    return max(G, -(-T // G) * G)


def _merged(parts) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logsumexp(torch.stack([p.lse for p in parts]), 0)
    return combine(parts, F32), lse


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("G", [32, 64])
@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("half", [False, True])
def test_pack_is_bit_exact(bits, G, Hq, Hkv, D, half, threads):  # noqa: F811
    """The flush, scales and zeros float32 or float16 (--kv-dtype f16: rounded first, the
    codes from the rounded values)."""
    T = _whole(LENGTHS[-1], G)
    k, v = _kv(Hkv, T, D, bits * 100 + G)
    view_k = torch.cat([k, k], 1)[:, :T]  # a tail buffer's view: rows strided by its room
    want = kivi_pack_ref(k, v, bits, G, F16 if half else None)
    for got, ref in zip(ops.kivi_pack(view_k, v, bits, G, half), want, strict=True):
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    assert want[1].dtype == (F16 if half else F32) and want[4].dtype == want[1].dtype


def _body(Hkv: int, T: int, D: int, bits: int, G: int, seed: int):
    k, v = _kv(Hkv, T, D, seed)
    return kivi_pack_ref(k, v, bits, G)


def _room(body, Tb: int):
    """The body as KiviLayer's buffers hold it: each with room beyond its Tb tokens."""
    kc, ks, kz, vc, vs, vz = body
    grow = [(kc, 1), (ks, 1), (kz, 1), (vc, 1), (vs, 1), (vz, 1)]
    return [torch.cat([t, torch.full_like(t, 7)], d) for t, d in grow]


@pytest.mark.parametrize("bits,G", [(2, 32), (4, 64)])
@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("Tq", [1, 5])
def test_body_matches_reference(bits, G, Hq, Hkv, D, T, Tq, isa, threads):  # noqa: F811
    Tb = _whole(T, G)
    body = _body(Hkv, Tb, D, bits, G, T + D)
    q = torch.randn(1, Hq, Tq, D, generator=torch.Generator().manual_seed(T))
    empty = torch.empty(Hkv, 0, D)
    out, lse = ops.kivi_attn(q, *_room(body, Tb), Tb, empty, empty, 0, bits, G, 0, D**-0.5)
    ref_out, ref_lse = kivi_decode_ref(q, *body, bits, G)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("bits,G", [(1, 32), (2, 64), (4, 32), (8, 32), (4, 16), (2, 16)])
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("sdt", [F32, F16])
def test_body_other_layouts(bits, G, Hq, Hkv, D, sdt, isa):  # noqa: F811
    """Every layout, scales and zeros float32 or float16: attention and the dequantized body."""
    Tb = 320
    k, v = (x.to(sdt).float() for x in _kv(Hkv, Tb, D, bits))  # as an f16 store's tail holds them
    body = kivi_pack_ref(k, v, bits, G, sdt)
    q = torch.randn(1, Hq, 1, D, generator=torch.Generator().manual_seed(bits))
    empty = torch.empty(Hkv, 0, D)
    out, lse = ops.kivi_attn(q, *body, Tb, empty, empty, 0, bits, G, 0, D**-0.5)
    ref_out, ref_lse = kivi_decode_ref(q, *body, bits, G)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)
    kd, vd = ops.kivi_dequant(*body, bits, G, 0, Tb)
    layer = KiviLayer(Hkv, D, bits, G, Tb, F32, "cpu", None, sdt)
    layer.append(k, v)
    layer.flush(Tb)
    ref_k, ref_v = layer.dequantized()  # the torch path's
    assert kd.dtype == F32 and torch.equal(kd[0], ref_k) and torch.equal(vd[0], ref_v)


def _layers(
    Hkv: int, D: int, bits: int, G: int, R: int, before: int, new: int, seed: int, sdt=None
):
    """The same store twice, native kernels and torch path: `before` tokens appended and
    flushed by R, then `new` more appended (a chunk's own tokens, or a decode row's); scales
    and zeros in sdt (default float32)."""
    native = KiviLayer(Hkv, D, bits, G, R, F32, "cpu", ops, sdt)
    torch_path = KiviLayer(Hkv, D, bits, G, R, F32, "cpu", None, sdt)
    k, v = _kv(Hkv, before + new, D, seed)
    for layer in (native, torch_path):
        layer.append(k[:, :before], v[:, :before])
        layer.flush(R)
        layer.append(k[:, before:], v[:, before:])
    return native, torch_path


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize(
    "before,Tq", [(0, 1), (300, 1), (1027, 1), (250, 7), (1027, 64), (0, 200), (700, 300)]
)
@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("sdt", [F32, F16])
def test_store_partials_match_torch(Hq, Hkv, D, before, Tq, own, sdt, threads):  # noqa: F811
    """Body and tail merged in one call (few rows) or through flash attention (many): the
    chunk's own tokens causal in the tail, or every slot seen (n_new 0)."""
    G = 64 if D >= 64 else 32
    native, torch_path = _layers(Hkv, D, 2, G, 128, before, Tq, before + Tq, sdt)
    q = torch.randn(1, Hq, Tq, D, generator=torch.Generator().manual_seed(Tq))
    n_new = Tq if own else 0
    out, lse = _merged(native.partials(q, None, n_new, None))
    ref_out, ref_lse = _merged(torch_path.partials(q, None, n_new, None))
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("Tq,new", [(1, 32), (3, 34), (100, 128)])
def test_own_tokens_in_the_body(Tq, new, isa):  # noqa: F811
    """A flush before attending (MiniKV) puts a query's own tokens in the body: each sees the
    body up to itself (kivi_decode's causal offset), natively too."""
    Hq, Hkv, D, G = 6, 3, 64, 32
    native, torch_path = _layers(Hkv, D, 2, G, 32, 64, new, 5)
    for layer in (native, torch_path):
        layer.flush(32)  # the own tokens partly (or wholly) quantized
    assert native.body_len > native.length - Tq
    q = torch.randn(1, Hq, Tq, D, generator=torch.Generator().manual_seed(9))
    out, lse = _merged(native.partials(q, None, Tq, None))
    ref_out, ref_lse = _merged(torch_path.partials(q, None, Tq, None))
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)


class _Rope:
    """RoPE tables as kvrun.models.rope.Rope gives them to the native kernels (signed sin)."""

    def __init__(self, D: int, n: int):
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        ang = torch.arange(n).float()[:, None] * inv[None]
        ang = torch.cat([ang, ang], -1)  # (n, D)
        self.cos = ang.cos()
        self.ssin = torch.cat([-ang.sin()[:, : D // 2], ang.sin()[:, D // 2 :]], -1)

    def signed_tables(self, n: int):
        return self.cos, self.ssin

    def apply(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        D = x.shape[-1]
        rolled = torch.roll(x, D // 2, dims=-1)
        return x * self.cos[pos] + rolled * self.ssin[pos]


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("before", [0, 250, 1027])
@pytest.mark.parametrize("sdt", [F32, F16])
def test_decode_row_matches_rope_append_partials(Hq, Hkv, D, before, sdt, threads):  # noqa: F811
    G = 32
    native, torch_path = _layers(Hkv, D, 2, G, 128, before, 0, before + 1, sdt)
    rope = _Rope(D, before + 8)
    g = torch.Generator().manual_seed(before)
    assert native.tail_dtype == torch_path.tail_dtype == sdt  # the CPU's tail: the KV dtype
    for pos in range(before, before + 3):
        q = torch.randn(1, Hq, 1, D, generator=g)
        k, v = torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
        out = native.rotate_append_attend(rope, q, k, v, pos)
        kr = rope.apply(k, pos)[0]
        # the row as stored: rotated within rounding (f32), then rounded as torch rounds (f16)
        tol = 1e-6 if sdt == F32 else 2**-10
        torch.testing.assert_close(native.tail()[0][:, -1:].float(), kr, atol=tol, rtol=tol)
        assert torch.equal(native.tail()[1][:, -1:], v[0].to(sdt))
        # the torch path over the same rows: an f32 rotation's last bit can round an f16 apart
        torch_path.append(kr if sdt == F32 else native.tail()[0][:, -1:], v[0])
        ref = combine(torch_path.partials(rope.apply(q, pos), None, 1, None), F32)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(native.tail()[0], torch_path.tail()[0], atol=1e-6, rtol=1e-6)
        assert torch.equal(native.tail()[1], torch_path.tail()[1])


@pytest.mark.parametrize("bits,G", [(2, 32), (4, 64), (1, 32), (8, 32)])
@pytest.mark.parametrize("sdt", [F32, F16])
def test_flushes_and_dequantized_are_bit_exact(bits, G, sdt, threads):  # noqa: F811
    """Several flushes of a growing store: the same body buffers and dequantized K/V."""
    native, torch_path = _layers(3, 64, bits, G, 2 * G, 5 * G + 7, 0, bits, sdt)
    assert native.body()[1].dtype == sdt
    for step in range(3):
        k, v = _kv(3, G + step, 64, step)
        for layer in (native, torch_path):
            layer.append(k, v)
            layer.flush(G)
        for a, b in zip(native.body(), torch_path.body(), strict=True):
            assert torch.equal(a, b)
        for a, b in zip(native.dequantized(), torch_path.dequantized(), strict=True):
            assert torch.equal(a, b)


# --- end to end --------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["kivi2", "minikv", "kivi4@f16"])
def test_greedy_tokens_equal_torch_path(default_runtime, spec):
    """Greedy tokens on the default model's exact path (float32 weights: smooth products),
    the KIVI stores given the native kernels or not: the same tokens. (With the default
    packed weights the products quantize activations to 8 bits, so any change of arithmetic
    anywhere moves logits by ~0.5 and 2-bit codes at rounding boundaries: there the tokens
    agree only until the first near tie, for any two paths.)"""
    from kvrun.kv import check
    from kvrun.run.sampling import SamplingConfig
    from kvrun.run.session import Session

    rt = default_runtime
    text = "The GNU General Public License is a free, copyleft license for software. " * 12
    ids = rt.tokenizer.encode(text)[:170]  # a flush during the prefill, more at its end

    name, _, dtype = spec.partition("@")  # @f16: scales and zeros in float16

    def run(kernels):
        kv = rt.new_kv(check(name).with_dtype(dtype or None))
        for st in kv.layers:
            if st.kivi is not None:
                st.kivi.kernels = kernels
        session = Session(rt.model, rt.tokenizer, kv, ubatch=128)
        held = next(st.kivi for st in kv.layers if st.kivi is not None)
        assert held.body()[1].dtype == (F16 if dtype else F32)
        return session.generate(ids, 16, SamplingConfig(temp=0), seed=0).tokens

    assert run(ops) == run(None)


@pytest.mark.parametrize("dtype,scales", [(None, F32), ("f32", F32), ("auto", F16), ("f16", F16)])
def test_kv_dtype_sets_the_scales(default_runtime, dtype, scales):
    """--kv-dtype: KIVI's scales and zeros in f16 on the CPU by default (auto), as the spec's
    KV dtype; kv_bytes_full counts `full` in the same dtype; another type is one line."""
    from kvrun.errors import KvrunError
    from kvrun.kv import check

    rt = default_runtime
    kv = rt.new_kv(check("snapkv+kivi2").with_dtype(dtype))
    held = [st.kivi for st in kv.layers if st.kivi is not None]
    assert held and all(k.scale_dtype == scales and k.dtype == F32 for k in held)
    full = kv.full_kv_type
    assert (full.name if full is not None else None) == (None if scales == F32 else "f16")
    with pytest.raises(KvrunError, match="scales and zeros in f32 or f16, not q8_0"):
        rt.new_kv(check("kivi2").with_dtype("q8_0"))
