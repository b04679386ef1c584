"""The needle grid: prompt lengths x needle depths x seeded trials x KV configs, scored.

Two modes share one prompt builder (passkey.fit_prompt): `passkey` hides "the pass key is N"
in our filler and asks for N; `niah` hides the user's needle sentence in the user's haystack
and asks the user's question, correct when the answer text is in the reply.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KvrunError
from ..kv import KVSpec
from . import passkey
from .trials import Trial, run_trials

LADDER = (1000, 2000, 4000, 8000)  # the default --lengths, cut to what fits the context


def parse_lengths(text: str) -> list[int]:
    """'2k,1k,1500' -> [1000, 1500, 2000] (k = 1000 tokens; sorted, no repeats)."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kK]?)", item)
        n = round(float(m.group(1)) * (1000 if m.group(2) else 1)) if m else 0
        if n <= 0:
            raise KvrunError(
                f"--lengths: {item!r} is not a length in tokens (use forms like 1k,2k,1500)"
            )
        out.append(n)
    return sorted(set(out))


def pick_lengths(text: str | None, context: int, n_predict: int) -> list[int]:
    """--lengths (each must fit the context with -n), or LADDER cut to what fits."""
    if text is None:
        return [n for n in LADDER if n + n_predict <= context] or [context - n_predict]
    lengths = parse_lengths(text)
    if max(lengths) + n_predict > context:
        raise KvrunError(
            f"--lengths {fmt_length(max(lengths))} plus -n {n_predict} does not fit the context of "
            f"{context} tokens; use --lengths up to {context - n_predict} or raise -c/--ctx-size "
            "up to the model's context"
        )
    return lengths


def parse_depths(text: str) -> list[float]:
    """'50,0,25%' -> [0.0, 25.0, 50.0] (percent of the haystack before the needle; sorted)."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        try:
            d = float(item.removesuffix("%"))
        except ValueError:
            d = -1.0
        if not 0 <= d <= 100:
            raise KvrunError(f"--depths: {item!r} is not a percentage from 0 to 100")
        out.append(d)
    return sorted(set(out))


def fmt_length(n: int) -> str:
    """1000 -> '1k', 1500 -> '1.5k', 700 -> '700'."""
    return f"{n / 1000:g}k" if n >= 1000 and n % 100 == 0 else str(n)


def fmt_depth(d: float) -> str:
    return f"{d:g}%"


@dataclass(frozen=True, slots=True)
class KvConfig:
    """One column of the comparison: a --kv method and the budget it runs at (None: none)."""

    method: str
    budget: str | None
    spec: KVSpec = field(compare=False, repr=False)  # the method at that budget, validated

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method} @ {self.budget}"


def kv_configs(methods: list[tuple[str, KVSpec]], budgets: str | None) -> list[KvConfig]:
    """Every method (its --kv text and spec) x budget, each checked against the method's
    budget rules; methods that take no budget (full, kivi*, minicache) run once."""
    bs = [b.strip() for b in budgets.split(",")] if budgets else [None]
    out: dict[KvConfig, None] = {}
    for text, spec in methods:
        for b in bs if spec.takes_budget else [None]:
            out.setdefault(KvConfig(text, b, spec.with_budget(b)))
    return list(out)


@dataclass(frozen=True, slots=True)
class Cell:
    """One prompt of the grid (every KV config answers the same prompt)."""

    length: int  # target prompt tokens
    depth: float  # percent
    trial: int


def grid(lengths: list[int], depths: list[float], trials: int) -> list[Cell]:
    """Short prompts first (lengths sorted), so an interrupted run has every method's rows."""
    return [Cell(n, d, t) for n in lengths for d in depths for t in range(trials)]


def trial_key(seed: int, cell: Cell) -> int:
    """The 5-digit pass key of one cell, a function of --seed and the cell only."""
    return random.Random(f"kvrun-needle/{seed}/{cell.length}/{cell.depth}/{cell.trial}").randint(
        10000, 99999
    )


