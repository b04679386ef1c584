"""A fingerprint of every KV method on the default model, to show a refactor changed nothing.

    PYTHONPATH=<checkout> python bench/kv_fingerprint.py out.json             # --wtype f32
    PYTHONPATH=<checkout> python bench/kv_fingerprint.py out.json --wtype auto
    python bench/kv_fingerprint.py --compare a.json b.json

For each method (alone and in stacks): 16 greedy tokens after a ~1,300-token prompt (the
GPL-3 text, prefilled in chunks of 256), the KV bytes held and a hash of the last logits'
bytes. Run it under two checkouts (a `git worktree` of the older one on PYTHONPATH) and
compare: equal hashes mean bit-identical logits. --wtype f32 (the default) is the exact
path (dense float32 weights), what KV-layer refactors must keep bit for bit; --wtype auto
fingerprints the default weights' path too (it changes with the weight kernels).
"""

from __future__ import annotations

import argparse
import hashlib
import json

METHODS = ["full", "streaming", "h2o", "snapkv", "pyramidkv", "minikv", "xkv", "minicache",
           "spindlekv", "snapkv+kivi2", "full+kivi4", "minicache+kivi4", "xkv+kivi2"]  # fmt: skip
TEXT = "/usr/share/common-licenses/GPL-3"


def fingerprint(wtype: str = "f32") -> dict:
    import torch

    from kvrun.kv import check
    from kvrun.run.runtime import load_runtime
    from kvrun.run.session import Session

    rt = load_runtime(None, log=lambda s: None, wtype=wtype)
    with open(TEXT) as f:
        ids = rt.tokenizer.encode(f.read()[:6000])
    out = {}
    for m in METHODS:
        kv = rt.new_kv(check(m, None))
        s = Session(rt.model, rt.tokenizer, kv, ubatch=256)
        with torch.inference_mode():
            logits, toks = s.prefill(ids), []
            for _ in range(16):
                toks.append(int(logits.argmax()))
                logits = s.decode(toks[-1])
        digest = hashlib.sha1(logits.float().numpy().tobytes()).hexdigest()[:12]
        out[m] = {"toks": toks, "bytes": kv.nbytes(), "logits": digest}
        print(m, out[m], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", help="JSON to write")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two JSON files to compare")
    ap.add_argument("--wtype", default="f32", help="weights in memory (default: the exact path)")
    a = ap.parse_args()
    if a.compare:
        x, y = (json.load(open(p)) for p in a.compare)
        for m in x:
            print(m, "same" if x[m] == y.get(m) else f"DIFFERENT: {x[m]} vs {y.get(m)}")
        return
    result = fingerprint(a.wtype)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
