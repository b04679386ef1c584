"""GGUF tensor reading: every tensor type, bit-exact against `gguf.quants.dequantize`."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from kvrun.errors import UnsupportedModel
from kvrun.models.config import ModelConfig
from kvrun.models.file_headers import gguf_metadata, gguf_name_to_hf, open_gguf
from kvrun.models.weights import dequantize_tensor

DEFAULT_GGUF = Path.home() / ".cache/kvrun/models/SmolLM2-135M-Instruct.Q4_1.gguf"

ROWS, COLS = 6, 512  # rows != cols, and COLS is a multiple of every block size (<= 256)

# Types that `gguf.quants.quantize` can produce from float32.
QUANTIZABLE = [
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "TQ1_0",
    "TQ2_0",
    "MXFP4",
]

# Types gguf can only dequantize, with the byte offsets of each block's f16 scale fields
# (random bytes there could decode to inf / nan, so they are replaced by small values).
DEQUANT_ONLY = {
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ2_XXS": [0],
    "IQ2_XS": [0],
    "IQ2_S": [0],
    "IQ3_XXS": [0],
    "IQ3_S": [0],
    "IQ1_S": [0],
    "IQ1_M": [],  # its f16 scale is split over the top nibbles of four uint16s; see _raw_blocks
    "IQ4_NL": [0],
    "IQ4_XS": [0],
    "NVFP4": [],  # unsigned e4m3 scales: every byte decodes to a finite value
}


def _write(path: Path, name: str, data: np.ndarray, raw_dtype: Q | None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _read(path: Path):
    reader = open_gguf(path)
    (t,) = reader.tensors
    return t


def _raw_blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random but valid raw blocks for a (ROWS, COLS) tensor of qtype, as uint8 (ROWS, bytes)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = ROWS * COLS // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    for off in DEQUANT_ONLY[qtype.name]:
        raw[:, off : off + 2] = scales
    if qtype == Q.IQ1_M:
        d = scales.view(np.uint16)[:, 0]  # (n_blocks,)
        sc = raw[:, block // 8 + block // 16 :].copy().view(np.uint16)  # (n_blocks, 4)
        for i, shift in enumerate((12, 8, 4, 0)):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (((d >> (12 - shift)) & 0xF) << 12)
        raw[:, block // 8 + block // 16 :] = sc.view(np.uint8)
    return raw.reshape(ROWS, -1)


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantized_types_bit_exact(tmp_path, name):
    qtype = Q[name]
    x = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    try:
        data = gguf.quants.quantize(x, qtype)
    except NotImplementedError as e:
        pytest.skip(f"this gguf cannot quantize {name}: {e}")
    raw_dtype = None if qtype in (Q.F32, Q.F16) else qtype
    _write(tmp_path / "t.gguf", "blk.0.ffn_up.weight", data, raw_dtype)
    t = _read(tmp_path / "t.gguf")
    assert t.tensor_type == qtype
    ours = dequantize_tensor(t)
    ref = gguf.quants.dequantize(data, qtype)
    assert ours.shape == (ROWS, COLS)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, ref.reshape(ROWS, COLS))
    # the quantizer's round trip stays near the input (ternary TQ types are not meant to)
    if not name.startswith("TQ"):
        atol = {"F32": 0, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 2e-2, "MXFP4": 1.0}.get(name, 0.4)
        np.testing.assert_allclose(ours, x, atol=atol, rtol=0)


@pytest.mark.parametrize("name", sorted(DEQUANT_ONLY))
def test_dequantize_only_types_bit_exact(tmp_path, name):
    qtype = Q[name]
    raw = _raw_blocks(qtype, np.random.default_rng(1))
    ref = gguf.quants.dequantize(raw, qtype)
    assert np.isfinite(ref).all(), "test blocks must be valid"
    _write(tmp_path / "t.gguf", "blk.0.ffn_down.weight", raw, qtype)
    t = _read(tmp_path / "t.gguf")
    assert t.tensor_type == qtype
    ours = dequantize_tensor(t)
    assert ours.shape == (ROWS, COLS)
    np.testing.assert_array_equal(ours, ref)


def test_one_dimensional_tensor(tmp_path):
    x = np.random.default_rng(2).standard_normal(COLS).astype(np.float32)
    _write(tmp_path / "t.gguf", "output_norm.weight", x, None)
    ours = dequantize_tensor(_read(tmp_path / "t.gguf"))
    assert ours.shape == (COLS,)
    np.testing.assert_array_equal(ours, x)


def test_three_dimensional_shape(tmp_path):
    x = np.random.default_rng(3).standard_normal((2, 3, 64)).astype(np.float32)
    data = gguf.quants.quantize(x, Q.Q8_0)
    _write(tmp_path / "t.gguf", "blk.0.attn_q.weight", data, Q.Q8_0)
    ours = dequantize_tensor(_read(tmp_path / "t.gguf"))
    assert ours.shape == (2, 3, 64)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(data, Q.Q8_0))


@pytest.mark.parametrize("name", ["Q8_K", "Q8_1"])
def test_type_gguf_cannot_dequantize_is_a_clear_error(tmp_path, name):
    qtype = Q[name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((2, COLS // block * size), dtype=np.uint8)
    _write(tmp_path / "t.gguf", "blk.0.ffn_up.weight", raw, qtype)
    t = _read(tmp_path / "t.gguf")
    with pytest.raises(UnsupportedModel, match=name):
        dequantize_tensor(t)


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    if not DEFAULT_GGUF.exists():
        pytest.skip(f"default model not downloaded ({DEFAULT_GGUF} is absent)")
    return DEFAULT_GGUF


def _hf_shape(hf: str, c: ModelConfig) -> tuple[int, ...]:
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, c.dim),
        "lm_head.weight": (c.vocab_size, c.dim),
        "model.norm.weight": (c.dim,),
        "input_layernorm.weight": (c.dim,),
        "post_attention_layernorm.weight": (c.dim,),
        "self_attn.q_proj.weight": (q, c.dim),
        "self_attn.k_proj.weight": (kv, c.dim),
        "self_attn.v_proj.weight": (kv, c.dim),
        "self_attn.o_proj.weight": (c.dim, q),
        "mlp.gate_proj.weight": (c.ffn_dim, c.dim),
        "mlp.up_proj.weight": (c.ffn_dim, c.dim),
        "mlp.down_proj.weight": (c.dim, c.ffn_dim),
    }
    key = hf if hf in shapes else hf.split(".", 3)[-1]
    return shapes[key]


def test_default_model_every_tensor_loads(default_gguf):
    reader = open_gguf(default_gguf)
    names = {t.name for t in reader.tensors}
    c = ModelConfig.from_gguf(gguf_metadata(reader), has_output="output.weight" in names)
    assert (c.vocab_size, c.dim, c.n_layers) == (49152, 576, 30)
    types = set()
    for t in reader.tensors:
        hf = gguf_name_to_hf(t.name)
        assert hf is not None, t.name
        w = dequantize_tensor(t)
        assert w.shape == _hf_shape(hf, c), t.name
        assert np.isfinite(w).all(), t.name
        types.add(t.tensor_type.name)
    assert "model.embed_tokens.weight" in {gguf_name_to_hf(n) for n in names}
    assert {"Q4_1", "F32"} <= types


def _same_as_gguf_reader(path: Path) -> None:
    ours, ref = open_gguf(path), gguf.GGUFReader(str(path), "r")
    want = {name: f.contents() for name, f in ref.fields.items()}
    assert gguf_metadata(ours) == want
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data)


def test_header_parser_equals_gguf_reader(tmp_path):
    """kvrun's GGUF header parser (kvrun.models.file_headers, ~30x faster on a 49k vocabulary) reads
    every value type, a non-default alignment and tensors of several types exactly as
    gguf.GGUFReader does."""
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 700)
    w.add_int16("t.i16", -700)
    w.add_uint32("t.u32", 70000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.5)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.empty", [])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((4, 64)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((2, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((3, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("c.weight", q, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_gguf_reader(path)


def test_header_parser_on_the_default_model(default_gguf):
    _same_as_gguf_reader(default_gguf)


def _rss_file_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile line")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_release_unmaps_a_tensors_pages_and_keeps_its_bytes(default_gguf):
    """A loaded tensor's file pages leave the process (an 8B Q4 load otherwise ends with the
    whole file resident beside the packed model), and the tensor still reads the same."""
    reader = open_gguf(default_gguf)
    before = {t.name: np.array(t.data) for t in reader.tensors}  # touches every page
    touched = _rss_file_kib()
    for t in reader.tensors:
        reader.release(t)
    released = _rss_file_kib()
    size_kib = sum(a.nbytes for a in before.values()) // 1024
    assert touched - released > 0.9 * size_kib, (touched, released, size_kib)
    for t in reader.tensors:
        assert np.array_equal(np.asarray(t.data), before[t.name]), t.name
