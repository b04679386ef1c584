"""Structured outputs (kvrun/grammar.py) and tool calls (kvrun/server/tools.py) without a model:
random walks through the masks on tiny BPE and SentencePiece tokenizers give text valid against
held-out pydantic schemas; bad schemas and grammars are one-line errors; tool-call syntaxes
parse from any split of the stream; request bodies name unknown fields."""

from __future__ import annotations

import json
import random
import re
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvrun.models.tokenizer import Tokenizer
from kvrun.run.grammar import GrammarError, Grammars, Spec, prepare_row
from kvrun.server import mistral_calls, tools
from kvrun.server.schema import ChatBody
from tiny_models import CHAT_TEMPLATE, SPM_VOCAB, VOCAB, make_tokenizer, save_spm, save_tokenizer

# ---------------------------------------------------------------- held-out schemas
# (closed objects, as OpenAI's strict mode makes them: an open one lets a random walk add keys
# of unbounded text forever)


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Address(Closed):
    city: str = Field(max_length=12)
    zip: int = Field(ge=0, le=99999)


class Person(Closed):  # nested object, enum, bounded array, number
    name: str = Field(max_length=10)
    role: Literal["admin", "user", "guest"]
    address: Address
    scores: list[float] = Field(min_length=1, max_length=3)


class Cat(Closed):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(Closed):
    kind: Literal["dog"]
    good: bool


class Pet(Closed):  # anyOf
    pet: Cat | Dog
    tags: list[Literal["a", "b", "c"]] = Field(min_length=2, max_length=2)


HELD_OUT = [Person, Pet]


@pytest.fixture(scope="module", params=["bpe", "spm"])
def grammars(request, tmp_path_factory):
    """Grammars over a tiny byte-level BPE or SentencePiece tokenizer, as kvrun loads them."""
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "bpe":
        save_tokenizer(make_tokenizer(), d)
        n = VOCAB
    else:
        save_spm(d)
        n = SPM_VOCAB
    tok = Tokenizer.from_hf_dir(d)
    return Grammars(tok, n)


def walk(grammars: Grammars, spec: Spec, seed: int, limit: int = 400) -> str:
    """Text of random tokens drawn from the masks until the grammar ends. After 20 tokens the
    walk draws closing characters where the mask allows them, and a stop token once allowed
    after 40, so walks end."""
    c = grammars.compile(spec)
    tok, rng = grammars.tokenizer, random.Random(seed)
    closers = {i for i in range(grammars.n_vocab) if tok.decode([i]) in ('"', "}", "]", "1")}
    out: list[int] = []
    for _ in range(limit):
        row = c.mask(torch.zeros(grammars.n_vocab))
        allowed = torch.isfinite(row).nonzero().flatten().tolist()
        assert allowed, "the mask allows nothing"
        stops = [t for t in allowed if t in tok.stop_ids]
        if stops and (len(out) > 40 or len(stops) == len(allowed)):
            break
        pool = [t for t in allowed if t not in tok.stop_ids]
        if len(out) > 20 and closers.intersection(pool):
            pool = sorted(closers.intersection(pool))
        t = rng.choice(pool)
        out.append(t)
        c.accept(t)
        if c.finished:
            break
    else:
        pytest.fail(f"no end after {limit} tokens: {tok.decode(out)!r}")
    return tok.decode(out)


@pytest.mark.parametrize("model", HELD_OUT, ids=lambda m: m.__name__)
def test_random_walks_validate(grammars, model):
    """Whatever tokens are drawn among those the mask allows, the text validates."""
    spec = Spec.json_schema(model.model_json_schema())
    for seed in range(6):
        text = walk(grammars, spec, seed)
        model.model_validate_json(text)


def test_json_object_and_grammars(grammars):
    """json_object: a JSON object; GBNF and Lark: only their strings."""
    for seed in range(3):
        assert isinstance(json.loads(walk(grammars, Spec.json_object(), seed)), dict)
    gbnf = Spec("grammar", 'root ::= "yes" | "no" | "maybe"')
    lark = Spec("grammar", 'start: "x" NUM\nNUM: /[0-9]{2}/')
    for seed in range(4):
        assert walk(grammars, gbnf, seed) in ("yes", "no", "maybe")
        text = walk(grammars, lark, seed)
        assert text[0] == "x" and text[1:].isdigit() and len(text) == 3


