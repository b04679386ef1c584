"""KVzip (`--kv kvzip`, docs/methods/kvzip.md) against a naive oracle written from the spec alone.

The oracle (`KvzipRule` on naive_ref.Naive): at a turn's prefill end, run the model once more
over the reconstruction input, which without a tokenizer is the turn's own ids, at positions
n, n + 1, ... on a copy of the full-history cache (attending exactly to everything held plus
the pass's own earlier tokens); per layer, take the pass queries' softmax over the turn's
slots and the pass's own keys (causal), the max over the G query heads of each KV head and
over every pass row, then keep per KV head the top B(n) slots, the first `sinks` positions
always kept (ties to the lower position). `scope=layer` gives the layer's Hkv * B(n) slots to
the best (head, slot) pairs instead. The prompts here are shorter than one 2048-token chunk.

The real cache runs through Session (as the CLI does) or the tests' `drive`, observed through
its debug hook and a tap on attend (naive_ref.Watch; the pass runs on another manager and is
not seen there): kept sets at the prefill end, every attention output of the prompt and of
decode, the logits and nbytes() are compared.
"""

from __future__ import annotations

import math

import pytest
import torch
from naive_ref import Naive, Watch, keep_top, points
from test_kv_methods import budget_tokens, drive, new_kv, prompt, tap, tiny

from kvrun.run.session import Session

E = 4  # bytes per float32 element (the CPU reference path)
N, UB, STEPS = 61, 16, 12
MARGIN = 1e-4  # relative: the oracle's choices are this far from a tie

pytestmark = pytest.mark.usefixtures("one_thread")


def opts_of(spec: str) -> tuple[int, str]:
    o = dict(x.split("=") for x in spec.partition(":")[2].split(",") if x)
    return int(o.get("sinks", 4)), {"layer": "layer", "model": "model"}.get(
        o.get("scope"), "uniform"
    )


class KvzipRule:
    """kvzip.md steps 1-5 as a Naive policy: at the prefill end of the turn `self.ids`, the
    reconstruction pass on a copy of the cache, the scores, the selection."""

    def __init__(self, model, budget, sinks=4, heads="uniform"):
        self.model, self.budget, self.sinks, self.heads = model, budget, sinks, heads
        self.ids: list[int] = []  # the turn being prefilled (set by the caller)
        self.rows = None
        self.scores: list = []  # per layer, per KV head {position: score} of the last pass

    def __call__(self, h, layer, point, n):
        if point != "prefill":
            return None  # decode tokens are appended, never evicted
        if layer == 0:
            self.rows = self.select(h, n)
        return self.rows[layer]

    def pass_scores(self, h, n):
        """Per layer and KV head, {slot position: score} for the turn's slots."""
        t = len(self.ids)
        turn = list(range(n - t, n))
        copy = Naive(self.model)  # the cache as held now; the pass writes only into the copy
        copy.Q, copy.K, copy.V = list(h.Q), list(h.K), list(h.V)
        copy.held = [[list(r) for r in rows] for rows in h.held]
        copy.seen = n
        with torch.inference_mode():
            self.model(torch.tensor([self.ids]), torch.arange(n, n + t), copy)
        self.copy = copy  # kept for the oracle's own checks
        out = []
        for layer in range(h.L):
            K = copy.K[layer]  # (Hkv, n + t, D)
            q = copy.Q[layer][:, n : n + t]  # the pass queries (Hq, t, D)
            cols = torch.tensor(turn + list(range(n, n + t)))
            own = torch.arange(t)
            visible = torch.cat(
                [torch.ones(t, len(turn), dtype=torch.bool), own[None, :] <= own[:, None]], dim=1
            )  # the turn's slots, then the pass's own tokens (causal)
            per_head = []
            for hk in range(h.Hkv):
                best = None
                for g in range(h.G):
                    s = q[hk * h.G + g] @ K[hk, cols].T / math.sqrt(h.D)  # (t, len(cols))
                    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
                    m = p[:, : len(turn)].amax(dim=0)  # max over the pass rows
                    best = m if best is None else torch.maximum(best, m)  # ... and the group
                per_head.append(dict(zip(turn, best.tolist(), strict=True)))
            out.append(per_head)
        return out

    def select(self, h, n):
        t = len(self.ids)
        start = n - t
        B = budget_tokens(self.budget, n, self.sinks)
        forced = [p for p in range(min(self.sinks, n)) if p >= start]  # the sequence's sinks
        self.scores = self.pass_scores(h, n)
        earlier_of = [[[p for p in r if p < start] for r in held] for held in h.held]
        if self.heads == "model":  # the model's L * Hkv * B(n) to the best (layer, position, head)
            s = {
                (layer, p, hk): x
                for layer, per_head in enumerate(self.scores)
                for hk, d in enumerate(per_head)
                for p, x in d.items()
            }
            pin = [(layer, p, hk) for layer in range(h.L) for hk in range(h.Hkv) for p in forced]
            room = h.L * h.Hkv * B - sum(len(e) for held in earlier_of for e in held)
            kept, margin = keep_top(s, room, pin)
            h.margins.append(margin)
            return [
                [
                    e + sorted(p for lk, p, k in kept if (lk, k) == (layer, hk))
                    for hk, e in enumerate(earlier_of[layer])
                ]
                for layer in range(h.L)
            ]
        rows = []
        for layer, per_head in enumerate(self.scores):
            earlier = earlier_of[layer]  # kept as they are
            if self.heads == "uniform":
                picked = []
                for hk, s in enumerate(per_head):
                    kept, margin = keep_top(s, B - len(earlier[hk]), forced)
                    picked.append(sorted(kept))
                    h.margins.append(margin)
            else:  # scope=layer: the layer's Hkv * B(n) slots to the best (position, head)
                s = {(p, hk): x for hk, d in enumerate(per_head) for p, x in d.items()}
                pin = [(p, hk) for hk in range(h.Hkv) for p in forced]
                room = h.Hkv * B - sum(len(e) for e in earlier)
                kept, margin = keep_top(s, room, pin)
                picked = [sorted(p for p, k in kept if k == hk) for hk in range(h.Hkv)]
                h.margins.append(margin)
            rows.append([e + k for e, k in zip(earlier, picked, strict=True)])
        return rows


