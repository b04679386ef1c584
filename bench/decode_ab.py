"""Decode speed of several KV methods in one process, their rounds interleaved: each method's
cache is prefilled once on the same prompt, then rounds of decode steps go method by method,
so a noisy machine's drift hits every row alike (bench/long_context.py runs one process per
row, where the rounds' ratios move by up to 0.2 on a shared VM).

    python bench/decode_ab.py full,kivi2,kivi4,minicache+kivi4,snapkv@0.1 [--tokens 8000]
                              [--rounds 6] [--steps 16] [--threads 2] [-m smollm2]

A method is `--kv` text, `@budget` for its --kv-budget; every cache at kvrun's own
--kv-dtype (f16 on the CPU). The prompt is the GPL-3 text repeated, cut to --tokens. Prints
each method's prefill seconds and KV bytes, then a markdown table: median ms per decode step,
the first method's median over it (how many times faster), and every round's ms. Greedy
decoding from each cache's own logits. Speed is measured here, never asserted in a test."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvrun.kv import check
from kvrun.run.runtime import load_runtime
from kvrun.run.session import Session

TEXT = Path("/usr/share/common-licenses/GPL-3")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("methods", help="comma list of --kv texts, each with an optional @budget")
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=8000, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16, help="decode steps a round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = load_runtime(args.model, "auto", "cpu", log=lambda m: None)
    text = TEXT.read_text()
    ids = rt.tokenizer.encode(text * (args.tokens // len(rt.tokenizer.encode(text)) + 2))
    ids = ids[: args.tokens]
    names = args.methods.split(",")
    runs = {}
    for name in names:
        kv, _, budget = name.partition("@")
        s = Session(rt.model, rt.tokenizer, rt.new_kv(check(kv, budget or None).with_dtype("auto")))
        t = time.perf_counter()
        logits = s.prefill(ids)
        print(
            f"{name}: prefill {time.perf_counter() - t:.1f} s, "
            f"KV {s.kv.nbytes() / 1e6:.1f} MB"
        )  # fmt: skip
        runs[name] = [s, int(logits.argmax())]
    ms = {name: [] for name in names}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name in names:
                s, tok = runs[name]
                t = time.perf_counter()
                for _ in range(args.steps):
                    tok = int(s.decode(tok).argmax())
                ms[name].append((time.perf_counter() - t) / args.steps * 1e3)
                runs[name][1] = tok
    base = statistics.median(ms[names[0]])
    print(f"\n| --kv | ms / step | {names[0]} / it | rounds |\n|---|---|---|---|")
    for name in names:
        med = statistics.median(ms[name])
        rounds = " ".join(f"{x:.1f}" for x in ms[name])
        print(f"| {name} | {med:.2f} | {base / med:.2f}x | {rounds} |")


if __name__ == "__main__":
    main()
