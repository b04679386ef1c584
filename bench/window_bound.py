"""Tokens held per layer under every KV method on a sliding-window model (issue 47's window bound).

    python bench/family_shapes.py gemma3-1b /tmp/gemma3-1b.q8_0.gguf
    python bench/window_bound.py -m /tmp/gemma3-1b.q8_0.gguf --tokens 3000

Prefills the GPL-3 text (cut to --tokens tokens, in chunks of 256) and decodes --decode greedy
tokens under each method, then prints, per method: the most tokens any local (windowed) layer
holds, the window, what the global layers hold, and `kv_bytes`. A local layer holding more than
its window is marked and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys

METHODS = ["full", "streaming", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "kvzip", "minikv",
           "xkv", "minicache", "spindlekv", "duo", "kvzap", "snapkv+kivi2", "minicache+kivi4"]  # fmt: skip
TEXT = "/usr/share/common-licenses/GPL-3"


def held(model: str, methods: list[str], tokens: int, decode: int, budget: str | None) -> list:
    import torch

    from kvrun.errors import KvrunError
    from kvrun.kv import check
    from kvrun.run.runtime import load_runtime
    from kvrun.run.session import Session

    rt = load_runtime(model, log=lambda s: None)
    c = rt.model.config
    with open(TEXT) as f:
        ids = rt.tokenizer.encode(f.read())
    ids = (ids * (tokens // max(len(ids), 1) + 1))[:tokens]
    rows = []
    for m in methods:
        try:  # the budget where the method takes one
            spec = check(m, budget)
        except KvrunError:
            spec = check(m)
        try:
            kv = rt.new_kv(spec)
            s = Session(rt.model, rt.tokenizer, kv, ubatch=256)
            with torch.inference_mode():
                logits = s.prefill(ids)
                for _ in range(decode):
                    logits = s.decode(int(logits.argmax()))
        except KvrunError as e:  # e.g. a calibrated method without its calibration
            rows.append({"method": m, "error": str(e)})
            continue
        if not hasattr(kv, "kept_counts"):
            rows.append({"method": m, "error": "no kept_counts()"})
            continue
        counts = kv.kept_counts()
        local = [i for i in range(c.n_layers) if c.window(i)]
        rows.append({
            "method": m,
            "window": max((c.window(i) for i in local), default=None),
            "local_max": max((counts[i] for i in local), default=None),
            "global_max": max((counts[i] for i in range(c.n_layers) if i not in local), default=0),
            "kv_bytes": kv.nbytes(),
        })  # fmt: skip
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="a GGUF with sliding-window layers")
    ap.add_argument("--tokens", type=int, default=3000, help="prompt tokens (default 3000)")
    ap.add_argument("--decode", type=int, default=8, help="greedy steps after the prompt")
    ap.add_argument("--budget", default="0.1", help="--kv-budget of the methods that take one")
    ap.add_argument("--kv", action="append", help="methods (default: every method and stack)")
    a = ap.parse_args()
    rows = held(a.model, a.kv or METHODS, a.tokens, a.decode, a.budget)
    print("| --kv | window | most held by a local layer | most held by a global layer | KV bytes |")
    print("|---|---:|---:|---:|---:|")
    bad = 0
    for r in rows:
        if "error" in r:
            print(f"| {r['method']} | {r['error']} | | | |")
            bad += 1
            continue
        over = r["window"] is not None and r["local_max"] > r["window"]
        bad += over
        mark = " (over the window)" if over else ""
        print(f"| {r['method']} | {r['window']} | {r['local_max']}{mark} | {r['global_max']} "
              f"| {r['kv_bytes'] / 1e6:.1f} MB |")  # fmt: skip
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
