"""Attention that keeps its probabilities on the native kernels (kernels/cpu/tova_attn.h and the
ops attn_probs, rope_append_probs, attn_colsum, evict_one) against the torch path: the kernels
on the shared shapes, ISAs and threads; then TOVA, H2O, StreamingLLM, MiniKV and KVzip on the
tiny model with the native kernels against the same caches without them (kept positions at
every point, logits), the oracles of test_tova.py and test_kv_methods.py run natively, and the
decode step's eviction that writes over a slot against the compaction it replaces."""

from __future__ import annotations

import math

import pytest
import test_kv_methods as methods
import test_tova
import torch
from native_attention import HEADS, LENGTHS, isa, needs_native, ops, threads  # noqa: F401
from test_kv_methods import Events, drive, new_kv, prompt, tiny

from kvrun.kernels.colsum import colsum_ref
from kvrun.kv import build, check
from kvrun.kv.attention import attention_colsum, position_mask, segment_attention
from kvrun.kv.cache import keep_indices
from kvrun.kv.stores.dense import DenseSeg
from kvrun.run import kvc

pytestmark = needs_native
TOL = {"atol": 2e-6, "rtol": 1e-5}


def qkv(Hq, Hkv, D, Tq, T, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hq, Tq, D, generator=g)
    return q, torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)


