"""The default model (Q4_1 layers, Q8_0 embeddings) with packed weights against the dense path.

`--wtype auto` packs a GGUF's 4/8-bit tensors where the packed path decodes at least as fast
as dense weights (measured once per process) or dense weights would not fit. The tests force
that decision, so they check the packed model whatever this machine measures.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvrun import packed as packed_mod
from kvrun.generate import Session
from kvrun.packed import PackedEmbedding, PackedLinear
from kvrun.sampling import SamplingConfig
from kvrun.tasks.perplexity import score_window

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def packed_runtime(default_gguf):
    from kvrun.runtime import load_runtime

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed_mod, "packed_decode_pays", lambda device_type, dtype: True)
        rt = load_runtime(str(default_gguf), "float32", "cpu", log=lambda m: None, wtype="auto")
    assert rt.weights.wtype == "packed"
    return rt


def test_auto_keeps_the_file_types(packed_runtime):
    m = packed_runtime.model
    up = m.model.layers[0].mlp.up_proj
    assert isinstance(up, PackedLinear) and (up.bits, up.source) == (4, "Q4_1")
    emb = m.model.embed_tokens
    assert isinstance(emb, PackedEmbedding) and (emb.bits, emb.source) == (8, "Q8_0")
    assert m.lm_head is None  # tied: the head multiplies by the packed table
    from kvrun.tasks.bench import weight_bytes

    # about the file's size (98 MB), a fifth of the dense float32 model
    assert weight_bytes(m) < 110e6


def test_prefill_logits_match_dense(packed_runtime, default_runtime):
    text = PROMPTS[2] + " The sea is wide and 12345 waves roll in, again and again."
    ids = default_runtime.tokenizer.encode(text)
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        want = default_runtime.model(torch.tensor([ids]), pos, default_runtime.new_kv())
        got = packed_runtime.model(torch.tensor([ids]), pos, packed_runtime.new_kv())
    # exact mappings: the same weights, the same float32 products
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_equals_dense(packed_runtime, default_runtime, prompt):
    greedy = SamplingConfig(temp=0)
    out = []
    for rt in (default_runtime, packed_runtime):
        s = Session(rt.model, rt.tokenizer, rt.new_kv())
        r = s.generate(rt.tokenizer.encode(prompt), 32, greedy, seed=0)
        out.append(r.tokens)
    assert out[1] == out[0]


def test_perplexity_within_half_a_percent(packed_runtime, default_runtime):
    from pathlib import Path

    text = Path("/usr/share/common-licenses/GPL-3")
    src = text.read_text() if text.exists() else " ".join(PROMPTS) * 40
    ids = default_runtime.tokenizer.encode(src)[:640]
    tok = packed_runtime.tokenizer
    method = Session(packed_runtime.model, tok, packed_runtime.new_kv(), ubatch=256)
    ref = Session(default_runtime.model, tok, default_runtime.new_kv(), ubatch=256)
    sc = score_window(method, ref, ids, context=512)
    ppl = math.exp(sum(sc.nll) / len(sc.nll))
    ppl_ref = math.exp(sum(sc.nll_full) / len(sc.nll_full))
    assert abs(ppl / ppl_ref - 1) < 0.005
    assert max(sc.kl) < 1e-6
