"""Batched generation (kvrun.run.engine, `--parallel N`): N sequences at once give what N
sequential runs give, a failing sequence leaves the others alone, memory admission holds a
tiny --kv-mem, and a batch killed mid-run resumes without losing or duplicating documents."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import tiny_models
from kvrun.cli.longdoc import longdoc
from kvrun.cli.main import KvrunGroup
from kvrun.kv import check
from kvrun.run.engine import Engine, EngineStats, Request
from kvrun.run.sampling import SamplingConfig
from kvrun.run.session import Session, Stats

GREEDY = SamplingConfig(temp=0.0)
GROUP = KvrunGroup("kvrun")
GROUP.add_command(longdoc)
TEXT = open("/usr/share/common-licenses/GPL-3").read() if os.path.exists(
    "/usr/share/common-licenses/GPL-3"
) else " ".join(tiny_models.CORPUS) * 200  # fmt: skip


def prompts(tok, n: int) -> list[list[int]]:
    """n prompts of different lengths (about 120 to 330 tokens) from one text."""
    words = TEXT.split()
    return [tok.encode(" ".join(words[i * 70 : i * 70 + 90 + 40 * i])) for i in range(n)]


def sequential(rt, spec, ids_list, n: int) -> list[list[int]]:
    s = Session(rt.model, rt.tokenizer, rt.new_kv(spec), ubatch=128)
    out = []
    for ids in ids_list:
        s.reset()
        out.append(s.generate(ids, n, GREEDY, seed=0).tokens)
    return out


def batched(rt, spec, ids_list, n: int, parallel: int, kv_mem=None):
    sessions = [
        Session(rt.model, rt.tokenizer, rt.new_kv(spec), ubatch=128) for _ in range(parallel)
    ]
    got, errors = {}, {}

    def finish(req, result, error):
        if error is not None:
            errors[req.tag] = error
        else:
            got[req.tag] = result.tokens

    reqs = [Request(ids, n, GREEDY, 0, i) for i, ids in enumerate(ids_list)]
    stats = Engine(sessions, kv_mem).run(reqs, finish)
    return got, errors, stats


@pytest.mark.parametrize("method", ["full", "snapkv", "kivi2", "minikv", "minicache"])
def test_parallel_equals_sequential_on_the_default_model(default_runtime, one_thread, method):
    """Five prompts through three slots (continuous batching: slots are reused) give each
    prompt's sequential greedy tokens."""
    rt = default_runtime
    spec = check(method)
    ids = prompts(rt.tokenizer, 5)
    want = sequential(rt, spec, ids, 12)
    got, errors, stats = batched(rt, spec, ids, 12, parallel=3)
    assert not errors
    assert stats.max_active == 3 and stats.sequences == 5
    assert stats.decode_steps < sum(len(t) for t in want)  # steps were shared
    for i, w in enumerate(want):
        assert got[i] == w, (method, i)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models.build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_rt(tiny):
    from kvrun.run.runtime import load_runtime

    return load_runtime(str(tiny.gguf_path), "float32", "cpu", log=lambda m: None)


def test_a_failing_sequence_leaves_the_others_alone(tiny_rt, one_thread):
    """A prompt longer than the context fails in its own prefill; the other sequences of the
    batch produce what they produce alone."""
    rt, spec = tiny_rt, check("snapkv")
    ids = [rt.tokenizer.encode(f"Doc {i}. " + tiny_models.TEXT * (1 + i)) for i in range(4)]
    ids[1] = ids[1] * 400  # over the tiny model's context
    want = sequential(rt, spec, [x for i, x in enumerate(ids) if i != 1], 6)
    got, errors, _ = batched(rt, spec, ids, 6, parallel=3)
    assert list(errors) == [1] and "context" in errors[1]
    assert [got[i] for i in (0, 2, 3)] == want


def test_memory_admission_holds_a_tiny_limit(tiny_rt, one_thread):
    """--kv-mem that fits one sequence's reservation runs them one at a time (same tokens);
    a request that cannot fit even alone fails with a message naming --kv-mem."""
    rt, spec = tiny_rt, check("full")
    ids = [rt.tokenizer.encode(f"Doc {i}. " + tiny_models.TEXT) for i in range(3)]
    per_token = rt.config.kv_bytes_per_token(4)
    one = per_token * (max(len(x) for x in ids) + 6)
    want = sequential(rt, spec, ids, 6)
    got, errors, stats = batched(rt, spec, ids, 6, parallel=3, kv_mem=one)
    assert not errors and stats.max_active == 1
    assert [got[i] for i in range(3)] == want
    assert stats.peak_kv_bytes <= one
    ids.append(rt.tokenizer.encode(tiny_models.TEXT * 8))
    got, errors, _ = batched(rt, spec, ids, 6, parallel=3, kv_mem=one)
    assert list(errors) == [3] and "--kv-mem" in errors[3]
    assert [got[i] for i in range(3)] == want


