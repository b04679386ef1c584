"""Expected Attention (`--kv expected_attention`, docs/methods/expected_attention.md) against a
naive oracle written from the spec (and kvpress's ExpectedAttentionPress) alone.

At the end of a turn's prefill: the mean and covariance of the newest `window` queries before
RoPE (the model's own q, captured on its way into the cache; the sinks' queries left out),
each rotated by the mean of the RoPE matrices of the next `future` positions (built here by
rotating the basis vectors with the model's RoPE, one position at a time); each key's
exp(mu.k / sqrt(D) + k^T Sigma k / (2 D)) normalised over the non-sink keys per query head,
averaged over the group, times the value's norm. Each KV head keeps its sinks and its best
B(n) - sinks (naive_ref.Watch checks every kept set and attention output).
"""

from __future__ import annotations

import math

import pytest
import torch
from naive_ref import Watch, keep_top, points
from test_kv_methods import budget_tokens, drive, new_kv, prompt, tiny

pytestmark = pytest.mark.usefixtures("one_thread")
MARGIN = 1e-4


def mean_rotation(rope, start: int, count: int, D: int) -> torch.Tensor:
    """(D, D) float64: the mean over positions start .. start + count - 1 of the matrix that
    RoPE applies there (column j: the rotated j-th basis vector)."""
    eye = torch.eye(D)[None, :, None, :]  # (1, D, 1, D): D vectors as heads
    total = torch.zeros(D, D, dtype=torch.float64)
    for p in range(start, start + count):
        total += rope.apply(eye, torch.tensor([p]))[0, :, 0, :].double().T
    return total / count


def ea_rule(model, raw, budget, window=128, future=512, sinks=4, margins=None):
    """Predict each head's kept positions at the prefill end from the captured raw queries."""
    c = model.config

    def predict(h, layer, point, n):
        if point != "prefill":
            return None
        B = budget_tokens(budget, n, sinks)
        if all(len(held) <= B for held in h.held[layer]):
            return None
        q = torch.cat(raw[layer], dim=1)[:, -window:]  # (Hq, w, D) pre-RoPE, float64
        first = n - q.shape[1]
        if n - max(first, sinks) >= 2:
            q = q[:, max(0, sinks - first) :]
        mu = q.mean(1)
        x = q - mu[:, None]
        cov = torch.einsum("hwi,hwj->hij", x, x) / q.shape[1]
        R = mean_rotation(model.rope.at(layer), n, future, c.head_dim)
        mu, cov = mu @ R.T, R @ cov @ R.T
        rows = []
        for hk, held in enumerate(h.held[layer]):
            scored = [p for p in held if p >= sinks]
            K = h.K[layer][hk, scored]  # (C, D) post-RoPE
            V = h.V[layer][hk, scored]
            G = h.G
            p = torch.zeros(len(scored), dtype=torch.float64)
            for g in range(G):
                qh = hk * G + g
                logit = K @ mu[qh] / math.sqrt(c.head_dim)
                logit = logit + torch.einsum("cd,de,ce->c", K, cov[qh], K) / (2 * c.head_dim)
                p += torch.softmax(logit, 0) / G
            s = p * V.norm(dim=-1)
            scores = {pos: float(x) for pos, x in zip(scored, s, strict=True)}
            scores.update({pos: math.inf for pos in held if pos < sinks})
            kept, margin = keep_top(scores, B, forced=[pos for pos in held if pos < sinks])
            rows.append(kept)
            if margins is not None:
                margins.append(margin)
        return rows

    return predict


def watched(model, spec, budget, **kw):
    raw = [[] for _ in range(model.config.n_layers)]
    margins = []
    w = Watch(model, spec, budget, ea_rule(model, raw, budget, margins=margins, **kw))
    inner = w.kv.attend

    def attend(layer, q, k, v, positions):  # the model's own q, before the cache rotates it
        raw[layer].append(q[0].double())
        return inner(layer, q, k, v, positions)

    w.kv.attend = attend
    return w, margins


CASES = [
    ("expected_attention", "0.3", {}),
    ("expected_attention:window=16,future=64", "20", {"window": 16, "future": 64}),
    ("expected_attention:sinks=0,window=8", "0.25", {"window": 8, "sinks": 0}),
]


@pytest.mark.parametrize("spec,budget,kw", CASES, ids=[c[0] for c in CASES])
def test_expected_attention_matches_naive_oracle(spec, budget, kw):
    """Prefill in chunks, decode steps: every head keeps the oracle's positions at the
    prefill end, attention outputs are dense attention over them, and nothing is evicted at
    decode; the layers' bytes are K and V of the kept slots (no positions, no scores)."""
    m = tiny()
    c = m.config
    n, steps = 61, 6
    w, margins = watched(m, spec, budget, **kw)
    drive(m, w.kv, prompt(n, seed=34), 16, steps)
    assert margins and min(margins) > MARGIN, "a near-tie: pick another prompt"
    ev = points(w.events, "prefill")
    B = budget_tokens(budget, n, kw.get("sinks", 4))
    assert len(ev) == c.n_layers and all(len(r) == B for *_, rows in ev for r in rows)
    assert any(rows[0] != rows[1] for *_, rows in ev)  # KV heads choose apart
    assert w.kv.nbytes() == c.n_layers * 2 * c.n_kv_heads * (B + steps) * c.head_dim * 4


def test_query_agnostic_with_the_question_after():
    """A document compressed alone, then a question turn that selects nothing
    (--question-after): the document's kept sets are the oracle's and the question's tokens
    are all kept."""
    m = tiny()
    w, margins = watched(m, "expected_attention", "0.3")
    doc, question = prompt(61, seed=34), prompt(9, seed=35)
    drive(m, w.kv, doc, 16)
    w.kv.begin_prefill(len(question), select=False)
    kept = [list(r) for r in w.held[0]]
    n = w.kv.seen
    with torch.inference_mode():
        m(torch.tensor([question]), torch.arange(n, n + len(question)), w.kv)
    w.kv.end_chunk(len(question))
    w.kv.end_prefill()
    assert min(margins) > MARGIN
    assert [r[: len(kept[i])] for i, r in enumerate(w.held[0])] == kept
    assert all(set(range(61, 70)) <= set(r) for r in w.held[0])


def test_covering_budget_equals_full():
    m = tiny()
    ids = prompt(61, seed=34)
    full = drive(m, new_kv(m, "full"), ids, 16, 6)
    toks = full[60:66].argmax(-1).tolist()
    got = drive(m, new_kv(m, "expected_attention", "4096"), ids, 16, 6, tokens=toks)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
