"""Batched generation: `kvrun longdoc --parallel N` throughput against --parallel 1.

    python bench/parallel_batch.py [-m smollm2] [--docs 16] [--doc-tokens 1000] [-n 64]
                             [--parallel 1,4,8] [--kv full --kv snapkv] [--text FILE]
                             [--wtype auto] [--device auto] [--cuda-graph] [--out FILE]

Builds --docs documents of about --doc-tokens tokens from --text (default: the GPL-3 text
shipped with Debian, any long English text works), asks each the same question with greedy
decoding of -n tokens (--ignore-eos style: a stop token ends a document early, as in
longdoc), and runs the whole batch through the code `kvrun longdoc` runs (the same prompt
building, the sequential loop for N = 1, kvrun.run.engine for N > 1) on one loaded model, one
row per (--kv, N). Reports wall time for the batch, documents per minute, aggregate decode
tok/s (generated tokens over the time spent in decode steps) and the speedup over N = 1 of
the same --kv; checks that every document's tokens equal the N = 1 run's. The table goes to
stdout and into bench/README.md (or --out) between parallel markers, with date, machine and
command. On a GPU: `bash bench/gpu.sh parallel` (N = 1, 8, 32 with CUDA graphs).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from bench_harness import md_head, utc_now, write_section

from kvrun.kv import check
from kvrun.run.runtime import load_runtime, pick_device
from kvrun.run.sampling import SamplingConfig
from kvrun.run.session import Session
from kvrun.tasks import longdoc as task
from kvrun.tasks import longdoc_questions as batch
from kvrun.tasks.bench import machine

BEGIN, END = "<!-- parallel:begin -->", "<!-- parallel:end -->"
README = Path(__file__).with_name("README.md")
TEXT = "/usr/share/common-licenses/GPL-3"


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--parallel", default="1,4,8")
    ap.add_argument("--kv", action="append", default=None)
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--wtype", default="auto")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="decode steps replay CUDA graphs (kvrun longdoc --cuda-graph)")  # fmt: skip
    ap.add_argument("--out", default=str(README))
    return ap.parse_args()


def documents(tok, text: str, n: int, size: int) -> list[task.Doc]:
    """n documents of `size` tokens each, consecutive windows of the text (wrapping)."""
    ids = tok.encode(text, add_bos=False)
    docs = []
    for i in range(n):
        s = (i * size) % max(len(ids) - size, 1)
        docs.append(task.Doc(i, text=tok.decode(ids[s : s + size]), line=i + 1))
    return docs


def run(rt, spec, docs, a, parallel: int) -> tuple[float, dict, float, float, int]:
    """(wall s, tokens by id, prefill s, decode s, generated tokens) of one batch."""
    graph = "on" if a.cuda_graph else "off"
    sessions = [
        Session(rt.model, rt.tokenizer, rt.new_kv(spec), ubatch=a.ubatch, graph=graph)
        for _ in range(parallel)
    ]
    templates = {t: task.load_template(t) for t in ("question", "summarize")}
    job = task.LongdocJob(templates, "What is this text about? Answer in detail.", False,
                   rt.tokenizer.chat_template is not None, a.n, "middle",
                   SamplingConfig(temp=0.0), 0, {}, {})  # fmt: skip
    recs = []
    t0 = time.perf_counter()
    if parallel == 1:
        batch.run_batch(sessions[0], docs, job, recs.append, set(), lambda d: (None, None),
                       lambda d, r: None)  # fmt: skip
        prefill_s = sum(r["prefill_s"] for r in recs)
        decode_s = sum(r["decode_s"] for r in recs)
        gen = sum(max(r["generated_tokens"] - 1, 0) for r in recs)
    else:
        _, st = batch.run_parallel(sessions, docs, job, recs.append, set(), lambda d, r: None)
        prefill_s, decode_s, gen = st.prefill_s, st.decode_s, st.decode_tokens
    wall = time.perf_counter() - t0
    bad = [r["error"] for r in recs if r["error"]]
    if bad:
        raise SystemExit(f"a document failed: {bad[0]}")
    return wall, {r["id"]: r["tokens"] for r in recs}, prefill_s, decode_s, gen


def main() -> None:
    a = args()
    if a.cuda_graph and pick_device(a.device).type != "cuda":
        raise SystemExit("--cuda-graph needs a CUDA device (--device cuda)")
    rt = load_runtime(
        a.model, a.dtype, a.device, log=lambda m: print(m, file=sys.stderr), wtype=a.wtype
    )
    text = Path(a.text).read_text("utf-8", errors="replace")
    docs = documents(rt.tokenizer, text, a.docs, a.doc_tokens)
    rows, bounds = [], []
    for kv in a.kv or ["full", "snapkv"]:
        spec = check(kv)
        base, ref = None, None
        run(rt, spec, [task.Doc(**vars(d)) for d in docs[:2]], a, 2)  # warm-up (kernel probes)
        for n in (int(x) for x in a.parallel.split(",")):
            wall, toks, pre_s, dec_s, gen = run(rt, spec, [task.Doc(**vars(d)) for d in docs], a, n)
            same = "yes" if ref is None or toks == ref else "NO"
            ref = ref or toks
            if base is None:  # N = 1 (the first): wall / prefill bounds any N's speedup
                base = wall
                bounds.append(f"{kv} {wall / pre_s:.2f}x")
            rows.append(
                f"| {kv} | {n} | {wall:.1f} | {pre_s:.1f} | {dec_s:.1f} | "
                f"{60 * len(docs) / wall:.1f} | {gen / dec_s:.1f} | {base / wall:.2f}x | {same} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    m = machine(rt.model.device)
    head = md_head(["--kv", "--parallel", "wall s", "prefill s", "decode s", "documents / min",
                    "decode tok/s (aggregate)", "speedup", "tokens = N 1"], "lrrrrrrrl")  # fmt: skip
    body = "\n".join(
        [
            "## Batched generation (--parallel)",
            "",
            f"- date: {utc_now()}",
            f"- machine: {m['device_name']} ({m['device']}), {m['threads']} threads, "
            f"torch {m['torch']}",
            f"- model: {rt.path.name}, {str(rt.model.dtype).removeprefix('torch.')} "
            f"(wtype {rt.weights.wtype}){', CUDA graphs' if a.cuda_graph else ''}",
            f"- command: `python bench/parallel_batch.py {shlex.join(sys.argv[1:])}`",
            f"- {len(docs)} documents of {a.doc_tokens} tokens, one question each, greedy, "
            f"up to {a.n} tokens per answer; wall = the whole batch (prefill and decode)",
            "",
            *head,
            *rows,
            "",
            "Prefill chunks do not batch (one sequence's chunk a step, already a GEMM of "
            "--ubatch rows), so the speedup of any N is at most the first row's wall time "
            f"over its prefill time, the bound with decode steps free: {', '.join(bounds)}.",
        ]
    )
    print(body)
    write_section(Path(a.out), body, BEGIN, END)


if __name__ == "__main__":
    main()
