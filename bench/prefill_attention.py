"""A prefill chunk's attention: PyTorch's SDPA (its CPU flash attention, what the prefill ran
before) against the native kernel (attn_colsum, attention alone: kvrun.kv.attention.
native_attention), side by side in one process on the same tensors.

    python bench/prefill_attention.py --keys 2048,4096,8000 --rows 512 --reps 5

Shapes are the default model's (9 query heads, 3 KV heads, head_dim 64) unless given. Each
line: the chunk's rows attending causally by slot to T keys (the rows the last of them), as a
prefill chunk does, and the same rows seeing every key (KVzip's pass over the rest of the
cache, KIVI's body), with the median time of each side and their ratio. Speed is measured
here, never asserted in a test; the outputs' agreement is printed beside it."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrun.kv.attention import native_attention, sdpa  # noqa: E402
from kvrun.quant import native  # noqa: E402


def timed(f, reps: int) -> float:
    f()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="2048,4096,8000", help="key counts T, comma-separated")
    ap.add_argument("--rows", type=int, default=512, help="query rows of the chunk (--ubatch)")
    ap.add_argument("--heads", default="9,3", help="query heads, KV heads")
    ap.add_argument("--dim", type=int, default=64, help="head_dim")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    kernels = native.ops()
    if kernels is None:
        sys.exit(f"kvrun: the native kernels are not built here ({native.note()})")
    torch.set_num_threads(a.threads)
    hq, hkv = (int(x) for x in a.heads.split(","))
    g = torch.Generator().manual_seed(0)
    print("| keys | rows | visibility | SDPA | native | SDPA / native | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for T in (int(x) for x in a.keys.split(",")):
        Tq = min(a.rows, T)
        q = torch.randn(1, hq, Tq, a.dim, generator=g)
        k = torch.randn(1, hkv, T, a.dim, generator=g)
        v = torch.randn(1, hkv, T, a.dim, generator=g)
        rows = torch.arange(T - Tq, T)[:, None]
        for name, mask, causal in (
            ("causal", torch.arange(T)[None, :] <= rows, True),
            ("all keys", None, False),
        ):
            ref = sdpa(q, k, v, mask)
            out = native_attention(kernels, q, k, v, causal=causal).out
            ts = timed(lambda q=q, k=k, v=v, m=mask: sdpa(q, k, v, m), a.reps)
            tn = timed(
                lambda q=q, k=k, v=v, c=causal: native_attention(kernels, q, k, v, causal=c),
                a.reps,
            )
            diff = float((ref - out).abs().max())
            print(
                f"| {T} | {Tq} | {name} | {ts * 1e3:.1f} ms | {tn * 1e3:.1f} ms | {ts / tn:.2f}x "
                f"| {diff:.1e} |"
            )


if __name__ == "__main__":
    main()
