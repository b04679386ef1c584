"""Prefill and decode speed of the full cache on one model, prompt lengths in one table
(`kvrun bench` measures the same per KV method and depth).

    python bench/prefill_decode.py [-m smollm2] [--prompts 512,4096] [-n 64] [--reps 3]

Prints a markdown table: prompt tokens, prefill tok/s and decode tok/s (mean ± std over
reps after one warm-up), KV bytes held, peak memory.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvrun.run.runtime import load_runtime
from kvrun.run.session import Session, peak_memory_bytes


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--prompts", default="512,4096")
    ap.add_argument("-n", type=int, default=64, help="decode tokens after each prompt")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--ubatch", type=int, default=512)
    a = ap.parse_args()
    rt = load_runtime(a.model, a.dtype, a.device, log=lambda m: None)
    gen = torch.Generator().manual_seed(0)
    print(
        f"model {rt.path.name}, {rt.model.dtype}, {rt.model.device}, {torch.get_num_threads()} threads"
    )
    print("| prompt | prefill tok/s | decode tok/s | KV bytes | peak mem |")
    print("|---:|---:|---:|---:|---:|")
    for n_prompt in (int(x) for x in a.prompts.split(",")):
        ids = torch.randint(100, rt.config.vocab_size, (n_prompt,), generator=gen).tolist()
        pre, dec = [], []
        for rep in range(a.reps + 1):
            s = Session(rt.model, rt.tokenizer, rt.new_kv(), ubatch=a.ubatch)
            t0 = time.perf_counter()
            logits = s.prefill(ids)
            t1 = time.perf_counter()
            for _ in range(a.n):
                logits = s.decode(int(logits.argmax()))
            t2 = time.perf_counter()
            if rep:  # the first run warms up
                pre.append(n_prompt / (t1 - t0))
                dec.append(a.n / (t2 - t1))
        print(
            f"| {n_prompt} | {statistics.mean(pre):.1f} ± {_sd(pre):.1f} | "
            f"{statistics.mean(dec):.1f} ± {_sd(dec):.1f} | {s.kv.nbytes():,} | "
            f"{peak_memory_bytes(rt.model.device) / 2**20:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
