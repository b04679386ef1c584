"""Sampling: a pure function from logits to a token, in llama.cpp's order and defaults.

Order (llama.cpp's default chain): repetition penalty -> top-k -> top-p -> min-p ->
temperature -> draw. Temperature 0 means greedy (argmax after the penalty).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models.config import SamplingConfig  # noqa: F401 - re-exported: kvrun.sampling.SamplingConfig


def apply_repeat_penalty(
    logits: torch.Tensor, recent: Sequence[int], penalty: float
) -> torch.Tensor:
    """llama.cpp's penalty: divide positive logits of recent tokens, multiply negative ones."""
    if penalty == 1.0 or not recent:
        return logits
    ids = torch.tensor(sorted(set(recent)), device=logits.device)
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (ties at the edge kept), others -inf."""
    if k <= 0 or k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sum reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # a token is kept when the mass before it is still below p (so at least one is kept)
    drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the top token's."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def ban(logits: torch.Tensor, ids) -> torch.Tensor:
    """logits with the tokens `ids` at -inf (--ignore-eos: the stop tokens are never drawn)."""
    ids = [i for i in ids if 0 <= i < logits.shape[-1]]
    if not ids:
        return logits
    out = logits.clone()
    out[..., ids] = float("-inf")
    return out


def sample(
    logits: torch.Tensor,  # (V,) float32
    cfg: SamplingConfig,
    recent: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> int:
    """Pick the next token id."""
    window = list(recent) if cfg.repeat_last_n < 0 else list(recent)[-cfg.repeat_last_n :]
    if cfg.repeat_last_n == 0:
        window = []
    logits = apply_repeat_penalty(logits, window, cfg.repeat_penalty)
    if cfg.temp <= 0:
        return int(torch.argmax(logits))
    logits = top_k_filter(logits, cfg.top_k)
    logits = top_p_filter(logits, cfg.top_p)
    logits = min_p_filter(logits, cfg.min_p)
    probs = torch.softmax(logits / cfg.temp, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
