"""SpindleKV (methods/spindlekv.md, "How to test it" 1-10) against naive references.

Every reference here is written out densely and independently of kvrun.kv.methods.spindlekv:
exact-fraction schedules, materialised fp64 window attention, explicit
sorting for top-k, an N x N greedy codebook, masked fp64 attention over per-query-head sets,
and the byte formula of the spec. Kept sets are decoded from the manager's raw tensors
(positions, mask bytes); its reconstructions (materialise) are compared with the vectors
the model produced, captured at the attend call.
"""

from __future__ import annotations

import functools
import json
import math
from fractions import Fraction

import pytest
import torch
from click.testing import CliRunner
from kv_helpers import codebook_sizes
from passkey_helpers import passkey_prompt
from test_kv_methods import config, drive, new_kv, prompt, random_transformer, tap, tiny

import tiny_families
from kvrun.cli.main import cli
from kvrun.errors import KvrunError
from kvrun.kv import build, check
from kvrun.kv.attention import pool_scores
from kvrun.kv.methods.spindlekv.cache import (
    endpoints,
    layer_ratios,
    qhead_scores,
    spindle_keep,
    union_slots,
)
from kvrun.kv.methods.spindlekv.store import assign, build_codebook, nbytes_of
from kvrun.models.config import ModelConfig
from kvrun.models.model import Transformer
from kvrun.models.rope import Rope, inverse_frequencies
from kvrun.tasks.passkey import answer_matches

E = 4  # bytes per fp32 element (CPU reference dtype)
L, HKV, D = 3, 2, 32
NEG = float("-inf")

pytestmark = pytest.mark.usefixtures("one_thread")


# --- independent references ---------------------------------------------------------------------
def ref_keep_counts(t: int, B: int, w: int, n_layers: int, beta="0.05", flat=False):
    """k_lambda of spindlekv.md step 3 in exact fractions; None = keep everything."""
    n_ctx = t - w
    if n_ctx <= 0:
        return None
    rc = Fraction(B - w, n_ctx)
    if rc >= 1:
        return None
    b = Fraction(beta)
    alpha = (1 + b) / 2
    if flat or n_layers == 1:
        r = [rc] * n_layers
    else:
        if rc <= b:
            r0 = rl = max(rc, 0)
        elif rc <= alpha:
            r0, rl = 2 * rc - b, b
        else:
            r0, rl = Fraction(1), 2 * rc - 1
        r = [r0 + (rl - r0) * Fraction(i, n_layers - 1) for i in range(n_layers)]
    return [math.floor(x * n_ctx) for x in r]


def budget_tokens(b: str, n: int, protected: int) -> int:
    f = Fraction(b)
    return min(n, max(protected, math.ceil(f * n))) if f < 1 else min(n, math.floor(f))


