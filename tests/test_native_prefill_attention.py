"""A prefill chunk's attention on the native kernels (kvrun.kv.attention.native_attention, the
op attn_colsum with no column sums) against PyTorch's SDPA with the mask the torch path builds:
causal by slot, every key, and by positions (per-head positions with padding, a window), on the
shared head shapes, odd lengths, every instruction set here and 1 or 2 threads; where it does
not apply it hands back None (the caller's SDPA, bit for bit as before); and `full`'s prefill on
the tiny model with the kernels set against the same run without them."""

from __future__ import annotations

import pytest
import torch
from native_attention import HEADS, isa, needs_native, ops, threads  # noqa: F401
from test_kv_methods import drive, new_kv, prompt, tiny
from test_native_scores import TOL, qkv

from kvrun.kv.attention import dense_attention, native_attention, position_mask, sdpa
from kvrun.kv.stores.dense import PAD

pytestmark = needs_native


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("Tq,T", [(2, 2), (7, 7), (33, 250), (250, 250), (64, 1027)])
def test_causal_by_slot_and_every_key(Hq, Hkv, D, Tq, T, isa, threads):  # noqa: F811
    q, k, v = qkv(Hq, Hkv, D, Tq, T, seed=Tq * 7 + T)
    rows = torch.arange(T - Tq, T)[:, None]
    causal = torch.arange(T)[None, :] <= rows  # the rows the last Tq slots (a prefill chunk)
    got = native_attention(ops, q, k, v)
    torch.testing.assert_close(got.out, sdpa(q, k, v, causal), **TOL)
    ref = sdpa(q.double(), k.double(), v.double(), causal)  # and its log-sum-exp
    g = Hq // Hkv
    s = torch.einsum("hgqd,hkd->hgqk", q[0].double().view(Hkv, g, Tq, D), k[0].double()) * D**-0.5
    lse = s.masked_fill(~causal, float("-inf")).logsumexp(-1).reshape(1, Hq, Tq)
    torch.testing.assert_close(got.lse.double(), lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.out.double(), ref, atol=1e-5, rtol=1e-5)
    every = native_attention(ops, q, k, v, causal=False)
    torch.testing.assert_close(every.out, sdpa(q, k, v), **TOL)


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("window", [None, 1, 40])
@pytest.mark.parametrize("per_head", [False, True])
def test_by_positions(Hq, Hkv, D, window, per_head, isa, threads):  # noqa: F811
    """Positions as dense_attention takes them: (T,) or (Hkv, T) with padding slots, a window."""
    Tq, T = 19, 133
    q, k, v = qkv(Hq, Hkv, D, Tq, T, seed=D + Hq + (window or 0))
    qpos = torch.arange(T - Tq, T) + 3
    if per_head:
        g = torch.Generator().manual_seed(5)
        kpos = torch.stack([torch.randperm(T, generator=g) + 3 for _ in range(Hkv)])
        kpos[:, -4:] = PAD  # a head holding fewer slots: padding no row sees
    else:
        kpos = torch.arange(T) + 3
    mask = position_mask(qpos, kpos, window)
    if mask is not None and mask.dim() == 3:
        mask = mask.repeat_interleave(Hq // Hkv, dim=0)
    ref = sdpa(q, k, v, mask)
    got = dense_attention(q, k, v, qpos, kpos, window, ops)
    torch.testing.assert_close(got, ref, **TOL)


def test_where_it_does_not_apply():
    q, k, v = qkv(9, 3, 64, 5, 20, seed=1)
    assert native_attention(None, q, k, v) is None  # no kernels: the exact path
    assert native_attention(ops, q[:, :, :1], k, v) is None  # one row: the decode kernels'
    assert native_attention(ops, q.double(), k.double(), v.double()) is None
    assert native_attention(ops, q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v) is None
    # and dense_attention without kernels is SDPA's, bit for bit
    qpos, kpos = torch.arange(15, 20), torch.arange(20)
    mask = position_mask(qpos, kpos)
    assert torch.equal(dense_attention(q, k, v, qpos, kpos), sdpa(q, k, v, mask))


@pytest.mark.parametrize(
    "spec",
    ["full", "snapkv:window=8", "kivi2:residual=32", "spindlekv", "minicache", "tova", "h2o"]
    + ["tova:scope=head"],
)
def test_prefill_with_the_kernels_set(spec):
    """The tiny model's prefill (chunks of 32) and decode with the managers' kernels set, against
    the same managers without them: logits within rounding. A second turn follows the first's
    selection (the stores that hold positions: older slots at scattered positions, the chunk's
    rows still seeing by slot what they see by position)."""
    m = tiny()
    outs = []
    for kernels in (ops, None):
        m.rope.kernels = kernels
        try:
            kv = new_kv(m, spec, None if spec == "minicache" else "0.5")
            first = drive(m, kv, prompt(90, seed=4), 32, n_decode=4)
            outs.append(torch.cat([first, drive(m, kv, prompt(40, seed=5), 32, n_decode=2)]))
        finally:
            m.rope.kernels = None
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)


def test_chunks_see_by_slot_only_where_positions_agree():
    """DenseSeg._as_slots: a store holding positions attends a chunk by slot only where that
    is what its positions say (no window, its own tokens last at their positions, every older
    slot earlier); the rest by positions."""
    from kvrun.kv.stores.dense import DenseSeg

    seg = DenseSeg(2, 8, torch.float32, "cpu", pos_rows=2)
    old = torch.tensor([0, 3, 5])
    seg.append(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), old)
    own = torch.tensor([9, 10])
    seg.append(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), own)
    assert seg._as_slots(own, 2, None)
    assert not seg._as_slots(own, 2, 4)  # a window: by positions
    assert not seg._as_slots(torch.tensor([10, 11]), 2, None)  # not the own slots' positions
    assert not seg._as_slots(own, 1, None)
    late = DenseSeg(2, 8, torch.float32, "cpu", pos_rows=1)
    late.append(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), torch.tensor([20, 21]))
    late.append(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), torch.tensor([7, 8]))
    assert not late._as_slots(torch.tensor([7, 8]), 2, None)  # an older slot is later
