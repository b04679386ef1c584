"""Naive references shared by the TOVA, KNorm and KVzip oracle tests (docs/methods/*.md).

Everything here is plain torch in float64 with materialised attention and explicit sorting,
written from the specs alone: nothing from kvrun.kv is called. Two pieces:

- `Naive`, a KV manager of its own (the `kv` a model forward takes): the full history per
  layer, masked attention over the positions it holds per KV head, and an eviction `policy`
  run at the prefill end and after every decode step. With a policy that keeps everything it
  is the full cache (checked against `full` in every oracle file).
- `Watch`, the real cache observed: a debug hook and a tap on its `attend`. Every attention
  output is checked against dense attention over the positions the cache reported holding
  (baselines.md 0.8.2), and every report is checked against a `predict` rule computed from
  the cache's own post-RoPE queries and keys.

Ranking everywhere: score descending, then position ascending (baselines.md 0.7).
"""

from __future__ import annotations

import math

import torch
from test_kv_methods import new_kv, tap

PAD = 2**31 - 1  # kvzip:scope=layer stores padding slots at this position (reported as -1)


def is_pad(p: int) -> bool:
    return p < 0 or p >= PAD


def rank(scores: dict[int, float]) -> list[int]:
    """Positions by score descending, then position ascending."""
    return sorted(scores, key=lambda p: (-scores[p], p))


def keep_top(scores: dict[int, float], k: int, forced=()) -> tuple[list[int], float]:
    """The `forced` positions plus the best `k - len(forced)` others, in position order, and
    the relative margin between the lowest score kept by rank and the highest left out (inf
    if none is left out)."""
    forced = [p for p in forced if p in scores]
    rest = rank({p: s for p, s in scores.items() if p not in forced})
    m = k - len(forced)
    assert m >= 0
    kept, out = rest[:m], rest[m:]
    margin = math.inf
    if kept and out:
        a, b = scores[kept[-1]], scores[out[0]]
        margin = (a - b) / max(abs(a), abs(b), 1e-300)
    return sorted(forced + kept), margin


def masked_attention(q, K, V, cols, qpos):
    """q (G, T, D) float64 at positions qpos (T,); K, V (N, D) indexed by position; each query
    row sees the positions `cols` that are not after it. Returns (G, T, D)."""
    idx = torch.tensor(cols, dtype=torch.long)
    visible = idx[None, :] <= qpos[:, None]  # (T, C)
    s = q @ K[idx].T / math.sqrt(q.shape[-1])  # (G, T, C)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return p @ V[idx]


class History:
    """Post-RoPE queries, keys and values per layer, float64, indexed by position."""

    def __init__(self, config):
        c = config
        self.L, self.Hq, self.Hkv, self.D = c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim
        self.G = self.Hq // self.Hkv
        self.Q = [torch.zeros(self.Hq, 0, self.D, dtype=torch.float64) for _ in range(self.L)]
        self.K = [torch.zeros(self.Hkv, 0, self.D, dtype=torch.float64) for _ in range(self.L)]
        self.V = [torch.zeros(self.Hkv, 0, self.D, dtype=torch.float64) for _ in range(self.L)]
        self.held = [[[] for _ in range(self.Hkv)] for _ in range(self.L)]

    def n(self, layer: int) -> int:
        return self.K[layer].shape[1]

    def append(self, layer, qr, kr, v, pos) -> list[list[int]]:
        """Add the new tokens (post-RoPE qr (Hq,T,D), kr, v (Hkv,T,D)); they join every KV
        head's held positions. Returns the columns each head attends over."""
        n = self.n(layer)
        qpos = pos.tolist()
        assert qpos == list(range(n, n + len(qpos))), "positions: the tokens seen before them"
        self.Q[layer] = torch.cat([self.Q[layer], qr.double()], dim=1)
        self.K[layer] = torch.cat([self.K[layer], kr.double()], dim=1)
        self.V[layer] = torch.cat([self.V[layer], v.double()], dim=1)
        cols = [h + qpos for h in self.held[layer]]
        self.held[layer] = [list(c) for c in cols]
        return cols

    def attention(self, layer, cols, pos) -> torch.Tensor:
        """Dense attention (Hq, T, D) of the newest T queries over `cols` per KV head."""
        T = pos.numel()
        q = self.Q[layer][:, -T:]
        out = torch.empty(self.Hq, T, self.D, dtype=torch.float64)
        for hk in range(self.Hkv):
            hs = slice(hk * self.G, (hk + 1) * self.G)
            out[hs] = masked_attention(q[hs], self.K[layer][hk], self.V[layer][hk], cols[hk], pos)
        return out


