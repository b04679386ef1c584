"""Needle prompts: a pass key (or any needle) hidden at a depth in filler text we wrote
(prompts/) or in a user's haystack, cut or repeated to an exact length in tokens."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import KvrunError

INTRO = (
    "There is an important pass key hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the pass key.\n\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


def filler_sentences() -> list[str]:
    """The filler lines shipped in prompts/passkey_filler.txt."""
    text = resources.files("kvrun.prompts").joinpath("passkey_filler.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def answer_matches(text: str, key: int) -> bool:
    """True when the first number in the reply is the key."""
    m = re.search(r"\d+", text)
    return m is not None and int(m.group()) == key


def answer_found(reply: str, answer: str) -> bool:
    """Needle scoring: the answer text appears in the reply (case and spacing ignored)."""

    def norm(s: str) -> str:
        return " ".join(s.lower().split())

    return norm(answer) in norm(reply)


def question_template() -> str:
    """prompts/needle_question.txt: the needle prompt around {haystack} and {question}."""
    return resources.files("kvrun.prompts").joinpath("needle_question.txt").read_text().rstrip()


# --- exact-length prompts for the needle grid (kvrun needle) ----------------------------------
_SENTENCE_END = re.compile(r"(?<=[.!?。])[\"')\]]*\s+|\n\s*\n")
_LONG_UNIT = 250  # characters: a longer "sentence" is cut at line breaks, then between words


def _cut(unit: str) -> list[str]:
    """A run-on unit as pieces of at most _LONG_UNIT characters (line breaks, then spaces)."""
    if len(unit) <= _LONG_UNIT:
        return [unit]
    lines = unit.splitlines(keepends=True)
    if len(lines) > 1:
        return [piece for line in lines for piece in _cut(line)]
    cut = unit.rfind(" ", 0, _LONG_UNIT) + 1 or _LONG_UNIT
    return [unit[:cut], *_cut(unit[cut:])]


def split_units(text: str) -> list[str]:
    """Sentences of `text`, each with the whitespace that follows it, so ''.join gives the text
    back (stripped at the start, with a blank line added at an end without whitespace);
    run-ons are cut to at most _LONG_UNIT characters."""
    units, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        units.append(text[start : m.end()])
        start = m.end()
    units.append(text[start:])
    out = [piece for u in units for piece in _cut(u)]
    # whitespace-only pieces join the piece before them
    merged: list[str] = []
    for piece in out:
        if merged and not piece.strip():
            merged[-1] += piece
        elif piece:
            merged.append(piece)
    if merged and not merged[0].strip():
        merged = merged[1:]
    if merged and not merged[-1][-1].isspace():
        merged[-1] += "\n\n"  # the haystack repeats: keep its end apart from its start
    return merged


def read_haystack(path: str) -> list[str]:
    """A user's haystack file as sentences (split_units); one-line errors when unusable."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise KvrunError(f"cannot read haystack file {path}: {e.strerror}") from None
    units = split_units(text)
    if not units:
        raise KvrunError(f"haystack file {path} has no text")
    return units


def filler_units() -> list[str]:
    """The shipped filler (prompts/passkey_filler.txt) as sentences, each ending in a space."""
    return [u.strip() + " " for u in split_units(" ".join(filler_sentences()) + " ")]


@dataclass(frozen=True, slots=True)
class NeedlePrompt:
    """A prompt of at most the target length with a needle sentence at a depth."""

    text: str
    ids: list[int]
    units: int  # haystack sentences used
    needle_depth: float  # characters of haystack before the needle / all haystack characters


def _compose(units, offset, n, depth, needle, prefix, suffix) -> tuple[str, float]:
    body = [units[(offset + i) % len(units)] for i in range(n)]
    ends = list(itertools.accumulate((len(u) for u in body), initial=0))  # boundary offsets
    # the sentence boundary nearest to depth, by characters (sentences differ in length)
    at = min(range(n + 1), key=lambda i: (abs(ends[i] - depth * ends[-1]), i))
    before, after = "".join(body[:at]), "".join(body[at:]).rstrip()
    total = len(before) + len(after)
    text = prefix + before + needle.strip() + (" " + after if after else "") + suffix
    return text, (len(before) / total if total else depth)


def fit_prompt(
    encode,
    units: list[str],
    n_tokens: int,
    depth: float,
    needle: str,
    prefix: str = "",
    suffix: str = "",
    offset: int = 0,
) -> NeedlePrompt:
    """The longest prompt of whole haystack sentences (repeated from `offset` as needed) with
    `needle` at the sentence boundary nearest to `depth`, whose encode(text) is at most n_tokens long.

    encode: full prompt text -> ids (chat template and BOS included). Raises ValueError when
    the needle, prefix and suffix alone exceed n_tokens."""

    def build(n: int) -> NeedlePrompt:
        text, where = _compose(units, offset, n, depth, needle, prefix, suffix)
        return NeedlePrompt(text, encode(text), n, where)

    p = build(0)
    fixed = len(p.ids)
    if fixed > n_tokens:
        raise ValueError(f"the needle and question alone take {fixed} tokens")
    # secant steps on tokens(n) ~ fixed + n * per, then single sentences to the exact edge
    wrap = len(encode(""))
    per = max(1.0, sum(len(encode(u)) - wrap for u in units[:64]) / min(len(units), 64))
    for _ in range(4):
        n = max(0, int((n_tokens - fixed) / per))
        if n == p.units:
            break
        p = build(n)
        if n:
            per = max((len(p.ids) - fixed) / n, 1e-3)
    while len(p.ids) > n_tokens:
        p = build(max(0, p.units - max(1, int((len(p.ids) - n_tokens) / per))))
    while len((q := build(p.units + 1)).ids) <= n_tokens:
        p = q
    return p
