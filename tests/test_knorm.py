"""KNorm (`--kv knorm`, docs/methods/knorm.md) against a naive oracle written from the spec alone.

At the end of each turn's prefill, every KV head keeps the B(n) held keys with the lowest L2
norm (post-RoPE keys, ties to the lower position), the newest `window` slots always among
them; decode tokens are appended and never evicted. The oracle (naive_ref.Naive with
`knorm_rule`) does that on its own float64 history; the real cache is observed through its
debug hook and a tap on attend (naive_ref.Watch), which predicts its kept sets from the keys
it was handed and checks every attention output against dense masked attention.
"""

from __future__ import annotations

import pytest
import torch
from naive_ref import Naive, Watch, keep_top, points
from test_kv_methods import budget_tokens, drive, feed, layer_kv, new_kv, prompt, tiny

E = 4  # bytes per float32 element (the CPU reference path)
N, UB, STEPS = 61, 16, 20
MARGIN = 1e-4  # relative: the oracle's choices are this far from a tie

pytestmark = pytest.mark.usefixtures("one_thread")


def window_of(spec: str) -> int:
    for opt in spec.partition(":")[2].split(","):
        if opt.startswith("window="):
            return int(opt.split("=")[1])
    return 0


def knorm_rule(budget: str, window: int):
    """knorm.md: at the prefill end, per KV head, the B(n) lowest key norms over every slot
    held (the newest `window` forced); nothing at chunk ends or decode steps."""

    def rule(h, layer, point, n):
        if point != "prefill":
            return None
        B = budget_tokens(budget, n, window)
        rows = []
        for hk, held in enumerate(h.held[layer]):
            if len(held) <= B:
                rows.append(held)
                continue
            norms = h.K[layer][hk, torch.tensor(held)].norm(dim=-1).tolist()
            scores = {p: -x for p, x in zip(held, norms, strict=True)}
            kept, margin = keep_top(scores, B, forced=held[len(held) - window :])
            rows.append(kept)
            if hasattr(h, "margins"):
                h.margins.append(margin)
        return rows

    return rule


def oracle(model, spec, budget, turns):
    """The naive oracle over `turns` [(ids, ubatch, steps)], decoding greedily: its logits,
    its prefill-end events and the tokens it decoded."""
    ref = Naive(model, knorm_rule(budget, window_of(spec)))
    logits, toks = [], []
    for ids, ub, steps in turns:
        out = drive(model, ref, ids, ub, steps)
        toks.append(out[len(ids) - 1 : len(ids) - 1 + steps].argmax(-1).tolist())
        logits.append(out)
    assert min(ref.margins) > MARGIN, "a near-tie: pick another prompt"
    return torch.cat(logits), points(ref.events, "prefill"), toks


def nbytes_check(w: Watch, c):
    """After the prefill end and every step: each head of each layer holds
    min(n_p, B(n_p)) + n_gen slots and nbytes() = sum_l 2 * Hkv * T_l * D * e."""
    state = {}
    counted = []

    def after(point):
        if point == "chunk":
            return
        n = w.kv.seen
        assert n == w.n(0)
        if point == "prefill":
            state["T"] = [len(w.held[layer][0]) for layer in range(c.n_layers)]
            state["n_p"] = n
        T = [t + n - state["n_p"] for t in state["T"]]
        for layer in range(c.n_layers):
            assert [len(r) for r in w.held[layer]] == [T[layer]] * c.n_kv_heads, (point, n)
        want = sum(2 * c.n_kv_heads * t * c.head_dim * E for t in T)
        assert w.kv.nbytes() == want, (point, n)
        counted.append(point)

    return after, counted


CASES = [
    (4, "knorm", "0.3"),
    (4, "knorm", "20"),
    (6, "knorm", "0.3"),
    (4, "knorm:window=8", "24"),
    (6, "knorm:window=8", "0.3"),
]


@pytest.mark.parametrize("n_heads,spec,budget", CASES)
def test_knorm_matches_naive_oracle(n_heads, spec, budget):
    """Four prefill chunks then 20 decode steps: the kept positions at the prefill end (from
    the keys the cache was handed and from the oracle's own), every attention output, the
    logits through decode and nbytes() follow the spec."""
    m = tiny(n_heads)
    c, window = m.config, window_of(spec)
    ids = prompt(N, seed=34)
    want, ref_events, toks = oracle(m, spec, budget, [(ids, UB, STEPS)])
    w = Watch(m, spec, budget, knorm_rule(budget, window))
    after, counted = nbytes_check(w, c)
    got = drive(m, w.kv, ids, UB, STEPS, tokens=toks[0], after=after)
    assert points(w.events, "prefill") == ref_events
    assert len(ref_events) == c.n_layers
    assert w.in_order  # slots in position order (knorm.md: What is stored)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert counted == ["prefill"] + ["step"] * STEPS
    B = budget_tokens(budget, N, window)
    for *_, rows in ref_events:
        assert all(len(r) == B for r in rows)
        assert all(set(range(N - window, N)) <= set(r) for r in rows)
    assert any(rows[0] != rows[1] for *_, rows in ref_events)  # KV heads choose apart
    # the newest tokens are not simply kept: the rule reaches into the whole prompt
    assert any(N - 1 - window not in r for *_, rows in ref_events for r in rows)
    # decode tokens are never evicted: every one is held at the end
    assert all(set(range(N, N + STEPS)) <= set(r) for held in w.held for r in held)


