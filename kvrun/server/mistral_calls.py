"""Mistral's tool-call syntax (kvrun.server.tools' "mistral" families), as its templates write
calls and its models reply with them:

  mistral    `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (tokenizers v3 to v7:
             Mistral 7B v0.3, Mixtral 8x22B, Nemo, Small 3 and 3.1; v7 writes no space)
  mistral11  `[TOOL_CALLS]name[ARGS]{...}`, once a call (tokenizer v11 and later: Small 3.2,
             Magistral, Devstral, Ministral 3), told apart by its template writing `[ARGS]`

`[TOOL_CALLS]` and `[ARGS]` are control tokens: a forced call's grammar names them by id, so the
model writes the one token it was trained to (spelled out in text, they would be several).
Mistral's templates refuse call ids that are not 9 letters or digits: the calls get such ids,
and ids of other shapes a client sends back are mapped to such ids before rendering.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from typing import Any

MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_CHARS = string.ascii_letters + string.digits
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,256}")
_DECODER = json.JSONDecoder()


def new_id() -> str:
    """A call id as Mistral's templates take them: 9 letters or digits."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def template_id(call_id: Any) -> Any:
    """A client's call id as Mistral's templates take it: 9 letters or digits kept as it is,
    any other text mapped to 9 hex digits of its hash (the same for a call and its answer)."""
    if not isinstance(call_id, str) or re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages with their call ids (tool_calls' and tool answers' tool_call_id) as
    template_id gives them."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[dict(c, id=template_id(c.get("id"))) for c in m["tool_calls"]])
        if "tool_call_id" in m:
            m = dict(m, tool_call_id=template_id(m["tool_call_id"]))
        out.append(m)
    return out


def read(syntax: str, body: str) -> tuple[list[dict], int] | bool | None:
    """The calls at the start of `body` (the text after a `[TOOL_CALLS]`): (their objects,
    {"name", "arguments"}, and the characters they took); None while they may still be
    arriving; False when the text is not a call."""
    s = body.lstrip()
    skipped = len(body) - len(s)
    if syntax == "mistral":
        if not s:
            return None
        if s[0] not in "[{":
            return False
        try:
            obj, end = _DECODER.raw_decode(s)
        except ValueError:
            return None  # not yet whole (or never: the reply's end shows it as text)
        objs = obj if isinstance(obj, list) else [obj]
        if not objs or not all(
            isinstance(o, dict) and isinstance(o.get("name"), str) for o in objs
        ):
            return False
        return objs, skipped + end
    # mistral11: name[ARGS]{...}, maybe name[CALL_ID]id[ARGS]{...}
    j = s.find(ARGS)
    if j < 0:
        return None if _may_be_name(s) else False
    name = s[:j].split(CALL_ID)[0].strip()
    if not _NAME.fullmatch(name):
        return False
    rest = s[j + len(ARGS) :]
    args = rest.lstrip()
    if not args:
        return None
    if args[0] != "{":
        return False
    try:
        obj, end = _DECODER.raw_decode(args)
    except ValueError:
        return None
    used = skipped + j + len(ARGS) + (len(rest) - len(args)) + end
    return [{"name": name, "arguments": obj}], used


def _may_be_name(text: str) -> bool:
    """Whether text may be the start of `name[ARGS]` or `name[CALL_ID]id[ARGS]`."""
    rest = text[re.match(r"[A-Za-z0-9_.\-]*", text).end() :]
    if rest.startswith(CALL_ID):
        rest = rest[len(CALL_ID) :]
        rest = rest[re.match(r"[A-Za-z0-9]*", rest).end() :]
        return ARGS.startswith(rest)
    return ARGS.startswith(rest) or CALL_ID.startswith(rest)


def grammar(syntax: str, fns: list[dict], shapes: list[dict], mark: str, args: str) -> str:
    """Lark for one call in `syntax` to one of fns: shapes are the {"name", "arguments"}
    objects' schemas (as tools.call_spec builds them), mark and args the Lark of the
    `[TOOL_CALLS]` and `[ARGS]` tokens."""
    if syntax == "mistral":
        schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
        call = json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})
        return f'start: {mark} " "? "[" call "]"\ncall: %json {call}'
    rules = []
    for k, shape in enumerate(shapes):
        params = {**shape["properties"]["arguments"], "x-guidance": {"whitespace_flexible": False}}
        rules.append(f"call{k}: {json.dumps(fns[k]['name'])} {args} %json {json.dumps(params)}")
    alts = " | ".join(f"call{k}" for k in range(len(rules)))
    return "\n".join([f"start: {mark} ({alts})", *rules])
