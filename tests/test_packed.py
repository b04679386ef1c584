"""Packed 4/8-bit weights: GGUF blocks -> packed form, the matmul paths, --wtype end to end."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from test_dequant import COLS, DEQUANT_ONLY, ROWS, _raw_blocks, _read, _write

from kvrun.errors import KvrunError, UnsupportedModel
from kvrun.models.weights import read_gguf_tensor
from kvrun.quant import choice as matmul_choice
from kvrun.quant import hardware, int4mm
from kvrun.quant import linear as packed_mod
from kvrun.quant.formats import GROUP, nearest_bits, plan_nbytes
from kvrun.quant.linear import PackedEmbedding, PackedLinear, dequant_linear
from kvrun.quant.packed import from_gguf, pack_nibbles, quantize, quantize_rows, requantize_bits


def pack_cpu_op(q: torch.Tensor) -> torch.Tensor:
    """Codes packed by PyTorch's own conversion: the reference for the CPU layout."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)


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


@pytest.mark.parametrize("bits", [4, 8])
def test_int4_cpu_layout_reads_back_exactly(bits):
    """The CPU op's layout as found by packing known codes: `unpack_cpu` inverts the op's own
    packing (whole tensor, whole-block slices, gathered rows), and a layer moved to the int4
    planes dequantizes to exactly the weights it had (q8 as two 4-bit planes)."""
    q = torch.randint(0, 16, (192, 96), generator=torch.Generator().manual_seed(5))
    w = pack_cpu_op(q)  # PyTorch's own packing
    assert torch.equal(int4mm.pack_cpu(q), w)  # kvrun's byte-op packing makes the same bytes
    assert torch.equal(int4mm.unpack_cpu(w), q.to(torch.uint8))
    assert torch.equal(int4mm.unpack_cpu(w, slice(64, 192)), q[64:].to(torch.uint8))
    idx = torch.tensor([0, 31, 32, 63, 64, 191, 100, 100])
    assert torch.equal(int4mm.unpack_cpu(w, idx), q[idx].to(torch.uint8))
    p = quantize(torch.randn(128, 256, generator=torch.Generator().manual_seed(3)), bits)
    p.exact = True  # as a GGUF block type that maps exactly: the float16 scales are kept
    lin = PackedLinear(p, torch.float32)
    assert lin.use_int4pack() and lin.codes is None and lin.n_planes == bits // 4
    assert torch.equal(lin.packed.dequantize(), p.dequantize())
    emb = PackedEmbedding(p, torch.float32)
    emb.use_int4pack()
    ids = torch.tensor([[5, 0, 127], [64, 63, 5]])
    assert torch.equal(emb(ids), F.embedding(ids, p.dequantize()))
    # inexact weights (re-quantized, random) keep only the planes' bfloat16 scales: prefill
    # and gathers read those, within a bfloat16 rounding of the float16 ones
    p.exact = False
    lin = PackedLinear(p, torch.float32)
    lin.use_int4pack()
    assert lin.scale is None and lin.zero is None
    w = lin.packed.dequantize()
    exact_rows = lin.op_rows() + 1  # past the int4 op's rows: the dequantizing path
    assert torch.equal(lin(torch.eye(256)[:exact_rows]), w.T[:exact_rows])
    zero = p.zero.float().abs().repeat_interleave(GROUP, 1) if bits == 4 else 0
    mag = p.dequantize().abs() + zero + 8 * p.scale.float().repeat_interleave(GROUP, 1)
    assert ((w - p.dequantize()).abs() <= 2 * 2**-8 * mag).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_int4_cpu_products_within_bfloat16_rounding(bits):
    """Decode-sized products go through the int4 op on bfloat16 activations, scales and zeros
    (kvrun/quant/int4mm.py): each product term is off by at most a few bfloat16 roundings
    (2^-8 relative each), so |y - y_ref| <= 4 * 2^-8 * sum_k |x_k| (|w_nk| + |zero'_nk|).
    Longer products (prefill) dequantize exactly."""
    p = quantize(torch.randn(128, 256, generator=torch.Generator().manual_seed(3)), bits)
    p.exact = True  # keep the float16 scales, as for an exactly mapped GGUF type
    ref_w = p.dequantize()
    lin = PackedLinear(p, torch.float32)
    lin.use_int4pack()
    x = torch.randn(1, 3, 256, generator=torch.Generator().manual_seed(6))
    zero = (p.zero.float() if p.zero is not None else 0) + 8 * p.scale.float()
    if bits == 8:  # the planes' zeros: 0 and 8s
        zero = 8 * p.scale.float()
    mag = ref_w.abs() + zero.abs().repeat_interleave(GROUP, dim=1)
    bound = 4 * 2**-8 * (x.abs() @ mag.T)
    got, want = lin(x), F.linear(x, ref_w)
    assert ((got - want).abs() <= bound).all()
    assert (got - want).abs().max() > 0  # really the bfloat16 op, not the exact path
    xl = torch.randn(lin.op_rows() + 1, 256)
    torch.testing.assert_close(lin(xl), F.linear(xl, ref_w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("refine,margin", [(64, 6.0), (4, 1e9)])
def test_head_refines_the_top_logits(monkeypatch, refine, margin):
    """A decode step's head logits (int4 op): every logit within REFINE_MARGIN of its row's
    largest is recomputed exactly, at most REFINE of them (the largest); the rest stay the
    op's bfloat16 product."""
    monkeypatch.setattr(packed_mod, "REFINE", refine)
    monkeypatch.setattr(packed_mod, "REFINE_MARGIN", margin)
    g = torch.Generator().manual_seed(7)
    p = quantize(torch.randn(512, 128, generator=g), 8)
    p.exact = True
    head = PackedEmbedding(p, torch.float32)
    assert head.use_int4pack()
    x = 3 * torch.randn(3, 128, generator=g)
    approx, exact = head.matmul(x, exact=True), F.linear(x, p.dequantize())
    got = head.logits(x)
    for r in range(3):
        near = (approx[r] > approx[r].max() - margin).nonzero().squeeze(1)
        top = near if near.numel() <= refine else approx[r].topk(refine).indices
        mask = torch.zeros(512, dtype=torch.bool)
        mask[top] = True
        assert 1 <= mask.sum() <= refine and mask.sum() < 512
        torch.testing.assert_close(got[r][mask], exact[r][mask], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[r][~mask], approx[r][~mask])
        assert (approx[r][mask] - exact[r][mask]).abs().max() > 1e-4  # there was something to fix


@pytest.mark.parametrize("bits", [4, 8])
def test_large_layers_prefill_in_bfloat16(monkeypatch, bits):
    """Layers of BF16_PREFILL_WEIGHTS weights or more (made small here) take the int4 op up
    to BF16_OP_ROWS rows and beyond it dequantize to bfloat16 for oneDNN's GEMM: both within
    the bfloat16 bound of the test above; the output head (`logits`) stays exact beyond a
    decode step's rows. Where bf16 GEMMs are not faster the product stays exact."""
    p = quantize(torch.randn(128, 256, generator=torch.Generator().manual_seed(4)), bits)
    p.exact = True
    ref_w = p.dequantize()
    lin = PackedLinear(p, torch.float32)
    lin.use_int4pack()
    monkeypatch.setattr(packed_mod, "BF16_PREFILL_WEIGHTS", 0)
    monkeypatch.setattr(hardware, "bf16_gemm_faster", lambda: True)
    assert lin.op_rows() == packed_mod.BF16_OP_ROWS
    mag = ref_w.abs() + 16 * p.scale.float().abs().repeat_interleave(GROUP, dim=1)
    if p.zero is not None:
        mag += p.zero.float().abs().repeat_interleave(GROUP, dim=1)
    for rows in (packed_mod.BF16_OP_ROWS, packed_mod.BF16_OP_ROWS + 72):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        got, want = lin(x), F.linear(x, ref_w)
        assert got.dtype == torch.float32
        assert ((got - want).abs() <= 4 * 2**-8 * (x.abs() @ mag.T)).all()
        assert (got - want).abs().max() > 0  # bfloat16, not the exact product
    x = torch.randn(40, 256)
    torch.testing.assert_close(lin.logits(x), F.linear(x, ref_w), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(hardware, "bf16_gemm_faster", lambda: False)
    x = torch.randn(lin.op_rows() + 1, 256)  # past the op's measured rows: exact again
    torch.testing.assert_close(lin(x), F.linear(x, ref_w), rtol=1e-5, atol=1e-5)


def test_stacked_layers_equal_their_parts():
    ps = [
        quantize(torch.randn(n, 128, generator=torch.Generator().manual_seed(n)), 4)
        for n in (64, 128)
    ]
    mods = [PackedLinear(p, torch.float32) for p in ps]
    fused = PackedLinear.stack(mods)
    x = torch.randn(2, 128)
    torch.testing.assert_close(fused(x), torch.cat([m(x) for m in mods], dim=-1))
    assert (
        PackedLinear.stack(
            [mods[0], PackedLinear(quantize(torch.randn(64, 128), 8), torch.float32)]
        )
        is None
    )


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
    torch.testing.assert_close(emb.logits(torch.ones(2, 64)), torch.ones(2, 64) @ p.dequantize().T)


# ------------------------------------------------------------ whole models, --wtype
def _dense_twin(rt):
    """A dense Transformer with the packed model's weights dequantized (the reference)."""
    from kvrun.models.model import Transformer

    sd = {}
    parts = {"qkv": ["q_proj", "k_proj", "v_proj"], "gate_up": ["gate_proj", "up_proj"]}
    c = rt.config
    sizes = {"qkv": [c.n_heads * c.head_dim] + [c.n_kv_heads * c.head_dim] * 2,
             "gate_up": [c.ffn_dim] * 2}  # fmt: skip
    for name, mod in rt.model.named_modules():
        if isinstance(mod, PackedLinear):
            w = mod.packed.dequantize(torch.float32)
            parent, _, attr = name.rpartition(".")
            if attr not in parts:
                sd[f"{name}.weight"] = w
                continue
            for part, rows in zip(parts[attr], w.split(sizes[attr]), strict=True):
                sd[f"{parent}.{part}.weight"] = rows
    sd.update({k: v for k, v in rt.model.state_dict().items() if k.endswith("norm.weight")})
    return Transformer.from_weights(rt.config, sd, "cpu")


@pytest.mark.parametrize("source,wtype", [("gguf", "q8"), ("gguf", "q4"), ("hf", "q4")])
def test_tiny_model_packed_equals_its_dense_twin(tmp_path, monkeypatch, source, wtype):
    """The packed model (GGUF: Q/K rows un-permuted as packed rows; HF: quantized at load)
    gives the logits of a dense model holding the same dequantized weights."""
    from kvrun.run.runtime import load_runtime
    from tiny_models import build

    tiny = build(tmp_path, tied=source == "gguf")
    path = tiny.gguf_path if source == "gguf" else tiny.hf_dir
    rt = load_runtime(str(path), "float32", "cpu", wtype=wtype)
    assert rt.weights.wtype == wtype
    assert isinstance(rt.model.model.layers[0].self_attn.qkv, PackedLinear)
    assert isinstance(rt.model.model.embed_tokens, PackedEmbedding)
    twin = _dense_twin(rt)
    ids, pos = torch.tensor([[1, 5, 9, 33, 2, 17, 8, 8, 40, 3, 1, 7]]), torch.arange(12)
    with torch.inference_mode():
        # a prefill chunk of more rows than the int4 op takes: the exact (dequantizing) path
        monkeypatch.setattr(packed_mod, "int4_op_rows", lambda dtype: packed_mod.DECODE_ROWS)
        kv, kv_twin = rt.new_kv(), rt.new_kv()
        got = rt.model(ids, pos, kv)
        want = twin(ids, pos, kv_twin)
        # one decode step: the int4 op on bfloat16 activations where the shape allows it
        step = rt.model(torch.tensor([[4]]), torch.tensor([12]), kv)
        step_want = twin(torch.tensor([[4]]), torch.tensor([12]), kv_twin)
        # a short prefill chunk within the op's rows: the op too, within its rounding
        monkeypatch.setattr(packed_mod, "int4_op_rows", lambda dtype: 16)
        short = rt.model(ids, pos, rt.new_kv())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (step - step_want).abs().max() <= 0.05 * step_want.abs().max()
    assert 0 < (short - want).abs().max() <= 0.05 * want.abs().max()
    if wtype == "q8":  # and near the float model (8-bit absmax of its random weights)
        dense = load_runtime(str(path), "float32", "cpu", wtype="f32")
        with torch.inference_mode():
            ref = dense.model(ids, pos, dense.new_kv())
        assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_wtype_and_dtype_conflict_is_one_error():
    from kvrun.run.runtime import pick_dtype

    assert pick_dtype("auto", torch.device("cpu"), "bf16") == torch.bfloat16
    assert pick_dtype("auto", torch.device("cpu"), "q4") == torch.float32
    with pytest.raises(KvrunError, match="--wtype f16"):
        pick_dtype("float32", torch.device("cpu"), "f16")
    with pytest.raises(KvrunError, match="unknown --wtype"):
        pick_dtype("auto", torch.device("cpu"), "q3")


def test_auto_packs_when_dense_would_not_fit(monkeypatch, no_native):
    monkeypatch.setattr(hardware, "available_bytes", lambda device: 10 * 2**20)
    wt, note = matmul_choice.auto_wtype(20 * 2**20, torch.device("cpu"), torch.float32)
    assert wt == "packed" and "would take" in note


def test_synthetic_preset_packed_without_floats():
    from kvrun.models.config import ModelConfig
    from kvrun.models.presets import PRESETS
    from kvrun.models.synthetic import random_weights, weight_bytes
    from kvrun.quant.packed import Packed
    from kvrun.run.runtime import preset_runtime
    from kvrun.tasks.bench import weight_bytes as measured_bytes

    cfg: ModelConfig = PRESETS["tiny-synthetic"]
    tensors = random_weights(cfg, torch.float32, torch.device("cpu"), bits=4)
    assert all(isinstance(v, Packed) for k, v in tensors.items() if not k.endswith("norm.weight"))
    rt = preset_runtime("tiny-synthetic", torch.float32, torch.device("cpu"), wtype="q4")
    planes = matmul_choice.matmul_path("cpu", torch.float32) == "int4pack"
    assert measured_bytes(rt.model) == weight_bytes(cfg, torch.float32, 4, planes)
    kv = rt.new_kv()
    with torch.inference_mode():
        out = rt.model(torch.tensor([[1, 2, 3]]), torch.arange(3), kv)
        step = rt.model(torch.tensor([[4]]), torch.tensor([3]), kv)
    assert out.shape == (1, 3, cfg.vocab_size) and step.shape == (1, 1, cfg.vocab_size)
    assert torch.isfinite(step).all() and out.std() > 0
    # the 8B shape at q4: codes + fp16 scale/zero per 32 = 5 bits a weight (6 with the CPU
    # int4 planes' bf16 scales), under 6 GB
    assert weight_bytes(PRESETS["llama3-8b-synthetic"], torch.float32, 4) < 5.1e9
    assert weight_bytes(PRESETS["llama3-8b-synthetic"], torch.float32, 4, True) < 6.0e9


@pytest.mark.parametrize("bits", [4, 8])
def test_scratch_dequantize_equals_reference(bits):
    """The fast in-place dequantization (int32 nibble masks, reused buffers) against
    Packed.dequantize, for whole tensors, row slices and gathered rows, twice (reuse)."""
    from kvrun.quant.linear import DequantBuffers

    sc = DequantBuffers()
    p = quantize(torch.randn(48, 192, generator=torch.Generator().manual_seed(4)), bits)
    for part in (p, p.rows(slice(5, 20)), p.rows(torch.tensor([3, 3, 40, 0]))):
        for _ in range(2):
            assert torch.equal(sc.dequantize(part, torch.float32), part.dequantize())
    assert sc.dequantize(p, torch.bfloat16).dtype == torch.bfloat16


def test_q4_on_columns_off_the_group_is_one_line(tmp_path, monkeypatch):
    """A model whose rows are not whole groups cannot be packed: one line naming the tensor
    and the dense --wtype to use, exit 1 (the group is shrunk to fit the tiny model's 64)."""
    from cli_checks import one_error_line
    from click.testing import CliRunner

    from kvrun.cli.main import cli
    from kvrun.models import weights
    from tiny_models import build

    tiny = build(tmp_path)
    monkeypatch.setattr(weights, "GROUP", 48)
    for path in (tiny.gguf_path, tiny.hf_dir):
        args = ["generate", "-m", str(path), "-p", "hi", "-n", "2", "--wtype", "q4"]
        r = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert r.exit_code == 1
        one_error_line(r, "group size 48", "--wtype f32")
    r = CliRunner().invoke(cli, ["generate", "-p", "hi", "--wtype", "q3"])
    assert r.exit_code == 2 and "q3" in r.output


def _layer(n: int, k: int, seed: int, int4: bool = True) -> PackedLinear:
    p = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1, 4)
    lin = PackedLinear(p, torch.float32)
    assert not int4 or lin.use_int4pack()
    return lin


def test_op_arguments_follow_the_buffers():
    """The int4 op's arguments are kept as plain attributes (a decode step makes ~120
    products); replacing the buffers (Module._apply: .to(), .cuda()) rebinds them."""
    lin = _layer(128, 256, 1)
    x = torch.randn(1, 256)
    want = lin(x)
    lin._apply(lambda t: t.clone())
    assert lin._op.planes[0] is lin.w0 and lin._op.sz[0] is lin.sz0
    torch.testing.assert_close(lin(x), want, rtol=0, atol=0)


def test_bfloat16_products_chain_through_the_op():
    """A bfloat16 x through the CPU int4 op comes back bfloat16, the same product a float32
    x gets (the op casts to bfloat16 first); `bf16_op` names the products that chain, and
    the MLP of a decode step chains gate/up -> silu * up -> down in bfloat16, within a
    bfloat16 rounding of the float32 chain."""
    from types import SimpleNamespace

    from kvrun.models.model import MLP

    lin = _layer(128, 256, 2)
    x = torch.randn(1, 3, 256)
    got = lin(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), lin(x), rtol=0, atol=0)
    assert lin.bf16_op(lin.op_rows()) and not lin.bf16_op(lin.op_rows() + 1)
    assert not _layer(64, 64, 6, int4=False).bf16_op(1)

    mlp = MLP(SimpleNamespace(dim=256, ffn_dim=512, act="silu"))
    mlp.gate_up = PackedLinear.stack([_layer(512, 256, s, int4=False) for s in (3, 4)])
    mlp.gate_up.use_int4pack()
    mlp.down_proj = _layer(256, 512, 5)
    x = torch.randn(1, 2, 256)
    got = mlp(x)  # decode-sized: the bfloat16 chain
    assert got.dtype == torch.bfloat16
    gate, up = mlp.gate_up(x).chunk(2, dim=-1)  # the float32 chain
    want = mlp.down_proj(F.silu(gate) * up)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    rows = torch.randn(mlp.down_proj.op_rows() + 1, 256)
    assert mlp(rows).dtype == torch.float32  # beyond a decode step: float32 as before
    assert mlp(x.half()).dtype == torch.float16  # a float16 model keeps its casts


@pytest.mark.parametrize("shape", [(64, 32), (128, 576), (320, 1536)])
def test_byte_packing_matches_the_ops_own(shape):
    """`pack_cpu` (byte ops) gives the bytes of PyTorch's int4 conversion for CPU, and a
    product through the op on them equals the product on the op's own packing."""
    q = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(shape[0]))
    ours, ref = int4mm.pack_cpu(q), pack_cpu_op(q)
    assert ours.dtype == torch.uint8 and torch.equal(ours, ref)
    for group in (32, 64):  # straight from a Packed's canonical bytes (Q4_0's nibble order)
        if shape[1] % group == 0:
            assert torch.equal(int4mm.pack_cpu_nibbles(pack_nibbles(q, group), group), ref)
    sz = int4mm.scales_zeros(torch.rand(shape[0], shape[1] // 32), None, torch.bfloat16)
    x = torch.randn(3, shape[1], dtype=torch.bfloat16)
    assert torch.equal(int4mm.mm(x, [ours], [sz], 32), int4mm.mm(x, [ref], [sz], 32))


def test_short_prefill_products_take_the_op_up_to_the_crossover(monkeypatch):
    """CPU products of up to `op_rows()` rows (decode steps and short prefill chunks) go
    through the int4 op, longer ones dequantize exactly; the crossover is the measured one
    (`packed.int4_op_rows`, here pinned to 24), never below a decode step's rows."""
    monkeypatch.setattr(packed_mod, "int4_op_rows", lambda dtype: 24)
    lin = _layer(128, 256, 8)
    ref = lin.packed.dequantize()
    assert lin.op_rows() == 24
    for rows, via_op in ((1, True), (8, True), (24, True), (25, False), (64, False)):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        err = (lin(x) - F.linear(x, ref)).abs().max()
        assert (err > 0) == via_op and err < 0.05 * F.linear(x, ref).abs().max()
        assert lin.bf16_op(rows) == via_op


def test_op_rows_probe_finds_the_crossover_and_is_recorded(monkeypatch, tmp_path):
    """The crossover is the largest step where the op beats the exact path (a decode step's
    rows where it never does), measured once and then read from the probe record; a
    damaged record is measured again, and KVRUN_PROBES=fresh always measures."""
    from kvrun.quant import probes

    monkeypatch.setenv("KVRUN_CACHE", str(tmp_path))
    wins = {"upto": 32}
    timed = []

    def faster(a, b, reps=15):
        rows = packed_mod.OP_ROW_STEPS[len(timed)]
        timed.append(rows)
        return rows <= wins["upto"]

    # the real probes run here (the suite otherwise reads them from the probe record)
    assert matmul_choice.measure_path("cpu", torch.float32) in ("int4pack", "dequant")
    assert hardware._time_bf16_gemm() in ("yes", "no")
    real = packed_mod._measure_op_rows(torch.float32)
    assert real in (packed_mod.DECODE_ROWS, *packed_mod.OP_ROW_STEPS)
    monkeypatch.setattr(hardware, "faster", faster)
    assert packed_mod._measure_op_rows(torch.float32) == 32
    assert timed == [16, 24, 32, 48]  # stops at the first loss
    timed.clear()
    wins["upto"] = 0
    assert packed_mod._measure_op_rows(torch.float32) == packed_mod.DECODE_ROWS
    calls = []

    def measure():
        calls.append(1)
        return "48"

    probe = "int4 op rows cpu float32"
    assert probes.measured(probe, measure, str.isdigit) == "48"
    assert probes.measured(probe, measure, str.isdigit) == "48" and len(calls) == 1
    probes.record(probe, "garbage")
    assert probes.measured(probe, measure, str.isdigit) == "48" and len(calls) == 2
    monkeypatch.setenv("KVRUN_PROBES", "fresh")
    assert probes.measured(probe, measure, str.isdigit) == "48" and len(calls) == 3
