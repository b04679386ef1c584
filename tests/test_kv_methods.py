"""Compressed KV managers on a tiny random Llama (baselines.md sections 0-5, "How to test it").

Every reference here is dense and naive: full-precision history per layer, materialised
attention matrices, explicit sorting. The manager's own helpers are never called from them.
Pure-function tests (scorers, selector, allocators) are in test_kv_select.py.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import pytest
import torch
from calib_helpers import ensure_calibrated
from test_kv_select import ref_pyramid, ref_snap_scores, ref_topk

from kvrun.kv import build, check
from kvrun.models.config import ModelConfig
from kvrun.models.model import Transformer
from kvrun.models.rope import Rope, inverse_frequencies
from kvrun.run.session import Session, run_pass

E = 4  # bytes per fp32 element
L, HKV, D = 3, 2, 32


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is faster


# --- the tiny model and a driver ------------------------------------------------------------
def config(n_heads: int = 4, n_layers: int = L) -> ModelConfig:
    return ModelConfig(
        arch="llama", n_layers=n_layers, dim=64, n_heads=n_heads, n_kv_heads=HKV, head_dim=D,
        ffn_dim=128, vocab_size=256, context_length=4096,
    )  # fmt: skip


def random_transformer(c: ModelConfig, seed: int, qk: float = 0.25) -> Transformer:
    """Random weights (fixed seed); q/k projections scaled by `qk` so attention is peaked."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(c).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        elif "embed_tokens" in name:
            tensors[name] = torch.randn(shape, generator=g)
        elif "q_proj" in name or "k_proj" in name:
            tensors[name] = qk * torch.randn(shape, generator=g)
        else:
            tensors[name] = 0.1 * torch.randn(shape, generator=g)
    return Transformer.from_weights(c, tensors)


@functools.lru_cache(maxsize=4)
def tiny(n_heads: int = 4) -> Transformer:
    """The tiny model of these tests: 3 layers, 2 KV heads, head_dim 32."""
    return random_transformer(config(n_heads), 1234 + n_heads)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_kv(model, spec: str, budget=None, hook=None):
    kw = {"on_select": hook} if hook is not None else {}
    parsed = check(spec, budget)
    ensure_calibrated(model, parsed)  # kvzap, duo: a tiny calibration first
    if parsed.select.critical:  # CriticalKV reads the output projection (as Runtime.new_kv)
        kw["out_proj"] = lambda layer: model.model.layers[layer].self_attn.o_proj
    return build(parsed, model.config, model.rope, "cpu", torch.float32, **kw)


@torch.inference_mode()
def drive(model, kv, ids, ubatch, n_decode=0, tokens=None, after=None) -> torch.Tensor:
    """One turn: prefill `ids` in chunks (as Session does), then decode greedily (or `tokens`).

    Returns the logits (T, V) of every token fed; `after(point)` runs after each point. The
    passes a cache asks for after the prefill run as Session runs them; XKV's scoring pass
    before it runs only through Session (here XKV plans at the end of the prefill).
    """
    out, n = [], kv.seen
    kv.begin_prefill(len(ids))
    for s in range(0, len(ids), ubatch):
        chunk = ids[s : s + ubatch]
        pos = torch.arange(n, n + len(chunk))
        out.append(model(torch.tensor([chunk]), pos, kv)[0])
        kv.end_chunk(len(chunk))
        n += len(chunk)
        if after:
            after("chunk")
    passes = getattr(kv, "planning_pass", None)  # a test's own reference cache has none
    for p in passes("after", ids, None) if passes else []:  # KVzip's, as Session runs them
        run_pass(model, p, ubatch)
    kv.end_prefill()
    if after:
        after("prefill")
    for i in range(n_decode):
        tok = int(out[-1][-1].argmax()) if tokens is None else tokens[i]
        out.append(model(torch.tensor([[tok]]), torch.tensor([n]), kv)[0])
        kv.end_step()
        n += 1
        if after:
            after("step")
    return torch.cat(out)


def budget_tokens(budget: str, n: int, protected: int) -> int:
    """B(n) of baselines.md 0.2, exactly from the decimal."""
    b = Fraction(budget)
    return min(n, max(protected, math.ceil(b * n))) if b < 1 else min(n, math.floor(b))


