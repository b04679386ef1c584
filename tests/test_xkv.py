"""XKV (methods/xkv.md, "How to test it" 1-11), its profiles and `kvrun profile`.

References are naive and written out here: materialised fp64 attention, loops for pooling,
sorting python lists for the allocation, brute force over every composition of small
budgets. They never call kvrun.kv.methods.xkv's helpers. The tiny model of test_kv_methods (3 layers,
2 KV heads, D 32) runs most tests; the default model runs the CLI ones.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
import re

import pytest
import torch
from cli_checks import one_error_line
from click.testing import CliRunner
from passkey_helpers import passkey_prompt
from test_kv_methods import (
    HKV,
    Shadow,
    budget_tokens,
    capture,
    drive,
    feed,
    layer_kv,
    prompt,
    random_transformer,
    tiny,
)
from test_kv_methods import config as tiny_config
from test_kv_methods import new_kv as build

import kvrun.cli.common  # noqa: F401 - the CLI modules, loaded
import kvrun.run.runtime
from kvrun.cli.main import KvrunGroup, cli
from kvrun.cli.profile import profile
from kvrun.errors import KvrunError
from kvrun.kv.attention import pool_scores
from kvrun.kv.methods.xkv import cache as xkv
from kvrun.kv.methods.xkv.cache import (
    Profile,
    allocate_budget,
    allocate_target,
    layer_scores,
    load_profile,
    profile_budgets,
    save_profile,
)
from kvrun.models.model import Transformer
from kvrun.run.session import Session
from kvrun.tasks.passkey import answer_matches

E, D = 4, 32  # fp32 bytes per element; the tiny model's head_dim
NEG = float("-inf")


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny tensors run faster on one thread; the default model keeps all of them."""
    if "default_runtime" in request.fixturenames:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --- naive references ------------------------------------------------------------------------
def ref_pool(x: list[float], pool: str) -> list[float]:
    """Pooling by loops: avg over K with zero pads counted, max over the in-range values."""
    if pool == "none":
        return list(x)
    kind, k = pool.split(":")
    h, n = int(k) // 2, len(x)
    out = []
    for j in range(n):
        vals = [x[m] for m in range(j - h, j + h + 1) if 0 <= m < n]
        out.append(sum(vals) / int(k) if kind == "avg" else max(vals))
    return out


