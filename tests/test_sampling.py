"""Sampling steps against hand-computed expectations."""

import torch

from kvrun.run.sampling import (
    SamplingConfig,
    apply_repeat_penalty,
    min_p_filter,
    sample,
    top_k_filter,
    top_p_filter,
)


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample(logits, SamplingConfig(temp=0)) == 1


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repeat_penalty(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]
    # greedy with a penalty strong enough changes the pick
    assert sample(torch.tensor([2.0, 1.5]), SamplingConfig(temp=0, repeat_penalty=2.0), [0]) == 1


def test_top_k_keeps_k():
    out = top_k_filter(torch.tensor([1.0, 4.0, 3.0, 2.0]), 2)
    assert torch.isfinite(out).tolist() == [False, True, True, False]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = top_p_filter(probs.log(), 0.8)
    # 0.5 < 0.8 -> keep next; 0.5 + 0.3 reaches 0.8 -> stop
    assert torch.isfinite(out).tolist() == [True, True, False, False]
    out = top_p_filter(probs.log(), 0.81)
    assert torch.isfinite(out).tolist() == [True, True, True, False]


def test_min_p_relative_to_top():
    probs = torch.tensor([0.6, 0.3, 0.06, 0.04])
    out = min_p_filter(probs.log(), 0.09)  # threshold 0.054
    assert torch.isfinite(out).tolist() == [True, True, True, False]


def test_seeded_sampling_is_reproducible_and_respects_filters():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    cfg = SamplingConfig(temp=1.0, top_k=5, top_p=1.0, min_p=0.0)
    draws = []
    for _ in range(2):
        g = torch.Generator().manual_seed(123)
        draws.append([sample(logits, cfg, generator=g) for _ in range(30)])
    assert draws[0] == draws[1]
    top5 = set(torch.topk(logits, 5).indices.tolist())
    assert set(draws[0]) <= top5
    assert len(set(draws[0])) > 1
