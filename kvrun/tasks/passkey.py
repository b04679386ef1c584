"""Pass-key retrieval: a key hidden at a depth in filler text we wrote (prompts/)."""

from __future__ import annotations

import random
import re
from importlib import resources

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


def passkey_prompt(tokenizer, n_tokens: int, depth: float, key: int, seed: int = 0) -> str:
    """About n_tokens of text with the key's sentence at `depth` (0 = start, 1 = end)."""
    rng = random.Random(seed)
    lines = filler_sentences()
    fixed = len(tokenizer.encode(INTRO + NEEDLE.format(key=key) + QUESTION, add_bos=False))
    per_line = sum(len(tokenizer.encode(" " + ln, add_bos=False)) for ln in lines) / len(lines)
    n_lines = max(1, int((n_tokens - fixed) / per_line))
    body = [rng.choice(lines) for _ in range(n_lines)]
    at = round(depth * n_lines)
    body.insert(at, NEEDLE.format(key=key).strip())
    return INTRO + " ".join(body) + QUESTION


def answer_matches(text: str, key: int) -> bool:
    """True when the first number in the reply is the key."""
    m = re.search(r"\d+", text)
    return m is not None and int(m.group()) == key
