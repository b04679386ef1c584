"""The files people download: the default model in llama.cpp's own quantization types, each
run by kvrun and by llama.cpp beside the exact model.

    python bench/quant_files.py                                   # every type below
    python bench/quant_files.py --types Q4_K_M,IQ4_XS --reps 2 --write

For each type (Q4_0, Q8_0, Q4_K_M, Q5_K_M, Q6_K, IQ4_XS, Q3_K_M) the default model
(SmolLM2-135M-Instruct Q4_1) is quantized by llama.cpp's own quantizer
(llama-cpp-python's `llama_model_quantize`, re-quantization allowed, no importance matrix)
into bench/.quant-files/. Then, per file:

- perplexity on the same 256 tokens (the last 256 of the first 1,024 tokens of --text, one
  1,024-token context): the exact model (the same file dequantized to float32 and run by HF
  transformers, `gguf_file=`), kvrun (its prefill: chunks of 512 rows, the products that
  kvrun.quant.blocks.native_rows() sends through the native kernels, 8-bit activations as
  llama.cpp's, the others exact),
  kvrun's decode steps (the first 768 tokens prefilled, the 256 fed one decode step at a time:
  the fast products, 8-bit activations as llama.cpp's) and llama.cpp (`logits_all`, n_batch
  512); the same token ids for all;
- decode tok/s of both tools (bench/vs_llamacpp.py's tgN test, tools alternating, median);
- kvrun's weights in memory (every parameter and buffer of the loaded model) against the
  file's tensor bytes, and the forms it holds them in.

llama.cpp runs in bench/vs_llamacpp.py's virtual environment (built on first use).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vs_llamacpp as vl  # noqa: E402
from bench_harness import cpu_model, log, md_head, torch_version, utc_now, write_section  # noqa: E402

HERE = Path(__file__).parent
OUT = HERE / ".quant-files"
README = HERE / "README.md"
BEGIN, END = "<!-- quant-files:begin -->", "<!-- quant-files:end -->"
TYPES = ["Q4_0", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "Q3_K_M"]
CONTEXT, SCORED = 1024, 256

QUANTIZE = r"""
import json, sys
import llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
p.allow_requantize = True
p.nthread = 2
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
print(json.dumps({"rc": rc}))
"""

LLAMA_NLL = r"""
import json, math, sys
import numpy as np
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
ids = cfg["ids"]
llm = Llama(model_path=cfg["model"], n_ctx=len(ids), n_batch=512, n_ubatch=512,
            n_threads=cfg["threads"], n_threads_batch=cfg["threads"], logits_all=True,
            verbose=False)
llm.eval(ids)
logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
first = len(ids) - cfg["scored"]
nll = []
for p in range(first - 1, len(ids) - 1):
    row = logits[p]
    m = row.max()
    nll.append(m + math.log(np.exp(row - m).sum()) - row[ids[p + 1]])
