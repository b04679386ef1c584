"""Chat templates (Hugging Face style jinja2) rendered in an immutable sandbox, with bounds on
what a template may build and how long it may run: a model's template comes from a stranger."""

from __future__ import annotations

import datetime
import functools
import json
import re
import time
from collections.abc import Iterable, Iterator, Mapping, MappingView, Sequence
from collections.abc import Set as AbstractSet
from contextvars import ContextVar
from dataclasses import dataclass
from importlib import resources
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from kvrun.errors import KvrunError

FALLBACK_TEMPLATE = "chatml.jinja"  # in kvrun.prompts, used when a model ships no template
# What one render may build (any str, list or dict, counted through every reference, and the
# whole output), in characters and items: this, or 4x what it is given, whichever is more.
_MAX_ITEMS = 1 << 20
_MAX_POWER = 4096  # largest exponent a template may use with `**`
_MAX_STEPS = 1 << 18  # loop iterations, calls and filters a render may take (or 16x its input)
_MAX_SECONDS = 10.0
_MAX_INDENT = 16  # tojson's indent


@dataclass(slots=True)
class _Budget:
    """One render's bounds; the sandbox's hooks draw on it."""

    size: int  # largest value (and output) the render may build
    steps: int  # steps left
    deadline: float  # time.monotonic() past which it stops

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise SecurityError("the template runs too long (too many loop steps or calls)")
        if time.monotonic() > self.deadline:
            raise SecurityError(f"the template runs too long (over {_MAX_SECONDS:g} s)")

    def fits(self, n: int, what: str = "a value") -> None:
        if n > self.size:
            raise SecurityError(f"{what} is too large ({n:,} > {self.size:,})")


