"""Chat templates: exact renders, the ChatML fallback, and the sandbox."""

from __future__ import annotations

import datetime

import pytest
from tokenizers.pre_tokenizers import ByteLevel

from kvrun.errors import KvrunError
from kvrun.models import chat_template
from kvrun.models.tokenizer import Tokenizer

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


# Templates that try to run a command (which would leave `{pwned}` behind), to reach the
# interpreter's globals, or to build or loop without bound: each is refused in one line, at
# once, and leaves nothing behind.
HOSTILE = [
    "{{ cycler.__init__.__globals__.os.popen('touch {pwned}').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch {pwned}') }}",
    "{{ namespace.__init__.__globals__['os'].system('touch {pwned}') }}",
    "{{ lipsum.__globals__['os'].system('touch {pwned}') }}",
    "{{ self._TemplateReference__context.environment }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ ''|attr('__class__') }}",
    "{% include '/etc/passwd' %}",
    "{{ 'a' * 10**10 }}",
    "{% set ns = namespace(x=10) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}",
    "{% set ns = namespace(x=10) %}{% for i in range(8) %}{% set ns.x = ns.x ** 4096 %}"
    "{% endfor %}",
    "{{ '{:>5.100000000000f}'.format(1.0) }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 99999 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
    "{% set x = 'a' * 1000000 %}{{ ([x] * 1000000)|join }}",
    "{% set a = ['a' * 100000] * 8 %}{% set b = [a, a, a, a, a, a, a, a] %}"
    "{% set c = [b, b, b, b, b, b, b, b] %}{{ [c, c, c, c, c, c, c, c] }}",
    "{{ 'a'|center(10**10) }}",
    "{{ 'a'.ljust(10**10) }}",
    "{{ '{:>10000000000}'.format('a') }}",
    "{{ '{:>{w}}'.format('a', w=10**10) }}",
    "{{ '%10000000000d' % 1 }}",
    "{{ '%*d' % (10**10, 1) }}",
    "{{ 'x\ny'|indent(10**10) }}",
    "{{ ('a' * 1000000).replace('', 'b' * 1000000) }}",
    "{{ ('a' * 1000000)|join('b' * 1000000) }}",
    "{{ messages|tojson(indent=10**9) }}",
    "{{ range(10)|batch(10**9, 'x')|list }}",
    "{{ lipsum(10**6) }}",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_templates_are_one_line_at_once_and_leave_nothing(template, tmp_path) -> None:
    pwned = tmp_path / "pwned"
    with pytest.raises(KvrunError, match="^chat template error: ") as info:
        chat_template.render(template.replace("{pwned}", str(pwned)), CONVERSATION)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
    assert list(tmp_path.iterdir()) == []


def test_the_bounds_grow_with_what_is_rendered() -> None:
    """A long document in a message renders whole (the size bound is 4x the input), and a
    refused render leaves the next one its own budget."""
    long = "word " * 600_000  # 3 MB: past the 1 MiB floor
    messages = [{"role": "user", "content": long}]
    out = chat_template.render(SMOLLM2, messages)
    assert out.count("word") == 600_000 and out.endswith("<|im_start|>assistant\n")
    with pytest.raises(KvrunError, match="too long"):
        loops = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
        chat_template.render(loops, CONVERSATION)
    assert chat_template.render(SMOLLM2, CONVERSATION).endswith("<|im_start|>assistant\n")


def test_guarded_loops_literals_and_joins_keep_their_meaning() -> None:
    template = (
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{% if loop.last %}!{% endif %}"
        "{{ m.role ~ ':' ~ m.content }}{% else %}none{% endfor %}|{{ [1, (2, 3), {'a': 4}] }}"
        "|{{ messages|map(attribute='role')|join(',') }}|{{ 'ab' * 2 + 'c' }}|{{ '%03d' % 7 }}"
        "|{{ '{:>4}'.format('x') }}|{{ 'x'|center(5) }}|{% for i in [] %}{% else %}none{% endfor %}"
    )
    assert chat_template.render(template, CONVERSATION[:2]) == (
        "1/2user:What is 2+2?2/2!assistant:4.|[1, (2, 3), {'a': 4}]|user,assistant|ababc|007"
        "|   x|  x  |none"
    )
