"""The native CPU kernels (kernels/cpu/, kvrun/quant/native.py) against gguf's own numbers.

For every GGUF type with a native kernel, on every instruction set this machine runs
(portable C++ always; AVX2 and AVX-512 VNNI or AVX-VNNI where the CPU has them):

- dequantization gives exactly `gguf.quants.dequantize`'s float32 values, row-major and
  interleaved, whole or by row indices;
- the interleaved layout unpacks to the file's bytes, byte for byte;
- the activations are quantized as llama.cpp quantizes them (q8_0 / q8_1 / q8_K: the same
  scales, codes and sums, computed here in numpy from ggml's formulas);
- a product equals dequantize(W) @ dequantize(q8(x)) in float64 (q8_1's rounded sums
  included) within float32 accumulation (1e-5 of sum |w| |x|), for 1..32 rows, weight rows
  not a multiple of the tile, K not a multiple of 256 where the type allows, 1 and 2 threads.

Weights are random bytes (every code value occurs) with sane float16 scales written over the
scale fields, so no type needs a quantizer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvrun.quant import native
from kvrun.quant.blocks import BlockLinear, Blocks

ops = native.ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"native kernels unavailable: {native.note()}")

# byte offsets of each type's float16 scale fields (the rest of a block is codes and bits)
SCALES = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.IQ4_NL: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
    Q.IQ4_XS: [0],
}  # fmt: skip
PRODUCTS = [t for t in SCALES if t not in (Q.Q2_K, Q.Q3_K)]  # Q2_K, Q3_K: dequantized only
INTERLEAVED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]
ISAS = [] if ops is None else [i for i in ("portable", "avx2", "avx512vnni", "avxvnni")]


def isas_here() -> list[str]:
    here = []
    for name in ISAS:
        try:
            ops.set_isa(name)
            here.append(name)
        except RuntimeError:
            pass
    ops.set_isa("best")
    return here


@pytest.fixture(params=isas_here() if ops is not None else ["none"])
def isa(request):
    ops.set_isa(request.param)
    yield request.param
    ops.set_isa("best")


def random_blocks(t: Q, n: int, k: int, seed: int = 0) -> torch.Tensor:
    elems, size = GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // elems, size), dtype=np.uint8)
    for off in SCALES[t]:
        d = (rng.standard_normal((n, k // elems)) * 0.01).astype(np.float16)
        raw[..., off : off + 2] = d[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def ref_dequant(t: Q, w: torch.Tensor, k: int) -> np.ndarray:
    return dequantize(w.numpy(), t).reshape(w.shape[0], k)


# ----------------------------------------------------------- llama.cpp's activation rounding
def q8_32(x: np.ndarray):
    """quantize_row_q8_0 / q8_1 (ggml-cpu x86): d = amax / 127 kept in fp16, codes
    round-half-even(x * 127 / amax), q8_1's s = fp16(d * sum of codes)."""
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    d = amax / np.float32(127)
    inv = np.where(amax != 0, np.float32(127) / np.where(amax == 0, 1, amax), 0).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    s = (d * q.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float16)
    return q.reshape(x.shape), d.astype(np.float16).astype(np.float32), s.astype(np.float32)


def q8_k(x: np.ndarray):
    """quantize_row_q8_K_ref: the value of largest magnitude maps to -127, d = 1 / iscale."""
    xb = x.reshape(x.shape[0], -1, 256)
    mx = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)[..., 0]
    iscale = np.float32(-127) / mx
    q = np.minimum(127, np.rint(iscale[..., None] * xb)).astype(np.int8)
    bs = q.reshape(x.shape[0], -1, 16).astype(np.int32).sum(-1).astype(np.int16)
    return q.reshape(x.shape), (np.float32(1) / iscale).astype(np.float32), bs


