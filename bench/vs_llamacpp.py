"""kvrun vs llama.cpp: prefill and decode speed on the same GGUF file, same thread count.

    python bench/vs_llamacpp.py                      # default model, 2 threads, 3 reps
    python bench/vs_llamacpp.py --write --json bench/vs_llamacpp.json
    python bench/vs_llamacpp.py --wtype q4 --tests pp512,tg128 --skip-8b
    python bench/vs_llamacpp.py --synthetic-8b /tmp/llama3-8b-shape-q4_0.gguf --tests '' --skip-8b

llama.cpp runs through llama-cpp-python, which is not a kvrun dependency: on first use the
script creates the virtual environment bench/.venv-llamacpp and pip-installs
llama-cpp-python into it (a source build with cmake; it takes several minutes). The build
targets the x86 extensions this CPU lists in /proc/cpuinfo, with AMX off (`llamacpp_cmake`): a native
build turns AMX on where the CPU lists it, and on the development VM its first matmul then
dies with a general protection fault in libggml-cpu. Set CMAKE_ARGS to build otherwise. The llama.cpp side runs as a worker subprocess in that venv and
answers JSON on stdout. The kvrun side runs `kvrun bench ... --json` as a subprocess.

Tests, llama-bench style, on random token ids:
  ppN   time to evaluate an N-token prompt in a fresh context (prefill tok/s)
  tgN   N single-token decode steps after a short prompt (decode tok/s)
Each rep is one subprocess per tool, alternating kvrun, llama.cpp, kvrun, ... and each
subprocess does one untimed warm-up run before the timed one; the table shows the median
over --reps. llama.cpp decode steps feed pre-drawn random ids (no sampling); kvrun decodes
greedily (an argmax per step).

Also recorded: load time and peak RSS of each side on the default model, and kvrun's load
time and peak RSS for the synthetic 8B preset `llama3-8b-synthetic --wtype q4` (unless
--skip-8b), and the wait a `kvrun generate` user sees: load + a 33-token prompt + its first
token, each tool in fresh processes (bench/first_token.py's runs). Load time is the model-load call alone (kvrun.run.runtime.load_runtime; llama.cpp's
Llama() constructor), imports excluded. Peak RSS is the subprocess's ru_maxrss (wait4).
Failures are recorded as 'failed: <reason>' and do not stop the run.

--synthetic-8b PATH: also compare both tools on one Llama-3-8B-body-sized file
(bench/synth_gguf.py: dim 4096, 32 layers, GQA 32/8, FFN 14336, random Q4_0 weights, the
default model's 49,152-token tokenizer; ~4.2 GB), written to PATH first if it is not there
(about half a minute). At that size the matmuls dominate rather than Python overhead as on
the 135M default model. --synthetic-tests (default pp128,tg32) run on it with the same
alternation, warm-ups, threads and reps; the rows are labelled "llama3-8b-shape Q4_0 (same
file)" (the file's type) and come with both sides' load time and peak RSS on it (kvrun's load time from the
load probe, one per rep). --baseline-wtype is not applied to it (a dense float32 copy of
an 8B body does not fit in memory). --tests '' then runs the file alone (no default-model
tests, load/RSS rows or preset rows).
--synthetic-layers N writes a shallower file for a quick check (its label says so).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import venv
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when imported by path (tests)
from bench_harness import (  # noqa: E402
    alternate,
    cpu_flags,
    cpu_model,
    log,
    machine,
    torch_version,
    utc_now,
    write_section,
)

BENCH_DIR = Path(__file__).resolve().parent
README = BENCH_DIR / "README.md"
VENV_DIR = BENCH_DIR / ".venv-llamacpp"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYNTH_8B = "llama3-8b-synthetic"
SAME_FILE_LABEL = "llama3-8b-shape {kind} (same file)"
SECTION_TITLE = "## kvrun vs llama.cpp (CPU)"
BEGIN, END = "<!-- vs-llamacpp:begin -->", "<!-- vs-llamacpp:end -->"
MiB = 1024 * 1024
# ggml's x86 options and the /proc/cpuinfo flag each needs: ON only where this CPU lists it (a
# fixed set crashed with SIGILL on an AMD EPYC without AVX-VNNI); AMX stays off (see above)
GGML_X86 = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2",
            "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
            "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16"}  # fmt: skip


def llamacpp_cmake() -> str:
    """CMAKE_ARGS for llama.cpp on this CPU: a native build, but AMX off; where the flags
    cannot be read (not Linux), ggml's own native detection."""
    flags = cpu_flags()
    off = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    if not flags:
        return " ".join(["-DGGML_NATIVE=ON", *off])
    on = [f"-DGGML_{k}={'ON' if f in flags else 'OFF'}" for k, f in GGML_X86.items()]
    return " ".join(["-DGGML_NATIVE=OFF", *off, *on])


