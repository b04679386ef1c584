"""Where the CPU int4 op stops beating the exact path: packed products of R rows, both ways.

    python bench/op_rows.py [--threads 2] [--out FILE]

For layer shapes of the default model (QKV stacked, O, gate+up stacked, down) and of an
8B model (QKV stacked), times a product of R rows through PyTorch's int4 op
(`int4mm.mm`, bfloat16 activations) and through the exact path (dequantize the int4
planes to float32 + MKL, `PackedLinear._dequant_planes_linear`), best of several calls
each, and prints exact / op: above 1 the op is faster. kvrun's own probe
(`kvrun.quant.linear.int4_op_rows`, recorded in ~/.cache/kvrun/probes.json) finds the crossover
on the default model's FFN shape; its answer is printed too. The table goes into
bench/README.md (or --out) between op-rows markers.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from bench_harness import md_head, md_row, timed, utc_now, write_section

from kvrun.quant import int4mm
from kvrun.quant.choice import _probe
from kvrun.quant.linear import _measure_op_rows

BENCH = Path(__file__).resolve().parent
BEGIN, END = "<!-- op-rows:begin -->", "<!-- op-rows:end -->"
ROWS = (8, 16, 32, 48, 64, 96, 128, 256)
SHAPES = {
    "default model QKV (960 x 576)": (960, 576),
    "default model O (576 x 576)": (576, 576),
    "default model gate+up (3072 x 576)": (3072, 576),
    "default model down (576 x 1536)": (576, 1536),
    "8B QKV (6144 x 4096)": (6144, 4096),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(BENCH / "README.md"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lines = md_head(["layer", *(f"{r} rows" for r in ROWS)], "l" + "r" * len(ROWS))
    for label, (n, k) in SHAPES.items():
        lin = _probe(n, k, torch.device("cpu"), torch.float32)
        lin.use_int4pack()
        op = lin.cpu_op()
        reps = 5 if n * k > 1 << 22 else 20
        cells = []
        for rows in ROWS:
            x = torch.randn(rows, k)
            via_op = functools.partial(int4mm.mm, x, op.planes, op.sz, lin.group)
            exact = functools.partial(lin._dequant_planes_linear, x)
            ratio = timed(exact, reps, warmup=1).best / timed(via_op, reps, warmup=1).best
            cells.append(f"{ratio:.2f}")
        lines.append(md_row([label, *cells]))
        print(lines[-1], flush=True)
    probe = _measure_op_rows(torch.float32)
    body = "\n".join(
        [
            "## Short prefills: the int4 op against the exact path (CPU)",
            "",
            f"- date: {utc_now()}; {a.threads} threads, torch {torch.__version__}",
            "- command: `python bench/op_rows.py`",
            "- cells: time of the exact path (int4 planes dequantized to float32 + MKL) / time of "
            "the int4 op, for a product of that many rows; above 1 the op is faster",
            f"- kvrun's probe (`packed.int4_op_rows`, 1536 x 576) on this run: the op up to "
            f"{probe} rows",
            "",
            *lines,
        ]
    )
    print(body)
    write_section(Path(a.out), body, BEGIN, END)


if __name__ == "__main__":
    main()
