"""Many questions per document: `kvrun longdoc` with "questions" (one compression of each
document, every question on a fork of it) against one run per question (--question-after).

    python bench/longdoc_questions.py [-m smollm2] [--docs 8] [--doc-tokens 4000]
                                      [--questions 10] [-n 16] [-c 4608] [--parallel 4]
                                      [--kv kvzip:0.25 --kv snapkv:0.25] [--out FILE]

Builds --docs documents of about --doc-tokens tokens from the license texts Debian ships in
/usr/share/common-licenses (public texts; one text a document, repeated when short) and
asks each the same --questions questions, greedy, -n tokens at most. For each --kv
(method:budget) it runs the real command three ways on the same files, each one process:
  one    a JSONL line per (document, question), --question-after (every question
         prefills and compresses its document again);
  multi  a JSONL line per document with "questions" (one compression per document);
  multi -np N  the same on the batch engine (--parallel N; 0 or 1 leaves it out).
It reports the wall time of each run (model load included, the same in all), the ratio to
the one-per-question run, and whether every answer's tokens equal that run's. The table goes
to stdout and into bench/README.md (or --out) between markers, with date, machine and
command. The JSONL inputs and outputs stay in --work (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_harness import md_head, utc_now, write_section

BEGIN, END = "<!-- longdoc-questions:begin -->", "<!-- longdoc-questions:end -->"
README = Path(__file__).with_name("README.md")
LICENSES = Path("/usr/share/common-licenses")
TEXTS = ["GPL-3", "GPL-2", "Apache-2.0", "LGPL-2.1", "MPL-2.0", "GFDL-1.3", "Artistic",
         "LGPL-3", "CC0-1.0"]  # fmt: skip
QUESTIONS = [
    "What is the name of this license?",
    "Who holds the copyright of the license text itself?",
    "May I sell copies of the program?",
    "Must I give the source code to people I distribute the program to?",
    "Does the license give any warranty?",
    "What happens to my rights if I break the terms?",
    "May the license be replaced by a later version?",
    "What does the license say about patents?",
    "May I change the program and distribute my changes?",
    "What must every copy of the program carry with it?",
]


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=4000)
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("-c", "--ctx-size", type=int, default=4608)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--kv", action="append", default=None, help="method:budget (repeatable)")
    ap.add_argument("--work", default=None, help="folder for the JSONL files (default: temp)")
    ap.add_argument("--out", default=str(README))
    return ap.parse_args()


def documents(model: str | None, n: int, size: int) -> list[str]:
    """n texts of about `size` tokens of the model's tokenizer, one license each."""
    from kvrun.run.runtime import load_runtime

    tok = load_runtime(model, "float32", "cpu", log=lambda m: None).tokenizer
    texts = [p.read_text("utf-8", errors="replace") for p in (LICENSES / t for t in TEXTS)]
    out = []
    for i in range(n):
        ids = tok.encode(texts[i % len(texts)], add_bos=False)
        while len(ids) < size:
            ids = ids + ids
        out.append(tok.decode(ids[:size]).strip())
    return out


def write_inputs(work: Path, docs: list[str], questions: list[str]) -> tuple[Path, Path]:
    """multi.jsonl (a line per document with "questions") and one.jsonl (a line per question)."""
    multi, one = work / "multi.jsonl", work / "one.jsonl"
    with multi.open("w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d, "questions": questions}) + "\n")
    with one.open("w") as f:
        for i, d in enumerate(docs):
            for j, q in enumerate(questions):
                f.write(json.dumps({"id": f"{i}/{j}", "text": d, "question": q}) + "\n")
    return multi, one


def run(a, src: Path, dst: Path, kv: str, extra: list[str]) -> tuple[float, dict]:
    """Wall seconds of one `kvrun longdoc` and its answers' tokens by (doc, question)."""
    method, _, budget = kv.partition(":")
    cmd = [sys.executable, "-m", "kvrun", "longdoc", "--jsonl", str(src), "-o", str(dst),
           "-n", str(a.n), "-c", str(a.ctx_size), "--kv", method, "--quiet", *extra]  # fmt: skip
    cmd += ["--kv-budget", budget] if budget else []
    cmd += ["-m", a.model] if a.model else []
    dst.unlink(missing_ok=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{shlex.join(cmd)} failed: {r.stderr.strip().splitlines()[-1:]}")
    toks = {}
    for line in dst.read_text().splitlines():
        rec = json.loads(line)
        key = tuple(map(int, rec["id"].split("/"))) if isinstance(rec["id"], str) else None
        toks[key or (rec["id"], rec["question_index"])] = rec["tokens"]
    return wall, toks


def main() -> None:
    a = args()
    work = Path(a.work or tempfile.mkdtemp(prefix="kvrun-lq-"))
    work.mkdir(parents=True, exist_ok=True)
    docs = documents(a.model, a.docs, a.doc_tokens)
    multi, one = write_inputs(work, docs, QUESTIONS[: a.questions])
    rows = []
    for kv in a.kv or ["kvzip:0.25", "snapkv:0.25"]:
        name = kv.replace(":", " ")
        base, ref = run(a, one, work / f"one-{kv}.jsonl", kv, ["--question-after"])
        rows.append(f"| {name} | one run per question | {base:.1f} | 1.00x | - |")
        print(rows[-1], file=sys.stderr, flush=True)
        ways = [("multi", [])] + [(f"multi -np {a.parallel}", ["-np", str(a.parallel)])] * (
            a.parallel > 1
        )
        for label, extra in ways:
            wall, toks = run(a, multi, work / f"{label.replace(' ', '')}-{kv}.jsonl", kv, extra)
            same = sum(toks.get(k) == v for k, v in ref.items())
            rows.append(
                f"| {name} | {label} | {wall:.1f} | {wall / base:.2f}x | {same}/{len(ref)} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    from kvrun.tasks.bench import machine

    m = machine(_device())
    head = md_head(["--kv", "run", "wall s", "of one run per question", "answers equal"], "llrrr")
    body = "\n".join(
        [
            '## Many questions per document (`longdoc` "questions")',
            "",
            f"- date: {utc_now()}",
            f"- machine: {m['device_name']} ({m['device']}), {m['threads']} threads, "
            f"torch {m['torch']}",
            f"- command: `python bench/longdoc_questions.py {shlex.join(sys.argv[1:])}`",
            f"- {a.docs} documents of {a.doc_tokens} tokens (Debian's license texts), "
            f"{a.questions} questions each, greedy, -n {a.n}, -c {a.ctx_size}; wall = the "
            "whole command (model load included); answers equal = tokens equal to the "
            "one-run-per-question answer",
            "",
            *head,
            *rows,
        ]
    )
    print(body)
    write_section(Path(a.out), body, BEGIN, END)


def _device():
    from kvrun.run.runtime import pick_device

    return pick_device("auto")


if __name__ == "__main__":
    main()
