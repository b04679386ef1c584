"""The headline table: every KV method on one model, quality and cost side by side.

    python bench/headline_table.py --text book.txt [-m smollm2] [--budget 0.25] [--quick]

For each method (all of `kvrun kv list`, plus the snapkv+kivi2, minicache+kivi4 and
xkv+kivi2 stacks) at one setting: methods whose budget is a token fraction at --budget;
methods with a default of their own at it (MiniKV: 25 % heavy hitters + 25 % recent window of
the prompt, its paper's setting, so about twice --budget); the others at their defaults.
Next to each budget: the KV bytes measured after the --depth fill (compare methods at equal
memory by this column, not by the budget), and for SpindleKV, whose budget is its
per-query-head eviction ratio, the paper's reported "Ratio" (Eq. 15, r1 * r2 * r3) as well:
  - pass key: accuracy over lengths 1k, 2k, 4k x depths 0, 50, 100 % (kvrun needle's grid,
    our own filler from prompts/passkey_filler.txt, greedy, raw prompts), with the question
    in the prompt and with --question-after (the haystack compressed before the question);
  - KL vs full: mean KL(P_full || P_method) over 64 teacher-forced tokens after a 4000-token
    prefix of --text (kvrun perplexity's scoring; supply any long English text yourself);
  - KV bytes / full: measured nbytes() / nbytes_full() after a --depth-token fill + decode;
  - decode tok/s and its ratio to the full cache (kvrun bench's loop, random token ids).
The table goes to stdout and into bench/README.md between headline markers (replaced on
each run) with the date, machine and command. --quick is a tiny smoke run of the same code.

A full run takes hours on a 2-core CPU. --results FILE keeps each finished part (acc, after,
kl, speed), and each finished pass-key prompt of a part under way, in a JSON file; a rerun
with the same settings takes them from there, so a run can be resumed, and --parts picks what this run measures: the accuracy parts give the same
answers however busy the machine is, the speed part wants it quiet, e.g.
    nice python bench/headline_table.py --text T --results h.json --parts acc,after,kl   # any time
    python bench/headline_table.py --text T --results h.json --parts speed              # quiet
The table is written once every part is there.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from bench_harness import alternate, log, md_head, md_row, utc_now, write_section

from kvrun.errors import KvrunError
from kvrun.kv import REGISTRY, check
from kvrun.run.runtime import load_runtime
from kvrun.run.session import Session
from kvrun.tasks import needle as nd
from kvrun.tasks import perplexity as ppl
from kvrun.tasks.bench import bench_row, machine, rep_stats
from kvrun.tasks.bench_settings import BenchSettings
from kvrun.tasks.passkey import filler_units

BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"
PARTS = ("acc", "after", "kl", "speed")
README = Path(__file__).with_name("README.md")


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="model name or path (default smollm2)")
    ap.add_argument("--text", default=None, help="long English text for the KL column")
    ap.add_argument("--budget", default="0.25", help="budget of selecting methods")
    ap.add_argument(
        "--methods", default=",".join(REGISTRY) + ",snapkv+kivi2,minicache+kivi4,xkv+kivi2"
    )
    ap.add_argument("--lengths", default="1000,2000,4000")
    ap.add_argument("--depths", default="0,50,100")
    ap.add_argument("--kl-context", type=int, default=4000)
    ap.add_argument("--kl-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4000, help="cache fill before timed decode")
    ap.add_argument("-n", type=int, default=64, help="decode tokens timed per rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument("--out", default=str(README), help="markdown file to update")
    ap.add_argument("--parts", default=",".join(PARTS), help="parts this run measures")
    ap.add_argument("--results", default=None, help="JSON file keeping finished parts")
    a = ap.parse_args()
    if a.quick:
        a.lengths, a.depths, a.kl_context, a.kl_tokens = "600", "50", 256, 16
        a.depth, a.n, a.reps = 256, 8, 1
    bad = set(a.parts.split(",")) - set(PARTS)
    if bad:
        ap.error(f"unknown part {sorted(bad)[0]!r}: choose from {', '.join(PARTS)}")
    return a


def passkey_accuracy(rt, configs, a, res: Results, part: str) -> dict:
    """(method, budget) -> (correct, trials) over the length x depth grid; the records of
    each finished prompt (cell) are kept in --results, and a rerun starts after them (a
    cell's prompt and answer depend only on the seed and the cell)."""
    question_after = part == "after"
    task = nd.NeedleTask("passkey", filler_units(), rt.tokenizer.encode, a.seed,
                         question_after=question_after)  # fmt: skip
    cells = nd.grid(nd.parse_lengths(a.lengths), nd.parse_depths(a.depths), 1)
    records, before = res.partial(part)
    skip = len(records) // len(configs)
    if skip:
        log(f"pass key{' (question after)' * question_after}: {skip}/{len(cells)} prompts kept")
    t0 = time.time()
    for i, rec in enumerate(nd.run_grid(rt, task, configs, cells[skip:], n_predict=12)):
        records.append(rec)
        if (i + 1) % len(configs) == 0:
            res.keep_partial(part, records, before + time.time() - t0)
            log(
                f"pass key{' (question after)' * question_after}: "
                f"{skip + (i + 1) // len(configs)}/{len(cells)} prompts"
            )
    return {
        (s["method"], s["budget"]): (s["correct"], s["trials"])
        for s in nd.summarize(records, configs)
    }


def kl_vs_full(rt, configs, a) -> tuple[dict, str]:
    """(method, budget) -> mean KL over the eval tokens of one window of --text."""
    if a.text is None:
        return {}, "no --text given: KL not measured"
    try:
        text = Path(a.text).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise KvrunError(f"cannot read --text {a.text}: {e.strerror}") from None
    tok = rt.tokenizer
    tokens = ppl.file_tokens(tok, text)
    context = min(a.kl_context, rt.config.context_length - a.kl_tokens)
    ppl.check_file(len(tokens), context, a.kl_tokens, 1)
    bos = tok.bos_id if tok.add_bos else None
    out = {}
    for cfg in configs:
        method = Session(rt.model, tok, rt.new_kv(cfg.spec))
        ref = None if cfg.method == "full" else Session(rt.model, tok, rt.new_kv())
        rep = ppl.evaluate(method, ref, tokens, context, a.kl_tokens, 1, bos)
        out[(cfg.method, cfg.budget)] = rep.summary()["kl"]
        log(f"KL: {cfg.label} {out[(cfg.method, cfg.budget)]:.4f}")
    note = f"{Path(a.text).name}: {a.kl_tokens} tokens after a {context}-token prefix"
    return out, note


def speed(rt, configs, a) -> dict:
    """(method, budget) -> bench row: decode tok/s and KV bytes after a --depth fill.

    The --reps timed reps are rounds over all rows, every other round in reverse order, so
    a machine that speeds up or slows down over the run (a shared host does, by 2x over an
    hour) moves every row alike and the "vs full" ratios stay fair. The first round warms
    each row up."""
    warmed: set = set()

    def one(cfg) -> dict:
        s = BenchSettings(0, a.n, (a.depth,), 1, (cfg.method,), (cfg.budget,), a.seed,
                          specs=(cfg.spec,))  # fmt: skip
        first = cfg.label not in warmed  # the first round
        warmed.add(cfg.label)
        return bench_row(rt, cfg.method, cfg.spec, a.depth, s, warmup=first)

    def shown(label: str, r: int, row: dict) -> None:
        log(f"speed, round {r + 1}/{a.reps}: {label} {row['decode_tok_s']:.1f} tok/s")

    by_label = {cfg.label: cfg for cfg in configs}
    runners = {label: lambda cfg=cfg: one(cfg) for label, cfg in by_label.items()}
    rounds = alternate(runners, a.reps, flip=True, each=shown)
    out = {}
    for label, rows in rounds.items():
        key = (by_label[label].method, by_label[label].budget)
        tg = [x for row in rows for x in row["decode_tok_s_reps"]]
        out[key] = {**rows[-1], "reps": len(tg), **rep_stats("decode_tok_s", tg)}
    return out


def configs_of(methods: list[str], budget: str) -> list[nd.KvConfig]:
    """One KvConfig per method: --budget where the method's default budget is a fraction,
    its own default where it has one (MiniKV's heavy + recent); a method with a paper-style
    size report (SpindleKV's Eq. 15 ratio, MiniKV's App. I bytes) runs with it on."""
    out = []
    for m in methods:
        spec = check(m)
        if "report" in spec.select_opts and not spec.store:
            spec = check(f"{m}{',' if ':' in m else ':'}report=paper")
        own = spec.select.default_budget is None  # a budget of the method's own
        out += nd.kv_configs([(m, spec)], None if own else budget)
    return out


def budget_label(cfg, row: dict) -> str:
    """The budget a row ran at, in the method's own terms."""
    o, desc = cfg.spec.select_opts, row["kv_method"]
    if cfg.budget is None and cfg.spec.select.default_budget is None and cfg.spec.takes_budget:
        return f"{o['heavy']:g} heavy + {o['recent']:g} recent (own)"
    label = cfg.budget or "-"
    if isinstance(desc.get("paper"), dict):  # SpindleKV: eviction ratio, and the paper's Ratio
        label += f" (paper Ratio {desc['paper']['ratio']:.3f})"
    return label


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def settings(spec) -> str:
    """The method's axes: scorer / allocator / store (stacked store parts named)."""
    scorer, _, allocator, store = spec.select.axes
    if spec.store:
        store = f"{store}+{spec.store.name}" if store != "dense" else spec.store.name
    return f"- / - / {store}" if spec.keeps_all else f"{scorer} / {allocator} / {store}"


def table(configs, acc, after, kl, rows) -> list[str]:
    lines = md_head(
        ["method", "settings (scorer / allocator / store)", "budget", "KV bytes", "pass key",
         "pass key, question after", "KL vs full (nats)", "KV bytes / full", "decode tok/s",
         "vs full"], "llrrrrrrrr",
    )  # fmt: skip
    full = rows[("full", None)]["decode_tok_s"]
    for cfg in configs:
        key = (cfg.method, cfg.budget)
        c, n = acc[key]
        ca, na = after[key]
        r = rows[key]
        k = f"{kl[key]:.4f}" if key in kl else "-"
        lines.append(md_row([
            cfg.method, settings(cfg.spec), budget_label(cfg, r), mib(r["kv_bytes"]),
            f"{c}/{n} ({c / n:.0%})", f"{ca}/{na} ({ca / na:.0%})", k, f"{r['kv_ratio']:.3f}",
            f"{r['decode_tok_s']:.1f}", f"{r['decode_tok_s'] / full:.2f}x",
        ]))  # fmt: skip
    return lines


class Results:
    """Finished parts kept in a JSON file, valid only for the settings they ran with."""

    def __init__(self, path: str | None, a: argparse.Namespace):
        keep = ("parts", "results", "out", "quick")
        self.settings = {k: v for k, v in sorted(vars(a).items()) if k not in keep}
        self.path = Path(path) if path else None
        self.parts: dict = {}
        if self.path and self.path.exists():
            try:
                saved = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                saved = {}
            if saved.get("settings") == self.settings:
                self.parts = saved.get("parts", {})
            else:
                log(f"{self.path}: other settings or unreadable, starting afresh")

    def get(self, part: str):
        """(value by (method, budget), extra, seconds) of a kept part, or None."""
        got = self.parts.get(part)
        if got is None:
            return None
        return {(m, b): v for m, b, v in got["rows"]}, got.get("extra"), got["seconds"]

    def put(self, part: str, values: dict, extra, seconds: float) -> None:
        rows = [[m, b, v] for (m, b), v in values.items()]
        seconds += self.partial(part)[1]  # the time of earlier runs' finished cells
        self.parts.pop(f"{part}:cells", None)
        self.parts[part] = {"rows": rows, "extra": extra, "seconds": seconds}
        self._save()

    def partial(self, part: str) -> tuple[list, float]:
        """Records of the part's cells finished by earlier runs, and their seconds."""
        got = self.parts.get(f"{part}:cells") or {"records": [], "seconds": 0.0}
        return list(got["records"]), got["seconds"]

    def keep_partial(self, part: str, records: list, seconds: float) -> None:
        self.parts[f"{part}:cells"] = {"records": records, "seconds": seconds}
        self._save()

    def _save(self) -> None:
        if self.path:
            body = {"settings": self.settings, "parts": self.parts}
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(body, indent=1), encoding="utf-8")
            tmp.replace(self.path)  # a kill mid-write leaves the last good file


