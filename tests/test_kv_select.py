"""Pure selection parts (baselines.md 0.2, 0.3, 0.7, 3, 4): budgets, the SnapKV scorer, the
top-k selector, GQA duplication and the PyramidKV allocator.

References are written out densely here (materialised attention, explicit sorting); they never
call the implementation's helpers.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from kv_helpers import pyramid_budgets_compat

from kvrun.errors import KvrunError
from kvrun.kv.attention import attention_colsum, group_sum, pool, window_scores
from kvrun.kv.cache import keep_indices
from kvrun.kv.methods.pyramidkv import PyramidKV
from kvrun.kv.spec import Budget

NEG = float("-inf")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- references -----------------------------------------------------------------------------
def ref_window_attention(qw: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(Hq, w, T) softmax of the window rows over every key, causal inside the window (fp32)."""
    Hq, w, D = qw.shape
    Hkv, T, _ = k.shape
    kq = k.float().repeat_interleave(Hq // Hkv, dim=0)  # query head h reads KV head h // G
    logits = qw.float() @ kq.transpose(1, 2) / math.sqrt(D)
    row_pos = torch.arange(T - w, T)
    future = torch.arange(T)[None, :] > row_pos[:, None]
    return torch.softmax(logits.masked_fill(future, NEG), dim=-1)


def ref_snap_scores(qw: torch.Tensor, k: torch.Tensor, kernel: int) -> torch.Tensor:
    """(Hkv, T - w): votes summed over window rows, max-pooled (-inf edges), THEN summed per group."""
    Hq, w, _ = qw.shape
    Hkv, T, _ = k.shape
    G = Hq // Hkv
    vote = ref_window_attention(qw, k)[:, :, : T - w].sum(dim=1)  # (Hq, T - w)
    pad = torch.full((Hq, kernel // 2), NEG)
    padded = torch.cat([pad, vote, pad], dim=1)
    pooled = padded.unfold(1, kernel, 1).amax(dim=-1)  # pooled[:, j] = max(vote[j-k//2 .. j+k//2])
    assert pooled.shape == vote.shape
    rows = []
    for hk in range(Hkv):
        s = pooled[hk * G]
        for g in range(1, G):
            s = s + pooled[hk * G + g]
        rows.append(s)
    return torch.stack(rows)


def window_votes(qw, k, kernel: int, kind: str) -> torch.Tensor:
    """SnapKV's votes as the driver's score computes them (Ctx.window_votes)."""
    return group_sum(pool(window_scores(qw, k), kind, kernel), k.shape[0])


def pyramid_budgets(B: int, n: int, window: int, n_layers: int, beta: int) -> list[int]:
    """PyramidKV's allocator as declared (kvrun/kv/methods/pyramidkv.py)."""
    return PyramidKV(window=window, beta=beta).budgets(B, n, n_layers)


def ref_topk(scores: torch.Tensor, k: int) -> list[list[int]]:
    """Per row: the k best columns by score descending, then position ascending; ascending."""
    return [
        sorted(sorted(range(row.numel()), key=lambda j, r=row: (-float(r[j]), j))[:k])
        for row in scores
    ]


def snap_keep(qw, k, budget, kernel=7) -> list[list[int]]:
    """The implementation's SnapKV pipeline on pure tensors (votes, window protected, top-k)."""
    w = qw.shape[1]
    votes = window_votes(qw, k, kernel, "max")
    scores = torch.cat([votes, votes.new_full((votes.shape[0], w), float("inf"))], dim=1)
    return keep_indices(scores, None, budget).tolist()


# --- budgets (0.2) --------------------------------------------------------------------------
def test_budget_fraction_is_exact_decimal():
    assert Budget.parse("0.55").tokens(100) == 55  # in floats ceil(0.55 * 100) is 56
    assert Budget.parse("0.3").tokens(100) == 30  # 0.3 * 100 = 30.000000000000004 in floats
    assert Budget.parse("0.3").tokens(101) == 31
    for n in range(1, 400):
        assert Budget.parse("0.07").tokens(n, 5) == min(n, max(5, -(-7 * n // 100)))


def test_budget_lifted_to_protected_and_absolute():
    b = Budget.parse("0.1")
    assert [b.tokens(n, 33) for n in (10, 33, 100, 330, 331)] == [10, 33, 33, 33, 34]
    a = Budget.parse("24")
    assert [a.tokens(n, 5) for n in (3, 24, 25, 1000)] == [3, 24, 24, 24]
    assert Budget.parse("24.9").tokens(100) == 24  # floor(b) for a count
    a.check(24, "x")
    with pytest.raises(KvrunError, match="protected minimum"):
        a.check(25, "x")
    for bad in ("0", "-1", "abc"):
        with pytest.raises(KvrunError):
            Budget.parse(bad)


# --- top-k selector and ties (0.7) ------------------------------------------------------------
def test_keep_indices_ties_rank_lower_position_first():
    scores = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
    assert keep_indices(scores, None, 3).tolist() == [[1, 2, 4], [0, 1, 2]]
    assert keep_indices(scores, None, 2).tolist() == [[1, 2], [0, 1]]
    prot = torch.zeros(2, 6, dtype=torch.bool)
    prot[:, 5] = True  # protected slots are kept whatever their score
    assert keep_indices(scores, prot, 3).tolist() == [[1, 2, 5], [0, 1, 5]]
    rnd = torch.randn(3, 50, generator=_gen(1)).round(decimals=1)  # many exact ties
    assert keep_indices(rnd, None, 17).tolist() == ref_topk(rnd, 17)


# --- SnapKV scorer (3, "How to test it") -------------------------------------------------------
@pytest.mark.parametrize("j_star", [3, 20, 36])
def test_snapkv_peak_keeps_its_pooled_neighbourhood(j_star):
    """One head, G = 1: the window attends almost only to j*; kernel 7 and B - w = 7 keep
    exactly {j*-3 .. j*+3} of the prefix (plus the window)."""
    w, prefix, D = 8, 40, 16
    T = prefix + w
    g = _gen(j_star)
    u = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    k = 0.3 * torch.randn(1, T, D, generator=g)
    k[0, j_star] = 12 * u
    qw = 12 * u + 0.3 * torch.randn(1, w, D, generator=g)
    A = ref_window_attention(qw, k)
    assert float(A[0, :, j_star].min()) > 0.99  # the construction does what it says
    kept = snap_keep(qw, k, w + 7)
    assert kept == [list(range(j_star - 3, j_star + 4)) + list(range(prefix, T))]
    assert ref_topk(ref_snap_scores(qw, k, 7), 7) == [list(range(j_star - 3, j_star + 4))]


@pytest.mark.parametrize("G", [1, 3])
def test_snapkv_kernel_one_is_plain_topk_of_window_sums(G):
    Hkv, w, T, D = 2, 6, 70, 16
    g = _gen(10 + G)
    k = torch.randn(Hkv, T, D, generator=g)
    qw = 2 * torch.randn(Hkv * G, w, D, generator=g)
    votes = window_votes(qw, k, 1, "max")
    A = ref_window_attention(qw, k)
    sums = A[:, :, : T - w].sum(dim=1).view(Hkv, G, T - w).sum(dim=1)
    torch.testing.assert_close(votes, sums, rtol=1e-5, atol=1e-6)
    # each window row sums to 1, so a query head's votes sum to at most w
    assert bool((votes.sum(dim=1) <= G * w + 1e-4).all())
    kept = snap_keep(qw, k, w + 20, kernel=1)
    if G == 1:
        assert kept == [r + list(range(T - w, T)) for r in ref_topk(sums, 20)]
    assert kept == [r + list(range(T - w, T)) for r in ref_topk(ref_snap_scores(qw, k, 1), 20)]


@pytest.mark.parametrize("G", [1, 2, 3])
def test_snapkv_scores_match_dense_reference(G):
    Hkv, w, T, D = 2, 8, 90, 16
    g = _gen(20 + G)
    k = torch.randn(Hkv, T, D, generator=g)
    qw = 2 * torch.randn(Hkv * G, w, D, generator=g)
    ref = ref_snap_scores(qw, k, 7)
    torch.testing.assert_close(window_votes(qw, k, 7, "max"), ref, rtol=1e-5, atol=1e-6)
    assert snap_keep(qw, k, w + 25) == [r + list(range(T - w, T)) for r in ref_topk(ref, 25)]


def test_snapkv_constant_attention_keeps_lowest_positions():
    """Tie-heavy input: constant keys make every prefix vote equal; ties go to lower positions."""
    Hkv, G, w, T, D = 2, 2, 8, 40, 16
    k = torch.ones(Hkv, T, D)
    qw = torch.randn(Hkv * G, w, D, generator=_gen(5))
    kept = snap_keep(qw, k, w + 10)
    assert kept == [list(range(10)) + list(range(T - w, T))] * Hkv


# --- GQA duplication (0.8.4) on the pure scorers --------------------------------------------
@pytest.mark.parametrize("G", [2, 4])
def test_gqa_duplication_window_votes(G):
    Hkv, w, T, D = 2, 8, 120, 16
    g = _gen(30 + G)
    k = torch.randn(Hkv, T, D, generator=g)
    q1 = 2 * torch.randn(Hkv, w, D, generator=g)  # MHA: one query head per KV head
    qG = q1.repeat_interleave(G, dim=0)  # G identical copies per group
    assert torch.equal(window_votes(qG, k, 7, "max"), G * window_votes(q1, k, 7, "max"))
    assert snap_keep(qG, k, w + 30) == snap_keep(q1, k, w + 30)


@pytest.mark.parametrize("G", [2, 4])
def test_gqa_duplication_column_sums(G):
    Hkv, Tq, T, D = 2, 5, 60, 16
    g = _gen(40 + G)
    k = torch.randn(1, Hkv, T, D, generator=g)
    v = torch.randn(1, Hkv, T, D, generator=g)
    q1 = 2 * torch.randn(1, Hkv, Tq, D, generator=g)
    qG = q1.repeat_interleave(G, dim=1)
    mask = torch.arange(T)[None, :] <= torch.arange(T - Tq, T)[:, None]
    out1, col1 = attention_colsum(q1, k, v, mask)
    outG, colG = attention_colsum(qG, k, v, mask)
    torch.testing.assert_close(outG, out1.repeat_interleave(G, dim=1), rtol=0, atol=0)
    torch.testing.assert_close(colG, G * col1, rtol=1e-6, atol=0)
    assert keep_indices(colG, None, 25).tolist() == keep_indices(col1, None, 25).tolist()


def test_attention_colsum_matches_dense():
    Hkv, G, Tq, T, D = 2, 3, 7, 40, 16
    g = _gen(50)
    q = torch.randn(1, Hkv * G, Tq, D, generator=g)
    k = torch.randn(1, Hkv, T, D, generator=g)
    v = torch.randn(1, Hkv, T, D, generator=g)
    mask = torch.arange(T)[None, :] <= torch.arange(T - Tq, T)[:, None]
    out, col = attention_colsum(q, k, v, mask)
    kq, vq = k[0].repeat_interleave(G, 0), v[0].repeat_interleave(G, 0)
    A = torch.softmax((q[0] @ kq.transpose(1, 2) / math.sqrt(D)).masked_fill(~mask, NEG), -1)
    torch.testing.assert_close(out[0], A @ vq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(col, A.sum(dim=1).view(Hkv, G, T).sum(dim=1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(col.sum(dim=1), torch.full((Hkv,), float(G * Tq)))


# --- PyramidKV allocator (4) -------------------------------------------------------------------
def ref_pyramid(B: int, n: int, w: int, L: int, beta: int) -> list[int]:
    """kvrun rule: exact rational schedule, largest remainder (ties to the lower layer)."""
    if n <= B:
        return [n] * L
    if n < 2 * (B - w):
        return [B] * L
    mean = Fraction(B - w)
    hi = min(2 * mean - mean / beta, Fraction(n - w))
    lo = 2 * mean - hi
    ks = [hi - layer * (hi - lo) / (L - 1) for layer in range(L)]
    out = [math.floor(x) for x in ks]
    order = sorted(range(L), key=lambda i: (-(ks[i] - out[i]), i))
    for i in order[: L * (B - w) - sum(out)]:
        out[i] += 1
    return [x + w for x in out]


def test_pyramid_golden_row():
    b = pyramid_budgets(512, 8000, 32, 32, 20)
    assert [b[i] for i in (0, 1, 2, 15, 16, 30, 31)] == [968, 939, 909, 527, 497, 85, 56]
    assert sum(b) == 16384 == 32 * 512
    assert b == ref_pyramid(512, 8000, 32, 32, 20)


def test_pyramid_compat_row():
    c = pyramid_budgets_compat(512, 8000, 32, 32, 20)
    assert [c[i] for i in (0, 1, 2, 15, 16, 30, 31)] == [968, 939, 910, 533, 504, 98, 69]
    assert sum(c) == 16592


@pytest.mark.parametrize(
    "B,n,w,L,beta",
    [(512, 8000, 32, 32, 20), (64, 150, 32, 3, 20), (100, 1000, 8, 7, 3), (48, 90, 8, 5, 20),
     (300, 700, 32, 30, 20), (40, 77, 8, 2, 1), (2048, 100000, 32, 80, 20)],
)  # fmt: skip
def test_pyramid_active_branch_properties(B, n, w, L, beta):
    assert n >= 2 * (B - w)  # the pyramid branch
    b = pyramid_budgets(B, n, w, L, beta)
    assert len(b) == L and sum(b) == L * B
    assert all(b[i] >= b[i + 1] for i in range(L - 1))
    mean = Fraction(B - w)
    hi = min(2 * mean - mean / beta, Fraction(n - w))
    for layer, bl in enumerate(b):
        k_real = hi - layer * (2 * hi - 2 * mean) / (L - 1)
        assert abs(bl - w - k_real) < 1
        assert w <= bl <= n
    assert b == ref_pyramid(B, n, w, L, beta)


def test_pyramid_remainder_ties_go_to_the_lower_layer():
    # k_l = 19.5, 10, 0.5: one token left over, tied between layers 0 and 2
    assert pyramid_budgets(42, 100, 32, 3, 20) == [52, 42, 32]
    # k_l = 31.5, 28.5, ..., 10.5 (mean 21): four tokens left over go to layers 0-3
    assert pyramid_budgets(29, 400, 8, 8, 2) == [40, 37, 34, 31, 27, 24, 21, 18]


def test_pyramid_branch_boundaries():
    L, B, w, beta = 32, 512, 32, 20
    for n in (100, 511, 512):  # n <= B: no change
        assert pyramid_budgets(B, n, w, L, beta) == [n] * L
    for n in (513, 700, 959):  # B < n < 2(B - w): uniform SnapKV
        assert pyramid_budgets(B, n, w, L, beta) == [B] * L
    b = pyramid_budgets(B, 960, w, L, beta)  # n = 2(B - w): the pyramid starts
    assert b != [B] * L and sum(b) == L * B
    # clamp case: 2(B-w) - (B-w)/beta = 936 > n - w, so layer 0 keeps all n tokens
    for n in (960, 967):
        b = pyramid_budgets(B, n, w, L, beta)
        assert b[0] == n and sum(b) == L * B and b == ref_pyramid(B, n, w, L, beta)
    b = pyramid_budgets(B, 968, w, L, beta)  # just past the clamp: layer 0 = 936 + w
    assert b[0] == 968 and b == ref_pyramid(B, 968, w, L, beta)
    assert pyramid_budgets(B, 2000, w, L, beta)[0] == 968 < 2000
