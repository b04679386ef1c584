"""The GPU smoke check: the first real CUDA figures in under 8 minutes, from the repository alone.

    bash bench/gpu.sh smoke [-o DIR]       on the GPU machine: wheels set up, then this script
    python bench/gpu_smoke.py --dry-run    anywhere (CI runs it): the plan is checked, nothing run

The run, in this order, each step under its own time limit and all of it under --budget
seconds (a step that would start past the budget is recorded as skipped):
  1. the kernel tests compiled for real (no interpreter; bf16 included) for every kernel
     family, the static / graph decode tests and the packed int4 CUDA test: none needs the
     default model (the ones that do skip, saying so);
  2. bench/kernel_speed.py --check, then the dense vs KIVI-2 decode kernel at 32k (GB/s);
  3. kvrun bench -m llama3-8b-synthetic (random weights, no file) at --wtype bf16 and q4:
     decode tok/s at depth 0 and 8192 for full, kivi2 and snapkv at budget 0.25, without and
     with --cuda-graph, and the batched step at --parallel 8 with --cuda-graph.
Everything lands in DIR in at most 8 files (FILES below), summary.md a table ready for
bench/README.md with each decode figure next to its HBM bound.

--dry-run checks what can be checked without a GPU: every command exists and takes the flags
it is given (--help), the KV specs and the model are valid and synthetic (nothing needs the
default model), the selected tests collect with an empty models folder and without the
packages the GPU machine lacks, the time limits fit the budget, the output fits 8 files, and
what travels to the GPU machine (the repository's files plus .whl/) is under 64 MiB.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TESTS = (
    "tests/test_kernels.py",
    "tests/test_kernels_merged.py",
    "tests/test_kernels_codebook.py",
    "tests/test_kernels_e2e.py",
    "tests/test_graph.py",
    "tests/test_graph_batch.py",
    "tests/test_packed_cuda.py",
)
MODEL = "llama3-8b-synthetic"
METHODS = ("full", "kivi2", "snapkv")
BUDGET = "0.25"
DEPTHS = "0,8192"
FILES = ("env.txt", "log.txt", "tests.txt", "check.txt", "kernels.json", "bench.jsonl",
         "summary.md")  # fmt: skip
BUDGET_S = 450  # the whole run: with the wheel and kvrun set-up it fits 8 minutes
SEND_LIMIT = 64 * 2**20  # what one run on the GPU machine receives
# Packages kvrun's server or tests use that the GPU machine does not have (its package list in
# the device notes); nothing the smoke run imports may need them.
ABSENT_THERE = ("starlette", "uvicorn", "pydantic", "fastapi", "openai", "ray")


@dataclass
class Step:
    name: str  # the output file's stem, and the name in log.txt
    argv: list[str]
    timeout: int  # seconds
    out: str  # file in DIR the step's stdout goes to (bench.jsonl collects one line per run)
    help_argv: list[str] = field(default_factory=list)  # the command's --help


def kvrun(*args: str) -> list[str]:
    return [PY, "-m", "kvrun", *args]


def plan() -> list[Step]:
    """The smoke run's commands, in order."""
    steps = [
        Step(
            "tests",
            [PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-n", "8", *TESTS],
            140,
            "tests.txt",
            [PY, "-m", "pytest", "--help"],
        ),
        Step(
            "check",
            [PY, "bench/kernel_speed.py", "--check"],
            40,
            "check.txt",
            [PY, "bench/kernel_speed.py", "--help"],
        ),
        Step(
            "kernels",
            [
                PY,
                "bench/kernel_speed.py",
                "--contexts",
                "32768",
                "--bits",
                "2",
                "--reps",
                "20",
                "--json",
            ],
            30,
            "kernels.json",
            [PY, "bench/kernel_speed.py", "--help"],
        ),
    ]
    common = ["-m", MODEL, "-c", "8448", "-p", "0", "-n", "32", "-r", "2", "--json"]
    kv = [a for m in METHODS for a in ("--kv", m)] + ["--kv-budget", BUDGET]
    for wtype in ("bf16", "q4"):
        w = ["--wtype", wtype]
        for graph in ((), ("--cuda-graph",)):
            name = f"bench_{wtype}{'_graph' * bool(graph)}"
            argv = kvrun("bench", *common, *w, "-d", DEPTHS, *kv, *graph)
            steps.append(Step(name, argv, 40, "bench.jsonl", kvrun("bench", "--help")))
        argv = kvrun("bench", *common, *w, "-d", "1000", "--kv", "full", "--kv", "snapkv",
                     "--kv-budget", BUDGET, "--parallel", "8", "--cuda-graph")  # fmt: skip
        steps.append(Step(f"bench_{wtype}_np8", argv, 40, "bench.jsonl", kvrun("bench", "--help")))
    return steps


# ---------------------------------------------------------------------------------------------
# the run


def env_text() -> str:
    lines = []
    try:
        smi = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"]
        lines.append(subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout)
    except (OSError, subprocess.TimeoutExpired) as e:
        lines.append(f"nvidia-smi: {e}")
    probe = ("import torch, triton, gguf; print('torch', torch.__version__, 'cuda', "
             "torch.version.cuda, 'triton', triton.__version__, 'gguf', "
             "getattr(gguf, '__version__', '?'))")  # fmt: skip
    r = subprocess.run([PY, "-c", probe], capture_output=True, text=True)
    lines.append((r.stdout or r.stderr).strip())
    lines.append(
        f"python {sys.version.split()[0]}; {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    )
    return "\n".join(lines) + "\n"


def run(out: Path, budget: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.txt").write_text(env_text())
    log = (out / "log.txt").open("a")
    t_start, failed = time.monotonic(), 0
    for step in plan():
        used = time.monotonic() - t_start
        if used + step.timeout > budget:
            print(f"{step.name}: SKIPPED (used {used:.0f} s of {budget:.0f})", file=log, flush=True)
            continue
        print(f"{step.name}: {shlex.join(step.argv)}", file=log, flush=True)
        print(f"[{used:5.0f} s] {step.name}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            r = subprocess.run(step.argv, cwd=ROOT, capture_output=True, text=True,
                               timeout=step.timeout)  # fmt: skip
            rc, stdout, stderr = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout = "timeout", _text(e.stdout)
            stderr = _text(e.stderr) + f"\nstopped after {step.timeout} s"
        dt = time.monotonic() - t0
        failed += rc != 0
        print(f"{step.name}: rc {rc}, {dt:.1f} s", file=log, flush=True)
        if stderr.strip():
            log.write("".join(f"  | {line}\n" for line in stderr.strip().splitlines()[-25:]))
        if step.out == "bench.jsonl":
            with (out / "bench.jsonl").open("a") as f:
                line = {"step": step.name, "wtype": _opt(step.argv, "--wtype"),
                        "parallel": int(_opt(step.argv, "--parallel") or 1), "rc": rc,
                        "seconds": round(dt, 1), "result": _json(stdout)}  # fmt: skip
                f.write(json.dumps(line) + "\n")
        else:
            with (out / step.out).open("a") as f:
                f.write(stdout)
    (out / "summary.md").write_text(summary(out))
    print(f"done in {time.monotonic() - t_start:.0f} s, {failed} step(s) failed; results in {out}",
          file=log)  # fmt: skip
    log.close()
    print((out / "summary.md").read_text())
    return 1 if failed else 0


def _opt(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _json(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# summary.md


def peak_gbps(name: str) -> float | None:
    """HBM peak of the GPU by name: bench/kernel_speed.py's table."""
    spec = importlib.util.spec_from_file_location(
        "kernel_speed", ROOT / "bench" / "kernel_speed.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._peak(name, None)


def summary(out: Path) -> str:
    env = (out / "env.txt").read_text() if (out / "env.txt").exists() else ""
    lines = ["## GPU smoke run (`bash bench/gpu.sh smoke`)", "", "```", env.strip(), "```", ""]
    tests = (out / "tests.txt").read_text() if (out / "tests.txt").exists() else ""
    last = [ln for ln in tests.strip().splitlines() if ln.strip()][-1:] or ["not run"]
    lines += [f"- tests (compiled Triton, CUDA graphs, packed int4 on CUDA): {last[0]}"]
    check = (out / "check.txt").read_text() if (out / "check.txt").exists() else "not run"
    lines += [f"- bench/kernel_speed.py --check: {check.strip().splitlines()[-1] if check.strip() else 'no output'}", ""]  # fmt: skip
    runs = []
    if (out / "bench.jsonl").exists():
        runs = [json.loads(x) for x in (out / "bench.jsonl").read_text().splitlines() if x]
    name = next((r["result"]["machine"]["device_name"] for r in runs if r["result"]), "")
    peak = peak_gbps(name) if name else None
    if (out / "kernels.json").exists() and (k := _json((out / "kernels.json").read_text())):
        lines += ["| decode kernel (Llama-3-8B layer, B=1) | context | us | GB/s | % of HBM peak |",
                  "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for r in k["rows"]:
            pct = "-" if r["pct_peak"] is None else f"{r['pct_peak']:.1f}"
            lines.append(f"| {r['kernel']} | {r['context']} | {r['us']:.1f} | {r['gbps']:.0f} | {pct} |")  # fmt: skip
        lines.append("")
    peak_txt = f"{peak:.0f} GB/s" if peak else "unknown"
    lines += [
        f"Decode on {MODEL} (random weights), tok/s (all sequences together at -np 8), mean of "
        f"the reps; HBM bound = np x HBM peak ({peak_txt}) / (weight bytes + np x KV bytes read "
        "per token): each step reads the weights once for all its sequences.",
        "",
        "| wtype | kv | budget | graph | -np | depth | decode tok/s | GB/s | HBM bound tok/s | % of bound |",  # fmt: skip
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run_ in runs:
        res = run_["result"]
        if not res:
            lines.append(f"| {run_['step']}: rc {run_['rc']}, no result | | | | | | | | | |")
            continue
        np_ = run_["parallel"]
        for r in res["rows"]:
            step_bytes = r["weight_bytes"] + np_ * r["kv_bytes_read_per_token"]
            bound = np_ * peak * 1e9 / step_bytes if peak else None
            pct = f"{100 * r['decode_tok_s'] / bound:.0f}%" if bound else "-"
            lines.append(
                f"| {run_['wtype']} | {r['kv']} | {r['budget'] or '-'} | "
                f"{'yes' if r['cuda_graph'] else 'no'} | {np_} | {r['depth']} | "
                f"{r['decode_tok_s']:.1f} | {r['bandwidth_gb_s']:.0f} | "
                f"{f'{bound:.0f}' if bound else '-'} | {pct} |"
            )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# the dry run


def _help_flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))


def _flags(argv: list[str]) -> list[str]:
    """The options an argv passes: -rs -> -r (pytest's attached value), --a=b -> --a."""
    out = []
    for a in argv:
        if a.startswith("--"):
            out.append(a.split("=")[0])
        elif re.fullmatch(r"-[A-Za-z]\w*", a) and not re.fullmatch(r"-\d+", a):
            out.append(a if a in ("-np",) else a[:2])
    return out


def blocked(argv: list[str]) -> list[str]:
    """argv run with the packages the GPU machine lacks made unimportable."""
    boot = (
        "import sys, runpy, importlib.abc\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {ABSENT_THERE!r}:\n"
        "            raise ModuleNotFoundError(f'{name} is not on the GPU machine')\n"
        "sys.meta_path.insert(0, Absent())\n"
        "sys.argv = sys.argv[1:]\n"
        "if sys.argv[0] == '-m':\n"
        "    sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"  # fmt: skip
        "else:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    assert argv[0] == PY
    return [PY, "-c", boot, *argv[1:]]


def sent_bytes() -> tuple[int, str]:
    """Bytes that travel to the GPU machine: tracked and untracked-not-ignored files, and .whl/."""
    r = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        return 0, "not a git checkout: size not measured"
    files = [ROOT / p for p in r.stdout.split("\0") if p]
    repo = sum(p.stat().st_size for p in files if p.is_file())
    whl = ROOT / ".whl"
    wheels = sum(p.stat().st_size for p in whl.glob("*.whl")) if whl.is_dir() else 0
    how = "measured in .whl/"
    if not wheels:  # not downloaded here: the installed gguf's files stand in for its wheel
        from importlib.metadata import distribution

        d = distribution("gguf")
        wheels = sum((d.locate_file(f)).stat().st_size for f in d.files or [] if
                     Path(d.locate_file(f)).is_file())  # fmt: skip
        how = "no .whl/ here: the installed gguf package's files counted instead"
    return repo + wheels, f"repository {repo / 2**20:.1f} MiB + wheels {wheels / 2**20:.2f} MiB ({how})"  # fmt: skip


def dry_run(budget: float) -> int:
    problems: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            problems.append(what)

    steps = plan()
    helps: dict[tuple, str] = {}
    env = dict(os.environ, KVRUN_MODELS=tempfile.mkdtemp(prefix="kvrun-no-models-"))
    for step in steps:
        key = tuple(step.help_argv)
        if key not in helps:
            r = subprocess.run(blocked(step.help_argv), cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=120)  # fmt: skip
            check(r.returncode == 0, f"{step.name}: `{shlex.join(step.help_argv[1:])}` runs "
                  f"without {', '.join(ABSENT_THERE)}" + (f": {r.stderr.strip()[-300:]}" if r.returncode else ""))  # fmt: skip
            helps[key] = r.stdout
        known = _help_flags(helps[key])
        missing = [f for f in _flags(step.argv[1:]) if f not in known and f != "-m"]
        check(not missing, f"{step.name}: every flag is in its --help" +
              (f" (not: {' '.join(missing)})" if missing else ""))  # fmt: skip
        for p in step.argv:
            if p.endswith((".py",)) and not p.startswith("-"):
                check((ROOT / p).is_file(), f"{step.name}: {p} exists")
    # kvrun's own parser, on the exact argv (unknown options and bad values fail here)
    from kvrun.kv import check as check_kv
    from kvrun.models.presets import is_preset

    for step in steps:
        if step.argv[1:3] != ["-m", "kvrun"]:
            continue
        a = step.argv[3:]
        model = a[a.index("-m") + 1]
        check(is_preset(model), f"{step.name}: -m {model} is a synthetic preset (no model file)")
        for i, x in enumerate(a):
            if x == "--kv":
                try:
                    check_kv(a[i + 1])
                    check(True, f"{step.name}: --kv {a[i + 1]} is a valid spec")
                except Exception as e:  # noqa: BLE001 - the message is what is reported
                    check(False, f"{step.name}: --kv {a[i + 1]}: {e}")
        r = subprocess.run(blocked([*step.argv, "--help"]), cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        check(r.returncode == 0, f"{step.name}: kvrun parses its arguments" +
              (f": {r.stderr.strip()[-300:]}" if r.returncode else ""))  # fmt: skip
    # the tests: every file there, collected with no default model and without the absent
    # packages; those that need the default model skip, saying why
    for t in TESTS:
        check((ROOT / t).is_file(), f"tests: {t} exists")
    r = subprocess.run(blocked([PY, "-m", "pytest", "-q", "--collect-only", "-p",
                                "no:cacheprovider", *TESTS]), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    n = re.search(r"(\d+) tests? collected", r.stdout)
    check(r.returncode == 0 and n is not None,
          f"tests: {n.group(1) if n else 0} collected with an empty models folder"
          + (f": {(r.stdout + r.stderr).strip()[-400:]}" if r.returncode else ""))  # fmt: skip
    r = subprocess.run(blocked([PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                "tests/test_kernels_e2e.py", "-k", "default_model"]),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    check(
        r.returncode == 0 and "default model not pulled" in r.stdout,
        "tests: the default-model test skips with its reason when the model is absent",
    )
    # limits
    total = sum(s.timeout for s in steps)
    check(total <= budget, f"time limits add up to {total} s <= the {budget:.0f} s budget")
    outs = set(FILES) | {s.out for s in steps}
    check(len(outs) <= 8, f"{len(outs)} output files <= 8: {', '.join(sorted(outs))}")
    size, how = sent_bytes()
    check(0 < size < SEND_LIMIT, f"what travels: {size / 2**20:.1f} MiB < 64 MiB: {how}")
    print(f"\n{len(problems)} problem(s)" if problems else "\ndry run passed: the plan is:")
    for s in steps:
        print(f"  [{s.timeout:3d} s] {shlex.join(s.argv[1:])}")
    return 1 if problems else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", default=os.environ.get("OUT", "bench/gpu-results"),
                    help="folder for the results (default $OUT, else bench/gpu-results)")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="check the plan; run nothing")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    ap.add_argument("--summary", action="store_true", help="only rewrite summary.md in --out")
    a = ap.parse_args()
    if a.dry_run:
        sys.exit(dry_run(a.budget))
    out = Path(a.out)
    if a.summary:
        (out / "summary.md").write_text(summary(out))
        print((out / "summary.md").read_text())
        return
    sys.exit(run(out, a.budget))


if __name__ == "__main__":
    main()
