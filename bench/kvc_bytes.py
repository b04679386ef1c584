"""Bytes of a .kvc file against the cache's measured bytes, per KV method (issue 39 (c)).

    python bench/kvc_bytes.py                         # the default model, a ~4k-token document
    python bench/kvc_bytes.py --tokens 2000 --kv snapkv --kv kvzip

For each method the document is prefilled and compressed (`kvrun prefill`'s path), saved,
loaded back, and a question turn is run on both: the table gives kv_bytes, the file's tensor
bytes and header bytes, their ratio, save and load times, and whether the question's logits
are equal bit for bit.
"""

from __future__ import annotations

import argparse
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvrun.errors import KvrunError
from kvrun.kv import REGISTRY, check
from kvrun.run import kvc
from kvrun.run.runtime import load_runtime
from kvrun.run.session import Session

DEFAULT_METHODS = [m for m in REGISTRY if m != "full"] + ["full", "snapkv+kivi2", "xkv+kivi4"]


def _text(tokens: int, tok) -> list[int]:
    src = Path("/usr/share/common-licenses/GPL-3")
    text = src.read_text() if src.exists() else "The quick brown fox jumps over the dog. " * 2000
    ids = tok.encode(text * 4)
    return ids[:tokens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--kv", action="append", default=None)
    ap.add_argument("--budget", default="0.25")
    a = ap.parse_args()
    rt = load_runtime(a.model, log=lambda s: print(s, file=sys.stderr))
    rt.model.use_context(8192)
    doc = _text(a.tokens, rt.tokenizer)
    question = rt.tokenizer.encode("\n\nWhat is this document about?", add_bos=False)
    print(f"model {rt.path.name}, document {len(doc)} tokens, --kv-budget {a.budget}\n")
    print("| --kv | kv_bytes | file tensors | ratio | header | save s | load s | same logits |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for text in a.kv or DEFAULT_METHODS:
            try:  # the budget where the method takes one
                spec = check(text, a.budget)
            except KvrunError:
                spec = check(text)
            s = Session(rt.model, rt.tokenizer, rt.new_kv(spec), ubatch=512, context=8192)
            s.prefill(doc)
            path = Path(tmp) / "doc.kvc"
            t0 = time.perf_counter()
            kvc.save(path, s.kv, s.tokens, rt)
            t1 = time.perf_counter()
            kv, tokens, header = kvc.load(path, rt)
            t2 = time.perf_counter()
            with open(path, "rb") as f:
                (n_head,) = struct.unpack("<Q", f.read(8))
            body = path.stat().st_size - 8 - n_head
            want = s.prefill([], question=question)
            s2 = Session(rt.model, rt.tokenizer, kv, ubatch=512, context=8192)
            s2.tokens = tokens
            same = torch.equal(s2.prefill([], question=question), want)
            held = header["kv_bytes"]
            print(
                f"| {text} | {held:,} | {body:,} | {body / held:.3f} | {n_head:,} | "
                f"{t1 - t0:.2f} | {t2 - t1:.2f} | {'yes' if same else 'NO'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