print(json.dumps({"nll": sum(nll) / len(nll)}))
"""


def quantize(src: Path, kind: str) -> Path:
    dst = OUT / f"{src.stem.split('.')[0]}.{kind}.gguf"
    if dst.exists():
        return dst
    OUT.mkdir(exist_ok=True)
    log(f"quantizing {src.name} -> {dst.name} (llama.cpp)")
    res = subprocess.run([str(vl.venv_python()), "-c", QUANTIZE, str(src), str(dst), kind],
                         capture_output=True, text=True)  # fmt: skip
    if res.returncode or not dst.exists():
        raise RuntimeError(f"llama_model_quantize {kind}: {vl.one_line(res.stderr or res.stdout)}")
    return dst


def token_ids(text: Path, model: Path) -> list[int]:
    from kvrun.models.file_headers import gguf_metadata, open_gguf
    from kvrun.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf_metadata(open_gguf(model)))
    ids = tok.encode(text.read_text())[:CONTEXT]
    if len(ids) < CONTEXT:
        raise SystemExit(f"{text} gives {len(ids)} tokens; {CONTEXT} are needed")
    return ids


def mean_nll(logits, ids: list[int]) -> float:
    """Mean NLL of the last SCORED tokens from logits (T, V) of the whole sequence."""
    import torch

    first = len(ids) - SCORED
    lp = torch.log_softmax(logits[first - 1 : len(ids) - 1].double(), dim=-1)
    target = torch.tensor(ids[first:])
    return float(-lp[torch.arange(SCORED), target].mean())


def exact_nll(path: Path, ids: list[int]) -> float:
    """HF transformers on the file dequantized to float32 (its GGUF loader)."""
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0]
    return mean_nll(logits, ids)


def kvrun_nll(path: Path, ids: list[int]) -> dict:
    """kvrun's prefill (512-row chunks) and its decode steps over the scored tokens; the
    weights it holds and in what forms."""
    import torch

    from kvrun.quant.blocks import BlockLinear
    from kvrun.quant.linear import PackedLinear
    from kvrun.run.runtime import load_runtime
    from kvrun.run.session import Session
    from kvrun.tasks.bench import weight_bytes

    rt = load_runtime(str(path), log=lambda m: None)
    rows = []
    s = Session(rt.model, rt.tokenizer, rt.new_kv(), ubatch=512)
    with torch.inference_mode():
        for out, _ in s.prefill_chunks(ids, rows=True):
            rows.append(out)
        prefill = mean_nll(torch.cat(rows).float(), ids)
        first = len(ids) - SCORED
        s = Session(rt.model, rt.tokenizer, rt.new_kv(), ubatch=512)
        steps = [s.prefill(ids[:first])]
        for t in ids[first:-1]:
            steps.append(s.decode(t))
    decode = mean_nll(
        torch.cat([torch.zeros(first - 1, steps[0].shape[-1]), torch.stack(steps)]).float(), ids
    )
    forms: dict[str, int] = {}
    for mod in rt.model.modules():
        if isinstance(mod, BlockLinear):
            key = "+".join(mod.types) + " blocks"
        elif isinstance(mod, PackedLinear):
            key = f"q{mod.bits} from {mod.source}"
        else:
            continue
        forms[key] = forms.get(key, 0) + 1
    return {"prefill": prefill, "decode": decode, "weights": weight_bytes(rt.model), "forms": forms}


def llamacpp_nll(path: Path, ids: list[int], threads: int) -> float:
    cfg = json.dumps({"model": str(path), "ids": ids, "scored": SCORED, "threads": threads})
    res = subprocess.run([str(vl.venv_python()), "-c", LLAMA_NLL, cfg], capture_output=True,
                         text=True, env=vl.thread_env(threads))  # fmt: skip
    if res.returncode:
        raise RuntimeError(f"llama.cpp perplexity: {vl.one_line(res.stderr)}")
    return json.loads(res.stdout.strip().splitlines()[-1])["nll"]


def tensor_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def decode_speed(path: Path, args) -> dict:
    """bench/vs_llamacpp.py's tg test on the file: {tool: median tok/s}."""
    out = OUT / f"{path.stem}.speed.json"
    cmd = [sys.executable, str(HERE / "vs_llamacpp.py"), "--model", str(path), "--tests",
           f"tg{args.tg}", "--tg-prompt", str(args.tg_prompt), "--reps", str(args.reps),
           "--skip-8b", "--json", str(out), "--threads", str(args.threads)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    data = json.loads(out.read_text())
    test = data["results"][f"tg{args.tg}"]
    return {tool: vl.median_of(runs) for tool, runs in test.items()}


def measure(kind: str, src: Path, ids: list[int], args) -> dict:
    path = src if kind == "source" else quantize(src, kind)
    log(f"{kind}: perplexity")
    row = {"type": kind, "file": path.name, "file_bytes": path.stat().st_size,
           "tensor_bytes": tensor_bytes(path)}  # fmt: skip
    row["exact"] = math.exp(exact_nll(path, ids))
    kv = kvrun_nll(path, ids)
    row["kvrun"], row["kvrun_decode"] = math.exp(kv["prefill"]), math.exp(kv["decode"])
    row["weights_bytes"], row["forms"] = kv["weights"], kv["forms"]
    row["llama.cpp"] = math.exp(llamacpp_nll(path, ids, args.threads))
    if args.reps:
        log(f"{kind}: decode speed")
        row["tg"] = decode_speed(path, args)
    return row


def pct(x: float, ref: float) -> str:
    return f"{x:.3f} ({100 * (x / ref - 1):+.2f} %)"


def table(rows: list[dict], meta: dict) -> str:
    head = md_head(["file", "exact ppl", "kvrun ppl", "kvrun decode-step ppl", "llama.cpp ppl",
                    "kvrun tg tok/s", "llama.cpp tg tok/s", "kvrun / llama.cpp",
                    "kvrun weights / file tensors"], "l" + "r" * 8)  # fmt: skip
    lines = [
        f"- date: {meta['date']}; machine: {meta['cpu']}, {meta['threads']} threads; "
        f"torch {meta['torch']}; llama-cpp-python {meta['llamacpp']}",
        f"- command: `{meta['command']}`",
        f"- perplexity of the last {SCORED} of the first {CONTEXT} tokens of {meta['text']}, "
        "one context; exact: the file dequantized to float32 in HF transformers; kvrun: its "
        "prefill (512-row chunks; 8-bit activations where the native kernels take them, as "
        "llama.cpp); kvrun decode: those tokens fed as decode "
        "steps (8-bit activations, as llama.cpp); decode tok/s: tg"
        f"{meta['tg']} after {meta['tg_prompt']} prompt tokens, median of {meta['reps']}, "
        "tools alternating",
        "",
        *head,
    ]
    for r in rows:
        tg = r.get("tg", {})
        k, lc = tg.get("kvrun"), tg.get("llama.cpp")
        speed = (f"{k:.1f} | {lc:.1f} | {k / lc:.2f}x" if isinstance(k, float) and
                 isinstance(lc, float) else "- | - | -")  # fmt: skip
        lines.append(
            f"| {r['type']} ({r['file_bytes'] / 2**20:.1f} MiB) | {r['exact']:.3f} | "
            f"{pct(r['kvrun'], r['exact'])} | {pct(r['kvrun_decode'], r['exact'])} | "
            f"{pct(r['llama.cpp'], r['exact'])} | {speed} | "
            f"{r['weights_bytes'] / r['tensor_bytes']:.3f} |"
        )
    lines += ["", "Forms kvrun holds each file's tensors in:", ""]
    for r in rows:
        forms = ", ".join(f"{k} x{v}" for k, v in sorted(r["forms"].items()))
        lines.append(f"- {r['type']}: {forms}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    ap.add_argument("--model", default=vl.default_model(), help="the file to quantize from")
    ap.add_argument("--types", default=",".join(TYPES), help="comma list (default: all)")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="decode-speed reps (0: skip speed)")
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--tg-prompt", type=int, default=16)
    ap.add_argument("--json", metavar="PATH", help="save the rows as JSON")
    ap.add_argument("--write", action="store_true", help="write the table into bench/README.md")
    args = ap.parse_args(argv)
    version, _ = vl.ensure_llamacpp()
    src = Path(args.model)
    ids = token_ids(Path(args.text), src)
    rows = []
    for kind in [t.strip() for t in args.types.split(",") if t.strip()]:
        try:
            rows.append(measure(kind, src, ids, args))
        except Exception as e:  # noqa: BLE001 - one failing file must not end the run
            log(f"{kind}: failed: {e}")
            continue
        log(json.dumps(rows[-1]))
    meta = {
        "date": utc_now(),
        "cpu": cpu_model(), "threads": args.threads, "torch": torch_version(),
        "llamacpp": version, "text": args.text, "tg": args.tg, "tg_prompt": args.tg_prompt,
        "reps": args.reps, "command": "python bench/quant_files.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    text = table(rows, meta)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.write:
        write_section(README, text, BEGIN, END)


if __name__ == "__main__":
    main()
