"""The OpenAI request bodies the server accepts, and the OpenAI error JSON it answers bad ones with.

Types are strict (a string where a number belongs is refused, not coerced) and unknown fields are refused, so a
misspelt option never silently does nothing. OpenAI's own fields that verispec does not implement are declared
anyway, and accepted only at the value that means "off": a client that sends `presence_penalty: 0` works, one that
asks for a penalty is told it is unsupported instead of getting output without it. Ranges are checked later, by the
same validators as the Python API (`verispec/serve/prepare.py`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from verispec.errors import InvalidArgumentError

Prompt = str | list[int] | list[str] | list[list[int]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema (under its JSON name `schema`) and OpenAI's name for it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    schema_: dict = Field(alias="schema")  # (`schema` would shadow pydantic's own attribute)
    description: str | None = None
    strict: bool | None = None  # verispec always follows the schema exactly


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON valid under a schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema goes with type json_schema, and that type needs it")
        return self


# Fields of the OpenAI API that verispec does not implement, with the values at which each changes nothing (null,
# which means "the default", always does too).
UNSUPPORTED_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "logprobs": (False,),
    "top_logprobs": (),
    "echo": (False,),
    "suffix": (),
    "best_of": (1,),
}


class ApiRequest(BaseModel):
    """Fields common to both endpoints; `top_k` and `ignore_eos` are verispec's extras (as in vLLM)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    ignore_eos: bool = False
    user: str | None = None  # OpenAI's end-user id for abuse monitoring; nothing to do with the output
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _only_neutral(self) -> ApiRequest:
        for name, neutral in UNSUPPORTED_NEUTRAL.items():
            value = getattr(self, name, None)
            if value is not None and value not in neutral:
                allowed = " or ".join(map(repr, (*neutral, None)))
                raise ValueError(f"{name}={value!r} is not supported by verispec (only {allowed})")
        if self.n is not None and self.n != 1:
            raise ValueError(f"n={self.n} is not supported: verispec returns one choice per request (n=1)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(ApiRequest):
    """POST /v1/completions."""

    prompt: Prompt
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids; a batch of prompts would need n choices."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return self.prompt
        if len(self.prompt) != 1:
            raise InvalidArgumentError(
                f"prompt: a batch of {len(self.prompt)} prompts is not supported; send one prompt per request"
            )
        return self.prompt[0]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(ApiRequest):
    """POST /v1/chat/completions; `max_completion_tokens` is the newer name of `max_tokens`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if not self.messages:
            raise ValueError("messages must not be empty")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(
    message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}. A lone surrogate that the message quotes
    from the request is written as its escape: it has no UTF-8 form to send."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