class Naive(History):
    """A reference KV manager: full float64 history, masked attention over the positions held,
    `policy(self, layer, point, n) -> rows per KV head or None` (None keeps what is held) at
    every chunk end, the prefill end and after every decode step. `events` records
    (layer, point, n, rows) at each of those points; `margins` collects what policies append
    there."""

    def __init__(self, model, policy=None):
        super().__init__(model.config)
        self.rope, self.policy = model.rope, policy
        self.seen = 0
        self.events: list[tuple] = []
        self.margins: list[float] = []

    def attend(self, layer, q, k, v, positions):
        qr = self.rope.apply(q, positions)[0]  # float32, as the model's caches rotate
        kr = self.rope.apply(k, positions)[0]
        cols = self.append(layer, qr, kr, v[0], positions)
        return self.attention(layer, cols, positions).to(q.dtype)[None]

    def begin_prefill(self, n: int) -> None:
        pass

    def end_chunk(self, t: int) -> None:
        self.seen += t
        self._point("chunk")

    def _point(self, point: str) -> None:
        for layer in range(self.L):
            n = self.n(layer)
            assert n == self.seen
            rows = self.policy(self, layer, point, n) if self.policy else None
            if rows is not None:
                assert all(set(r) <= set(h) for r, h in zip(rows, self.held[layer], strict=True))
                self.held[layer] = [sorted(r) for r in rows]
            self.events.append((layer, point, n, [list(r) for r in self.held[layer]]))

    def end_prefill(self) -> None:
        self._point("prefill")

    def end_step(self) -> None:
        self.seen += 1
        self._point("step")


class Watch(History):
    """The real cache of `spec` (new_kv), observed through its debug hook and a tap on attend.

    - Every attention output equals dense attention over the positions held (the ones the
      cache last reported, plus the tokens fed since) within `atol`.
    - Every report equals `predict(self, layer, point, n)` (None: nothing evicted, the report
      is what is held). Padding positions (-1, 2^31 - 1) are filtered out of the reports.
    `events` records (layer, point, n, rows sorted); `in_order` whether every report listed
    each head's positions ascending.
    """

    def __init__(self, model, spec, budget=None, predict=None, atol=1e-5):
        super().__init__(model.config)
        self.predict, self.atol = predict, atol
        self.events: list[tuple] = []
        self.in_order = True
        self.kv = new_kv(model, spec, budget, self.on_select)
        tap(self.kv, self.before, self.after)

    def before(self, layer, qr, kr, v, pos):
        return self.append(layer, qr, kr, v, pos)

    def after(self, layer, qr, kr, v, pos, out, cols):
        ref = self.attention(layer, cols, pos)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=self.atol)

    def on_select(self, layer, point, positions):
        assert positions.shape[0] == self.Hkv
        n = self.n(layer)
        raw = [[p for p in r if not is_pad(p)] for r in positions.tolist()]
        rows = [sorted(r) for r in raw]
        assert all(len(set(r)) == len(r) for r in rows), "a position is held twice"
        assert all(0 <= p < n for r in rows for p in r), "a position not seen yet"
        self.in_order &= raw == rows
        want = self.predict(self, layer, point, n) if self.predict else None
        if want is None:
            want = self.held[layer]
        assert rows == [sorted(w) for w in want], (layer, point, n)
        self.held[layer] = rows
        self.events.append((layer, point, n, rows))


def points(events, *names) -> list[tuple]:
    """The events at the points named (all but the chunk ends when none is named)."""
    return [e for e in events if (e[1] in names if names else e[1] != "chunk")]
