"""The fused decode blocks (kvrun/models/fused_decode.py) against the modules they stand in for.

The loop must do Block.forward's arithmetic op for op, so decode-step logits are compared
bit for bit: one sequence over many steps (KIVI flushes, MiniKV and SnapKV evictions, the
MiniCache merge), and rows of several sequences in one batched step."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from test_packed_default import packed_runtime  # noqa: F401 (module fixture)

from kvrun.kv import check
from kvrun.models import fused_decode
from kvrun.run.session import Session

TEXT = (
    "The lighthouse keeper wrote in his log every evening: the weather, the ships that "
    "passed, the colour of the sea. In the spring of that year a storm broke the lamp. "
)


@contextmanager
def counted(mp):
    """Count the steps that went through the loop."""
    calls = []
    real = fused_decode.blocks

    def blocks(*a, **kw):
        calls.append(a[2].shape)
        return real(*a, **kw)

    mp.setattr(fused_decode, "blocks", blocks)
    yield calls


def run(rt, spec, budget, ids, steps):
    """Prefill ids, then greedy decode steps; the logits of every step."""
    s = Session(rt.model, rt.tokenizer, rt.new_kv(check(spec, budget)), ubatch=64)
    logits = [s.prefill(ids)]
    for _ in range(steps):
        logits.append(s.decode(int(logits[-1].argmax())))
    return torch.stack(logits)


def batched_steps(make_sessions, tokens: list[int], n: int) -> torch.Tensor:
    """n batched greedy decode steps of fresh sessions, from `tokens`: the logits (n, B, V)."""
    sessions, out = make_sessions(), []
    for _ in range(n):
        logits = Session.decode_batch(sessions, tokens)
        tokens = logits.argmax(-1).tolist()
        out.append(logits)
    return torch.stack(out)


def loop_and_modules(m, make_sessions, tokens, n, mp):
    """The batched steps through the fused loop and through the modules, and the loop's calls."""
    with counted(mp) as calls:
        fast = batched_steps(make_sessions, tokens, n)
    m.use_fused_decode = False
    try:
        ref = batched_steps(make_sessions, tokens, n)
    finally:
        m.use_fused_decode = True
    return fast, ref, calls


def test_binds_packed_models_only(packed_runtime, default_runtime):  # noqa: F811
    layers = fused_decode.bind(packed_runtime.model)
    assert layers is not None and len(layers) == packed_runtime.config.n_layers
    if packed_runtime.path_name == "int4":
        assert len(layers[0].qkv.planes) == 1  # Q4_1: one int4 plane a product
    else:  # Q, K and V as one call over their Q4_1 blocks, float32 in and out
        assert layers[0].qkv.codes and layers[0].dt == torch.float32
    assert fused_decode.bind(default_runtime.model) is None  # dense float32 weights
    x = torch.zeros(1, 1, packed_runtime.config.dim)
    assert fused_decode.takes(x, layers)
    assert not fused_decode.takes(torch.zeros(1, 2, x.shape[-1]), layers)  # a prefill chunk
    nine = torch.zeros(9, 1, x.shape[-1])  # beyond the int4 op's decode rows; native: within
    assert fused_decode.takes(nine, layers) == (packed_runtime.path_name == "native")
    assert not fused_decode.takes(x.bfloat16(), layers)


METHODS = [("full", None), ("snapkv", "0.5"), ("kivi2", None), ("minikv", None),
           ("minicache", None), ("h2o", "0.5"), ("xkv+kivi2", "0.5")]  # fmt: skip


PATH_METHODS = [("native", *m) for m in METHODS] + [
    ("int4", *m) for m in [("full", None), ("minikv", None), ("xkv+kivi2", "0.5")]
]


