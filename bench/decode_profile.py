"""Where a decode step's time goes: ms per step, then the top torch ops per step (profiler).

    python bench/decode_profile.py                 # default model, --wtype auto, full cache
    python bench/decode_profile.py --wtype f32     # the dense reference path
    python bench/decode_profile.py --kv snapkv --budget 0.25 --prompt 2048
    python bench/decode_profile.py --prompt 8000 --kv-dtype f32   # the float32 cache
    python bench/decode_profile.py --modules       # through the modules, not kvrun/models/fused_decode.py
    python bench/decode_profile.py --products      # the int4 products alone, back to back

Decode steps follow a prompt of random ids; the first steps are a warm-up. The table's
times are self CPU time per step under the profiler (which adds overhead of its own, so
the unprofiled ms per step is printed first).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_harness import timed
from torch.profiler import ProfilerActivity, profile

from kvrun.run.runtime import load_runtime
from kvrun.run.session import Session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--wtype", default="auto")
    ap.add_argument("--kv", default="full")
    ap.add_argument("--budget", default=None)
    ap.add_argument(
        "--kv-dtype", default="auto", help="as kvrun's --kv-dtype (auto: f16 on the CPU)"
    )
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before the steps")
    ap.add_argument("--steps", type=int, default=64, help="timed steps (16 more profiled)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument(
        "--modules",
        action="store_true",
        help="decode through the modules, not kvrun/models/fused_decode.py",
    )
    ap.add_argument(
        "--products",
        action="store_true",
        help="time the step's int4 products alone (body and head) on the model's weights",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # --wtype auto is passed as nothing, so the script also profiles checkouts from before it
    kw = {} if args.wtype == "auto" else {"wtype": args.wtype}
    rt = load_runtime(args.model, "auto", "cpu", log=lambda m: None, **kw)
    if args.products:
        return products(rt.model, args.steps)
    try:
        from kvrun.kv import check

        spec = check(args.kv, args.budget)
        kv = rt.new_kv(spec.with_dtype(args.kv_dtype) if hasattr(spec, "with_dtype") else spec)
    except ImportError:  # checkouts before the KV registry: new_kv parsed the text itself
        kv = rt.new_kv(args.kv, args.budget)
    if args.modules:
        rt.model.use_fused_decode = False
    s = Session(rt.model, rt.tokenizer, kv)
    ids = torch.randint(100, rt.config.vocab_size, (args.prompt,), generator=torch.Generator())
    with torch.inference_mode():
        s.prefill(ids.tolist())
        for _ in range(5):
            s.decode(5)
        t = time.perf_counter()
        for _ in range(args.steps):
            s.decode(5)
        ms = (time.perf_counter() - t) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(16):
                s.decode(5)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / 16 / 1e3
    ops = sum(e.count for e in events) / 16
    wtype = getattr(rt.weights, "wtype", "f32")
    print(f"{args.model} --wtype {wtype} --kv {args.kv} --kv-dtype {args.kv_dtype}, "
          f"{args.threads} threads")  # fmt: skip
    print(f"{ms:.2f} ms/step unprofiled ({1e3 / ms:.1f} tok/s); profiled self CPU "
          f"{total:.2f} ms/step, {ops:.0f} torch ops/step")  # fmt: skip
    print("| op | calls/step | self ms/step |\n| --- | ---: | ---: |")
    for e in events[: args.top]:
        print(f"| {e.key} | {e.count / 16:.0f} | {e.self_cpu_time_total / 16 / 1e3:.2f} |")


def products(model, reps: int) -> None:
    """ms per step of the decode step's int4 products alone, one row, back to back in the
    step's order on the model's own weights (what a step cannot go below on this path)."""
    from kvrun.models import fused_decode

    layers = fused_decode.bind(model)
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    op = head.cpu_op() if hasattr(head, "cpu_op") else None
    if not layers or op is None:
        raise SystemExit("--products needs a packed model on the CPU int4 path (--wtype auto)")
    c = model.config
    x = torch.randn(1, c.dim, dtype=torch.bfloat16)
    xf = torch.randn(1, c.ffn_dim, dtype=torch.bfloat16)
    xo = torch.randn(1, c.n_heads * c.head_dim, dtype=torch.bfloat16)

    def body():
        for L in layers:
            L.qkv(x), L.o(xo), L.gate_up(x), L.down(xf)

    logits = fused_decode.Product(op.planes, op.sz, head.group)  # the head's product, unrefined

    def ms(fn) -> float:
        return timed(fn, reps=1, warmup=10, inner=reps).best * 1e3

    n = 4 * len(layers)
    print(f"int4 products alone, {torch.get_num_threads()} threads, {reps} reps:")
    print(f"body ({n} products) {ms(body):.2f} ms, head ({len(op.planes)} planes) "
          f"{ms(lambda: logits(x)):.2f} ms per step")  # fmt: skip


if __name__ == "__main__":
    main()
