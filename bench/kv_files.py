"""Which kvrun/kv files one short `kvrun generate` runs per KV method (how a reader meets it).

    python bench/kv_files.py                    # every registry method
    python bench/kv_files.py --kv snapkv --kv xkv --json out.json

For each method: `python -m coverage run --include='*/kvrun/kv/*' -m kvrun generate` on the
default model (a ~600-token prompt, 8 greedy tokens), then coverage's JSON report. A file
counts when one of its functions ran (module-level lines, which every import runs, do not).
The table gives the files beyond those `--kv full` runs, and their lines. Needs `coverage`
(`pip install coverage`); the checkout on PYTHONPATH is the one measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TEXT = "/usr/share/common-licenses/GPL-3"


def files_run(method: str, prompt: Path, env: dict) -> set[str]:
    """kvrun/kv files (relative to kvrun/kv) with a function that ran for `--kv method`."""
    with tempfile.TemporaryDirectory() as tmp:
        data, report = Path(tmp) / ".coverage", Path(tmp) / "cov.json"
        run = [sys.executable, "-m", "coverage", "run", f"--data-file={data}",
               "--include=*/kvrun/kv/*", "-m", "kvrun", "generate", "-f", str(prompt),
               "-n", "8", "--temp", "0", "--kv", method]  # fmt: skip
        subprocess.run(run, env=env, check=True, capture_output=True)
        subprocess.run([sys.executable, "-m", "coverage", "json", f"--data-file={data}",
                        "-o", str(report)], env=env, check=True, capture_output=True)  # fmt: skip
        files = json.loads(report.read_text())["files"]
    out = set()
    for path, f in files.items():
        ran = any(fn["executed_lines"] for name, fn in f.get("functions", {}).items() if name)
        if ran:
            out.add(path.split("kvrun/kv/", 1)[1])
    return out


def lines(root: Path, rel: str) -> int:
    return len((root / rel).read_text().splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", action="append", help="methods (default: every registry entry)")
    ap.add_argument("--json", help="write the table as JSON here")
    a = ap.parse_args()
    import kvrun.kv

    root = Path(kvrun.kv.__file__).parent
    methods = a.kv or [m for m in kvrun.kv.REGISTRY if m != "full"]
    prompt = Path(tempfile.mkstemp(suffix=".txt")[1])
    prompt.write_text(Path(TEXT).read_text()[:3000])
    env = dict(os.environ)
    base = files_run("full", prompt, env)
    total = sum(lines(root, f) for f in root.rglob("*.py") for f in [str(f.relative_to(root))])
    print(f"kvrun/kv: {len(list(root.rglob('*.py')))} files, {total} lines; "
          f"full runs {len(base)} files: {', '.join(sorted(base))}")  # fmt: skip
    rows = {}
    for m in methods:
        extra = sorted(files_run(m, prompt, env) - base)
        rows[m] = {f: lines(root, f) for f in extra}
        desc = ", ".join(f"{f} ({n})" for f, n in rows[m].items()) or "-"
        print(f"{m:16s} {len(extra):2d}  {desc}", flush=True)
    prompt.unlink()
    if a.json:
        Path(a.json).write_text(json.dumps({"full": sorted(base), "extra": rows}, indent=1))


if __name__ == "__main__":
    main()