@dataclass
class NeedleTask:
    """Builds the prompt of each cell and scores replies."""

    mode: str  # "passkey" | "niah"
    units: list[str]  # haystack sentences
    encode: Callable[[str], list[int]]  # prompt text -> ids (chat template applied)
    seed: int
    needle: str = ""
    question: str = ""
    answer: str = ""
    question_after: bool = False  # the haystack is compressed before the question arrives
    _prefix: str = field(init=False, default="")
    _suffix: str = field(init=False, default="")

    def __post_init__(self):
        if self.mode == "passkey":
            self._prefix, self._suffix = passkey.INTRO, passkey.QUESTION
        else:
            before, _, after = passkey.question_template().partition("{haystack}")
            self._prefix = before.replace("{question}", self.question)
            self._suffix = after.replace("{question}", self.question)

    def offset(self, trial: int) -> int:
        """Trial 0 starts the haystack at its start, later ones at a seeded sentence."""
        rng = random.Random(f"kvrun-needle/{self.seed}/offset/{trial}")
        return 0 if trial == 0 else rng.randrange(len(self.units))

    def check_fits(self, length: int) -> None:
        """A one-line error when `length` cannot hold the prompt without any haystack."""
        need = len(self.encode(self._prefix + self.needle_text(12345) + self._suffix))
        if need > length:
            raise KvrunError(
                f"--lengths {length} is too short: the needle and question alone take {need} tokens"
            )

    def needle_text(self, key: int) -> str:
        return passkey.NEEDLE.format(key=key) if self.mode == "passkey" else self.needle

    def expected(self, cell: Cell) -> dict:
        if self.mode == "passkey":
            key = trial_key(self.seed, cell)
            return {"key": key, "answer": str(key)}
        return {"answer": self.answer}

    def prompt(self, cell: Cell, expected: dict) -> passkey.NeedlePrompt:
        needle = self.needle_text(expected.get("key", 0))
        try:
            return passkey.fit_prompt(
                self.encode,
                self.units,
                cell.length,
                cell.depth / 100,
                needle,
                self._prefix,
                self._suffix,
                self.offset(cell.trial),
            )
        except ValueError as e:
            raise KvrunError(f"--lengths {cell.length} is too short: {e}") from None

    def turns(self, p: passkey.NeedlePrompt) -> tuple[list[int], list[int] | None]:
        """The prompt's ids, or with question_after the haystack's turn and the question's:
        the same ids, cut where the text after the haystack starts (the longest common prefix
        with the prompt's encoding without it, so the cut follows the tokenizer)."""
        if not self.question_after:
            return p.ids, None
        head = self.encode(p.text[: len(p.text) - len(self._suffix)])
        k = 0
        while k < min(len(head), len(p.ids)) and head[k] == p.ids[k]:
            k += 1
        return p.ids[:k], p.ids[k:]

    def correct(self, reply: str, expected: dict) -> bool:
        if self.mode == "passkey":
            return passkey.answer_matches(reply, expected["key"])
        return passkey.answer_found(reply, expected["answer"])


@dataclass(frozen=True)
class GridOptions:
    """What the command line asks of every trial, known before a model loads; `setup` makes
    the grid's task on a loaded model (here, or on a Ray worker)."""

    mode: str  # "passkey" | "niah"
    units: list[str]  # haystack sentences
    seed: int
    lengths: str | None  # --lengths as given (None: LADDER cut to the context)
    n_predict: int
    chat: bool
    parallel: int  # trials decoded together (kvrun.engine)
    needle: str = ""
    question: str = ""
    answer: str = ""
    question_after: bool = False

    def setup(self, rt, configs: list[KvConfig], ctx_size: int):
        """(context, lengths, task) on a loaded model: what only the model can tell (head_dim
        vs. KIVI group, the prompt's own length) fails now."""
        context = ctx_size or rt.config.context_length
        lengths = pick_lengths(self.lengths, context, self.n_predict)
        for cfg in configs:
            rt.new_kv(cfg.spec)
        tok = rt.tokenizer

        def encode(text: str) -> list[int]:
            if self.chat:
                msg = [{"role": "user", "content": text}]
                text = tok.render_chat(msg, add_generation_prompt=True)
            return tok.encode(text)

        task = NeedleTask(
            self.mode,
            self.units,
            encode,
            self.seed,
            self.needle,
            self.question,
            self.answer,
            self.question_after,
        )
        task.check_fits(min(lengths))
        return context, lengths, task