def test_a_request_that_arrives_mid_batch_joins_it(tiny_rt, one_thread):
    """The engine polls its intake at every step: a request that arrives while another is
    decoding takes the free slot at once and decodes in the same steps; both give their
    sequential tokens."""
    rt, spec = tiny_rt, check("full")
    ids = [rt.tokenizer.encode(f"Doc {i}. " + tiny_models.TEXT) for i in range(2)]
    want = sequential(rt, spec, ids, 12)
    assert len(want[0]) == 12  # the first runs to its limit: it is active when the other comes
    log = []

    def request(i: int) -> Request:
        started = lambda: log.append(("start", i))  # noqa: E731
        token = lambda tok, entry: log.append(("token", i))  # noqa: E731
        return Request(ids[i], 12, GREEDY, 0, i, on_start=started, on_token=token)

    class Arrivals:
        """The first request at once; the second once the first has three tokens."""

        def __init__(self):
            self.late = request(1)
            self.now = [request(0)]

        def poll(self):
            if self.late is not None and log.count(("token", 0)) >= 3:
                self.now.append(self.late)
                self.late = None
            return self.now.pop(0) if self.now else None

    sessions = [Session(rt.model, rt.tokenizer, rt.new_kv(spec), ubatch=128) for _ in range(2)]
    engine = Engine(sessions)
    got = {}
    for req, result, error in engine.results(Arrivals()):
        assert error is None
        got[req.tag] = result.tokens
        log.append(("end", req.tag))
    assert got == {0: want[0], 1: want[1]}
    assert log.index(("start", 1)) < log.index(("end", 0))
    assert log.index(("token", 1)) < log.index(("end", 0))  # decoded beside the first
    assert engine.stats.max_active == 2


def test_the_server_engine_thread_takes_jobs_that_arrive_mid_batch(tiny_rt, one_thread):
    """kvrun serve's engine thread: a job submitted while another decodes (here, from the
    first one's first token) joins the running batch rather than waiting for it to end."""
    import threading

    from kvrun.server.worker import EngineThread, HttpJob, StopText

    rt, spec = tiny_rt, check("full")
    ids = [rt.tokenizer.encode(f"Doc {i}. " + tiny_models.TEXT) for i in range(2)]
    want = sequential(rt, spec, ids, 12)
    jobs = [HttpJob(x, 12, GREEDY, 0, spec, stop=StopText([])) for x in ids]
    ended: dict[int, tuple] = {}
    both = threading.Event()

    class Metrics:
        def ttft(self, seconds: float) -> None:
            if not jobs[1].submitted:  # the first job's first token: the second arrives
                worker.submit(jobs[1])

        def itl(self, seconds: float) -> None:
            pass

        def ended(self, job, result, error) -> None:
            ended[jobs.index(job)] = (time.perf_counter(), result, error)
            if len(ended) == 2:
                both.set()

    def session(rt, kv):
        return Session(rt.model, rt.tokenizer, kv, ubatch=128)

    worker = EngineThread(lambda: rt, 2, None, session, Metrics(), spec)
    worker.start()
    try:
        assert worker.ready.wait(60), worker.load_error
        worker.submit(jobs[0])
        assert both.wait(120)
    finally:
        worker.close()
    assert [ended[i][2] for i in range(2)] == [None, None]
    assert [ended[i][1].tokens for i in range(2)] == want
    assert jobs[1].started < ended[0][0]  # it held a slot while the first still decoded
    assert worker.engine.stats.max_active == 2


def run_cli(*args):
    base = ["longdoc", "--device", "cpu", "--dtype", "float32"]
    return CliRunner().invoke(GROUP, base + list(args), catch_exceptions=False)