def oracle(model, spec, budget, turns):
    """The naive oracle over `turns` [(ids, ubatch, steps)] (greedy): its logits, prefill-end
    events, decoded tokens and the rule (its last scores)."""
    sinks, heads = opts_of(spec)
    rule = KvzipRule(model, budget, sinks, heads)
    ref = Naive(model, rule)
    logits, toks = [], []
    for ids, ub, steps in turns:
        rule.ids = list(ids)
        out = drive(model, ref, ids, ub, steps)
        toks.append(out[len(ids) - 1 : len(ids) - 1 + steps].argmax(-1).tolist())
        logits.append(out)
    assert min(ref.margins) > MARGIN, "a near-tie: pick another prompt"
    return torch.cat(logits), points(ref.events, "prefill"), toks, rule


def predict_from(events):
    """Watch's predict: the oracle's rows at each prefill end, nothing evicted elsewhere."""
    table = {(layer, n): rows for layer, _, n, rows in events}

    def predict(w, layer, point, n):
        return table[layer, n] if point == "prefill" else None

    return predict


def expected_nbytes(w: Watch, c, heads: str) -> int:
    """kvzip.md: sum_l T_l * (2 * Hkv * D * e + 4 * Hkv * [scope = layer or model]), T_l the
    layer's largest head count (every head the same under scope=head)."""
    padded = heads in ("layer", "model")
    per_slot = 2 * c.n_kv_heads * c.head_dim * E + (4 * c.n_kv_heads if padded else 0)
    return sum(max(len(r) for r in rows) * per_slot for rows in w.held)


def run_real(w: Watch, model, turns, toks, use_session: bool, check):
    """The real cache over the turns, decoding the oracle's tokens; `check(point)` after the
    prefill end and each step. Returns the logits of every token fed (as drive does) or, with
    Session, of each prompt's last token and of every decode step."""
    out = []
    if not use_session:
        for (ids, ub, steps), t in zip(turns, toks, strict=True):
            out.append(drive(model, w.kv, ids, ub, steps, tokens=t, after=check))
        return torch.cat(out)
    s = Session(model, None, w.kv, ubatch=turns[0][1])
    for (ids, ub, _), t in zip(turns, toks, strict=True):
        s.ubatch = ub
        out.append(s.prefill(ids)[None])
        check("prefill")
        for tok in t:
            out.append(s.decode(tok)[None])
            check("step")
    return torch.cat(out)


