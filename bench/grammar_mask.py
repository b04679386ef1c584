"""The grammar mask's cost per decode step (structured outputs, kvrun/grammar.py).

    python bench/grammar_mask.py [-m smollm2] [--parallel 1,8] [-n 96] [--reps 3] [--out FILE]

Runs N requests at once through kvrun.engine (as kvrun serve batches them) on one loaded
model, each with its own grammar (a JSON schema of nested objects, an enum, a bounded array
and numbers), and times what the grammar adds to each decode step: llguidance's mask of every
sequence, its application to the logits and the token's acceptance, summed over the step's
sequences. Reports that per step in ms and as a fraction of the same run's mean decode step,
and the unconstrained run's mean step beside it (the same prompts, --ignore-eos to the same
length); rounds alternate the two runs. The table goes to stdout and into bench/README.md (or
--out) between grammar markers.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_harness import describe, machine, md_head, md_row, utc_now, write_section

from kvrun.engine import Engine, Request
from kvrun.generate import Session
from kvrun.grammar import Grammars, Spec
from kvrun.runtime import load_runtime
from kvrun.sampling import SamplingConfig

BEGIN, END = "<!-- grammar:begin -->", "<!-- grammar:end -->"
README = Path(__file__).with_name("README.md")
SCHEMA = {
    "type": "object",
    "properties": {
        "traveller": {"type": "string", "maxLength": 30},
        "mode": {"enum": ["train", "plane", "car"]},
        "stops": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "population": {"type": "integer", "minimum": 0, "maximum": 10**8},
                },
                "required": ["name", "population"],
                "additionalProperties": False,
            },
        },
        "budget_eur": {"type": "number", "minimum": 0, "maximum": 10**5, "multipleOf": 0.01},
    },
    "required": ["traveller", "mode", "stops", "budget_eur"],
    "additionalProperties": False,
}
SCHEMA_TEXT = json.dumps(SCHEMA)
PROMPTS = [
    "Plan a trip through {} European cities as JSON.",
    "Describe a journey across {} countries in Asia as JSON.",
]


class Timed:
    """A Constraint whose mask and accept add their seconds to `spent`."""

    def __init__(self, inner, spent: list[float]):
        self.inner, self.spent = inner, spent

    def mask(self, row):
        t = time.perf_counter()
        out = self.inner.mask(row)
        self.spent[0] += time.perf_counter() - t
        return out

    def accept(self, token: int) -> None:
        t = time.perf_counter()
        self.inner.accept(token)
        self.spent[0] += time.perf_counter() - t

    @property
    def accepting(self) -> bool:
        return self.inner.accepting

    @property
    def finished(self) -> bool:
        return self.inner.finished


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--parallel", default="1,8")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(README))
    return ap.parse_args()


def run(rt, grammars, n_seq: int, n: int, constrained: bool) -> tuple[float, float, int]:
    """(decode s, grammar s, decode steps) of n_seq requests at once."""
    sessions = [Session(rt.model, rt.tokenizer, rt.new_kv()) for _ in range(n_seq)]
    engine = Engine(sessions)
    spent = [0.0]
    reqs = []
    for i in range(n_seq):
        text = PROMPTS[i % 2].format(i + 2)
        ids = rt.tokenizer.encode(
            rt.tokenizer.render_chat([{"role": "user", "content": text}], True)
        )
        c = (
            Timed(grammars.compile(Spec("json_schema", SCHEMA_TEXT)), spent)
            if constrained
            else None
        )
        # unconstrained: as many tokens as the grammar would allow at most (no early stop)
        cfg = SamplingConfig(temp=0.0, ignore_eos=not constrained)
        reqs.append(Request(ids, n, cfg, seed=i, constraint=c))
    errors = []
    st = engine.run(reqs, lambda r, res, err: err and errors.append(err))
    if errors:
        raise SystemExit(f"a request failed: {errors[0]}")
    return st.decode_s, spent[0], st.decode_steps


def main() -> None:
    a = args()
    rt = load_runtime(a.model, "auto", "cpu", log=lambda m: print(m, file=sys.stderr))
    grammars = Grammars(rt.tokenizer, rt.config.vocab_size)
    t = time.perf_counter()
    grammars.ll_tokenizer()
    trie_s = time.perf_counter() - t
    t = time.perf_counter()
    grammars.compile(Spec("json_schema", SCHEMA_TEXT))
    compile_ms = 1e3 * (time.perf_counter() - t)
    run(rt, grammars, 2, 8, True)  # warm-up (kernel probes, first masks)
    rows = []
    for n_seq in (int(x) for x in a.parallel.split(",")):
        plain, masked, share = [], [], []
        for _ in range(a.reps):  # alternate: the host's speed drifts
            d, _, steps = run(rt, grammars, n_seq, a.n, False)
            plain.append(d / steps)
            d, g, steps = run(rt, grammars, n_seq, a.n, True)
            masked.append(d / steps)
            share.append((g / steps, g / d))
        step_g = statistics.median(s for s, _ in share)
        frac = statistics.median(f for _, f in share)
        rows.append(
            md_row(
                [
                    n_seq,
                    f"{1e3 * statistics.median(plain):.1f}",
                    f"{1e3 * statistics.median(masked):.1f}",
                    f"{1e3 * step_g:.2f}",
                    f"{100 * frac:.1f}%",
                ]
            )  # fmt: skip
        )
        print(rows[-1], file=sys.stderr, flush=True)
    head = md_head(["-np", "decode step, no grammar (ms)", "decode step, grammar (ms)",
                    "grammar per step (ms)", "grammar / step"], "rrrrr")  # fmt: skip
    body = "\n".join(
        [
            "## Grammar masks (structured outputs)",
            "",
            f"- date: {utc_now()}",
            f"- machine: {describe(machine())}, {torch.get_num_threads()} threads",
            f"- model: {rt.path.name} (wtype {rt.weights.wtype}), vocabulary "
            f"{rt.config.vocab_size}; llguidance's token trie built once in {trie_s:.2f} s, "
            f"the schema compiled in {compile_ms:.1f} ms",
            f"- command: `python bench/grammar_mask.py {shlex.join(sys.argv[1:])}`",
            f"- -np requests at once, greedy, up to {a.n} tokens each under a JSON schema "
            "(nested objects, an enum, a bounded array, numbers); medians of "
            f"{a.reps} alternated rounds",
            "",
            *head,
            *rows,
            "",
            "grammar per step: llguidance's masks for every sequence of the step, applied to "
            "the logits, and each drawn token accepted; grammar / step: that over the "
            "constrained run's mean decode step. The masks of a step run one after another "
            "on the engine thread, so the cost grows with -np while the forward pass of a "
            "batch grows less.",
        ]
    )
    print(body)
    write_section(Path(a.out), body, BEGIN, END)


if __name__ == "__main__":
    main()
