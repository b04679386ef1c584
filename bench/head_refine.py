"""How exact the packed output head is, by refine rule: KL and perplexity against exact logits.

    python bench/head_refine.py --text /usr/share/common-licenses/GPL-3

A decode step's head product goes through PyTorch's int4 op, which rounds the activations
and the scales to bfloat16; `PackedLinear.logits` then recomputes the top logits of each row
exactly. For the final hidden states of a text (the packed model's own), this compares the
head's logits with exact ones (the dequantized table in float32) under each rule: none, a
fixed number of rows, or the rows within a margin of the largest (at most REFINE). The rows
refined are what a rule costs: each is gathered from the op's interleaved layout.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from kvrun.kv import check
from kvrun.quant import linear as packed_mod
from kvrun.run.runtime import load_runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--text", required=True, help="any long text file")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = load_runtime(args.model, "auto", "cpu", log=lambda m: None)
    m = rt.model
    head = m.model.embed_tokens if m.lm_head is None else m.lm_head
    if getattr(head, "path", "") != "int4pack":
        raise SystemExit("the head does not run through the int4 op here: nothing to refine")
    ids = rt.tokenizer.encode(open(args.text, encoding="utf-8").read())[: args.tokens]
    hidden = []
    hook = m.model.norm.register_forward_hook(lambda mod, i, o: hidden.append(o[0]))
    with torch.inference_mode():
        m(torch.tensor([ids]), torch.arange(len(ids)), rt.new_kv(check("full", None)))
        hook.remove()
        x = hidden[0]  # (T, dim)
        exact = x @ head.packed.dequantize(torch.float32).T  # (T, V)
        target = torch.tensor(ids[1:])
        ref_ppl = math.exp(F.cross_entropy(exact[:-1], target).item())
        print(f"{args.model}, {len(ids)} tokens of {args.text}; exact perplexity {ref_ppl:.4f}")
        print(
            "| rule | logits changed by the refine (mean) | perplexity vs exact | KL mean (nats) | KL max |"
        )
        print("| --- | ---: | ---: | ---: | ---: |")
        rules = [("none", 0, 0.0), ("top 64", 64, math.inf)]
        rules += [(f"within {g:g} nats, at most 64", 64, g) for g in (4.0, 6.0, 8.0)]
        approx = [head.matmul(x[t : t + 1], exact=True) for t in range(x.shape[0])]  # the op's
        for name, refine, margin in rules:
            rows, logits = [], []
            packed_mod.REFINE, packed_mod.REFINE_MARGIN = refine, margin
            for t, a in enumerate(approx):
                y = head.logits(x[t : t + 1]) if refine else a
                logits.append(y)
                rows.append(int((y != a).sum()))
            got = torch.cat(logits)
            ppl = math.exp(F.cross_entropy(got[:-1], target).item())
            lp, lq = exact.log_softmax(-1), got.log_softmax(-1)
            kl = (lp.exp() * (lp - lq)).sum(-1)
            print(f"| {name} | {sum(rows) / len(rows):.1f} | {100 * (ppl / ref_ppl - 1):+.3f}% "
                  f"| {kl.mean():.2e} | {kl.max():.2e} |")  # fmt: skip


if __name__ == "__main__":
    main()
