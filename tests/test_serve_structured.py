"""Structured outputs, tool calls and ignore_eos through `kvrun serve` on the default model
(SmolLM2-135M), driven by the openai SDK: its `parse` with a pydantic model, held-out schemas
whose every reply validates (sampled, several seeds, several --kv methods in one batch), a
tool-call loop that sends the tool's answer back, streamed tool-call deltas; and
`kvrun generate --json-schema / --grammar`."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field

pytestmark = pytest.mark.slow  # a server process


# Numbers carry multipleOf, strings maxLength: without a bound the grammar allows digits or
# letters without end, and a 135M model, once it repeats, runs to max_tokens (as it would
# under any grammar engine); with them each reply ends.
class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class City(Closed):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=100_000_000)


class Trip(Closed):  # nested objects, an enum, a bounded array, numbers
    traveller: str = Field(max_length=30)
    mode: Literal["train", "plane", "car"]
    stops: list[City] = Field(min_length=1, max_length=3)
    budget_eur: float = Field(ge=0, le=100000, multiple_of=0.01)


class Circle(Closed):
    shape: Literal["circle"]
    radius: float = Field(gt=0, le=100, multiple_of=0.1)


class Square(Closed):
    shape: Literal["square"]
    side: float = Field(gt=0, le=100, multiple_of=0.1)


class Drawing(Closed):  # anyOf, a bounded array of enums, a boolean
    title: str = Field(max_length=40)
    item: Circle | Square
    colors: list[Literal["red", "green", "blue"]] = Field(min_length=1, max_length=2)
    filled: bool


class Person(BaseModel):
    name: str
    age: int


HELD_OUT = [
    (Trip, "Plan a short trip through two European cities as JSON."),
    (Drawing, "Describe a simple drawing as JSON."),
    (City, "Give me facts about Tokyo as JSON."),
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 40}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


class WeatherArgs(Closed):
    city: str
    unit: Literal["celsius", "fahrenheit"]


class ClockArgs(Closed):
    zone: str


@pytest.fixture(scope="module")
def server(default_gguf):
    from test_serve import Served

    s = Served(default_gguf, "-np", "4", "--queue", "64")
    yield s
    s.stop()


def schema_format(model: type[BaseModel]) -> dict:
    schema = model.model_json_schema()
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": schema}}


def test_parse_with_a_pydantic_model(server):
    """The SDK's parse (a strict json_schema built from the model) gives a parsed object."""
    c = server.client()
    # openai < 1.92 (the floor is 1.51) has it under beta only
    parse = getattr(c.chat.completions, "parse", None) or c.beta.chat.completions.parse
    r = parse(model="smollm2", response_format=Person, max_tokens=80,
                                 messages=[{"role": "user", "content": "Describe a person."}],
                                 temperature=0)  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Person)


def test_held_out_schemas_always_validate(server):
    """Each held-out schema, sampled with several seeds and a different --kv method each, all
    at once in the server's batch: every reply validates."""
    c = server.client()
    methods = [{"kv": "full"}, {"kv": "snapkv", "kv_budget": 0.5}, {"kv": "kivi2"},
               {"kv": "tova", "kv_budget": 0.5}]  # fmt: skip

    def run(job):
        (model, prompt), seed = job
        r = c.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=250,
            temperature=0.8, seed=seed, response_format=schema_format(model),
            extra_body=methods[seed % len(methods)],
        )  # fmt: skip
        return model, r.choices[0]

    jobs = [(h, seed) for h in HELD_OUT for seed in range(3)]
    with ThreadPoolExecutor(8) as pool:
        for model, choice in pool.map(run, jobs):
            assert choice.finish_reason == "stop", choice.message.content
            model.model_validate_json(choice.message.content)


