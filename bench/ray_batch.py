"""What going through Ray costs: `kvrun longdoc --ray` against the local run at the same parallelism.

    python bench/ray_batch.py [-m smollm2] [--docs 24] [--doc-tokens 500] [-n 32]
                              [--workers 1,2] [--ray local] [--text FILE] [--out FILE]

Writes --docs documents of about --doc-tokens tokens cut from --text (default: the GPL-3 text
shipped with Debian) as a JSONL batch, then runs, for each W in --workers, the whole batch
through `kvrun longdoc --jsonl` twice as a user would (separate processes, greedy, -n tokens):
locally with `--parallel W`, and with `--ray ADDRESS --workers W --cpus-per-worker C/W` (C =
this machine's CPUs; with --ray ADDRESS naming a multi-node cluster, --cpus-per-worker is
left to kvrun and the figure is the cluster's). Reports documents per minute end to end
(command start to exit: model loads and Ray's start included) and steady (between the first
and the last line written, which leaves the start-up out), the Ray/local ratio of each, and
checks that both runs wrote every id once with the same answers. The table goes to stdout
and into bench/README.md (or --out) between ray markers.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_harness import md_head, md_row, utc_now, write_section

BEGIN, END = "<!-- ray:begin -->", "<!-- ray:end -->"
README = Path(__file__).with_name("README.md")
TEXT = "/usr/share/common-licenses/GPL-3"
QUESTION = "Which rights does this text give, in one sentence?"


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--doc-tokens", type=int, default=500)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--ray", default="local", help="local, auto or a cluster address")
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--out", default=str(README))
    return ap.parse_args()


def write_docs(path: Path, text: str, n: int, tokens: int) -> None:
    """n documents of about `tokens` tokens (4 characters a token), cut at word boundaries
    from successive places in the text."""
    words = text.split()
    size = max(1, tokens * 4 // 6)  # ~6 characters a word with its space
    with path.open("w") as f:
        for i in range(n):
            start = (i * size * 7) % max(1, len(words) - size)
            chunk = " ".join(words[start : start + size])
            f.write(json.dumps({"id": f"doc{i}", "text": chunk}) + "\n")


def timed_run(cmd: list[str], out: Path) -> dict:
    """Run a command; the wall time, and when its output file got its first and last line."""
    seen: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        n = 0
        while not stop.is_set():
            k = out.read_text().count("\n") if out.exists() else 0
            seen.extend([time.monotonic()] * (k - n))
            n = max(n, k)
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t0 = time.monotonic()
    t.start()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    stop.set()
    t.join()
    if r.returncode != 0:
        sys.exit(f"failed: {shlex.join(cmd)}\n{r.stderr[-2000:]}")
    recs = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    return {"wall": wall, "seen": seen, "recs": recs, "stderr": r.stderr}


def rates(run: dict) -> tuple[float, float]:
    n, seen = len(run["recs"]), run["seen"]
    end_to_end = 60 * n / run["wall"]
    steady = 60 * (n - 1) / (seen[-1] - seen[0]) if n > 1 and seen[-1] > seen[0] else 0.0
    return end_to_end, steady


def main() -> None:
    a = args()
    cpus = os.cpu_count() or 1
    tmp = Path(tempfile.mkdtemp(prefix="kvrun-ray-bench-"))
    docs = tmp / "docs.jsonl"
    write_docs(docs, Path(a.text).read_text(errors="replace"), a.docs, a.doc_tokens)
    base = [sys.executable, "-m", "kvrun", "longdoc", "--jsonl", str(docs), "-q", QUESTION,
            "-n", str(a.n)] + (["-m", a.model] if a.model else [])  # fmt: skip
    rows = []
    for w in (int(x) for x in a.workers.split(",")):
        local_out, ray_out = tmp / f"local{w}.jsonl", tmp / f"ray{w}.jsonl"
        local = timed_run([*base, "-o", str(local_out), "--parallel", str(w)], local_out)
        ray_cmd = [*base, "-o", str(ray_out), "--ray", a.ray, "--workers", str(w)]
        if a.ray == "local":
            ray_cmd += ["--cpus-per-worker", str(max(1, cpus // w))]
        ray = timed_run(ray_cmd, ray_out)
        same = {r["id"]: r["tokens"] for r in local["recs"]} == {
            r["id"]: r["tokens"] for r in ray["recs"]
        } and len(ray["recs"]) == a.docs
        (le, ls), (re_, rs) = rates(local), rates(ray)
        rows.append((w, le, ls, re_, rs, same))
        print(f"W={w}: local {le:.1f} ({ls:.1f} steady) docs/min, ray {re_:.1f} ({rs:.1f})",
              file=sys.stderr)  # fmt: skip
    lines = md_head(["parallelism", "local docs/min (end to end / steady)",
                     "Ray docs/min (end to end / steady)", "Ray / local (end to end / steady)",
                     "same answers"], "rrrrl")  # fmt: skip
    for w, le, ls, re_, rs, same in rows:
        lines.append(md_row([w, f"{le:.1f} / {ls:.1f}", f"{re_:.1f} / {rs:.1f}",
                             f"{re_ / le:.2f} / {rs / ls if ls else 0:.2f}",
                             "yes" if same else "NO"]))  # fmt: skip
    import torch

    from kvrun.tasks.bench import machine

    argv = [x for x in sys.argv[1:] if x not in ("--out", a.out)]
    body = "\n".join(
        [
            "## kvrun longdoc on Ray against the local run",
            "",
            f"- date: {utc_now()}",
            f"- machine: {machine(torch.device('cpu'))['device_name']}, {cpus} CPUs, torch "
            f"{torch.__version__}",
            f"- command: `python bench/ray_batch.py {shlex.join(argv)}`",
            f"- batch: {a.docs} documents of ~{a.doc_tokens} tokens, one question, greedy, "
            f"-n {a.n}, default model and --kv full; local `--parallel W` against `--ray "
            f"{a.ray} --workers W`"
            + (f" `--cpus-per-worker {cpus}/W`" if a.ray == "local" else ""),
            "- end to end: command start to exit (loads and Ray's start included); steady: "
            "between the first and the last line written",
            "",
            *lines,
        ]
    )
    print(body)
    write_section(Path(a.out), body, BEGIN, END)


if __name__ == "__main__":
    main()