def test_activations_round_as_llama_cpp(isa):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 512, generator=g) * torch.linspace(0.01, 3, 512)
    x[2, :32] = 0  # an all-zero block
    q, d, s = (t.numpy() for t in ops.quantize_act(x, 0))
    rq, rd, rs = q8_32(x.numpy())
    assert np.array_equal(q, rq) and np.array_equal(d, rd) and np.array_equal(s, rs)
    x[3, 256:] = 0
    q, d, bs = (t.numpy() for t in ops.quantize_act(x, 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        rq, rd, rbs = q8_k(x.numpy())
    live = np.ones(rd.shape, bool)
    live[3, 1] = False  # ggml writes d = 0 and zero codes for an all-zero block
    rq.reshape(5, 2, 256)[3, 1] = 0
    rbs.reshape(5, 2, 16)[3, 1] = 0
    assert np.array_equal(q, rq) and np.array_equal(bs, rbs)
    assert np.array_equal(d[live], rd[live]) and d[3, 1] == 0


@pytest.mark.parametrize("t", list(SCALES), ids=lambda t: t.name)
def test_dequant_exact(t, isa):
    elems = GGML_QUANT_SIZES[t][0]
    n, k = 21, 3 * elems if elems == 256 else 96
    w = random_blocks(t, n, k)
    want = ref_dequant(t, w, k)
    assert np.array_equal(
        ops.dequant(w, int(t), n, k).numpy().view(np.uint32), want.view(np.uint32)
    )
    idx = torch.tensor([20, 0, 7, 8, 8])
    assert np.array_equal(ops.dequant(w, int(t), n, k, idx).numpy(), want[idx.numpy()])
    if t in INTERLEAVED:
        w8 = ops.repack(w, int(t), k)
        assert w8.shape[0] == 3  # 21 rows: two whole groups of 8 and one of 5
        assert torch.equal(ops.unpack(w8, int(t), n, k), w)  # the file's bytes, moved
        code = int(t) | 256
        assert np.array_equal(ops.dequant(w8, code, n, k).numpy(), want)
        assert np.array_equal(ops.dequant(w8, code, n, k, idx).numpy(), want[idx.numpy()])


def reference(t: Q, w: torch.Tensor, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """dequantize(W) @ dequantize(q8(x)) in float64, with llama.cpp's rounded q8_1 sums for
    Q4_1 / Q5_1; and sum |w| |x_q| for the bound."""
    n, k = w.shape[0], x.shape[1]
    wd = ref_dequant(t, w, k).astype(np.float64)
    elems = GGML_QUANT_SIZES[t][0]
    if elems == 32:
        q, d, s = q8_32(x.numpy())
        xq = (q.reshape(len(x), -1, 32) * d[..., None]).astype(np.float64)
    else:
        q, d, _ = q8_k(x.numpy())
        xq = (q.reshape(len(x), -1, 256) * d[..., None]).astype(np.float64)
    xq = xq.reshape(len(x), k)
    y = xq @ wd.T
    if t in (Q.Q4_1, Q.Q5_1):  # m x fp16(d * sum) in place of m x d x sum
        blocks = w.numpy().reshape(n, -1, GGML_QUANT_SIZES[t][1])
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)  # (N, B)
        exact = d * q.reshape(len(x), -1, 32).astype(np.int32).sum(-1)
        y += (s.astype(np.float64) - exact) @ m.T
    return y, np.abs(xq) @ np.abs(wd).T


LAYOUTS = [(t, "rows") for t in PRODUCTS] + [(t, "x8") for t in INTERLEAVED]


@pytest.mark.parametrize("t,layout", LAYOUTS, ids=lambda v: getattr(v, "name", v))
def test_product_matches_q8_reference(t, layout, isa):
    elems = GGML_QUANT_SIZES[t][0]
    k = 512 if elems == 256 else 224  # 224: not a multiple of 256
    n = 45  # not a multiple of the 16-row tile nor of the 8-row group
    w = random_blocks(t, n, k, seed=int(t))
    data, code = (w, int(t)) if layout == "rows" else (ops.repack(w, int(t), k), int(t) | 256)
    g = torch.Generator().manual_seed(int(t))
    for m in (1, 2, 3, 4, 5, 8, 17, 32):
        x = torch.randn(m, k, generator=g)
        y = ops.qmm(x, [data], [code], [n]).numpy()
        want, scale = reference(t, w, x)
        err = np.abs(y - want) / (scale * 1e-5 + 1e-30)
        assert err.max() < 1, f"{t.name} {layout} m={m}: {err.max():.2f} of the bound"


def test_threads_and_stacked_types_agree(isa):
    """One call over parts of different types (a Q4_K_M layer's Q4_K Q and K beside its Q6_K V)
    equals the parts multiplied alone, on 1 and 2 threads alike."""
    k = 512
    parts = [(Q.Q4_K, 40), (Q.Q6_K, 24), (Q.Q8_0, 9)]
    ws = [random_blocks(t, n, k, seed=i) for i, (t, n) in enumerate(parts)]
    data = [ops.repack(w, int(t), k) for w, (t, _) in zip(ws, parts, strict=True)]
    codes = [int(t) | 256 for t, _ in parts]
    rows = [n for _, n in parts]
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        outs = []
        for nt in (1, 2):
            torch.set_num_threads(nt)
            outs.append(ops.qmm(x, data, codes, rows))
    finally:
        torch.set_num_threads(threads)
    alone = torch.cat(
        [ops.qmm(x, [d], [c], [n]) for d, c, n in zip(data, codes, rows, strict=True)], 1
    )
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], alone)


