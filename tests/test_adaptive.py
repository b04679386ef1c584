"""scope=adaptive (docs/methods/adaptive.md, AdaKV) against a naive oracle written from the spec.

Wherever the method selects, per layer: each KV head's protected tokens rank first, each head
keeps its floor(alpha * B) best, and the rest of the layer's Hkv * B slots go to the best
(head, position) pairs of the whole layer by raw score (ties: lower position, then lower head).
The oracle computes each method's score in float64 from the post-RoPE queries and keys the
cache was handed (naive_ref.Watch), predicts every head's kept positions, and Watch checks
every attention output against dense attention over what each head holds (the padding of
shorter heads never seen).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from naive_ref import Watch, keep_top, points, rank
from test_kv_methods import budget_tokens, drive, new_kv, prompt, tiny
from test_kv_select import ref_snap_scores

pytestmark = pytest.mark.usefixtures("one_thread")
MARGIN = 1e-4  # relative: the oracle's choices are this far from a tie


def _margin(a: float, b: float) -> float:
    if math.isinf(a) or math.isinf(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def adaptive_rows(scores, B, alpha, first=0, last=0, margins=None):
    """scores: per KV head {position: score} over what it holds. The kept positions per head."""
    Hkv = len(scores)
    floor = min(B, math.floor(Fraction(str(alpha)) * B))
    keep = []
    for s in scores:
        held = sorted(s)
        forced = set(held[:first]) | set(held[len(held) - last :])
        order = sorted(forced) + [p for p in rank(s) if p not in forced]
        keep.append(set(order[:floor]) | set(forced) if floor else set(forced))
        if margins is not None and len(forced) < floor < len(order):  # the floor's edge
            margins.append(_margin(s[order[floor - 1]], s[order[floor]]))
    total = min(Hkv * B, sum(len(s) for s in scores))
    # the rest of the layer: (head, position) pairs by score, then position, then head
    pool = [(-s[p], p, h) for h, s in enumerate(scores) for p in s if p not in keep[h]]
    pool.sort()
    left = total - sum(len(k) for k in keep)
    for _, p, h in pool[:left]:
        keep[h].add(p)
    if margins is not None and 0 < left < len(pool):
        margins.append(_margin(-pool[left - 1][0], -pool[left][0]))
    return [sorted(k) for k in keep]


def knorm_scores(h, layer):
    return [
        {p: -float(h.K[layer][hk, p].norm()) for p in held} for hk, held in enumerate(h.held[layer])
    ]


def keydiff_scores(h, layer):
    out = []
    for hk, held in enumerate(h.held[layer]):
        k = h.K[layer][hk, held]
        unit = k / k.norm(dim=-1, keepdim=True)
        anchor = unit.mean(0)
        cos = unit @ anchor / anchor.norm()
        out.append({p: -float(c) for p, c in zip(held, cos, strict=True)})
    return out


def tova_scores(h, layer):
    """The newest query's softmax over what each KV head holds, summed over its group."""
    n, G = h.n(layer), h.G
    out = []
    for hk, held in enumerate(h.held[layer]):
        q = h.Q[layer][hk * G : (hk + 1) * G, n - 1]  # (G, D)
        p = torch.softmax(q @ h.K[layer][hk, held].T / math.sqrt(h.D), dim=-1).sum(0)
        out.append({pos: float(x) for pos, x in zip(held, p, strict=True) if pos != n - 1})
    return out


def snap_scores(h, layer, window=32, kernel=7):
    """SnapKV's votes over a first turn (every head holds every position): ref_snap_scores."""
    n = h.n(layer)
    assert all(held == list(range(n)) for held in h.held[layer])
    s = ref_snap_scores(h.Q[layer][:, n - window :].float(), h.K[layer].float(), kernel)
    return [{p: float(x) for p, x in enumerate(row)} for row in s.double()]


def rule(score, budget, alpha, when, first=0, last=0, protected=0):
    def predict(h, layer, point, n):
        if point not in when:
            return None
        B = budget_tokens(budget, n, protected)
        scores = score(h, layer)
        if all(len(held) <= B for held in h.held[layer]):
            return None
        if score in (tova_scores, snap_scores):  # the newest (window): kept, count in B
            for s in scores:
                s.update({p: math.inf for p in range(n - last, n)})
            return adaptive_rows(scores, B, alpha, margins=h.margins)
        return adaptive_rows(scores, B, alpha, first, last, h.margins)

    return predict


CASES = [  # spec, budget, score, points, newest kept
    ("knorm:scope=adaptive", "0.3", knorm_scores, {"prefill"}, 0),
    ("knorm:scope=adaptive,alpha=0", "20", knorm_scores, {"prefill"}, 0),
    ("knorm:scope=adaptive,alpha=1", "0.3", knorm_scores, {"prefill"}, 0),
    ("keydiff:scope=adaptive", "0.3", keydiff_scores, {"prefill"}, 0),
    ("keydiff:scope=adaptive,alpha=0.5", "16", keydiff_scores, {"prefill"}, 0),
    ("tova:scope=adaptive", "0.4", tova_scores, {"prefill", "step"}, 1),
    ("snapkv:scope=adaptive", "0.7", snap_scores, {"prefill"}, 32),
]


