"""The default model (Q4_1 layers, Q8_0 embeddings) with packed weights against the dense path.

`--wtype auto` keeps a GGUF's quantized tensors packed: in their own GGUF blocks through the
native CPU kernels where they build (kvrun/quant/native.py), else through PyTorch's int4 op
where it serves decode steps, or where dense weights would not fit. The tests force that
decision and run both paths ("native" and "int4", the latter as without a compiler), so they
check each packed model whatever this machine measures.

The two paths round activations differently in the products that are not exact: the int4 op
to bfloat16, the native kernels to 8 bits per block of 32 as llama.cpp does (q8_0 / q8_1),
about twice bfloat16's error. Their bounds against the dense float32 model differ by that.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_default_model import PROMPTS

from kvrun.kv import check
from kvrun.quant import blocks as blocks_mod
from kvrun.quant import choice as matmul_choice
from kvrun.quant import linear as packed_mod
from kvrun.quant import native
from kvrun.quant.blocks import BlockEmbedding, BlockLinear
from kvrun.quant.linear import DECODE_ROWS, PackedEmbedding, PackedLinear
from kvrun.run.sampling import SamplingConfig
from kvrun.run.session import Session
from kvrun.tasks.perplexity import score_window

# per path: the most KL (nats) of one decode step's next-token distribution against the dense
# model's, the mean over a perplexity window's decode steps, perplexity's relative change over
# those steps, and the gap of the dense top two logits below which a greedy token may flip.
# Measured on a 2-core EPYC: int4 max 3.7e-3, mean 4.1e-4, +0.07 %; native (8-bit activations,
# as llama.cpp: +0.96 % perplexity on this model's Q8_0 file) max 2.0e-2, mean 1.9e-3, +1.1 %.
BOUNDS = {"int4": (1e-2, 1e-3, 0.005, 0.2), "native": (5e-2, 5e-3, 0.02, 0.5)}


@pytest.fixture(scope="module", params=["native", "int4"])
def packed_runtime(request, default_gguf):
    from kvrun.run.runtime import load_runtime

    if request.param == "native" and native.ops() is None:
        pytest.skip(f"native kernels unavailable: {native.note()}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matmul_choice, "auto_wtype", lambda *a: ("packed", "forced by the test"))
        if request.param == "int4":
            mp.setattr(native, "ops", lambda: None)
        rt = load_runtime(str(default_gguf), "float32", "cpu", log=lambda m: None, wtype="auto")
    assert rt.weights.wtype == "packed"
    rt.path_name = request.param
    return rt


def _pin_rows(monkeypatch, rows: int) -> None:
    """Products of more rows than this take the exact path (int4 op or native kernels)."""
    monkeypatch.setattr(packed_mod, "int4_op_rows", lambda dtype: rows)
    monkeypatch.setattr(blocks_mod, "native_rows", lambda: rows)


def test_auto_keeps_the_file_types(packed_runtime):
    m = packed_runtime.model
    up = m.model.layers[0].mlp.gate_up  # gate and up stacked into one packed layer
    emb = m.model.embed_tokens
    if packed_runtime.path_name == "native":
        assert isinstance(up, BlockLinear) and up.types == ["Q4_1", "Q4_1"] and all(up.x8s)
        assert isinstance(emb, BlockEmbedding) and emb.types == ["Q8_0"]
    else:
        assert isinstance(up, PackedLinear) and (up.bits, up.source) == (4, "Q4_1")
        assert isinstance(emb, PackedEmbedding) and (emb.bits, emb.source) == (8, "Q8_0")
    assert m.model.layers[0].mlp.up_proj is None
    assert m.lm_head is None  # tied: the head multiplies by the packed table
    from kvrun.tasks.bench import weight_bytes

    # about the file's size (98 MB; the native layout adds nothing for Q4_1 / Q8_0, the CPU
    # int4 planes add bf16 scales and zeros, 4 bytes per group of 32), under a quarter of the
    # dense float32 model (538 MB)
    size = packed_runtime.path.stat().st_size
    assert weight_bytes(m) < (1.1 if packed_runtime.path_name == "native" else 1.25) * size
    assert weight_bytes(m) < 0.25 * packed_runtime.config.n_params() * 4
    # and `kvrun info` (metadata only) predicts the bytes the loaded model holds
    from kvrun.tasks.info import inspect, weights_rows

    cfg, facts = inspect(packed_runtime.path)
    native_here = packed_runtime.path_name == "native"
    rows = weights_rows(facts, "auto", True, cfg.tie_embeddings, native=native_here)
    assert rows["packed"]["bytes"] == weight_bytes(m)


def test_prefill_logits_match_dense(packed_runtime, default_runtime, monkeypatch):
    text = PROMPTS[2] + " The sea is wide and 12345 waves roll in, again and again."
    ids = default_runtime.tokenizer.encode(text)
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        want = default_runtime.model(torch.tensor([ids]), pos, default_runtime.new_kv())
        # a chunk longer than the fast products take (pinned here: the crossover is measured)
        _pin_rows(monkeypatch, DECODE_ROWS)
        got = packed_runtime.model(torch.tensor([ids]), pos, packed_runtime.new_kv())
        # and one within it (the crossover measured on a quiet 2-core EPYC: 96 rows)
        _pin_rows(monkeypatch, 96)
        short = packed_runtime.model(torch.tensor([ids]), pos, packed_runtime.new_kv())
    # exact mappings: the same weights, the same float32 products
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    # a short prompt (within the crossover) goes through the fast products as decode steps
    # do: the last row's next-token distribution stays within the decode steps' KL bound of
    # the dense one, and the first token is the same
    assert len(ids) <= 96
    lp, lq = want[0, -1].log_softmax(-1), short[0, -1].float().log_softmax(-1)
    assert (lp.exp() * (lp - lq)).sum() < BOUNDS[packed_runtime.path_name][0]
    top2 = want[0, -1].topk(2).values
    gap = BOUNDS[packed_runtime.path_name][3]
    assert short[0, -1].argmax() == want[0, -1].argmax() or top2[0] - top2[1] < gap


def _greedy_logits(rt, prompt: str, n: int, forced: list[int] | None = None):
    """Logits (n, V) of n greedy steps (or of the steps feeding `forced` tokens) and the tokens."""
    s = Session(rt.model, rt.tokenizer, rt.new_kv())
    logits = [s.prefill(rt.tokenizer.encode(prompt))]
    tokens = []
    for i in range(n):
        tokens.append(forced[i] if forced else int(logits[-1].argmax()))
        if i + 1 < n:
            logits.append(s.decode(tokens[-1]))
    return torch.stack(logits).float(), tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_follows_dense(packed_runtime, default_runtime, prompt):
    """32 greedy tokens. Decode steps multiply on rounded activations (bfloat16 for the int4
    op, 8 bits per block natively), so a near-tie may flip: the packed model is fed the dense
    path's tokens, and at every step the KL between the two next-token distributions stays
    within the path's bound; where the argmax differs, the dense path's top two logits were
    within the path's gap of each other (the KL is reported)."""
    with torch.inference_mode():
        want, tokens = _greedy_logits(default_runtime, prompt, 32)
        got, _ = _greedy_logits(packed_runtime, prompt, 32, forced=tokens)
    lp, lq = want.log_softmax(-1), got.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)  # (32,) KL(dense || packed) per step
    flips = (got.argmax(-1) != want.argmax(-1)).nonzero().flatten().tolist()
    report = ", ".join(f"step {i}: KL {kl[i]:.2e}" for i in flips) or "no token differs"
    print(f"{prompt[:20]!r}: max KL {kl.max():.2e}; {report}")
    most, _, _, gap = BOUNDS[packed_runtime.path_name]
    assert kl.max() < most, report
    for i in flips:
        top2 = want[i].topk(2).values
        assert top2[0] - top2[1] < gap, report


