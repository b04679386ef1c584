"""Long contexts on the CPU: every KV method against the full cache and llama.cpp's caches, one
table (issue 47's): KV bytes, peak RSS, prefill and decode tok/s, decode vs full.

    python bench/long_context.py                               # default model, 8,000 tokens
    python bench/long_context.py --json bench/long_context.json --markdown
    python bench/long_context.py -m /tmp/shapes/qwen3-0.6b.q8_0.gguf --tokens 32000 \
        --methods full,snapkv,kivi2 --llamacpp f16             # bench/family_shapes.py's file
    python bench/long_context.py --methods full,kivi2 --no-llamacpp   # a quick look

Each row is its own `kvrun generate -f PROMPT --raw --json --temp 0 --ignore-eos -n N` process
(so its peak RSS is its own), the prompt the GPL-3 text repeated and cut to --tokens tokens.
Selecting methods run at --kv-budget 0.1 (--budget), the others at their defaults; the rows
are every method of `kvrun kv list` and the stacks in STACKS. llama.cpp (llama-cpp-python in
bench/.venv-llamacpp, built by bench/vs_llamacpp.py on first use) evaluates the same text with
its f16 cache, f16 with flash attention, and a q8_0 cache with flash attention (llama.cpp
quantizes V only with flash attention; --llamacpp picks among them), then feeds N greedy tokens
one at a time. Both sides use --threads threads. KV bytes: kvrun's as measured by the cache
(kv_bytes); llama.cpp's from its layout (2 * layers * Hkv * D * n_ctx at the type's bytes).
"decode vs full" is each row's decode tok/s over the full cache's in the same run.

On a shared or noisy machine one process's rate moves by 20-30% from run to run; --rounds N
runs every row N times, round after round (each round the rows in order), and prints each
row's median prefill and decode, and its "vs full" as the median of the rounds' ratios (each
round's row over that round's full: a ratio taken side by side, not of two medians):

    python bench/long_context.py --methods full,kivi2,minicache --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import vs_llamacpp as peer

TEXT = Path("/usr/share/common-licenses/GPL-3")
STACKS = ["snapkv+kivi2", "pyramidkv+kivi2", "xkv+kivi2", "minicache+kivi4"]
# llama.cpp's caches: --llamacpp's name -> (label, flash attention, K/V type as ggml's number)
LLAMACPP = {"f16": ("f16 cache", False, 1), "f16+fa": ("f16 + flash attention", True, 1), "q8_0+fa": ("q8_0 + flash attention", True, 8)}  # fmt: skip
ELEM = {1: 2.0, 8: 34 / 32}

WORKER = r"""
import json, sys, time
import numpy as np
cfg = json.loads(sys.argv[1])
from llama_cpp import Llama

kw = dict(model_path=cfg["model"], n_ctx=cfg["n_ctx"], n_batch=512, n_ubatch=512,
          n_threads=cfg["threads"], n_threads_batch=cfg["threads"], type_k=cfg["type"],
          type_v=cfg["type"], verbose=False)
try:
    llm = Llama(flash_attn=cfg["flash"], **kw)
except TypeError:  # newer llama-cpp-python: flash_attn_type (1 = enabled, 0 = disabled)
    llm = Llama(flash_attn_type=1 if cfg["flash"] else 0, **kw)
text = open(cfg["prompt"]).read()
toks = llm.tokenize(text.encode(), add_bos=True)
t0 = time.perf_counter()
llm.eval(toks)
t1 = time.perf_counter()
n_vocab = llm.n_vocab()
out = []
for _ in range(cfg["n"]):
    # the last token's logits (llama-cpp-python 0.3 keeps no scores without logits_all)
    row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
    tok = int(np.argmax(row))
    out.append(tok)
    llm.eval([tok])
t2 = time.perf_counter()
print(json.dumps({"prompt_tokens": len(toks), "prefill_tok_s": len(toks) / (t1 - t0),
                  "decode_tok_s": cfg["n"] / (t2 - t1), "tokens": out}))
