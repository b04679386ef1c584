"""The native CPU kernels alone: a product's time per GGUF type, layout and row count.

    python bench/native_kernels.py                      # the best instruction set here
    python bench/native_kernels.py --isa avx2,avx512vnni --rows 1,4,16 --write

For each type and shape, the same random blocks multiply x (R rows) as the file lays them
out (row-major) and in the 8-row interleaving kvrun makes at load (kernels/cpu/qlayout.h).
Weights are cycled through enough copies to exceed the last-level cache (--dram, default on)
so the figures are what a model's decode step sees, not cache-resident loops; GB/s is weight
bytes read per second. Best of 5 repeats, each the mean of many products, 2 threads.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from bench_harness import timed, write_section

HERE = Path(__file__).parent
README = HERE / "README.md"
BEGIN, END = "<!-- native-kernels:begin -->", "<!-- native-kernels:end -->"
SHAPES = [("Q4_1", 3072, 576), ("Q8_0", 49152, 576), ("Q4_0", 4096, 4096), ("Q4_K", 4096, 4096),
          ("Q5_K", 4096, 4096), ("Q6_K", 4096, 4096), ("IQ4_XS", 4096, 4096),
          ("Q5_0", 4096, 4096)]  # fmt: skip
SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2],
          "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}  # fmt: skip
LLC_BYTES = 64 << 20  # copies of a weight until they exceed this


def blocks(kind: str, n: int, k: int, rng) -> torch.Tensor:
    import gguf

    elems, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(n, k // elems, size), dtype=np.uint8)
    for off in SCALES[kind]:
        raw[..., off : off + 2] = (rng.uniform(0.001, 0.01, (n, k // elems)).astype(np.float16)
                                   [..., None].view(np.uint8))  # fmt: skip
    return torch.from_numpy(raw.reshape(n, -1))


def main(argv=None) -> None:
    import gguf

    from kvrun.quant import native

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="best", help="comma list of instruction sets")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-dram", dest="dram", action="store_false",
                    help="one copy of each weight (cache-resident when it fits)")  # fmt: skip
    ap.add_argument("--write", action="store_true", help="write the table into bench/README.md")
    args = ap.parse_args(argv)
    ops = native.ops()
    if ops is None:
        raise SystemExit(native.note())
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = [int(r) for r in args.rows.split(",")]
    lines = [  # no heading: README's "Native CPU kernels" section introduces the table
        f"`python bench/native_kernels.py --isa {args.isa} --rows {args.rows}` "
        f"({time.strftime('%Y-%m-%d')}, {args.threads} threads; weights cycled through "
        f"{'copies past the last-level cache' if args.dram else 'one copy'}). us per product "
        "and GB/s of weights, row-major blocks / the 8-row interleaving.",
        "",
        "| isa | type | shape | " + " | ".join(f"{r} row{'s' * (r > 1)}" for r in rows) + " |",
        "| --- | --- | --- |" + " ---: |" * len(rows),
    ]
    for isa in args.isa.split(","):
        isa = ops.set_isa(isa)
        for kind, n, k in SHAPES:
            w = blocks(kind, n, k, rng)
            t = int(gguf.GGMLQuantizationType[kind])
            layouts = [("rows", w, t)]
            if ops.has_x8(t):
                layouts.append(("x8", ops.repack(w, t, k), t | 256))
            copies = max(1, LLC_BYTES // w.numel() + 1) if args.dram else 1
            cells = []
            for r in rows:
                x = torch.randn(r, k)
                parts = []
                for _name, data, code in layouts:
                    ws = [data] + [data.clone() for _ in range(copies - 1)]
                    i = [0]

                    def one(ws=ws, code=code, x=x, i=i, n=n):
                        i[0] = (i[0] + 1) % len(ws)
                        ops.qmm(x, [ws[i[0]]], [code], [n])

                    reps = max(5, int(4e7 // (n * k * max(1, r // 4))))
                    s = timed(one, reps=5, warmup=3, inner=reps).best
                    parts.append(f"{s * 1e6:.0f} us {data.numel() / s / 1e9:.1f} GB/s")
                cells.append(" / ".join(parts))
            lines.append(f"| {isa} | {kind} | {n} x {k} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    ops.set_isa("best")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(README, text, BEGIN, END)


if __name__ == "__main__":
    main()