class Events(list):
    """The debug hook: (layer, point, n, positions per KV head) at every compression point."""

    def __init__(self, check=None):
        super().__init__()
        self.kv, self.check = None, check
        self.in_order = True  # slots were reported in ascending position order

    def __call__(self, layer, point, positions):
        raw = positions.tolist()
        rows = [sorted(r) for r in raw]
        assert all(len(set(r)) == len(r) for r in rows), "a position is held twice"
        self.in_order &= raw == rows
        self.append((layer, point, self.kv.seen, rows))
        if self.check:
            self.check(self[-1])


def hooked(model, spec, budget, check=None):
    ev = Events(check)
    kv = new_kv(model, spec, budget, ev)
    ev.kv = kv
    return kv, ev


def tap(kv, before=None, after=None):
    """Wrap kv.attend; callbacks get (layer, qr (Hq,T,D), kr (Hkv,T,D), v, positions[, out])."""
    inner = kv.attend

    def attend(layer, q, k, v, positions):
        qr, kr = kv.rope.apply(q, positions)[0], kv.rope.apply(k, positions)[0]
        state = before(layer, qr, kr, v[0], positions) if before else None
        out = inner(layer, q, k, v, positions)
        if after:
            after(layer, qr, kr, v[0], positions, out[0], state)
        return out

    kv.attend = attend


@functools.lru_cache(maxsize=2)
def full_logits(n: int) -> torch.Tensor:
    """`full` over prompt(n, 1) in chunks of 7, then 10 greedy decode steps."""
    m = tiny()
    return drive(m, new_kv(m, "full"), prompt(n, seed=1), 7, n_decode=10)


# --- 1. budget covers everything ------------------------------------------------------------
EXACT = ["streaming", "snapkv", "pyramidkv", "kivi2:bits=16", "kivi4:bits=16",
         "snapkv+kivi2:bits=16", "pyramidkv+kivi4:bits=16"]  # fmt: skip


@pytest.mark.parametrize(
    "spec,n,exact",
    [(s, 150, True) for s in EXACT] + [("h2o", 150, False), ("kivi2", 100, False),
                                       ("kivi4", 100, False), ("full+kivi2", 100, False)],
)  # fmt: skip
def test_budget_covers_everything_equals_full(spec, n, exact):
    m = tiny()
    ids = prompt(n, seed=1)
    ref = full_logits(n)
    toks = ref[n - 1 :].argmax(-1).tolist()
    out = drive(m, new_kv(m, spec, "4096"), ids, 7, n_decode=10, tokens=toks)
    if exact:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


