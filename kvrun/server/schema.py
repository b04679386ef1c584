"""The OpenAI request bodies kvrun serve accepts (pydantic), and the error object it answers.

Fields follow OpenAI's API; llama-server's sampling extensions (top_k, min_p, repeat_penalty,
repeat_last_n, cache_prompt) and kvrun's own (kv, kv_budget: the cache of this request,
validated by the --kv grammar) sit beside them. Unknown fields are ignored, as OpenAI's SDKs send a few that
change nothing here (user, metadata, ...). Defaults of the sampling fields are kvrun's (the
CLI's, llama.cpp's), not OpenAI's: a body without temperature samples as `kvrun generate` does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import SamplingConfig

_DEFAULT = SamplingConfig()
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    """What both endpoints share: sampling, stop strings, the KV method, streaming."""

    model: str
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] = _DEFAULT.temp
    top_p: Annotated[float, Field(gt=0, le=1)] = _DEFAULT.top_p
    top_k: Annotated[int, Field(ge=0)] = _DEFAULT.top_k
    min_p: Annotated[float, Field(ge=0, le=1)] = _DEFAULT.min_p
    repeat_penalty: Annotated[float, Field(gt=0)] = _DEFAULT.repeat_penalty
    repeat_last_n: Annotated[int, Field(ge=-1)] = _DEFAULT.repeat_last_n
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv: str | None = None  # kvrun: this request's --kv (default: the server's)
    kv_budget: float | str | None = None  # kvrun: its --kv-budget
    cache_prompt: bool = True  # llama-server's: go on from a kept prefix (kvrun serve --cache-mem)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop takes up to 16 non-empty strings")
        return stops

    def config(self) -> SamplingConfig:
        return SamplingConfig(
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.repeat_penalty,
            self.repeat_last_n,
        )

    def unsupported(self) -> str | None:
        """Why this body asks for something kvrun serve does not do (400), or None."""
        if self.n != 1:
            return "n > 1 is not supported: send the request n times (each with its own seed)"
        if self.frequency_penalty or self.presence_penalty:
            return (
                "frequency_penalty and presence_penalty are not supported: "
                "use repeat_penalty (and repeat_last_n), llama.cpp's penalty"
            )
        return None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatBody(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def limit(self) -> int:
        """Tokens to generate: max_completion_tokens or max_tokens, else to the end (-1)."""
        n = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        return -1 if n is None else n

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(Sampling):
    # one prompt (text or token ids) or several (each its own choice)
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def limit(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


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
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ()))
    text = "; ".join(
        f"{'.'.join(str(x) for x in e.get('loc', ())) or 'body'}: {e.get('msg', '')}"
        for e in errs[:3]
    )
    return text, loc or None