@pytest.mark.parametrize("packed_runtime,spec,budget", PATH_METHODS, indirect=["packed_runtime"])
def test_loop_equals_modules(packed_runtime, spec, budget, monkeypatch):  # noqa: F811
    rt = packed_runtime
    ids = rt.tokenizer.encode(TEXT * 3)[:120]
    m = rt.model
    with counted(monkeypatch) as calls:
        fast = run(rt, spec, budget, ids, 40)
    assert len(calls) == 40  # every decode step took the loop, no prefill chunk did
    m.use_fused_decode = False
    try:
        ref = run(rt, spec, budget, ids, 40)
    finally:
        m.use_fused_decode = True
    assert torch.equal(fast, ref)


def test_batched_rows_equal_modules(packed_runtime, monkeypatch):  # noqa: F811
    """Three sequences at different lengths and methods decode as rows of one step."""
    rt = packed_runtime
    m = rt.model
    texts = [TEXT, TEXT * 2, "Once upon a time " * 5]
    specs = [("full", None), ("snapkv", "0.5"), ("kivi2", None)]

    def sessions():
        out = []
        for text, (spec, budget) in zip(texts, specs, strict=True):
            s = Session(m, rt.tokenizer, rt.new_kv(check(spec, budget)), ubatch=64)
            s.prefill(rt.tokenizer.encode(text))
            out.append(s)
        return out

    fast, ref, calls = loop_and_modules(m, sessions, [5, 6, 7], 20, monkeypatch)
    assert len(calls) == 20 and calls[0][0] == 3
    assert torch.equal(fast, ref)


def test_norm_of_a_row_is_the_same_alone_and_among_others():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(576, generator=g)
    for b in (2, 3, 8):
        x = torch.randn(b, 1, 576, generator=g) * torch.rand(b, 1, 1, generator=g) * 10
        both = fused_decode.rms_norm(x, w, 1e-5)
        for i in range(b):
            assert torch.equal(both[i], fused_decode.rms_norm(x[i : i + 1], w, 1e-5)[0])
        ref = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
        torch.testing.assert_close(both, ref, rtol=1e-6, atol=1e-6)
        out = torch.empty(b, 1, 576, dtype=torch.bfloat16)
        assert torch.equal(fused_decode.rms_norm(x, w, 1e-5, out=out), both.bfloat16())


def test_batched_rows_equal_each_sequence_alone(packed_runtime):  # noqa: F811
    """The property `--parallel N` rests on: a sequence's logits in a batched step are those
    of its own step, bit for bit (the batch's int4 products and norms are row-wise)."""
    rt = packed_runtime
    texts = [TEXT, TEXT * 2, "Once upon a time " * 5]

    def sessions():
        out = []
        for text in texts:
            s = Session(rt.model, rt.tokenizer, rt.new_kv(check("full", None)), ubatch=64)
            s.prefill(rt.tokenizer.encode(text))
            out.append(s)
        return out

    forced = [[5 + 7 * i + j for j in range(3)] for i in range(12)]  # (steps, B) tokens
    together = sessions()
    batched = torch.stack([Session.decode_batch(together, toks) for toks in forced])
    for j, s in enumerate(sessions()):
        alone = torch.stack([s.decode(toks[j]) for toks in forced])
        assert torch.equal(batched[:, j], alone)


@pytest.mark.parametrize("packed_runtime", ["native"], indirect=True)
def test_wide_native_batch_equals_modules(packed_runtime, monkeypatch):  # noqa: F811
    """Native products take a batch wider than a decode step's 8 rows through the loop too (up
    to the native rows), bit for bit as the modules do."""
    from kvrun.quant import blocks

    monkeypatch.setattr(blocks, "native_rows", lambda: 16)
    rt, m = packed_runtime, packed_runtime.model
    ids = [rt.tokenizer.encode(f"Story {i}: " + TEXT[: 40 + 7 * i]) for i in range(10)]

    def sessions():
        out = [Session(m, rt.tokenizer, rt.new_kv(), ubatch=64) for _ in ids]
        for s, x in zip(out, ids, strict=True):
            s.prefill(x)
        return out

    fast, ref, calls = loop_and_modules(m, sessions, list(range(5, 15)), 6, monkeypatch)
    assert len(calls) == 6 and calls[0][0] == 10
    assert torch.equal(fast, ref)