def ref_scores(qw: torch.Tensor, keys: torch.Tensor, pool: str):
    """w (C,) and s (Hkv, C) as python lists, fp64: every window row's softmax over the slots
    (causal inside the window), averaged over rows, then head mean / group sum, then pooled."""
    Hq, w, d = qw.shape
    Hkv, T, _ = keys.shape
    G, C = Hq // Hkv, T - w
    a = []
    for h in range(Hq):
        logits = qw[h].double() @ keys[h // G].double().T / math.sqrt(d)  # (w, T)
        for r in range(w):
            logits[r, T - w + r + 1 :] = NEG
        A = torch.softmax(logits, dim=-1)
        a.append([float(A[:, j].sum()) / w for j in range(C)])
    mean = [sum(a[h][j] for h in range(Hq)) / Hq for j in range(C)]
    s = [ref_pool([sum(a[hk * G + g][j] for g in range(G)) for j in range(C)], pool)
         for hk in range(Hkv)]  # fmt: skip
    return ref_pool(mean, pool), s


def ref_allocate(p: list[list[float]], N: int, f: int) -> list[int]:
    """Global top-N by sorting tuples: the floors first, then (-p, layer, rank)."""
    ranked = [sorted(x, reverse=True) for x in p]
    fl = [min(f, len(x)) for x in p]
    N = max(sum(fl), min(N, sum(len(x) for x in p)))
    extra = sorted((-v, i, r) for i, x in enumerate(ranked) for r, v in enumerate(x) if r >= fl[i])
    n = list(fl)
    for _, i, _ in extra[: N - sum(fl)]:
        n[i] += 1
    return n


def ref_target(p: list[list[float]], R: float, f: int) -> list[int]:
    """Target mode by sorting tuples: add entries until the mean retained mass reaches R."""
    ranked = [sorted(x, reverse=True) for x in p]
    n = [min(f, len(x)) for x in p]
    mass = sum(sum(x[:k]) for x, k in zip(ranked, n, strict=True))
    extra = sorted((-v, i, r) for i, x in enumerate(ranked) for r, v in enumerate(x) if r >= n[i])
    for v, i, _ in extra:
        if mass / len(p) >= R:
            break
        mass -= v
        n[i] += 1
    return n


def retained(p: list[list[float]], n: list[int]) -> float:
    """R_avg: the mean over layers of the mass of each layer's n_i best entries."""
    return sum(sum(sorted(x, reverse=True)[:k]) for x, k in zip(p, n, strict=True)) / len(p)


def compositions(C: list[int], f: int, total: int | None):
    """Every (n_0..n_{L-1}) with min(f, C_i) <= n_i <= C_i (and sum = total when given)."""
    for n in itertools.product(*[range(min(f, c), c + 1) for c in C]):
        if total is None or sum(n) == total:
            yield list(n)


def tensors(p: list[list[float]]) -> list[torch.Tensor]:
    return [torch.tensor(x, dtype=torch.float32) for x in p]


def f32(p: list[list[float]]) -> list[list[float]]:
    """The values as the implementation sees them (rounded to fp32)."""
    return [torch.tensor(x, dtype=torch.float32).tolist() for x in p]


# --- the model ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def toy(n_layers: int = 2, n_heads: int = 4) -> Transformer:
    """A random model with peaked attention (as test_kv_methods.tiny), any number of layers."""
    return random_transformer(tiny_config(n_heads, n_layers), 77 + n_layers, qk=0.3)


class Hook(list):
    """on_select debug hook: (layer, point, seen, kept positions per KV head)."""

    def __init__(self):
        super().__init__()
        self.kv = None

    def __call__(self, layer, point, positions):
        self.append((layer, point, self.kv.seen, positions.tolist()))


def hooked(model, spec, budget=None):
    ev = Hook()
    kv = build(model, spec, budget, ev)
    ev.kv = kv
    return kv, ev


@torch.inference_mode()
def run(model, kv, ids, ubatch, n_decode=0, tokens=None, session=None):
    """Through Session (so plan=two-pass gets its scoring pass): prefill, then greedy decode.
    Returns the stacked logits (1 + n_decode, V)."""
    s = session or Session(model, None, kv, ubatch=ubatch)
    out = [s.prefill(ids)]
    for i in range(n_decode):
        out.append(s.decode(int(out[-1].argmax()) if tokens is None else tokens[i]))
    return torch.stack(out)


# --- 6. pooling ----------------------------------------------------------------------------
@pytest.mark.parametrize("j", [0, 2, 10, 24])
def test_pool_unit_impulse(j):
    x = torch.zeros(2, 25)
    x[1, j] = 1.0
    avg = pool_scores(x, "avg:7")
    assert avg.shape == x.shape and avg[0].abs().sum() == 0
    expect = [1 / 7 if abs(i - j) <= 3 else 0.0 for i in range(25)]  # zero pads count at edges
    torch.testing.assert_close(avg[1], torch.tensor(expect), rtol=0, atol=1e-7)
    mx = pool_scores(x, "max:7")
    assert mx[1].tolist() == [1.0 if abs(i - j) <= 3 else 0.0 for i in range(25)]
    assert torch.equal(pool_scores(x, "none"), x)
    y = torch.rand(3, 11, generator=torch.Generator().manual_seed(j))
    for pool in ("avg:7", "avg:3", "max:5", "avg:1"):
        got = pool_scores(y, pool)
        ref = torch.tensor([ref_pool(r, pool) for r in y.tolist()])
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("G,pool", [(1, "avg:7"), (2, "max:7"), (3, "none"), (4, "avg:7")])
def test_layer_scores_match_dense_reference(G, pool):
    g = torch.Generator().manual_seed(G)
    w, T = 8, 60
    qw, k = 2 * torch.randn(2 * G, w, D, generator=g), torch.randn(2, T, D, generator=g)
    got_w, got_s = layer_scores(qw, k, pool)
    ref_w, ref_s = ref_scores(qw, k, pool)
    torch.testing.assert_close(
        got_w.double(), torch.tensor(ref_w, dtype=torch.float64), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(
        got_s.double(), torch.tensor(ref_s, dtype=torch.float64), rtol=0, atol=1e-6
    )


# --- 3, 4, 5. allocation ---------------------------------------------------------------------
@pytest.mark.parametrize("alloc", ["topk", "loop"])
def test_hand_built_allocation(alloc):
    p = tensors([[0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.29, 0.01]])
    assert allocate_budget(p, 3, 0, alloc) == [0, 3]
    assert allocate_budget(p, 3, 1, alloc) == [1, 2]
    assert allocate_target(p, 0.65, 0, alloc) == [2, 3]  # mass 1.24 < 1.3 <= 1.49
    # ties go to the lower layer, then the higher rank; clamps to [L f, L C]
    q = tensors([[0.5, 0.5], [0.5, 0.5]])
    assert allocate_budget(q, 3, 0, alloc) == [2, 1]
    assert allocate_budget(q, 99, 0, alloc) == [2, 2]
    assert allocate_budget(q, 0, 1, alloc) == [1, 1]


def random_case(rng: random.Random):
    L = rng.randint(1, 5)
    same = rng.random() < 0.5  # first prefill: every layer has C; later turns: C_i differ
    C0 = rng.randint(0, 8)
    C = [C0 if same else rng.randint(0, 8) for _ in range(L)]
    ties = rng.random() < 0.5
    p = []
    for c in C:
        raw = [float(rng.randint(0, 3)) if ties else rng.random() for _ in range(c)]
        total = sum(raw)
        p.append([x / total for x in raw] if total > 0 else raw)
    return p, C, rng.randint(0, sum(C) + 2), rng.randint(0, 3)


def test_greedy_loop_equals_top_n_and_the_naive_sort():
    rng = random.Random(5)
    for _ in range(1000):
        p, C, N, f = random_case(rng)
        top = allocate_budget(tensors(p), N, f, "topk")
        assert allocate_budget(tensors(p), N, f, "loop") == top
        assert top == ref_allocate(f32(p), N, f)
        R = rng.choice([0.0, 0.3, 0.5, 0.8, 0.95, 1.0])
        tt = allocate_target(tensors(p), R, f, "topk")
        assert allocate_target(tensors(p), R, f, "loop") == tt
        # target mode is the top-m allocation for the smallest m that reaches R
        m, pf = sum(tt), f32(p)
        assert tt == ref_allocate(pf, m, f)
        fl = [min(f, c) for c in C]
        assert retained(pf, tt) >= R - 1e-9 or tt == C
        if m > sum(fl):
            assert retained(pf, ref_allocate(pf, m - 1, f)) < R + 1e-9


def test_allocation_is_optimal_over_every_composition():
    """Budget mode maximises R_avg over all compositions; target mode needs the fewest tokens;
    both keep sum n_i = N (budget) and f <= n_i <= C."""
    rng = random.Random(9)
    for _ in range(300):
        p, C, N, f = random_case(rng)
        C = C[:3]
        p = f32(p[:3])
        fl = [min(f, c) for c in C]
        Nc = max(sum(fl), min(N, sum(C)))
        n = allocate_budget(tensors(p), N, f)
        assert sum(n) == Nc and all(a <= b <= c for a, b, c in zip(fl, n, C, strict=True))
        best = max(retained(p, m) for m in compositions(C, f, Nc))
        assert retained(p, n) >= best - 1e-9
        R = rng.choice([0.2, 0.5, 0.9])
        t = allocate_target(tensors(p), R, f)
        every = [(sum(m), retained(p, m)) for m in compositions(C, f, None)]
        lo = min((k for k, r in every if r >= R - 1e-9), default=sum(C))
        hi = min((k for k, r in every if r >= R + 1e-9), default=sum(C))
        assert lo <= sum(t) <= hi  # the fewest tokens that reach R (exact up to rounding)


def test_allocation_beats_random_allocations():
    g = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    L, C, f = 6, 50, 8
    p = [torch.softmax(3 * torch.randn(C, generator=g), 0) for _ in range(L)]
    pl = [x.tolist() for x in p]
    for N in (L * f, 100, 170, 299, L * C):
        n = allocate_budget(p, N, f)
        assert sum(n) == N and all(f <= x <= C for x in n)
        ours = retained(pl, n)
        for _ in range(100):
            m = [f] * L
            for _ in range(N - L * f):
                m[rng.choice([i for i in range(L) if m[i] < C])] += 1
            assert retained(pl, m) <= ours + 1e-9


# --- 10. profiles (pure) ---------------------------------------------------------------------
def test_profile_rounding_rules():
    # equal shares: largest remainder, ties to the lower layer
    assert profile_budgets([0.3, 0.3, 0.3], "fractions", 20, 3 * 2 + 4, 2, 10, False) == [4, 3, 3]
    # layer 0 is cut to C; the excess fills the others in descending phi (ties: lower layer)
    assert profile_budgets([0.5, 0.1, 0.1], "fractions", 20, 18, 2, 10, False) == [10, 6, 2]
    # tokens: the same split; target mode rounds phi * t and clips to [f, C]
    assert profile_budgets([6.0, 2.0, 4.0], "tokens", 20, 12, 2, 10, False) == [6, 2, 4]
    assert profile_budgets([0.52, 0.01, 0.125], "fractions", 20, 0, 2, 10, True) == [10, 2, 3]
    assert profile_budgets([0.3, 0.3], "fractions", 5, 10, 8, 0, False) == [0, 0]  # t <= window


def test_profile_round_trip_reproduces_budgets(tmp_path):
    """Save n_i/t, load, and get n_i back for the same length and budget; other lengths keep
    sum n_i = N and the floors."""
    rng = random.Random(1)
    path = tmp_path / "p.json"
    for _ in range(300):
        L, t, f = rng.randint(1, 6), rng.randint(20, 400), rng.choice([0, 1, 8])
        C = t - 8
        fl = min(f, C)
        N = rng.randint(L * fl, L * C)
        n = [fl] * L
        for _ in range(N - L * fl):
            n[rng.choice([i for i in range(L) if n[i] < C])] += 1
        for units in ("fractions", "tokens"):
            vals = [x / t for x in n] if units == "fractions" else [float(x) for x in n]
            save_profile(path, Profile("m", L, 8, "avg:7", units, vals, 1))
            prof = load_profile(path)
            assert prof.values == vals and prof.units == units
            assert profile_budgets(prof.values, units, t, N, f, C, False) == n
            assert profile_budgets(prof.values, units, t, 0, f, C, True) == n
            t2 = rng.randint(9, 900)
            C2 = t2 - 8
            N2 = rng.randint(0, L * C2)
            n2 = profile_budgets(prof.values, units, t2, N2, f, C2, False)
            f2 = min(f, C2)
            assert sum(n2) == max(L * f2, min(N2, L * C2))
            assert all(f2 <= x <= C2 for x in n2)


BAD_PROFILES = [
    ("{not json", "not valid JSON"),
    ('["xkv"]', "not an XKV profile"),
    ('{"method": "snapkv"}', "not an XKV profile"),
    ('{"method": "xkv", "n_layers": 3, "fractions": [0.1, 0.2]}', "malformed"),
    ('{"method": "xkv", "n_layers": 3, "fractions": [0.1, -0.2, 0.1]}', "malformed"),
    ('{"method": "xkv", "n_layers": 3, "fractions": [0.1, "a", 0.1]}', "malformed"),
    ('{"method": "xkv", "n_layers": 3, "fractions": [0.1, 0.1, 0.1], "count": 0}', "malformed"),
    ('{"method": "xkv", "n_layers": 4, "fractions": [0.1, 0.1, 0.1, 0.1]}', "has 4 layers"),
    ('{"method": "xkv", "n_layers": 3, "fractions": [0.1, 0.1, 0.1], "window": 16}', "window=16"),
    ('{"method": "xkv", "n_layers": 3, "fractions": [0.1, 0.1, 0.1], "units": "bits"}',
     "malformed"),
]  # fmt: skip


@pytest.mark.parametrize("text,needle", BAD_PROFILES)
def test_bad_profile_is_one_line_error(tmp_path, text, needle):
    path = tmp_path / "bad.json"
    path.write_text(text)
    m = tiny()
    with pytest.raises(KvrunError, match=needle) as e:
        build(m, f"xkv:profile={path}", "0.3")
    assert "\n" not in str(e.value)


def test_target_with_budget_is_an_error():
    with pytest.raises(KvrunError, match="give one of them"):
        build(tiny(), "xkv:target=0.9", "0.3")


# --- 2. a budget that covers everything ------------------------------------------------------
@pytest.mark.parametrize(
    "spec,ubatch", [("xkv", 1000), ("xkv:plan=deferred", 1000), ("xkv", 7), ("xkv+kivi2", 1000)]
)
def test_full_budget_equals_full_bit_for_bit(spec, ubatch):
    m, ids = tiny(), prompt(150, 1)
    ref = run(m, build(m, "full"), ids, ubatch, 20)
    kv = build(m, spec.replace("kivi2", "kivi2:bits=16"), "4096")
    out = run(m, kv, ids, ubatch, 20, tokens=ref[:-1].argmax(-1).tolist())
    assert torch.equal(out, ref)
    assert kv.describe()["layer_budgets"] == [150] * 3


# --- 7. selection against the dense reference -----------------------------------------------
def expected_selection(Q, K, held, rows, budget, opts, n, n_layers):
    """Reference budgets and kept positions per layer and KV head from captured post-RoPE Q, K.

    held[layer][hk]: positions in slot order (the last `rows` the window)."""
    pool, f = opts.get("pool", "avg:7"), int(opts.get("min_tokens", 8))
    scores, C = [], []
    for layer in range(n_layers):
        window = held[layer][0][-rows:]
        keys = torch.stack([K[layer][hk, h] for hk, h in enumerate(held[layer])])
        scores.append(ref_scores(Q[layer][:, window], keys, pool))
        C.append(len(held[layer][0]) - rows)
    p = [[x / sum(w) for x in w] for w, _ in scores]
    if "target" in opts:
        nl = ref_target(p, float(opts["target"]), f)
    else:
        B = budget_tokens(budget, n, 8 + f)
        nl = ref_allocate(p, n_layers * B - n_layers * rows, f)
    kept = []
    for layer in range(n_layers):
        w, s = scores[layer]
        per_head = [w] * HKV if opts.get("scope") == "layer" else s
        rows_ = []
        for hk, h in enumerate(held[layer]):
            ctx = sorted(range(C[layer]), key=lambda j, r=per_head[hk]: (-r[j], j))[: nl[layer]]
            rows_.append(sorted(h[j] for j in ctx) + h[-rows:])
        kept.append(rows_)
    return nl, kept


SELECT_CASES = [
    ("xkv", "0.3", 4, 1000),  # two-pass, G = 2
    ("xkv", "0.3", 6, 16),  # chunked: deferred, G = 3
    ("xkv:plan=deferred,pool=max:7", "40", 4, 1000),
    ("xkv:scope=layer", "0.25", 4, 1000),
    ("xkv:min_tokens=0,pool=none", "0.2", 4, 1000),
    ("xkv:target=0.6", None, 6, 1000),
]


@pytest.mark.parametrize("spec,budget,n_heads,ubatch", SELECT_CASES)
def test_selection_matches_dense_reference(spec, budget, n_heads, ubatch):
    m = toy(2, n_heads)
    kv, ev = hooked(m, spec, budget)
    Q, K = capture(kv)
    n = 140
    run(m, kv, prompt(n, 21), ubatch)
    opts = dict(o.split("=") for o in spec.partition(":")[2].split(",") if o)
    held = [[list(range(n))] * HKV] * 2
    nl, kept = expected_selection(Q, K, held, 8, budget, opts, n, 2)
    assert [e[:3] for e in ev] == [(0, "prefill", n), (1, "prefill", n)]
    assert kv.describe()["layer_budgets"] == [x + 8 for x in nl]
    assert kv.describe()["plan_used"] == ("two-pass" if "deferred" not in spec and ubatch > n
                                          else "deferred")  # fmt: skip
    for layer, _, _, rows in ev:
        assert rows == kept[layer], layer
        assert all(set(range(n - 8, n)) <= set(r) for r in rows)  # the window, every head
        assert all(len(r) == nl[layer] + 8 for r in rows)
    assert nl[0] != nl[1]  # the layers really get different budgets
    if "scope=layer" in spec:
        assert all(r[0] == r[1] for *_, r in ev)
    else:
        assert any(r[0] != r[1] for *_, r in ev)  # KV heads select independently


def test_later_turn_reselects_all_slots_with_total_budget():
    """Later turns: deferred over the T_i slots held, N_tot = L * B(n) (as snapkv)."""
    m, n1, n2 = toy(2), 120, 40
    kv, ev = hooked(m, "xkv", "0.3")
    Q, K = capture(kv)
    session = Session(m, None, kv, ubatch=1000)
    run(m, kv, prompt(n1, 3), 1000, 5, session=session)
    turn1 = {layer: rows for layer, _, _, rows in ev}
    assert kv.describe()["plan_used"] == "two-pass"
    run(m, kv, prompt(n2, 4), 1000, 2, session=session)
    n = n1 + 5 + n2
    assert kv.describe()["plan_used"] == "deferred"
    # slots held before the turn: turn 1's kept positions plus the 5 decoded, then the new turn
    held = [[r + list(range(n1, n)) for r in turn1[layer]] for layer in range(2)]
    nl, kept = expected_selection(Q, K, held, 8, "0.3", {}, n, 2)
    assert sum(x + 8 for x in nl) == 2 * budget_tokens("0.3", n, 16)
    for layer, point, seen, rows in ev[2:]:
        assert (point, seen) == ("prefill", n) and rows == kept[layer]
    assert kv.kept_counts() == [x + 8 + 2 for x in nl]


# --- 8. plan equivalence ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts,budget,stack",
    [("", "0.3", ""), ("scope=layer,", "0.2", ""), ("pool=max:7,min_tokens=0,", "50", ""),
     ("target=0.7,", None, ""), ("budget_scope=context,alloc=loop,", "0.15", ""),
     ("", "0.3", "+kivi2")],
)  # fmt: skip
def test_two_pass_and_deferred_are_identical(opts, budget, stack):
    m, ids = tiny(), prompt(160, 2)
    results = []
    for plan in ("two-pass", "deferred"):
        kv, ev = hooked(m, f"xkv:{opts}plan={plan}{stack}", budget)
        logits = run(m, kv, ids, 1000, 12)
        d = kv.describe()
        assert d["plan_used"] == plan
        results.append((d["layer_budgets"], list(ev), logits, kv.nbytes()))
    (b1, e1, l1, n1), (b2, e2, l2, n2) = results
    assert b1 == b2 and e1 == e2 and n1 == n2
    assert torch.equal(l1, l2)
    assert len(set(b1)) > 1 and min(b1) < 160
    if "budget_scope=context" in opts:
        assert sum(b1) == 3 * budget_tokens(budget, 160, 8) + 3 * 8


# --- 1 (0.8.2). masked-attention equivalence over two turns ----------------------------------
@pytest.mark.parametrize("ubatch", [1000, 32])
def test_masked_attention_equivalence(ubatch):
    """Every layer output (prefill, decode, a second turn) equals dense attention over the
    positions kept, checked in fp64 by test_kv_methods.Shadow."""
    m = tiny()
    sh = Shadow(m, "xkv", "0.3")
    session = Session(m, None, sh.kv, ubatch=ubatch)
    run(m, sh.kv, prompt(130, 9), ubatch, 6, session=session)
    run(m, sh.kv, prompt(50, 10), ubatch, 4, session=session)
    assert sh.points == 2 * 3
    assert all(len(r) < 130 for *_, rows in sh.events for r in rows)


# --- 1 (0.8.4). GQA duplication ---------------------------------------------------------------
@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize("spec,budget", [("xkv", "24"), ("xkv:pool=max:7", "0.3")])
def test_gqa_duplicated_heads_select_as_mha(spec, budget, G):
    g = torch.Generator().manual_seed(11)
    n, n_prompt = 150, 130
    q = 2 * torch.randn(1, HKV, n, D, generator=g)
    k = torch.randn(1, HKV, n, D, generator=g)
    v = torch.randn(1, HKV, n, D, generator=g)
    kv1, ev1 = layer_kv(spec, budget, HKV)
    kvG, evG = layer_kv(spec, budget, HKV * G)
    out1 = feed(kv1, q, k, v, n_prompt, 16)
    outG = feed(kvG, q.repeat_interleave(G, dim=1), k, v, n_prompt, 16)
    assert len(ev1) == 1 and evG == ev1 and ev1[0][3][0] != ev1[0][3][1]
    # the kept sets are equal (above); the outputs go through two SDPA call shapes (query
    # heads stacked as rows for GQA, one per head for MHA) whose float32 sums round apart by
    # a few ulps: 1.07e-6 at a value of 1.13 on an AMD EPYC (Zen 4), so a relative term too
    torch.testing.assert_close(outG, out1.repeat_interleave(G, dim=1), rtol=1e-6, atol=1e-6)


# --- 1 (0.8.5, 0.8.6), 11. bytes and kept counts ----------------------------------------------
@pytest.mark.parametrize("spec,budget,ubatch", [("xkv", "0.3", 1000), ("xkv", "0.25", 40),
                                                ("xkv:target=0.8", None, 1000)])  # fmt: skip
def test_bytes_and_kept_counts(spec, budget, ubatch):
    m, n = tiny(), 150
    kv, ev = hooked(m, spec, budget)
    state = {}

    def check(point):
        if point == "chunk":
            return
        if point == "prefill":
            state["b"], state["n"] = kv.describe()["layer_budgets"], kv.seen
            for layer, _, seen, rows in ev:  # every KV head of layer l holds n_l + ows slots
                assert seen == n and [len(r) for r in rows] == [state["b"][layer]] * HKV
        gen = kv.seen - state["n"]
        T = [b + gen for b in state["b"]]
        assert kv.kept_counts() == T
        assert kv.nbytes() == sum(2 * HKV * D * E * t for t in T)  # 4 H_kv d (n_i + ows + n_gen)
        assert kv.nbytes_full() == 2 * 3 * HKV * kv.seen * D * E

    drive(m, kv, prompt(n, 8), ubatch, n_decode=0, after=check)  # deferred points
    kv.reset()
    ev.clear()
    with torch.inference_mode():
        s = Session(m, None, kv, ubatch=ubatch)
        s.prefill(prompt(n, 8))
        check("prefill")
        for _ in range(12):
            s.decode(3)
            check("step")
    if budget:
        assert sum(state["b"]) == 3 * budget_tokens(budget, n, 16)


# --- 9. peak memory ------------------------------------------------------------------------
def per_layer_bytes(kv, after):
    """nbytes() right after each layer's attention, through a wrapper around attend."""
    inner = kv.attend

    def attend(layer, q, k, v, positions):
        out = inner(layer, q, k, v, positions)
        after.append(kv.nbytes())
        return out

    kv.attend = attend


def test_two_pass_evicts_each_layer_after_its_attention():
    """CPU form of test 9: during the real prefill of plan=two-pass, the cache after layer i
    holds the compressed layers 0..i plus the plan's scores of layers i+1..; deferred holds
    every full layer until end_prefill."""
    m, n, L = tiny(), 400, 3
    full_layer = 2 * HKV * n * D * E
    seen = {}
    for plan in ("two-pass", "deferred"):
        kv = build(m, f"xkv:plan={plan}", "0.1")
        after = seen[plan] = []
        per_layer_bytes(kv, after)
        run(m, kv, prompt(n, 12), 1000)
        b = kv.describe()["layer_budgets"]
        comp = [2 * HKV * D * E * x for x in b]
        score = HKV * (n - 8) * 4  # the plan's s_{i,h} of one layer, fp32, held until used
        if plan == "two-pass":
            assert after == [sum(comp[: i + 1]) + (L - 1 - i) * score for i in range(L)]
            assert max(after) < L * full_layer / 2
        else:
            qwin = m.config.n_heads * 8 * D * E
            assert after == [(i + 1) * (full_layer + qwin) for i in range(L)]
        assert kv.nbytes() == sum(comp)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak CUDA memory needs a CUDA GPU")
def test_peak_cuda_memory_two_pass_vs_deferred():
    """xkv.md test 9 on CUDA: the two-pass peak is at most the compressed bytes + one layer of
    full KV + activations (the peak of the scoring pass alone, which keeps no KV); the
    deferred peak is at least the full KV."""
    from kvrun.kv import build, check

    c, dev, n = tiny_config(4, 8), torch.device("cuda"), 4000
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(c).state_dict().items()}
    g = torch.Generator().manual_seed(5)
    weights = {k: 0.2 * torch.randn(sh, generator=g) + k.endswith("norm.weight")
               for k, sh in shapes.items()}  # fmt: skip
    m = Transformer.from_weights(c, weights, dev)
    ids = prompt(n, 13)
    full = 2 * c.n_layers * HKV * n * D * E

    def peak(spec, scoring_only=False):
        kv = build(check(spec, "0.1"), c, m.rope, dev, m.dtype)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if scoring_only:
            (pre,) = [p.kv for p in kv.planning_pass("before", ids, None)]
            with torch.inference_mode():
                pre.begin_prefill(n)
                m(torch.tensor([ids], device=dev), torch.arange(n, device=dev), pre, True)
            kv.nbytes = pre.nbytes
        else:
            run(m, kv, ids, 8192)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, kv.nbytes()

    act, scores = peak("xkv", scoring_only=True)
    two_pass, comp = peak("xkv:plan=two-pass")
    deferred, _ = peak("xkv:plan=deferred")
    assert two_pass <= comp + full // c.n_layers + act + scores + (1 << 20)
    assert deferred >= full > 4 * comp