@pytest.mark.parametrize(
    "spec, words",
    [
        (Spec("json_schema", '{"type": "objekt"}'), "objekt"),
        (Spec("grammar", "root ::= foo"), "foo"),
        (Spec("grammar", 'start: "a" (('), "invalid grammar"),
        (Spec("json_schema", "x" * 300_000), "characters"),
    ],
)
def test_bad_specs_are_one_line_errors(grammars, spec, words):
    with pytest.raises(GrammarError) as e:
        grammars.compile(spec)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_schema_must_be_an_object():
    with pytest.raises(GrammarError):
        Spec.json_schema([1, 2])


def test_ignore_eos_yields_to_a_complete_grammar(grammars):
    """With ignore_eos the stop tokens are banned while the text is incomplete, and allowed
    once the grammar allows nothing else."""
    c = grammars.compile(Spec("grammar", 'root ::= "yes"'))
    stops = sorted(grammars.tokenizer.stop_ids)
    row = prepare_row(torch.zeros(grammars.n_vocab), c, True, stops)
    assert all(row[s] == float("-inf") for s in stops)
    for t in grammars.ll_tokenizer().tokenize_str("yes"):
        c.accept(t)
    row = prepare_row(torch.zeros(grammars.n_vocab), c, True, stops)
    assert torch.isfinite(row).any()


# ------------------------------------------------------------------------- tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"]}}}  # fmt: skip


class WeatherArgs(BaseModel):
    city: str
    unit: Literal["c", "f"]


def test_families():
    """ChatML without tools (SmolLM2's) and no template take kvrun's Hermes template; a
    template that reads tools is used as it is; any other is a ToolError."""
    assert tools.family(None).name == "hermes"
    smol = tools.family(CHAT_TEMPLATE)
    assert smol.name == "hermes" and "<tool_call>" in smol.template
    qwen = "{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>"
    assert tools.family(qwen).template == qwen
    llama = '{% if tools %}<|python_tag|>{"name": "parameters"}{% endif %}'
    assert tools.family(llama).args_key == "parameters"
    with pytest.raises(tools.ToolError, match="no tool support"):
        tools.family("[INST] {{ messages[0]['content'] }} [/INST]")
    assert tools.family(MISTRAL_V3).name == "mistral"
    assert tools.family(MISTRAL_V11).name == "mistral11"
    with pytest.raises(tools.ToolError, match="syntax"):
        tools.family("{% if tools %}<function_call>{{ tools }}{% endif %}")


def test_render_tool_loop():
    """Tools, a call sent back (its arguments as JSON text) and the tool's answer render
    through the ChatML tools template."""
    tok_msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "c"}',
                    },
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    fam = tools.family(CHAT_TEMPLATE)
    from kvrun.models.chat_template import render

    text = render(fam.template, tools.template_messages(tok_msgs), True, tools=[WEATHER])
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text
    )
    assert "<tool_response>\n18 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_hermes_stream_any_split(split):
    fam = tools.family(None)
    reply = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'  # fmt: skip
    s = tools.CallStream(fam)
    text, calls = "", []
    for i in range(0, len(reply), split):
        t, c = s.push(reply[i : i + split])
        text, calls = text + t, calls + c
    t, c = s.flush()
    text, calls = text + t, calls + c
    assert text.strip() == "Sure."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "unit": "f"}
    assert calls[0]["id"] != calls[1]["id"]


def test_plain_replies_and_llama3():
    hermes = tools.family(None)
    assert tools.parse(hermes, "No call <tool_ here.") == ("No call <tool_ here.", [])
    assert tools.parse(hermes, "<tool_call>not json</tool_call>")[1] == []
    llama = tools.Family("llama3", "", "parameters")
    text, calls = tools.parse(
        llama, '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}'
    )
    assert text == "" and json.loads(calls[0]["function"]["arguments"]) == {"tz": "UTC"}
    assert tools.parse(llama, "{not a call") == ("{not a call", [])
    assert tools.parse(llama, "Hello there") == ("Hello there", [])


