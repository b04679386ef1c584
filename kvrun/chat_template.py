"""Chat templates (Hugging Face style jinja2) rendered in an immutable sandbox."""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from kvrun.errors import KvrunError

FALLBACK_TEMPLATE = "chatml.jinja"  # in kvrun.prompts, used when a model ships no template
_MAX_ITEMS = 1 << 20  # longest str/list a template may build with `*`; guards memory
_MAX_POWER = 4096  # largest exponent a template may use with `**`


class _GenerationTag(Extension):
    """Accept `{% generation %}...{% endgeneration %}` (HF assistant masks) as plain output."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The jinja2 immutable sandbox, made loud: unsafe access raises instead of rendering ''."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to {type(obj).__name__}.{attribute} is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > _MAX_POWER:
            raise SecurityError(f"exponent {right} is too large")
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                if len(seq) * n > _MAX_ITEMS:
                    raise SecurityError("repetition result is too large")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise KvrunError(f"chat template error: {_one_line(message)}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own tojson: keeps non-ASCII and does no HTML escaping, as HF renders it.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.cache
def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


@functools.cache
def fallback_template() -> str:
    """The ChatML template shipped in kvrun.prompts, for models without their own."""
    return resources.files("kvrun.prompts").joinpath(FALLBACK_TEMPLATE).read_text("utf-8")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())[:300]


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` with a chat template; any template failure is a one-line KvrunError."""
    if not isinstance(messages, Sequence) or not all(
        isinstance(m, Mapping) and "role" in m for m in messages
    ):
        raise KvrunError("chat messages must be a list of {'role': ..., 'content': ...} dicts")
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise KvrunError(f"chat template error: {_one_line(e.message)} (line {e.lineno})") from None
    try:
        return compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except KvrunError:
        raise
    except SecurityError as e:
        raise KvrunError(f"chat template error: unsafe operation: {_one_line(e)}") from None
    except Exception as e:  # a model's template may fail in any way; never show a traceback
        raise KvrunError(f"chat template error: {type(e).__name__}: {_one_line(e)}") from None
