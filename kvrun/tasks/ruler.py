"""kvrun ruler: RULER's synthetic tasks (kvrun.tasks.ruler_tasks) made to a length in the model's
own tokens, and scored as RULER and kvpress score them.

A sample is (context, question, answer prefix, answers): kvpress's split, so the context (the
instructions and the haystack) is what a method compresses, and with --question-after the
question and answer prefix arrive as a turn of their own. The two parts are tokenized apart
(as kvpress does), so a run with and without --question-after sees the same tokens.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import KvrunError
from . import ruler_tasks as rt_
from .ruler_tasks import LEFT_OUT, TASKS

VT_EXAMPLE_TOKENS = 500  # RULER sizes vt's one-shot example to 500 tokens


@dataclass(frozen=True, slots=True)
class Sample:
    """One prompt of one task."""

    task: str
    index: int
    context: str  # instructions + haystack: what a method compresses
    question: str
    answer_prefix: str  # the start of the answer, put after the chat template's assistant turn
    answers: list[str]  # every one must appear in the reply (RULER's string_match_all)
    n_predict: int
    prompt_tokens: int  # as built, with the chat template

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


def parse_tasks(text: str | None) -> list[str]:
    """--tasks a,b (default every offline task), in RULER's order; a one-line error for others."""
    if text is None:
        return list(TASKS)
    asked = [t.strip() for t in text.split(",") if t.strip()]
    for t in asked:
        if t in LEFT_OUT:
            raise KvrunError(
                f"--tasks {t}: RULER's QA tasks need SQuAD / HotpotQA, which kvrun does not "
                "download; the offline tasks are " + ", ".join(TASKS)
            )
        if t not in TASKS:
            raise KvrunError(f"--tasks {t}: no such task; choose from {', '.join(TASKS)}")
    if not asked:
        raise KvrunError("--tasks: give at least one task")
    return [t for t in TASKS if t in asked]


def parse_length(text: str) -> int:
    """'4k' -> 4096 (k = 1024, as RULER's 4k, 8k, ... are), '3000' -> 3000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kK]?)\s*", text)
    n = round(float(m.group(1)) * (1024 if m.group(2) else 1)) if m else 0
    if n <= 0:
        raise KvrunError(f"--length {text!r}: give tokens, such as 4k (4096) or 3000")
    return n


@dataclass(frozen=True)
class PromptForm:
    """How a sample becomes token ids: encode(text, first) -> ids (first: the prompt's start,
    where a BOS may go); head/tail: the chat template's text around the user's message
    (empty with --raw)."""

    encode: Callable[[str, bool], list[int]]
    head: str = ""
    tail: str = ""

    def ids(self, context: str, question: str, answer_prefix: str) -> tuple[list[int], list[int]]:
        """(context ids, question ids): the context turn and the question turn."""
        return self.encode(self.head + context, True), self.encode(
            question + self.tail + answer_prefix, False
        )

    def count(self, context: str, question: str, answer_prefix: str) -> int:
        a, b = self.ids(context, question, answer_prefix)
        return len(a) + len(b)


def prompt_form(tokenizer, chat: bool) -> PromptForm:
    """The form of the model's prompts: the chat template split around the user's message
    (kvpress's way), or the raw text (RULER's "base" template)."""
    encode = lambda text, first: tokenizer.encode(text, add_bos=None if first else False)  # noqa: E731
    if not chat:
        return PromptForm(encode)
    slot = "kvrunRulerSlot"
    text = tokenizer.render_chat([{"role": "user", "content": slot}], add_generation_prompt=True)
    head, _, tail = text.partition(slot)
    return PromptForm(encode, head, tail)


class Generator:
    """Samples of the tasks at `length` tokens (prompt + the task's tokens to generate), for
    one tokenizer and seed: sample(task, index) is a function of those alone."""

    def __init__(self, form: PromptForm, length: int, seed: int):
        self.form, self.length, self.seed = form, length, seed

    def rng(self, *parts) -> random.Random:
        return random.Random("/".join(["kvrun-ruler", str(self.seed), *map(str, parts)]))

    def sample(self, task: str, index: int) -> Sample:
        t = TASKS[task]
        build = rt_.BUILDERS[t.family]
        extra = {}
        if t.family == "vt":
            extra["example"] = self._vt_example(task, index)

        def parts(n: int):
            return build(self.rng(task, index), n, t.args, self.length, **extra)

        budget = self.length - t.n_predict
        n = self._fit(lambda n: self.form.count(*parts(n)[:3]), rt_.smallest(task), budget, task)
        context, question, prefix, answers = parts(n)
        tokens = self.form.count(context, question, prefix)
        return Sample(task, index, context, question, prefix, answers, t.n_predict, tokens)

    def _vt_example(self, task: str, index: int) -> str:
        hops = TASKS[task].args["hops"]

        def example(n):
            return rt_.vt_example(self.rng(task, index, "example"), n, hops)

        # RULER falls back to the smallest example where even that is longer
        tokens = lambda n: len(self.form.encode(example(n), False))  # noqa: E731
        least = hops + 1
        return example(
            self._fit(tokens, least, VT_EXAMPLE_TOKENS, task)
            if tokens(least) <= VT_EXAMPLE_TOKENS
            else least
        )

    def _fit(self, tokens: Callable[[int], int], lo: int, budget: int, task: str) -> int:
        """The largest haystack size n >= lo with tokens(n) <= budget (a doubling, then a
        bisection; tokens grows with n)."""
        if tokens(lo) > budget:
            least = tokens(lo) + (self.length - budget)
            raise KvrunError(
                f"--length {self.length} is too short for {task}: its prompt alone takes "
                f"{least} tokens with the task's answer"
            )
        hi = lo * 2
        while tokens(hi) <= budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if tokens(mid) <= budget else (lo, mid)
        return lo


def postprocess(reply: str) -> str:
    """RULER's cleaning of a prediction: control characters become line breaks, ends stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", reply.strip()).strip()


def match_all(reply: str, answers: list[str]) -> float:
    """RULER's string_match_all for one sample: the fraction of answers in the reply, any case."""
    pred = postprocess(reply).lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def match_part(reply: str, answers: list[str]) -> float:
    """RULER's string_match_part (its QA tasks): 1 when any answer is in the reply, any case."""
    pred = postprocess(reply).lower()
    return float(any(a.lower() in pred for a in answers))


def score(task: str, reply: str, answers: list[str]) -> float:
    """A sample's score in [0, 1] by its task's metric (qa: part; every other task: all)."""
    return (match_part if task.startswith("qa") else match_all)(reply, answers)


def task_scores(records: list[dict]) -> dict[str, float]:
    """task -> mean score x 100, rounded to 2 places (RULER's figure)."""
    per: dict[str, list[float]] = {}
    for r in records:
        per.setdefault(r["task"], []).append(r["score"])
    return {t: round(100 * sum(v) / len(v), 2) for t, v in per.items()}


def kvpress_ratio(budget: str | None, spec) -> float | None:
    """kvpress's compression_ratio (the fraction removed) for a kvrun budget (the fraction
    kept): 1 - budget; 0 for full; None where it is no fraction (a count, a method that keeps
    every token in other form, such as KIVI)."""
    if spec.name == "full":
        return 0.0
    if not spec.takes_budget:
        return None
    b = budget if budget is not None else spec.select.default_budget
    try:
        b = float(b)
    except (TypeError, ValueError):
        return None
    return round(1 - b, 4) if 0 < b < 1 else None
