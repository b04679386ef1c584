"""Whether `torch.compile` makes a decode step faster here: eager against compiled, side by side.

    python bench/compile_step.py [-m smollm2] [--prompt 16] [--steps 100] [--threads 2] [--cpp-wrapper]

kvrun decodes eagerly: on CPU a step is the flat loop of kvrun/models/fused_decode.py over the
dynamic full cache; on CUDA the static step replays from a CUDA graph (`--cuda-graph`).
torch.compile needs a step without host reads, so it compiles the static form (the one a
CUDA graph captures: buffers with room, positions as tensors, no number read back). Rows:

- eager: `Session.decode`, what kvrun runs (CPU: the dynamic step);
- static: the same step in its static form, uncaptured;
- static body, compiled: embeddings -> blocks -> final norm of the static step through
  `torch.compile(dynamic=False)` (inductor; a C++ compiler on CPU; with --cpp-wrapper also
  a row whose wrapper is C++, so no Python runs between the kernels), the head eager: the
  part compilation can fuse (norms, RoPE, casts, SiLU). The head stays eager: its refine
  gathers a data-dependent number of rows, and compiled with it the step recompiles until
  dynamo's limit and runs at ~65 ms (measured).

The dynamic step (slices by Python lengths, reads positions back) is no candidate: dynamo
breaks it into 17 graphs and it runs at twice the eager time (measured).

Each row: the first three steps (compilation) and ms per step over --steps. The greedy
tokens of each row are checked against eager's.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvrun.kv import check
from kvrun.models import fused_decode
from kvrun.run.runtime import load_runtime
from kvrun.run.session import Session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before the steps")
    ap.add_argument(
        "--cpp-wrapper",
        action="store_true",
        help="also compile with inductor's C++ wrapper (no Python between the kernels)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = load_runtime(args.model, "auto", args.device, log=lambda m: None)
    model = rt.model
    prompt = torch.randint(100, rt.config.vocab_size, (args.prompt,), generator=torch.Generator())

    def session(graph: str) -> Session:
        s = Session(model, rt.tokenizer, rt.new_kv(check("full", None)), graph=graph)
        s.prefill(prompt.tolist())
        if graph != "off":
            s.prepare_decode(args.steps + 8)
        return s

    def compiled(cpp_wrapper: bool):
        def prep(s: Session) -> None:
            g = s.graph

            def body(tok, pos):
                return model.model.norm(model.hidden(tok, pos, g.kv))

            torch._dynamo.reset()
            opts = {"cpp_wrapper": True} if cpp_wrapper else None
            fn = torch.compile(body, dynamic=False, options=opts)
            g._forward = lambda: model.head(fn(g.tok, g.pos)).float()[0, -1]

        return prep

    rows = [("eager", "off", None), ("static", "static", None)]
    rows += [("static body, compiled", "static", compiled(False))]
    if args.cpp_wrapper:
        rows += [("static body, compiled, C++ wrapper", "static", compiled(True))]
    ref = None
    print(
        f"{rt.path.name}, {rt.model.device}, {args.threads} threads, --kv full, greedy, "
        f"{args.steps} steps after a {args.prompt}-token prompt"
    )
    print("| step | first 3 steps (s) | ms per step | tok/s | tokens = eager |")
    print("| --- | ---: | ---: | ---: | --- |")
    with torch.inference_mode():
        for name, graph, prep in rows:
            fused_decode.READ_BACK = ("cpu",) if prep is None else ()  # no reads in a graph
            s = session(graph)
            if prep is not None:
                prep(s)
            toks, tok = [], 5
            t = time.perf_counter()
            for i in range(args.steps + 3):
                if i == 3:
                    warm, t = time.perf_counter() - t, time.perf_counter()
                tok = int(s.decode(tok).argmax())
                toks.append(tok)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t) / args.steps * 1e3
            ref = ref or toks
            print(f"| {name} | {warm:.1f} | {ms:.2f} | {1e3 / ms:.1f} | "
                  f"{'yes' if toks == ref else 'NO'} |")  # fmt: skip
    fused_decode.READ_BACK = ("cpu",)


if __name__ == "__main__":
    main()