# --- a naive reference for decode-time eviction (streaming, h2o) ------------------------------
class Shadow:
    """Full fp64 history per layer; checks every attention output against materialised masked
    attention over the positions held, and predicts every eviction (streaming rule or H2O)."""

    def __init__(self, model, method, budget, sinks=0, recent="0.5", opts=""):
        self.model, self.method, self.budget = model, method, budget
        self.sinks, self.recent = sinks, Fraction(recent)
        self.kv, self.events = hooked(model, method + opts, budget, self.on_select)
        c = model.config
        self.G = c.n_heads // c.n_kv_heads
        self.K = [torch.zeros(HKV, 0, D, dtype=torch.float64) for _ in range(L)]
        self.V = [torch.zeros(HKV, 0, D, dtype=torch.float64) for _ in range(L)]
        self.held = [[[] for _ in range(HKV)] for _ in range(L)]
        self.acc = [[{} for _ in range(HKV)] for _ in range(L)]
        self.points = 0
        tap(self.kv, self.before, self.after)

    def before(self, layer, qr, kr, v, pos):
        d = self.kv.layers[layer].dense
        return d.acc.sum(dim=1).clone() if d.acc is not None else None

    def after(self, layer, qr, kr, v, pos, out, acc_before):
        Tq = pos.numel()
        self.K[layer] = torch.cat([self.K[layer], kr.double()], dim=1)
        self.V[layer] = torch.cat([self.V[layer], v.double()], dim=1)
        assert self.K[layer].shape[1] == int(pos[-1]) + 1  # history indexed by position
        if acc_before is not None:  # conservation: G per query row, summed over slots
            gain = self.kv.layers[layer].dense.acc.sum(dim=1) - acc_before
            torch.testing.assert_close(
                gain, torch.full((HKV,), float(self.G * Tq)), atol=1e-4, rtol=0
            )
        qpos = pos.tolist()
        for hk in range(HKV):
            cols = self.held[layer][hk] + qpos
            idx = torch.tensor(cols)
            visible = idx[None, :] <= pos[:, None]
            for g in range(self.G):
                h = hk * self.G + g
                s = qr[h].double() @ self.K[layer][hk, idx].T / math.sqrt(D)
                p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
                ref = p @ self.V[layer][hk, idx]
                torch.testing.assert_close(out[h].double(), ref, rtol=0, atol=1e-5)
                acc = self.acc[layer][hk]
                for j, col in enumerate(p.sum(dim=0).tolist()):
                    acc[cols[j]] = acc.get(cols[j], 0.0) + col
            self.held[layer][hk] = cols

    def on_select(self, item):
        layer, point, n, rows = item
        B = budget_tokens(self.budget, n, self.sinks + 1)
        for hk in range(HKV):
            held = self.held[layer][hk]
            if self.method not in ("streaming", "h2o"):  # prefill-time: adopt what was kept
                assert set(rows[hk]) <= set(held)
                held = rows[hk]
            elif len(held) > B:
                if self.method == "streaming":
                    rest = sorted((p for p in held if p >= self.sinks), reverse=True)
                else:  # h2o: the W(n) newest are protected, then by acc descending, position ascending
                    W = math.floor(self.recent * B)
                    rest = [p for p in held if p >= self.sinks and p < n - W]
                    rest.sort(key=lambda p, a=self.acc[layer][hk]: (-a[p], p))
                    rest = [p for p in held if p >= n - W] + rest
                sinks = [p for p in held if p < self.sinks]
                held = sorted(sinks + rest[: B - len(sinks)])
                assert len(held) == B
            assert rows[hk] == held, (layer, point, n, hk)
            self.held[layer][hk] = held
            self.acc[layer][hk] = {p: self.acc[layer][hk][p] for p in held}
        self.points += 1

    def run(self, n_prompt, ubatch, n_decode, seed=3):
        out = drive(self.model, self.kv, prompt(n_prompt, seed), ubatch, n_decode)
        if self.method in ("streaming", "h2o"):
            assert self.points == L * (-(-n_prompt // ubatch) + n_decode)
        return out


# --- 2, 3, 10: streaming and H2O against the naive reference -------------------------------------
@pytest.mark.parametrize(
    "opts,budget,sinks",
    [("", "20", 4), ("", "0.3", 4), ("", "0.55", 4), (":sinks=0", "17", 0), (":sinks=0", "0.3", 0)],
)
def test_streaming_kept_sets_and_masked_attention(opts, budget, sinks):
    sh = Shadow(tiny(), "streaming", budget, sinks=sinks, opts=opts)
    sh.run(61, 16, 20)
    evicting = 0
    for _, _, n, rows in sh.events:
        B = budget_tokens(budget, n, sinks + 1)
        if n > B:
            evicting += 1
            assert rows == [list(range(sinks)) + list(range(n - (B - sinks), n))] * HKV
        else:
            assert rows == [list(range(n))] * HKV
    assert evicting >= L * 20


@pytest.mark.parametrize(
    "n_heads,opts,budget,recent,sinks",
    [(4, "", "24", "0.5", 0), (4, "", "0.3", "0.5", 0), (6, "", "0.3", "0.5", 0),
     (4, ":sinks=2", "0.3", "0.5", 2), (4, ":recent=0.25", "21", "0.25", 0)],
)  # fmt: skip
def test_h2o_matches_naive_oracle(n_heads, opts, budget, recent, sinks):
    """Kept sets at every point, every layer output (masked-attention equivalence) and the
    conservation of accumulated attention, over 4 prefill chunks and 20 decode steps."""
    sh = Shadow(tiny(n_heads), "h2o", budget, sinks=sinks, recent=recent, opts=opts)
    sh.run(61, 16, 20)
    # heads choose differently (otherwise H2O would be as weak a test as StreamingLLM)
    assert any(rows[0] != rows[1] for *_, rows in sh.events)


def test_h2o_recent_share_is_exact_decimal():
    """W(n) = floor(recent * B(n)) from the decimal: recent=0.57 and B=100 protect the 57 newest
    (0.57 * 100 is 56.99... in floats)."""
    c = config(2, n_layers=1)
    rope = Rope(inverse_frequencies(c), torch.device("cpu"), torch.float32)
    ev = Events()
    kv = build(check("h2o:recent=0.57", "100"), c, rope, "cpu", torch.float32, on_select=ev)
    ev.kv = kv
    g = torch.Generator().manual_seed(0)
    n = 110
    # u lives on the slowest RoPE pairs, so q . k barely rotates over 110 positions
    u = torch.zeros(D)
    u[12:16], u[28:32] = 1.0, 1.0
    u = u / u.norm()
    q = (4 * u).expand(1, HKV, n, D).clone()
    k = torch.randn(1, HKV, n, D, generator=g)
    k[:, :, n - 57] = -8 * u  # every query turns away from position 53
    v = torch.randn(1, HKV, n, D, generator=g)
    kv.begin_prefill(n)
    kv.attend(0, q, k, v, torch.arange(n))
    acc = kv.layers[0].dense.acc
    assert acc[:, : n - 56].argmin(dim=1).tolist() == [n - 57] * HKV  # the lowest candidate
    kv.end_chunk(n)
    rows = ev[-1][3]
    for r in rows:
        assert len(r) == 100 and set(range(n - 57, n)) <= set(r), "the W(n) newest are protected"


# --- 4, 5. SnapKV / PyramidKV selection against the dense reference ------------------------------
def capture(kv, n_max=1024):
    """Post-RoPE queries (Hq, N, D) and keys (Hkv, N, D) the manager saw, by position."""
    c = kv.config
    Q = torch.zeros(c.n_layers, c.n_heads, n_max, D)
    K = torch.zeros(c.n_layers, HKV, n_max, D)

    def after(layer, qr, kr, v, pos, out, state):
        Q[layer][:, pos], K[layer][:, pos] = qr, kr

    tap(kv, after=after)
    return Q, K


def ref_window_select(Q, K, held, w, kernel, B):
    """Dense SnapKV over the slots `held` (positions per KV head, the last w the window)."""
    if len(held[0]) <= B:
        return held
    window = held[0][-w:]
    assert all(h[-w:] == window for h in held) and window == list(range(window[0], window[-1] + 1))
    k = torch.stack([K[hk, h] for hk, h in enumerate(held)])
    top = ref_topk(ref_snap_scores(Q[:, window], k, kernel), B - w)
    return [[h[j] for j in t] + window for h, t in zip(held, top, strict=True)]


def spec_opts(spec):
    o = dict(kv.split("=") for kv in spec.partition(":")[2].split("+")[0].split(",") if kv)
    return int(o.get("window", 32)), int(o.get("kernel", 7))


@pytest.mark.parametrize(
    "n_heads,spec,budget,n,ubatch",
    [(6, "snapkv", "0.3", 150, 7),  # G = 3; the window spans five chunks
     (4, "snapkv", "48", 90, 40),  # G = 2; last chunk (10) shorter than the window
     (6, "snapkv:window=8,kernel=5", "0.2", 120, 13),
     (4, "pyramidkv", "64", 150, 40),
     (6, "pyramidkv:window=8", "0.25", 200, 64),
     (4, "pyramidkv:window=16", "0.7", 70, 30)],  # clamp: layer 0 keeps all 70
)  # fmt: skip
def test_window_selection_matches_dense_reference(n_heads, spec, budget, n, ubatch):
    m = tiny(n_heads)
    kv, ev = hooked(m, spec, budget)
    Q, K = capture(kv)
    drive(m, kv, prompt(n, 5), ubatch)
    w, kernel = spec_opts(spec)
    B = budget_tokens(budget, n, w)
    budgets = ref_pyramid(B, n, w, L, 20) if spec.startswith("pyramid") else [B] * L
    if spec.startswith("pyramid"):
        assert sum(budgets) == L * B and budgets[0] > budgets[-1]
        assert (budgets[0] == n) == (budget == "0.7")  # the clamp case is the one meant
    prefill = [e for e in ev if e[1] == "prefill"]
    assert len(prefill) == len(ev) == L
    differ = False
    for layer, _, seen, rows in prefill:
        assert seen == n
        held = [list(range(n))] * HKV
        assert rows == ref_window_select(Q[layer], K[layer], held, w, kernel, budgets[layer])
        assert all(len(r) == min(n, budgets[layer]) for r in rows)
        differ |= rows[0] != rows[1]
    assert differ  # KV heads select independently
    assert ev.in_order  # kept slots are written in ascending position order (0.4)
    assert kv.kept_counts() == [min(n, b) for b in budgets]


@pytest.mark.parametrize("spec", ["snapkv", "pyramidkv:window=16"])
def test_chunked_prefill_selects_as_one_chunk(spec):
    m = tiny()
    kept = []
    for ubatch in (5, 1000):
        kv, ev = hooked(m, spec, "0.3")
        drive(m, kv, prompt(131, 6), ubatch)
        kept.append(ev)
    assert kept[0] == kept[1]


# --- 6. snapkv:chunked=true bounds the cache during prefill --------------------------------------
def test_snapkv_chunked_mode_bounds_prefill_memory():
    m, n, ub, B, w = tiny(), 600, 64, 100, 32
    Hq = m.config.n_heads
    slot, qwin = 2 * HKV * D * E, Hq * w * D * E

    def check(kv, chunked):
        peak = []
        tap(kv, after=lambda *a: peak.append(kv.nbytes()))
        seen = []

        def progress(done, total):
            T = min(done, B) if chunked else done
            assert kv.nbytes() == L * (T * slot + Hq * min(w, done) * D * E)
            seen.append(done)

        Session(m, None, kv, ubatch=ub).prefill(prompt(n, 7), progress)
        assert seen == list(range(ub, n, ub)) + [n]
        return max(peak)

    kv, ev = hooked(m, "snapkv:chunked=true", str(B))
    Q, K = capture(kv)
    peak = check(kv, True)
    assert peak <= L * ((B + ub) * slot + qwin)
    assert kv.kept_counts() == [B] * L and kv.nbytes() == L * B * slot
    # every chunk end selects with that chunk's window over the slots held (the dense reference)
    held = {layer: ([[] for _ in range(HKV)], 0) for layer in range(L)}
    for layer, _, seen, rows in ev:
        prev, prev_n = held[layer]
        cand = [h + list(range(prev_n, seen)) for h in prev]
        assert rows == ref_window_select(Q[layer], K[layer], cand, w, 7, min(seen, B)), seen
        held[layer] = rows, seen
    assert [p for _, p, *_ in ev] == ["chunk"] * L * -(-n // ub) + ["prefill"] * L
    assert all(seen == n for _, seen in held.values())
    # without chunked the cache holds the whole prompt until end_prefill
    peak_full = check(new_kv(m, "snapkv", str(B)), False)
    assert peak_full >= L * n * slot > 3 * peak


# --- 7, 8. bytes and kept counts at every compression point ---------------------------------------
def kivi_bytes(tokens: int, bits: int, group: int = 32, residual: int = 128) -> int:
    tq = residual * (tokens // residual)
    per = Fraction(bits, 4) + Fraction(4 * E, group)
    b = L * HKV * D * (tq * per + 2 * E * (tokens - tq))
    assert b.denominator == 1
    return int(b)


@pytest.mark.parametrize(
    "spec,budget,n,ubatch",
    [("full", None, 150, 40), ("streaming", "0.3", 150, 40), ("h2o", "40", 150, 40),
     ("snapkv", "0.3", 150, 40), ("pyramidkv", "64", 150, 40), ("kivi2", None, 300, 64),
     ("kivi4", None, 300, 64), ("snapkv+kivi2", "200", 400, 100),
     ("snapkv:window=8+kivi4", "0.45", 330, 128)],
)  # fmt: skip
def test_nbytes_and_kept_counts_match_formulas(spec, budget, n, ubatch):
    m = tiny()
    Hq = m.config.n_heads
    method = spec.split(":")[0].split("+")[0]
    method = method if method in ("streaming", "h2o", "snapkv", "pyramidkv") else "full"
    bits = 2 if "kivi2" in spec else 4 if "kivi4" in spec else None
    P = {"streaming": 5, "h2o": 1}.get(method, spec_opts(spec)[0])
    w = spec_opts(spec)[0]
    if spec == "full":
        kv, ev = new_kv(m, "full"), []
    else:
        kv, ev = hooked(m, spec, budget)
    state = {"n_p": None}

    def after(point):
        nn = kv.seen
        assert kv.nbytes_full() == 2 * L * HKV * nn * D * E
        counts = kv.kept_counts() if spec != "full" else None
        if method == "full":
            T = [nn] * L
            expect = kivi_bytes(nn, bits) if bits else 2 * L * HKV * nn * D * E
        elif method in ("streaming", "h2o"):
            T = [min(nn, budget_tokens(budget, nn, P))] * L
            per_slot = 2 * HKV * D * E + 4 if method == "streaming" else HKV * (2 * D * E + 8)
            expect = L * T[0] * per_slot
        elif point == "chunk":  # prefill-time methods hold everything, plus the window queries
            T = [nn] * L
            expect = L * (2 * HKV * nn * D * E + Hq * min(w, nn) * D * E)
        else:
            if point == "prefill":
                state["n_p"] = nn
            n_p, n_gen = state["n_p"], nn - state["n_p"]
            B = budget_tokens(budget, n_p, P)
            budgets = ref_pyramid(B, n_p, w, L, 20) if method == "pyramidkv" else [B] * L
            T = [min(n_p, b) + n_gen for b in budgets]
            if bits:
                expect = kivi_bytes(T[0], bits)
            else:
                expect = sum(2 * HKV * t * D * E for t in T)
        assert kv.nbytes() == expect, (point, nn)
        if counts is not None:
            assert counts == T, (point, nn)
        decode_time = method in ("streaming", "h2o")
        if (decode_time and point != "prefill") or (
            method in ("snapkv", "pyramidkv") and point == "prefill"
        ):
            assert [e[:3] for e in ev[-L:]] == [(layer, point, nn) for layer in range(L)]
            for layer, _, _, rows in ev[-L:]:  # every KV head holds exactly T_l slots
                assert [len(r) for r in rows] == [T[layer]] * HKV

    drive(m, kv, prompt(n, 8), ubatch, n_decode=12, after=after)
    points = {"full": 0, "streaming": -(-n // ubatch) + 12, "h2o": -(-n // ubatch) + 12}
    assert len(ev) == L * points.get(method, 1)


# --- 9. GQA duplication (0.8.4) on a hand-built layer ---------------------------------------
def layer_kv(spec, budget, n_heads):
    """A one-layer manager, fed directly (no model); returns it and its event list."""
    c = config(n_heads, n_layers=1)
    rope = Rope(inverse_frequencies(c), torch.device("cpu"), torch.float32)
    ev = Events()
    kv = build(check(spec, budget), c, rope, "cpu", torch.float32, on_select=ev)
    ev.kv = kv
    return kv, ev


def feed(kv, q, k, v, n_prompt, ubatch):
    """Prefill the first n_prompt tokens in chunks, then decode the rest one by one."""
    kv.begin_prefill(n_prompt)
    outs = []
    for s in range(0, n_prompt, ubatch):
        e = min(s + ubatch, n_prompt)
        outs.append(kv.attend(0, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], torch.arange(s, e)))
        kv.end_chunk(e - s)
    kv.end_prefill()
    for t in range(n_prompt, q.shape[2]):
        outs.append(kv.attend(0, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                              torch.tensor([t])))  # fmt: skip
        kv.end_step()
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize(
    "spec,budget", [("snapkv:window=8", "24"), ("snapkv", "0.3"), ("h2o", "20"), ("h2o", "0.25")]
)
def test_gqa_duplicated_heads_select_as_mha(spec, budget, G):
    g = torch.Generator().manual_seed(11)
    n, n_prompt = 150, 130
    q = 2 * torch.randn(1, HKV, n, D, generator=g)
    k = torch.randn(1, HKV, n, D, generator=g)
    v = torch.randn(1, HKV, n, D, generator=g)
    kv1, ev1 = layer_kv(spec, budget, HKV)  # MHA: one query head per KV head
    kvG, evG = layer_kv(spec, budget, HKV * G)  # G identical copies of it
    out1 = feed(kv1, q, k, v, n_prompt, 16)
    outG = feed(kvG, q.repeat_interleave(G, dim=1), k, v, n_prompt, 16)
    assert len(ev1) == (1 if spec.startswith("snapkv") else -(-n_prompt // 16) + n - n_prompt)
    assert evG == ev1 and any(r[0] != r[1] for *_, r in ev1)
    # the G copies attend as G query rows of one SDPA call (kvrun/kv/attention.py's decode
    # form), the MHA layer as one row: equal up to float32 rounding of different blockings
    torch.testing.assert_close(outG, out1.repeat_interleave(G, dim=1), rtol=2e-6, atol=1e-6)


# --- 11. later chat turns ---------------------------------------------------------------------
def test_snapkv_later_turn_reselects_all_held_slots():
    m, w, budget = tiny(), 32, "0.3"
    kv, ev = hooked(m, "snapkv", budget)
    Q, K = capture(kv)
    drive(m, kv, prompt(120, 9), 32, n_decode=5)
    assert len(ev) == L and kv.seen == 125
    turn1 = {layer: rows for layer, _, _, rows in ev}
    assert kv.kept_counts() == [budget_tokens(budget, 120, w) + 5] * L  # 36 + 5
    drive(m, kv, prompt(40, 10), 32, n_decode=3)
    assert len(ev) == 2 * L
    n = 165
    B = budget_tokens(budget, n, w)  # B(n) over all turns: 50 of the 81 slots held
    for layer, point, seen, rows in ev[L:]:
        assert (point, seen) == ("prefill", n)
        held = [r + list(range(120, n)) for r in turn1[layer]]
        assert rows == ref_window_select(Q[layer], K[layer], held, w, 7, B)
        assert all(len(r) == B for r in rows) and rows[0] != rows[1]
        assert any(p < 120 for p in rows[0]) and any(120 <= p < 125 for r in rows for p in r)
    assert kv.kept_counts() == [B + 3] * L


@pytest.mark.parametrize("spec", ["snapkv", "pyramidkv:window=16"])
def test_window_methods_masked_attention_across_turns(spec):
    """0.8.2 for prefill-time selection: every layer output of two turns (prefill chunks and
    decode) equals dense attention over the positions kept; without the debug hook (no positions
    held, masks by slot order) the logits are the same."""
    m = tiny()
    sh = Shadow(m, spec.split(":")[0], "0.3", opts=spec[len(spec.split(":")[0]) :])
    turns = [(120, 9, 32, 5), (50, 10, 16, 4)]
    hooked_logits = torch.cat([sh.run(n, ub, nd, seed) for n, seed, ub, nd in turns])
    assert sh.points == 2 * L and all(len(r) < 120 for *_, rows in sh.events for r in rows)
    kv = new_kv(m, spec, "0.3")
    plain = [drive(m, kv, prompt(n, seed), ub, nd) for n, seed, ub, nd in turns]
    torch.testing.assert_close(torch.cat(plain), hooked_logits, rtol=0, atol=1e-5)


def test_snapkv_kivi_later_turn_selects_only_new_tokens():
    m, w, budget = tiny(), 8, "0.5"
    kv, ev = hooked(m, "snapkv:window=8+kivi2", budget)
    drive(m, kv, prompt(300, 11), 64, n_decode=5)
    B1 = budget_tokens(budget, 300, w)  # 150: body 128, tail 22 + 5 generated
    stores = [st.kivi for st in kv.layers]
    assert [(s.body_len, s.tail_len) for s in stores] == [(128, B1 - 128 + 5)] * L
    assert [len(r) for *_, rows in ev for r in rows] == [B1] * (L * HKV)
    body = [[t.clone() for t in s.body()] for s in stores]
    tail = [[t.clone() for t in s.tail()] for s in stores]
    drive(m, kv, prompt(60, 12), 64, n_decode=2)
    B2 = budget_tokens(budget, 60, w)  # the same fraction of the new turn's 60 tokens: 30
    assert len(ev) == 2 * L
    for _, point, seen, rows in ev[L:]:
        assert (point, seen) == ("prefill", 365)
        for r in rows:  # only the new turn's tokens are selected, its window always kept
            assert len(r) == B2 and set(range(357, 365)) <= set(r) and min(r) >= 305
    for s, b, t in zip(stores, body, tail, strict=True):
        assert s.body_len == 128 and all(
            torch.equal(x, y) for x, y in zip(s.body(), b, strict=True)
        )
        assert s.tail_len == 27 + B2 + 2
        assert all(torch.equal(x[:, :27], y) for x, y in zip(s.tail(), t, strict=True))
    assert kv.kept_counts() == [B1 + 5 + B2 + 2] * L
    assert kv.nbytes() == kivi_bytes(B1 + 5 + B2 + 2, 2)
