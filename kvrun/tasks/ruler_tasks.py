"""RULER's synthetic tasks (Hsieh et al. 2024, github.com/NVIDIA/RULER, scripts/synthetic.yaml
and scripts/data/synthetic/*.py), written again for kvrun: what each task hides, how many keys,
values and queries, which haystack, and the prompts.

The prompts (instructions, questions, answer prefixes) are RULER's, word for word, because a
score is only RULER's on RULER's prompts. What differs, since nothing is downloaded: the
"essay" haystack is the GNU GPL v3 text shipped in prompts/ruler_essay.txt (RULER uses Paul
Graham's essays), words come from prompts/ruler_words.txt (RULER: the wonderwords lists), and
sentences are split with a regular expression (RULER: nltk). qa_1/qa_2 need SQuAD and HotpotQA
and are left out.

A builder takes a random.Random and a haystack size n and returns the sample's parts; it draws
what the answer depends on first, so one seed gives one set of answers whatever n the length
fit settles on.
"""

from __future__ import annotations

import math
import re
import string
import uuid
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 needle depths, percent

NIAH = (
    "Some special magic {v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {v} afterwards.\n{context}\n",
    "What are all the special magic {v} for {query} mentioned in the provided text?",
    " The special magic {v} for {query} mentioned in the provided text are",
)
# one key, one value: RULER turns the template singular ("Some"->"A", "are"->"is", "numbers"->"number")
NIAH_ONE = (
    "A special magic {v} is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {v} afterwards.\n{context}\n",
    "What is the special magic {v} for {query} mentioned in the provided text?",
    " The special magic {v} for {query} mentioned in the provided text is",
)
NEEDLE = "One of the special magic {v} for {key} is: {value}."
VT = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\n",
    "Question: Find all variables that are assigned the value {query} in the text above.",
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
    "variables are assigned the value {query}, they are: ",
)
CWE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n",
    "Question: What are the 10 most common words in the above list?",
    " Answer: The top 10 words that appear most often in the list are:",
)
FWE = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\n",
    "Question: Do not provide any explanation. Please ignore the dots '....'. What are the "
    "three most frequently appeared words in the above coded text?",
    " Answer: According to the coded text above, the three most frequently appeared words are:",
)


@dataclass(frozen=True, slots=True)
class TaskDef:
    """One RULER task: its family's builder, tokens to generate, and its settings."""

    family: str  # niah | vt | cwe | fwe
    n_predict: int  # RULER's tokens_to_generate (also reserved in --length)
    args: dict = field(default_factory=dict)


def _niah(haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> TaskDef:
    return TaskDef(
        "niah", 128, {"haystack": haystack, "k": k, "v": v, "nk": nk, "nv": nv, "nq": nq}
    )


# scripts/synthetic.yaml, less qa_1 / qa_2
TASKS = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", nk=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", nv=4),
    "niah_multiquery": _niah("essay", "words", "numbers", nq=4),
    "vt": TaskDef("vt", 30, {"chains": 1, "hops": 4}),
    "cwe": TaskDef("cwe", 120, {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    "fwe": TaskDef("fwe", 50, {"alpha": 2.0}),
}
LEFT_OUT = ("qa_1", "qa_2")  # SQuAD / HotpotQA: not to be had offline


@cache
def words() -> dict[str, list[str]]:
    """prompts/ruler_words.txt: {"nouns", "adjectives", "verbs"} -> sorted words."""
    text = resources.files("kvrun.prompts").joinpath("ruler_words.txt").read_text("utf-8")
    out: dict[str, list[str]] = {}
    for part in re.split(r"^\[(\w+)\]$", text, flags=re.M)[1:]:
        if part in ("nouns", "adjectives", "verbs"):
            name = part
        else:
            out[name] = sorted(set(part.split()))
    return out


@cache
def essay_words() -> list[str]:
    """The essay haystack as words (RULER collapses whitespace and splits on spaces)."""
    text = resources.files("kvrun.prompts").joinpath("ruler_essay.txt").read_text("utf-8")
    return text.split()


_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def draw(rng, kind: str) -> str:
    """A key or value: words (adjective-noun), 7-digit numbers or uuids, as RULER draws them."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        w = words()
        return f"{rng.choice(w['adjectives'])}-{rng.choice(w['nouns'])}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _insert(lines: list[str], items: list[str], rng) -> list[str]:
    """items put between the lines at random places (RULER's noise/needle haystacks)."""
    out = list(lines)
    for i, item in zip(
        sorted(rng.sample(range(len(lines)), len(items)), reverse=True), items, strict=True
    ):
        out.insert(i, item)
    return out


def niah(rng, n: int, a: dict, length: int) -> tuple[str, str, str, list[str]]:
    """Needles "One of the special magic {v} for {key} is: {value}." in n haystack units
    (noise sentences, essay words, or distractor needles); asks for the values of nq keys."""
    nk = max(a["nk"], a["nq"])
    keys, values, needles = [], [], []
    for _ in range(nk):
        keys.append(draw(rng, a["k"]))
        values.append([draw(rng, a["v"]) for _ in range(a["nv"])])
        needles += [NEEDLE.format(v=a["v"], key=keys[-1], value=x) for x in values[-1]]
    rng.shuffle(needles)
    asked = rng.sample(range(nk), a["nq"])
    answers = [x for i in asked for x in values[i]]
    queries = [keys[i] for i in asked]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    if a["haystack"] == "essay":
        ws = essay_words()
        text = " ".join(ws[i % len(ws)] for i in range(n))  # repeated when n is past its end
        sents = _SENTENCE.split(text.strip())
        cuts = sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
        parts, last = [], 0
        for cut, needle in zip(cuts, needles, strict=True):
            parts += [" ".join(sents[last:cut]), needle]
            last = cut
        context = " ".join(parts + [" ".join(sents[last:])])
    else:
        if a["haystack"] == "noise":
            lines = [NOISE] * n
        else:  # distractor needles, none with a key asked about
            lines = []
            while len(lines) < n:
                key = draw(rng, a["k"])
                value = draw(rng, a["v"])
                if key not in keys:
                    lines.append(NEEDLE.format(v=a["v"], key=key, value=value))
        context = "\n".join(_insert(lines, needles, rng))
    one = a["nq"] * a["nv"] == 1
    ctx, question, prefix = NIAH_ONE if one else NIAH
    v = a["v"][:-1] if one else a["v"]
    return ctx.format(v=v, context=context), question.format(v=v, query=query), \
        prefix.format(v=v, query=query), answers  # fmt: skip


def vt_parts(rng, n: int, hops: int, name_len: int) -> tuple[str, str, str, list[str]]:
    """One chain "VAR A = 12345", "VAR B = VAR A ", ... hidden in n noise sentences; asks for
    every variable holding the value."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [
        f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)
    ]
    lines = [NOISE] * n
    for j, p in enumerate(sorted(rng.sample(range(n), len(chain)))):
        lines.insert(p + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    ctx, question, prefix = VT
    return ctx.format(context=context), question.format(query=value), \
        prefix.format(num_v=hops + 1, query=value), names  # fmt: skip


def vt(rng, n: int, a: dict, length: int, example: str = "") -> tuple[str, str, str, list[str]]:
    """RULER's vt: a solved one-shot example (`example`, see vt_example) before the task."""
    ctx, question, prefix, names = vt_parts(rng, n, a["hops"], 5)
    return example + "\n" + ctx, question, prefix, names


def vt_example(rng, n: int, hops: int) -> str:
    """The one-shot example: a whole vt prompt with 3-letter names and its answer."""
    ctx, question, prefix, names = vt_parts(rng, n, hops, 3)
    return ctx + question + prefix + " " + " ".join(names) + "\n"


def _word_pool(rng, n: int) -> list[str]:
    """n distinct words: the word lists shuffled, then (past their end, for long lengths, as
    RULER turns to a larger list) made-up lowercase words."""
    w = words()
    pool = sorted(set(w["nouns"] + w["adjectives"] + w["verbs"]))
    rng.shuffle(pool)
    seen = set(pool)
    while len(pool) < n:
        made = "".join(rng.choices("bcdfghklmnprstvz", k=1) + rng.choices("aeiou", k=1)
                       + rng.choices("bcdfghklmnprstvz", k=1) + rng.choices("aeiou", k=1)
                       + rng.choices("bcdfghklmnprstvz", k=1))  # fmt: skip
        if made not in seen:
            seen.add(made)
            pool.append(made)
    return pool[:n]


def _word_list(rng, chosen: list[str], common: int, freq_cw: int, freq_ucw: int) -> str:
    """The first `common` words freq_cw times each, the rest freq_ucw times, shuffled, as
    "1. w 2. w ..."."""
    entries = chosen[:common] * freq_cw + chosen[common:] * freq_ucw
    rng.shuffle(entries)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))