# The render in progress (in this thread or task): its budget, which the hooks below read.
_BUDGET: ContextVar[_Budget | None] = ContextVar("kvrun_chat_template_budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # jinja folding a constant at compile time: leave it to the render
        raise SecurityError("no render in progress")
    return budget


def _weight(value: Any, limit: int) -> int:
    """Characters and items `value` holds, counted through every reference (as str() prints
    it); stops counting past `limit`, so a huge shared structure costs no more than that."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
            continue
        if isinstance(v, Namespace):  # prints its attributes
            v = v._Namespace__attrs  # type: ignore[attr-defined]
        if isinstance(v, Mapping):
            total += len(v) + 1
            if total <= limit:
                stack += [*v.keys(), *v.values()]
        elif isinstance(v, (list, tuple, AbstractSet, MappingView)):
            total += len(v) + 1
            if total <= limit:
                stack += list(v)
        else:
            total += 1
    return total


def _check(value: Any, what: str = "a value") -> Any:
    budget = _budget()
    budget.fits(_weight(value, budget.size), what)
    return value


_WIDE = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")  # printf widths and precisions


def _check_format(text: str) -> None:
    """Refuse a format string whose widths or precisions are large or given as arguments
    (`'%*d'`, `'{:>{w}}'`): what they print is not bounded by what they are given."""
    budget = _budget()
    widths = [w for m in _WIDE.finditer(text) for w in m.groups() if w]
    for spec in re.findall(r"\{[^{}]*?:([^}]*)", text):  # str.format's, nested fields too
        widths += ["{"] if "{" in spec else re.findall(r"\d+", spec)
    for w in widths:
        if not w.isdigit() or len(w) > 9 or int(w) > budget.size:
            raise SecurityError("a format width or precision is too large")


def _estimates(name: str, args: tuple, kwargs: dict) -> int:
    """What a str method or filter that can build more than it is given would build."""

    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    s = str(args[0]) if args and isinstance(args[0], str) else ""
    if name in ("center", "ljust", "rjust", "zfill"):
        width = arg(1, "width", 80)
        return max(len(s), width if isinstance(width, int) else 0)
    if name == "expandtabs":
        return len(s) + s.count("\t") * max(int(arg(1, "tabsize", 8)), 0)
    if name == "indent":
        width = arg(1, "width", 4)
        per = width if isinstance(width, int) else len(str(width))
        return len(s) + (s.count("\n") + 1) * max(per, 0)
    if name == "wordwrap":
        return len(s) * (1 + len(str(arg(3, "wrapstring", None) or "\n")))
    if name == "replace":
        old, new = str(arg(1, "old", "")), str(arg(2, "new", ""))
        n = s.count(old) if old else len(s) + 1
        count = arg(3, "count", None)
        n = min(n, count) if isinstance(count, int) and count >= 0 else n
        return len(s) + n * max(len(new) - len(old), 0)
    if name in ("batch", "slice"):
        n = arg(1, "linecount" if name == "batch" else "slices", 1)
        fill = arg(2, "fill_with", None)
        return (n if isinstance(n, int) else 0) * (1 + _weight(fill, _budget().size))
    return 0


_WIDENING = frozenset(
    {"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "replace",
     "batch", "slice"}
)  # fmt: skip
_REFUSED_METHODS = frozenset({"translate"})  # a table can widen every character


class _Bounded(NodeTransformer):
    """Rewrites a parsed template so that every loop counts its steps, and every `~` and
    list, tuple or dict it writes out is weighed before it is built."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = _hook("kvrun_loop", node.iter)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        return _hook("kvrun_concat", *self.generic_visit(node).nodes)

    def _literal(self, node: nodes.Expr) -> nodes.Node:
        node = self.generic_visit(node)
        return node if getattr(node, "ctx", "load") != "load" else _hook("kvrun_built", node)

    visit_List = visit_Tuple = visit_Dict = _literal


def _hook(name: str, *args: nodes.Expr) -> nodes.Call:
    call = nodes.Call(nodes.EnvironmentAttribute(name), list(args), [], None, None)
    return call.set_lineno(args[0].lineno if args else 1)


class _GenerationTag(Extension):
    """Accept `{% generation %}...{% endgeneration %}` (HF assistant masks) as plain output."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The jinja2 immutable sandbox, made loud (unsafe access raises instead of rendering '')
    and bounded: every loop step, call and filter counts against the render's budget, and
    what can grow a value (`*`, `+`, `%`, `~`, literals, widening methods and filters) is
    weighed before it is built."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Bounded().visit(super()._parse(source, name, filename))

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to {type(obj).__name__}.{attribute} is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if operator == "**" and isinstance(right, int) and abs(right) > _MAX_POWER:
            raise SecurityError(f"exponent {right} is too large")
        if operator in ("*", "**") and _ints(left, right):  # repeated squaring grows without end
            bits = left.bit_length() * (abs(right) if operator == "**" else 1)
            bits += 0 if operator == "**" else right.bit_length()
            if bits > 8 * budget.size:
                raise SecurityError("an integer result is too large")
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                if _weight(seq, budget.size) * n > budget.size:
                    raise SecurityError("repetition result is too large")
        if operator == "+" and isinstance(left, (str, list, tuple)):
            budget.fits(_weight(left, budget.size) + _weight(right, budget.size), "a sum")
        if operator == "%" and isinstance(left, str):
            _check_format(left)
        return _check(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _budget().step()
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(owner, str):
            if name in _REFUSED_METHODS:
                raise SecurityError(f"str.{name} is not allowed")
            if name in ("format", "format_map"):
                _check_format(owner)
            if name == "join":
                items = list(args[0]) if args else []
                _budget().fits(_weight(items, _budget().size) + len(owner) * len(items))
                args = (items, *args[1:])
            if name in _WIDENING:
                _budget().fits(_estimates(name, (owner, *args), kwargs), f"str.{name}'s result")
        return _check(super().call(__context, __obj, *args, **kwargs))

    def kvrun_loop(self, iterable: Any) -> Iterable:
        """A loop's items, each one a step of the render's budget."""
        return _Steps(iterable, _budget())

    def kvrun_concat(self, *parts: Any) -> str:
        """`a ~ b ~ ...`, weighed before it is joined."""
        budget = _budget()
        budget.fits(sum(_weight(p, budget.size) for p in parts), "a concatenation")
        return _check("".join(map(str, parts)))

    def kvrun_built(self, value: Any) -> Any:
        """A list, tuple or dict the template writes out, weighed."""
        return _check(value, "a literal")


def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


class _Steps:
    """An iterator whose every item is a step of a render's budget (its length kept, for
    `loop.length`)."""

    def __init__(self, iterable: Any, budget: _Budget):
        self.inner, self.it, self.budget = iterable, iter(iterable), budget

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        self.budget.step()
        return next(self.it)

    def __len__(self) -> int:
        return len(self.inner)


def _bounded_filter(name: str, f: Any) -> Any:
    """A filter that takes a step of the budget, refuses to widen past it and has its
    result weighed."""
    passes = getattr(f, "jinja_pass_arg", None) is not None  # the first argument is jinja's

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        own = args[1:] if passes else args
        if name == "format" and own and isinstance(own[0], str):
            _check_format(own[0])
        if name == "join" and own:
            items = list(own[0])
            sep = own[1] if len(own) > 1 else kwargs.get("d", "")
            budget.fits(_weight(items, budget.size) + len(str(sep)) * len(items), "a join")
            args = (*args[: len(args) - len(own)], items, *own[1:])
        if name in _WIDENING:
            budget.fits(_estimates(name, own, kwargs), f"the {name} filter's result")
        return _check(f(*args, **kwargs))

    return bounded


def _raise_exception(message: str) -> None:
    raise KvrunError(f"chat template error: {_one_line(message)}")


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    # jinja's lorem ipsum, its paragraphs and words bounded
    if not all(isinstance(x, int) and 0 <= x <= 100 for x in (n, min, max)):
        raise SecurityError("lipsum asks for too much text")
    from jinja2.utils import generate_lorem_ipsum

    return generate_lorem_ipsum(n, html, min, max)


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
    # Indents are bounded: each line of the output repeats one for every level of nesting.
    width = indent if isinstance(indent, int) else len(str(indent or ""))
    if width > _MAX_INDENT or len(str(separators or "")) > 4 * _MAX_INDENT:
        raise SecurityError("tojson's indent or separators are too wide")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.cache
def _environment() -> _Sandbox:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[loopcontrols, _GenerationTag],
        finalize=lambda value: value if isinstance(value, str) else _check(value),
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["lipsum"] = _lipsum
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
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
    except Exception as e:  # what jinja compiles may still not be Python ('break' outside a loop)
        raise KvrunError(f"chat template error: {type(e).__name__}: {_one_line(e)}") from None
    context = dict(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **extra,
    )
    given = _weight(context, 1 << 40)
    budget = _Budget(
        size=max(_MAX_ITEMS, 4 * given),
        steps=max(_MAX_STEPS, 16 * given),
        deadline=time.monotonic() + _MAX_SECONDS,
    )
    token = _BUDGET.set(budget)
    try:
        out, size = [], 0
        for piece in compiled.generate(**context):
            size += len(piece)
            budget.fits(size, "the rendered prompt")
            out.append(piece)
        return "".join(out)
    except KvrunError:
        raise
    except SecurityError as e:
        raise KvrunError(f"chat template error: unsafe operation: {_one_line(e)}") from None
    except Exception as e:  # a model's template may fail in any way; never show a traceback
        raise KvrunError(f"chat template error: {type(e).__name__}: {_one_line(e)}") from None
    finally:
        _BUDGET.reset(token)