def write_docs(path, n: int, bad_at: int | None = None):
    rows = []
    for i in range(n):
        if i == bad_at:
            rows.append({"id": i, "path": str(path.parent / "missing.txt")})
        else:
            rows.append({"id": i, "text": f"Doc {i}. " + tiny_models.TEXT * (1 + i % 3)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def by_id(path) -> dict:
    recs = [json.loads(ln) for ln in path.read_text().splitlines()]
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), "a document was written twice"
    return {r["id"]: r for r in recs}


@pytest.mark.parametrize("method", ["full", "snapkv", "minikv", "minicache"])
def test_longdoc_parallel_matches_sequential(tiny, tmp_path, method):
    src = write_docs(tmp_path / "in.jsonl", 7, bad_at=3)
    outs = {}
    for n in (1, 4):
        dst = tmp_path / f"out{n}.jsonl"
        r = run_cli("--jsonl", str(src), "-o", str(dst), "-q", "Which doc?", "-n", "6",
                    "--kv", method, "--parallel", str(n), "-m", str(tiny.gguf_path))  # fmt: skip
        assert r.exit_code == 1 and "1 of 7 documents failed" in r.stderr
        outs[n] = by_id(dst)
    assert "parallel 4: 6 sequences" in r.stderr and "decode" in r.stderr
    assert sorted(outs[4]) == list(range(7))
    for i, rec in outs[1].items():
        assert outs[4][i]["tokens"] == rec["tokens"] and outs[4][i]["answer"] == rec["answer"]
        assert (outs[4][i]["error"] is None) == (i != 3)


def test_parallel_refuses_bad_options(tiny, tmp_path):
    src = write_docs(tmp_path / "in.jsonl", 2)
    r = run_cli("--jsonl", str(src), "-q", "x", "--kv-mem", "lots", "-m", str(tiny.gguf_path),
                "--parallel", "2")  # fmt: skip
    assert r.exit_code != 0 and "--kv-mem lots" in r.stderr
    r = run_cli("--jsonl", str(src), "-q", "x", "--parallel", "0", "-m", str(tiny.gguf_path))
    assert r.exit_code != 0 and "--parallel" in r.stderr
    r = run_cli("--jsonl", str(src), "-q", "x", "--parallel", "2", "--cuda-graph",
                "-m", str(tiny.gguf_path))  # fmt: skip
    assert r.exit_code != 0 and "--cuda-graph needs a CUDA device" in r.stderr


@pytest.mark.slow  # a subprocess
def test_resume_after_kill_mid_batch(tiny, tmp_path):
    """kill -9 while a --parallel batch runs, then --resume: every document exactly once,
    each answer equal to an uninterrupted sequential run's."""
    src = write_docs(tmp_path / "in.jsonl", 24)
    dst = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "kvrun", "longdoc", "--device", "cpu", "--dtype", "float32",
           "--jsonl", str(src), "-o", str(dst), "-q", "Which doc?", "-n", "40",
           "--parallel", "3", "-m", str(tiny.gguf_path)]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if dst.exists() and dst.read_text().count("\n") >= 1:
            break
        time.sleep(0.05)
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.wait()
    before = dst.read_text().count("\n") if dst.exists() else 0
    r = run_cli("--jsonl", str(src), "-o", str(dst), "-q", "Which doc?", "-n", "40",
                "--parallel", "3", "--resume", "-m", str(tiny.gguf_path))  # fmt: skip
    assert r.exit_code == 0, r.stderr
    got = by_id(dst)
    assert sorted(got) == list(range(24)) and before < 24
    ref = tmp_path / "ref.jsonl"
    run_cli("--jsonl", str(src), "-o", str(ref), "-q", "Which doc?", "-n", "40",
            "-m", str(tiny.gguf_path))  # fmt: skip
    for i, rec in by_id(ref).items():
        assert got[i]["tokens"] == rec["tokens"]


def test_graph_sessions_batch_through_one_batch_graph(tiny_rt):
    """Sessions that asked for a graph (--cuda-graph) decode their batch through the engine's
    BatchGraph (tests/test_graph_batch.py); "static" ones run its steps uncaptured."""
    s = [Session(tiny_rt.model, tiny_rt.tokenizer, tiny_rt.new_kv(check("full")), graph="static")
         for _ in range(2)]  # fmt: skip
    eng = Engine(s)
    assert eng.graph is not None and not eng.graph.capture
    assert (
        Engine([Session(tiny_rt.model, tiny_rt.tokenizer, tiny_rt.new_kv(check("full")))]).graph
        is None
    )


