"""Chat templates: exact renders, the ChatML fallback, and the sandbox."""

from __future__ import annotations

import datetime

import pytest
from tokenizers.pre_tokenizers import ByteLevel

from kvrun import chat_template
from kvrun.errors import KvrunError
from kvrun.tokenizer import Tokenizer

# tokenizer.chat_template of SmolLM2-135M-Instruct (GGUF), verbatim
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


def _tiny_tokenizer(chat: str | None) -> Tokenizer:
    """A byte-level BPE vocabulary with ChatML control tokens and no merges."""
    tokens = [*ByteLevel.alphabet(), "<|im_start|>", "<|im_end|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3, 3],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.eos_token_id": 257,
    }
    if chat is not None:
        meta["tokenizer.chat_template"] = chat
    return Tokenizer.from_gguf(meta)


def test_smollm2_two_turns_exact() -> None:
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert chat_template.render(SMOLLM2, CONVERSATION, True) == expected
    assert _tiny_tokenizer(SMOLLM2).render_chat(CONVERSATION) == expected
    no_prompt = chat_template.render(SMOLLM2, CONVERSATION, add_generation_prompt=False)
    assert no_prompt == expected.removesuffix("<|im_start|>assistant\n")


def test_fallback_chatml_when_model_has_none() -> None:
    tok = _tiny_tokenizer(None)
    assert tok.chat_template is None
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:2]]
    assert tok.render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("4.<|im_end|>\n")
    ids = tok.encode(tok.render_chat(messages))
    assert ids[0] == 256 and ids.count(257) == 3  # control tokens in the prompt map to their ids


def test_bos_eos_and_helpers() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{% endfor %}"
        "{{ eos_token }}{{ strftime_now('%Y') }}{% for i in range(5) %}{% if i == 2 %}"
        "{% break %}{% endif %}{{ i }}{% endfor %}{% generation %}g{% endgeneration %}{{ x }}"
    )
    out = _tiny_tokenizer(template).render_chat([{"role": "user", "content": "héllo 中"}], x="!")
    year = datetime.datetime.now().year
    assert out == f'<|im_start|>"héllo 中"<|im_end|>{year}01g!'


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ joiner.__init__.__globals__.os.system('echo pwned') }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{% set x = messages.append({'role': 'x'}) %}",
        "{{ ''.format.__globals__ }}",
        "{{ self.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ 'a' * 100000000 }}",
        "{{ 2 ** 100000000 }}",
    ],
)
def test_sandbox_escapes_raise(template: str) -> None:
    with pytest.raises(KvrunError, match="^chat template error: unsafe operation: ") as info:
        chat_template.render(template, CONVERSATION)
    assert "\n" not in str(info.value)


def test_raise_exception_message() -> None:
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('System first!\\nplease') }}{% endif %}"  # fmt: skip
    with pytest.raises(KvrunError, match=r"^chat template error: System first! please$"):
        chat_template.render(template, CONVERSATION)


@pytest.mark.parametrize(
    "template",
    ["{% for m in messages %}", "{{ messages[0]['content'] + 1 }}", "{{ undefined_fn() }}"],
)
def test_broken_templates_raise_one_line(template: str) -> None:
    with pytest.raises(KvrunError, match="^chat template error") as info:
        chat_template.render(template, CONVERSATION)
    assert "\n" not in str(info.value)


def test_bad_messages_and_cache() -> None:
    with pytest.raises(KvrunError, match="chat messages"):
        chat_template.render(SMOLLM2, [{"content": "no role"}])
    assert chat_template._compile(SMOLLM2) is chat_template._compile(SMOLLM2)
