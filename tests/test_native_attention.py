"""The native attention driver (kernels/cpu/qops.cpp split_keys) against the torch path
(kvrun.kv.attention.segment_attention): one query row and a prefill chunk's rows, every key
visible, output and log-sum-exp."""

from __future__ import annotations

import pytest
import torch
from native_attention import HEADS, LENGTHS, isa, needs_native, ops, threads  # noqa: F401

from kvrun.kv.attention import segment_attention

pytestmark = needs_native


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("T", [0, *LENGTHS])
@pytest.mark.parametrize("Tq", [1, 5])
def test_attn_partial_matches_torch(Hq, Hkv, D, T, Tq, isa, threads):  # noqa: F811
    g = torch.Generator().manual_seed(Hq * 1000 + T * 10 + Tq)
    q = torch.randn(1, Hq, Tq, D, generator=g)
    k = torch.randn(1, Hkv, T, D, generator=g)
    v = torch.randn(1, Hkv, T, D, generator=g)
    out, lse = ops.attn_partial(q, k, v, D**-0.5)
    ref = segment_attention(q, k, v)
    torch.testing.assert_close(out, ref.out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref.lse, atol=2e-6, rtol=1e-5)