def test_needle_parallel_gives_the_sequential_grid(tiny, tmp_path):
    """--parallel 4 runs a needle grid's trials together; every record (reply, score, bytes)
    and the order of the records are the sequential run's."""
    from kvrun.cli.needle import needle

    group = KvrunGroup("kvrun")
    group.add_command(needle)
    docs = {}
    for n in (1, 4):
        out = tmp_path / f"n{n}.json"
        args = ["needle", "-m", str(tiny.gguf_path), "--json", str(out), "--lengths", "300,450",
                "--depths", "0,50,100", "--kv", "full", "--kv", "snapkv", "--kv", "h2o",
                "--kv-budget", "0.5", "-n", "3", "--parallel", str(n)]  # fmt: skip
        r = CliRunner().invoke(group, args, catch_exceptions=False)
        assert r.exit_code == 0, r.output
        docs[n] = json.loads(out.read_text())
    keys = ("method", "budget", "length", "depth", "key", "reply", "correct", "kv_bytes")
    seq, par = docs[1]["trials"], docs[4]["trials"]
    assert len(seq) == 2 * 3 * 3
    assert [[t[k] for k in keys] for t in par] == [[t[k] for k in keys] for t in seq]


def test_perplexity_windows_in_parallel(default_runtime, one_thread):
    """Four windows scored two at a time in batched decode steps give the sequential
    scores (NLL, KL, agreement) up to the float reordering of a batched product."""
    from kvrun.tasks.perplexity import evaluate, file_tokens

    rt = default_runtime
    tokens = file_tokens(rt.tokenizer, TEXT)

    def pair(method):
        new = lambda kv: Session(rt.model, rt.tokenizer, kv, ubatch=128)  # noqa: E731
        return new(rt.new_kv(check(method))), new(rt.new_kv())

    for method in ("snapkv", "kivi2"):
        seq = evaluate(*pair(method), tokens, 200, 8, windows=4)
        par = evaluate(*pair(method), tokens, 200, 8, windows=4, more=[pair(method)])
        for a, b in zip(seq.windows, par.windows, strict=True):
            assert (a.start, a.kv_bytes) == (b.start, b.kv_bytes)
            assert abs(a.nll - b.nll) < 1e-4 and abs(a.kl - b.kl) < 1e-4 and a.top1 == b.top1


def test_a_sequence_and_the_engine_share_the_rates():
    """Stats and EngineStats take prefill_s, decode_s and the tok/s rates from PhaseStats:
    tokens through each phase per second of it (a sequence's first token is the prefill's)."""
    s = Stats(prompt_tokens=10, generated_tokens=5, prefill_s=2.0, decode_s=1.0)
    assert (s.prefill_tok_s, s.decode_tok_s) == (5.0, 4.0)
    e = EngineStats(prefill_tokens=6, prefill_s=3.0, decode_tokens=8, decode_s=2.0)
    assert (e.prefill_tok_s, e.decode_tok_s) == (2.0, 4.0)
    assert EngineStats().decode_tok_s == Stats().decode_tok_s == 0.0
    keys = ["prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "kv_bytes"]
    assert list(s.as_dict())[:5] == keys  # --json's key order


@pytest.mark.parametrize("method", ["full", "snapkv", "kvzip"])
def test_requests_go_on_from_a_forked_cache(tiny_rt, one_thread, method):
    """Request.start: a document prefilled and compressed once, each question a request on
    its own fork (run together in one batch), gives the tokens of a session that prefilled
    the document and then that question as its next turn."""
    rt, spec = tiny_rt, check(method)
    doc = rt.tokenizer.encode("Doc. " + tiny_models.TEXT * 3)
    questions = [rt.tokenizer.encode(f" Question {i}: what?", add_bos=False) for i in range(3)]
    want = []
    for q in questions:
        s = Session(rt.model, rt.tokenizer, rt.new_kv(spec), ubatch=128)
        s.prefill(doc)
        want.append(s.generate(q, 6, GREEDY, seed=0).tokens)
    base = Session(rt.model, rt.tokenizer, rt.new_kv(spec), ubatch=128)
    base.prefill(doc)
    held = base.kv.nbytes()
    sessions = [Session(rt.model, rt.tokenizer, rt.new_kv(spec), ubatch=128) for _ in range(2)]
    got = {}
    reqs = [
        Request(q, 6, GREEDY, 0, i, start=(base.kv.fork(), list(base.tokens)))
        for i, q in enumerate(questions)
    ]
    Engine(sessions).run(reqs, lambda req, res, err: got.__setitem__(req.tag, (res, err)))
    assert [got[i][0].tokens for i in range(3)] == want
    assert base.kv.nbytes() == held  # the document's cache is as it was
