"""Tool calls: `tools` rendered through the model's chat template, the model's tool-call syntax
parsed back into OpenAI's `tool_calls`, and the grammar that forces a call (tool_choice
"required" or a named function).

Each template family writes calls its own way; kvrun knows these, told apart by the template:
  hermes  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5, Hermes,
          and kvrun's prompts/chatml_tools.jinja for ChatML templates without tool support,
          such as SmolLM2's, whose ChatML turns are the same as Qwen's)
  llama3  the reply is one JSON object `{"name": ..., "parameters": {...}}`, after an optional
          `<|python_tag|>` (Llama 3.1 / 3.2)
  mistral, mistral11  `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`, and the v11
          tokenizers' `[TOOL_CALLS]name[ARGS]{...}` (kvrun/server/mistral_calls.py)
A template that takes no `tools` and is not ChatML, or writes calls in another syntax, is a
ToolError (a 400).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from ..errors import KvrunError
from ..run.grammar import Spec
from . import mistral_calls

TOOLS_TEMPLATE = "chatml_tools.jinja"
PYTHON_TAG = "<|python_tag|>"


class ToolError(KvrunError):
    """Tools asked of a model whose template cannot take them (a 400)."""


@dataclass(frozen=True, slots=True)
class Family:
    """How a template family writes a call: its name, its template, the arguments' key."""

    name: str  # "hermes", "llama3", "mistral" or "mistral11"
    template: str
    args_key: str  # "arguments" or "parameters"


@cache
def _chatml_tools() -> str:
    return resources.files("kvrun.prompts").joinpath(TOOLS_TEMPLATE).read_text("utf-8")


