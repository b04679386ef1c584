"""Packed 4/8-bit weights: GGUF blocks -> packed form, the matmul paths, --wtype end to end."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from test_dequant import COLS, DEQUANT_ONLY, ROWS, _raw_blocks, _read, _write

from kvrun import packed as packed_mod
from kvrun.errors import KvrunError, UnsupportedModel
from kvrun.packed import PackedEmbedding, PackedLinear, dequant_linear, to_int4pack
from kvrun.quant import (
    GROUP,
    from_gguf,
    nearest_bits,
    plan_nbytes,
    quantize,
    quantize_rows,
    requantize_bits,
)
from kvrun.weights import read_gguf_tensor

EXACT = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8}
MAPPED = ["Q5_0", "Q5_1", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K"]


def _gguf_tensor(tmp_path, name: str):
    """A (ROWS, COLS) tensor of GGUF type `name` written to a file and read back, plus the
    reference float32 weights from `gguf.quants.dequantize`."""
    qtype = Q[name]
    rng = np.random.default_rng(7)
    if name in DEQUANT_ONLY:
        raw = _raw_blocks(qtype, rng)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype)
    _write(tmp_path / "t.gguf", "blk.0.ffn_up.weight", raw, qtype)
    t = _read(tmp_path / "t.gguf")
    ref = gguf.quants.dequantize(raw, qtype).reshape(ROWS, COLS)
    return t, torch.from_numpy(np.ascontiguousarray(ref))


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_types_dequantize_bit_exact(tmp_path, name):
    t, ref = _gguf_tensor(tmp_path, name)
    p = from_gguf(t, rows_per_slab=4)  # two slabs: 4 rows + 2 rows
    assert (p.bits, p.exact, p.shape) == (EXACT[name], True, (ROWS, COLS))
    assert torch.equal(p.dequantize(), ref)
    assert p.nbytes == plan_nbytes(name, ROWS, COLS, p.bits)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_types_matmul_equals_dense(tmp_path, name):
    t, ref = _gguf_tensor(tmp_path, name)
    lin = PackedLinear(from_gguf(t), torch.float32)
    x = torch.randn(3, 5, COLS, generator=torch.Generator().manual_seed(0))
    want = F.linear(x, ref)
    got = lin(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("name", MAPPED)
def test_mapped_types_within_their_quantization_step(tmp_path, name):
    """Types with no exact packed form are re-quantized: every weight moves by at most half a
    step of its group, so |y - y_ref| <= sum_k |x_k| * step_k / 2 (the bound the test checks)."""
    t, ref = _gguf_tensor(tmp_path, name)
    p = from_gguf(t)
    assert (p.bits, p.exact, p.source) == (nearest_bits(name), False, name)
    step = p.scale.float().repeat_interleave(GROUP, dim=1)  # (N, K)
    err = (p.dequantize() - ref).abs()
    assert (err <= step / 2 * (1 + 1e-3) + 1e-7).all()
    x = torch.randn(4, COLS, generator=torch.Generator().manual_seed(1))
    bound = x.abs() @ (step / 2).T * (1 + 1e-3) + 1e-5
    assert ((PackedLinear(p, torch.float32)(x) - F.linear(x, ref)).abs() <= bound).all()


def test_q8_k_cannot_be_read_is_a_clear_error(tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_K]
    _write(
        tmp_path / "t.gguf",
        "blk.0.ffn_up.weight",
        np.zeros((2, COLS // block * size), np.uint8),
        Q.Q8_K,
    )
    t = _read(tmp_path / "t.gguf")
    with pytest.raises(UnsupportedModel, match="Q8_K"):
        read_gguf_tensor(t, "model.layers.0.mlp.up_proj.weight", torch.float32, 8)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_floats_round_to_nearest(bits):
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(2))
    w[3, :32] = 0.0  # a constant group: scale 0, no division by zero
    p = quantize_rows(w, bits, rows_per_slab=16)
    assert p.shape == (40, 256) and not torch.isnan(p.dequantize()).any()
    step = p.scale.float().repeat_interleave(GROUP, dim=1)
    # half a step, plus the float16 rounding of the zero point (q4)
    slack = 0 if bits == 8 else p.zero.float().abs().repeat_interleave(GROUP, 1) * 2**-11
    assert ((p.dequantize() - w).abs() <= step / 2 + slack + 1e-6).all()
    assert torch.equal(p.dequantize()[3, :32], torch.zeros(32))


def test_widening_q4_to_q8_is_exact():
    p = quantize(torch.randn(8, 64), 4)
    wide = requantize_bits(p, 8)
    assert wide.bits == 8 and wide.codes.dtype == torch.int8
    assert torch.equal(wide.dequantize(), p.dequantize())


def test_int4pack_path_equals_dequant_path():
    p = quantize(torch.randn(96, 256, generator=torch.Generator().manual_seed(3)), 4)
    lin = PackedLinear(p, torch.float32)
    x = torch.randn(2, 3, 256)
    want = lin(x)
    lin.use_int4pack()
    assert lin.path == "int4pack"
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    w, sz = to_int4pack(p, torch.float32)
    assert sz.shape == (256 // GROUP, 96, 2)


def test_slabs_of_rows_equal_one_product(monkeypatch):
    p = quantize(torch.randn(100, 64), 4)
    x = torch.randn(5, 64)
    whole = dequant_linear(x, p, torch.float32)
    monkeypatch.setattr(packed_mod, "SLAB_ELEMS", 64 * 7)  # 7 rows a slab, 15 slabs
    torch.testing.assert_close(dequant_linear(x, p, torch.float32), whole)


def test_packed_embedding_gathers_rows():
    p = quantize(torch.randn(50, 64), 8)
    emb = PackedEmbedding(p, torch.float32)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(emb(ids), F.embedding(ids, p.dequantize()))
    torch.testing.assert_close(emb.linear(torch.ones(2, 64)), torch.ones(2, 64) @ p.dequantize().T)


# ------------------------------------------------------------ whole models, --wtype
def _dense_twin(rt):
    """A dense Transformer with the packed model's weights dequantized (the reference)."""
    from kvrun.model import Transformer

    sd = {}
    for name, mod in rt.model.named_modules():
        if isinstance(mod, PackedLinear):
            sd[f"{name}.weight"] = mod.packed.dequantize(torch.float32)
    sd.update({k: v for k, v in rt.model.state_dict().items() if k.endswith("norm.weight")})
    return Transformer.from_weights(rt.config, sd, "cpu")