def measure(rt, configs, a) -> tuple[dict, float] | None:
    """Every part, run here or taken from --results; None while some are still missing."""
    res = Results(a.results, a)
    run = {
        "acc": lambda: (passkey_accuracy(rt, configs, a, res, "acc"), None),
        "after": lambda: (passkey_accuracy(rt, configs, a, res, "after"), None),
        "kl": lambda: kl_vs_full(rt, configs, a),
        "speed": lambda: (speed(rt, configs, a), None),
    }
    out, seconds = {}, 0.0
    wanted = a.parts.split(",")
    for part in PARTS:
        got = res.get(part)
        if got is None and part in wanted:
            t0 = time.time()
            values, extra = run[part]()
            res.put(part, values, extra, time.time() - t0)
            got = res.get(part)
        if got is None:
            continue
        out[part], seconds = got, seconds + got[2]
    missing = [p for p in PARTS if p not in out]
    if missing:
        where = f"kept in {a.results}" if a.results else "not kept (no --results)"
        log(f"measured parts {', '.join(out) or 'none'} ({where}); to finish: --parts "
            f"{','.join(missing)}")  # fmt: skip
        return None
    return out, seconds


def command_args(argv: list[str]) -> list[str]:
    """The command line without --parts / --results: the one a whole run would use."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--parts", "--results"):
            skip = True
        elif not arg.startswith(("--parts=", "--results=")):
            out.append(arg)
    return out


def main() -> None:
    a = args()
    rt = load_runtime(a.model, a.dtype, a.device, log=log)
    methods = list(dict.fromkeys(["full", *a.methods.split(",")]))  # full is the reference
    configs = configs_of(methods, a.budget)
    got = measure(rt, configs, a)
    if got is None:
        return
    parts, seconds = got
    acc, after, (kl, kl_note, _), rows = (
        parts["acc"][0], parts["after"][0], parts["kl"], parts["speed"][0]
    )  # fmt: skip
    lines = table(configs, acc, after, kl, rows)
    m = machine(rt.model.device)
    dt = str(rt.model.dtype).removeprefix("torch.")
    body = "\n".join(
        [
            "## Headline" + (" (--quick smoke run)" if a.quick else ""),
            "",
            f"- date: {utc_now()}, {seconds:.0f} s of measuring",
            f"- machine: {m['device_name']} ({m['device']}), {dt}, {m['threads']} threads, "
            f"torch {m['torch']}, {m['platform']}",
            f"- model: {rt.config.name or rt.path.name} ({rt.path.name})",
            f"- command: `python bench/headline_table.py {shlex.join(command_args(sys.argv[1:]))}`",
            f"- pass key: lengths {a.lengths} x depths {a.depths} %, greedy, 12 tokens; "
            "question after: the haystack prefilled and compressed before the question "
            "arrives as its own turn (`kvrun needle --question-after`)",
            f"- KL: {kl_note}",
            f"- budgets: token fraction {a.budget} for the methods that take one; MiniKV at its "
            "paper's own 25 % heavy + 25 % recent of the prompt; SpindleKV's budget is its "
            "per-query-head eviction ratio, with the paper's reported Ratio (Eq. 15) beside it; "
            "KV bytes: measured after the fill (compare methods at equal memory by it)",
            f"- KV bytes and decode: {a.depth}-token fill of random ids, {a.n} greedy decode "
            f"steps, mean of {a.reps} reps after a warm-up; the reps are rounds over all rows, "
            "alternating in order, so drift of the machine's speed hits every row alike",
            "",
            *lines,
        ]
    )
    print(body)
    write_section(Path(a.out), body, BEGIN, END)
    log(f"wrote {a.out}")


if __name__ == "__main__":
    try:
        main()
    except KvrunError as e:
        sys.exit(f"error: {e}")
