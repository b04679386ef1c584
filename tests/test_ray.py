"""kvrun longdoc / needle on a Ray cluster (kvrun/run/cluster.py): the same lines and results as a
local run, a killed worker's documents sent again, a killed driver resumed without loss or
duplicate, a failing document not retried. One Ray head (2 CPUs) serves the module's tests;
the needle test starts its own with --ray local."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from kvrun.errors import KvrunError
from kvrun.run import cluster

pytestmark = [
    pytest.mark.xdist_group("ray"),
    pytest.mark.slow,
]  # one worker runs them all: one head, 2 CPUs

N_DOCS = 8
WORDS = "The quick brown fox jumps over the lazy dog while the river keeps running. "
ASK = ["-q", "What is the secret number?", "-n", "16"]
# the `ray` command installed with this Python (its bin folder may not be on PATH)
RAY = (
    str(Path(sys.executable).with_name("ray"))
    if Path(sys.executable).with_name("ray").exists()
    else "ray"
)
# a test cluster on one machine: no token (Ray 2.5x turns token authentication on by default)
ENV = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
TIMING = ("prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s", "ttft_s", "peak_mem_bytes")


def kvrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvrun", *args]


def _docs(path: Path, n: int = N_DOCS, long_one: bool = False) -> Path:
    with path.open("w") as f:
        for i in range(n):
            text = f"Document {i}. " + WORDS * (4 + 2 * i) + f"The secret number is {100 + i}."
            f.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")
        if long_one:
            f.write(json.dumps({"id": "huge", "text": WORDS * 2000}) + "\n")
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _answers(path: Path) -> dict:
    recs = _lines(path)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), f"duplicate ids: {sorted(ids)}"
    return {r["id"]: (r["answer"], r["tokens"], r["error"]) for r in recs}


@pytest.fixture(scope="module")
def ray_head(default_gguf):
    """`ray start --head --block` with 2 CPUs on a free port, stopped after the module."""
    pytest.importorskip("ray")
    ports = [_free_port() for _ in range(6)]  # the ports a head opens: none taken by another
    tmp = tempfile.mkdtemp(prefix="kvrun-ray-")
    env = ENV
    flags = ["--port", "--dashboard-port", "--dashboard-agent-grpc-port",
             "--dashboard-agent-listen-port", "--metrics-export-port", "--runtime-env-agent-port"]  # fmt: skip
    log = Path(tmp) / "head.out"
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--num-cpus", "2", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={tmp}", "--object-store-memory", str(100 * 2**20),
         *(f"{f}={p}" for f, p in zip(flags, ports, strict=True))],
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env,
    )  # fmt: skip
    address = f"127.0.0.1:{ports[0]}"
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log.read_text():  # then it blocks, serving
        if head.poll() is not None or time.monotonic() > deadline:
            _stop(head)
            pytest.fail(f"ray start --head did not come up: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    try:
        yield address
    finally:
        _stop(head)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(head: subprocess.Popen) -> None:
    """The head and every process it started (its session)."""
    try:
        os.killpg(head.pid, signal.SIGKILL)  # SIGTERM would drain for 30 s
        head.wait(30)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray")
    _docs(d / "docs.jsonl")
    return d


@pytest.fixture(scope="module")
def local_answers(workdir, default_gguf):
    """The local run (--parallel 1, greedy): what every Ray run must give."""
    out = workdir / "local.jsonl"
    r = subprocess.run(kvrun_cmd("longdoc", "--jsonl", str(workdir / "docs.jsonl"), "-o",
                                 str(out), *ASK), capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    answers = _answers(out)
    assert len(answers) == N_DOCS and all(e is None for _, _, e in answers.values())
    return answers


class _Run:
    """A kvrun command in the background, its stderr read as it comes."""

    def __init__(self, args, cwd):
        self.p = subprocess.Popen(kvrun_cmd(*args), cwd=cwd, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stderr:
            self.err.append(line)

    def pids(self) -> list[int]:
        return [int(m.group(1)) for ln in self.err if (m := re.search(r"ready: .*pid (\d+)", ln))]

    def wait_for(self, cond, what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.p.poll() is not None:
                pytest.fail(f"the run ended before {what}: {''.join(self.err)[-2000:]}")
            if time.monotonic() > deadline:
                self.p.kill()
                pytest.fail(f"no {what} in {timeout} s: {''.join(self.err)[-2000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> int:
        rc = self.p.wait(timeout)
        time.sleep(0.1)
        return rc


def test_longdoc_on_two_workers_equals_the_local_run(ray_head, workdir, local_answers):
    out = workdir / "two.jsonl"
    r = subprocess.run(
        kvrun_cmd("longdoc", "--jsonl", "docs.jsonl", "-o", str(out), *ASK, "--ray", ray_head,
                  "--workers", "2"),
        cwd=workdir, capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert _answers(out) == local_answers  # every id once, the same answers
    recs = _lines(out)
    assert all(rec["node"] for rec in recs)  # the worker's node, in every line
    local = _lines(workdir / "local.jsonl")[0]
    assert set(recs[0]) == set(local) | {"node"}  # the local format, plus the node
    same = {k: v for k, v in local["settings"].items() if k != "seed"}  # -1: drawn per run
    assert {k: v for k, v in recs[0]["settings"].items() if k != "seed"} == same
    assert re.search(r"ray: 8 documents on 2 workers \(1 node\)", r.stderr)


def test_a_killed_worker_loses_no_document(ray_head, workdir, local_answers):
    out = workdir / "killed.jsonl"
    run = _Run(["longdoc", "--jsonl", "docs.jsonl", "-o", str(out), *ASK, "--ray", ray_head,
                "--workers", "2"], workdir)  # fmt: skip
    run.wait_for(lambda: len(run.pids()) == 2, "two ready workers")
    run.wait_for(lambda: out.exists() and out.read_text().count("\n") >= 1, "a first line")
    os.kill(run.pids()[0], signal.SIGKILL)
    assert run.finish() == 0, "".join(run.err)
    assert _answers(out) == local_answers
    err = "".join(run.err)
    assert "lost" in err and "sent again" in err


def test_a_killed_driver_resumes_every_missing_id_once(ray_head, workdir, local_answers):
    out = workdir / "resumed.jsonl"
    args = ["longdoc", "--jsonl", "docs.jsonl", "-o", str(out), *ASK, "--ray", ray_head,
            "--workers", "2"]  # fmt: skip
    run = _Run(args, workdir)
    run.wait_for(lambda: out.exists() and out.read_text().count("\n") >= 2, "two lines")
    run.p.send_signal(signal.SIGKILL)
    run.p.wait()
    before = len(_lines(out))
    assert before < N_DOCS
    r = subprocess.run(kvrun_cmd(*args, "--resume"), cwd=workdir, capture_output=True,
                       text=True, timeout=300, env=ENV)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"resuming {out}: {before} done" in r.stderr
    assert _answers(out) == local_answers  # every id exactly once


def test_a_document_too_long_fails_once_and_the_rest_go_on(ray_head, tmp_path):
    _docs(tmp_path / "docs.jsonl", n=2, long_one=True)
    out = tmp_path / "out.jsonl"
    r = subprocess.run(
        kvrun_cmd("longdoc", "--jsonl", "docs.jsonl", "-o", str(out), *ASK, "-c", "1024",
                  "--truncate", "error", "--ray", ray_head, "--workers", "2"),
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert r.returncode == 1 and "1 of 3 documents failed" in r.stderr
    answers = _answers(out)
    assert set(answers) == {"d0", "d1", "huge"}
    assert "fit" in answers["huge"][2] and answers["d0"][2] is None
    assert "sent again" not in r.stderr  # its own failure: not retried


def test_needle_grid_on_ray_local_equals_the_local_grid(default_gguf, tmp_path):
    pytest.importorskip("ray")
    grid = ["needle", "--lengths", "300", "--depths", "0,100", "--kv", "full", "--kv", "snapkv",
            "--kv-budget", "0.25"]  # fmt: skip
    docs = {}
    for name, extra in [("local", []), ("ray", ["--ray", "local", "--workers", "2"])]:
        path = tmp_path / f"{name}.json"
        r = subprocess.run(kvrun_cmd(*grid, "--json", str(path), *extra), capture_output=True,
                           text=True, timeout=300, env=ENV)  # fmt: skip
        assert r.returncode == 0, r.stderr
        docs[name] = json.loads(path.read_text())

    def strip(d):
        return [{k: v for k, v in t.items() if k not in TIMING} for t in d["trials"]]

    assert strip(docs["ray"]) == strip(docs["local"]) and len(docs["ray"]["trials"]) == 4
    assert docs["ray"]["settings"] == docs["local"]["settings"]
    for a, b in zip(docs["ray"]["summary"], docs["local"]["summary"], strict=True):
        assert (a["method"], a["correct"], a["kv_ratio"]) == (b["method"], b["correct"], b["kv_ratio"])  # fmt: skip
    assert docs["ray"]["complete"]


# -------------------------------------------------------------------- without a cluster


def test_ray_missing_says_how_to_install(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from kvrun.cli.main import cli as main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    _docs(tmp_path / "docs.jsonl", n=1)
    r = CliRunner().invoke(main, ["longdoc", "--jsonl", str(tmp_path / "docs.jsonl"), *ASK,
                                  "--ray", "local"])  # fmt: skip
    assert r.exit_code == 1 and "pip install 'kvrun[ray]'" in r.output
    r = CliRunner().invoke(main, ["needle", "--lengths", "300", "--ray"])
    assert r.exit_code == 1 and "pip install 'kvrun[ray]'" in r.output


def test_ray_needs_a_jsonl_batch(tmp_path):
    from click.testing import CliRunner

    from kvrun.cli.main import cli as main

    f = tmp_path / "a.txt"
    f.write_text("text")
    r = CliRunner().invoke(main, ["longdoc", str(f), *ASK, "--ray"])
    assert r.exit_code == 1 and "--ray runs a batch: give --jsonl IN" in r.output


class _FakeRay:
    def __init__(self, **res):
        self.res = res

    def cluster_resources(self):
        return self.res


@pytest.mark.parametrize(
    "res,workers,cpus,want",
    [
        ({"CPU": 8}, None, None, (4, 2, 0)),  # one worker per 2 CPUs
        ({"CPU": 2}, 2, None, (2, 1, 0)),  # the CPUs shared out among --workers
        ({"CPU": 8}, None, 4, (2, 4, 0)),
        ({"CPU": 32, "GPU": 4}, None, None, (4, 4, 1)),  # one per GPU
        ({"CPU": 1}, None, None, (1, 1, 0)),
    ],
)
def test_layout(res, workers, cpus, want):
    lay = cluster.layout(_FakeRay(**res), workers, cpus)
    assert (lay.workers, lay.num_cpus, lay.num_gpus) == want


@pytest.mark.parametrize(
    "res,workers,cpus,msg",
    [
        ({"CPU": 2}, 2, 2, "2 workers x 2 CPUs do not fit the cluster's 2 CPUs"),
        ({"CPU": 16, "GPU": 2}, 3, None, "the cluster has 2 GPUs"),
    ],
)
def test_layout_that_does_not_fit(res, workers, cpus, msg):
    with pytest.raises(KvrunError, match=re.escape(msg)):
        cluster.layout(_FakeRay(**res), workers, cpus)


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--jsonl", "missing.jsonl", "--ray", "local"], "cannot read --jsonl missing.jsonl"),
        (["--jsonl", "docs.jsonl", "--ray", "127.0.0.1:1"], "cannot reach the Ray cluster at"),
        (["--jsonl", "docs.jsonl", "--ray", "nonsense"], "give local, auto or HOST:PORT"),
    ],
)
def test_bad_ray_input_fails_before_any_worker_starts(tmp_path, monkeypatch, extra, msg):
    pytest.importorskip("ray")
    from click.testing import CliRunner

    from kvrun.cli.main import cli as main

    _docs(tmp_path / "docs.jsonl", n=1)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["longdoc", *ASK, *extra])
    assert r.exit_code == 1 and msg in r.output and "starting" not in r.output