"""


def prompt_file(tokens: int, model: str | None, path: Path) -> Path:
    """The GPL-3 text repeated and cut to `tokens` tokens of the model's tokenizer."""
    from kvrun.run.runtime import load_runtime

    rt = load_runtime(model, log=lambda s: None)
    text = TEXT.read_text()
    ids = rt.tokenizer.encode(text * (tokens // len(rt.tokenizer.encode(text)) + 2))[:tokens]
    path.write_text(rt.tokenizer.decode(ids))
    return path


def rows(methods: list[str] | None, budget: str) -> list[tuple[str, str | None]]:
    """(--kv, --kv-budget) of every row: the registry's methods, then the stacks."""
    from kvrun.kv import REGISTRY, check

    names = methods or [*REGISTRY, *STACKS]
    return [(m, budget if check(m).takes_budget else None) for m in names]


def kvrun_row(args, prompt: Path, kv: str, budget: str | None) -> dict:
    cmd = [sys.executable, "-m", "kvrun", "generate", "-f", str(prompt), "--raw", "--json"]
    cmd += ["--temp", "0", "--ignore-eos", "-n", str(args.n), "-c", str(args.ctx), "--kv", kv]
    cmd += ["--quiet", *(["-m", args.model] if args.model else [])]
    cmd += ["--kv-budget", budget] if budget else []
    cmd += ["--kv-dtype", args.kv_dtype] if args.kv_dtype else []
    res = peer.run_measured(cmd, peer.thread_env(args.threads), args.timeout)
    j = peer.last_json(res, f"kvrun --kv {kv}")
    return {
        "kv_bytes": j["kv_bytes"],
        "peak_rss_bytes": res["maxrss_bytes"],
        "prefill_tok_s": j["prefill_tok_s"],
        "decode_tok_s": j["decode_tok_s"],
        "prompt_tokens": j["prompt_tokens"],
        "kv_dtype": j.get("kv", {}).get("kv_dtype") if isinstance(j.get("kv"), dict) else None,
    }


def llamacpp_row(args, prompt: Path, flash: bool, kind: int, shape: dict) -> dict:
    cfg = {"model": args.model_path, "n_ctx": args.ctx, "threads": args.threads, "flash": flash,
           "type": kind, "prompt": str(prompt), "n": args.n}  # fmt: skip
    cmd = [str(peer.venv_python()), "-c", WORKER, json.dumps(cfg)]
    res = peer.run_measured(cmd, peer.thread_env(args.threads), args.timeout)
    j = peer.last_json(res, "llama.cpp")
    per_tok = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * ELEM[kind]
    return {
        "kv_bytes": int(per_tok * args.ctx),
        "peak_rss_bytes": res["maxrss_bytes"],
        "prefill_tok_s": j["prefill_tok_s"],
        "decode_tok_s": j["decode_tok_s"],
        "prompt_tokens": j["prompt_tokens"],
    }


def model_shape(model: str | None) -> tuple[str, dict]:
    from kvrun.run.runtime import load_runtime

    rt = load_runtime(model, log=lambda s: None)
    c = rt.config
    shape = {"layers": c.n_layers, "kv_heads": c.n_kv_heads, "head_dim": c.head_dim}
    return str(rt.path), shape


def attempt(fn, *a) -> dict:
    try:
        return fn(*a)
    except peer.Failed as e:
        return {"failed": str(e)}


def summarise(runs: list[dict]) -> list[dict]:
    """Rows measured over rounds (a row's result per round, `round` in each) -> one result a
    row: the median of each rate over its rounds that did not fail, `rounds` the per-round
    results, and decode_vs_full the median of the rounds' ratios to that round's full."""
    labels = list(dict.fromkeys(r["row"] for r in runs))
    full = {r["round"]: r for r in runs if r["row"] == "full" and "failed" not in r}
    out = []
    for label in labels:
        mine = [r for r in runs if r["row"] == label]
        ok = [r for r in mine if "failed" not in r]
        if not ok:
            out.append({**mine[-1], "rounds": mine})
            continue
        row = {**ok[0], "rounds": mine}
        row.pop("round", None)
        for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_bytes"):
            row[key] = statistics.median(r[key] for r in ok)
        vs = [
            r["decode_tok_s"] / full[r["round"]]["decode_tok_s"] for r in ok if r["round"] in full
        ]
        if vs and row["tool"] == "kvrun":
            row["decode_vs_full"] = statistics.median(vs)
        out.append(row)
    return out


def table(results: list[dict]) -> str:
    lines = [
        "| --kv | KV bytes | peak RSS | prefill tok/s | decode tok/s | decode vs full |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['row']} | failed: {r['failed']} | | | | |")
            continue
        vs = f"{r['decode_vs_full']:.2f}x" if "decode_vs_full" in r else ""
        lines.append(
            f"| {r['row']} | {r['kv_bytes'] / 1e6:.1f} MB | {r['peak_rss_bytes'] / 1e6:.0f} MB "
            f"| {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} | {vs} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="kvrun -m (default: the default model)")
    ap.add_argument("--tokens", type=int, default=8000, help="prompt tokens")
    ap.add_argument("-n", type=int, default=64, help="greedy tokens decoded")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", default="0.1", help="--kv-budget of the selecting methods")
    ap.add_argument("--kv-dtype", default=None, help="kvrun's --kv-dtype (default: its own)")
    ap.add_argument("--methods", default=None, help="comma list of --kv rows (default: all)")
    ap.add_argument("--no-llamacpp", action="store_true", help="kvrun's rows only")
    ap.add_argument(
        "--llamacpp",
        default=",".join(LLAMACPP),
        help=f"llama.cpp's caches to run, a comma list of {', '.join(LLAMACPP)} (default: all; "
        "its q8_0 cache prefills at ~1/8 of f16's speed, hours at 32k)",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per row")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument(
        "--rounds", type=int, default=1, help="run every row this many times, alternated (medians)"
    )
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    caches = [c.strip() for c in args.llamacpp.split(",") if c.strip()]
    unknown = [c for c in caches if c not in LLAMACPP]
    if unknown:
        ap.error(f"--llamacpp: unknown cache {unknown[0]!r}; choose from {', '.join(LLAMACPP)}")
    args.ctx = args.tokens + args.n + 64
    args.model_path, shape = model_shape(args.model)
    prompt = prompt_file(args.tokens, args.model, Path(f"/tmp/long_context_{args.tokens}.txt"))
    runs = []

    def show(r: dict) -> None:
        runs.append(r)
        peer.log(json.dumps(r))

    methods = args.methods.split(",") if args.methods else None
    version = peer.ensure_llamacpp()[0] if not args.no_llamacpp and caches else None
    for rnd in range(args.rounds):
        for kv, budget in rows(methods, args.budget):
            label = f"{kv} {budget}" if budget else kv
            r = attempt(kvrun_row, args, prompt, kv, budget)
            show({"row": label, "tool": "kvrun", "round": rnd, **r})
        for label, flash, kind in [LLAMACPP[c] for c in caches] if version else []:
            r = attempt(llamacpp_row, args, prompt, flash, kind, shape)
            show({"row": f"llama.cpp {version}, {label}", "tool": "llama.cpp", "round": rnd, **r})
    results = summarise(runs)
    out = {"model": args.model_path, "tokens": args.tokens, "n": args.n, "threads": args.threads,
           "budget": args.budget, "rounds": args.rounds, "results": results}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
