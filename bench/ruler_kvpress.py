"""RULER through kvrun and through kvpress on the same samples and the same weights.

kvrun's generator (kvrun.tasks.ruler) writes the samples as JSONL (context, question, answer
prefix, answers: kvpress's split). kvpress 0.5.5 answers them in its own virtual environment,
bench/.venv-kvpress (made on first use: `pip install torch==2.13.0`, then kvpress 0.5.5, which
needs transformers < 5.3; kvrun's own environment keeps its transformers), on the default model
converted to an HF safetensors folder with f32 weights (`kvrun convert --outtype f32`); `kvrun
ruler --wtype f32 --question-after` answers them on the same weights (kvpress compresses the
context alone, so the question comes after). Both sides' replies are scored by kvrun's RULER
scorer (RULER's string_match_all). kvpress's compression_ratio is 1 - kvrun's --kv-budget.

    python bench/ruler_kvpress.py --length 1024 --samples 2 --tasks niah_single_1,vt
    python bench/ruler_kvpress.py --write     (the table into bench/README.md)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_harness import log, utc_now, write_section  # noqa: E402

BENCH = Path(__file__).resolve().parent
VENV = BENCH / ".venv-kvpress"
WORK = BENCH / ".ruler-kvpress"  # the converted model, samples and answers (gitignored)
README = BENCH / "README.md"
BEGIN, END = "<!-- ruler-kvpress:begin -->", "<!-- ruler-kvpress:end -->"
KVRUN = Path(sys.executable).with_name("kvrun")
# kvrun method -> kvpress press; None: only one side has it
PAIRS = {
    "streaming": "StreamingLLMPress", "snapkv": "SnapKVPress", "knorm": "KnormPress",
    "tova": "TOVAPress", "kvzip": "KVzipPress", "kvzip:scope=model": "KVzipPress",
    "keydiff": "KeyDiffPress",
    "expected_attention": "ExpectedAttentionPress",
    "snapkv:scope=adaptive": "AdaKVPress(SnapKVPress)",
    "snapkv:critical=1": "CriticalKVPress(SnapKVPress)", None: None,
}  # fmt: skip
KVPRESS_ONLY: list[str] = []  # presses kvrun has no method for (rows of kvpress's alone)

WORKER = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
import kvpress

cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
tok = AutoTokenizer.from_pretrained(cfg["model"])
model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
samples = [json.loads(x) for x in open(cfg["samples"])]
done = set()
try:
    for x in open(cfg["out"]):
        r = json.loads(x)
        done.add((r["press"], r["ratio"], r["task"], r["index"]))
except FileNotFoundError:
    pass
with open(cfg["out"], "a") as out:
    for name, ratio in cfg["presses"]:
        if name == "none":
            press = None
        elif "(" in name:  # a wrapper press around a scorer: AdaKVPress(SnapKVPress)
            outer, inner = name.rstrip(")").split("(")
            press = getattr(kvpress, outer)(getattr(kvpress, inner)(compression_ratio=ratio))
        else:
            press = getattr(kvpress, name)(compression_ratio=ratio)
        for s in samples:
            if (name, ratio, s["task"], s["index"]) in done:
                continue
            t = time.perf_counter()
            reply = pipe(s["context"], question=s["question"], answer_prefix=s["answer_prefix"],
                         press=press, max_new_tokens=s["n_predict"])["answer"]
            rec = {"press": name, "ratio": ratio, "task": s["task"], "index": s["index"],
                   "reply": reply, "seconds": round(time.perf_counter() - t, 2)}
            out.write(json.dumps(rec) + "\n"); out.flush()
            print(name, ratio, s["task"], s["index"], repr(reply[:60]), file=sys.stderr, flush=True)
"""


def ensure_venv() -> Path:
    """bench/.venv-kvpress with torch 2.13.0 (the CPU wheel, before kvpress pulls any other)
    and kvpress 0.5.5 with transformers < 5.3."""
    py = VENV / "bin" / "python"
    if not py.exists():
        log(f"making {VENV}")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, "kvpress==0.5.5", "transformers<5.3"], check=True)
    return py


def ensure_model() -> Path:
    """The default model as an HF folder with f32 weights (kvrun convert)."""
    hf = WORK / "smollm2-hf-f32"
    if not (hf / "config.json").exists():
        WORK.mkdir(exist_ok=True)
        cmd = [str(KVRUN), "convert", "smollm2", str(hf), "--outtype", "f32", "--force"]
        subprocess.run(cmd, check=True)
    return hf


def write_samples(args, path: Path) -> int:
    """kvrun ruler's samples (the same generator, tokenizer, chat form, length and seed)."""
    from kvrun.run.runtime import load_runtime
    from kvrun.tasks import ruler as ru

    rt = load_runtime(None, "float32", "cpu", log=lambda m: None, wtype="f32")
    form = ru.prompt_form(rt.tokenizer, rt.tokenizer.chat_template is not None)
    gen = ru.Generator(form, args.length, args.seed)
    with path.open("w") as f:
        for task in ru.parse_tasks(args.tasks):
            for i in range(args.samples):
                f.write(json.dumps(gen.sample(task, i).as_dict()) + "\n")
    return sum(1 for _ in path.open())


