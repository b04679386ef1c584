"""Methods that score keys by attention, on the native kernels: decode steps and prefills beside
the full cache, in one process.

    python bench/native_scores.py [--prompt 8000] [--budget 0.1] [--steps 8] [--reps 6]
                                  [--threads 2] [--clock wall|cpu] [--torch]

Default model, a prompt of random ids. Decode: `full`, `tova`, `h2o` (and with --torch the
same two with their stores on the torch path, `self.rope.kernels` off for the cache) each
prefilled once, then decoded --steps steps a round, rounds alternated (--reps), median ms per
step and tok/s against full. Prefill: full, minikv, kvzip, h2o, tova prefilled alternately,
their tok/s and the ratio to full's. --clock cpu times the process's CPU seconds (stable on a
shared machine with --threads 1), wall the elapsed time (what `kvrun generate` reports).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_harness import alternate

from kvrun.kv import check
from kvrun.run.runtime import load_runtime
from kvrun.run.session import Session

DECODE = ["full", "tova", "h2o"]
PREFILL = ["full", "minikv", "kvzip", "h2o", "tova"]
NO_BUDGET = {"full", "minikv"}  # their own defaults, as issue 47's table runs them


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=8000)
    ap.add_argument("--budget", default="0.1")
    ap.add_argument("--steps", type=int, default=8, help="decode steps a round")
    ap.add_argument("--reps", type=int, default=6, help="rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--torch", action="store_true", help="also tova and h2o on the torch path")
    ap.add_argument("--skip", default="", help="'decode' or 'prefill'")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    now = time.process_time if args.clock == "cpu" else time.perf_counter
    rt = load_runtime("smollm2", "auto", "cpu", log=lambda m: None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, rt.config.vocab_size, (args.prompt,), generator=g).tolist()
    print(f"{args.prompt}-token prompt, --kv-budget {args.budget}, {args.threads} threads, "
          f"{args.clock} clock, native ISA {getattr(rt.model.rope.kernels, 'isa', lambda: '-')()}")  # fmt: skip

    def session(name: str, native: bool = True) -> Session:
        kernels = rt.model.rope.kernels
        rt.model.rope.kernels = kernels if native else None  # the cache's stores only
        try:
            kv = rt.new_kv(check(name, None if name in NO_BUDGET else args.budget))
        finally:
            rt.model.rope.kernels = kernels
        return Session(rt.model, rt.tokenizer, kv)

    def prefill(s: Session) -> float:
        t = now()
        with torch.inference_mode():
            s.prefill(ids)
        return args.prompt / (now() - t)

    if "decode" not in args.skip:
        runs = {m: session(m) for m in DECODE}
        if args.torch:
            runs |= {f"{m} (torch)": session(m, native=False) for m in DECODE[1:]}
        for s in runs.values():
            prefill(s)

        def steps(s: Session):
            def run() -> float:
                t = now()
                with torch.inference_mode():
                    for _ in range(args.steps):
                        s.decode(5)
                return (now() - t) / args.steps * 1e3

            return run

        got = alternate({m: steps(s) for m, s in runs.items()}, args.reps, flip=True)
        full = statistics.median(got["full"])
        print(
            "| decode | KV bytes | ms/step | tok/s | vs full |\n| --- | ---: | ---: | ---: | ---: |"
        )
        for m, ms in got.items():
            med = statistics.median(ms)
            kvb = runs[m].kv.nbytes() / 1e6
            print(f"| {m} | {kvb:.1f} MB | {med:.2f} | {1e3 / med:.1f} | {full / med:.2f}x |")
    if "prefill" not in args.skip:
        reps = max(1, args.reps // 3)
        got = alternate({m: lambda m=m: prefill(session(m)) for m in PREFILL}, reps, flip=True)
        full = statistics.median(got["full"])
        print("| prefill | tok/s | vs full |\n| --- | ---: | ---: |")
        for m, v in got.items():
            print(f"| {m} | {statistics.median(v):.1f} | {statistics.median(v) / full:.2f}x |")


if __name__ == "__main__":
    main()
