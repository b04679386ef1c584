"""Load and first token on the default model, kvrun next to llama.cpp, quiet and beside another job.

    python bench/first_token.py [--reps 3] [--threads 2] [--out FILE] [--before TREE]
        [-m MODEL] [--tools kvrun,built,f32,before,llama.cpp]

What a user of `kvrun generate` or `kvrun chat` waits for: a fresh process loads the model
and answers a ~40-token prompt with its first token. For each tool, in one process each
(alternating, --reps times, median shown): load time (the load call alone) and time to the
first token (the prompt's prefill and one token). Tools: kvrun with its defaults (packed
weights, mapped from the packed cache, which a warm-up run fills), kvrun building the
packed model from the GGUF (KVRUN_PACKED_CACHE=off: a file's first load), kvrun --wtype
f32 (dense), kvrun as checked out in TREE (--before: `git worktree add /tmp/before REV`),
and llama.cpp (llama-cpp-python from bench/.venv-llamacpp, which bench/vs_llamacpp.py sets
up), all raw prompts, greedy, the same GGUF file and thread count. Then again beside a
competing job: a process of --threads torch threads multiplying matrices at normal priority
for the whole second half. The table goes to stdout and into bench/README.md (or --out)
between first-token markers (a section per model file).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_harness import alternate, md_head, md_row, utc_now, write_section

BENCH = Path(__file__).resolve().parent
BEGIN, END = "<!-- first-token:begin -->", "<!-- first-token:end -->"
LLAMACPP = BENCH / ".venv-llamacpp" / "bin" / "python"
NEUTRAL = tempfile.mkdtemp(prefix="first-token-")  # cwd: no checkout's kvrun on sys.path
PROMPT = (
    "The river runs through the old city, under seven stone bridges, past the cathedral "
    "and the market, and on towards the sea. Describe the city in one sentence:"
)
LLAMACPP_CODE = """
import json, sys, time
t0 = time.perf_counter()
import llama_cpp
t1 = time.perf_counter()
m = llama_cpp.Llama(sys.argv[1], n_ctx=2048, n_threads=int(sys.argv[2]), n_batch=512, verbose=False)
t2 = time.perf_counter()
ids = m.tokenize(sys.argv[3].encode(), add_bos=True)
m.eval(ids)
first = int(m.scores[len(ids) - 1].argmax())
t3 = time.perf_counter()
print(json.dumps({"load_s": t2 - t1, "ttft_s": t3 - t2, "prompt_tokens": len(ids), "first": first}))
"""
HOG = """
import time, torch
torch.set_num_threads(int(__import__("sys").argv[1]))
a = torch.randn(1024, 1024)
while True:
    a @ a
"""


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(BENCH / "README.md"))
    ap.add_argument("--before", default=None, help="a worktree of the kvrun to compare with")
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the default model)")
    ap.add_argument("--tools", default="kvrun,built,f32,before,llama.cpp")
    return ap.parse_args()


def kvrun_run(extra: list[str], env: dict, tree: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "kvrun", "generate", "--raw", "-p", PROMPT, "-n", "1",
           "--temp", "0", "--json", *extra]  # fmt: skip
    if tree:
        env = dict(env, PYTHONPATH=os.path.abspath(tree))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=NEUTRAL)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "failed"}
    d = json.loads(r.stdout)
    return {"load_s": d["load_s"], "ttft_s": d["ttft_s"], "prompt_tokens": d["prompt_tokens"]}


def llamacpp_run(model: str, threads: int) -> dict:
    if not LLAMACPP.exists():
        return {"error": f"no {LLAMACPP} (python bench/vs_llamacpp.py makes it)"}
    r = subprocess.run([str(LLAMACPP), "-c", LLAMACPP_CODE, model, str(threads), PROMPT],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "failed"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    a = args()
    from kvrun.hub.model_store import DEFAULT_MODEL, resolve

    model = (
        str(Path(a.model).resolve()) if a.model else str(resolve(DEFAULT_MODEL, pull_missing=True))
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    env.pop("GOMP_SPINCOUNT", None)
    env.pop("KVRUN_PACKED_CACHE", None)
    m = ["-m", model]
    rev = ""
    if a.before:
        rev = subprocess.run(["git", "-C", a.before, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    tools = {
        "kvrun": ("kvrun (packed, mapped from the packed cache)", lambda: kvrun_run(m, env)),
        "built": (
            "kvrun, packed model built from the GGUF (a first load)",
            lambda: kvrun_run(m, dict(env, KVRUN_PACKED_CACHE="off")),
        ),
        "f32": ("kvrun --wtype f32", lambda: kvrun_run([*m, "--wtype", "f32"], env)),
        "before": (f"kvrun before ({rev})", lambda: kvrun_run(m, env, a.before)),
        "llama.cpp": ("llama.cpp", lambda: llamacpp_run(model, a.threads)),
    }
    wanted = a.tools.split(",")
    if not a.before:
        wanted = [t for t in wanted if t != "before"]
    tools = dict(tools[t] for t in wanted)
    kvrun_run(m, env)  # fills the packed cache (a file's first load writes it)
    results: dict = {}
    for condition in ("quiet", f"beside a {a.threads}-thread job"):
        hog = None
        if condition != "quiet":
            hog = subprocess.Popen([sys.executable, "-c", HOG, str(a.threads)])
            time.sleep(3)
        try:

            def shown(name: str, rep: int, got: dict, condition: str = condition) -> None:
                print(f"{condition} | {name} | rep {rep + 1}: {got}", file=sys.stderr)

            runs = alternate(tools, a.reps, each=shown)
            results.update({(condition, name): got for name, got in runs.items()})
        finally:
            if hog:
                hog.kill()
                hog.wait()
    lines = md_head(["condition", "tool", "load (s)", "first token (s)",
                     "load + first token (s)", "prompt tokens"], "llrrrr")  # fmt: skip
    for (condition, name), runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"| {condition} | {name} | {runs[0]['error']} | | | |")
            continue
        load = statistics.median(r["load_s"] for r in ok)
        ttft = statistics.median(r["ttft_s"] for r in ok)
        both = statistics.median(r["load_s"] + r["ttft_s"] for r in ok)
        lines.append(md_row([condition, name, f"{load:.2f}", f"{ttft:.2f}", f"{both:.2f}",
                             ok[0]["prompt_tokens"]]))  # fmt: skip
    import torch

    from kvrun.tasks.bench import machine

    m = machine(torch.device("cpu"))
    argv = [x for x in sys.argv[1:] if x not in ("--out", a.out)]
    name = Path(model).name
    begin, end = BEGIN, END
    if a.model:  # a section of its own per model file
        begin, end = BEGIN.replace(":begin", f":{name}:begin"), END.replace(":end", f":{name}:end")
    body = "\n".join(
        [
            f"## Load and first token, kvrun next to llama.cpp (CPU, {name})",
            "",
            f"- date: {utc_now()}",
            f"- machine: {m['device_name']}, {a.threads} threads, torch {m['torch']}",
            f"- command: `python bench/first_token.py {shlex.join(argv)}`",
            f"- model: {Path(model).name}; a {ok[0]['prompt_tokens']}-token raw prompt, greedy; "
            f"median of {a.reps} processes per row, tools alternating; load = the load call "
            "alone, first token = the prompt's prefill and one token",
            f"- the competing job: {a.threads} torch threads multiplying 1024x1024 matrices at "
            "normal priority",
            "",
            *lines,
        ]
    )
    print(body)
    write_section(Path(a.out), body, begin, end)


if __name__ == "__main__":
    main()
