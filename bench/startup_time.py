"""Start-up time of commands that run no model, against `python -c "import torch"`.

    python bench/startup_time.py [--reps 5]

Each command runs as a fresh process (`python -m kvrun ...`), --reps times after one
warm-up (the page cache holds the files, and `kvrun info` finds the probe record a run
leaves); the table gives the median wall time and its
ratio to importing torch alone, and goes into bench/README.md between startup markers.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import subprocess
import sys
from pathlib import Path

from bench_harness import md_head, md_row, timed, utc_now, write_section

from kvrun.tasks.bench import machine

BEGIN, END = "<!-- startup:begin -->", "<!-- startup:end -->"
CASES = [
    ("import torch", [sys.executable, "-c", "import torch"]),
    ("kvrun --help", [sys.executable, "-m", "kvrun", "--help"]),
    ("kvrun kv list", [sys.executable, "-m", "kvrun", "kv", "list"]),
    ("kvrun models", [sys.executable, "-m", "kvrun", "models"]),
    ("kvrun info (GGUF metadata; matmul path from the probe record)",
     [sys.executable, "-m", "kvrun", "info"]),
    ("kvrun generate --kv bogus (an option error)",
     [sys.executable, "-m", "kvrun", "generate", "--kv", "bogus", "-p", "hi"]),
    ("kvrun bench --kv bogus (an option error)",
     [sys.executable, "-m", "kvrun", "bench", "--kv", "bogus"]),
    ("kvrun profile -f missing.txt (an input error)",
     [sys.executable, "-m", "kvrun", "profile", "-f", "missing.txt", "-o", "p.json"]),
    ("kvrun generate -n 1 (runs the model: load + prompt + 1 token)",
     [sys.executable, "-m", "kvrun", "generate", "-p", "hi", "-n", "1"]),
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).with_name("README.md")))
    a = ap.parse_args()
    rows, base = [], None
    for name, cmd in CASES:
        run = functools.partial(subprocess.run, cmd, capture_output=True, check=False)
        t = timed(run, a.reps, warmup=1).median
        base = base or t
        rows.append(md_row([f"`{name}`", f"{t:.2f}", f"{t / base:.2f}"]))
        print(rows[-1], file=sys.stderr, flush=True)
    import torch

    m = machine(torch.device("cpu"))
    body = "\n".join(
        [
            "## Start-up of commands that run no model",
            "",
            f"- date: {utc_now()}, {m['device_name']}, torch {m['torch']}",
            f"- command: `python bench/startup_time.py {shlex.join(sys.argv[1:])}`; median of "
            f"{a.reps} fresh processes after a warm-up",
            "",
            *md_head(["command", "wall s", "vs `import torch`"], "lrr"),
            *rows,
        ]
    )
    print(body)
    write_section(Path(a.out), body, BEGIN, END)


if __name__ == "__main__":
    main()
