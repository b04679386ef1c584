"""Teacher-forced KL of KV methods against `full`, with the spread a tiny perturbation gives.

    python bench/kv_kl.py --methods snapkv+kivi2@0.25,minikv@0.1 --offsets 0,3000,6000 --seeds 5
    PYTHONPATH=OLD python bench/kv_kl.py ... --json old.json   # the checkout before, to compare

At each offset into the GPL-3 text, --prefix tokens are prefilled and the next --steps tokens
fed one at a time (teacher forcing); each step's next-token distribution is compared with
`full`'s under the same --kv-dtype: the mean KL in nats, and the share of steps whose top
token agrees. --seeds N runs each method N more times with the prefill's input embeddings
scaled by (1 + eps * noise), seeded (the reference stays unperturbed; `full` in --methods shows
what the perturbation alone costs). A 2-bit stack's KL moves by about a tenth under eps=1e-3
(bench/NOTES.md, 2026-12-07 fourth session), so one draw cannot tell two checkouts apart:
compare the means over seeds and offsets.
"""

from __future__ import annotations

import argparse
import json
import statistics

TEXT = "/usr/share/common-licenses/GPL-3"


class Perturb:
    """A forward hook on the input embeddings: (1 + eps * noise) while a generator is set."""

    def __init__(self, eps: float):
        self.eps, self.gen = eps, None

    def __call__(self, module, inputs, out):
        if self.gen is None:
            return out
        import torch

        noise = torch.randn(out.shape, generator=self.gen).to(out.device, out.dtype)
        return out * (1 + self.eps * noise)


def teacher_forced(rt, spec, ids, prefix: int, perturb: Perturb, seed: int | None):
    """log-softmax of every step's logits (steps + 1, vocab): the prefill's, then one a token."""
    import torch

    from kvrun.run.session import Session

    s = Session(rt.model, rt.tokenizer, rt.new_kv(spec))
    perturb.gen = None if seed is None else torch.Generator().manual_seed(seed)
    try:
        with torch.inference_mode():
            out = [s.prefill(ids[:prefix]).float().log_softmax(-1)]
    finally:
        perturb.gen = None
    with torch.inference_mode():
        for t in ids[prefix:-1]:
            out.append(s.decode(t).float().log_softmax(-1))
    return torch.stack(out), s.kv.nbytes()


def measure(a) -> dict:
    import torch

    from kvrun.kv import check
    from kvrun.run.runtime import load_runtime

    torch.set_num_threads(a.threads)
    rt = load_runtime(a.model, device="cpu", log=lambda m: None, wtype=a.wtype)
    perturb = Perturb(a.eps)
    rt.model.model.embed_tokens.register_forward_hook(perturb)
    with open(a.text) as f:
        text = rt.tokenizer.encode(f.read())
    seeds = [None] + list(range(a.seeds))
    result = {"settings": vars(a), "methods": {}}
    for off in a.offsets:
        ids = text[off : off + a.prefix + a.steps]
        if len(ids) < a.prefix + a.steps:
            raise SystemExit(f"offset {off}: the text has {len(text)} tokens, too few")
        ref, _ = teacher_forced(rt, check("full", None).with_dtype(a.kv_dtype), ids, a.prefix,
                                perturb, None)  # fmt: skip
        for name in a.methods:
            kv, _, budget = name.partition("@")
            spec = check(kv, budget or None).with_dtype(a.kv_dtype)
            for seed in seeds:
                lp, nbytes = teacher_forced(rt, spec, ids, a.prefix, perturb, seed)
                kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
                top = (ref.argmax(-1) == lp.argmax(-1)).float().mean().item()
                row = {"offset": off, "seed": seed, "kl": kl, "top1": top, "kv_bytes": nbytes}
                result["methods"].setdefault(name, []).append(row)
                print(f"{name} offset {off} seed {seed}: KL {kl:.4f} top-1 {top:.3f}", flush=True)
    return result


def summary(result: dict) -> list[str]:
    """A markdown row per method: each offset's mean KL over its draws (min-max where perturbed),
    the mean over offsets, top-1 agreement and bytes."""
    offsets = result["settings"]["offsets"]
    lines = ["| --kv | " + " | ".join(f"KL at {o}" for o in offsets)
             + " | mean KL | top-1 | KV bytes |", "|---" * (len(offsets) + 4) + "|"]  # fmt: skip
    for name, rows in result["methods"].items():
        cells, means = [], []
        for o in offsets:
            kl = [r["kl"] for r in rows if r["offset"] == o]
            means.append(statistics.fmean(kl))
            spread = f" ({min(kl):.4f}-{max(kl):.4f})" if len(kl) > 1 else ""
            cells.append(f"{means[-1]:.4f}{spread}")
        top = statistics.fmean(r["top1"] for r in rows)
        mb = rows[-1]["kv_bytes"] / 1e6
        lines.append(f"| {name} | " + " | ".join(cells)
                     + f" | {statistics.fmean(means):.4f} | {top:.3f} | {mb:.2f} MB |")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", required=True, help="comma list of --kv[@budget]")
    ap.add_argument("--offsets", default="0,3000,6000", help="token offsets into the text")
    ap.add_argument("--prefix", type=int, default=1500, help="tokens prefilled")
    ap.add_argument("--steps", type=int, default=96, help="tokens fed one at a time")
    ap.add_argument("--seeds", type=int, default=0, help="perturbed runs a method and offset")
    ap.add_argument("--eps", type=float, default=1e-3, help="the perturbation's relative size")
    ap.add_argument("--kv-dtype", default="auto", help="kvrun's --kv-dtype (default: auto)")
    ap.add_argument("-m", "--model", default=None, help="kvrun -m (default: the default model)")
    ap.add_argument("--wtype", default="auto", help="weights in memory (kvrun --wtype)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", default=TEXT, help="the text (default: the GPL-3)")
    ap.add_argument("--json", default=None, help="write every draw here")
    a = ap.parse_args()
    a.methods = a.methods.split(",")
    a.offsets = [int(o) for o in a.offsets.split(",")]
    if a.prefix < 1 or a.steps < 1 or a.seeds < 0:
        raise SystemExit("--prefix and --steps must be >= 1, --seeds >= 0")
    result = measure(a)
    print("\n".join(summary(result)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
