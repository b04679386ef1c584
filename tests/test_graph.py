"""CUDA-graph decode (kvrun/run/graph.py): the static decode step equals the dynamic one.

On CPU the static step runs without capture (graph="static"), through the torch reference and,
with KVRUN_KERNELS=triton, through the interpreted split-K kernel over the whole capacity with
the length as a tensor. The captured graph itself needs a GPU (skipped, with the reason).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kv_methods import config, new_kv, prompt, random_transformer, tiny

from kvrun.errors import KvrunError
from kvrun.kv.stores.dense import DenseSeg
from kvrun.kv.stores.kivi import KiviLayer
from kvrun.models import fused_decode
from kvrun.run.graph import ROUND
from kvrun.run.session import Session

pytestmark = pytest.mark.usefixtures("one_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: graphs need one")


def run(model, graph: str, turns, n_decode: int, spec: str = "full", ubatch: int = 64):
    """Logits of every decode step over chat-like turns (prefill, greedy decode, next turn)."""
    kv = new_kv(model, spec) if model.device.type == "cpu" else _kv_on(model, spec)
    sess = Session(model, None, kv, ubatch=ubatch, graph=graph)
    out = []
    for ids in turns:
        logits = sess.prefill(ids)
        sess.prepare_decode(n_decode)
        for _ in range(n_decode):
            logits = sess.decode(int(logits.argmax()))
            out.append(logits.float().cpu())
    return torch.stack(out), sess


def _kv_on(model, spec):
    from kvrun.kv import build, check

    return build(check(spec), model.config, model.rope, model.device, model.dtype)


STATIC = ["full", "kivi2:residual=32", "kivi4", "minikv:residual=32", "snapkv+kivi2:residual=32",
          "xkv+kivi2:residual=32", "snapkv", "pyramidkv", "xkv", "minikv:quant=none"]  # fmt: skip


@pytest.mark.parametrize("spec", STATIC)
def test_static_step_equals_dynamic_step(monkeypatch, spec):
    """Two turns with decode steps across KIVI flushes (recaptures) and MiniKV's eager
    flush-before-attention steps."""
    m = tiny()
    turns = [prompt(200, seed=1), prompt(37, seed=2)]
    n = 40 if "residual=32" in spec else 12
    ref, _ = run(m, "off", turns, n, spec)
    calls = []
    for cls in (KiviLayer, DenseSeg):
        real = cls.attend_static
        monkeypatch.setattr(cls, "attend_static", lambda *a, f=real: calls.append(1) or f(*a))
    got, sess = run(m, "static", turns, n, spec)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert sess.kv.static and sess.graph_mode == "static"
    if spec == "full":
        assert sess.kv.capacity % ROUND == 0
    else:  # most steps went through the static segment step, in every layer
        assert len(calls) >= 0.75 * 2 * n * m.config.n_layers


def test_static_step_grows_past_its_capacity():
    m = tiny()
    turns = [prompt(250, seed=3)]  # the first capacity is 256: decoding crosses it
    ref, _ = run(m, "off", turns, 20)
    sess_out, sess = run(m, "static", turns, 20)
    torch.testing.assert_close(sess_out, ref, rtol=1e-5, atol=1e-5)
    assert sess.kv.capacity >= 270


@pytest.mark.parametrize("spec", ["full", "kivi2:residual=32", "snapkv"])
def test_static_step_through_the_triton_kernels(monkeypatch, spec):
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    monkeypatch.setenv("KVRUN_KERNELS", "triton")
    m = tiny()
    turns = [prompt(70, seed=4)]
    got, _ = run(m, "static", turns, 3, spec)
    monkeypatch.setenv("KVRUN_KERNELS", "torch")
    ref, _ = run(m, "off", turns, 3, spec)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_reset_keeps_the_buffers_and_the_next_sequence_is_exact():
    m = tiny()
    ref_a, _ = run(m, "off", [prompt(40, seed=5)], 5)
    ref_b, _ = run(m, "off", [prompt(90, seed=6)], 5)
    kv = new_kv(m, "full")
    sess = Session(m, None, kv, ubatch=32, graph="static")
    got = []
    for ids in (prompt(40, seed=5), prompt(90, seed=6)):
        sess.reset()
        logits = sess.prefill(ids)
        steps = []
        for _ in range(5):
            logits = sess.decode(int(logits.argmax()))
            steps.append(logits)
        got.append(torch.stack(steps))
    torch.testing.assert_close(got[0], ref_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref_b, rtol=1e-5, atol=1e-5)


class HostReads:
    """Fail on any tensor value read back to Python (what a CUDA graph cannot capture): the
    CPU stand-in for CUDA's sync debug mode."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.mp = monkeypatch

    def __enter__(self):
        # on CUDA a one-row norm is F.rms_norm; the CPU form reads its sum of squares back
        self.mp.setattr(fused_decode, "READ_BACK", ())
        for name in self.NAMES:
            self.mp.setattr(torch.Tensor, name, self._fail(name))
        return self

    def __exit__(self, *exc):
        self.mp.undo()

    @staticmethod
    def _fail(name):
        def read(*a, **k):
            raise AssertionError(f"the static decode step read a tensor value (Tensor.{name})")

        return read