@pytest.mark.parametrize("source,wtype", [("gguf", "q8"), ("gguf", "q4"), ("hf", "q4")])
def test_tiny_model_packed_equals_its_dense_twin(tmp_path, source, wtype):
    """The packed model (GGUF: Q/K rows un-permuted as packed rows; HF: quantized at load)
    gives the logits of a dense model holding the same dequantized weights."""
    from kvrun.runtime import load_runtime
    from tiny_models import build

    tiny = build(tmp_path, tied=source == "gguf")
    path = tiny.gguf_path if source == "gguf" else tiny.hf_dir
    rt = load_runtime(str(path), "float32", "cpu", wtype=wtype)
    assert rt.weights.wtype == wtype
    assert isinstance(rt.model.model.layers[0].self_attn.q_proj, PackedLinear)
    assert isinstance(rt.model.model.embed_tokens, PackedEmbedding)
    twin = _dense_twin(rt)
    ids, pos = torch.tensor([[1, 5, 9, 33, 2, 17]]), torch.arange(6)
    with torch.inference_mode():
        got = rt.model(ids, pos, rt.new_kv("full"))
        want = twin(ids, pos, rt.new_kv("full"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if wtype == "q8":  # and near the float model (8-bit absmax of its random weights)
        dense = load_runtime(str(path), "float32", "cpu", wtype="f32")
        with torch.inference_mode():
            ref = dense.model(ids, pos, dense.new_kv("full"))
        assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_wtype_and_dtype_conflict_is_one_error():
    from kvrun.runtime import pick_dtype

    assert pick_dtype("auto", torch.device("cpu"), "bf16") == torch.bfloat16
    assert pick_dtype("auto", torch.device("cpu"), "q4") == torch.float32
    with pytest.raises(KvrunError, match="--wtype f16"):
        pick_dtype("float32", torch.device("cpu"), "f16")
    with pytest.raises(KvrunError, match="unknown --wtype"):
        pick_dtype("auto", torch.device("cpu"), "q3")


def test_auto_packs_when_dense_would_not_fit(monkeypatch):
    from kvrun import presets

    monkeypatch.setattr(presets, "available_bytes", lambda device: 10 * 2**20)
    wt, note = packed_mod.auto_wtype(20 * 2**20, torch.device("cpu"), torch.float32)
    assert wt == "packed" and "would take" in note


def test_synthetic_preset_packed_without_floats():
    from kvrun.config import ModelConfig
    from kvrun.presets import PRESETS, preset_runtime, random_weights, weight_bytes
    from kvrun.quant import Packed
    from kvrun.tasks.bench import weight_bytes as measured_bytes

    cfg: ModelConfig = PRESETS["tiny-synthetic"]
    tensors = random_weights(cfg, torch.float32, torch.device("cpu"), bits=4)
    assert all(isinstance(v, Packed) for k, v in tensors.items() if not k.endswith("norm.weight"))
    rt = preset_runtime("tiny-synthetic", torch.float32, torch.device("cpu"), wtype="q4")
    assert measured_bytes(rt.model) == weight_bytes(cfg, torch.float32, 4)
    kv = rt.new_kv("full")
    with torch.inference_mode():
        out = rt.model(torch.tensor([[1, 2, 3]]), torch.arange(3), kv)
        step = rt.model(torch.tensor([[4]]), torch.tensor([3]), kv)
    assert out.shape == (1, 3, cfg.vocab_size) and step.shape == (1, 1, cfg.vocab_size)
    assert torch.isfinite(step).all() and out.std() > 0
    # the 8B shape at q4: codes + fp16 scale/zero per 32 = 5 bits a weight, under 6 GB
    assert weight_bytes(PRESETS["llama3-8b-synthetic"], torch.float32, 4) < 5.1e9


@pytest.mark.parametrize("bits", [4, 8])
def test_scratch_dequantize_equals_reference(bits):
    """The fast in-place dequantization (int32 nibble masks, reused buffers) against
    Packed.dequantize, for whole tensors, row slices and gathered rows, twice (reuse)."""
    from kvrun.packed import Scratch

    sc = Scratch()
    p = quantize(torch.randn(48, 192, generator=torch.Generator().manual_seed(4)), bits)
    for part in (p, p.rows(slice(5, 20)), p.rows(torch.tensor([3, 3, 40, 0]))):
        for _ in range(2):
            assert torch.equal(sc.dequantize(part, torch.float32), part.dequantize())
    assert sc.dequantize(p, torch.bfloat16).dtype == torch.bfloat16
