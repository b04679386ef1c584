"""TOVA (`--kv tova`, docs/methods/tova.md) against a naive oracle written from the spec alone.

The oracle (naive_ref.Naive with `tova_rule`) keeps the full float64 history per layer and, at
the prefill end and after every decode step, takes the newest query's softmax over the slots
held, averages it over all query heads (`scope=layer`) or over each KV head's group
(`scope=head`), always keeps the newest token and keeps the top B(n) (ties to the lower
position). The real cache is observed through its debug hook and a tap on attend
(naive_ref.Watch): every attention output, every kept set and the logits are compared.
"""

from __future__ import annotations

import math

import pytest
import torch
from naive_ref import Naive, Watch, keep_top, points
from test_kv_methods import budget_tokens, drive, feed, layer_kv, new_kv, prompt, tiny

E = 4  # bytes per float32 element (the CPU reference path)
N, UB, STEPS = 61, 16, 20  # a prompt of four chunks, then decode steps
MARGIN = 1e-4  # relative: the oracle's choices are this far from a tie (float32 cannot flip them)

pytestmark = pytest.mark.usefixtures("one_thread")


def heads_of(spec: str) -> str:
    return "kv" if "scope=head" in spec else "layer"


def tova_scores(q, K, held, G, heads):
    """Per KV head, {position: score} for the newest query q (Hq, D) over the held positions
    (rows per KV head) of keys K (Hkv, N, D): softmax per query head, then the mean over all
    query heads (scope=layer, the same scores for every KV head) or over the head's group."""
    Hq, D = q.shape
    A = []
    for h in range(Hq):
        idx = torch.tensor(held[h // G])
        A.append(torch.softmax(K[h // G, idx] @ q[h] / math.sqrt(D), dim=0))
    Hkv = Hq // G
    if heads == "layer":
        assert all(r == held[0] for r in held), "scope=layer holds one set per layer"
        s = torch.stack(A).mean(dim=0).tolist()
        return [dict(zip(held[0], s, strict=True))] * Hkv
    out = []
    for hk in range(Hkv):
        s = torch.stack(A[hk * G : (hk + 1) * G]).mean(dim=0).tolist()
        out.append(dict(zip(held[hk], s, strict=True)))
    return out


def tova_rule(budget: str, heads: str):
    """The eviction of tova.md: at the prefill end and after each step, down to B(n) (P = 1)."""

    def rule(h, layer, point, n):
        if point == "chunk":  # prompts are attended exactly, compressed once at its end
            return None
        B = budget_tokens(budget, n, 1)
        held = h.held[layer]
        if all(len(r) <= B for r in held):
            return None
        assert n - 1 in held[0], "the newest token is held"
        scores = tova_scores(h.Q[layer][:, n - 1], h.K[layer], held, h.G, heads)
        rows = []
        for s in scores:
            kept, margin = keep_top(s, B, forced=[n - 1])  # the newest is always kept
            rows.append(kept)
            if hasattr(h, "margins"):
                h.margins.append(margin)
        return rows

    return rule


def oracle(model, spec, budget, turns):
    """The naive oracle over `turns` [(ids, ubatch, steps)] (greedy): its logits, events and
    the tokens it decoded."""
    ref = Naive(model, tova_rule(budget, heads_of(spec)))
    logits, toks = [], []
    for ids, ub, steps in turns:
        out = drive(model, ref, ids, ub, steps)
        toks.append(out[len(ids) - 1 : len(ids) - 1 + steps].argmax(-1).tolist())
        logits.append(out)
    assert min(ref.margins) > MARGIN, "a near-tie: pick another prompt"
    return torch.cat(logits), points(ref.events), toks


def bytes_check(w: Watch, budget: str, heads: str, c):
    """After each point but the chunk ends: every head holds min(n, B(n)) slots and nbytes()
    is L * T * (2 * Hkv * D * e + 4 * R)."""
    R = 1 if heads == "layer" else c.n_kv_heads
    counted = []

    def after(point):
        if point == "chunk":
            return
        n = w.kv.seen
        T = min(n, budget_tokens(budget, n, 1))
        assert n == w.n(0)
        assert all(len(r) == T for held in w.held for r in held), (point, n)
        assert w.kv.nbytes() == c.n_layers * T * (2 * c.n_kv_heads * c.head_dim * E + 4 * R)
        counted.append(point)

    return after, counted


CASES = [
    (4, "tova", "0.3"),
    (4, "tova", "20"),
    (4, "tova:scope=head", "0.3"),
    (4, "tova:scope=head", "20"),
    (6, "tova", "0.3"),
    (6, "tova:scope=head", "17"),
]


@pytest.mark.parametrize("n_heads,spec,budget", CASES)
def test_tova_matches_naive_oracle(n_heads, spec, budget):
    """Four prefill chunks then 20 decode steps: the kept positions at the prefill end and at
    every step, every layer's attention output, the logits and nbytes() all follow the spec."""
    m = tiny(n_heads)
    c, heads = m.config, heads_of(spec)
    ids = prompt(N, seed=21)
    want, ref_events, toks = oracle(m, spec, budget, [(ids, UB, STEPS)])
    w = Watch(m, spec, budget, tova_rule(budget, heads))
    after, counted = bytes_check(w, budget, heads, c)
    got = drive(m, w.kv, ids, UB, STEPS, tokens=toks[0], after=after)
    events = points(w.events)  # chunk ends, if reported, hold everything (Watch checks)
    assert [e[:3] for e in events] == [e[:3] for e in ref_events]
    assert len(events) == c.n_layers * (1 + STEPS)
    assert events == ref_events
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert counted == ["prefill"] + ["step"] * STEPS
    if heads == "layer":
        assert all(r == rows[0] for *_, rows in events for r in rows)
    else:  # KV heads choose apart (otherwise scope=head would be tested no better than layer)
        assert any(rows[0] != rows[1] for *_, rows in events)
    # the evictions reach back into the prompt, not only the newest tokens
    assert any(min(set(range(N)) - set(rows[0])) < N // 2 for *_, rows in events)


@pytest.mark.parametrize("spec,budget", [("tova", "0.3"), ("tova:scope=head", "20")])
def test_tova_later_turn(spec, budget):
    """Two chat turns: the second prompt is attended exactly over what the first turn kept,
    then compressed at its end to B(n) over every token seen (from its last query)."""
    m = tiny()
    turns = [(prompt(45, seed=22), UB, 6), (prompt(30, seed=23), 8, 6)]
    want, ref_events, toks = oracle(m, spec, budget, turns)
    w = Watch(m, spec, budget, tova_rule(budget, heads_of(spec)))
    got = torch.cat(
        [drive(m, w.kv, ids, ub, s, tokens=t) for (ids, ub, s), t in zip(turns, toks, strict=True)]
    )
    assert points(w.events) == ref_events
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n_heads,spec", [(4, "tova"), (4, "tova:scope=head"), (6, "tova")])
def test_naive_oracle_covering_budget_equals_full(n_heads, spec):
    """The oracle itself: with a budget covering every token it evicts nothing and gives the
    full cache's logits (the masked reference is the full cache)."""
    m = tiny(n_heads)
    ids = prompt(N, seed=21)
    full = drive(m, new_kv(m, "full"), ids, UB, STEPS)
    toks = full[N - 1 : N - 1 + STEPS].argmax(-1).tolist()
    ref = Naive(m, tova_rule("4096", heads_of(spec)))
    got = drive(m, ref, ids, UB, STEPS, tokens=toks)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    assert all(rows == [list(range(n))] * m.config.n_kv_heads for _, _, n, rows in ref.events)
    assert len(points(ref.events)) == m.config.n_layers * (1 + STEPS)


@pytest.mark.parametrize("spec", ["tova", "tova:scope=head"])
def test_tova_covering_budget_equals_full(spec):
    m = tiny()
    ids = prompt(N, seed=21)
    full = drive(m, new_kv(m, "full"), ids, UB, STEPS)
    toks = full[N - 1 : N - 1 + STEPS].argmax(-1).tolist()
    w = Watch(m, spec, "4096")  # every report holds everything
    got = drive(m, w.kv, ids, UB, STEPS, tokens=toks)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    c = m.config
    R = 1 if spec == "tova" else c.n_kv_heads
    n = N + STEPS
    assert w.kv.nbytes() == c.n_layers * n * (2 * c.n_kv_heads * c.head_dim * E + 4 * R)


@pytest.mark.parametrize("spec", ["tova", "tova:scope=head"])
def test_tova_ties_go_to_the_lower_position(spec):
    """Hand-made: zero queries give every held slot the same score, so each point keeps the
    newest token and the B - 1 lowest positions (one layer fed directly, no model)."""
    kv, ev = layer_kv(spec, "8", 4)
    g = torch.Generator().manual_seed(24)
    n, n_prompt = 40, 30
    q = torch.zeros(1, 4, n, 32)
    k = torch.randn(1, 2, n, 32, generator=g)
    v = torch.randn(1, 2, n, 32, generator=g)
    feed(kv, q, k, v, n_prompt, 16)
    points = [(p, rows) for _, p, _, rows in ev if p != "chunk"]
    assert len(points) == 1 + n - n_prompt
    for i, (p, rows) in enumerate(points):
        assert p == ("prefill" if i == 0 else "step")
        assert rows == [list(range(7)) + [n_prompt - 1 + i]] * 2


@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize("budget", ["20", "0.25"])
def test_tova_kv_heads_gqa_duplication_selects_as_mha(G, budget):
    """baselines.md 0.8.4 for scope=head: G identical query heads per KV head keep exactly what
    the MHA layer with that one head keeps."""
    g = torch.Generator().manual_seed(25)
    n, n_prompt = 90, 70
    q = 2 * torch.randn(1, 2, n, 32, generator=g)
    k = torch.randn(1, 2, n, 32, generator=g)
    v = torch.randn(1, 2, n, 32, generator=g)
    kv1, ev1 = layer_kv("tova:scope=head", budget, 2)
    kvG, evG = layer_kv("tova:scope=head", budget, 2 * G)
    feed(kv1, q, k, v, n_prompt, 16)
    feed(kvG, q.repeat_interleave(G, dim=1), k, v, n_prompt, 16)
    pick = [e for e in ev1 if e[1] != "chunk"]
    assert len(pick) == 1 + n - n_prompt
    assert [e for e in evG if e[1] != "chunk"] == pick
    assert any(r[0] != r[1] for *_, r in pick)


def test_watch_harness_on_streaming():
    """The harness itself, on a method that exists today: naive_ref.Watch predicts StreamingLLM
    (4 sinks plus the newest) at every chunk end and step, checks every attention output, and
    naive_ref.Naive with the same rule gives streaming's logits."""
    m, budget = tiny(), "20"

    def rule(h, layer, point, n):
        B = budget_tokens(budget, n, 5)
        held = h.held[layer]
        if len(held[0]) <= B:
            return None
        return [[p for p in r if p < 4] + [p for p in r if p >= 4][-(B - 4) :] for r in held]

    ids = prompt(N, seed=21)
    ref = Naive(m, rule)
    want = drive(m, ref, ids, UB, STEPS)
    toks = want[N - 1 : N - 1 + STEPS].argmax(-1).tolist()
    w = Watch(m, "streaming", budget, rule)
    got = drive(m, w.kv, ids, UB, STEPS, tokens=toks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # streaming reports at chunk ends and steps (it has nothing more to do at the prefill end)
    assert w.events == points(ref.events, "chunk", "step")
    assert len(w.events) == m.config.n_layers * (4 + STEPS)
