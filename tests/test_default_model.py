"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) against HF transformers on the same file."""

from __future__ import annotations

import pytest
import torch

from kvrun.run.sampling import SamplingConfig
from kvrun.run.session import Session

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def hf_model(default_gguf):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32
    )
    return m.eval()


def test_prefill_logits_equal_transformers(default_runtime, hf_model):
    rt = default_runtime
    ids = rt.tokenizer.encode(PROMPTS[2] + " The sea is wide and 12345 waves roll in.")
    session = Session(rt.model, rt.tokenizer, rt.new_kv(), ubatch=7)  # several chunks
    ours = []
    with torch.inference_mode():
        # chunked prefill: collect the logits of every position through the model directly
        kv = session.kv
        for s in range(0, len(ids), 7):
            chunk = ids[s : s + 7]
            pos = torch.arange(s, s + len(chunk))
            ours.append(rt.model(torch.tensor([chunk]), pos, kv)[0])
            kv.end_chunk(len(chunk))
        ref = hf_model(torch.tensor([ids])).logits[0]
    ours = torch.cat(ours)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_equals_transformers(default_runtime, hf_model, prompt):
    rt = default_runtime
    ids = rt.tokenizer.encode(prompt)
    session = Session(rt.model, rt.tokenizer, rt.new_kv())
    ours = session.generate(ids, 40, SamplingConfig(temp=0), seed=0).tokens
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=40,
            do_sample=False,
            eos_token_id=sorted(rt.tokenizer.stop_ids),
            pad_token_id=rt.tokenizer.eos_id,
        )
    theirs = [t for t in out[0, len(ids) :].tolist() if t not in rt.tokenizer.stop_ids]
    assert len(ours) >= 32 or len(ours) == len(theirs)
    assert ours == theirs


def test_chat_history_stays_in_cache(default_runtime):
    """A second turn prefills only the new text, and equals a fresh run on the whole dialogue."""
    from kvrun.run.chat import Conversation

    rt = default_runtime
    conv = Conversation(Session(rt.model, rt.tokenizer, rt.new_kv()))
    greedy = dict(n_predict=12, sampling=SamplingConfig(temp=0), seed=0)
    first = conv.reply("What is the capital of France?", **greedy)
    held = len(conv.session.tokens)
    second = conv.reply("And of Italy?", **greedy)
    assert second.stats.prompt_tokens < held  # only the delta was prefilled
    # the same dialogue from scratch, rendered in one go, gives the same second reply
    msgs = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And of Italy?"},
    ]
    fresh = Session(rt.model, rt.tokenizer, rt.new_kv())
    ids = rt.tokenizer.encode(rt.tokenizer.render_chat(msgs, add_generation_prompt=True))
    again = fresh.generate(ids, **greedy)
    assert again.tokens == second.tokens