WORKER = r"""
import json, random, resource, sys, time

cfg = json.loads(sys.argv[1])
import llama_cpp
from llama_cpp import Llama

t0 = time.perf_counter()
llm = Llama(
    model_path=cfg["model"],
    n_ctx=cfg["n_ctx"],
    n_batch=cfg["n_batch"],
    n_ubatch=cfg["n_batch"],
    n_threads=cfg["threads"],
    n_threads_batch=cfg["threads"],
    logits_all=False,
    verbose=False,
)
load_s = time.perf_counter() - t0
rng = random.Random(cfg["seed"])
n_vocab = llm.n_vocab()


def ids(n):
    return [rng.randrange(n_vocab) for _ in range(n)]


def pp(n):
    tokens = ids(n)
    llm.reset()
    t = time.perf_counter()
    llm.eval(tokens)
    return n / (time.perf_counter() - t)


def tg(n, n_prompt):
    prompt, steps = ids(n_prompt), ids(n)
    llm.reset()
    llm.eval(prompt)
    t = time.perf_counter()
    for tok in steps:
        llm.eval([tok])
    return n / (time.perf_counter() - t)


out = {"load_s": load_s, "version": llama_cpp.__version__}
try:
    out["system_info"] = llama_cpp.llama_print_system_info().decode().strip()
except Exception:
    pass
if cfg["kind"] == "pp":
    pp(cfg["n"])
    out["tok_s"] = pp(cfg["n"])
elif cfg["kind"] == "tg":
    tg(cfg["n"], cfg["tg_prompt"])
    out["tok_s"] = tg(cfg["n"], cfg["tg_prompt"])
out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(out))
"""

KVRUN_LOAD_PROBE = r"""
import json, resource, sys, time

spec, wtype = sys.argv[1], sys.argv[2]
from kvrun.run.runtime import load_runtime

t0 = time.perf_counter()
rt = load_runtime(spec, wtype=wtype, log=lambda s: None)
load_s = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"load_s": load_s, "peak_rss_bytes": rss}))
"""


# ---------------------------------------------------------------- subprocesses


class Failed(Exception):
    """A measurement that did not produce a number; str() is the one-line reason."""


def one_line(text: str, limit: int = 160) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = lines[-1] if lines else "no output"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _limit_memory(gb: float):
    def apply() -> None:
        if gb > 0:
            n = int(gb * 1024**3)
            resource.setrlimit(resource.RLIMIT_AS, (n, n))

    return apply