# --- 10. profile=FILE through the manager ------------------------------------------------------
def test_profile_written_then_loaded_gives_same_budgets_and_tokens(tmp_path, monkeypatch):
    m, path = tiny(), tmp_path / "prof.json"
    ids = prompt(150, 14)
    kv1, ev1 = hooked(m, f"xkv:profile={path}", "0.2")
    l1 = run(m, kv1, ids, 1000, 6)
    d1 = kv1.describe()
    assert d1["plan_used"] == "two-pass" and path.exists()
    obj = json.loads(path.read_text())
    n1 = [b - 8 for b in d1["layer_budgets"]]
    assert obj == {"method": "xkv", "model": "", "n_layers": 3, "window": 8, "pool": "avg:7",
                   "units": "fractions", "fractions": [x / 150 for x in n1], "count": 1}  # fmt: skip

    def no_pass(*a, **k):
        raise AssertionError("a loaded profile needs no scoring pass")

    monkeypatch.setattr(xkv._ScoringPass, "__init__", no_pass)
    kv2, ev2 = hooked(m, f"xkv:profile={path}", "0.2")
    per_layer = []
    per_layer_bytes(kv2, per_layer)
    l2 = run(m, kv2, ids, 1000, 6)
    assert kv2.describe()["plan_used"] == "profile"
    assert kv2.describe()["layer_budgets"] == d1["layer_budgets"] and ev2 == ev1
    assert torch.equal(l1, l2)
    assert per_layer[0] == 2 * HKV * D * E * d1["layer_budgets"][0]  # evicted inside layer 0
    # another length: sum n_i = N, floors, window kept; chunked: selection at end_prefill
    kv3, ev3 = hooked(m, f"xkv:profile={path}", "0.2")
    run(m, kv3, prompt(301, 15), 64)
    b3 = kv3.describe()["layer_budgets"]
    assert kv3.describe()["plan_used"] == "profile"
    assert sum(b3) == 3 * budget_tokens("0.2", 301, 16) and all(b >= 16 for b in b3)
    assert all(set(range(293, 301)) <= set(r) for *_, rows in ev3 for r in rows)


