"""One-query attention of a decode step on CPU: the forms kvrun can use, side by side.

    python bench/attention_decode.py [--keys 100,1000,4000,8000] [--seqs 1] [--threads 2]

Each form attends one query (the default model's 9 query heads over 3 KV heads, head dim 64)
over `keys` float32 keys, for 30 layers' distinct K/V tensors (so the K/V bytes come from
memory, as in a decode step, not from cache), times --seqs sequences (a batched step). Forms, alternated, median of --reps:

- `sdpa-gqa`: F.scaled_dot_product_attention(q (1, 9, 1, 64), k, v, enable_gqa=True);
- `sdpa-rows`: the query heads of each KV head as 3 query rows of one unmasked SDPA call
  (q (1, 3, 3, 64)): each K/V head is read once for its 3 query heads;
- `bmm`: two grouped matmuls and a softmax (kvrun's CPU form before 2026-11-25).

Prints ms per step (30 layers x --seqs) and the ratio to `bmm`.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
import torch.nn.functional as F
from bench_harness import alternate, clock, md_head, md_row

HQ, HKV, D, LAYERS = 9, 3, 64, 30


def forms(q: torch.Tensor) -> dict:
    qg = q.reshape(1, HKV, HQ // HKV, D)

    def sdpa_gqa(k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def sdpa_rows(k, v):
        return F.scaled_dot_product_attention(qg, k, v).view(1, HQ, 1, D)

    def bmm(k, v):
        s = torch.matmul(qg, k.transpose(-1, -2)) * D**-0.5
        return torch.matmul(torch.softmax(s, dim=-1), v).view(1, HQ, 1, D)

    return {"sdpa-gqa": sdpa_gqa, "sdpa-rows": sdpa_rows, "bmm": bmm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="100,1000,4000,8000")
    ap.add_argument("--seqs", type=int, default=1, help="sequences of a batched step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, 1, D, generator=g)
    fs = forms(q)
    print(
        f"ms per {LAYERS} layers x {args.seqs} sequences, {args.threads} threads, median of {args.reps}"
    )
    head = md_head(["keys", *fs, *(f"{n} / bmm" for n in fs)], "r" * (2 * len(fs) + 1))
    print("\n".join(head))
    for n in (int(x) for x in args.keys.split(",")):
        kv = [(torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g))
              for _ in range(LAYERS * args.seqs)]  # fmt: skip
        ref = fs["bmm"](*kv[0])
        for f in fs.values():  # same result, and a warm-up
            torch.testing.assert_close(f(*kv[0]), ref, rtol=1e-4, atol=1e-5)

        def step(f, kv=kv) -> float:  # seconds of one step: every layer's (and sequence's) K/V
            def run() -> None:
                for k, v in kv:
                    f(k, v)

            return clock(run)

        times = alternate({name: partial(step, f) for name, f in fs.items()}, args.reps)
        ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        cells = [f"{ms[x]:.2f}" for x in fs] + [f"{ms[x] / ms['bmm']:.2f}x" for x in fs]
        print(md_row([n, *cells]))


if __name__ == "__main__":
    main()