def session_rows(want, turns):
    """The rows of drive-shaped logits that a Session returns (each prompt's last, then each
    decode step's)."""
    rows, at = [], 0
    for ids, _, steps in turns:
        rows.append(at + len(ids) - 1)
        rows.extend(range(at + len(ids), at + len(ids) + steps))
        at += len(ids) + steps
    return want[rows]


CASES = [
    (4, "kvzip", "0.3", True),
    (4, "kvzip", "20", False),
    (6, "kvzip", "0.3", False),
    (4, "kvzip:sinks=2", "0.25", True),
    (4, "kvzip:scope=layer", "0.3", True),
    (6, "kvzip:scope=layer", "20", False),
    (4, "kvzip:scope=model", "0.3", True),
    (6, "kvzip:scope=model", "20", False),
]


@pytest.mark.parametrize("n_heads,spec,budget,use_session", CASES)
def test_kvzip_matches_naive_oracle(n_heads, spec, budget, use_session):
    """A prompt of four chunks, then decode steps: the kept positions at the prefill end,
    every attention output, the logits and nbytes() follow the spec."""
    m = tiny(n_heads)
    c = m.config
    sinks, heads = opts_of(spec)
    ids = prompt(N, seed=41)
    turns = [(ids, UB, STEPS)]
    want, ref_events, toks, _ = oracle(m, spec, budget, turns)
    w = Watch(m, spec, budget, predict_from(ref_events))
    counted = []

    def check(point):
        if point == "chunk":
            return
        n = N + counted.count("step") + (point == "step")
        assert w.kv.seen == n == w.n(0)  # the pass leaves no token behind
        assert w.kv.nbytes() == expected_nbytes(w, c, heads), (point, n)
        counted.append(point)

    got = run_real(w, m, turns, toks, use_session, check)
    if use_session:
        want = session_rows(want, turns)
    assert points(w.events, "prefill") == ref_events and len(ref_events) == c.n_layers
    assert counted == ["prefill"] + ["step"] * STEPS
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    B = budget_tokens(budget, N, sinks)
    for *_, rows in ref_events:
        assert all(set(range(sinks)) <= set(r) for r in rows)  # the sinks in every head
        if heads == "uniform":
            assert all(len(r) == B for r in rows)
        elif heads == "layer":
            assert sum(len(r) for r in rows) == c.n_kv_heads * B
    if heads == "model":  # the layers share L * Hkv * B, and keep different counts
        per_layer = [sum(len(r) for r in rows) for *_, rows in ref_events]
        assert sum(per_layer) == c.n_layers * c.n_kv_heads * B
        assert len(set(per_layer)) > 1
    if heads == "uniform":
        assert w.in_order  # slots in position order (kvzip.md: What is stored)
        assert any(rows[0] != rows[1] for *_, rows in ref_events)  # heads choose apart
    else:  # heads keep different counts (in some layer)
        assert any(len(rows[0]) != len(rows[1]) for *_, rows in ref_events)
    # decode tokens are appended and never evicted
    assert all(set(range(N, N + STEPS)) <= set(r) for held in w.held for r in held)


def test_kvzip_later_turn_scores_the_new_turn_only():
    """Two chat turns (scope=head): the second pass runs over the second turn's ids at
    positions n, n + 1, ... attending to everything held; the first turn's kept slots and its
    decode tokens stay as they are; the new turn's slots are scored by the softmax over the
    turn's slots and the pass's own tokens, and fill the budget up to B(n) over every token
    seen."""
    m = tiny()
    c = m.config
    turns = [(prompt(61, seed=42), UB, 5), (prompt(40, seed=43), UB, 4)]
    want, ref_events, toks, _ = oracle(m, "kvzip", "0.3", turns)
    w = Watch(m, "kvzip", "0.3", predict_from(ref_events))

    def check(point):
        if point != "chunk":
            assert w.kv.nbytes() == expected_nbytes(w, c, "uniform"), (point, w.kv.seen)

    got = run_real(w, m, turns, toks, True, check)
    assert points(w.events, "prefill") == ref_events
    torch.testing.assert_close(got, session_rows(want, turns), rtol=1e-4, atol=1e-4)
    n1, n = 61 + 5, 61 + 5 + 40
    B = budget_tokens("0.3", n, 4)  # 32 of the 106 tokens seen
    for (_, _, n_a, first), (_, _, n_b, second) in zip(
        ref_events[: c.n_layers], ref_events[c.n_layers :], strict=True
    ):
        assert (n_a, n_b) == (61, n)
        for r1, r2 in zip(first, second, strict=True):
            assert [p for p in r2 if p < n1] == r1 + list(range(61, n1))
            assert len(r2) == B and 0 < len([p for p in r2 if p >= n1]) < 40