def test_perplexity_within_half_a_percent(packed_runtime, default_runtime):
    from pathlib import Path

    text = Path("/usr/share/common-licenses/GPL-3")
    src = text.read_text() if text.exists() else " ".join(PROMPTS) * 40
    ids = default_runtime.tokenizer.encode(src)[:640]
    tok = packed_runtime.tokenizer
    method = Session(packed_runtime.model, tok, packed_runtime.new_kv(), ubatch=256)
    ref = Session(default_runtime.model, tok, default_runtime.new_kv(), ubatch=256)
    sc = score_window(method, ref, ids, context=512)
    ppl = math.exp(sum(sc.nll) / len(sc.nll))
    ppl_ref = math.exp(sum(sc.nll_full) / len(sc.nll_full))
    most, mean, rel, _ = BOUNDS[packed_runtime.path_name]
    print(f"{packed_runtime.path_name}: ppl {ppl:.4f} vs {ppl_ref:.4f}, KL mean "
          f"{sum(sc.kl) / len(sc.kl):.2e} max {max(sc.kl):.2e}")  # fmt: skip
    assert abs(ppl / ppl_ref - 1) < rel
    # teacher-forced decode steps go through the fast products (rounded activations, the
    # head's top logits refined exactly): small per-token KL against the float32 path
    assert sum(sc.kl) / len(sc.kl) < mean and max(sc.kl) < most