def cwe(rng, n: int, a: dict, length: int) -> tuple[str, str, str, list[str]]:
    """Common words extraction: n distinct words, the first num_cw of them repeated most,
    after one solved example; below 4096 tokens RULER repeats less (6 and 1 times)."""
    big = length >= 4096
    ctx, question, prefix = CWE
    shot = _word_pool(rng, 40 if big else 20)
    listed = _word_list(rng, shot, a["num_cw"], *((10, 3) if big else (3, 1)))
    answer = " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot[: a["num_cw"]]))
    example = ctx.format(context=listed) + question + prefix + " " + answer
    chosen = _word_pool(rng, n)
    freq = (a["freq_cw"], a["freq_ucw"]) if big else (6, 1)
    listed = _word_list(rng, chosen, a["num_cw"], *freq)
    return example + "\n" + ctx.format(context=listed), question, prefix, chosen[: a["num_cw"]]


def _zeta(s: float) -> float:
    """Riemann zeta for s > 1 (Euler-Maclaurin after 1000 terms; RULER uses scipy's)."""
    n = 1000
    return (
        sum(k**-s for k in range(1, n))
        + n ** (1 - s) / (s - 1)
        + n**-s / 2
        + s * n ** (-s - 1) / 12
    )


def fwe(rng, n: int, a: dict, length: int) -> tuple[str, str, str, list[str]]:
    """Frequent words extraction: about n coded words drawn Zipf(alpha) from a vocabulary of
    (length - 50) // 50 six-letter words; the most frequent is '...' (noise), the answer the
    next three."""
    size = max(4, (length - TASKS["fwe"].n_predict) // 50)
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."
    z = _zeta(a["alpha"])
    coded = [w for k, w in enumerate(ranked, 1) for _ in range(int(n * k ** -a["alpha"] / z))]
    rng.shuffle(coded)
    ctx, question, prefix = FWE
    return ctx.format(context=" ".join(coded)), question, prefix, ranked[1:4]


BUILDERS = {"niah": niah, "vt": vt, "cwe": cwe, "fwe": fwe}


def smallest(name: str) -> int:
    """The least haystack size a task's builder takes (its needles need places to go)."""
    t = TASKS[name]
    if t.family == "niah":
        return max(t.args["nk"], t.args["nq"]) * t.args["nv"] + (t.args["haystack"] == "essay")
    if t.family == "vt":
        return t.args["hops"] + 1
    if t.family == "cwe":
        return t.args["num_cw"] + 1
    return math.ceil(_zeta(t.args["alpha"]) * 4 ** t.args["alpha"])  # the 4th word once