# --- the kernels ------------------------------------------------------------------------------
@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("T", [0, *LENGTHS])
def test_attn_probs_matches_torch(Hq, Hkv, D, T, isa, threads):  # noqa: F811
    """A decode row: the output, the probabilities it used and acc += them (per KV head's
    group, or per query head) as the torch path computes them."""
    q, k, v = qkv(Hq, Hkv, D, 1, T, Hq * 1000 + T)
    acc, per_q = torch.rand(Hkv, T), torch.rand(Hq, T)
    acc0, per_q0 = acc.clone(), per_q.clone()
    out, p = ops.attn_probs(q, k, v, D**-0.5, acc)
    ops.attn_probs(q, k, v, D**-0.5, per_q)
    ref_out, col = attention_colsum(q, k, v, None)
    s = torch.einsum("hd,htd->ht", q[0, :, 0], k[0].repeat_interleave(Hq // Hkv, 0)) / math.sqrt(D)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(p, torch.softmax(s, -1), **TOL)
    torch.testing.assert_close(acc, acc0 + col, **TOL)
    torch.testing.assert_close(per_q, per_q0 + torch.softmax(s, -1), **TOL)


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("n", [0, 7, 250])
def test_rope_append_probs_is_rope_append_attend_with_probs(Hq, Hkv, D, n, isa):  # noqa: F811
    """The fused step writes the same slot and gives the same output as rope_append_attend,
    the probabilities of attn_probs over the written buffers, the position appended and acc
    with the new slot's 0 then the probabilities added."""
    q, k, v = qkv(Hq, Hkv, D, 1, 1, n)
    kb, vb = torch.randn(1, Hkv, n + 3, D), torch.randn(1, Hkv, n + 3, D)
    cos, ssin = torch.randn(n + 5, D), torch.randn(n + 5, D)
    pos, acc = torch.arange(n, dtype=torch.int32)[None].repeat(Hkv, 1), torch.rand(Hkv, n)
    kb2, vb2 = kb.clone(), vb.clone()
    want = ops.rope_append_attend(q, k, v, cos, ssin, n + 2, kb2, vb2, n, D**-0.5)
    out, p, qr, rows, acc2 = ops.rope_append_probs(
        q, k, v, cos, ssin, n + 2, kb, vb, n, D**-0.5, pos, acc
    )
    assert torch.equal(kb, kb2) and torch.equal(vb, vb2)
    torch.testing.assert_close(out, want, **TOL)
    assert torch.equal(qr, ops.rope(q, cos[n + 2][None, None], ssin[n + 2][None, None]))
    ref_out, ref_p = ops.attn_probs(qr, kb[:, :, : n + 1], vb[:, :, : n + 1], D**-0.5)
    torch.testing.assert_close(p, ref_p, **TOL)
    assert rows.tolist() == [list(range(n)) + [n + 2]] * Hkv
    torch.testing.assert_close(acc2, torch.cat([acc, torch.zeros(Hkv, 1)], 1) + col_of(p, Hkv))


TYPES = {"f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2}  # --kv-dtype: the kernels' codes


def typed(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 rows -> (the rows in KV type `name`, those rows decoded back to float32)."""
    rows = ops.kv_encode(x, TYPES[name])
    return rows, ops.kv_decode(rows, TYPES[name], x.shape[-1])


@pytest.mark.parametrize("kv_type", TYPES)
@pytest.mark.parametrize("Hq,Hkv,D", HEADS[::2])
@pytest.mark.parametrize("T", [1, *LENGTHS])
def test_attn_probs_reads_typed_rows(kv_type, Hq, Hkv, D, T, isa, threads):  # noqa: F811
    """K/V held in a KV type (f16, bf16, llama.cpp's q8_0 / q4_0): the output, probabilities
    and acc of attn_probs over the same rows decoded to float32."""
    q, k, v = qkv(Hq, Hkv, D, 1, T, Hq * 100 + T)
    (kt, kf), (vt, vf) = typed(k, kv_type), typed(v, kv_type)
    acc = torch.rand(Hkv, T)
    ref_acc = acc.clone()
    out, p = ops.attn_probs(q, kt, vt, D**-0.5, acc, TYPES[kv_type])
    ref_out, ref_p = ops.attn_probs(q, kf, vf, D**-0.5, ref_acc)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(p, ref_p, **TOL)
    torch.testing.assert_close(acc, ref_acc, **TOL)


@pytest.mark.parametrize("kv_type", TYPES)
@pytest.mark.parametrize("n", [0, 7, 250])
def test_rope_append_probs_writes_typed_rows(kv_type, n, isa):  # noqa: F811
    """The fused step over typed buffers writes the rows rope_append_attend writes in that
    type and gives attn_probs' output and probabilities over them."""
    Hq, Hkv, D, code = 6, 2, 64, TYPES[kv_type]
    q, k, v = qkv(Hq, Hkv, D, 1, 1, n)
    kb, vb = (
        typed(torch.randn(1, Hkv, n + 3, D), kv_type)[0],
        typed(torch.randn(1, Hkv, n + 3, D), kv_type)[0],
    )
    cos, ssin = torch.randn(n + 5, D), torch.randn(n + 5, D)
    kb2, vb2 = kb.clone(), vb.clone()
    want = ops.rope_append_attend(q, k, v, cos, ssin, n + 2, kb2, vb2, n, D**-0.5, code)
    out, p, qr, _, _ = ops.rope_append_probs(
        q, k, v, cos, ssin, n + 2, kb, vb, n, D**-0.5, None, None, code
    )
    assert torch.equal(kb, kb2) and torch.equal(vb, vb2)
    torch.testing.assert_close(out, want, **TOL)
    ref_out, ref_p = ops.attn_probs(qr, kb[:, :, : n + 1], vb[:, :, : n + 1], D**-0.5, None, code)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(p, ref_p, **TOL)


def col_of(p: torch.Tensor, Hkv: int) -> torch.Tensor:
    return p.view(Hkv, -1, p.shape[1]).sum(1)


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("Tq", [1, 37])
def test_attn_colsum_matches_colsum_ref(Hq, Hkv, D, T, Tq, isa, threads):  # noqa: F811
    """A prefill chunk causal by slot (MiniKV's column sums): out, lse and the sums per KV head
    or per query head, with earlier segments' log-sum-exp renormalising them."""
    Tq = min(Tq, T)  # the queries are the last Tq of the T slots
    q, k, v = qkv(Hq, Hkv, D, Tq, T, T * 10 + Tq)
    other = torch.randn(Hq, Tq, generator=torch.Generator().manual_seed(T))
    for per_head, oth in [(False, None), (True, other), (False, other)]:
        out, lse, col = ops.attn_colsum(q, k, v, D**-0.5, other=oth, per_head=per_head)
        ref_out, ref_lse, ref_col = colsum_ref(q, k, v, per_head, oth)
        torch.testing.assert_close(out, ref_out, **TOL)
        torch.testing.assert_close(lse[0], ref_lse, **TOL)
        torch.testing.assert_close(col, ref_col, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("window", [0, 20])
def test_attn_colsum_by_position_matches_attention_colsum(Hq, Hkv, D, T, window, isa):  # noqa: F811
    """Slots in any order, visible by position (H2O's chunks; a window): out, lse and the sums
    of the torch path; a row that sees no key gives 0 and -inf and adds nothing (torch: NaN)."""
    Tq = min(T, 9)
    q, k, v = qkv(Hq, Hkv, D, Tq, T, T + window)
    g = torch.Generator().manual_seed(T)
    kpos = torch.stack([torch.randperm(T + 4, generator=g)[:T] for _ in range(Hkv)]).int()
    qpos = torch.arange(T - Tq, T) + 2
    out, lse, col = ops.attn_colsum(q, k, v, D**-0.5, kpos, qpos, window)
    mask = position_mask(qpos, kpos.long(), window or None)  # (Hkv, Tq, T)
    if mask is None:  # every key seen
        mask = torch.ones(Hkv, Tq, T, dtype=torch.bool)
    ref = segment_attention(q, k, v, mask)
    p = torch.exp(
        torch.einsum("hgqd,htd->hgqt", q[0].view(Hkv, -1, Tq, D), k[0]) / math.sqrt(D)
        - ref.lse[0].view(Hkv, -1, Tq, 1)
    ).masked_fill(~mask[:, None], 0.0)
    torch.testing.assert_close(out, ref.out, **TOL)
    torch.testing.assert_close(lse, ref.lse, **TOL)
    torch.testing.assert_close(col, p.sum(dim=(1, 2)), atol=1e-5, rtol=1e-5)
    assert (out[lse == -math.inf] == 0).all()


@pytest.mark.parametrize("Hq,Hkv,D", HEADS)
@pytest.mark.parametrize("T", [7, 250, 1027])
def test_attn_colsum_max_and_attention_alone(Hq, Hkv, D, T, isa):  # noqa: F811
    """mode 1: each key's largest probability over the rows and heads (KVzip's score, no
    values read); mode 2: the attention alone, causal or every key seen."""
    Tq = min(T, 40)
    q, k, v = qkv(Hq, Hkv, D, Tq, T, T)
    s = torch.einsum("hqd,htd->hqt", q[0], k[0].repeat_interleave(Hq // Hkv, 0)) / math.sqrt(D)
    rows = torch.arange(T - Tq, T)
    p = torch.softmax(s.masked_fill(torch.arange(T)[None] > rows[:, None], -math.inf), -1)
    want = p.view(Hkv, Hq // Hkv, Tq, T).amax(dim=(1, 2))
    torch.testing.assert_close(ops.attn_colsum(q, k, None, D**-0.5, mode=1)[2], want, **TOL)
    out, lse, col = ops.attn_colsum(q, k, v, D**-0.5, mode=2)
    ref_out, ref_lse, _ = colsum_ref(q, k, v)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert col.numel() == 0
    out, lse, _ = ops.attn_colsum(q, k, v, D**-0.5, mode=2, causal=False)
    ref = segment_attention(q, k, v)
    torch.testing.assert_close(out, ref.out, **TOL)
    torch.testing.assert_close(lse, ref.lse, **TOL)


@pytest.mark.parametrize("rows,Hkv", [(1, 3), (3, 3), (2, 2)])
@pytest.mark.parametrize("first,last", [(0, 1), (2, 5), (0, 0), (3, 0), (4, 40)])
def test_evict_one_ranks_as_keep_indices_in_position_order(rows, Hkv, first, last):
    """The slot evict_one drops is the one keep_indices leaves out, ranking in position order
    (ties common: scores in steps of 1/4); K, V, positions and acc move the last slot into
    it; protection reaching every slot still drops exactly one."""
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        n, C = 37, 37 - seed % 3
        pos = torch.stack([torch.randperm(60, generator=g)[:n] for _ in range(rows)]).int()
        scores = torch.randint(0, 8, (rows, C), generator=g).float() / 4
        kb, vb = (
            torch.randn(1, Hkv, n + 2, 8, generator=g),
            torch.randn(1, Hkv, n + 2, 8, generator=g),
        )
        acc = torch.randn(2 * Hkv, n, generator=g)
        order = pos.argsort(dim=1)  # position order, as the compacting path holds the slots
        padded = torch.cat([scores, torch.full((rows, n - C), math.inf)], 1).gather(1, order)
        j = torch.arange(n)
        protected = ((j < first) | (j >= n - last))[None]
        kept = order.gather(1, keep_indices(padded, protected, n - 1))  # (rows, n - 1) slots
        want_out = [sorted(set(range(n)) - set(r.tolist())) for r in kept]
        before = (kb.clone(), vb.clone(), pos.clone(), acc.clone())
        out = ops.evict_one(scores, pos, first, last, kb, vb, n, acc)
        assert [[int(x)] for x in out] == want_out
        for h in range(Hkv):
            r, s = (0 if rows == 1 else h), int(out[0 if rows == 1 else h])
            kept_slots = [x for x in range(n) if x != s]
            moved = list(range(n - 1))  # slot x after: x itself, or the last slot where x = s
            src = [x if x != s else n - 1 for x in moved]
            assert sorted(src) == kept_slots
            assert torch.equal(kb[0, h, : n - 1], before[0][0, h, src])
            assert torch.equal(vb[0, h, : n - 1], before[1][0, h, src])
            assert torch.equal(pos[r, : n - 1], before[2][r, src])
        if seed % 5 == 0:  # rows in a KV type: the same slots move, byte for byte
            pos2, q8 = before[2].clone(), typed(before[0][..., :n, :].repeat(1, 1, 1, 4), "q8_0")[0]
            q8_before = q8.clone()
            ops.evict_one(scores, pos2, first, last, q8, q8.clone(), n, None)
            for h in range(Hkv):
                s_ = int(out[0 if rows == 1 else h])
                src = [x if x != s_ else n - 1 for x in range(n - 1)]
                assert torch.equal(q8[0, h, : n - 1], q8_before[0, h, src])
            assert torch.equal(acc[2 * h : 2 * h + 2, : n - 1], before[3][2 * h : 2 * h + 2, src])


# --- the methods on the tiny model -------------------------------------------------------------
@pytest.fixture
def native_tiny():
    """The tiny models' RoPE carrying the native kernels (what a model whose products run
    natively hands its caches), taken off again after the test."""
    models = [tiny(4), tiny(6)]
    for m in models:
        m.rope.kernels = ops
    yield
    for m in models:
        m.rope.kernels = None


def run(model, spec, budget, kernels, turns, monkeypatch=None, dtype=None):
    """Turns [(ids, ubatch, tokens)] through one cache (dtype: its --kv-dtype, None the
    model's): (logits, events, cache)."""
    model.rope.kernels = kernels
    try:
        ev = Events()
        if dtype is None:
            kv = new_kv(model, spec, budget, hook=ev)
        else:
            kv = build(check(spec, budget).with_dtype(dtype), model.config, model.rope, "cpu",
                       torch.float32, on_select=ev)  # fmt: skip
        ev.kv = kv
        out = [drive(model, kv, ids, ub, len(t), tokens=t) for ids, ub, t in turns]
    finally:
        model.rope.kernels = None
    return torch.cat(out), list(ev), kv


SPECS = [
    ("tova", "0.3"), ("tova", "20"), ("tova:scope=head", "0.3"), ("tova:scope=head", "17"),
    ("h2o", "0.3"), ("h2o", "24"), ("h2o:sinks=2", "0.3"), ("h2o:recent=0.25", "21"),
    ("streaming", "0.3"), ("streaming:sinks=0", "17"),
]  # fmt: skip
TURNS = [(prompt(61, seed=21), 16, prompt(30, seed=2)), (prompt(23, seed=9), 8, prompt(12, seed=4))]


@pytest.mark.parametrize("n_heads", [4, 6])
@pytest.mark.parametrize("spec,budget", SPECS)
def test_native_keeps_what_torch_keeps(n_heads, spec, budget, monkeypatch):
    """Two turns (the second's prefill selects over slots that decode steps put out of
    position order): the native caches keep the positions the torch path keeps at every
    point, and give its logits."""
    m = tiny(n_heads)
    want, want_ev, _ = run(m, spec, budget, None, TURNS)
    evict, written = DenseSeg.evict_one, []
    monkeypatch.setattr(DenseSeg, "evict_one", lambda *a: written.append(evict(*a)) or written[-1])
    got, got_ev, kv = run(m, spec, budget, ops, TURNS)
    assert got_ev == want_ev and len(got_ev) > 60
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert sum(written) >= 30 * len(kv.layers)  # every step wrote over a slot


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("spec,budget", SPECS[::2])
def test_native_keeps_what_torch_keeps_in_a_kv_type(dtype, spec, budget, monkeypatch):
    """The same over a cache in a KV type (the CPU's default is f16): the step's probabilities
    come from the typed rows natively, and evictions write over typed slots."""
    m = tiny(4)
    want, want_ev, _ = run(m, spec, budget, None, TURNS, dtype=dtype)
    evict, written = DenseSeg.evict_one, []
    monkeypatch.setattr(DenseSeg, "evict_one", lambda *a: written.append(evict(*a)) or written[-1])
    got, got_ev, kv = run(m, spec, budget, ops, TURNS, dtype=dtype)
    assert all(st.dense.kv_type is not None for st in kv.layers)
    assert got_ev == want_ev and len(got_ev) > 60
    # a rotated key that differs in its last float32 bit may round to the next f16 / q8_0 step
    # (q8_0's is 1/127 of the block's largest value): the kept sets above are the exact check
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    if not spec.startswith("streaming"):
        assert written.count(True) >= 30 * len(kv.layers)  # steps wrote over typed slots


@pytest.mark.parametrize("spec,budget", SPECS[:6])
def test_writing_over_a_slot_equals_compaction(spec, budget, monkeypatch):
    """The native step that writes the newest token over the evicted slot keeps the positions
    and gives the logits of the native step that compacts the cache (DenseSeg.keep)."""
    m = tiny(4)
    got, got_ev, _ = run(m, spec, budget, ops, TURNS)
    monkeypatch.setattr(DenseSeg, "evict_one", lambda self, *a: False)
    want, want_ev, kv = run(m, spec, budget, ops, TURNS)
    assert got_ev == want_ev
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(st.dense.in_order() for st in kv.layers)


@pytest.mark.parametrize("n_heads,spec,budget", test_tova.CASES)
def test_tova_oracle_natively(n_heads, spec, budget, native_tiny):
    test_tova.test_tova_matches_naive_oracle(n_heads, spec, budget)


@pytest.mark.parametrize("spec,budget", [("tova", "0.3"), ("tova:scope=head", "20")])
def test_tova_later_turn_natively(spec, budget, native_tiny):
    test_tova.test_tova_later_turn(spec, budget)


@pytest.mark.parametrize(
    "n_heads,opts,budget,recent,sinks",
    [(4, "", "0.3", "0.5", 0), (6, "", "0.3", "0.5", 0), (4, ":sinks=2", "0.3", "0.5", 2),
     (4, ":recent=0.25", "21", "0.25", 0)],
)  # fmt: skip
def test_h2o_oracle_natively(n_heads, opts, budget, recent, sinks, native_tiny):
    methods.test_h2o_matches_naive_oracle(n_heads, opts, budget, recent, sinks)


@pytest.mark.parametrize(
    "spec,budget",
    [("minikv", None), ("minikv:quant=none", "0.4"), ("minikv:gqa_agg=max", None),
     ("kvzip", "0.3"), ("kvzip:scope=layer", "0.3"), ("kvzip:chunk=16", "0.3")],
)  # fmt: skip
def test_prefill_column_sums_natively(spec, budget):
    """MiniKV's column sums and KVzip's reconstruction pass on the native kernels: the kept
    sets and logits of the torch path, over two turns (MiniKV's second turn renormalises over
    the first's store)."""
    m = tiny(4)
    turns = [(prompt(61, seed=3), 16, prompt(8, seed=3)), (prompt(20, seed=5), 16, prompt(6))]
    hooked = "scope=layer" not in spec  # its padding repeats positions: no Events there
    want, want_ev, a = run(m, spec, budget, None, turns) if hooked else (None, None, None)
    got, got_ev, b = run(m, spec, budget, ops, turns) if hooked else (None, None, None)
    if not hooked:
        want = drive(m, new_kv(m, spec, budget), *turns[0][:2], 8, tokens=turns[0][2])
        m.rope.kernels = ops
        try:
            got = drive(m, new_kv(m, spec, budget), *turns[0][:2], 8, tokens=turns[0][2])
        finally:
            m.rope.kernels = None
    else:
        assert got_ev == want_ev and a.kept_counts() == b.kept_counts()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_out_of_order_slots_round_trip_a_kvc_file(tmp_path):
    """A cache whose steps wrote over slots saves and loads as it is: continuing from the file
    equals continuing in memory, bit for bit."""
    from test_kvc import _continue, _runtime, same_graph

    m = tiny(4)
    m.rope.kernels = ops
    try:
        rt = _runtime(tmp_path, m)
        kv = rt.new_kv(check("h2o", "0.3"))
        drive(m, kv, prompt(61, seed=1), 16, 20, tokens=prompt(20, seed=2))
        assert not all(st.dense.in_order() for st in kv.layers)
        tokens = prompt(81, seed=7)
        path = kvc.save(tmp_path / "doc.kvc", kv, tokens, rt)
        kv2, tokens2, _ = kvc.load(path, rt)
        same_graph(kv, kv2)
        want = _continue(m, kv, tokens, prompt(5, seed=5), prompt(9, seed=6))
        got = _continue(m, kv2, tokens2, prompt(5, seed=5), prompt(9, seed=6))
    finally:
        m.rope.kernels = None
    assert torch.equal(got, want)
