"""Pass-key prompts for the tests that check a KV method keeps a mid-prompt key: filler
lines of prompts/passkey_filler.txt around the key's sentence (`kvrun needle` builds its
exact-length prompts with kvrun.tasks.passkey.fit_prompt instead)."""

from __future__ import annotations

import random

from kvrun.tasks.passkey import INTRO, NEEDLE, QUESTION, filler_sentences


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