def assert_one_valid_call(fam, text: str, name: str | None) -> None:
    """A forced call's text parses to one call of the named tool (any of the two where None),
    its arguments valid for that tool."""
    _, calls = tools.parse(fam, text)
    assert len(calls) == 1, text
    fn = calls[0]["function"]
    args = json.loads(fn["arguments"])
    if name or fn["name"] == "get_weather":
        assert fn["name"] == "get_weather"
        WeatherArgs.model_validate(args)
    else:
        assert fn["name"] == "get_time" and isinstance(args["tz"], str)


@pytest.mark.parametrize("fam_name", ["hermes", "llama3"])
def test_forced_calls_are_valid(grammars, fam_name):
    """A named or required call, drawn at random through its grammar, parses into a call to
    one of the tools with arguments valid against its schema. (The tiny SentencePiece model
    normalizes newlines away, so it cannot write Hermes' `<tool_call>\\n`: Llama 3's syntax
    for it in both cases.)"""
    if grammars.n_vocab == SPM_VOCAB:
        fam_name = "llama3"
    fam = tools.family(None) if fam_name == "hermes" else tools.Family("llama3", "", "parameters")
    for name in ("get_weather", None):
        for seed in range(4):
            text = walk(grammars, tools.call_spec(fam, [WEATHER, TIME], name), seed)
            assert_one_valid_call(fam, text, name)
    with pytest.raises(tools.ToolError, match="not among"):
        tools.call_spec(fam, [WEATHER], "nope")


# Mistral-style templates, written here the way Mistral's own are: v3 (Mistral 7B v0.3) lists
# the tools before the last user turn and writes a call as a JSON list after [TOOL_CALLS], each
# with its 9-character id, which it refuses in any other shape; v11 (Small 3.2, Devstral)
# writes [TOOL_CALLS]name[ARGS]{...}.
MISTRAL_V3 = """{{- bos_token }}
{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if tools is not none and tools and message == users[-1] %}
            {{- '[AVAILABLE_TOOLS] [' }}
            {%- for tool in tools %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.function.items() %}
                    {{- '"' + key + '": ' + (('"' + val + '"') if val is string else val | tojson) }}
                    {{- ', ' if not loop.last }}
                {%- endfor %}
                {{- '}}' + (', ' if not loop.last else ']') }}
            {%- endfor %}
            {{- '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST] ' + message.content + '[/INST]' }}
    {%- elif message.tool_calls is defined and message.tool_calls %}
        {{- '[TOOL_CALLS] [' }}
        {%- for call in message.tool_calls %}
            {%- if call.id | length != 9 %}
                {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
            {%- endif %}
            {%- set out = call.function | tojson %}
            {{- out[:-1] + ', "id": "' + call.id + '"}' + (', ' if not loop.last else ']' + eos_token) }}
        {%- endfor %}
    {%- elif message.role == 'assistant' %}
        {{- ' ' + message.content | trim + eos_token }}
    {%- elif message.role == 'tool' %}
        {%- if message.tool_call_id | length != 9 %}
            {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | string + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}"""  # fmt: skip
MISTRAL_V11 = """{{- bos_token }}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' %}
        {{- message.content or '' }}
        {%- for call in message.tool_calls or [] %}
            {%- set args = call.function.arguments %}
            {{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' + (args if args is string else args | tojson) }}
        {%- endfor %}
        {{- eos_token }}
    {%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}"""  # fmt: skip


def _loop_messages(call_id: str) -> list[dict]:
    call = {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}  # fmt: skip
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": '"18 C"'},
        {"role": "user", "content": "And now?"},
    ]


class _Tok:  # what tools.render asks of a tokenizer
    bos_id, eos_id = 1, 2

    def token_text(self, i: int) -> str:
        return {1: "<s>", 2: "</s>"}[i]