METHODS = [("full", None), ("streaming", "0.25"), ("h2o", "0.25"), ("snapkv", "0.25"),
           ("pyramidkv", "0.25"), ("xkv", "0.25"), ("minikv", None), ("minikv-pyramid", None),
           ("minicache", None), ("spindlekv", "0.25"), ("kivi2", None), ("kivi4", None),
           ("snapkv+kivi2", "0.25"), ("minicache+kivi4", None), ("xkv+kivi2", "0.25")]  # fmt: skip


# every method on the default path; the int4 op's path (no compiler) on a spread of them
INT4_METHODS = [("full", None), ("snapkv", "0.25"), ("minikv", None), ("minicache", None),
                ("kivi2", None), ("xkv+kivi2", "0.25")]  # fmt: skip
PATH_METHODS = [("native", *m) for m in METHODS] + [("int4", *m) for m in INT4_METHODS]


@pytest.mark.parametrize("packed_runtime,spec,budget", PATH_METHODS, indirect=["packed_runtime"])
def test_every_kv_method_runs_on_packed_weights(
    packed_runtime, default_runtime, spec, budget, monkeypatch
):
    """Each named method and seed stack through prefill (exact products: the same first token,
    the same compression decisions and bytes as on dense weights), then decode (int4 op or
    native kernels)."""
    from pathlib import Path

    text = Path("/usr/share/common-licenses/GPL-3")
    src = text.read_text()[:3000] if text.exists() else " ".join(PROMPTS) * 20
    ids = default_runtime.tokenizer.encode(src)[:400]
    greedy = SamplingConfig(temp=0)
    # chunks of 128 rows stay exact wherever the fast products' crossover is measured
    _pin_rows(monkeypatch, DECODE_ROWS)
    runs = []
    for rt in (default_runtime, packed_runtime):
        s = Session(rt.model, rt.tokenizer, rt.new_kv(check(spec, budget)), ubatch=128)
        runs.append((s, s.generate(ids, 1, greedy, seed=0)))  # prefill only
    (_, dense), (session, packed) = runs
    assert packed.tokens == dense.tokens
    assert packed.stats.kv_bytes == dense.stats.kv_bytes
    more = session.generate([], 8, greedy, seed=0)  # decode steps on the packed weights
    assert len(more.tokens) == 8 and more.stats.kv_bytes > 0
