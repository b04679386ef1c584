"""CUDA-graph decode of a batch (kvrun.run.graph.BatchGraph, `--parallel N --cuda-graph`): the
static batched step, padded to its bucket, equals the eager batched step, and the engine
replays a captured step only for the members it was captured over.

On CPU the static step runs uncaptured; a stand-in for capture (a "graph" that re-runs the
step it was captured from, over that capture's rows and inputs) checks which step a replay
runs. The captured graph itself needs a GPU (skipped, with the reason).
"""

from __future__ import annotations

import pytest
import torch
from test_engine import GREEDY, tiny, tiny_rt  # noqa: F401 - module fixtures
from test_graph import HostReads, _kv_on
from test_kv_methods import config as tiny_config
from test_kv_methods import new_kv, prompt, random_transformer
from test_kv_methods import tiny as tiny_model

import kvrun.run.graph
import tiny_models
from kvrun.kv import check
from kvrun.run.engine import Engine, Request
from kvrun.run.graph import BatchGraph, bucket
from kvrun.run.session import Session

pytestmark = pytest.mark.usefixtures("one_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: graphs need one")

LENS = [150, 60, 97]  # three sequences: a bucket of 4 with one padding row
SPECS = ["full", "kivi2:residual=32", "minikv:residual=32", "snapkv", "xkv+kivi2:residual=32",
         "minikv:quant=none"]  # fmt: skip


def decode_rows(model, spec: str, graph: BatchGraph | None, n: int = 40):
    """Logits (n, B, V) of n batched greedy decode steps after prefilling LENS prompts."""
    mode = "off" if graph is None else "static"
    sess = [
        Session(
            model,
            None,
            new_kv(model, spec) if model.device.type == "cpu" else _kv_on(model, spec),
            ubatch=64,
            graph=mode,
        )
        for _ in LENS
    ]
    toks = prefill(sess)
    out = []
    for _ in range(n):
        logits = Session.decode_batch(sess, toks, graph)
        out.append(logits.float().cpu())
        toks = logits.argmax(-1).tolist()
    return torch.stack(out)


def prefill(sessions) -> list[int]:
    """Prefill LENS prompts, one per session; the greedy first tokens."""
    return [
        int(s.prefill(prompt(k, seed=i)).argmax())
        for i, (s, k) in enumerate(zip(sessions, LENS, strict=True))
    ]


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 24, 32]  # fmt: skip


@pytest.mark.parametrize("spec", SPECS)
def test_batched_static_step_equals_the_eager_batch(spec):
    """Three sequences of different lengths, 40 steps: across KIVI flushes (recaptures),
    MiniKV's eager flush-before-attention steps, and a padding row in every static step."""
    m = tiny_model()
    ref = decode_rows(m, spec, None)
    g = BatchGraph(m, m.config.context_length, capture=False)
    got = decode_rows(m, spec, g)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert g.static_steps + g.eager_steps == 40
    assert g.static_steps >= 30  # MiniKV's flush steps (one per residual per member) are eager
    assert g.pad is not None and g.pad.seen == 0  # padding rows never advance


