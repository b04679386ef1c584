"""MiniKV (methods/minikv.md, "How to test it"): column sums, selection, pyramid, the 2-bit
store's schedule and persistence, bytes, and pass-key retrieval through the CLI.

References are naive and independent: materialised fp64 attention, explicit sorting,
hand-computed schedules. The manager's helpers are never called from them.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from cli_checks import one_error_line
from click.testing import CliRunner
from kv_helpers import pack, quantize
from passkey_helpers import passkey_prompt
from test_kv_methods import HKV, drive, full_logits, hooked, new_kv, prompt, tap, tiny

from kvrun.cli.main import cli
from kvrun.kernels.colsum import colsum_ref
from kvrun.kv import build, check
from kvrun.kv.methods.minikv.cache import dense_colsum
from kvrun.kv.methods.minikv.cache import pyramid as minikv_pyramid
from kvrun.kv.methods.minikv.cache import pyramid_shares as minikv_pyramid_shares
from kvrun.kv.stores.kivi import KiviLayer, dequantize, unpack
from kvrun.tasks.passkey import answer_matches

pytestmark = pytest.mark.usefixtures("one_thread")


# --- 2. no eviction, no quantization -----------------------------------------------------------
@pytest.mark.parametrize("spec", ["minikv:heavy=1.0,recent=1.0,quant=none",
                                  "minikv-pyramid:heavy=1.0,recent=1.0,quant=none"])  # fmt: skip
def test_everything_kept_equals_full(spec):
    """Logits equal the full cache for prefill and 10 decode steps. Not bit for bit: the
    column-sum attention is an explicit fp32 softmax where the full cache runs SDPA."""
    m, n = tiny(), 150
    ref = full_logits(n)
    toks = ref[n - 1 :].argmax(-1).tolist()
    out = drive(m, new_kv(m, spec), prompt(n, seed=1), 7, n_decode=10, tokens=toks)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


# --- 3. column sums ----------------------------------------------------------------------------
def ref_colsum(q, k, v):
    """fp64 materialised causal attention of the last Tq slots: out (Hq,Tq,D), P (Hq,Tq,T)."""
    Hq, Tq, D = q.shape
    Hkv, T, _ = k.shape
    kk = k.double().repeat_interleave(Hq // Hkv, 0)
    s = q.double() @ kk.transpose(1, 2) / math.sqrt(D)
    rows = torch.arange(T - Tq, T)[:, None]
    s = s.masked_fill(torch.arange(T)[None, :] > rows, float("-inf"))
    p = s.softmax(-1)
    return p @ v.double().repeat_interleave(Hq // Hkv, 0), p


@pytest.mark.parametrize("t", [1, 15, 16, 17, 100, 1000, 4097])
@pytest.mark.parametrize("g", [1, 4])
def test_column_sums_match_dense_reference(t, g):
    torch.manual_seed(t * 10 + g)
    Hkv, D = 1 if t > 1000 else 2, 16
    q = torch.randn(1, Hkv * g, t, D)
    k, v = torch.randn(1, Hkv, t, D), torch.randn(1, Hkv, t, D)
    out_ref, p = ref_colsum(q[0], k[0], v[0])
    a_q = p.sum(1)  # (Hq, T)
    a_h = a_q.view(Hkv, g, t).sum(1)
    out, _, col = colsum_ref(q, k, v)
    for o, c in ((out, col), (dense_colsum(q, k, v)[0].out, dense_colsum(q, k, v)[1])):
        torch.testing.assert_close(c.double(), a_h, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(o[0].double(), out_ref, rtol=1e-4, atol=1e-5)
        assert torch.allclose(
            col.sum(-1).double(), torch.full((Hkv,), float(g * t), dtype=torch.float64), rtol=1e-3
        )
    _, _, per_q = colsum_ref(q, k, v, per_head=True)
    torch.testing.assert_close(per_q.double(), a_q, rtol=1e-4, atol=1e-6)
    # A_q[t-1] = P_q[t-1, t-1]: only the last row sees the last key
    torch.testing.assert_close(per_q[:, -1].double(), p[:, -1, -1], rtol=1e-5, atol=1e-7)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(colsum_ref(q, k, v)[0], sdpa, rtol=1e-4, atol=1e-5)


def test_column_sums_with_older_keys_are_true_probabilities():
    """A later turn: rows also see keys held elsewhere; column sums are the probabilities over
    all of them, so they sum to g*Tq minus the mass the older keys took."""
    torch.manual_seed(3)
    Hkv, g, Told, Tq, D = 2, 2, 30, 20, 16
    q = torch.randn(1, Hkv * g, Tq, D)
    k, v = torch.randn(1, Hkv, Told + Tq, D), torch.randn(1, Hkv, Told + Tq, D)
    _, p = ref_colsum(q[0], k[0], v[0])  # all keys in one segment
    ref = p[:, :, Told:].sum(1).view(Hkv, g, Tq).sum(1)
    s_old = (q[0].double() @ k[0, :, :Told].double().repeat_interleave(g, 0).mT) / math.sqrt(D)
    other = torch.logsumexp(s_old, -1)[None].float()  # (1, Hq, Tq)
    _, _, col = colsum_ref(q, k[:, :, Told:], v[:, :, Told:], other_lse=other)
    torch.testing.assert_close(col.double(), ref, rtol=1e-4, atol=1e-6)


# --- selection -------------------------------------------------------------------------------
def staged(spec, t, acc, budget=None):
    """A MiniKV manager on the tiny model after a t-token prefill whose column sums are replaced
    by `acc` (Hkv or Hq rows) just before selection; returns the kept positions per layer."""
    m = tiny()
    kv, ev = hooked(m, spec, budget)
    orig = kv.select  # the cache's own selection (heavy hitters + recent)

    def select(point):
        for st in kv.layers:
            st.dense.acc = acc.clone().float()
        orig(point)

    kv.select = select
    drive(m, kv, prompt(t), 64)
    return [rows for layer, point, _, rows in ev if point == "prefill"]


def test_hand_built_selection():
    """t = 8, heavy = recent = 0.25, A_h = [5, 1, 3, 0.5, 4, 2, 9, 9] keeps {0, 4, 6, 7}."""
    a = torch.tensor([5, 1, 3, 0.5, 4, 2, 9, 9]).expand(HKV, 8)
    for rows in staged("minikv:quant=none", 8, a):
        assert rows == [[0, 4, 6, 7]] * HKV


def test_length_norm_and_gqa_max_change_the_ranking():
    # length: A[j] / (8 - j) = [0.625, 0.143, 0.5, 0.1, 1.0, 0.67, ...] -> heavy {4, 5}
    a = torch.tensor([5, 1, 3, 0.5, 4, 2, 9, 9]).expand(HKV, 8)
    for rows in staged("minikv:quant=none,score_norm=length", 8, a):
        assert rows == [[4, 5, 6, 7]] * HKV
    # max over the group: query head 1 of each KV head has a peak at token 3
    per_q = torch.tensor([[5, 1, 3, 0.5, 4, 2, 9, 9], [0, 0, 0, 6, 1, 0, 9, 9]] * HKV)
    for rows in staged("minikv:quant=none,gqa_agg=max", 8, per_q):
        assert rows == [[0, 3, 6, 7]] * HKV  # the sum would pick {0, 4}


def test_budget_splits_into_recent_and_heavy_and_align():
    t = 200
    a = torch.arange(t, 0, -1).float().expand(HKV, t)  # earlier = heavier
    (rows, *_) = staged("minikv:quant=none", t, a, budget="0.3")  # B = 60: 30 recent, 30 heavy
    assert rows[0] == list(range(30)) + list(range(170, 200))
    (rows, *_) = staged("minikv:quant=none,align=16", t, a)  # 50 + 50 -> heavy 46, keep 96
    assert rows[0] == list(range(46)) + list(range(150, 200))


def test_kept_sets_equal_dense_reference():
    """Chunked prefill on the tiny model: the kept set per (layer, KV head) is the top n_hh of
    the fp64 column sums over every prompt query (materialised), plus the recent window."""
    m, t = tiny(), 90
    kv, ev = hooked(m, "minikv:quant=none,heavy=0.2,recent=0.1", None)
    hist: dict[int, list] = {}
    tap(kv, after=lambda layer, qr, kr, v, pos, out, _: hist.setdefault(layer, []).append((qr, kr)))
    drive(m, kv, prompt(t, seed=5), 16)
    n_hh, n_rw = 18, 9
    kept = {layer: rows for layer, point, _, rows in ev if point == "prefill"}
    for layer, parts in hist.items():
        q = torch.cat([p[0] for p in parts], 1)  # (Hq, t, D)
        k = torch.cat([p[1] for p in parts], 1)
        _, p = ref_colsum(q, k, k)
        a_h = p.sum(1).view(HKV, -1, t).sum(1)
        for h in range(HKV):
            cand = sorted(range(t - n_rw), key=lambda j: (-float(a_h[h, j]), j))[:n_hh]
            assert kept[layer][h] == sorted(cand) + list(range(t - n_rw, t))


@pytest.mark.parametrize("spec", ["minikv:heavy=0.3,recent=0.2", "minikv:heavy=0.3,recent=0.2,quant=none"])  # fmt: skip
def test_staged_and_held_rows_take_the_kv_dtype(spec):
    """--kv-dtype f16 (the CPU's default): the staged turn and the held turns (quant=none) keep
    f16 rows; the column sums read the staged rows widened into one reused scratch and give
    the logits the same rows widened afresh a call (DenseSeg.k) give, bit for bit."""
    m, ids = tiny(), prompt(120, seed=3)

    def run(scratch: bool):
        kv = build(check(spec).with_dtype("f16"), m.config, m.rope, "cpu", torch.float32)
        if not scratch:  # a fresh float32 copy a call
            for st in kv.layers:
                st.dense.widened = lambda _, d=st.dense: (d.k, d.v, None)
        return kv, drive(m, kv, ids, 16, n_decode=5)

    kv, got = run(True)
    assert torch.equal(got, run(False)[1])
    assert kv._scratch is None  # the prefill's only
    assert all(st.dense._k.data.dtype == torch.float16 for st in kv.layers)
    held = [h for h in kv.held if h is not None]
    assert len(held) == (len(kv.layers) if "quant=none" in spec else 0)
    assert all(h.length and h._k.data.dtype == torch.float16 for h in held)


# --- 5. pyramid --------------------------------------------------------------------------------
def test_pyramid_shares_and_sums():
    x = Fraction(1, 4)
    s = [x * v for v in minikv_pyramid_shares(32, 7)]
    assert [round(float(s[i]), 6) for i in (0, 8, 31)] == [0.464286, 0.353687, 0.035714]
    assert sum(s) / 32 == x
    for n_hh in (0, 1, 7, 1000, 1023):
        hh = minikv_pyramid(n_hh, 32, 7)
        assert sum(hh) == 32 * n_hh and hh == sorted(hh, reverse=True)
    assert minikv_pyramid(100, 4, 7, "up") == minikv_pyramid(100, 4, 7)[::-1]


def test_pyramid_through_the_manager():
    m, t = tiny(), 400
    kv = new_kv(m, "minikv-pyramid:quant=none")
    drive(m, kv, prompt(t), 128)
    counts = kv.kept_counts()  # 3 layers, n_hh = 100: shares 13/7, 1, 1/7 -> 186, 100, 14
    assert counts == [186 + 100, 100 + 100, 14 + 100]


# --- 6. quantization (G = 16, 2 bits) ----------------------------------------------------------
def test_two_bit_group16_quantizer():
    torch.manual_seed(0)
    x = torch.randn(4, 64, dtype=torch.float16)
    x[1] = 0.75  # a constant row: every group of it is flat
    codes, s, z = quantize(x, 2, -1, 16, torch.float16)
    xh = dequantize(codes, s, z, -1, 16)
    bound = s.float().repeat_interleave(16, -1) / 2 + 2e-3
    assert ((x.float() - xh).abs() <= bound).all()
    assert torch.equal(xh[1], x[1].float())
    assert torch.equal(unpack(pack(codes, 2), 2), codes)
    word = pack(torch.tensor([[0, 1, 2, 3] + [0] * 12], dtype=torch.uint8), 2)
    assert word.tolist() == [[228]]


# --- 7-9. residual schedule, persistence -------------------------------------------------------
def test_residual_schedule_and_persistence():
    """n_keep = 1000: n_q 992 + n_r 8; 119 steps -> n_r 127; 120 -> n_q 1120, n_r 0; 121 ->
    n_r 1; after 200 steps every layer holds 1200 and the prefill groups never change."""
    m, t = tiny(), 2000
    kv = new_kv(m, "minikv")
    ids = prompt(t, seed=2)
    drive(m, kv, ids, 512)
    st = kv.layers[0].kivi
    assert (st.body_len, st.tail_len) == (992, 8)
    body0 = [x.clone() for x in kv.layers[1].kivi.body()]
    seen = {}

    def after(point):
        steps = kv.seen - t
        if steps in (119, 120, 121):
            seen[steps] = (st.body_len, st.tail_len)

    drive(m, kv, [], 1, n_decode=200, tokens=[7] * 200, after=after)
    assert seen == {119: (992, 127), 120: (1120, 0), 121: (1120, 1)}
    assert kv.kept_counts() == [1200] * 3
    body1 = kv.layers[1].kivi.body()
    assert torch.equal(body1[0][:, : body0[0].shape[1]], body0[0])  # key codes, by group
    assert torch.equal(body1[3][:, :992], body0[3])  # value codes
    for a, b in zip(body0[1:3], body1[1:3], strict=True):  # key scales/zeros, by group
        assert torch.equal(b[:, : a.shape[1]], a)


def test_flush_happens_before_attention():
    """The token that fills the residual is attended in its quantized form (Alg. 1 order)."""
    m, t = tiny(), 2000
    kv = new_kv(m, "minikv")
    drive(m, kv, prompt(t, seed=2), 512, n_decode=119, tokens=[7] * 119)
    st = kv.layers[0].kivi
    captured = {}
    inner = st.partials

    def spy(q, q_pos, n_new, window):
        captured["body"], captured["tail"] = st.body_len, st.tail_len
        return inner(q, q_pos, n_new, window)

    st.partials = spy
    drive(m, kv, [], 1, n_decode=1, tokens=[7])
    assert captured == {"body": 1120, "tail": 0}


# --- 10. bytes ---------------------------------------------------------------------------------
def test_bytes_equal_formula():
    m, t, e, d = tiny(), 2000, 4, 32
    kv = new_kv(m, "minikv")
    drive(m, kv, prompt(t, seed=2), 512, n_decode=30, tokens=[5] * 30)
    n_keep, n_gen = 1000, 30
    n_r = (n_keep % 16 + n_gen) % 128
    n_q = n_keep + n_gen - n_r
    per_layer = HKV * d * (n_q * (Fraction(1, 2) + Fraction(e, 4)) + 2 * e * n_r)
    assert kv.nbytes() == 3 * per_layer
    dense = new_kv(m, "minikv:quant=none")
    drive(m, dense, prompt(t, seed=2), 512, n_decode=30, tokens=[5] * 30)
    assert dense.nbytes() == 3 * 2 * e * HKV * d * (n_keep + n_gen)


def test_worked_example_64_mib():
    """LLaMA-3-8B shape, t = 4096, uniform 25% + 25%: 2048 kept per layer -> 64 MiB in fp16."""
    st = KiviLayer(8, 128, 2, 16, 128, torch.float16, "cpu")
    st.append(torch.randn(8, 2048, 128, dtype=torch.float16), torch.randn(8, 2048, 128).half())
    st.flush(16)
    assert 32 * st.nbytes() == 64 * 2**20


def test_report_paper_and_describe():
    m = tiny()
    kv = new_kv(m, "minikv:report=paper")
    drive(m, kv, prompt(400), 128)
    d = kv.describe()
    assert d["method"] == "minikv" and "budget" not in d
    assert d["bytes_paper"] == 3 * 200 * 4 * 32  # layers x kept x Hq x D (one byte each)
    assert new_kv(m, "minikv", "0.3").describe()["budget"] == 0.3


def test_later_turn_compresses_only_the_new_tokens():
    m = tiny()
    kv = new_kv(m, "minikv")
    drive(m, kv, prompt(400, seed=1), 128, n_decode=5, tokens=[3] * 5)
    first = [x.clone() for x in kv.layers[2].kivi.body()]
    kept1 = kv.kept_counts()[0]
    drive(m, kv, prompt(200, seed=3), 128, n_decode=2, tokens=[3] * 2)
    assert kv.kept_counts() == [kept1 + 100 + 2] * 3  # the new turn: 50 heavy + 50 recent
    after = kv.layers[2].kivi.body()
    assert torch.equal(after[3][:, : first[3].shape[1]], first[3])


def test_triton_colsum_needs_cuda():
    from kvrun.errors import KvrunError

    with pytest.raises(KvrunError, match="needs a CUDA GPU"):
        new_kv(tiny(), "minikv:colsum=triton")


# --- end to end on the default model -----------------------------------------------------------
KEY = 49595


@pytest.fixture(scope="module")
def passkey_late(default_runtime, tmp_path_factory):
    """~2,000 tokens with the key at 90% depth. MiniKV's recent window is the last 25% of
    the prompt; its heavy hitters (cumulative attention, unnormalised as the paper has it)
    do not keep a mid-prompt key on this model at 0.5, nor do H2O's: see bench/README.md."""
    path = tmp_path_factory.mktemp("passkey") / "late.txt"
    path.write_text(passkey_prompt(default_runtime.tokenizer, 2000, 0.9, KEY, seed=2))
    return path


@pytest.mark.parametrize("kv", ["minikv", "minikv-pyramid"])
def test_passkey_through_cli(default_gguf, passkey_late, kv):
    args = ["generate", "-m", str(default_gguf), "--raw", "-f", str(passkey_late), "-n", "8",
            "--temp", "0", "--kv", kv, "--json"]  # fmt: skip
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] > 1900
    assert answer_matches(out["text"], KEY), out["text"]
    assert out["kv"]["method"] == kv
    # half the prompt kept at 2-bit codes plus f16 scales and zeros a group of 16 (4 bits an
    # element: a quarter of `full`'s f16 K and V) and a < 16 + 8 token float32 residual (the
    # model's dtype): about 0.5 / 4 + 0.02 of f16 K and V
    assert 0.12 < out["kv_bytes"] / out["kv_bytes_full"] < 0.16


@pytest.mark.parametrize(
    "kv, needle",
    [("minikv+kivi4", "own store"), ("minikv:quant=kivi3", "quant"),
     ("minikv:group=8", "multiple of 16"), ("minikv:heavy=2", "out of range")],
)  # fmt: skip
def test_bad_minikv_options_are_one_line(default_gguf, kv, needle):
    r = CliRunner().invoke(cli, ["generate", "-m", str(default_gguf), "-p", "hi", "--kv", kv])
    one_error_line(r, needle)
