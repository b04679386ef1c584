"""lm-evaluation-harness against `kvrun serve`: the two local tasks of this folder, once per
KV method, through lm-eval's `local-completions` model (OpenAI's completions API).

    python bench/lm_eval_tasks/lm_eval_run.py                                  # full, snapkv 0.25, streaming 0.25
    python bench/lm_eval_tasks/lm_eval_run.py --kv full --kv "snapkv 0.1" --write

lm-eval is a bench dependency, not a kvrun one: it runs from the virtual environment
bench/.venv-lmeval (made on first use: `python -m venv --system-site-packages` so that it
sees this torch, then `pip install "lm-eval[api]"`). For each method the script starts
`kvrun serve --kv M --kv-budget B -np 4`, exports the model's tokenizer for lm-eval (kvrun's
Tokenizer.save_hf: lm-eval counts context tokens with it and sends token ids), runs

    lm_eval --model local-completions --tasks kvrun_mc,kvrun_passkey --include_path bench/lm_eval_tasks
        --model_args model=smollm2,base_url=http://127.0.0.1:PORT/v1/completions,
                     tokenizer_backend=huggingface,tokenizer=TOKENIZER_DIR,num_concurrent=4

and collects the scores (kvrun_mc: acc and acc_norm from log-likelihoods; kvrun_passkey:
exact match of the generated key). The table goes to stdout and, with --write, into
bench/README.md between lm-eval markers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import subprocess
import sys
import time
import venv
from pathlib import Path

from kvrun.server import wait_ready

HERE = Path(__file__).parent
BENCH = HERE.parent
VENV = BENCH / ".venv-lmeval"
OUT = HERE / "out"
README = BENCH / "README.md"
BEGIN, END = "<!-- lm-eval:begin -->", "<!-- lm-eval:end -->"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def lm_eval() -> Path:
    exe = VENV / "bin" / "lm_eval"
    if not exe.exists():
        log(f"creating {VENV} with lm-eval (a few minutes)")
        venv.EnvBuilder(with_pip=True, system_site_packages=True).create(VENV)
        pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", "lm-eval[api]"]
        subprocess.run(pip, check=True)
    return exe


def tokenizer_dir(model: str | None) -> Path:
    from kvrun.run.runtime import load_runtime

    rt = load_runtime(model, "float32", "cpu", log=lambda m: None)
    out = OUT / "tokenizer"
    rt.tokenizer.save_hf(out, model_max_length=rt.config.context_length)
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(kv: str, a, tok: Path) -> dict:
    method, _, budget = kv.partition(" ")
    port = free_port()
    cmd = [sys.executable, "-m", "kvrun", "serve", "--alias", "smollm2", "--port", str(port),
           "-np", str(a.parallel), "--kv", method, *(["--kv-budget", budget] if budget else []),
           *(["-m", a.model] if a.model else [])]  # fmt: skip
    log("$ " + shlex.join(cmd))
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", server, timeout=120)
        out = OUT / kv.replace(" ", "_")
        margs = (f"model=smollm2,base_url=http://127.0.0.1:{port}/v1/completions,"
                 f"tokenizer_backend=huggingface,tokenizer={tok},num_concurrent={a.parallel},"
                 "max_retries=1,tokenized_requests=True")  # fmt: skip
        ev = [str(lm_eval()), "--model", "local-completions", "--model_args", margs,
              "--tasks", a.tasks, "--include_path", str(HERE), "--output_path", str(out),
              "--batch_size", "1"]  # fmt: skip
        log("$ " + shlex.join(ev))
        t0 = time.perf_counter()
        subprocess.run(ev, check=True, stdout=sys.stderr, cwd=HERE)  # data_files: mc.jsonl, ...
        wall = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(30)
    res = max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return {"kv": kv, "results": json.loads(res.read_text())["results"], "wall_s": wall}


def table(rows: list[dict]) -> str:
    out = ["| --kv | kvrun_mc acc | acc_norm | kvrun_passkey exact match | lm_eval wall (s) |",
           "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        mc, pk = r["results"].get("kvrun_mc", {}), r["results"].get("kvrun_passkey", {})
        em = next((v for k, v in pk.items() if k.startswith("exact_match,")), float("nan"))
        out.append(f"| {r['kv']} | {mc.get('acc,none', float('nan')):.3f} "
                   f"| {mc.get('acc_norm,none', float('nan')):.3f} | {em:.3f} "
                   f"| {r['wall_s']:.0f} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--kv", action="append", help='"METHOD [BUDGET]" (repeat)')
    ap.add_argument("--tasks", default="kvrun_mc,kvrun_passkey")
    ap.add_argument("-np", "--parallel", type=int, default=4)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    kvs = a.kv or ["full", "snapkv 0.25", "streaming 0.25"]
    OUT.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_dir(a.model)
    rows = [run_one(kv, a, tok) for kv in kvs]
    text = f"`python {shlex.join(sys.argv)}` ({dt.date.today()})\n\n{table(rows)}"
    print(text)
    if a.write:
        sys.path.insert(0, str(BENCH))
        from bench_harness import write_section

        write_section(README, f"## lm-evaluation-harness against kvrun serve\n\n{text}", BEGIN, END)


if __name__ == "__main__":
    main()