def test_mistral_render_tool_loop():
    """Tools, a call sent back with an OpenAI-shaped id and the tool's answer render through
    Mistral-style templates: the id reaches the template as 9 characters, the same for the
    call and its answer (the v3 template refuses any other); a 9-character id is kept."""
    fam = tools.family(MISTRAL_V3)
    text = tools.render(
        _Tok(), fam, _loop_messages("call_0123456789abcdef01234567"), [WEATHER, TIME]
    )
    (cid,) = re.findall(r'"id": "(\w+)"', text)
    assert len(cid) == 9 and f'"call_id": "{cid}"' in text
    assert text.startswith("<s>[INST] Weather in Paris?[/INST][TOOL_CALLS] [")
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, "id"' in text
    assert '[TOOL_RESULTS] {"content": "18 C"' in text
    assert text.index("[AVAILABLE_TOOLS]") > text.index("[/TOOL_RESULTS]")  # the last user turn
    assert '"name": "get_time"' in text and text.endswith("[INST] And now?[/INST]")
    kept = tools.render(_Tok(), fam, _loop_messages("abcDEF123"), [WEATHER])
    assert '"id": "abcDEF123"' in kept and '"call_id": "abcDEF123"' in kept
    fam11 = tools.family(MISTRAL_V11)
    text = tools.render(_Tok(), fam11, _loop_messages("call_1"), [WEATHER])
    assert '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}</s>' in text
    assert text.startswith('<s>[AVAILABLE_TOOLS][{"type": "function"')


MISTRAL_REPLIES = {
    "mistral": 'Let me look.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
    "mistral7": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}][TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]',
    "mistral11": 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "unit": "f"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "UTC"}',
}  # fmt: skip


@pytest.mark.parametrize("split", [1, 2, 5, 1000])
@pytest.mark.parametrize("reply", sorted(MISTRAL_REPLIES))
def test_mistral_stream_any_split(reply, split):
    """Mistral's calls, written in one list or a mark a call, in either syntax, parse from
    any split of the stream; each call goes out once its JSON is whole, before the reply
    ends; ids are 9 letters or digits."""
    fam = tools.Family(reply.removesuffix("7"), "", "arguments")
    text = MISTRAL_REPLIES[reply]
    s = tools.CallStream(fam)
    shown, calls, early = "", [], 0
    for i in range(0, len(text), split):
        t, c = s.push(text[i : i + split])
        shown, calls = shown + t, calls + c
        early += len(c)
    t, c = s.flush()
    shown, calls = shown + t, calls + c
    assert shown.strip() == ("" if reply == "mistral7" else "Let me look.")
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "unit": "f"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"tz": "UTC"}
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert early == 2  # both were whole before the end: none waited for flush


def test_mistral_plain_and_broken_replies():
    for syntax in ("mistral", "mistral11"):
        fam = tools.Family(syntax, "", "arguments")
        assert tools.parse(fam, "Plain [TOOL text.") == ("Plain [TOOL text.", [])
        assert tools.parse(fam, "[TOOL_CALLS] not json") == ("[TOOL_CALLS] not json", [])
        assert tools.parse(fam, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}')[1] == []
    fam = tools.Family("mistral", "", "arguments")
    assert tools.parse(fam, '[TOOL_CALLS] [{"arguments": {}}]')[1] == []  # no name
    fam = tools.Family("mistral11", "", "arguments")
    assert tools.parse(fam, "[TOOL_CALLS]bad name![ARGS]{}")[1] == []
    assert tools.parse(fam, "[TOOL_CALLS]f[ARGS][1]")[1] == []
    _, (call,) = tools.parse(fam, "[TOOL_CALLS]f[ARGS]{}")
    assert call["function"] == {"name": "f", "arguments": "{}"}


@pytest.fixture(scope="module")
def mistral_grammars(tmp_path_factory):
    """Grammars over the tiny BPE tokenizer with Mistral's [TOOL_CALLS] and [ARGS] added as
    control tokens (ids VOCAB and VOCAB + 1)."""
    d = tmp_path_factory.mktemp("mistral")
    tok = make_tokenizer()
    tok.add_special_tokens([mistral_calls.MARK, mistral_calls.ARGS])
    save_tokenizer(tok, d)
    return Grammars(Tokenizer.from_hf_dir(d), VOCAB + 2)


