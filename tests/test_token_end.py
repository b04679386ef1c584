"""One end of a token (kvrun.token_end), shared by Session.generate and the batch engine:
`--repeat-last-n -1` penalizes the whole context, not only its last 1,024 tokens."""

from __future__ import annotations

import pytest

import tiny_models
from kvrun.kv import check
from kvrun.run.engine import Engine, Request
from kvrun.run.runtime import load_runtime
from kvrun.run.sampling import SamplingConfig
from kvrun.run.session import Session

FAVOURED = 7  # the token the hooked model always prefers


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    return load_runtime(
        str(tiny_models.build(tmp_path_factory.mktemp("te")).gguf_path), "float32", "cpu",
        log=lambda m: None,
    )  # fmt: skip


@pytest.fixture
def favouring(rt):
    """The model's logits with FAVOURED one above the best other token (a positive logit,
    so a repeat penalty divides it below the others)."""

    def bump(module, args, out):
        out = out.clone()
        top = out.max(dim=-1, keepdim=True).values  # (B, T, 1)
        out[..., FAVOURED] = top[..., 0].clamp(min=0) + 1.0
        return out

    handle = rt.model.register_forward_hook(bump)
    yield rt
    handle.remove()


def prompt(rt) -> list[int]:
    """FAVOURED once, at the start, then 1,200 other tokens: it is in the whole context but
    not in the last 1,024 tokens."""
    stops = rt.tokenizer.stop_ids
    filler = [i for i in range(10, 290) if i != FAVOURED and i not in stops]
    return [FAVOURED] + [filler[i % len(filler)] for i in range(1200)]


def first_token(rt, last_n: int, engine: bool) -> int:
    cfg = SamplingConfig(temp=0.0, repeat_penalty=1e9, repeat_last_n=last_n, ignore_eos=True)
    session = Session(rt.model, rt.tokenizer, rt.new_kv(check("full")), ubatch=512)
    ids = prompt(rt)
    if not engine:
        return session.generate(ids, 1, cfg, seed=0).tokens[0]
    got = {}
    Engine([session]).run([Request(ids, 1, cfg, 0)], lambda r, res, err: got.update(r=res, e=err))
    assert got["e"] is None
    return got["r"].tokens[0]


@pytest.mark.parametrize("engine", [False, True], ids=["session", "engine"])
def test_repeat_last_n_minus_one_is_the_whole_context(favouring, engine):
    assert first_token(favouring, 0, engine) == FAVOURED  # the hook works: no penalty
    assert first_token(favouring, 1024, engine) == FAVOURED  # out of the last 1,024
    assert first_token(favouring, 1201, engine) != FAVOURED  # in the last 1,201
    assert first_token(favouring, -1, engine) != FAVOURED  # -1: the whole context