def run_measured(cmd: list[str], env: dict, timeout: float, mem_gb: float = 0) -> dict:
    """Run cmd; return rc, stdout, stderr, wall seconds and the child's peak RSS (wait4)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, env=env, preexec_fn=_limit_memory(mem_gb)
        )
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return {
            "rc": proc.returncode,
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace"),
            "wall_s": wall,
            "maxrss_bytes": usage.ru_maxrss * 1024,
            "timed_out": wall >= timeout,
        }


def last_json(res: dict, what: str) -> dict:
    """The last JSON object line on a run's stdout, or Failed with a one-line reason."""
    if res["timed_out"]:
        raise Failed(f"{what}: timed out after {res['wall_s']:.0f} s")
    if res["rc"] != 0:
        reason = one_line(res["stderr"] or res["stdout"])
        raise Failed(f"{what}: exit {res['rc']}: {reason}")
    for line in reversed(res["stdout"].splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise Failed(f"{what}: no JSON on stdout: {one_line(res['stdout'])}")


def thread_env(threads: int) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    return env


# ---------------------------------------------------------------- llama-cpp-python venv


def venv_python() -> Path:
    return VENV_DIR / "bin" / "python"


def llamacpp_version() -> str | None:
    py = venv_python()
    if not py.exists():
        return None
    code = "import llama_cpp; print(llama_cpp.__version__)"
    res = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else None


def pip(args: list[str], env: dict | None = None) -> None:
    cmd = [str(venv_python()), "-m", "pip", "install", *args]
    log("$ " + shlex.join(cmd))
    subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)


def ensure_llamacpp() -> tuple[str, float | None]:
    """llama-cpp-python's version in the venv, installing it first if missing or built for
    other CMAKE_ARGS (the venv records them: a venv carried to another CPU is rebuilt); and
    the install's wall seconds (None when it was already there)."""
    cmake_args = os.environ.get("CMAKE_ARGS", llamacpp_cmake())
    stamp = VENV_DIR / "kvrun-cmake-args"
    version = llamacpp_version()
    built_for = stamp.read_text() if stamp.exists() else None
    if version and built_for in (None, cmake_args):  # None: built before the stamp existed
        return version, None
    t0 = time.perf_counter()
    if not venv_python().exists():
        log(f"creating {VENV_DIR}")
        venv.EnvBuilder(with_pip=True).create(VENV_DIR)
    if shutil.which("cmake") is None:
        pip(["cmake"])
    env = dict(os.environ)
    env["CMAKE_ARGS"] = cmake_args
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    env["PATH"] = f"{VENV_DIR / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    log(
        "building llama-cpp-python from source (CMAKE_ARGS="
        f"{env['CMAKE_ARGS']}); this takes several minutes..."
    )
    force = ["--force-reinstall", "--no-deps"] if version else []
    pip(["--no-cache-dir", *force, "llama-cpp-python"], env=env)
    stamp.write_text(cmake_args)
    seconds = time.perf_counter() - t0
    version = llamacpp_version()
    if not version:
        sys.exit("llama-cpp-python installed but `import llama_cpp` fails in the venv")
    log(f"llama-cpp-python {version} installed in {seconds:.0f} s")
    return version, seconds


# ---------------------------------------------------------------- the two sides