def ref_scores(qw, k, norm=True, pool="none", sliding=None) -> torch.Tensor:
    """ac (Hq, t - w) in fp64 from a materialised (Hq, w, t) softmax (Eq. 2), then pooling."""
    Hq, w, Dh = qw.shape
    Hkv, t, _ = k.shape
    kq = k.double().repeat_interleave(Hq // Hkv, dim=0)
    logits = qw.double() @ kq.transpose(1, 2) / math.sqrt(Dh)  # (Hq, w, t)
    rows = torch.arange(t - w, t)[:, None]
    cols = torch.arange(t)[None, :]
    hidden = cols > rows
    if sliding:
        hidden |= rows - cols >= sliding
    a = torch.softmax(logits.masked_fill(hidden, NEG), dim=-1)
    n_ctx = t - w
    ac = a[:, :, :n_ctx].sum(1)
    if norm:
        ac = ac / torch.tensor([t - j for j in range(n_ctx)], dtype=torch.float64)
    if pool != "none":
        kind, kk = pool.split(":")
        kk = int(kk)
        pad = torch.full((Hq, kk // 2), NEG if kind == "max" else 0.0, dtype=torch.float64)
        win = torch.cat([pad, ac, pad], 1).unfold(1, kk, 1)  # (Hq, n_ctx, kk)
        ac = win.amax(-1) if kind == "max" else win.sum(-1) / kk
    return ac


def ref_top(row, k) -> list[int]:
    """Top k by score descending, then position ascending; ascending positions."""
    return sorted(sorted(range(len(row)), key=lambda j: (-float(row[j]), j))[:k])


def ref_selection(qw, k, kk, G, gqa="qhead", **kw) -> list[set[int]]:
    """Per query head: its kept turn-relative positions (top kk + window)."""
    ac = ref_scores(qw, k, **kw)
    Hq, n_ctx = ac.shape
    t = k.shape[1]
    window = set(range(n_ctx, t))
    if gqa == "mean":
        groups = [ac[h * G : (h + 1) * G].mean(0) for h in range(Hq // G)]
        return [set(ref_top(groups[q // G], kk)) | window for q in range(Hq)]
    return [set(ref_top(ac[q], kk)) | window for q in range(Hq)]


def store_sets(kv, layer: int) -> list[set[int]]:
    """Positions each query head sees in the store, decoded from the raw mask bytes."""
    st, G = kv.layers[layer], kv.group
    out = [set() for _ in range(kv.config.n_heads)]
    for pos, mask in ((st.pos_c, st.mask_c), (st.pos_d, st.mask_d)):
        if pos is None:
            continue
        for h in range(pos.shape[0]):
            for s in range(pos.shape[1]):
                for j in range(G):
                    if (int(mask[h, s, j // 8]) >> (j % 8)) & 1:
                        out[h * G + j].add(int(pos[h, s]))
    return out


def slot_counts(kv, layer: int) -> tuple[int, int]:
    st = kv.layers[layer]
    return tuple(0 if p is None else p.shape[1] for p in (st.pos_c, st.pos_d))


def real_slots(kv, layer: int) -> list[int]:
    """Slots per KV head with any mask bit set (the rest are padding)."""
    st = kv.layers[layer]
    return [
        sum(int(m[h].ne(0).any(-1).sum()) for m in (st.mask_c, st.mask_d) if m is not None)
        for h in range(kv.config.n_kv_heads)
    ]


def ref_bytes(kv, e=E) -> int:
    """The spec's byte formula, summed over layers (padding slots included)."""
    c, o = kv.config, kv.opt
    nb = -(-(c.n_heads // c.n_kv_heads) // 8)
    total = 0
    for i, (ck, cv) in enumerate(codebook_sizes(kv)):
        S_c, S_d = slot_counts(kv, i)
        wide = o["index"] == "int32"
        i_k = 4 if wide or ck_max(kv, i, "k") > 32767 else 2
        i_v = 4 if wide or ck_max(kv, i, "v") > 32767 else 2
        total += e * c.head_dim * (ck + cv)
        total += c.n_kv_heads * S_c * (i_k + i_v + 2 * e + 4 + nb)
        total += c.n_kv_heads * S_d * (2 * e * c.head_dim + 4 + nb)
    return total


def ck_max(kv, layer, which):
    books = kv.layers[layer].books_k if which == "k" else kv.layers[layer].books_v
    return max(b.n for b in books)


def tap_layers(kv, after):
    """test_kv_methods.tap with each layer's own RoPE (Gemma 3's local layers rotate apart):
    after(layer, qr (Hq,T,D), kr (Hkv,T,D), v, positions, out, None)."""
    inner = kv.attend

    def attend(layer, q, k, v, positions):
        rope = kv.rope.at(layer)
        qr, kr = rope.apply(q, positions)[0], rope.apply(k, positions)[0]
        out = inner(layer, q, k, v, positions)
        after(layer, qr, kr, v[0], positions, out[0], None)
        return out

    kv.attend = attend


def capture(kv):
    """Post-RoPE q, k and v the manager saw, per layer, indexed by position (fp64)."""
    seen = {"q": {}, "k": {}, "v": {}}

    def after(layer, qr, kr, v, pos, out, state):
        for j, p in enumerate(pos.tolist()):
            seen["q"][layer, p] = qr[:, j].double()
            seen["k"][layer, p] = kr[:, j].double()
            seen["v"][layer, p] = v[:, j].double()

    tap_layers(kv, after=after)

    def get(kind, layer, positions):  # (H, len, D)
        return torch.stack([seen[kind][layer, p] for p in positions], dim=1)

    return get


class MaskedShadow:
    """Checks every layer output against fp64 attention of each query head over exactly the
    positions it may see: its stored set, plus the turn's own tokens (prefill) or the new
    token (decode), filtered by the layer's sliding window (0.8.2, spec item 8). A set keeps
    what a windowed layer's ring has written over: the window hides it all the same."""

    def __init__(self, kv):
        self.kv = kv
        c = kv.config
        self.G = c.n_heads // c.n_kv_heads
        self.sets = [[set() for _ in range(c.n_heads)] for _ in range(c.n_layers)]
        self.K, self.V = {}, {}
        self.turn: list[int] = []
        self.checked = 0
        tap_layers(kv, after=self.after)

    def after(self, layer, qr, kr, v, pos, out, state):
        for j, p in enumerate(pos.tolist()):
            self.K[layer, p], self.V[layer, p] = kr[:, j].double(), v[:, j].double()
        prefill, sliding = self.kv.in_prefill, self.kv.config.window(layer)
        for j, p in enumerate(pos.tolist()):
            for q in range(qr.shape[0]):
                h = q // self.G
                vis = set(self.sets[layer][q])
                vis |= set(range(self.turn_start, p + 1)) if prefill else {p}
                if sliding:
                    vis = {x for x in vis if p - x < sliding}
                cols = sorted(vis)
                k = torch.stack([self.K[layer, x][h] for x in cols])
                vv = torch.stack([self.V[layer, x][h] for x in cols])
                s = qr[q, j].double() @ k.T / math.sqrt(qr.shape[-1])
                ref = torch.softmax(s, 0) @ vv
                torch.testing.assert_close(out[q, j].double(), ref, rtol=0, atol=2e-5)
                self.checked += 1
        if not prefill:
            for q in range(qr.shape[0]):
                self.sets[layer][q] |= set(pos.tolist())

    def begin(self, start):
        self.turn_start = start

    def adopt(self):
        """After end_prefill: the store's sets become what later queries see (on a windowed
        layer, joined to the earlier sets: a slot the window hides may have been dropped)."""
        for layer in range(self.kv.config.n_layers):
            held = store_sets(self.kv, layer)
            if self.kv.config.window(layer):
                w = self.kv.config.window(layer)
                # what the layer dropped is out of every later query's window
                gone = [s - h for s, h in zip(self.sets[layer], held, strict=True)]
                assert all(x <= self.kv.seen - 1 - w for g in gone for x in g), layer
                held = [s | h for s, h in zip(self.sets[layer], held, strict=True)]
            self.sets[layer] = held


def run_turn(kv, model, shadow, ids, ubatch, n_decode, tokens=None, after=None):
    def point(p):
        if p == "prefill" and shadow is not None:
            shadow.adopt()
        if after:
            after(p)

    if shadow is not None:
        shadow.begin(kv.seen)
    return drive(model, kv, ids, ubatch, n_decode, tokens=tokens, after=point)


# --- 4. schedule ------------------------------------------------------------------------------------
def test_schedule_branches_and_mean():
    beta = Fraction("0.05")
    assert endpoints(Fraction("0.3"), beta) == (Fraction("0.55"), Fraction("0.05"))
    assert endpoints(Fraction("0.7"), beta) == (Fraction(1), Fraction("0.4"))
    alpha = (1 + beta) / 2
    assert endpoints(alpha, beta) == (Fraction(1), Fraction("0.05"))  # both branches agree
    lo = alpha + Fraction(1, 10**9)
    assert [float(x) for x in endpoints(lo, beta)] == pytest.approx([1.0, 0.05], abs=1e-8)
    assert endpoints(Fraction("0.03"), beta) == (Fraction("0.03"), Fraction("0.03"))  # flat
    for rc in [Fraction(i, 97) for i in range(98)]:
        r = layer_ratios(rc, 32, beta)
        assert abs(float(sum(r) / 32) - float(rc)) < 1e-12
        assert r == sorted(r, reverse=True) and min(r) >= 0 and max(r) <= 1
    assert layer_ratios(Fraction("0.3"), 32, beta, "flat") == [Fraction("0.3")] * 32


@pytest.mark.parametrize("t", [10, 33, 100, 1000, 4096, 7777])
@pytest.mark.parametrize("b", ["0.05", "0.2", "0.5", "0.8", "0.99", "64", "700"])
@pytest.mark.parametrize("flat", [False, True])
def test_schedule_keep_counts_match_reference(t, b, flat):
    w, n_layers = 32, 30
    B = budget_tokens(b, t, w)
    got = spindle_keep(t, B, w, n_layers, Fraction("0.05"), "flat" if flat else "linear")
    ref = ref_keep_counts(t, B, w, n_layers, flat=flat)
    assert got == ref
    if ref is not None:  # the floor makes the mean fall short of B(t) by less than a token
        mean = Fraction(sum(ref), n_layers) + w
        assert B - 1 < mean <= B
        assert all(0 <= k <= t - w for k in ref)


# --- 5, 6. codebook build ---------------------------------------------------------------------------
def angles(*deg, d=8):
    u = torch.zeros(len(deg), d)
    for i, a in enumerate(deg):
        u[i, 0], u[i, 1] = math.cos(math.radians(a)), math.sin(math.radians(a))
    return u


@pytest.mark.parametrize("theta,medoids", [(0.98, [0, 60, 120]), (0.995, [5, 60, 120])])
def test_hand_built_codebook(theta, medoids):
    u = angles(0, 5, 10, 60, 62, 120)
    entries, idx = build_codebook(u, theta, block=4, dtype=torch.float16)
    assert idx.tolist() == [0, 0, 0, 1, 1, 2]
    assert entries.dtype == torch.float16
    torch.testing.assert_close(entries.float(), angles(*medoids), atol=1e-3, rtol=0)


def test_zero_vectors_and_self_loops():
    """u = 0 where m = 0, and G[a, a] = 1 whatever theta: the zero vector (adjacent to both
    opposite vectors at theta = -0.5) has the highest degree and takes everything."""
    u = torch.stack([angles(0)[0], angles(180)[0], torch.zeros(8)])
    entries, idx = build_codebook(u, -0.5, block=2, dtype=torch.float32)
    assert idx.tolist() == [0, 0, 0] and torch.equal(entries, torch.zeros(1, 8))


def dense_greedy(u: torch.Tensor, theta: float):
    """Alg. 1 (corrected) on the materialised N x N graph, one pick at a time (fp64 cosines,
    exact here; G is symmetric, so the degree update sums rows)."""
    N = u.shape[0]
    ud = u.double()
    G = torch.cat([ud[i : i + 1000] @ ud.T > theta for i in range(0, N, 1000)])  # (N, N) bool
    G |= torch.eye(N, dtype=torch.bool)
    alive = torch.ones(N, dtype=torch.bool)
    deg = G.sum(1)
    idx = torch.full((N,), -1)
    picks = []
    while alive.any():
        a = int(torch.where(alive, deg, -1).argmax())  # first maximum: lowest index
        R = G[a] & alive
        idx[R] = len(picks)
        picks.append(a)
        alive &= ~R
        deg = deg - G[R].sum(0)
    return picks, idx


def clustered(n: int, d: int, seed: int) -> torch.Tensor:
    """Near-unit vectors in overlapping clusters, coordinates on a 1/256 grid so every dot
    product is exact in fp32 and fp64 (the fp32 build and the fp64 reference agree bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(
        torch.randn(n // 6, d, generator=g, dtype=torch.float64), dim=1
    )
    spread = torch.rand(n, 1, generator=g, dtype=torch.float64) * 0.25
    x = centres[torch.randint(0, n // 6, (n,), generator=g)]
    x = torch.nn.functional.normalize(
        x + spread * torch.randn(n, d, generator=g, dtype=torch.float64) / math.sqrt(d), dim=1
    )
    return (torch.round(x * 256) / 256).float()


@pytest.mark.parametrize("n,block", [(10000, 512), (777, 100)])
def test_blocked_build_equals_dense_reference(n, block):
    u = clustered(n, 32, seed=n)
    theta = (round(0.98 * 2**16) + 0.5) / 2**16  # halfway between representable dot products
    picks, ref_idx = dense_greedy(u, theta)
    entries, idx = build_codebook(u, theta, block=block, dtype=torch.float32)
    assert 50 < len(picks) < n // 2  # real merging, not all singletons
    assert idx.tolist() == ref_idx.tolist()
    assert torch.equal(entries, u[picks])


def test_build_without_merging_keeps_every_vector():
    u = clustered(300, 16, seed=3)
    entries, idx = build_codebook(u, 1.01, block=64, dtype=torch.float32)
    assert idx.tolist() == list(range(300)) and torch.equal(entries, u)


# --- 9. decode-time assignment ---------------------------------------------------------------------
def test_assign_joins_parallel_and_appends_orthogonal():
    e = angles(0, 90, d=4)  # entries e0, e1
    x = torch.tensor([[0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 5.0, 0.1]])
    idx, new, m = assign(e, x, 0.95)
    assert idx.tolist() == [1, 2, 2]  # parallel joins e1; head 2 joins the entry head 1 made
    torch.testing.assert_close(new, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(m, x.norm(dim=1))
    # ties go to the lower index; nothing above theta -> a new entry per head
    tie = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    assert assign(e, tie, 0.5)[0].tolist() == [0]
    idx, new, _ = assign(e, torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]]), 0.95)
    assert idx.tolist() == [2, 3] and new.shape == (2, 4)
    # a tie between an old entry and one made in this call goes to the old (lower) index
    idx, new, _ = assign(e[:1], torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]), 0.5)
    assert idx.tolist() == [1, 0] and new.shape == (1, 4)
    idx, new, _ = assign(e[:0], tie, 0.95)  # an empty codebook
    assert idx.tolist() == [0] and new.shape == (1, 4)


def test_decode_growth_bounded_and_covering():
    m = tiny()
    kv = new_kv(m, "spindlekv:window=8,theta_k=0.6,theta_v=0.4", "0.4")
    get = capture(kv)
    sizes = []

    def after(point):
        sizes.append(codebook_sizes(kv))

    drive(m, kv, prompt(90, 4), 32, n_decode=15, after=after)
    steps = sizes[-16:]  # after prefill, then each decode step
    grew = 0
    for a, b in zip(steps, steps[1:], strict=False):
        for (ka, va), (kb, vb) in zip(a, b, strict=True):
            assert 0 <= (kb - ka) + (vb - va) <= 2 * HKV
            grew += (kb - ka) + (vb - va)
    assert 0 < grew < 15 * L * 2 * HKV  # some decode vectors joined, some made entries
    check_covering(kv, get, {"k": 0.6, "v": 0.4})


def check_covering(kv, get, theta):
    """7: every coded slot's vector is within theta of the original; |recon| = stored mag."""
    checked = 0
    for layer, st in enumerate(kv.layers):
        kr, vr, pos, _ = st.materialise()
        for which, rec in (("k", kr[0]), ("v", vr[0])):
            mag = st.mag_k if which == "k" else st.mag_v
            for h in range(pos.shape[0]):
                valid = mag[h] > 0
                orig = get(which, layer, pos[h][valid].tolist())[h]
                r = rec[h][valid].double()
                cos = torch.nn.functional.cosine_similarity(r, orig, dim=1)
                assert bool((cos > theta[which] - 1e-3).all()), (layer, which, float(cos.min()))
                torch.testing.assert_close(r.norm(dim=1), mag[h][valid].double(), rtol=1e-5, atol=0)
                torch.testing.assert_close(
                    orig.norm(dim=1), mag[h][valid].double(), rtol=1e-5, atol=0
                )
                checked += int(valid.sum())
    assert checked > 0


def test_codebook_covering_after_prefill():
    m = tiny()
    kv = new_kv(m, "spindlekv:window=8,theta_k=0.5,theta_v=0.3", "0.5")
    get = capture(kv)
    drive(m, kv, prompt(120, 5), 40, n_decode=3)
    sizes = codebook_sizes(kv)
    slots = [kv.layers[i].pos_c.shape[1] * HKV for i in range(L)]
    assert all(ck < s and cv < s for (ck, cv), s in zip(sizes, slots, strict=True))  # merged
    check_covering(kv, get, {"k": 0.5, "v": 0.3})


# --- 3. no merging ----------------------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["layer", "head"])
def test_no_merging_reconstructs_every_vector(scope):
    m = tiny()
    kv = new_kv(m, f"spindlekv:window=8,theta_k=1.01,theta_v=1.01,codebook_scope={scope}", "0.3")
    get = capture(kv)
    drive(m, kv, prompt(100, 6), 30, n_decode=4)
    for layer, st in enumerate(kv.layers):
        kr, vr, pos, mask = st.materialise()
        valid = mask.ne(0).any(-1)  # (Hkv, S) real slots
        assert codebook_sizes(kv)[layer] == (int(valid.sum()), int(valid.sum()))
        for h in range(HKV):
            p = pos[h][valid[h]].tolist()
            for which, rec in (("k", kr[0, h]), ("v", vr[0, h])):
                orig = get(which, layer, p)[h]
                err = (rec[valid[h]].double() - orig).norm(dim=1)
                assert bool((err <= 2e-3 * orig.norm(dim=1)).all())


@pytest.mark.parametrize(
    "t,w,sliding,norm,pool",
    [(300, 32, None, True, "none"), (2200, 16, None, True, "none"), (260, 8, 100, True, "none"),
     (200, 8, None, False, "max:7"), (200, 8, 50, True, "avg:5")],
)  # fmt: skip
def test_scores_match_dense_reference(t, w, sliding, norm, pool):
    """Eq. 2 values: softmax over every visible key (window included), summed over the window
    rows, divided by t - a; key blocks (t > 2048) and the model's sliding window."""
    g = torch.Generator().manual_seed(t)
    qw = 3 * torch.randn(6, w, D, generator=g)
    k = torch.randn(2, t, D, generator=g)
    k[:, -w:] *= 3  # the window's own keys take a large, row-dependent share
    got = pool_scores(qhead_scores(qw, k, sliding, norm), pool)
    ref = ref_scores(qw, k, norm=norm, pool=pool, sliding=sliding)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-7)


# --- 8. union and masks -----------------------------------------------------------------------------
def test_union_slots_hand_case():
    keep = torch.zeros(1, 2, 8, dtype=torch.bool)
    keep[0, 0, [0, 3, 6, 7]] = True  # head A
    keep[0, 1, [3, 5, 6, 7]] = True  # head B
    sl = union_slots(keep)
    assert sl.rel.tolist() == [[0, 3, 5, 6, 7]]
    assert sl.mask[..., 0].tolist() == [[0b01, 0b11, 0b10, 0b11, 0b11]]
    # ragged heads are padded (mask 0), g > 8 uses two bytes per slot
    keep = torch.zeros(2, 10, 6, dtype=torch.bool)
    keep[0, 9, 2] = keep[0, 0, 4] = keep[1, 3, 1] = True
    sl = union_slots(keep)
    assert sl.rel.tolist() == [[2, 4], [1, 0]] and sl.valid.tolist() == [
        [True, True],
        [True, False],
    ]
    assert sl.mask.shape == (2, 2, 2)
    assert sl.mask.tolist() == [[[0, 2], [1, 0]], [[8, 0], [0, 0]]]


def one_layer(n_heads, n_kv, spec, budget, sliding=None):
    c = ModelConfig(arch="llama", n_layers=1, dim=64, n_heads=n_heads, n_kv_heads=n_kv,
                    head_dim=D, ffn_dim=128, vocab_size=256, context_length=4096,
                    sliding_window=sliding)  # fmt: skip
    rope = Rope(inverse_frequencies(c), torch.device("cpu"), torch.float32)
    return build(check(spec, budget), c, rope, "cpu", torch.float32), rope


def test_union_and_mask_through_the_manager():
    """g = 2: head A keeps {0, 3}, head B {3, 5}, window {6, 7}; then each query head attends
    over its own set only (dense fp64 reference), for prefill-compressed and decode slots."""
    kv, rope = one_layer(2, 1, "spindlekv:window=2,codebook=off", "4")
    t = 8
    k = torch.zeros(1, 1, t + 1, D)
    slow = [13, 14, 15]  # the slowest RoPE pairs: 8 positions barely rotate them
    for pos, dim in zip([0, 3, 5], slow, strict=True):
        k[0, 0, pos, dim] = 4.0
    q = torch.zeros(1, 2, t + 1, D)
    q[0, 0, :, [13, 14]] = 6.0  # A looks at 0 and 3
    q[0, 1, :, [14, 15]] = 6.0  # B looks at 3 and 5
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1, 1, t + 1, D, generator=g)
    kv.begin_prefill(t)
    kv.attend(0, q[:, :, :t], k[:, :, :t], v[:, :, :t], torch.arange(t))
    kv.end_chunk(t)
    kv.end_prefill()
    st = kv.layers[0]
    assert st.pos_d.tolist() == [[0, 3, 5, 6, 7]]
    assert st.mask_d[..., 0].tolist() == [[1, 3, 2, 3, 3]]
    assert store_sets(kv, 0) == [{0, 3, 6, 7}, {3, 5, 6, 7}]
    qd = torch.randn(1, 2, 1, D, generator=g)
    kd, vd = torch.randn(1, 1, 1, D, generator=g), torch.randn(1, 1, 1, D, generator=g)
    out = kv.attend(0, qd, kd, vd, torch.tensor([t]))
    keys = torch.cat([k[:, :, :t], kd], 2)
    vals = torch.cat([v[:, :, :t], vd], 2)
    kr = rope.apply(keys.double(), torch.arange(t + 1))[0, 0]
    qr = rope.apply(qd.double(), torch.tensor([t]))[0]
    for head, cols in enumerate([[0, 3, 6, 7, 8], [3, 5, 6, 7, 8]]):
        s = qr[head, 0] @ kr[cols].T / math.sqrt(D)
        ref = torch.softmax(s, 0) @ vals[0, 0, cols].double()
        torch.testing.assert_close(out[0, head, 0].double(), ref, atol=1e-5, rtol=0)


# --- 1, 2. shared eviction tests (codebook=off) and the full budget -------------------------------
@pytest.mark.parametrize("ubatch", [7, 1000])
@pytest.mark.parametrize("opts", [":codebook=off", ":codebook=off,gqa=mean"])
def test_full_budget_equals_full_bit_for_bit(ubatch, opts):
    m = tiny()
    ids = prompt(150, 1)
    ref = drive(m, new_kv(m, "full"), ids, ubatch, n_decode=20)
    toks = ref[149:].argmax(-1).tolist()
    out = drive(m, new_kv(m, "spindlekv" + opts, "4096"), ids, ubatch, n_decode=20, tokens=toks)
    assert torch.equal(out, ref)


SELECT_CASES = [
    (6, "window=8", "0.3", 150, 40),  # G = 3, the window spans chunks
    (4, "window=8", "0.5", 130, 1000),  # one chunk: compressed inside attend (step 7)
    (4, "window=16,gqa=mean", "0.35", 140, 32),
    (4, "window=8,pool=max:7", "0.25", 120, 50),
    (6, "window=8,pool=avg:5,score_norm=none", "0.4", 110, 23),
    (4, "window=8,schedule=flat", "48", 150, 64),
    (4, "window=8,beta=0.2", "0.15", 150, 9),  # r_c <= beta: a flat schedule
]


@pytest.mark.parametrize("n_heads,opts,budget,n,ubatch", SELECT_CASES)
def test_selection_matches_dense_reference_and_masked_attention(n_heads, opts, budget, n, ubatch):
    """Per query head: kept sets = the fp64 reference's (k_lambda + w, ties to the lower
    position), every layer output = fp64 attention over its own set (prefill and decode)."""
    m = tiny(n_heads)
    kv = new_kv(m, f"spindlekv:codebook=off,{opts}", budget)
    get = capture(kv)
    shadow = MaskedShadow(kv)
    run_turn(kv, m, shadow, prompt(n, 7), ubatch, n_decode=6)
    o = dict(x.split("=") for x in opts.split(","))
    w = int(o["window"])
    B = budget_tokens(budget, n, w)
    ks = ref_keep_counts(n, B, w, L, beta=o.get("beta", "0.05"), flat=o.get("schedule") == "flat")
    assert ks is not None
    G = n_heads // HKV
    differ = padded = False
    for layer in range(L):
        qw = get("q", layer, range(n - w, n))
        k = get("k", layer, range(n))
        ref = ref_selection(qw, k, ks[layer], G, gqa=o.get("gqa", "qhead"),
                            norm=o.get("score_norm") != "none", pool=o.get("pool", "none"))  # fmt: skip
        got = store_sets(kv, layer)
        decode = set(range(n, n + 6))
        for q in range(n_heads):
            assert got[q] - decode == ref[q], (layer, q)
            assert len(got[q] - decode) == ks[layer] + w  # item 1: exact count per query head
        differ |= any(got[q] != got[0] for q in range(n_heads))
        S = slot_counts(kv, layer)[1]
        unions = [set().union(*ref[h * G : (h + 1) * G]) for h in range(HKV)]
        assert S == max(map(len, unions)) + 6  # heads padded to the longest union
        padded |= len(unions[0]) != len(unions[1])
    assert differ
    if "mean" not in opts:
        assert padded
    assert shadow.checked > 0


@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize("opts", ["window=8", "window=8,gqa=mean", "window=4,pool=max:5"])
def test_gqa_duplicated_heads_select_as_mha(G, opts):
    """0.8.4: G identical query heads per group keep exactly what one head keeps (all bits set,
    no padding); outputs are the MHA outputs repeated (codebook on)."""
    from test_kv_methods import feed

    g = torch.Generator().manual_seed(11)
    n, n_prompt = 120, 100
    q = 2 * torch.randn(1, HKV, n, D, generator=g)
    k = torch.randn(1, HKV, n, D, generator=g)
    v = torch.randn(1, HKV, n, D, generator=g)
    kv1, _ = one_layer(HKV, HKV, f"spindlekv:{opts}", "0.3")
    kvG, _ = one_layer(HKV * G, HKV, f"spindlekv:{opts}", "0.3")
    out1 = feed(kv1, q, k, v, n_prompt, 16)
    outG = feed(kvG, q.repeat_interleave(G, dim=1), k, v, n_prompt, 16)
    s1, sG = store_sets(kv1, 0), store_sets(kvG, 0)
    assert sG == [s for s in s1 for _ in range(G)]
    assert s1[0] != s1[1] and len(s1[0]) < n
    assert kvG.layers[0].all_bits and slot_counts(kvG, 0) == slot_counts(kv1, 0)
    assert codebook_sizes(kvG) == codebook_sizes(kv1)
    torch.testing.assert_close(outG, out1.repeat_interleave(G, dim=1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("opts", ["codebook=off", "theta_k=0.6,theta_v=0.5"])
def test_slot_permutation_invariance(opts):
    """0.8.3: shuffling each head's slots (with positions, masks, indices, magnitudes) after
    prefill changes no output; decode decisions (codebook growth) are unchanged too."""
    m = tiny()
    ids = prompt(100, 8)
    runs = []
    for shuffle in (False, True):
        kv = new_kv(m, f"spindlekv:window=8,{opts}", "0.3")

        def after(point, kv=kv, shuffle=shuffle):
            if point == "prefill" and shuffle:
                g = torch.Generator().manual_seed(1)
                for st in kv.layers:
                    seg = "c" if st.pos_c is not None else "d"
                    names = (["idx_k", "idx_v", "mag_k", "mag_v", "pos_c", "mask_c"] if seg == "c"
                             else ["k_d", "v_d", "pos_d", "mask_d"])  # fmt: skip
                    S = getattr(st, names[-2]).shape[1]
                    perm = torch.stack([torch.randperm(S, generator=g) for _ in range(HKV)])
                    for name in names:
                        x = getattr(st, name)
                        ix = perm.view(HKV, S, *([1] * (x.dim() - 2))).expand_as(x)
                        setattr(st, name, torch.gather(x, 1, ix))
                    st.all_bits = False

        toks = None if not runs else runs[0][0][99:].argmax(-1).tolist()
        out = drive(m, kv, ids, 32, n_decode=10, tokens=toks, after=after)
        runs.append((out, codebook_sizes(kv), [store_sets(kv, i) for i in range(L)]))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=1e-5)
    assert runs[1][1:] == runs[0][1:]


# --- later turns, sliding windows, chunked vs one chunk ------------------------------------------
def test_later_turn_compresses_only_new_tokens():
    m = tiny()
    w, budget = 8, "0.4"
    kv = new_kv(m, f"spindlekv:window={w},theta_k=0.6,theta_v=0.5", budget)
    get = capture(kv)
    drive(m, kv, prompt(100, 9), 32, n_decode=5)
    st0 = [dict((n, getattr(st, n).clone()) for n in ("idx_k", "idx_v", "mag_k", "mag_v", "pos_c", "mask_c"))
           for st in kv.layers]  # fmt: skip
    books0 = [(st.books_k[0].rows().clone(), st.books_v[0].rows().clone()) for st in kv.layers]
    sets0 = [store_sets(kv, i) for i in range(L)]
    drive(m, kv, prompt(60, 10), 16, n_decode=3)
    t2, start = 60, 105
    ks = ref_keep_counts(t2, budget_tokens(budget, t2, w), w, L)  # B from the turn's length
    for layer, st in enumerate(kv.layers):
        S0 = st0[layer]["pos_c"].shape[1]
        for name, x in st0[layer].items():
            assert torch.equal(getattr(st, name)[:, :S0], x), name  # earlier turns as stored
        kb, vb = books0[layer]
        assert torch.equal(st.books_k[0].rows()[: len(kb)], kb)
        assert torch.equal(st.books_v[0].rows()[: len(vb)], vb)
        qw = get("q", layer, range(start + t2 - w, start + t2))
        k = get("k", layer, range(start, start + t2))
        ref = ref_selection(qw, k, ks[layer], 2)  # softmax over the turn's own keys
        got = store_sets(kv, layer)
        for q in range(4):
            new = {p - start for p in got[q] - sets0[layer][q] if p < start + t2}
            assert new == ref[q] and len(new) == ks[layer] + w
            assert got[q] - sets0[layer][q] - {p + start for p in new} == {165, 166, 167}
    check_covering(kv, get, {"k": 0.6, "v": 0.5})  # turn 2's indices point past turn 1's entries


@pytest.mark.parametrize("sliding", [None, 24])
def test_masked_attention_across_turns_and_sliding_window(sliding):
    """Every layer output of two turns (prefill chunks and decode) equals fp64 attention over
    the positions each query head sees; with a sliding window, keys past it are masked."""
    base = tiny()
    m = base
    if sliding:
        m = Transformer.from_weights(config().replace(sliding_window=sliding), base.state_dict())
    kv = new_kv(m, "spindlekv:window=8,codebook=off", "0.3")
    shadow = MaskedShadow(kv)
    run_turn(kv, m, shadow, prompt(90, 11), 32, 5)
    run_turn(kv, m, shadow, prompt(40, 12), 16, 4)
    assert shadow.checked == L * 4 * (90 + 40 + 9)
    assert all(len(s) < 139 for layer in shadow.sets for s in layer)


# --- sliding windows: a windowed layer holds at most the window (issue 47) ---------------------
@functools.lru_cache(maxsize=2)
def windowed(kind: str):
    """`mistral`: the tiny model with a window of 24 on every layer (2 KV heads, G = 2);
    `gemma3`: Gemma 3 1B's attention (one KV head, G = 4, head_dim 256), layers 0 and 1 local
    with a window of 48, layer 2 global."""
    if kind == "gemma3":
        return random_transformer(tiny_families.kv_config("gemma3"), 4325)
    return Transformer.from_weights(config().replace(sliding_window=24), tiny().state_dict())


def check_bound(kv, point: str, books: bool = True) -> None:
    """After a compression or a decode step: a windowed layer holds at most its window (slots
    per KV head, padding included), every byte by the spec's formula, and its books at most
    two rows per slot they may serve, plus a step's (the ring drops rows no slot names)."""
    c = kv.config
    for i, n in enumerate(kv.kept_counts()):
        w = c.window(i)
        if w is None:
            continue
        assert n <= w, (point, i, n)
        if books:
            ck, cv = codebook_sizes(kv)[i]
            assert max(ck, cv) <= c.n_kv_heads * (2 * w + 1), (point, i, ck, cv)
    assert kv.nbytes() == ref_bytes(kv), point


WINDOW_OPTS = [
    "codebook=off",
    "theta_k=1.01,theta_v=1.01",  # coded, no merging: one row per vector, rebuilt exactly
    "theta_k=1.01,theta_v=1.01,decode_codebook=off",  # coded prefill slots beside dense ones
    "theta_k=1.01,theta_v=1.01,codebook_scope=head",
]


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
@pytest.mark.parametrize("opts", WINDOW_OPTS)
def test_windowed_layers_hold_the_window_and_attend_exactly(kind, opts):
    """Two turns (the second shorter than the window, so the first's newest slots stay) and
    decode steps well past the window (the ring writes over each head's oldest slot): every
    windowed layer holds at most the window after each compression and step, and every
    layer output equals fp64 attention of each query head over its own selection within
    the window (MaskedShadow)."""
    m = windowed(kind)
    c = m.config
    kv = new_kv(m, f"spindlekv:window=8,{opts}", "0.3")
    shadow = MaskedShadow(kv)
    local = [i for i in range(c.n_layers) if c.window(i)]
    w = c.window(local[0])

    def after(point):
        if point != "chunk":
            check_bound(kv, point)

    run_turn(kv, m, shadow, prompt(90, 11), 32, w + 16, after=after)
    run_turn(kv, m, shadow, prompt(10, 12), 16, w + 4, after=after)
    assert kv.seen == 100 + 2 * w + 20
    assert shadow.checked == c.n_layers * c.n_heads * kv.seen
    assert [kv.kept_counts()[i] for i in local] == [w] * len(local)  # the ring is full
    if "decode_codebook=off" in opts:  # the coded slots are past the window: all dense now
        assert all(kv.layers[i].pos_c is None for i in local)
    if c.window(c.n_layers - 1) is None:  # Gemma 3's global layer keeps its whole selection
        assert kv.kept_counts()[-1] > w


@pytest.mark.parametrize("kind,opts", [("mistral", "window=8"), ("mistral", "window=8,gqa=mean"),
                                       ("gemma3", "window=8,pool=max:5"), ("gemma3", "window=60")])  # fmt: skip
@pytest.mark.parametrize("ubatch", [32, 1000])
def test_windowed_selection_takes_only_the_newest_window(kind, opts, ubatch):
    """At compression a windowed layer's candidates are the newest W tokens of the turn: each
    query head keeps its top min(k_l, W - w) of them (the fp64 reference's, scores masked
    outside) plus the observation window cut to the newest W (window=60 > W = 48); the
    tokens the window forbids are not given elsewhere. A global layer selects as before."""
    m = windowed(kind)
    c = m.config
    kv = new_kv(m, f"spindlekv:codebook=off,{opts}", "0.3")
    get = capture(kv)
    n = 130
    drive(m, kv, prompt(n, 7), ubatch)
    o = dict(x.split("=") for x in opts.split(","))
    w, G = int(o["window"]), c.n_heads // c.n_kv_heads
    ks = ref_keep_counts(n, budget_tokens("0.3", n, w), w, c.n_layers)
    for layer in range(c.n_layers):
        W = c.window(layer)
        ac = ref_scores(get("q", layer, range(n - w, n)), get("k", layer, range(n)),
                        pool=o.get("pool", "none"), sliding=W)  # fmt: skip
        first = n - W if W else 0
        ac[:, :first] = NEG
        kk = min(ks[layer], max(n - w - first, 0))
        if o.get("gqa") == "mean":
            ac = ac.view(c.n_kv_heads, G, -1).mean(1).repeat_interleave(G, 0)
        ref = [set(ref_top(ac[q], kk)) | set(range(max(n - w, first), n)) for q in range(c.n_heads)]
        assert store_sets(kv, layer) == ref, layer
        assert kv.kept_counts()[layer] <= (W or n)
        if W:
            assert min(len(r) for r in ref) == min(ks[layer] + w, W)  # the window's cut


@pytest.mark.parametrize("ubatch", [64, 1000])
def test_gemma3_covering_budget_equals_full_under_the_window(ubatch):
    """Everything kept (codebook=off): SpindleKV on Gemma 3's shape gives `full`'s logits (the
    window mask, full's own ring), prefilled past the window (in chunks, or one) and decoded
    past it again, while its local layers hold exactly the window."""
    m = windowed("gemma3")
    ids = prompt(150, 5)
    ref = drive(m, new_kv(m, "full"), ids, ubatch, n_decode=70)
    toks = ref[149:-1].argmax(-1).tolist()
    kv = new_kv(m, "spindlekv:codebook=off", "4096")
    seen = []

    def after(point):
        if point != "chunk":
            check_bound(kv, point, books=False)
            seen.append(kv.kept_counts())

    out = drive(m, kv, ids, ubatch, n_decode=70, tokens=toks, after=after)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert seen[0] == [48, 48, 150] and seen[-1] == [48, 48, 220]


def test_kvc_round_trip_and_fork_after_the_ring_wrapped(tmp_path):
    """Gemma 3's shape, a compressed document decoded well past the window (the ring has
    written over slots and dropped codebook rows): a .kvc file and a fork each go on as the
    cache that never left memory, bit for bit, through a question turn and decode steps."""
    from test_kvc import _continue, _runtime, same_graph

    from kvrun.run import kvc
    from kvrun.run.session import Session

    m = windowed("gemma3")
    rt = _runtime(tmp_path, m)
    s = Session(m, None, rt.new_kv(check("spindlekv:window=8,theta_k=0.7,theta_v=0.6", "0.3")),
                ubatch=64)  # fmt: skip
    logits = s.prefill(prompt(150, 3))
    for _ in range(80):
        logits = s.decode(int(logits.argmax()))
    local = s.kv.layers[0]
    assert s.kv.kept_counts()[:2] == [48, 48] and min(local.pos_c[0].tolist()) == 230 - 48
    path = kvc.save(tmp_path / "ring.kvc", s.kv, s.tokens, rt)
    kv, tokens, _ = kvc.load(path, rt)
    same_graph(s.kv, kv)
    fork = s.kv.fork()
    question, steps = prompt(12, 5), (7, 9, 11, 40, 3, 5)
    want = _continue(m, s.kv, s.tokens, question, steps)
    assert torch.equal(_continue(m, kv, tokens, question, steps), want)
    assert torch.equal(_continue(m, fork, tokens, question, steps), want)
    assert kv.nbytes() == s.kv.nbytes() == fork.nbytes()


def test_one_chunk_equals_chunked_and_bounds_prefill_memory():
    """Steps 7 and 8 keep the same sets; one chunk holds no full KV across layers, a chunked
    prefill holds every layer's K, V and window queries until end_prefill."""
    m, n, w = tiny(), 130, 8
    Hq = m.config.n_heads
    results = []
    for ubatch in (1000, 32):
        kv = new_kv(m, f"spindlekv:window={w}", "0.3")
        seen = []

        def measure(*a, kv=kv, seen=seen):
            seen.append(kv.nbytes())

        tap(kv, after=measure)
        drive(m, kv, prompt(n, 13), ubatch)
        results.append(([store_sets(kv, i) for i in range(L)], seen, kv.nbytes()))
    (one, peak_one, final_one), (chunked, peak_chunked, final_chunked) = results
    assert one == chunked and final_one == final_chunked
    assert max(peak_one) <= final_one  # never more than the compressed layers
    full = L * (2 * HKV * n * D * E + Hq * w * D * E)
    assert peak_chunked[-1] == full and max(peak_chunked) == full


# --- 10. bytes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts",
    ["", "codebook=off", "decode_codebook=off", "codebook_scope=head", "index=int32",
     "theta_k=0.7,theta_v=0.6"],
)  # fmt: skip
def test_nbytes_matches_formula(opts):
    m = tiny()
    n, ub, w = 110, 32, 8
    Hq = m.config.n_heads
    kv = new_kv(m, f"spindlekv:window={w}" + (f",{opts}" if opts else ""), "0.35")
    checked = []

    def after(point):
        nn = kv.seen
        assert kv.nbytes_full() == 2 * L * HKV * nn * D * E
        if point == "chunk":  # held pre-RoPE K, V of the turn plus the window queries
            assert kv.nbytes() == L * (2 * HKV * nn * D * E + Hq * min(w, nn) * D * E)
        else:
            assert kv.nbytes() == ref_bytes(kv), (point, nn)
            S_c, S_d = slot_counts(kv, 0)
            if opts == "codebook=off":
                assert S_c == 0 and S_d > 0
            elif opts == "decode_codebook=off":
                assert S_d == nn - n
        checked.append(point)

    drive(m, kv, prompt(n, 14), ub, n_decode=6, after=after)
    assert checked.count("step") == 6
    # padding slots are stored and counted: some layer's heads hold unions of different sizes
    assert any(len(set(real_slots(kv, i))) > 1 for i in range(L))
    if opts == "index=int32":
        assert kv.layers[0].idx_k.dtype == torch.int32


@pytest.mark.parametrize("index", ["auto", "int16-strict"])
def test_int32_switch_when_a_codebook_exceeds_int16(index):
    """A layer whose key codebook passes 32767 entries switches its key indices to int32 (4
    bytes per slot in the formula); index=int16-strict refuses."""
    m = tiny()
    kv = new_kv(m, f"spindlekv:window=8,theta_k=1.01,theta_v=1.01,index={index}", "0.3")
    drive(m, kv, prompt(80, 15), 40)
    st = kv.layers[1]
    before = st.idx_k.clone()
    st.books_k[0].append(torch.zeros(32767 - st.books_k[0].n, D))  # synthetic: a full book
    assert st.idx_k.dtype == torch.int16 and kv.nbytes() == ref_bytes(kv)
    if index == "int16-strict":
        with pytest.raises(KvrunError, match="int16"):
            drive(m, kv, [], 1, n_decode=1, tokens=[5])
        return
    drive(m, kv, [], 1, n_decode=2, tokens=[5, 6])
    assert st.idx_k.dtype == torch.int32 and st.idx_v.dtype == torch.int16
    assert kv.layers[0].idx_k.dtype == torch.int16
    assert torch.equal(st.idx_k[:, : before.shape[1]], before.int())
    assert st.idx_k[:, -1].tolist() == [32767 + 2, 32767 + 3]  # new entries, heads in order
    assert kv.nbytes() == ref_bytes(kv)


# --- options, describe, budgets ---------------------------------------------------------------------
def test_describe_and_paper_report():
    m = tiny()
    kv = new_kv(m, "spindlekv:window=8,report=paper")
    assert kv.describe()["budget"] == 0.2  # the spec's default budget
    drive(m, kv, prompt(100, 16), 50)
    d = kv.describe()
    assert d["method"] == "spindlekv" and d["window"] == 8 and d["theta_k"] == 0.98
    assert set(d) >= {"beta", "schedule", "pool", "gqa", "codebook", "index", "cb_block"}
    ks = ref_keep_counts(100, budget_tokens("0.2", 100, 8), 8, L)
    r = []
    for layer, (ck, cv) in enumerate(codebook_sizes(kv)):
        r1 = (ks[layer] + 8) / 100
        r2 = (ck + cv) / (2 * 4 * (ks[layer] + 8))
        assert d["paper"]["r1"][layer] == pytest.approx(r1, abs=1e-6)
        assert d["paper"]["r2"][layer] == pytest.approx(r2, abs=1e-6)
        r.append(r1 * r2 * (D + 16 / 33) / D)
    assert d["paper"]["ratio"] == pytest.approx(sum(r) / L, abs=1e-6)
    assert new_kv(m, "spindlekv", "100").describe()["budget"] == 100


def test_budget_below_window_is_rejected():
    m = tiny()
    with pytest.raises(KvrunError, match="protected minimum"):
        new_kv(m, "spindlekv", "16")
    new_kv(m, "spindlekv:window=8", "16")
    calls = []  # the debug hook is accepted (runtime signature) and never called
    kv = new_kv(m, "spindlekv:window=8", "0.3", hook=lambda *a: calls.append(a))
    drive(m, kv, prompt(60, 17), 20, n_decode=2)
    assert calls == [] and kv.seen == 62


# --- end to end on the default model ----------------------------------------------------------------
KEY = 49595


@pytest.fixture(scope="module")
def passkey_file(default_runtime, tmp_path_factory):
    path = tmp_path_factory.mktemp("spindle") / "passkey.txt"
    path.write_text(passkey_prompt(default_runtime.tokenizer, 2000, 0.5, KEY, seed=2))
    return path


def test_passkey_through_cli(default_gguf, passkey_file):
    """The spec's default (no pooling) loses the key's digits in the 5% deep layers of this
    135M model at 0.5 (so does codebook=off); pool=max:7 (a spec option) keeps neighbours."""
    args = ["generate", "-m", str(default_gguf), "--raw", "-f", str(passkey_file), "-n", "8",
            "--temp", "0", "--json", "--kv", "spindlekv:pool=max:7", "--kv-budget", "0.5"]  # fmt: skip
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] > 1900
    assert answer_matches(out["text"], KEY), out["text"]
    assert out["kv"]["method"] == "spindlekv" and out["kv"]["budget"] == 0.5
    ratio = out["kv_bytes"] / out["kv_bytes_full"]
    assert 0.03 < ratio < 0.12  # eviction (mean 0.5 per query head) times codebooks


def test_f16_store_halves_the_books_and_keeps_the_selection(tmp_path):
    """--kv-dtype f16 (the CPU's default): the books, magnitudes and dense slots in f16, the
    codebook built in fp32 and rounded after; the same kept sets, its float bytes halved, logits
    near the f32 store's, and a .kvc round trip bit for bit. q8_0 is refused in one line."""
    from test_kvc import _continue, _runtime, same_graph

    from kvrun.run import kvc
    from kvrun.run.session import Session

    m, ids = tiny(), prompt(120, 21)
    runs = {}
    for dt in ("f32", "f16"):
        for opts in ("", ",decode_codebook=off"):
            spec = check(f"spindlekv:window=8{opts}", "0.35").with_dtype(dt)
            kv = build(spec, m.config, m.rope, "cpu", torch.float32)
            runs[dt, opts] = kv, drive(m, kv, ids, 32, n_decode=6)
    for opts in ("", ",decode_codebook=off"):
        (k32, l32), (k16, l16) = runs["f32", opts], runs["f16", opts]
        st = k16.layers[0]
        assert st.shelf_k.data.dtype == st.mag_k.dtype == torch.float16
        assert opts == "" or st.k_d.dtype == torch.float16  # decode tokens kept dense
        assert [store_sets(k16, i) for i in range(L)] == [store_sets(k32, i) for i in range(L)]
        ints = sum(nbytes_of(t) for s in k16.layers for t in (s.idx_k, s.idx_v, s.pos_c,
                   s.mask_c, s.pos_d, s.mask_d))  # fmt: skip
        assert k16.nbytes() - ints == (k32.nbytes() - ints) // 2
        assert 2 * k16.nbytes_full() == k32.nbytes_full()
        err = (l16 - l32).abs().max() / l32.abs().max()
        assert err < 0.02, err
    rt = _runtime(tmp_path, m)
    s = Session(
        m, None, rt.new_kv(check("spindlekv:window=8", "0.35").with_dtype("f16")), ubatch=32
    )
    logits = s.prefill(ids)
    for _ in range(5):
        logits = s.decode(int(logits.argmax()))
    path = kvc.save(tmp_path / "f16.kvc", s.kv, s.tokens, rt)
    kv, tokens, _ = kvc.load(path, rt)
    same_graph(s.kv, kv)
    question, steps = prompt(12, 5), (7, 9, 11)
    assert torch.equal(_continue(m, kv, tokens, question, steps),
                       _continue(m, s.kv, s.tokens, question, steps))  # fmt: skip
    with pytest.raises(KvrunError, match="codebooks in f32 or f16, not q8_0"):
        build(check("spindlekv", "0.35").with_dtype("q8_0"), m.config, m.rope, "cpu", torch.float32)