def run_kvpress(py: Path, hf: Path, samples: Path, out: Path, ratios, threads: int) -> None:
    names = dict.fromkeys([*[v for v in PAIRS.values() if v], *KVPRESS_ONLY])  # each press once
    presses = [("none", 0.0)] + [(p, r) for p in names for r in ratios]
    cfg = {"model": str(hf), "samples": str(samples), "out": str(out), "presses": presses,
           "threads": threads}  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([str(py), "-c", WORKER, json.dumps(cfg)], check=True, env=env)


def run_kvrun(args, out: Path, ratios) -> None:
    budgets = ",".join(f"{1 - r:g}" for r in ratios)
    kv = [a for m in ["full", *[k for k in PAIRS if k]] for a in ("--kv", m)]
    cmd = [str(KVRUN), "ruler", "--wtype", "f32", "--length", str(args.length),
           "--samples", str(args.samples), "--seed", str(args.seed), "--question-after",
           *kv, "--kv-budget", budgets, "-o", str(out), "--resume", "--quiet"]  # fmt: skip
    if args.tasks:
        cmd[2:2] = ["--tasks", args.tasks]
    subprocess.run(cmd, check=True)


def table(kvrun_out: Path, kvpress_out: Path, samples: Path, ratios) -> str:
    """Per method and ratio, per task: kvrun's score, kvpress's, the difference."""
    from kvrun.tasks import ruler as ru

    answers = {(s["task"], s["index"]): s["answers"] for s in map(json.loads, samples.open())}
    tasks = list(dict.fromkeys(t for t, _ in answers))
    ours: dict[tuple, list] = {}
    for r in map(json.loads, kvrun_out.open()):
        if (r["task"], r["index"]) in answers:
            ratio = 0.0 if r["method"] == "full" else round(1 - float(r["budget"]), 4)
            ours.setdefault((r["method"], ratio), []).append(r)
    theirs: dict[tuple, list] = {}
    for r in map(json.loads, kvpress_out.open()):
        if (r["task"], r["index"]) in answers:
            r["score"] = ru.score(r["task"], r["reply"], answers[(r["task"], r["index"])])
            theirs.setdefault((r["press"], r["ratio"]), []).append(r)
    rows = [("full", "none", 0.0)] + [(m, p, r) for m, p in PAIRS.items() if m for r in ratios]
    rows += [(None, p, r) for p in KVPRESS_ONLY for r in ratios]
    head = "| kvrun | kvpress | ratio | " + " | ".join(tasks) + " | avg |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for m, p, r in rows:
        a = ru.task_scores(ours.get((m, r), [])) if m else {}
        b = ru.task_scores(theirs.get((p, r), []))

        def cell(t, a=a, b=b):
            x, y = a.get(t), b.get(t)
            if x is None or y is None:
                return "-" if x is None and y is None else f"{x if x is not None else y:.0f}"
            return f"{x:.0f} / {y:.0f} ({x - y:+.0f})"

        avg_a = sum(a.values()) / len(a) if a else None
        avg_b = sum(b.values()) / len(b) if b else None
        avg = {"avg": avg_a} if avg_a is not None else {}
        cells = [cell(t) for t in tasks] + [
            cell("avg", avg, {"avg": avg_b} if avg_b is not None else {})
        ]
        lines.append(f"| {m or '-'} | {p} | {r:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--tasks", default=None, help="comma list (default: every offline task)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--ratios", default="0.75,0.5", help="kvpress compression ratios")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-kvrun", action="store_true")
    ap.add_argument("--skip-kvpress", action="store_true")
    ap.add_argument("--write", action="store_true", help="put the table in bench/README.md")
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    WORK.mkdir(exist_ok=True)
    tag = f"{args.length}-{args.samples}-{args.seed}-{(args.tasks or 'all').replace(',', '+')}"
    samples, kvrun_out, kvpress_out = (
        WORK / f"{k}-{tag}.jsonl" for k in ("samples", "kvrun", "kvpress")
    )
    log(f"{write_samples(args, samples)} samples in {samples}")
    if not args.skip_kvpress:
        run_kvpress(ensure_venv(), ensure_model(), samples, kvpress_out, ratios, args.threads)
    if not args.skip_kvrun:
        run_kvrun(args, kvrun_out, ratios)
    body = table(kvrun_out, kvpress_out, samples, ratios)
    print(body)
    if args.write:
        cmd = " ".join(["python bench/ruler_kvpress.py", *sys.argv[1:]])
        note = (f"{utc_now()}, CPU; `{cmd}`. Cells: kvrun / kvpress (difference), RULER's "
                "score 0..100 by kvrun's scorer on both sides' replies.")  # fmt: skip
        write_section(README, f"{note}\n\n{body}", BEGIN, END)


if __name__ == "__main__":
    main()