def parse_test(name: str) -> tuple[str, int]:
    m = re.fullmatch(r"(pp|tg)(\d+)", name.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad test {name!r}: use ppN or tgN")
    return m.group(1), int(m.group(2))


def kvrun_cmd(args, model: str, n_prompt: int, n_gen: int, wtype: str | None) -> list[str]:
    cmd = ["kvrun", "bench", "-m", model, "-p", str(n_prompt), "-n", str(n_gen)]
    cmd += ["-r", "1", "--kv", "full", "--json"]
    if wtype:
        cmd += ["--wtype", wtype]
    return cmd + shlex.split(args.kvrun_args)


def kvrun_test(args, kind: str, n: int, wtype: str | None = None) -> dict:
    """One kvrun bench subprocess: tok/s of the test and its peak RSS."""
    p, g = (n, 0) if kind == "pp" else (args.tg_prompt, n)
    cmd = kvrun_cmd(args, args.model, p, g, wtype or args.wtype)
    res = run_measured(cmd, thread_env(args.threads), args.timeout)
    data = last_json(res, "kvrun bench")
    row = data["rows"][0]
    key = "prefill_tok_s" if kind == "pp" else "decode_tok_s"
    threads = data.get("machine", {}).get("threads")
    if threads is not None and threads != args.threads:
        log(f"warning: kvrun ran with {threads} torch threads, not {args.threads}")
    return {
        "tok_s": row[key],
        "peak_rss_bytes": row.get("peak_mem_bytes") or res["maxrss_bytes"],
        "wait4_maxrss_bytes": res["maxrss_bytes"],
        "wtype": data.get("settings", {}).get("wtype"),
        "dtype": data.get("settings", {}).get("dtype"),
        "threads": threads,
        "wall_s": res["wall_s"],
    }


def kvrun_load(args, spec: str, wtype: str) -> dict:
    cmd = [sys.executable, "-c", KVRUN_LOAD_PROBE, spec, wtype]
    res = run_measured(cmd, thread_env(args.threads), args.timeout, args.mem_limit_gb)
    data = last_json(res, f"kvrun load {spec}")
    data["peak_rss_bytes"] = max(data["peak_rss_bytes"], res["maxrss_bytes"])
    return data


def llamacpp_run(args, kind: str, n: int, n_ctx: int) -> dict:
    cfg = {
        "model": args.model,
        "kind": kind,
        "n": n,
        "n_ctx": n_ctx,
        "n_batch": args.n_batch,
        "threads": args.threads,
        "tg_prompt": args.tg_prompt,
        "seed": args.seed,
    }
    cmd = [str(venv_python()), "-c", WORKER, json.dumps(cfg)]
    res = run_measured(cmd, thread_env(args.threads), args.timeout)
    data = last_json(res, "llama.cpp worker")
    data["wall_s"] = res["wall_s"]
    data["peak_rss_bytes"] = max(data["peak_rss_bytes"], res["maxrss_bytes"])
    return data


def attempt(fn, *a) -> dict:
    try:
        return fn(*a)
    except Failed as e:
        return {"failed": str(e)}
    except (KeyError, IndexError, ValueError, OSError) as e:
        return {"failed": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------- orchestration


def needed_ctx(args, tests: list[tuple[str, int]]) -> int:
    need = max(n if k == "pp" else args.tg_prompt + n for k, n in tests)
    return max(512, -(-need // 256) * 256)


def tools(args) -> list[str]:
    """The columns: kvrun as asked, llama.cpp, and kvrun with --baseline-wtype if given."""
    return ["kvrun", "llama.cpp"] + (
        [f"kvrun {args.baseline_wtype}"] if args.baseline_wtype else []
    )


def run_tests(args, tests: list[tuple[str, int]]) -> dict:
    """For each test, alternate kvrun and llama.cpp --reps times."""
    n_ctx = needed_ctx(args, tests)
    results = {}
    for kind, n in tests:
        name = f"{kind}{n}"
        runners = {}
        for tool in tools(args):
            if tool == "kvrun":
                runners[tool] = lambda k=kind, n=n: attempt(kvrun_test, args, k, n)
            elif tool == "llama.cpp":
                runners[tool] = lambda k=kind, n=n: attempt(llamacpp_run, args, k, n, n_ctx)
            else:  # "kvrun <wtype>": the baseline path, side by side
                w = tool.split()[1]
                runners[tool] = lambda k=kind, n=n, w=w: attempt(kvrun_test, args, k, n, w)

        def shown(tool: str, rep: int, r: dict, name: str = name) -> None:
            got = r.get("failed") or f"{r['tok_s']:.1f} tok/s"
            log(f"{name} rep {rep + 1}/{args.reps} {tool}: {got}")

        results[name] = alternate(runners, args.reps, each=shown)
    return results


def median_of(runs: list[dict], key: str = "tok_s") -> float | str:
    xs = [r[key] for r in runs if key in r]
    if xs:
        return statistics.median(xs)
    fails = [r["failed"] for r in runs if "failed" in r]
    return f"failed: {fails[0]}" if fails else "-"


def max_of(runs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in runs if key in r]
    return max(xs) if xs else None


def load_and_rss(args, results: dict, show: bool = False) -> dict:
    """Both tools' load time and peak RSS on args.model: kvrun's load probe --reps times,
    llama.cpp's from its test runs; the peak over the tests' runs and the probes."""
    wtype = args.wtype or "auto"
    loads = [attempt(kvrun_load, args, args.model, wtype) for _ in range(args.reps)]
    for i, r in enumerate(loads if show else []):
        shown = r.get("failed") or f"{r['load_s']:.1f} s"
        log(f"kvrun load rep {i + 1}/{args.reps}: {shown}")
    runs = {t: [r for v in results.values() for r in v[t]] for t in ("kvrun", "llama.cpp")}
    return {
        "kvrun": {
            "load_s": median_of(loads, "load_s"),
            "peak_rss_bytes": max_of(runs["kvrun"] + loads, "peak_rss_bytes"),
            "load_runs": loads,
        },
        "llama.cpp": {
            "load_s": median_of(runs["llama.cpp"], "load_s"),
            "peak_rss_bytes": max_of(runs["llama.cpp"], "peak_rss_bytes"),
        },
    }


def first_tokens(args) -> dict:
    """Load + a ~40-token prompt + its first token, each tool in fresh processes (alternating,
    --reps times; bench/first_token.py's runs, which also split load from first token)."""
    import first_token as ft

    env = thread_env(args.threads)
    m = ["-m", args.model] + (["--wtype", args.wtype] if args.wtype else [])
    ft.kvrun_run(m, env)  # a file's first packed load fills the packed cache
    runs: dict = {"kvrun": [], "llama.cpp": []}
    for rep in range(args.reps):
        for tool, r in (("kvrun", ft.kvrun_run(m, env)),
                        ("llama.cpp", ft.llamacpp_run(args.model, args.threads))):  # fmt: skip
            if "error" in r:
                r = {"failed": r["error"]}
            else:
                r["s"] = r["load_s"] + r["ttft_s"]
            runs[tool].append(r)
            shown = r.get("failed") or f"{r['s']:.2f} s"
            log(f"load + first token rep {rep + 1}/{args.reps} {tool}: {shown}")
    tokens = next((r["prompt_tokens"] for r in runs["kvrun"] if "prompt_tokens" in r), "?")
    return {"tokens": tokens, **{t: median_of(v, "s") for t, v in runs.items()}}


def collect_memory(args, results: dict) -> dict:
    """Load time and peak RSS: default model on both sides, the 8B preset on kvrun."""
    mem: dict = {"default": load_and_rss(args, results), "first": first_tokens(args)}
    if not args.skip_8b:
        log(f"kvrun: loading {SYNTH_8B} --wtype q4 (RLIMIT_AS {args.mem_limit_gb} GB)")
        r = attempt(kvrun_load, args, SYNTH_8B, "q4")
        log("  " + (r.get("failed") or f"{r['load_s']:.1f} s"))
        mem["8b"] = r
        log(f"kvrun: {SYNTH_8B} --wtype q4 decode (tg8 after a {args.tg_prompt}-token prompt)")
        r = attempt(kvrun_8b_decode, args)
        log("  " + (r.get("failed") or f"{r['tok_s']:.2f} tok/s"))
        mem["8b_decode"] = r
    return mem


def kvrun_8b_decode(args) -> dict:
    """Decode tok/s and peak RSS of the 8B preset at q4 (one rep after the warm-up)."""
    cmd = kvrun_cmd(args, SYNTH_8B, args.tg_prompt, 8, "q4")
    res = run_measured(cmd, thread_env(args.threads), args.timeout)
    row = last_json(res, "kvrun bench 8b")["rows"][0]
    return {"tok_s": row["decode_tok_s"], "peak_rss_bytes": res["maxrss_bytes"]}


# ---------------------------------------------------------------- the same 8B-shaped file


def synth_label(layers: int | None, kind: str = "Q4_0") -> str:
    label = SAME_FILE_LABEL.format(kind=kind)
    if layers in (None, 32):
        return label
    return label.replace(" (", f", {layers} layers (", 1)


def file_field(path: str, key: str):
    """One metadata value of a GGUF file (None if unreadable)."""
    try:
        import gguf

        f = gguf.GGUFReader(path, "r").fields.get(key)
        return f.contents() if f is not None else None
    except Exception:  # noqa: BLE001 - only the label depends on it
        return None


def file_layers(path: str) -> int | None:
    """llama.block_count of a GGUF file."""
    n = file_field(path, "llama.block_count")
    return int(n) if n is not None else None


def file_kind(path: str) -> str:
    """The file's type as llama.cpp names it (general.file_type: Q4_0, Q4_K_M, ...)."""
    import gguf

    code = file_field(path, "general.file_type")
    try:
        return gguf.LlamaFileType(int(code)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return "Q4_0"


def ensure_synthetic(args) -> dict:
    """The --synthetic-8b file: written by bench/synth_gguf.py if missing (tokenizer from
    the default model). Returns path, layers, bytes and the creation record (or None)."""
    path = str(Path(args.synthetic_8b).expanduser())
    created = None
    if not Path(path).is_file():
        from synth_gguf import write_synthetic

        log(f"writing {path} ({args.synthetic_layers} layers, random Q4_0) ...")
        try:
            created = write_synthetic(
                path, args.synthetic_layers, tokenizer_from=default_model(), log=log
            )
        except FileNotFoundError as e:
            sys.exit(str(e))
        log(f"  {created['bytes'] / 1e9:.2f} GB in {created['seconds']:.1f} s")
    layers = created["layers"] if created else file_layers(path)
    return {
        "path": path,
        "layers": layers,
        "label": synth_label(layers, file_kind(path)),
        "bytes": Path(path).stat().st_size,
        "created": created,
    }


def run_synthetic(args, synth: dict) -> dict:
    """The --synthetic-tests on the same file through run_tests (kvrun and llama.cpp only),
    then kvrun's load probe on it; fills synth['results'] and synth['memory']."""
    s = argparse.Namespace(**vars(args))
    s.model, s.baseline_wtype = synth["path"], None
    log(f"{synth['label']}: {Path(s.model).name}")
    results = run_tests(s, args.synthetic_test_list)
    synth["results"] = results
    synth["memory"] = load_and_rss(s, results, show=True)
    return synth


def synth_rows(synth: dict) -> list[str]:
    """Table rows of the same-file comparison (kvrun and llama.cpp columns)."""
    label, lines = synth["label"], []
    for name, runs in synth["results"].items():
        k, ll = median_of(runs["kvrun"]), median_of(runs["llama.cpp"])
        lines.append(f"| {label}: {name} | {fmt(k)} | {fmt(ll)} | {ratio(k, ll)} |")
    m = synth["memory"]
    k, ll = m["kvrun"]["load_s"], m["llama.cpp"]["load_s"]
    lines.append(f"| {label}: load time (s) | {fmt(k, 2)} | {fmt(ll, 2)} | {ratio(k, ll)} |")
    k, ll = mib(m["kvrun"]["peak_rss_bytes"]), mib(m["llama.cpp"]["peak_rss_bytes"])
    lines.append(f"| {label}: peak RSS (MiB) | {fmt(k, 0)} | {fmt(ll, 0)} | {ratio(k, ll)} |")
    return lines


def synth_line(synth: dict) -> str:
    layers = synth["layers"] if synth["layers"] is not None else "?"
    made = synth["created"]
    made = f", written in {made['seconds']:.0f} s" if made else ""
    return (
        f"- {synth['label']}: {Path(synth['path']).name} ({synth['bytes'] / 1e9:.2f} GB, "
        f"bench/synth_gguf.py{made}): Llama-3-8B body (dim 4096, {layers} layers, 32/8 heads, "
        f"FFN 14336), random Q4_0 weights, the default model's 49,152-token vocabulary; "
        f"kvrun {kvrun_settings(synth['results'])}; no baseline column"
    )


# ---------------------------------------------------------------- report


def fmt(x, digits: int = 1) -> str:
    if isinstance(x, str):
        return x
    return "-" if x is None else f"{x:,.{digits}f}"


def ratio(a, b) -> str:
    ok = isinstance(a, float | int) and isinstance(b, float | int) and b
    return f"{a / b:.2f}x" if ok else "-"


def mib(x) -> float | str | None:
    return x / MiB if isinstance(x, int | float) else x


def table(results: dict, mem: dict, synth: dict | None = None) -> str:
    first = next(iter(results.values()), {})
    extra = [t for t in first if t not in ("kvrun", "llama.cpp")]
    head = "| test | kvrun tok/s | llama.cpp tok/s | kvrun / llama.cpp |"
    head += "".join(f" {t} tok/s | kvrun / {t} |" for t in extra)
    lines = [head, "| --- |" + " ---: |" * (3 + 2 * len(extra))]
    for name, runs in results.items():
        k, ll = median_of(runs["kvrun"]), median_of(runs["llama.cpp"])
        row = f"| {name} | {fmt(k)} | {fmt(ll)} | {ratio(k, ll)} |"
        for t in extra:
            b = median_of(runs[t])
            row += f" {fmt(b)} | {ratio(k, b)} |"
        lines.append(row)
    lines_before = len(lines)
    d = mem.get("default")
    if d is not None:
        k, ll = d["kvrun"]["load_s"], d["llama.cpp"]["load_s"]
        lines.append(f"| load time (s) | {fmt(k, 2)} | {fmt(ll, 2)} | {ratio(k, ll)} |")
        k, ll = mib(d["kvrun"]["peak_rss_bytes"]), mib(d["llama.cpp"]["peak_rss_bytes"])
        lines.append(f"| peak RSS (MiB) | {fmt(k, 0)} | {fmt(ll, 0)} | {ratio(k, ll)} |")
    f = mem.get("first")
    if f is not None:
        k, ll = f["kvrun"], f["llama.cpp"]
        label = f"load + {f['tokens']}-token prompt + first token (s)"
        lines.append(f"| {label} | {fmt(k, 2)} | {fmt(ll, 2)} | {ratio(k, ll)} |")
    name = f"{SYNTH_8B} --wtype q4"
    shown = {"8b": ("load", "load time (s)", "load_s", 1, "after load"),
             "8b_decode": ("decode", "decode tok/s", "tok_s", 2, "while decoding")}  # fmt: skip
    for key, (what, label, field, digits, when) in shown.items():
        r = mem.get(key)
        if r is None:
            continue
        if "failed" in r:
            lines.append(f"| {name}: {what} | {r['failed']} | - | - |")
            continue
        lines.append(f"| {name}: {label} | {fmt(r[field], digits)} | - | - |")
        rss = fmt(mib(r["peak_rss_bytes"]), 0)
        lines.append(f"| {name}: peak RSS {when} (MiB) | {rss} | - | - |")
    if synth is not None:
        lines += synth_rows(synth)
    if extra:  # the memory rows have no baseline cells
        lines[lines_before:] = [ln + " - | - |" * len(extra) for ln in lines[lines_before:]]
    return "\n".join(lines)


def kvrun_settings(results: dict) -> str:
    for runs in results.values():
        for r in runs["kvrun"]:
            if "wtype" in r:
                return f"wtype {r['wtype']}, dtype {r['dtype']}"
    return "settings unknown"


def section(args, meta: dict, results: dict, mem: dict, synth: dict | None = None) -> str:
    lines = [
        SECTION_TITLE,
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta['cpu']}, {args.threads} threads ({os.cpu_count()} CPUs visible)",
        f"- torch {meta['torch']}; llama-cpp-python {meta['llamacpp']}",
    ]
    if results:
        lines.append(
            f"- model: {Path(args.model).name}; kvrun --kv full, {kvrun_settings(results)}; "
            f"llama.cpp n_batch = n_ubatch = {args.n_batch}"
        )
    if synth is not None:
        lines.append(synth_line(synth))
    lines += [
        f"- command: `{meta['command']}`",
        f"- median of {args.reps} reps per cell, tools alternating, one warm-up each; tg "
        f"after a {args.tg_prompt}-token prompt; random token ids",
        "",
        table(results, mem, synth),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def default_model() -> str:
    env = os.environ.get("KVRUN_MODELS")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "kvrun" / "models"
    return str(root / DEFAULT_MODEL_FILE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="kvrun vs llama.cpp (llama-cpp-python) speed on one GGUF file.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--model", default=default_model(), help="GGUF file (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="subprocess pairs per test (median)")
    ap.add_argument(
        "--tests",
        default="pp512,pp2048,tg128",
        help="comma list of ppN / tgN on --model ('' with --synthetic-8b: none)",
    )
    ap.add_argument("--wtype", help="passed to kvrun as --wtype (default: kvrun's default)")
    ap.add_argument(
        "--baseline-wtype",
        help="also run kvrun with this --wtype in the same alternation (e.g. f32, the dense path)",
    )
    ap.add_argument("--kvrun-args", default="", help="extra arguments for `kvrun bench`")
    ap.add_argument("--skip-8b", action="store_true", help=f"skip the {SYNTH_8B} load")
    ap.add_argument(
        "--synthetic-8b",
        metavar="PATH",
        help="also run both tools on this Llama-3-8B-shaped Q4_0 GGUF file, written there "
        "by bench/synth_gguf.py if missing",
    )
    ap.add_argument(
        "--synthetic-tests", default="pp128,tg32", help="tests on the --synthetic-8b file"
    )
    ap.add_argument(
        "--synthetic-layers",
        type=int,
        default=32,
        help="block count when writing the --synthetic-8b file (default: %(default)s)",
    )
    ap.add_argument("--write", action="store_true", help="write the section into README.md")
    ap.add_argument("--json", metavar="PATH", help="save the raw numbers as JSON")
    ap.add_argument("--n-batch", type=int, default=512, help="llama.cpp n_batch = n_ubatch")
    ap.add_argument("--tg-prompt", type=int, default=16, help="prompt tokens before tgN")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    ap.add_argument(
        "--mem-limit-gb", type=float, default=16, help="RLIMIT_AS of kvrun load probes (0: none)"
    )
    args = ap.parse_args(argv)
    args.test_list = [parse_test(t) for t in args.tests.split(",") if t.strip()]
    args.synthetic_test_list = [parse_test(t) for t in args.synthetic_tests.split(",") if t.strip()]
    if not args.test_list and not (args.synthetic_8b and args.synthetic_test_list):
        ap.error("no tests to run")
    args.model = str(Path(args.model).expanduser())
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.test_list and not Path(args.model).is_file():
        sys.exit(f"no model file at {args.model} (try `kvrun pull smollm2`)")
    raw_argv = sys.argv[1:] if argv is None else argv
    version, build_s = ensure_llamacpp()
    meta = {
        "date": utc_now(),
        "cpu": cpu_model(),
        "machine": machine(gpu=False),  # ISA flags, cores, RAM: what the ratios depend on
        "torch": torch_version(),
        "llamacpp": version,
        "llamacpp_build_s": build_s,
        "command": shlex.join(["python", "bench/vs_llamacpp.py", *raw_argv]),
    }
    synth = ensure_synthetic(args) if args.synthetic_8b and args.synthetic_test_list else None
    t0 = time.perf_counter()
    results, mem = {}, {}
    if args.test_list:
        results = run_tests(args, args.test_list)
        mem = collect_memory(args, results)
    if synth is not None:
        run_synthetic(args, synth)
    meta["bench_s"] = time.perf_counter() - t0
    text = section(args, meta, results, mem, synth)
    print(text)
    if args.write:
        write_section(README, text, BEGIN, END)
        log(f"wrote the section into {README}")
    if args.json:
        raw = {"meta": meta, "args": vars(args), "results": results, "memory": mem}
        if synth is not None:
            raw["synthetic_8b"] = synth
        Path(args.json).write_text(json.dumps(raw, indent=2, default=str) + "\n")
        log(f"saved {args.json}")


if __name__ == "__main__":
    main()