@pytest.mark.parametrize(
    "spec",
    ["full", "kivi2:residual=32", "minikv:residual=32", "xkv+kivi2", "snapkv", "minikv:quant=none"],
)
def test_static_step_reads_no_tensor_value(monkeypatch, spec):
    m = tiny()
    sess = Session(m, None, new_kv(m, spec), ubatch=64, graph="static")
    logits = sess.prefill(prompt(100, seed=12))
    sess.prepare_decode(8)
    tok = int(logits.argmax())
    g = sess.graph
    for p in (100, 101):
        with torch.inference_mode():
            g.ready(p)
            g.tok.fill_(tok)
            g.pos.fill_(p)
            assert sess.kv.static_step_ok()
            with HostReads(monkeypatch):
                out = g._forward()  # the step a graph captures
            sess.kv.after_static_step()
        sess.kv.end_step()
        sess.tokens.append(tok)
        tok = int(out.argmax())


@pytest.mark.parametrize(
    "spec,why",
    [("h2o", "evicts at every decode step"), ("streaming", "evicts at every decode step"),
     ("minicache", "no static decode form"), ("spindlekv", "no static decode form")],
)  # fmt: skip
def test_methods_without_a_static_form_decode_eagerly(spec, why):
    m = tiny()
    sess = Session(m, None, new_kv(m, spec), graph="static")
    assert sess.graph_mode == "off" and why in sess.graph_note


def test_sliding_window_models_decode_eagerly():
    c = dataclasses.replace(config(), sliding_window=16)
    mw = random_transformer(c, 7)
    for spec in ("full", "kivi2", "snapkv"):
        sess = Session(mw, None, new_kv(mw, spec), graph="static")
        assert sess.graph_mode == "off" and "sliding-window" in sess.graph_note


def test_graph_on_needs_cuda():
    m = tiny()
    with pytest.raises(KvrunError, match="CUDA device"):
        Session(m, None, new_kv(m, "full"), graph="on")


def test_rope_bound_gives_the_same_rotation():
    m = tiny()
    x = torch.randn(1, 2, 3, m.config.head_dim)
    pos = torch.tensor([5, 600, 1000])
    a = m.rope.apply(x, pos)
    b = m.rope.apply(x, pos, bound=2048)
    torch.testing.assert_close(a, b)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["full", "kivi2:residual=32", "minikv:residual=32"])
def test_captured_graph_equals_eager_decode(dtype, spec):
    c = config()
    m = random_transformer(c, 11).to(device="cuda", dtype=dtype)
    m.rope = type(m.rope)(m.rope.inv_freq, torch.device("cuda"), dtype)
    turns = [prompt(300, seed=8), prompt(20, seed=9)]
    ref, _ = run(m, "off", turns, 40, spec)
    got, sess = run(m, "on", turns, 40, spec)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got, ref, **tol)
    assert sess.graph.graph is not None  # the steps replayed a captured graph
