"""kvrun serve under load, side by side with llama.cpp's llama-server and llama-cpp-python's
OpenAI server, on the same GGUF file and thread count.

    python bench/serve.py                         # default model, 2 threads, 1/4/8/16 clients
    python bench/serve.py --clients 1,8 --requests 2 --servers kvrun-full,llama-server
    python bench/serve.py --write                 # also into bench/README.md (serve markers)
    python bench/serve.py -m llama3-8b-synthetic --clients 32 --device cuda --servers kvrun-full

With --rounds N every setting runs N times, the servers alternating (the order flips per
setting and round), and each row is the median round: a host whose speed drifts then hits
every server alike. For each server and each client count C the server is started afresh (kvrun and llama-server
with C slots, -np C; llama-cpp-python's server has one), and C clients (threads) each send
--requests streamed chat requests one after another: a ~60-token prompt (a different one per
request) and a --max-tokens greedy answer. Measured per setting: aggregate generated tokens per
second (all content chunks of all clients over the wall time from the first request to the
last answer), requests per second, time to first token (request sent -> first content chunk)
and inter-token latency (between successive content chunks of one answer), p50 and p95.

Servers (--servers): kvrun-full (`kvrun serve --kv full`), kvrun-snapkv (`--kv snapkv
--kv-budget 0.25`), llama-server (built from the llama.cpp sources vendored in the
llama-cpp-python sdist, into bench/.llama-server/, with bench/vs_llamacpp.py's CMake flags for
this CPU), llama-cpp-python (its `llama_cpp.server`, in bench/vs_llamacpp.py's venv, with the
[server] extra; one model instance, requests served one at a time, `--interrupt_requests
False` so that a new request waits instead of cutting the streaming one off). A server that cannot be built or started is reported as failed, the others
still run. The first build takes several minutes each.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import vs_llamacpp as vl  # noqa: E402 - the llama.cpp build helpers live there
from bench_harness import log, write_section  # noqa: E402

from kvrun.server import wait_ready  # noqa: E402

HERE = Path(__file__).parent
README = HERE / "README.md"
BEGIN, END = "<!-- serve:begin -->", "<!-- serve:end -->"
SERVER_DIR = HERE / ".llama-server"
TOPICS = ["the sea", "a mountain village", "an old clock", "the first snow", "a lost letter",
          "a lighthouse keeper", "a desert road", "a city at night", "a garden in spring",
          "a long train journey", "a library", "a storm at sea", "a forgotten song",
          "a bakery at dawn", "a river crossing", "a comet"]  # fmt: skip


def prompt(i: int) -> str:
    """About 60 tokens with the chat template: a request for a long answer."""
    topic = TOPICS[i % len(TOPICS)]
    return (f"Write a long, detailed story about {topic}. Describe the place, the people, the "
            f"sounds and the colours, and tell what happens from the morning to the night. "
            f"Story number {i}.")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------ servers


def llama_server_binary() -> Path:
    """bench/.llama-server/llama-server, built on first use from the sdist's llama.cpp."""
    exe = SERVER_DIR / "llama-server"
    if exe.exists():
        return exe
    SERVER_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log("downloading the llama-cpp-python sdist (it vendors llama.cpp)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", "-d", tmp, "llama-cpp-python"], check=True,
                       stdout=sys.stderr)  # fmt: skip
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = Path(tmp) / "build"
        cmake = shutil.which("cmake") or sys.exit("llama-server needs cmake (pip install cmake)")
        args = shlex.split(os.environ.get("CMAKE_ARGS", vl.llamacpp_cmake()))
        log(f"building llama-server ({' '.join(args)}); this takes several minutes...")
        subprocess.run([cmake, "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", *args], check=True,
                       stdout=sys.stderr)  # fmt: skip
        subprocess.run([cmake, "--build", str(build), "--target", "llama-server", "-j",
                        str(os.cpu_count() or 1)], check=True, stdout=sys.stderr)  # fmt: skip
        shutil.copy2(next(build.rglob("bin/llama-server")), exe)
    return exe


def llama_cpp_python_server() -> Path:
    vl.ensure_llamacpp()
    py = vl.venv_python()
    probe = subprocess.run([str(py), "-c", "import llama_cpp.server, sse_starlette"],
                           capture_output=True)  # fmt: skip
    if probe.returncode != 0:
        vl.pip(["llama-cpp-python[server]"])
    return py


def command(name: str, model: str, port: int, clients: int, a) -> list[str]:
    ctx = clients * (a.max_tokens + 128)  # every slot's prompt and answer
    if name.startswith("kvrun"):
        kv = ["--kv", "full"] if name == "kvrun-full" else ["--kv", "snapkv", "--kv-budget", "0.25"]
        return [sys.executable, "-m", "kvrun", "serve", "-m", model, "--port", str(port),
                "-np", str(clients), "--queue", "1024", "--device", a.device, "--alias", "model",
                *kv]  # fmt: skip
    if name == "llama-server":
        return [str(llama_server_binary()), "-m", model, "--port", str(port), "-np",
                str(clients), "-c", str(ctx), "-t", str(a.threads), "-tb", str(a.threads),
                "--no-webui"]  # fmt: skip
    if name == "llama-cpp-python":
        return [str(llama_cpp_python_server()), "-m", "llama_cpp.server", "--model", model,
                "--port", str(port), "--n_ctx", str(a.max_tokens + 256), "--n_threads",
                str(a.threads), "--n_threads_batch", str(a.threads),
                "--model_alias", "model", "--interrupt_requests", "False"]  # fmt: skip
    raise SystemExit(f"unknown server {name!r}")


