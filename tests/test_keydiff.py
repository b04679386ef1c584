"""KeyDiff (`--kv keydiff`, docs/methods/keydiff.md) against a naive oracle written from the spec.

At the end of each turn's prefill, every KV head scores each held key by -cos(k, anchor), the
anchor the mean of the head's unit keys (post-RoPE, float64 here), and keeps its B(n) best
(the newest `window` forced, ties to the lower position); decode tokens are appended.
"""

from __future__ import annotations

import pytest
import torch
from naive_ref import Watch, keep_top, points
from test_kv_methods import budget_tokens, drive, feed, layer_kv, prompt, tiny

pytestmark = pytest.mark.usefixtures("one_thread")
MARGIN = 1e-4


def keydiff_rule(budget: str, window: int, margins: list):
    def rule(h, layer, point, n):
        if point != "prefill":
            return None
        B = budget_tokens(budget, n, window)
        rows = []
        for hk, held in enumerate(h.held[layer]):
            if len(held) <= B:
                rows.append(held)
                continue
            k = h.K[layer][hk, torch.tensor(held)]
            unit = k / k.norm(dim=-1, keepdim=True)
            anchor = unit.mean(0)
            cos = (unit @ anchor / anchor.norm()).tolist()
            scores = {p: -x for p, x in zip(held, cos, strict=True)}
            kept, margin = keep_top(scores, B, forced=held[len(held) - window :])
            rows.append(kept)
            margins.append(margin)
        return rows

    return rule


@pytest.mark.parametrize(
    "spec,budget,window",
    [("keydiff", "0.3", 0), ("keydiff", "20", 0), ("keydiff:window=8", "0.3", 8)],
)
def test_keydiff_matches_naive_oracle(spec, budget, window):
    """Chunks, then decode steps, then a second turn: the kept positions at both prefill ends,
    every attention output and nbytes follow the spec."""
    m = tiny()
    c = m.config
    margins = []
    w = Watch(m, spec, budget, keydiff_rule(budget, window, margins))
    drive(m, w.kv, prompt(61, seed=34), 16, 6)
    drive(m, w.kv, prompt(30, seed=33), 8, 4)
    assert min(margins) > MARGIN, "a near-tie: pick another prompt"
    ev = points(w.events, "prefill")
    assert len(ev) == 2 * c.n_layers
    assert any(rows[0] != rows[1] for *_, rows in ev)  # KV heads choose apart
    assert w.in_order  # slots in position order: no positions are stored
    B = budget_tokens(budget, 97, window)  # 61 + 6 + 30 tokens seen at the second prefill end
    assert w.kv.nbytes() == c.n_layers * 2 * c.n_kv_heads * (B + 4) * c.head_dim * 4


def test_keydiff_keeps_the_odd_key_out():
    """Hand-made keys (one layer fed directly): every key near one direction but one, pointing
    away from it, in each KV head at its own position: that key is kept at any budget."""
    n = 60
    g = torch.Generator().manual_seed(3)
    base = torch.randn(32, generator=g)
    k = base + 0.1 * torch.randn(1, 2, n, 32, generator=g)
    odd = [41, 7]
    for hk, p in enumerate(odd):
        k[0, hk, p] = -base
    q = torch.randn(1, 4, n, 32, generator=g)
    v = torch.randn(1, 2, n, 32, generator=g)
    kv, ev = layer_kv("keydiff", "1", 4)
    feed(kv, q, k, v, n, 16)
    rows = [e for e in ev if e[1] == "prefill"][-1][3]
    assert rows == [[41], [7]]