@pytest.mark.parametrize("spec", ["kvzip", "kvzip:scope=layer", "kvzip:scope=model"])
def test_naive_oracle_covering_budget_equals_full(spec):
    """The oracle itself: with a budget covering every token nothing is evicted and the logits
    are the full cache's; its pass scores are probabilities (at most 1, and the pass's first
    row, at position n, attends over exactly the prompt and itself)."""
    m = tiny()
    ids = prompt(N, seed=41)
    full = drive(m, new_kv(m, "full"), ids, UB, STEPS)
    sinks, heads = opts_of(spec)
    rule = KvzipRule(m, "4096", sinks, heads)
    rule.ids = ids
    ref = Naive(m, rule)
    toks = full[N - 1 : N - 1 + STEPS].argmax(-1).tolist()
    got = drive(m, ref, ids, UB, STEPS, tokens=toks)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    assert all(rows == [list(range(n))] * 2 for _, _, n, rows in ref.events)
    for per_head in rule.scores:
        for s in per_head:
            assert sorted(s) == list(range(N)) and all(0 < x <= 1 for x in s.values())


@pytest.mark.parametrize("spec", ["kvzip", "kvzip:scope=layer", "kvzip:scope=model"])
def test_kvzip_covering_budget_equals_full(spec):
    """--kv-budget 4096 covers every token: the full cache's logits, every position kept,
    nbytes() by the formula (scope=layer adds an int32 position per slot and head)."""
    m = tiny()
    c = m.config
    ids = prompt(N, seed=41)
    full = drive(m, new_kv(m, "full"), ids, UB, STEPS)
    toks = full[N - 1 : N - 1 + STEPS].argmax(-1).tolist()
    w = Watch(m, spec, "4096")
    got = drive(m, w.kv, ids, UB, STEPS, tokens=toks)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    everything = [(layer, "prefill", N, [list(range(N))] * 2) for layer in range(c.n_layers)]
    assert points(w.events, "prefill") == everything
    n = N + STEPS
    padded = "layer" in spec or "model" in spec
    per_slot = 2 * c.n_kv_heads * c.head_dim * E + (4 * c.n_kv_heads if padded else 0)
    assert w.kv.nbytes() == c.n_layers * n * per_slot


def test_naive_pass_is_the_full_cache_over_the_turn_twice():
    """The oracle's pass, checked against kvrun's `full` cache: with an empty instruction the
    first turn's pass is the model over the turn's ids twice (positions 0 .. 2n - 1), so its
    queries are those of `full` over ids + ids, and each score is the max, over the second
    copy's rows and the KV head's query heads, of full causal attention to the first copy."""
    m = tiny()
    c = m.config
    G = c.n_heads // c.n_kv_heads
    ids = prompt(N, seed=41)
    rule = KvzipRule(m, "0.3")
    rule.ids = ids
    drive(m, Naive(m, rule), ids, UB)
    kv = new_kv(m, "full")
    Q, K = {}, {}

    def grab(layer, qr, kr, v, pos, out, state):
        Q[layer], K[layer] = qr.double(), kr.double()

    tap(kv, after=grab)
    drive(m, kv, ids + ids, 2 * N)  # one chunk
    for layer in range(c.n_layers):
        q, k = Q[layer], K[layer].repeat_interleave(G, dim=0)
        torch.testing.assert_close(rule.copy.Q[layer][:, N:], q[:, N:], rtol=0, atol=1e-5)
        s = q @ k.transpose(1, 2) / math.sqrt(c.head_dim)  # (Hq, 2N, 2N)
        causal = torch.ones(2 * N, 2 * N, dtype=torch.bool).tril()
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        want = p[:, N:, :N].amax(dim=1).view(c.n_kv_heads, G, N).amax(dim=1)  # (Hkv, N)
        got = torch.tensor(
            [[d[j] for j in range(N)] for d in rule.scores[layer]], dtype=torch.float64
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