def test_profile_update_folds_running_mean(tmp_path):
    m, path = tiny(), tmp_path / "prof.json"
    fr = []
    for i, n in enumerate((150, 200, 120)):
        kv = build(m, f"xkv:profile={path},profile_update=1", "0.2")
        run(m, kv, prompt(n, 30 + i), 1000)
        assert kv.describe()["plan_used"] == "two-pass"  # always plans
        fr.append([(b - 8) / n for b in kv.describe()["layer_budgets"]])
        prof = load_profile(path)
        assert prof.count == i + 1
        mean = [sum(col) / len(fr) for col in zip(*fr, strict=True)]
        assert prof.values == pytest.approx(mean, rel=1e-12)
    kv = build(m, f"xkv:profile={path},profile_units=tokens,profile_update=1", "0.2")
    with pytest.raises(KvrunError, match="stores fractions"):
        run(m, kv, prompt(100, 1), 1000)
    tok = tmp_path / "tok.json"
    kv = build(m, f"xkv:profile={tok},profile_units=tokens", "0.2")
    run(m, kv, prompt(100, 1), 1000)
    assert load_profile(tok).values == [b - 8 for b in kv.describe()["layer_budgets"]]


# --- stacking on a KIVI store -------------------------------------------------------------------
@pytest.mark.parametrize("plan,ubatch", [("two-pass", 1000), ("deferred", 64)])
def test_xkv_stacks_on_kivi(plan, ubatch):
    """xkv+kivi2: the kept tokens of each layer (n_i + ows) move into the 2-bit store at
    end_prefill, whole residuals quantized, the rest in the fp tail; decode appends."""
    m, ids = tiny(), prompt(300, 16)
    plain = build(m, "xkv", "0.5")
    run(m, plain, ids, 1000)
    b = plain.describe()["layer_budgets"]
    kv = build(m, f"xkv:plan={plan}+kivi2", "0.5")
    run(m, kv, ids, ubatch, 8)
    assert kv.describe()["layer_budgets"] == b and kv.describe()["plan_used"] == plan
    assert max(b) > 128 and len(set(b)) > 1
    assert [st.kivi.length for st in kv.layers] == [x + 8 for x in b]  # 8 fed in decode
    assert [st.kivi.body_len for st in kv.layers] == [(x + 8) // 128 * 128 for x in b]
    assert all(st.dense.length == 0 for st in kv.layers)


# --- the CLI on the default model ----------------------------------------------------------------
GROUP = cli if "profile" in cli.commands else KvrunGroup("kvrun", commands={"profile": profile})
KEY = 49595


@pytest.fixture
def cli_runtime(default_runtime, monkeypatch):
    """The default model, loaded once for the module and handed to every command (the load
    path itself is covered by test_passkey_cli)."""
    monkeypatch.setattr(kvrun.run.runtime, "load_runtime", lambda *a, **k: default_runtime)
    return default_runtime


@pytest.fixture(scope="module")
def samples(default_runtime, tmp_path_factory):
    d = tmp_path_factory.mktemp("samples")
    paths = []
    for i in range(2):
        p = d / f"s{i}.txt"
        p.write_text(passkey_prompt(default_runtime.tokenizer, 600, 0.3 + 0.4 * i, 11111 * (i + 1),
                                    seed=i))  # fmt: skip
        paths.append(p)
    return paths


def invoke(group, args):
    return CliRunner().invoke(group, args, catch_exceptions=False)


def test_profile_command_extends_file_and_prints_table(cli_runtime, samples, tmp_path):
    rt, L = cli_runtime, cli_runtime.config.n_layers
    out = tmp_path / "legal.json"
    save_profile(out, Profile(rt.config.name, L, 8, "avg:7", "fractions", [0.1] * L, 1))
    args = ["profile", "-f", str(samples[0]), "-f", str(samples[1]), "-o", str(out)]
    r = invoke(GROUP, args + ["--kv-budget", "0.1"])
    assert r.exit_code == 0, r.output
    prof = load_profile(out)
    assert prof.count == 3 and prof.n_layers == L and prof.model == rt.config.name
    # each sample's fractions sum to (L B(t) - L ows) / t: fold them with the old mean
    ts = [len(rt.tokenizer.encode(p.read_text())) for p in samples]
    sums = [(L * budget_tokens("0.1", t, 16) - L * 8) / t for t in ts]
    assert sum(prof.values) == pytest.approx((0.1 * L + sum(sums)) / 3, rel=1e-9)
    assert len(set(prof.values)) > 1
    lines = r.stdout.splitlines()
    assert any("fraction" in ln and "min" in ln and "max" in ln for ln in lines)
    rows = [ln for ln in lines if re.match(r"^\W\s*\d+\s+\W", ln)]
    assert [int(ln.split()[1]) for ln in rows] == list(range(L))
    assert "3 in all" in r.stderr and "2 sample(s) added" in r.stderr


def test_generate_uses_profile_without_scoring_pass(cli_runtime, samples, tmp_path, monkeypatch):
    L = cli_runtime.config.n_layers
    out = tmp_path / "p.json"
    r = invoke(GROUP, ["profile", "-f", str(samples[0]), "-o", str(out), "--kv-budget", "0.1",
                       "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == json.loads(out.read_text())  # --json: the profile on stdout

    def no_pass(*a, **k):
        raise AssertionError("a loaded profile needs no scoring pass")

    monkeypatch.setattr(xkv._ScoringPass, "__init__", no_pass)
    args = ["generate", "--raw", "-f", str(samples[1]), "-n", "4", "--temp", "0", "--json",
            "--ubatch", "4096", "--kv", f"xkv:profile={out}", "--kv-budget", "0.1"]  # fmt: skip
    r = invoke(cli, args)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["kv"]["plan_used"] == "profile" and res["kv"]["budget"] == 0.1
    t = res["prompt_tokens"]
    assert sum(res["kv"]["layer_budgets"]) == L * budget_tokens("0.1", t, 16)
    assert load_profile(out).count == 1  # used, not extended


@pytest.mark.parametrize(
    "args,needles",
    [(["-f", "missing.txt"], ["missing.txt"]),
     (["--kv", "snapkv"], ["must be xkv"]),
     (["--kv", "xkv:profile=a.json"], ["-o FILE"]),
     (["--kv-budget", "abc"], ["not a number"]),
     (["--kv-budget", "5"], ["protected minimum"]),
     (["--kv", "xkv:target=0.9", "--kv-budget", "0.2"], ["target"]),
     (["--kv", "xkv:pool=avg:4"], ["pool"]),
     (["-o", "nodir/x.json"], ["folder does not exist"]),
     (["-o", "corrupt.json"], ["not valid JSON"]),
     (["-o", "win16.json"], ["window=16"])],
)  # fmt: skip
def test_profile_bad_input_is_one_line_before_loading(args, needles, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.txt").write_text("some sample text " * 20)
    (tmp_path / "corrupt.json").write_text("{")
    save_profile(tmp_path / "win16.json", Profile("", 30, 16, "avg:7", "fractions", [0.1] * 30, 1))

    def no_loading(*a, **k):
        raise AssertionError("bad input must be caught before the model loads")

    monkeypatch.setattr(kvrun.run.runtime, "load_runtime", no_loading)
    base = {"-f": ["-f", "s.txt"], "-o": ["-o", "out.json"]}
    full = [x for flag, v in base.items() if flag not in args for x in v] + args
    one_error_line(CliRunner().invoke(GROUP, ["profile", *full]), *needles)


def test_profile_bad_input_after_loading(cli_runtime, samples, tmp_path):
    L = cli_runtime.config.n_layers
    wrong = tmp_path / "l4.json"
    save_profile(wrong, Profile("", 4, 8, "avg:7", "fractions", [0.1] * 4, 1))
    r = CliRunner().invoke(GROUP, ["profile", "-f", str(samples[0]), "-o", str(wrong)])
    one_error_line(r, "has 4 layers", f"has {L}")
    other = tmp_path / "other.json"
    save_profile(other, Profile("other-model", L, 8, "avg:7", "fractions", [0.1] * L, 1))
    r = CliRunner().invoke(GROUP, ["profile", "-f", str(samples[0]), "-o", str(other)])
    one_error_line(r, "made for model 'other-model'")
    r = CliRunner().invoke(
        GROUP, ["profile", "-f", str(samples[0]), "-o", str(tmp_path / "x.json"), "-c", "100"]
    )
    one_error_line(r, "s0.txt", "context is 100")
    assert not (tmp_path / "x.json").exists()


@pytest.fixture(scope="module")
def passkey_file(default_runtime, tmp_path_factory):
    path = tmp_path_factory.mktemp("passkey") / "passkey.txt"
    path.write_text(passkey_prompt(default_runtime.tokenizer, 2000, 0.5, KEY, seed=2))
    return path


@pytest.mark.parametrize("ubatch,plan", [(None, "deferred"), ("4096", "two-pass")])
def test_passkey_through_cli(cli_runtime, passkey_file, ubatch, plan):
    args = ["generate", "--raw", "-f", str(passkey_file), "-n", "8", "--temp", "0", "--json",
            "--kv", "xkv", "--kv-budget", "0.5"] + (["--ubatch", ubatch] if ubatch else [])  # fmt: skip
    r = invoke(cli, args)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] > 1900
    assert answer_matches(out["text"], KEY), out["text"]
    kv = out["kv"]
    assert kv["method"] == "xkv" and kv["plan_used"] == plan
    L, t = cli_runtime.config.n_layers, out["prompt_tokens"]
    assert sum(kv["layer_budgets"]) == L * budget_tokens("0.5", t, 16)
    assert len(set(kv["layer_budgets"])) > 1
    assert 0.49 < out["kv_bytes"] / out["kv_bytes_full"] < 0.52
