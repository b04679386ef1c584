"""Pulling from Hugging Face (kvrun/hub/names.py, kvrun/hub/pull.py) against a hub served here: the
real huggingface_hub client talks to a local HTTP server (HF_ENDPOINT) that answers the routes
it calls, and downloads into an HF_HOME of the test's own."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import namedtuple
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from cli_checks import one_error_line
from click.testing import CliRunner

import tiny_models
from kvrun.cli.main import cli
from kvrun.errors import ModelNotFound, QuantNotFound
from kvrun.hub import names as hub
from kvrun.hub import pull as hub_pull
from kvrun.hub.model_store import resolve
from kvrun.hub.names import (
    GGUFEntry,
    HubModel,
    HubRef,
    gguf_entries,
    parse_ref,
    pick,
    quant_of,
)


# --------------------------------------------------------------------------- names, quants
def test_parse_ref():
    assert parse_ref("hf:a/b:q8_0") == HubRef("a/b", "q8_0")
    assert parse_ref("hf:a/b") == HubRef("a/b")
    assert parse_ref("a/b:Q4_K_M") is None  # -m takes repos only with hf:
    assert parse_ref("a/b:Q4_K_M", bare=True) == HubRef("a/b", "Q4_K_M")
    assert parse_ref("llama3-8b", bare=True) is None
    assert str(HubRef("a/b", "q8_0")) == "hf:a/b:q8_0"
    with pytest.raises(Exception, match="OWNER/NAME"):
        parse_ref("hf:just-a-name")


@pytest.mark.parametrize(
    "name, quant",
    [
        ("Meta-Llama-3-8B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "Q4_K_M"),
        ("Qwen3-0.6B-Q8_0.gguf", "Q8_0"),
        ("google_gemma-3-1b-it-IQ4_XS.gguf", "IQ4_XS"),
        ("Phi-3-mini-4k-instruct-q4.gguf", "Q4"),
        ("Phi-3-mini-4k-instruct-fp16.gguf", "FP16"),
        ("model-BF16-00002-of-00003.gguf", "BF16"),
        ("Llama-3.2-1B-Instruct-f16.gguf", "F16"),
        ("Q8_0/Big-Model-Q8_0-00001-of-00002.gguf", "Q8_0"),
        ("README.gguf", None),
    ],
)
def test_quant_of_file_names(name, quant):
    assert quant_of(name) == quant


def test_split_parts_are_one_entry_and_mmproj_is_left_out():
    names = ["m-Q8_0-00002-of-00002.gguf", "m-Q8_0-00001-of-00002.gguf", "m-Q4_K_M.gguf"]
    names += ["mmproj-m-f16.gguf", "README.md"]
    assert gguf_entries(names) == [
        GGUFEntry(("m-Q4_K_M.gguf",), "Q4_K_M"),
        GGUFEntry(("m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"), "Q8_0"),
    ]
    # a lone part names every part (the cache check then finds the missing ones)
    (entry,) = gguf_entries(["x-00001-of-00003.gguf"])
    assert entry.files[2] == "x-00003-of-00003.gguf"


def test_pick_by_quant_default_and_errors():
    entries = gguf_entries(["m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-IQ4_XS.gguf"])
    assert pick(entries, HubRef("o/m")).files == ("m-Q4_K_M.gguf",)
    assert pick(entries, HubRef("o/m", "q8_0")).files == ("m-Q8_0.gguf",)
    assert pick(entries, HubRef("o/m", "iq4_xs")).files == ("m-IQ4_XS.gguf",)
    assert pick(entries, HubRef("o/m", "m-Q8_0.gguf")).files == ("m-Q8_0.gguf",)
    with pytest.raises(QuantNotFound, match=r"no Q5_K_M; its quants: IQ4_XS, Q4_K_M, Q8_0"):
        pick(entries, HubRef("o/m", "Q5_K_M"))
    only = gguf_entries(["Phi-3-mini-4k-instruct-q4.gguf"])
    assert pick(only, HubRef("o/phi")) == only[0]  # no Q4_K_M: the only GGUF
    two = gguf_entries(["a-Q8_0.gguf", "a-F16.gguf"])
    with pytest.raises(QuantNotFound, match="Q4_K_M .the default. and several GGUFs; its quants"):
        pick(two, HubRef("o/a"))
    same = gguf_entries(["a/m-Q8_0.gguf", "b/m-Q8_0.gguf"])
    with pytest.raises(QuantNotFound, match="matches 2 files"):
        pick(same, HubRef("o/m", "Q8_0"))


def test_short_name_table_is_pinned():
    assert len(hub.HUB_MODELS) == 14 and "smollm2" not in hub.HUB_MODELS
    for name, m in hub.HUB_MODELS.items():
        assert name == m.name and re.fullmatch(r"[\w.-]+/[\w.-]+", m.repo), m
        assert m.file.endswith(".gguf") and quant_of(m.file) and 0.1 < m.size_gb < 6, m
    assert hub.HUB_MODELS["llama3-8b"].file == "Meta-Llama-3-8B-Instruct-Q4_K_M.gguf"


def test_missing_names_say_what_to_pull(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRUN_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(ModelNotFound, match=r"`kvrun pull llama3-8b` \(4.92 GB"):
        resolve("llama3-8b")
    with pytest.raises(ModelNotFound, match=r"run `kvrun pull hf:o/m:Q8_0`"):
        resolve("hf:o/m:Q8_0")


# ------------------------------------------------------------------------------ the hub
# huggingface_hub writes a download in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB): what a pull cut
# short keeps, and where the next one starts, is a whole number of them
CHUNK = 10 * 2**20
BIG = 2 * CHUNK + 1_000_000  # 20.95 MiB


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    sha: str = field(default_factory=lambda: os.urandom(20).hex())


class FakeHub(ThreadingHTTPServer):
    """The routes huggingface_hub 2.4 calls to pull files (no xet headers: plain HTTP)."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos: dict[str, Repo] = {}
        self.log: list[tuple[str, str, str | None]] = []  # method, path, Range
        self.rate: float | None = None  # bytes/s of file bodies
        self.cut_after: int | None = None  # the next file body stops after this many bytes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def gets(self) -> list[str | None]:
        """The Range header of each file GET so far (None: the whole file)."""
        return [r for m, p, r in self.log if m == "GET" and "/resolve/" in p]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.serve(body=False)

    def do_GET(self):
        self.serve(body=True)

    def serve(self, body: bool):
        hub_: FakeHub = self.server
        path = unquote(urlsplit(self.path).path)
        hub_.log.append((self.command, path, self.headers.get("Range")))
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+", path)
        file = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        match = info or tree or file
        repo = hub_.repos.get(match[1]) if match else None
        if repo is None:
            return self.error(404, "RepoNotFound", "Repository not found")
        if info:
            siblings = [{"rfilename": f, "size": len(d)} for f, d in repo.files.items()]
            gated = "manual" if repo.gated else False
            return self.json(
                {"id": match[1], "sha": repo.sha, "gated": gated, "siblings": siblings}
            )
        if tree:
            listing = [
                {"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                for f, d in repo.files.items()
            ]
            return self.json(listing)
        if repo.gated:
            return self.error(401, "GatedRepo", f"Access to model {match[1]} is restricted.")
        data = repo.files.get(file[2])
        if data is None:
            return self.error(404, "EntryNotFound", "Entry not found", repo.sha)
        start = (
            int(re.fullmatch(r"bytes=(\d+)-", self.headers["Range"])[1])
            if body and (self.headers.get("Range"))
            else 0
        )
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if body:
            self.stream(data[start:])

    def stream(self, data: bytes):
        hub_: FakeHub = self.server
        cut, hub_.cut_after = hub_.cut_after, None
        if cut is not None:
            data = data[:cut]  # then the connection closes short of Content-Length
        try:
            for i in range(0, len(data), 1 << 16):
                self.wfile.write(data[i : i + (1 << 16)])
                if hub_.rate:
                    time.sleep((1 << 16) / hub_.rate)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def json(self, obj):
        raw = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(raw)

    def error(self, status: int, code: str, message: str, commit: str | None = None):
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama as two GGUFs (two seeds) and as an HF folder; a big file of random bytes."""
    root = tmp_path_factory.mktemp("tiny")
    a, b = tiny_models.build(root / "a"), tiny_models.build(root / "b", seed=1)
    folder = {p.name: p.read_bytes() for p in a.hf_dir.iterdir() if p.is_file()}
    return a.gguf_path.read_bytes(), b.gguf_path.read_bytes(), folder, os.urandom(BIG)


@pytest.fixture
def fake(files, tmp_path, monkeypatch):
    """The hub, serving tester/tiny-GGUF, tester/split-GGUF, tester/tiny-hf, a gated repo and
    tester/big-GGUF; HF_ENDPOINT at it, HF_HOME and KVRUN_MODELS in tmp_path."""
    q4, q8, folder, big = files
    server = FakeHub()
    server.repos = {
        "tester/tiny-GGUF": Repo({"tiny-Q4_K_M.gguf": q4, "tiny-Q8_0.gguf": q8, "README.md": b"#"}),
        "tester/split-GGUF": Repo(
            {f"tiny-Q8_0-{i:05d}-of-00003.gguf": q8[i - 1 :: 3] for i in (1, 2, 3)}
        ),
        "tester/tiny-hf": Repo({**folder, "README.md": b"#", "pytorch_model.bin": b"pickle"}),
        "tester/gated-GGUF": Repo({"g-Q4_K_M.gguf": q4}, gated=True),
        "tester/big-GGUF": Repo({"big-Q4_K_M.gguf": big}),
    }
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("KVRUN_MODELS", str(tmp_path / "models"))
    yield server
    server.shutdown()
    server.server_close()


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def blobs(tmp_path, repo):
    return tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "blobs"


@pytest.mark.slow
def test_pull_repo_quant_into_the_hf_cache(fake, tmp_path):
    r = run("pull", "tester/tiny-GGUF:q8_0")
    assert r.exit_code == 0, r.output
    path = Path(r.stdout.strip())
    assert path.name == "tiny-Q8_0.gguf" and path.is_relative_to(tmp_path / "hf" / "hub")
    assert path.read_bytes() == fake.repos["tester/tiny-GGUF"].files["tiny-Q8_0.gguf"]
    assert fake.gets() == [None]
    fake.log.clear()  # pulled: found in the cache with no network call, by either spelling
    r = run("pull", "hf:tester/tiny-GGUF:Q8_0")
    assert r.exit_code == 0 and "already" in r.stderr and Path(r.stdout.strip()) == path
    assert resolve("hf:tester/tiny-GGUF:Q8_0") == path and fake.log == []
    listing = json.loads(run("models", "--json").stdout)
    assert {
        "name": "hf:tester/tiny-GGUF:Q8_0",
        "path": str(path),
        "bytes": path.stat().st_size,
    } in (listing["hf_cached"])


@pytest.mark.slow
def test_default_quant_split_parts_and_folder(fake, tmp_path):
    r = run("pull", "hf:tester/tiny-GGUF")
    assert r.exit_code == 0 and Path(r.stdout.strip()).name == "tiny-Q4_K_M.gguf", r.output
    r = run("pull", "tester/split-GGUF")  # its only GGUF, in three parts: all of them come
    assert r.exit_code == 0, r.output
    first = Path(r.stdout.strip())
    assert first.name == "tiny-Q8_0-00001-of-00003.gguf"
    parts = sorted(first.parent.glob("tiny-Q8_0-*.gguf"))
    assert len(parts) == 3 and resolve("hf:tester/split-GGUF") == first
    r = run("pull", "tester/tiny-hf")  # no GGUF: the safetensors folder, what kvrun reads only
    assert r.exit_code == 0, r.output
    folder = Path(r.stdout.strip())
    have = sorted(p.name for p in folder.iterdir())
    assert have == sorted(
        fake.repos["tester/tiny-hf"].files.keys() - {"README.md", "pytorch_model.bin"}
    )
    fake.log.clear()
    assert resolve("hf:tester/tiny-hf") == folder and fake.log == []
    names = {m["name"] for m in json.loads(run("models", "--json").stdout)["hf_cached"]}
    assert {"hf:tester/tiny-GGUF:Q4_K_M", "hf:tester/split-GGUF:Q8_0", "hf:tester/tiny-hf"} <= names


@pytest.mark.slow
def test_generate_pulls_hf_and_short_names(fake, monkeypatch):
    r = run("generate", "-m", "hf:tester/tiny-GGUF:Q8_0", "-p", "Hello", "-n", "4", "--temp", "0")
    assert r.exit_code == 0 and "saved" in r.stderr, r.output
    r = run("generate", "-m", "hf:tester/tiny-hf", "-p", "Hello", "-n", "4", "--temp", "0")
    assert r.exit_code == 0, r.output
    # a short name pointed at the test repo (the table itself stays as it is)
    monkeypatch.setitem(
        hub.HUB_MODELS, "tiny", HubModel("tiny", "tester/tiny-GGUF", "tiny-Q4_K_M.gguf", 0.001)
    )
    with pytest.raises(ModelNotFound, match=r"`kvrun pull tiny` \(0.001 GB"):
        resolve("tiny")  # commands that do not pull (info, convert) say how
    r = run("generate", "-m", "tiny", "-p", "Hello", "-n", "4", "--temp", "0")
    assert r.exit_code == 0 and "saved" in r.stderr, r.output
    fake.log.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("tiny").name == "tiny-Q4_K_M.gguf" and fake.log == []
    r = run("pull", "tiny")
    assert r.exit_code == 0 and "already" in r.stderr and fake.log == []


@pytest.mark.slow
def test_progress_lines_when_piped(fake, monkeypatch):
    from kvrun import progress

    monkeypatch.setattr(progress.LineProgress, "EVERY", 0.0)
    r = run("pull", "tester/big-GGUF")
    assert r.exit_code == 0, r.output
    line = re.compile(r"^big-Q4_K_M\.gguf: 10\.00 MiB/20\.95 MiB \(48%\), [\d.]+ \w+/s, ", re.M)
    assert line.search(r.stderr), r.stderr
    assert "20.95 MiB/20.95 MiB (100%)" in r.stderr and "done in" in r.stderr
    r = run("pull", "--quiet", "hf:tester/tiny-GGUF:Q8_0")
    assert r.exit_code == 0 and "%" not in r.stderr, r.stderr


@pytest.mark.slow
def test_a_cut_connection_resumes_with_a_range_request(fake):
    fake.cut_after = CHUNK + 100_000  # huggingface_hub retries from the chunk it wrote
    r = run("pull", "tester/big-GGUF")
    assert r.exit_code == 0, r.output
    assert fake.gets() == [None, f"bytes={CHUNK}-"]
    assert (
        Path(r.stdout.strip()).read_bytes()
        == fake.repos["tester/big-GGUF"].files["big-Q4_K_M.gguf"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill"])
def test_a_killed_pull_goes_on_where_it_stopped(fake, tmp_path, sig):
    data = fake.repos["tester/big-GGUF"].files["big-Q4_K_M.gguf"]
    fake.rate = 4e6  # ~5 s for the file: the signal lands well before its end on a loaded machine
    # the second pull prints progress lines at once (not every 5 s), as test_progress_lines
    # Ctrl-C as a terminal sends it: a worker that ignores SIGINT (xdist's) passes that on
    code = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    code += "import sys\nfrom kvrun import progress\nprogress.LineProgress.EVERY = 0.0\n"
    code += "from kvrun.cli.main import cli\ncli(sys.argv[1:], prog_name='kvrun')"
    cmd = [sys.executable, "-c", code, "pull", "tester/big-GGUF"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder, t0 = blobs(tmp_path, "tester/big-GGUF"), time.monotonic()
    while not any(p.stat().st_size >= CHUNK for p in folder.glob("*.incomplete")):
        assert first.poll() is None and time.monotonic() - t0 < 30, first.communicate()
        time.sleep(0.02)
    first.send_signal(sig)
    _, err = first.communicate(timeout=30)
    parts = list(folder.glob("*.incomplete"))
    assert len(parts) == 1, (first.returncode, err)
    part = parts[0]
    kept = part.stat().st_size
    assert kept in (CHUNK, 2 * CHUNK) and data.startswith(part.read_bytes())
    if sig == signal.SIGINT:
        assert first.returncode == 130 and "kept; pulling again goes on" in err, err
    fake.rate, fake.log[:] = None, []
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    assert fake.gets() == [f"bytes={kept}-"]
    assert Path(second.stdout.strip()).read_bytes() == data
    assert re.search(r"big-Q4_K_M\.gguf: .*\(100%\), .*/s, done in \d+ s", second.stderr)
    assert not list(folder.glob("*.incomplete"))


# ----------------------------------------------------------------------------- errors
@pytest.mark.slow
def test_gated_missing_repo_and_missing_quant_are_one_line(fake):
    r = run("pull", "tester/gated-GGUF")
    one_error_line(r, "https://huggingface.co/tester/gated-GGUF", "licence", "HF_TOKEN", "login")
    assert r.exit_code == 1
    one_error_line(run("pull", "hf:tester/nope"), "no model repo tester/nope")
    one_error_line(run("pull", "tester/tiny-GGUF:Q5_K_M"), "no Q5_K_M", "Q4_K_M, Q8_0")
    one_error_line(run("pull", "tester/tiny-hf:Q8_0"), "no GGUF", "hf:tester/tiny-hf")
    r = run("generate", "-m", "hf:tester/gated-GGUF", "-p", "hi")  # the same from -m
    one_error_line(r, "https://huggingface.co/tester/gated-GGUF")


@pytest.mark.slow
def test_no_network_and_offline_mode(fake, tmp_path, monkeypatch):
    assert run("pull", "tester/tiny-GGUF:Q8_0").exit_code == 0
    with socket_closed_port() as port:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        one_error_line(
            run("pull", "tester/tiny-GGUF"),
            "not in the Hugging Face cache",
            "cannot be reached",
            "HF_HUB_OFFLINE",
        )
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        one_error_line(run("pull", "tester/tiny-GGUF"), "HF_HUB_OFFLINE is set")
        # what the cache holds resolves in a process that starts with HF_HUB_OFFLINE=1 (as
        # huggingface_hub reads it) and no hub at all
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        r = subprocess.run([sys.executable, "-m", "kvrun", "info", "hf:tester/tiny-GGUF:Q8_0", "--json"],
                           capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["path"].endswith("tiny-Q8_0.gguf")


class socket_closed_port:
    """A local port that nothing listens on."""

    def __enter__(self):
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc):
        return False


@pytest.mark.slow
def test_a_full_disk_is_one_line(fake, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    with monkeypatch.context() as m:  # checked before the download: it would not fit
        m.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
        r = run("pull", "tester/big-GGUF")
    one_error_line(r, "needs 20.95 MiB", "1000 B free", str(tmp_path / "hf" / "hub"), "HF_HOME")
    assert fake.gets() == []

    def fills_up(url, f, **kw):  # the disk fills during the download
        f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub_pull, "http_get", fills_up)
    r = run("pull", "tester/big-GGUF")
    one_error_line(r, "is full", "big-Q4_K_M.gguf needs 20.95 MiB more", "1000 B kept", "HF_HOME")
    assert r.exit_code == 1
