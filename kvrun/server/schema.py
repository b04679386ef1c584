"""The OpenAI request bodies kvrun serve accepts (pydantic), and the error object it answers.

Fields follow OpenAI's API; llama-server's sampling extensions (top_k, min_p, repeat_penalty,
repeat_last_n, cache_prompt) and kvrun's own (kv, kv_budget: the cache of this request,
validated by the --kv grammar) sit beside them, with llama-server's json_schema, grammar
and ignore_eos. An unknown top-level field is a 400 naming it, unless it changes nothing here
(HARMLESS: user, metadata, ... that OpenAI's SDKs send); unknown fields inside messages and
options are ignored. Defaults of the sampling fields are kvrun's (the
CLI's, llama.cpp's), not OpenAI's: a body without temperature samples as `kvrun generate` does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from ..models.config import SamplingConfig

_DEFAULT = SamplingConfig()
MAX_TOP_LOGPROBS = 20
# Bounds on what a body may hold (the README's serve section lists them). Lists are measured
# before their items are validated: pydantic reports every bad item of a list, and a body of
# millions of them would cost seconds to report.
MAX_STOPS = 16
MAX_STOP_CHARS = 2048  # all stop strings together: each generated piece is matched against them
MAX_MESSAGES = 2048
MAX_PARTS = 64  # content parts of one message
MAX_PROMPTS = 1024  # prompts of one completions request (and at most --queue + -np)
MAX_LOGIT_BIAS = 1024
MAX_NAME = 256  # model, kv and kv_budget strings
MAX_TOOLS = 128
# top-level fields clients send that change no reply of kvrun's: accepted and ignored
HARMLESS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prediction",
        "id_slot",
    }  # fmt: skip
)
MAX_LISTED_ERRORS = 100  # more validation errors are counted, not itemized
# sampling values whose float32 arithmetic would overflow (inf, then NaN probabilities that
# fail the whole engine step): a temperature this low samples as greedy (0) does to within
# ties, and a smaller top_p keeps the one most likely token as this one does
MIN_TEMPERATURE = 1e-6
MIN_TOP_P = 1e-6


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: Annotated[str, Field(max_length=MAX_NAME)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama-server's


class Function(_Body):
    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: Function


class NamedFunction(_Body):
    name: Annotated[str, Field(max_length=MAX_NAME)]


class NamedTool(_Body):
    type: Literal["function"]
    function: NamedFunction


class CallFunction(_Body):
    name: Annotated[str, Field(max_length=MAX_NAME)]
    arguments: str = "{}"


class ToolCall(_Body):
    id: Annotated[str, Field(max_length=MAX_NAME)] = ""
    type: Literal["function"] = "function"
    function: CallFunction


class Sampling(_Body):
    """What both endpoints share: sampling, stop strings, the KV method, streaming, the
    grammar a reply follows."""

    model_config = ConfigDict(extra="allow")  # unknown fields: unsupported() names them

    model: Annotated[str, Field(max_length=MAX_NAME)]
    # beyond what the context leaves: clamped to it (the server's _job)
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] = _DEFAULT.temp
    top_p: Annotated[float, Field(gt=0, le=1)] = _DEFAULT.top_p
    top_k: Annotated[int, Field(ge=0)] = _DEFAULT.top_k
    min_p: Annotated[float, Field(ge=0, le=1)] = _DEFAULT.min_p
    # far from 1 the penalized logits overflow float32 (NaN probabilities)
    repeat_penalty: Annotated[float, Field(ge=1e-3, le=1e3)] = _DEFAULT.repeat_penalty
    repeat_last_n: Annotated[int, Field(ge=-1)] = _DEFAULT.repeat_last_n
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # checked by the server (the vocabulary's ids)
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None  # torch's seed range
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # kvrun: this request's --kv (default: the server's) and --kv-budget
    kv: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    kv_budget: float | Annotated[str, Field(max_length=MAX_NAME)] | None = None
    cache_prompt: bool = True  # llama-server's: go on from a kept prefix (kvrun serve --cache-mem)
    ignore_eos: bool = False  # vLLM's and llama-server's: exactly max_tokens tokens
    # structured outputs (kvrun.run.grammar): OpenAI's response_format, llama-server's fields
    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _few_stops(cls, v):
        return at_most(v, MAX_STOPS, "stop")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _few_biases(cls, v):
        return at_most(v, MAX_LOGIT_BIAS, "logit_bias")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops) or sum(map(len, stops)) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop takes up to {MAX_STOPS} non-empty strings of {MAX_STOP_CHARS} characters "
                "in all"
            )
        return stops

    def config(self) -> SamplingConfig:
        return SamplingConfig(
            self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0,
            self.top_k,
            max(self.top_p, MIN_TOP_P),
            self.min_p,
            self.repeat_penalty,
            self.repeat_last_n,
            ignore_eos=self.ignore_eos,
        )

    def grammar_spec(self):
        """The kvrun.run.grammar.Spec the reply must follow (None: free text); GrammarError for a
        request that asks for two, or a json_schema response_format without a schema."""
        from ..run.grammar import GrammarError, Spec

        asked = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(Spec.json_schema(rf.schema_) if rf.schema_ else Spec.json_object())
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_ if rf.json_schema is not None else rf.schema_
            if schema is None:
                raise GrammarError("response_format json_schema needs json_schema.schema")
            asked.append(Spec.json_schema(schema))
        if self.json_schema is not None:
            asked.append(Spec.json_schema(self.json_schema))
        if self.grammar is not None:
            asked.append(Spec("grammar", self.grammar))
        if len(asked) > 1:
            raise GrammarError("give one of response_format, json_schema and grammar")
        return asked[0] if asked else None

    def unsupported(self) -> str | None:
        """Why this body asks for something kvrun serve does not do (400), or None."""
        if self.n != 1:
            return "n > 1 is not supported: send the request n times (each with its own seed)"
        if self.frequency_penalty or self.presence_penalty:
            return (
                "frequency_penalty and presence_penalty are not supported: "
                "use repeat_penalty (and repeat_last_n), llama.cpp's penalty"
            )
        unknown = sorted(set(self.model_extra or ()) - HARMLESS)
        if unknown:
            names = ", ".join(n[:MAX_NAME] for n in unknown[:10])
            return f"unknown or unsupported fields: {names} (they would change the reply)"
        return None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, sent back
    tool_call_id: Annotated[str, Field(max_length=MAX_NAME)] | None = None  # a tool's answer
    name: Annotated[str, Field(max_length=MAX_NAME)] | None = None

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _few_calls(cls, v):
        return at_most(v, MAX_TOOLS, "tool_calls")

    def as_dict(self) -> dict:
        """The message as a chat template takes it."""
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            m["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            m["name"] = self.name
        return m

    @field_validator("content", mode="before")
    @classmethod
    def _few_parts(cls, v):
        return at_most(v, MAX_PARTS, "content")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatBody(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True  # one call at most is forced; more may come with "auto"

    @field_validator("tools", mode="before")
    @classmethod
    def _few_tools(cls, v):
        return at_most(v, MAX_TOOLS, "tools")

    def uses_tools(self) -> bool:
        """Whether the reply is rendered and read as a tool-using chat."""
        return bool(self.tools) or any(m.tool_calls or m.role == "tool" for m in self.messages)

    def forced_call(self) -> tuple[bool, str | None]:
        """(a call is forced, the function it names or None for any of tools)."""
        c = self.tool_choice
        if isinstance(c, NamedTool):
            return True, c.function.name
        return c == "required", None

    def limit(self) -> int:
        """Tokens to generate: max_completion_tokens or max_tokens, else to the end (-1)."""
        n = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        return -1 if n is None else n

    @field_validator("messages", mode="before")
    @classmethod
    def _few_messages(cls, v):
        return at_most(v, MAX_MESSAGES, "messages")

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(Sampling):
    # one prompt (text or token ids) or several (each its own choice); the shape is checked
    # first (_prompt_shape), so the first member that fits is the one meant
    prompt: Annotated[
        str | list[StrictInt] | list[str] | list[list[StrictInt]],
        Field(union_mode="left_to_right"),
    ]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        """One error for a list that is none of the four shapes, instead of one for each of its
        items under each member of the union."""
        if not isinstance(v, list) or not v:
            return v
        kinds = set(map(type, v))
        if kinds == {int}:
            return v
        at_most(v, MAX_PROMPTS, "prompt")
        if kinds == {str} or (kinds == {list} and all(set(map(type, p)) <= {int} for p in v)):
            return v
        raise ValueError(
            "prompt takes a string, a list of strings, a list of token ids or a list of lists "
            "of token ids"
        )

    def limit(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and type(p[0]) is int:  # one list of token ids (the shape is checked)
            return [list(p)]
        return list(p)


def at_most(v, n: int, name: str):
    """v unchanged, or ValueError when it is a list or object of more than n items."""
    if isinstance(v, (list, dict)) and len(v) > n:
        raise ValueError(f"{name} takes at most {n} items, not {len(v)}")
    return v


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(exc) -> tuple[str, str | None]:
    """A pydantic ValidationError as one line, and the first field it names."""
    n = exc.error_count()
    if n > MAX_LISTED_ERRORS:  # listing them costs microseconds each: millions would stall
        return f"{n} values in the body are invalid (wrong types or missing fields)", None
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ()))
    text = "; ".join(
        f"{'.'.join(str(x) for x in e.get('loc', ())) or 'body'}: {e.get('msg', '')}"
        for e in errs[:3]
    )
    return text, loc or None
