"""SpindleKV's prefill codebook build: the blocked torch greedy against the native one.

    python bench/codebook_build.py [--tokens 8000] [--budget 0.1] [--reps 3]

Prefills `--tokens` of the GPL-3 text on the default model with `--kv spindlekv` (the
native kernels on, as the CLI runs), recording every (vectors, theta) the prefill hands
`build_codebook`; then builds each again on the torch path (the kernels unset) and natively
(op codebook_build), alternated, and prints the seconds per prefill's worth of books of each
and whether the books and indices are the same.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from bench_harness import alternate, clock, md_head, md_row

TEXT = "/usr/share/common-licenses/GPL-3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--budget", default="0.1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from kvrun.kv import check
    from kvrun.kv.methods.spindlekv import store
    from kvrun.run.runtime import load_runtime
    from kvrun.run.session import Session

    rt = load_runtime("smollm2", "auto", "cpu", log=lambda m: None)
    text = open(TEXT).read()
    ids = rt.tokenizer.encode(text * (1 + 4 * args.tokens // len(text)))[: args.tokens]
    calls, real = [], store.build_codebook

    def record(u, theta, block=4096, dtype=torch.float16, kernels=None):
        calls.append((u.clone(), theta, block, dtype, kernels))
        return real(u, theta, block, dtype, kernels)

    store.build_codebook = record
    try:
        with torch.inference_mode():
            kv = rt.new_kv(check("spindlekv", args.budget).with_dtype("auto"))
            Session(rt.model, rt.tokenizer, kv).prefill(ids)
    finally:
        store.build_codebook = real
    ops = next((c[4] for c in calls if c[4] is not None), None)
    if ops is None:
        raise SystemExit("no native kernels here (no compiler?): nothing to compare")
    rows = sum(c[0].shape[0] for c in calls)
    print(
        f"{len(calls)} books of {rows} vectors in all ({args.tokens} tokens, --kv-budget {args.budget})"
    )

    def build_all(kernels) -> list:
        return [real(u, th, bl, dt, kernels) for u, th, bl, dt, _ in calls]

    same = all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(build_all(None), build_all(ops), strict=True)
    )
    forms = {"torch blocks": None, "native": ops}
    times = alternate(
        {n: partial(clock, partial(build_all, k)) for n, k in forms.items()}, args.reps
    )
    s = {n: statistics.median(t) for n, t in times.items()}
    print("\n".join(md_head(["build", "s per prefill", "vs torch"], "lrr")))
    for n in forms:
        print(md_row([n, f"{s[n]:.2f}", f"{s['torch blocks'] / s[n]:.1f}x"]))
    print(f"same books and indices: {same}")


if __name__ == "__main__":
    main()