def test_batched_static_step_reads_no_tensor_value(monkeypatch):
    m = tiny_model()
    sess = [Session(m, None, new_kv(m, "kivi2:residual=32"), graph="static") for _ in LENS]
    toks = prefill(sess)
    g = BatchGraph(m, m.config.context_length, capture=False)
    with torch.inference_mode():
        rows, forward = g._static([s.kv for s in sess], toks, [len(s.tokens) for s in sess])
        assert len(rows) == 4
        with HostReads(monkeypatch):
            forward()  # the step a graph captures


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: a replay re-runs the step it was captured
    from (that capture's rows and input tensors) and writes the captured output in place."""

    def __init__(self, forward):
        self.forward = forward
        self.out = forward()

    def replay(self):
        self.out.copy_(self.forward())


def fake_capture(forward, warmup):
    g = FakeGraph(forward)
    return g, g.out


def run_engine(rt, spec: str, graph: str, capture: bool = False, n_docs: int = 7, mixed=None):
    sessions = [Session(rt.model, rt.tokenizer, rt.new_kv(check(spec)), ubatch=64, graph=graph)
                for _ in range(3)]  # fmt: skip
    eng = Engine(sessions)
    if eng.graph is not None:
        eng.graph.capture = capture
    reqs = []
    for i in range(n_docs):
        ids = rt.tokenizer.encode(f"Doc {i}. " + tiny_models.TEXT * (1 + i % 3))
        new = (lambda: rt.new_kv(check(mixed))) if mixed and i == 2 else None
        reqs.append(Request(ids, 10 + 3 * i, GREEDY, 0, i, new_kv=new))
    got = {}
    for req, result, error in eng.results(reqs):
        assert error is None, error
        got[req.tag] = result.tokens
    return got, eng


@pytest.mark.parametrize("spec", ["full", "kivi2:residual=16,group=16", "snapkv"])
def test_engine_replays_a_step_only_for_its_members(tiny_rt, monkeypatch, spec):  # noqa: F811
    """Seven documents through three slots with stand-in captures: every replay runs the step
    of its own members (a replay of another batch's step would give that batch's tokens)."""
    monkeypatch.setattr(kvrun.run.graph, "capture_graph", fake_capture)
    want, _ = run_engine(tiny_rt, spec, "off")
    got, eng = run_engine(tiny_rt, spec, "static", capture=True)
    assert got == want
    g, st = eng.graph, eng.stats
    assert g.eager_steps == 0 and st.graph_steps == st.decode_steps
    assert 0 < g.captures < st.graph_steps / 2  # steps replayed graphs captured before
    if spec == "full":  # slots keep their buffers: a member set seen before is not recaptured
        again, eng2 = run_engine(tiny_rt, spec, "static", capture=True, n_docs=14)
        assert eng2.graph.captures < 2 * g.captures


def test_a_member_set_is_captured_on_its_second_step_in_a_row(monkeypatch):
    """Sets that change at every step (continuous batching's churn) are not captured; a set
    that decodes twice in a row is, and is then replayed when it comes back."""
    monkeypatch.setattr(kvrun.run.graph, "capture_graph", fake_capture)
    m = tiny_model()
    sess = [Session(m, None, new_kv(m, "full"), graph="static") for _ in LENS]
    toks = prefill(sess)
    g = BatchGraph(m, m.config.context_length, capture=True)
    pairs, trio = (sess[:2], sess[1:]), sess
    for i in range(4):  # two sets, alternating
        Session.decode_batch(pairs[i % 2], [toks[0]] * 2, g)
    assert g.captures == 0 and g.static_steps == 4
    for _ in range(3):
        Session.decode_batch(trio, toks, g)
    assert g.captures == 1 and len(g.graphs) == 1
    Session.decode_batch(pairs[0], [toks[0]] * 2, g)
    Session.decode_batch(trio, toks, g)  # back: replayed, not recaptured
    assert g.captures == 1


def test_a_member_without_a_static_form_makes_the_step_eager(tiny_rt, monkeypatch):  # noqa: F811
    """A request with its own h2o cache (as a needle grid mixes methods) in a graph batch: the
    steps it is in run eagerly, the others replay, and every document's tokens are kept."""
    monkeypatch.setattr(kvrun.run.graph, "capture_graph", fake_capture)
    want, _ = run_engine(tiny_rt, "full", "off", mixed="h2o")
    got, eng = run_engine(tiny_rt, "full", "static", capture=True, mixed="h2o")
    assert got == want
    assert eng.graph.eager_steps > 0 and eng.graph.static_steps > 0


def test_methods_without_a_static_form_batch_eagerly(tiny_rt):  # noqa: F811
    got, eng = run_engine(tiny_rt, "h2o", "static")
    assert eng.graph is None and eng.stats.graph_steps == 0
    assert got == run_engine(tiny_rt, "h2o", "off")[0]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["full", "kivi2:residual=32", "minikv:residual=32", "snapkv"])
def test_captured_batch_equals_the_eager_batch(dtype, spec):
    m = random_transformer(tiny_config(), 11).to(device="cuda", dtype=dtype)
    m.rope = type(m.rope)(m.rope.inv_freq, torch.device("cuda"), dtype)
    ref = decode_rows(m, spec, None)
    g = BatchGraph(m, m.config.context_length, capture=True)
    got = decode_rows(m, spec, g)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got, ref, **tol)
    assert g.captures >= 1 and g.static_steps >= 30