def run_grid(
    rt,
    task: NeedleTask,
    configs: list[KvConfig],
    cells: list[Cell],
    n_predict: int,
    ubatch: int = 512,
    context: int = 0,
    on_start: Callable[[Cell, KvConfig], None] | None = None,
    parallel: int = 1,
) -> Iterator[dict]:
    """One record per (cell, config), in grid order, each with a fresh KV manager; with
    parallel > 1, that many trials decode together (kvrun.engine), records still in order."""

    def trials():
        for cell, cfg, expected, p in _trials(task, configs, cells, on_start):
            ids, question = task.turns(p)
            label = f"needle trial {cell.length} tokens at {cell.depth}%"
            yield Trial((cell, cfg, expected, p), cfg.spec, ids, question, n_predict, label)

    for t, r in run_trials(rt, trials(), task.seed, ubatch, context, parallel):
        yield _record(task, *t.tag, r)


def _trials(task: NeedleTask, configs: list[KvConfig], cells: list[Cell], on_start):
    """(cell, config, expected answer, prompt) in grid order; on_start is told of each."""
    for cell in cells:
        expected = task.expected(cell)
        p = task.prompt(cell, expected)
        for cfg in configs:
            if on_start:
                on_start(cell, cfg)
            yield cell, cfg, expected, p


def _record(task: NeedleTask, cell: Cell, cfg: KvConfig, expected: dict, p, r) -> dict:
    return {
        "method": cfg.method,
        "budget": cfg.budget,
        "length": cell.length,
        "depth": cell.depth,
        "needle_depth": round(p.needle_depth * 100, 2),
        "trial": cell.trial,
        "question_after": task.question_after,
        **expected,
        "reply": r.text,
        "correct": task.correct(r.text, expected),
        **r.stats.as_dict(),  # prompt_tokens, kv_bytes, kv_bytes_full, timings, ...
    }


def summarize(records: list[dict], configs: list[KvConfig]) -> list[dict]:
    """Per config: accuracy, mean measured KV ratio, mean prefill and decode speed."""
    out = []
    for cfg in configs:
        rs = [r for r in records if (r["method"], r["budget"]) == (cfg.method, cfg.budget)]

        def mean(key: str, nd: int = 4, rs=rs) -> float:
            return round(sum(float(r[key]) for r in rs) / len(rs), nd) if rs else 0.0

        out.append(
            {"method": cfg.method, "budget": cfg.budget, "trials": len(rs)}
            | {"correct": sum(r["correct"] for r in rs), "accuracy": mean("correct")}
            | {"kv_ratio": mean("kv_ratio"), "kv_bytes": round(mean("kv_bytes"))}
            | {"prefill_tok_s": mean("prefill_tok_s", 2), "decode_tok_s": mean("decode_tok_s", 2)}
        )
    return out


def heat(records: list[dict], cfg: KvConfig) -> dict[tuple[float, int], tuple[int, int]]:
    """(depth, length) -> (correct, trials) for one config."""
    out: dict[tuple[float, int], tuple[int, int]] = {}
    for r in records:
        if (r["method"], r["budget"]) == (cfg.method, cfg.budget):
            c, n = out.get((r["depth"], r["length"]), (0, 0))
            out[(r["depth"], r["length"])] = (c + bool(r["correct"]), n + 1)
    return out


def write_json(path: str, doc: dict) -> None:
    """Write atomically (a temporary file renamed over), so an interrupt never leaves half."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    try:
        tmp.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, p)
    except OSError as e:
        raise KvrunError(f"cannot write --json {path}: {e.strerror}") from None


def settings(rt, **fields) -> dict:
    """The run's settings for the JSON: the model, the fields given, dtype and device."""
    return settings_from(model_facts(rt), **fields)


def model_facts(rt) -> dict:
    """What the settings say of the loaded model (a Ray worker sends these to the driver)."""
    return {
        "model": str(rt.path),
        "model_name": rt.config.name,
        "model_context": rt.config.context_length,
        "dtype": str(rt.model.dtype).removeprefix("torch."),
        "wtype": rt.weights.wtype,
        "device": str(rt.model.device),
    }


def settings_from(facts: dict, **fields) -> dict:
    head = {k: facts[k] for k in ("model", "model_name", "model_context")}
    return {**head, **fields, **{k: facts[k] for k in ("dtype", "wtype", "device")}}
