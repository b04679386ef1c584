"""KV bytes and decode speed of every KV method on one long prompt, full cache side by side.

    python bench/kv_methods.py [-m smollm2] [--prompt-tokens 4000] [-n 32] [--budgets default,0.25]

The prompt is our pass-key filler with a key in the middle; each row prefills it through
the method, then decodes n tokens greedily. Bytes are measured (`nbytes()`), not nominal.
"""

from __future__ import annotations

import argparse
import time

from kvrun.generate import Session
from kvrun.runtime import load_runtime
from kvrun.tasks.passkey import answer_matches, passkey_prompt

METHODS = ["full", "streaming", "h2o", "snapkv", "pyramidkv", "kivi2", "kivi4", "snapkv+kivi2"]
SELECTING = {"streaming", "h2o", "snapkv", "pyramidkv", "snapkv+kivi2"}


def run_one(rt, ids, kv: str, budget: str | None, n: int) -> dict:
    s = Session(rt.model, rt.tokenizer, rt.new_kv(kv, budget))
    t0 = time.perf_counter()
    logits = s.prefill(ids)
    t1 = time.perf_counter()
    out = []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        logits = s.decode(tok)
    t2 = time.perf_counter()
    return {
        "kv": kv,
        "budget": budget or "-",
        "bytes": s.kv.nbytes(),
        "full": s.kv.nbytes_full(),
        "prefill": len(ids) / (t1 - t0),
        "decode": n / (t2 - t1),
        "text": rt.tokenizer.decode(out),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--budgets", default="default,0.25")
    ap.add_argument("--methods", default=",".join(METHODS))
    a = ap.parse_args()
    rt = load_runtime(a.model, "auto", "auto", log=lambda m: None)
    key = 49595
    ids = rt.tokenizer.encode(passkey_prompt(rt.tokenizer, a.prompt_tokens, 0.5, key))
    print(
        f"model {rt.path.name}, {rt.model.dtype}, {rt.model.device}, prompt {len(ids)} tokens, "
        f"{a.n} decode tokens"
    )
    print("| method | budget | KV bytes | full bytes | ratio | decode tok/s | vs full | pass key |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    base = None
    for kv in a.methods.split(","):
        for b in a.budgets.split(","):
            if kv not in SELECTING and b != "default":
                continue
            r = run_one(rt, ids, kv, None if b == "default" else b, a.n)
            base = base or r["decode"]
            ok = "yes" if answer_matches(r["text"], key) else "no"
            print(
                f"| {kv} | {b} | {r['bytes']:,} | {r['full']:,} | {r['bytes'] / r['full']:.3f} | "
                f"{r['decode']:.1f} | {r['decode'] / base:.2f}x | {ok} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
