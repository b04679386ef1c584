"""Model load time and peak memory of `kvrun generate`, two checkouts side by side.

    git worktree add /tmp/old <rev>
    python bench/load_time.py /tmp/old . [--reps 3] [-m MODEL] [--wtype auto]

Each rep runs `python -m kvrun generate -m MODEL --wtype W -p hi -n 1 --json` (default: the
default model) under each checkout's PYTHONPATH in turn, so a busy machine slows both alike; prints
the median `load_s` and peak memory per checkout as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench_harness import alternate, md_head, md_row


def run(tree: str, model: str, wtype: str) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    cmd = [
        sys.executable,
        "-m",
        "kvrun",
        "generate",
        "-m",
        model,
        "--wtype",
        wtype,
        "-p",
        "hi",
        "-n",
        "1",
        "--temp",
        "0",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/tmp", check=True)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return d["load_s"], d["peak_mem_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs=2, help="two checkouts: before, after")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--wtype", default="auto")
    a = ap.parse_args()
    got = alternate({t: lambda t=t: run(t, a.model, a.wtype) for t in a.trees}, a.reps)
    print("\n".join(md_head(["checkout", "load s (median)", "peak mem MiB (median)"], "lrr")))
    for t, rows in got.items():
        load = statistics.median(r[0] for r in rows)
        mem = statistics.median(r[1] for r in rows) / 2**20
        print(md_row([t, f"{load:.2f}", f"{mem:.0f}"]))


if __name__ == "__main__":
    main()
