"""A KIVI store's attention on CPU: the native kernels against the torch path, side by side.

    python bench/kivi_attention.py [--keys 2000,8000] [--bits 2,4] [--rows 1,4,16,64,512]
                                   [--threads 2] [--reps 5]

Each form attends the default model's 9 query heads (3 KV heads, head dim 64) with Tq query
rows over one KiviLayer per layer (30 of them, distinct, so the codes come from memory as in
a step): `keys` tokens, all but the newest 64 in the packed body (group 32), the rest in the
dense tail. Forms, alternated, median of --reps:

- `native`: KiviLayer.partials on the native kernels (kvrun/kv/stores/kivi_native.py: the
  packed kernel for few rows, flash attention over dequantized ranges for many);
- `packed`: the packed kernel (kernels/cpu/kivi_attn.h) whatever the rows, one call;
- `torch`: the torch path (kivi_decode_ref over the body, segment_attention over the tail);
- `dense`: float32 K/V of the same length, one call (attn_partial), for scale;
- `f16`: the same K/V in float16, one call (attn_typed): `full`'s default cache on the CPU.

Prints ms per 30 layers, the ratio torch / native (how many times faster the native path
is) and f16 / native (the store's attention against `full`'s, the kernel behind issue 47's
"decodes >= 1.5x full"). With --rows 1 the body is the decode step's; larger --rows a prefill chunk's (every
slot visible: the chunk's own tokens are left out).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from bench_harness import alternate, clock, md_head, md_row

from kvrun.kernels.kivi_decode import kivi_decode_ref
from kvrun.kv.attention import segment_attention
from kvrun.kv.stores.kivi import KiviLayer
from kvrun.quant import native

HQ, HKV, D, LAYERS, G, TAIL = 9, 3, 64, 30, 32, 64


def store(ops, bits: int, n: int, g: torch.Generator) -> KiviLayer:
    """A layer's store: n - TAIL tokens packed (whole groups), the rest in the tail."""
    layer = KiviLayer(HKV, D, bits, G, G, torch.float32, "cpu", ops)
    body = (n - TAIL) // G * G
    layer.append(torch.randn(HKV, body, D, generator=g), torch.randn(HKV, body, D, generator=g))
    layer.flush(G)
    rest = n - body
    layer.append(torch.randn(HKV, rest, D, generator=g), torch.randn(HKV, rest, D, generator=g))
    return layer


def forms(ops, layers: list[KiviLayer], dense: list, half: list, q: torch.Tensor) -> dict:
    def run_native():
        for layer in layers:
            layer.partials(q, None, 0, None)

    def run_packed():
        for layer in layers:
            ops.kivi_attn(q, *layer.rooms()[:6], layer.body_len, *layer.rooms()[6:],
                          layer.tail_len, layer.bits, G, 0, D**-0.5)  # fmt: skip

    def run_torch():
        for layer in layers:
            kivi_decode_ref(q, *layer.body(), layer.bits, G)
            tk, tv = layer.tail()
            segment_attention(q, tk[None], tv[None])

    def run_dense():
        for k, v in dense:
            ops.attn_partial(q, k, v, D**-0.5)

    def run_f16():
        for k, v in half:
            ops.attn_typed(q, k, v, D**-0.5)

    return {
        "native": run_native,
        "packed": run_packed,
        "torch": run_torch,
        "dense": run_dense,
        "f16": run_f16,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="2000,8000")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--rows", default="1,16,512", help="query rows per head (Tq)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    ops = native.ops()
    if ops is None:
        raise SystemExit(f"native kernels unavailable: {native.note()}")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"ms per {LAYERS} layers, {args.threads} threads, {ops.isa()}, median of {args.reps}")
    names = ["native", "packed", "torch", "dense", "f16"]
    head = ["keys", "bits", "Tq", *names, "torch / native", "dense / native", "f16 / native"]
    print("\n".join(md_head(head, "r" * len(head))))
    for n in (int(x) for x in args.keys.split(",")):
        dense = [(torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g))
                 for _ in range(LAYERS)]  # fmt: skip
        half = [(k.half(), v.half()) for k, v in dense]
        for bits in (int(b) for b in args.bits.split(",")):
            layers = [store(ops, bits, n, g) for _ in range(LAYERS)]
            for tq in (int(r) for r in args.rows.split(",")):
                q = torch.randn(1, HQ, tq, D, generator=g)
                fs = forms(ops, layers, dense, half, q)
                for f in fs.values():  # a warm-up
                    f()
                runners = {name: partial(clock, f) for name, f in fs.items()}
                times = alternate(runners, args.reps)
                ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
                cells = [f"{ms[x]:.2f}" for x in names]
                ratios = [
                    f"{ms['torch'] / ms['native']:.1f}x",
                    f"{ms['dense'] / ms['native']:.2f}x",
                    f"{ms['f16'] / ms['native']:.2f}x",
                ]
                print(md_row([n, bits, tq, *cells, *ratios]))


if __name__ == "__main__":
    main()