@pytest.mark.parametrize("syntax", ["mistral", "mistral11"])
def test_mistral_forced_calls_are_valid(mistral_grammars, syntax):
    """A named or required call drawn at random through its grammar opens with the
    [TOOL_CALLS] control token (and v11's arguments follow the [ARGS] token), and parses into
    a call whose arguments are valid against the tool's schema."""
    fam = tools.Family(syntax, "", "arguments")
    tok = mistral_grammars.tokenizer
    for name in ("get_weather", None):
        spec = tools.call_spec(fam, [WEATHER, TIME], name, tok)
        assert f"<[{VOCAB}]>" in spec.text
        for seed in range(4):
            text = walk(mistral_grammars, spec, seed)
            ids = tok.encode(text, add_bos=False)
            assert ids[0] == VOCAB and (syntax == "mistral" or VOCAB + 1 in ids), text
            assert_one_valid_call(fam, text, name)


def test_tool_arguments_are_closed():
    """Objects that list their properties and say nothing of others are closed, at any depth;
    what a schema says itself is kept."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "c": {"type": "array", "items": {"properties": {"d": {"type": "integer"}}}},
            "e": {"anyOf": [{"properties": {"f": {}}}, {"type": "null"}]},
            "g": {"type": "object", "properties": {}, "additionalProperties": True},
            "h": {"type": "object"},
        },
        "$defs": {"X": {"properties": {"y": {}}, "unevaluatedProperties": False}},
    }
    out = tools.closed(schema)
    p = out["properties"]
    assert out["additionalProperties"] is False and p["a"]["additionalProperties"] is False
    assert p["c"]["items"]["additionalProperties"] is False
    assert p["e"]["anyOf"][0]["additionalProperties"] is False and p["e"]["anyOf"][1] == {
        "type": "null"
    }
    assert p["g"]["additionalProperties"] is True and p["h"] == {"type": "object"}
    assert "additionalProperties" not in out["$defs"]["X"]
    assert "additionalProperties" not in schema  # the request's own schema is not changed


# ------------------------------------------------------------------- request bodies

MSG = [{"role": "user", "content": "hi"}]


def test_unknown_fields_are_named():
    body = ChatBody.model_validate({"model": "m", "messages": MSG, "foo": 1, "logit_scale": 2})
    assert body.unsupported() == (
        "unknown or unsupported fields: foo, logit_scale (they would change the reply)"
    )
    ok = ChatBody.model_validate({"model": "m", "messages": MSG, "user": "u", "metadata": {}})
    assert ok.unsupported() is None


def test_grammar_fields():
    def spec(**kw):
        return ChatBody.model_validate({"model": "m", "messages": MSG, **kw}).grammar_spec()

    assert spec() is None
    assert spec(response_format={"type": "text"}) is None
    assert json.loads(spec(response_format={"type": "json_object"}).text) == {"type": "object"}
    s = spec(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}, "strict": True}})  # fmt: skip
    assert json.loads(s.text) == {"type": "integer"}
    assert spec(json_schema={"type": "string"}).kind == "json_schema"
    assert spec(grammar='root ::= "a"') == Spec("grammar", 'root ::= "a"')
    with pytest.raises(GrammarError, match="one of"):
        spec(json_schema={"type": "string"}, grammar='root ::= "a"')
    with pytest.raises(GrammarError, match="needs"):
        spec(response_format={"type": "json_schema"})
    with pytest.raises(ValidationError):
        spec(response_format={"type": "yaml"})


def test_tool_fields():
    body = ChatBody.model_validate(
        {
            "model": "m",
            "messages": MSG,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }  # fmt: skip
    )
    assert body.uses_tools() and body.forced_call() == (True, "get_weather")
    body = ChatBody.model_validate({"model": "m", "messages": MSG, "tool_choice": "required"})
    assert body.forced_call() == (True, None) and not body.uses_tools()
    tool_msg = [*MSG, {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert ChatBody.model_validate({"model": "m", "messages": tool_msg}).uses_tools()
    with pytest.raises(ValidationError):
        ChatBody.model_validate({"model": "m", "messages": MSG, "tools": [WEATHER] * 200})