def family(template: str | None) -> Family:
    """The tool family of a chat template (None: kvrun's ChatML fallback); ToolError when
    kvrun cannot render or parse tool calls with it."""
    if template is None or not re.search(r"\btools\b", template):
        if template is None or "<|im_start|>" in template:
            return Family("hermes", _chatml_tools(), "arguments")
        raise ToolError("this model's chat template has no tool support (it never reads `tools`)")
    if mistral_calls.MARK in template:
        syntax = "mistral11" if mistral_calls.ARGS in template else "mistral"
        return Family(syntax, template, "arguments")
    if "<tool_call>" in template:
        return Family("hermes", template, "arguments")
    if PYTHON_TAG in template or '"parameters"' in template:
        return Family("llama3", template, "parameters")
    raise ToolError(
        "this model's chat template writes tool calls in a syntax kvrun does not parse "
        "(kvrun knows Hermes/Qwen <tool_call>, Llama 3.1 JSON calls and Mistral's [TOOL_CALLS])"
    )


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them (HF's convention): each call's arguments as an
    object, not the JSON text OpenAI sends."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m, tool_calls=[_template_call(c) for c in calls])
        out.append(m)
    return out


def _template_call(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass  # not JSON: the template shows the text as it came
    return dict(call, function=fn)


def call_spec(fam: Family, tools: list[dict], name: str | None, tokenizer=None) -> Spec:
    """The grammar of one call in fam's syntax to the function `name` (None: any of tools),
    its arguments valid against that function's JSON schema (tokenizer: the model's, whose
    control tokens a Mistral call opens with)."""
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not fns:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools")
    shapes = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                fam.args_key: closed(f.get("parameters") or {"type": "object"}),
            },
            "required": ["name", fam.args_key],
            "additionalProperties": False,
        }
        for f in fns
    ]
    schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    call = json.dumps(schema)
    if fam.name == "hermes":
        return Spec("lark", f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {call}')
    if fam.name.startswith("mistral"):
        marks = (_token_lark(t, tokenizer) for t in (mistral_calls.MARK, mistral_calls.ARGS))
        return Spec("lark", mistral_calls.grammar(fam.name, fns, shapes, *marks))
    return Spec("lark", f"start: call\ncall: %json {call}")


def _token_lark(text: str, tokenizer) -> str:
    """Lark for a marker: its token by id where the vocabulary has it as one token (a
    control token, which text in a grammar cannot match), else its text."""
    if tokenizer is not None:
        ids = tokenizer.encode(text, add_bos=False)
        if len(ids) == 1:
            return f"<[{ids[0]}]>"
    return json.dumps(text)


_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains")


def closed(schema: Any) -> Any:
    """A tool's parameters with every object that lists its properties and says nothing of
    others closed (additionalProperties false), as llama.cpp's and xgrammar's grammars read
    such schemas: frameworks send their tools' schemas without it (langchain's @tool), and a
    small model then adds keys that the tool's own validation refuses."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUB_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    for key in _SUB_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(v) for v in out[key]]
    for key in _SUB_ONE:
        if key in out:
            out[key] = (
                [closed(v) for v in out[key]] if isinstance(out[key], list) else closed(out[key])
            )
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    elif (
        isinstance(out.get("properties"), dict)
        and not {"additionalProperties", "unevaluatedProperties"} & out.keys()
    ):
        out["additionalProperties"] = False
    return out


def _call(obj: Any, fam: Family) -> dict | None:
    """OpenAI's tool call for a parsed object, None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(fam.args_key, obj.get("arguments", {}))
    mistral = fam.name.startswith("mistral")
    return {
        "id": mistral_calls.new_id() if mistral else f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class CallStream:
    """Splits a reply's streamed text into content and tool calls: `push(piece)` and `flush()`
    return (content that may be shown now, calls completed now)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, fam: Family):
        self.fam = fam
        self.held = ""
        self.plain = False  # llama3: the reply is not a call; its text goes out as it comes
        self.calls: list[dict] = []

    def push(self, piece: str) -> tuple[str, list[dict]]:
        self.held += piece
        return self._read(False)

    def flush(self) -> tuple[str, list[dict]]:
        return self._read(True)

    def _read(self, final: bool) -> tuple[str, list[dict]]:
        if self.fam.name == "hermes":
            return self._hermes(final)
        if self.fam.name == "llama3":
            return self._llama3(final)
        return self._mistral(final)

    def _done(self, calls: list[dict]) -> list[dict]:
        self.calls += calls
        return calls

    def _hermes(self, final: bool) -> tuple[str, list[dict]]:
        shown, calls = [], []
        while True:
            i = self.held.find(self.OPEN)
            if i < 0:
                keep = 0 if final else _partial(self.held, self.OPEN)
                shown.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                break
            shown.append(self.held[:i])
            j = self.held.find(self.CLOSE, i)
            body = self.held[i + len(self.OPEN) : j if j >= 0 else None]
            if j < 0 and not final:  # a call still arriving
                self.held = self.held[i:]
                break
            call = _call(_loads(body.strip()), self.fam)
            if call is None:  # not a call after all: its text is content
                shown.append(self.held[i : j + len(self.CLOSE) if j >= 0 else None])
            else:
                calls.append(call)
            self.held = self.held[j + len(self.CLOSE) :] if j >= 0 else ""
            if j < 0:
                break
        text = "".join(shown)
        return (text.strip() if self.calls or calls else text), self._done(calls)

    def _mistral(self, final: bool) -> tuple[str, list[dict]]:
        """Text up to a `[TOOL_CALLS]` is content; each call after it goes out once its JSON
        is whole; what follows the calls is read again (v11 writes a mark a call)."""
        mark = mistral_calls.MARK
        shown, calls = [], []
        while True:
            i = self.held.find(mark)
            if i < 0:
                keep = 0 if final else _partial(self.held, mark)
                shown.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                break
            shown.append(self.held[:i])
            body = self.held[i + len(mark) :]
            got = mistral_calls.read(self.fam.name, body)
            if got is None and not final:  # a call still arriving
                self.held = self.held[i:]
                break
            found = [_call(o, self.fam) for o in got[0]] if got else []
            if not found or None in found:  # not calls after all: their text is content
                shown.append(self.held[i:])
                self.held = ""
                break
            calls += found
            self.held = body[got[1] :]
        text = "".join(shown)
        return (text.strip() if self.calls or calls else text), self._done(calls)

    def _llama3(self, final: bool) -> tuple[str, list[dict]]:
        if self.plain:
            text, self.held = self.held, ""
            return text, []
        s = self.held.lstrip()
        may_be_call = s == "" or s.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(s)
        if may_be_call and not final:
            return "", []
        if final and may_be_call:
            call = _call(_loads(s.removeprefix(PYTHON_TAG).strip()), self.fam)
            if call is not None:
                self.held = ""
                return "", self._done([call])
        self.plain = True
        text, self.held = self.held, ""
        return text, []


def _partial(text: str, mark: str) -> int:
    """The longest k < len(mark) such that text ends with mark[:k]."""
    for k in range(min(len(mark) - 1, len(text)), 0, -1):
        if text.endswith(mark[:k]):
            return k
    return 0


def parse(fam: Family, text: str) -> tuple[str, list[dict]]:
    """A whole reply's content and tool calls."""
    s = CallStream(fam)
    a, c1 = s.push(text)
    b, c2 = s.flush()
    return a + b, c1 + c2


def render(tokenizer, fam: Family, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt of a tool-using chat through fam's template (as Tokenizer.render_chat)."""
    from ..models.chat_template import render as render_template

    bos, eos = tokenizer.token_text(tokenizer.bos_id), tokenizer.token_text(tokenizer.eos_id)
    msgs = template_messages(messages)
    if fam.name.startswith("mistral"):
        msgs = mistral_calls.template_messages(msgs)
    return render_template(fam.template, msgs, True, bos, eos, tools=tools or None)


def call_deltas(calls: list[dict], first: int) -> list[dict]:
    """Stream deltas of completed calls as OpenAI sends them: the call's id, type and name
    with empty arguments, then its arguments."""
    out = []
    for k, c in enumerate(calls, first):
        fn = c["function"]
        head = {"index": k, "id": c["id"], "type": "function"}
        out.append({"tool_calls": [{**head, "function": {"name": fn["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]})
    return out