class Running:
    def __init__(self, cmd: list[str], port: int, env: dict):
        self.port = port
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.err, env=env)
        try:
            wait_ready(f"http://127.0.0.1:{port}/v1/models", self.proc, timeout=600)
        except RuntimeError as e:
            self.stop()
            self.err.seek(0)
            raise RuntimeError(f"{e}: {self.err.read().decode(errors='replace')[-600:]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------------- clients


def one_request(url: str, model: str, i: int, a) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt(i)}],
            "max_tokens": a.max_tokens, "temperature": 0, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    stamps = []
    with httpx.Client(timeout=1200) as h, h.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if "error" in data:
                raise RuntimeError(str(data["error"])[:200])
            for ch in data.get("choices", []):
                if (ch.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0 if stamps else None, "tokens": len(stamps),
            "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}  # fmt: skip


def load(url: str, model: str, clients: int, a) -> dict:
    def client(c: int) -> list[dict]:
        return [one_request(url, model, c * a.requests + k, a) for k in range(a.requests)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    itl = [x for r in done for x in r["itl"]]
    tokens = sum(r["tokens"] for r in done)
    return {"clients": clients, "requests": len(done), "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "req_s": len(done) / wall,
            "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
            "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95)}  # fmt: skip


def pct(xs: list[float], q: int) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


# --------------------------------------------------------------------------- table


def table(rows: list[dict]) -> str:
    head = ("| server | clients | gen tok/s | req/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) "
            "| vs own 1 client | vs llama-server |")  # fmt: skip
    out = [head, "|" + "---|" * 8]
    base = {(r["server"]): r["tok_s"] for r in rows if r.get("clients") == 1 and "tok_s" in r}
    ref = {r["clients"]: r["tok_s"] for r in rows if r["server"] == "llama-server" and "tok_s" in r}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['server']} | {r['clients']} | failed: {r['error'][:80]} |||||||")
            continue
        own = base.get(r["server"])
        vs = ref.get(r["clients"])
        out.append(
            f"| {r['server']} | {r['clients']} | {r['tok_s']:.1f} | {r['req_s']:.2f} "
            f"| {r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} "
            f"| {1000 * r['itl_p50']:.0f} / {1000 * r['itl_p95']:.0f} "
            f"| {r['tok_s'] / own:.2f}x | " + (f"{r['tok_s'] / vs:.2f}x" if vs else "-") + " |"
        )  # fmt: skip
    return "\n".join(out)


def run_one(name: str, model: str, clients: int, a, env) -> dict:
    """One server started afresh with `clients` slots, under `clients` clients: its row."""
    port = free_port()
    row = {"server": name, "clients": clients}
    try:
        srv = Running(command(name, model, port, clients, a), port, env)
    except (RuntimeError, subprocess.CalledProcessError, SystemExit, OSError) as e:
        log(f"  failed: {e}")
        return row | {"error": f"start: {e}"}
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        one_request(url, "model", 999, argparse.Namespace(max_tokens=8))  # warm-up
        row |= load(url, "model", clients, a)
        log(f"  {row['tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50']:.2f} s")
    except Exception as e:  # noqa: BLE001 - recorded, the others still run
        row["error"] = f"{type(e).__name__}: {e}"
        log(f"  failed: {row['error']}")
    finally:
        srv.stop()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF path or name (default smollm2)")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds over every setting, servers alternating; the median is shown",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--servers", default="kvrun-full,kvrun-snapkv,llama-server,llama-cpp-python")
    ap.add_argument("--json", default=None, help="write the rows here too")
    ap.add_argument("--write", action="store_true", help="update bench/README.md")
    a = ap.parse_args()
    import torch

    from kvrun.hub.model_store import resolve
    from kvrun.models.presets import is_preset
    from kvrun.tasks.bench import machine

    # a preset (llama3-8b-synthetic: real shapes, random weights) is kvrun's alone
    model = a.model if is_preset(a.model) else str(resolve(a.model, pull_missing=True, log=log))
    env = vl.thread_env(a.threads)
    servers = a.servers.split(",")
    clients_list = [int(c) for c in a.clients.split(",")]
    runs: dict[tuple[str, int], list[dict]] = {}
    failed: set[str] = set()
    for rnd in range(a.rounds):  # servers alternate per setting, so a drifting host hits both
        for ci, clients in enumerate(clients_list):
            order = servers if (rnd + ci) % 2 == 0 else servers[::-1]
            for name in [s for s in order if s not in failed]:
                log(
                    f"{name}: {clients} clients x {a.requests} requests (round {rnd + 1}/{a.rounds})"
                )
                row = run_one(name, model, clients, a, env)
                if "error" in row and row["error"].startswith("start:"):
                    failed.add(name)  # the next settings would fail the same way
                runs.setdefault((name, clients), []).append(row)
    rows = []
    for name in servers:
        for clients in clients_list:
            got = runs.get((name, clients), [])
            ok = sorted((r for r in got if "tok_s" in r), key=lambda r: r["tok_s"])
            if not ok:
                rows.append(got[0] if got else {"server": name, "clients": clients,
                                                "error": "not run"})  # fmt: skip
                continue
            row = dict(ok[len(ok) // 2])  # the median round, with its latencies
            row["rounds_tok_s"] = [r["tok_s"] for r in got if "tok_s" in r]
            rows.append(row)
    cmd = "python " + shlex.join(sys.argv)
    rounds = f"; median of {a.rounds} rounds, servers alternating" if a.rounds > 1 else ""
    text = f"`{cmd}` ({dt.date.today()}, {machine(torch.device(a.device))['device_name']}, {a.threads} threads{rounds})\n\n{table(rows)}"
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.write:
        write_section(README, f"## kvrun serve under load\n\n{text}", BEGIN, END)


if __name__ == "__main__":
    threading.excepthook = lambda args: log(f"thread failed: {args.exc_value}")
    main()