@pytest.mark.parametrize(
    "spec,budget,score,when,newest", CASES, ids=[c[0] + "@" + c[1] for c in CASES]
)
def test_adaptive_matches_naive_oracle(spec, budget, score, when, newest):
    """A prompt in chunks, then decode steps: every head's kept positions at every point equal
    the oracle's, the layer holds Hkv * B(n), heads differ in count somewhere, every attention
    output equals dense attention over what each head holds, and nbytes counts the padding."""
    m = tiny()
    c = m.config
    alpha = float(spec.partition("alpha=")[2] or 0.2)
    n_prompt, steps = 70, 8
    w = Watch(m, spec, budget, rule(score, budget, alpha, when, last=newest, protected=newest))
    w.margins = []
    drive(m, w.kv, prompt(n_prompt, seed=41), 16, steps)
    # exact ties (SnapKV's max-pooling repeats a value) go by the rule; none nearly tied
    assert all(x == 0 or x > MARGIN for x in w.margins), "a near-tie: pick another prompt"
    ev = points(w.events, *when)
    assert len(ev) == c.n_layers * (1 + (steps if "step" in when else 0))
    uneven = False
    for _, _, n, rows in ev:
        B = budget_tokens(budget, n, newest)
        assert sum(len(r) for r in rows) == c.n_kv_heads * B
        assert all(len(r) >= math.floor(Fraction(str(alpha)) * B) for r in rows)
        uneven |= len({len(r) for r in rows}) > 1
    if alpha < 1:
        assert uneven
    # what is held: each layer padded to its longest head, K, V and an int32 position per slot
    S = [max(len(r) for r in held) for held in w.held]
    assert w.kv.nbytes() == sum(s * c.n_kv_heads * (2 * c.head_dim * 4 + 4) for s in S)


def test_alpha_one_is_the_uniform_selection():
    """alpha = 1: every head's floor is B, nothing is left to share: the kept positions are
    scope=head's (held in padded form, with positions) and so are the logits."""
    m = tiny()
    ids = prompt(70, seed=41)
    kept, logits = {}, {}
    for spec in ("knorm:scope=adaptive,alpha=1", "knorm"):
        rows = kept[spec] = []

        def hook(layer, point, positions, rows=rows):
            rows.append([[p for p in r if p >= 0] for r in positions.tolist()])

        logits[spec] = drive(m, new_kv(m, spec, "0.3", hook), ids, 16, 4)
    assert kept["knorm:scope=adaptive,alpha=1"] == kept["knorm"] != []
    torch.testing.assert_close(logits["knorm"], logits["knorm:scope=adaptive,alpha=1"])


def critical_rule(budget: str, margins: list):
    """CriticalKV (critical=1) over KNorm's scores, per KV head: its floor(B / 2) lowest key
    norms first, then the best (score + 1e-4) * mean over the group of ||v W_o,h||_1, W_o,h
    the columns of the output projection that query head h's output multiplies."""

    def predict(h, layer, point, n):
        if point != "prefill":
            return None
        B = budget_tokens(budget, n, 0)
        W = h.model.model.layers[layer].self_attn.o_proj.weight.double()  # (dim, Hq * D)
        rows = []
        for hk, held in enumerate(h.held[layer]):
            if len(held) <= B:
                rows.append(held)
                continue
            raw = {p: -float(h.K[layer][hk, p].norm()) for p in held}
            order = rank(raw)
            first = order[: B // 2]
            margins.append(_margin(raw[order[B // 2 - 1]], raw[order[B // 2]]))
            norm = torch.zeros(len(held), dtype=torch.float64)
            for g in range(h.G):
                qh = hk * h.G + g
                Wh = W[:, qh * h.D : (qh + 1) * h.D]  # (dim, D)
                norm += (h.V[layer][hk, held] @ Wh.T).abs().sum(-1) / h.G
            s = {p: (raw[p] + 1e-4) * float(x) for p, x in zip(held, norm, strict=True)}
            s.update({p: math.inf for p in first})
            kept, margin = keep_top(s, B)
            rows.append(kept)
            margins.append(margin)
        return rows

    return predict


@pytest.mark.parametrize("budget", ["0.3", "12"])
def test_critical_matches_naive_oracle(budget):
    """knorm:critical=1 keeps, per KV head, what CriticalKV's two stages keep (float64, the
    output projection read from the model's weights); attention outputs follow."""
    m = tiny()
    margins = []
    w = Watch(m, "knorm:critical=1", budget, critical_rule(budget, margins))
    w.model = m
    drive(m, w.kv, prompt(61, seed=38), 16, 4)
    assert min(margins) > MARGIN, "a near-tie: pick another prompt"
    plain = []

    def hook(layer, point, positions):
        plain.append([sorted(p for p in r if p >= 0) for r in positions.tolist()])

    drive(m, new_kv(m, "knorm", budget, hook), prompt(61, seed=38), 16, 4)
    assert [e[3] for e in points(w.events, "prefill")] != plain[: m.config.n_layers]
