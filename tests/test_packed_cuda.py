"""Packed q4 weights on CUDA (`torch.ops.aten._weight_int4pack_mm`, bfloat16 tensor-core tiles):
products and gathers against the dequantized weights. Runs on a GPU only (`bash bench/gpu.sh
smoke` runs it there); the CPU int4 path is tested in test_packed.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrun.quant import int4mm
from kvrun.quant.formats import GROUP
from kvrun.quant.linear import PackedEmbedding, PackedLinear
from kvrun.quant.packed import quantize

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA int4 op needs a GPU"
)


def _packed(n: int, k: int, seed: int = 3):
    p = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), 4)
    p.exact = True  # as an exactly mapped GGUF type (Q4_1): the float16 scales are kept
    return p


def _bound(x: torch.Tensor, p) -> torch.Tensor:
    """A few bfloat16 roundings (2^-8 relative each) per product term, as on the CPU op."""
    zero = (p.zero.float() + 8 * p.scale.float()).abs().repeat_interleave(GROUP, dim=1)
    mag = p.dequantize().abs() + zero
    return 6 * 2**-8 * (x.abs().float() @ mag.T.to(x.device)) + 1e-2


@pytest.mark.parametrize("rows", [1, 8, 33, 512])
def test_cuda_int4_products_within_bfloat16_rounding(rows):
    n, k = 256, 2048  # the op wants K % 1024 == 0 and N % 8 == 0
    p = _packed(n, k)
    assert int4mm.cuda_supported(n, k, GROUP, torch.bfloat16)
    lin = PackedLinear(p, torch.bfloat16).to("cuda")
    assert lin.use_int4pack() and lin.path == "int4pack" and lin.n_planes == 1
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    got = lin(x).float()
    want = F.linear(x.float(), p.dequantize().to("cuda"))
    assert got.shape == (rows, n)
    assert ((got - want).abs() <= _bound(x, p)).all()


def test_cuda_int4_embedding_gathers_the_dequantized_rows():
    p = _packed(512, 1024, seed=5)
    emb = PackedEmbedding(p, torch.bfloat16).to("cuda")
    assert emb.use_int4pack()
    ids = torch.tensor([[5, 0, 511], [64, 63, 5]], device="cuda")
    want = F.embedding(ids.cpu(), p.dequantize()).to(torch.bfloat16)
    torch.testing.assert_close(emb(ids).cpu().float(), want.float(), rtol=1e-2, atol=1e-2)


def test_shapes_the_cuda_op_refuses_stay_on_the_dequant_path():
    p = _packed(256, 96)  # K not a multiple of 1024
    lin = PackedLinear(p, torch.bfloat16).to("cuda")
    assert not lin.use_int4pack() and lin.path == "dequant"
    x = torch.randn(3, 96, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), p.dequantize().to("cuda"))
    torch.testing.assert_close(lin(x).float(), want, rtol=2e-2, atol=2e-2)