def test_json_object_and_llama_server_fields(server):
    """json_object gives a JSON object (a reply that ends: one cut by max_tokens is cut JSON,
    as OpenAI's is); llama-server's json_schema and grammar (GBNF) fields constrain
    completions too."""
    c = server.client()
    book = "Describe a book as a JSON object with a title and an author."
    runs = [(book, 0.7, seed) for seed in range(3)] + [
        ("Return a JSON object with your name.", 0.0, 0),
        ("List three fruits in a JSON object.", 0.0, 0),
    ]
    for prompt, temp, seed in runs:
        r = c.chat.completions.create(
            model="smollm2", max_tokens=300, temperature=temp, seed=seed,
            messages=[{"role": "user", "content": prompt}], response_format={"type": "json_object"},
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.completions.create(model="smollm2", prompt="The answer is", max_tokens=20,
                             extra_body={"json_schema": {"type": "integer", "maximum": 99}})  # fmt: skip
    assert int(r.choices[0].text) <= 99
    r = c.completions.create(model="smollm2", prompt="Is water wet?", max_tokens=8,
                             extra_body={"grammar": 'root ::= "yes" | "no"'})  # fmt: skip
    assert r.choices[0].text in ("yes", "no")


def test_bad_requests_are_400s_naming_the_problem(server):
    base = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    cases = [
        ({"json_schema": {"type": "objekt"}}, "objekt"),
        ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
        ({"response_format": {"type": "json_schema"}}, "schema"),
        ({"grammar": 'root ::= "a"', "json_schema": {}}, "one of"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "nope"),
        ({"mirostat": 2, "typical_p": 0.5}, "mirostat, typical_p"),
    ]  # fmt: skip
    for extra, words in cases:
        r = httpx.post(f"{server.url}/chat/completions", json=base | extra, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert words in r.json()["error"]["message"], r.text
    ok = httpx.post(f"{server.url}/chat/completions", json=base | {"user": "u", "store": False},
                    timeout=60)  # fmt: skip
    assert ok.status_code == 200


def test_tool_call_loop(server):
    """A named call and a required one (two tools) give arguments valid against the chosen
    function's schema; the call and the tool's answer sent back give a plain reply."""
    c = server.client()
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(3):
        r = c.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER, CLOCK],
                                      tool_choice="required", max_tokens=120, seed=seed,
                                      temperature=0.8)  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        args = ClockArgs if call.function.name == "get_time" else WeatherArgs
        args.model_validate_json(call.function.arguments)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER, CLOCK],
                                  tool_choice=named, max_tokens=120, temperature=0)  # fmt: skip
    msg = r.choices[0].message
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    WeatherArgs.model_validate_json(call.function.arguments)
    msgs += [msg.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 18, "sky": "sunny"}'}]  # fmt: skip
    r2 = c.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER, CLOCK],
                                   tool_choice="none", max_tokens=30, temperature=0)  # fmt: skip
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    # the tool's answer is in the prompt: more tokens than the first turn's
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 10


def test_streamed_tool_call_deltas(server):
    """A streamed call comes as OpenAI streams one: id, type and name first, then arguments,
    finish_reason tool_calls; joined, the arguments validate."""
    c = server.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = c.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER], tool_choice=named, max_tokens=120, temperature=0, stream=True,
    )  # fmt: skip
    deltas, finish = [], None
    for ch in stream:
        for choice in ch.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].index == 0
    args = "".join(d.function.arguments or "" for d in deltas)
    WeatherArgs.model_validate_json(args)


def test_ignore_eos_gives_max_tokens(server):
    """ignore_eos: exactly max_tokens tokens, on a prompt the model ends early without it."""
    c = server.client()
    msgs = [{"role": "user", "content": "Say OK."}]
    short = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=100,
                                      temperature=0)  # fmt: skip
    assert short.usage.completion_tokens < 100 and short.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=100, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.completion_tokens == 100 and r.choices[0].finish_reason == "length"


def test_generate_json_schema_and_grammar(default_gguf, tmp_path):
    """kvrun generate --json-schema FILE / --grammar FILE; a bad schema is one line, exit 1."""
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(City.model_json_schema()))
    cmd = [sys.executable, "-m", "kvrun", "generate", "-m", str(default_gguf), "--json",
           "-n", "120", "-p", "Facts about Rome as JSON."]  # fmt: skip
    out = subprocess.run([*cmd, "--json-schema", str(schema)], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    City.model_validate_json(json.loads(out.stdout)["text"])
    gbnf = tmp_path / "yn.gbnf"
    gbnf.write_text('root ::= "yes" | "no"\n')
    out = subprocess.run([*cmd, "--grammar", str(gbnf)], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    assert json.loads(out.stdout)["text"] in ("yes", "no")
    schema.write_text('{"type": "objekt"}')
    bad = subprocess.run([*cmd, "--json-schema", str(schema)], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == "error: invalid json_schema: Invalid type: objekt"