@pytest.mark.parametrize("spec,budget", [("knorm", "0.3"), ("knorm:window=4", "20")])
def test_knorm_later_turn_reselects_all_held_slots(spec, budget):
    """Two chat turns: the second prefill end keeps, per KV head, the B(n) lowest norms over
    every slot held (the first turn's kept slots, its decode tokens and the new prompt)."""
    m = tiny()
    turns = [(prompt(45, seed=32), UB, 6), (prompt(30, seed=33), 8, 6)]
    want, ref_events, toks = oracle(m, spec, budget, turns)
    w = Watch(m, spec, budget, knorm_rule(budget, window_of(spec)))
    got = torch.cat(
        [drive(m, w.kv, ids, ub, s, tokens=t) for (ids, ub, s), t in zip(turns, toks, strict=True)]
    )
    assert points(w.events, "prefill") == ref_events and len(ref_events) == 2 * m.config.n_layers
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    c = m.config
    second = ref_events[c.n_layers :]
    B = budget_tokens(budget, 81, window_of(spec))  # 45 + 6 + 30 tokens seen
    assert all(n == 81 and len(r) == B for _, _, n, rows in second for r in rows)
    # the second selection keeps some of the first turn and some of its decode tokens
    assert any(p < 45 for *_, rows in second for p in rows[0])
    assert any(45 <= p < 51 for *_, rows in second for r in rows for p in r)
    assert w.kv.nbytes() == c.n_layers * 2 * c.n_kv_heads * (B + 6) * c.head_dim * E


def test_naive_oracle_covering_budget_equals_full():
    """The oracle itself: a budget covering every token evicts nothing and gives the full
    cache's logits."""
    m = tiny()
    ids = prompt(N, seed=34)
    full = drive(m, new_kv(m, "full"), ids, UB, STEPS)
    toks = full[N - 1 : N - 1 + STEPS].argmax(-1).tolist()
    ref = Naive(m, knorm_rule("4096", 0))
    got = drive(m, ref, ids, UB, STEPS, tokens=toks)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    assert all(rows == [list(range(n))] * 2 for _, _, n, rows in ref.events)


@pytest.mark.parametrize("spec", ["knorm", "knorm:window=8"])
def test_knorm_covering_budget_equals_full(spec):
    m = tiny()
    ids = prompt(N, seed=34)
    full = drive(m, new_kv(m, "full"), ids, UB, STEPS)
    toks = full[N - 1 : N - 1 + STEPS].argmax(-1).tolist()
    w = Watch(m, spec, "4096")
    got = drive(m, w.kv, ids, UB, STEPS, tokens=toks)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    c = m.config
    everything = [(layer, "prefill", N, [list(range(N))] * 2) for layer in range(c.n_layers)]
    assert points(w.events, "prefill") == everything
    n = N + STEPS  # no positions and no scores are stored
    assert w.kv.nbytes() == c.n_layers * 2 * c.n_kv_heads * n * c.head_dim * E


def handmade(n, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 32, generator=g)
    k = torch.randn(1, 2, n, 32, generator=g)
    v = torch.randn(1, 2, n, 32, generator=g)
    return q, k, v


@pytest.mark.parametrize("budget", ["0.2", "5", "1"])
def test_knorm_tiny_key_is_always_kept(budget):
    """Hand-made keys (one layer fed directly): a key scaled far below the others (a different
    position in each KV head) is kept however small the budget, and the rest are the lowest
    norms of the prompt."""
    n, n_prompt = 70, 60
    q, k, v = handmade(n, 34)
    tiny_at = [37, 12]
    for hk, p in enumerate(tiny_at):
        k[0, hk, p] *= 1e-3
    kv, ev = layer_kv("knorm", budget, 4)
    feed(kv, q, k, v, n_prompt, 16)
    pre = [rows for _, point, _, rows in ev if point == "prefill"]
    assert len(pre) == 1
    B = budget_tokens(budget, n_prompt, 0)
    norms = k[0, :, :n_prompt].double().norm(dim=-1)  # RoPE keeps norms
    for hk, row in enumerate(pre[0]):
        assert tiny_at[hk] in row and len(row) == B
        want, margin = keep_top({p: -float(norms[hk, p]) for p in range(n_prompt)}, B)
        assert row == want and margin > MARGIN
    assert kv.nbytes() == 2 * 2 * (B + n - n_prompt) * 32 * E  # decode tokens appended


def test_knorm_equal_norms_go_to_the_lower_position():
    """Zero keys have norm 0 exactly (before and after RoPE): with three of them and room for
    two, the two lower positions are kept."""
    n = 50
    q, k, v = handmade(n, 35)
    k[0, :, [30, 10, 20]] = 0.0
    kv, ev = layer_kv("knorm", "2", 4)
    feed(kv, q, k, v, n, 16)
    assert [rows for _, point, _, rows in ev if point == "prefill"] == [[[10, 20], [10, 20]]]


def test_knorm_window_protects_the_newest():
    """window=6: the six newest slots are kept even with the largest norms of the prompt."""
    n = 50
    q, k, v = handmade(n, 36)
    k[0, :, n - 6 :] *= 100.0
    k[0, :, 5] *= 1e-3
    kv, ev = layer_kv("knorm:window=6", "10", 4)
    feed(kv, q, k, v, n, 16)
    (rows,) = [rows for _, point, _, rows in ev if point == "prefill"]
    norms = k[0].double().norm(dim=-1)
    for hk, row in enumerate(rows):
        assert len(row) == 10 and set(range(n - 6, n)) <= set(row) and 5 in row
        want, margin = keep_top({p: -float(norms[hk, p]) for p in range(n - 6)}, 4)
        assert row == want + list(range(n - 6, n)) and margin > MARGIN