def test_products_run_on_torchs_threads():
    """A parallel region in the library runs on as many of torch's threads as are set (built
    without OpenMP, at::parallel_for would silently run on the calling thread alone)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert ops.threads_used() == 1
        torch.set_num_threads(2)  # more threads than cores still run as asked
        assert ops.threads_used() == 2
    finally:
        torch.set_num_threads(threads)


def test_isas_agree_closely():
    """Every instruction set gives the same products up to float32 summation order."""
    k, n = 512, 33
    w = random_blocks(Q.Q4_K, n, k)
    w8 = ops.repack(w, int(Q.Q4_K), k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
    outs = []
    for name in isas_here():
        ops.set_isa(name)
        outs.append(ops.qmm(x, [w8], [int(Q.Q4_K) | 256], [n]))
    ops.set_isa("best")
    for y in outs[1:]:
        assert (y - outs[0]).abs().max() <= 1e-5 * outs[0].abs().max()


def test_bad_arguments_raise():
    w = random_blocks(Q.Q4_0, 8, 64)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="not the"):
        ops.qmm(x, [w], [int(Q.Q4_0)], [9])  # 8 rows given, 9 claimed
    with pytest.raises(RuntimeError, match="block size"):
        ops.qmm(torch.randn(1, 48), [w], [int(Q.Q4_0)], [8])
    with pytest.raises(RuntimeError, match="float32"):
        ops.qmm(x.double(), [w], [int(Q.Q4_0)], [8])
    with pytest.raises(RuntimeError, match="not available"):
        ops.set_isa("sse9")


@pytest.mark.parametrize("t", [Q.Q4_0, Q.Q5_1, Q.Q6_K, Q.IQ4_XS, Q.Q3_K], ids=lambda t: t.name)
def test_block_linear_exact_path_is_dequantize_then_linear(t):
    """Beyond the native rows a product is F.linear on gguf's dequantized values, bit for bit."""
    elems = GGML_QUANT_SIZES[t][0]
    n, k = 40, 2 * elems if elems == 256 else 128
    w = random_blocks(t, n, k)
    lin = BlockLinear([Blocks(t.name, n, k, w).interleaved()], torch.float32)
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(5))
    want = torch.nn.functional.linear(x, torch.from_numpy(ref_dequant(t, w, k)))
    assert torch.equal(lin._exact(x), want)
    assert lin.x8s == [t in INTERLEAVED]
