"""An OpenAI request body -> the engine's `Request`: the prompt's tokens, the token limit and sampling, checked.

Ranges are judged by the Python API's own validators (`verispec.argument_checks`, `SamplingParams`), so the server
refuses exactly what `verispec.generate` refuses, with the same words; each refusal is a `VerispecError` that the app
turns into OpenAI's 400 error JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

from verispec.argument_checks import prompt_ids, seed_value, stop_strings, unicode_text, whole_number
from verispec.checkpoints.chat_template import WHERE_TEMPLATES_LIVE, ChatTemplate
from verispec.engine.request import Request
from verispec.errors import ContextLengthError, InvalidArgumentError
from verispec.grammar import Grammar, bind
from verispec.models.protocol import CausalLM
from verispec.sampling import SamplingParams
from verispec.serve.schema import ApiRequest, ChatRequest, CompletionRequest, ResponseFormat

COMPLETION_MAX_TOKENS = 16  # the OpenAI completions API's default; chat defaults to the rest of the context
DEFAULT_TEMPERATURE = 1.0  # the OpenAI API's default (verispec.generate's is 0, greedy)


class UnknownModelError(InvalidArgumentError):
    """The request names a model this server does not serve (answered with 404, as OpenAI does)."""


class ChatUnsupportedError(InvalidArgumentError):
    """The served checkpoint has no chat template."""


@dataclass(frozen=True)
class ServedModel:
    """What the server serves: the target under its public name, and its chat template if it has one."""

    name: str
    target: CausalLM
    chat: ChatTemplate | None
    created: int  # Unix time the server loaded it, as /v1/models reports
    longest_text: int  # characters past which a text cannot fit in the context (checked before it is encoded)
    context_length: int  # the tokens a request's prompt and answer may take (--max-model-len)
    exact: bool  # each request's tokens are bitwise those it gets alone


@dataclass(frozen=True)
class Prepared:
    request: Request
    prompt_tokens: int


def prepare_completion(model: ServedModel, body: CompletionRequest) -> Prepared:
    _check_model(model, body)
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        _check_length(model, len(prompt), "the prompt")
    ids = prompt_ids(model.target, prompt)  # text gets the tokenizer's special tokens (BOS)
    limit = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    return _prepared(model, body, ids, limit, "max_tokens")


def prepare_chat(model: ServedModel, body: ChatRequest) -> Prepared:
    _check_model(model, body)
    if model.chat is None:
        raise ChatUnsupportedError(
            f"model {model.name} has no chat template ({WHERE_TEMPLATES_LIVE}), so it cannot "
            "tell which text a conversation is (`verispec serve --chat-template FILE` gives it one); use "
            "/v1/completions with a plain prompt"
        )
    messages = [{"role": m.role, "content": unicode_text(m.text(), "a message")} for m in body.messages]
    _check_length(model, sum(len(m["content"]) for m in messages), "the messages")
    text = model.chat.render(messages)
    # The template writes the special tokens (BOS included) itself, so encoding must not add them again.
    ids = prompt_ids(model.target, model.target.tokenizer.encode(text, add_special_tokens=False).ids)
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    limit = model.context_length - len(ids) if body.token_limit is None else body.token_limit
    return _prepared(model, body, ids, limit, name)


def _response_grammar(response_format: ResponseFormat | None) -> Grammar | None:
    """What `response_format` asks the output to be: text (no grammar), any JSON object, or JSON under a schema."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Grammar.json_schema({"type": "object"})
    return Grammar.json_schema(response_format.json_schema.schema_)


def _check_length(model: ServedModel, length: int, what: str) -> None:
    """Refuse a text of `length` characters that cannot fit in the context before spending time on encoding it."""
    if length > model.longest_text:
        raise ContextLengthError(
            f"{what} has {length} characters: more than this model's context of "
            f"{model.context_length} tokens can hold (at most {model.longest_text})"
        )


def _check_model(model: ServedModel, body: ApiRequest) -> None:
    if body.model != model.name:
        raise UnknownModelError(f"the model `{body.model}` does not exist; this server serves `{model.name}`")


def _prepared(model: ServedModel, body: ApiRequest, ids: list[int], limit: int, limit_name: str) -> Prepared:
    limit = whole_number(limit, limit_name, 1)
    context = model.context_length
    if len(ids) + limit > context:
        raise ContextLengthError(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{len(ids)} and {limit_name} asks for {limit} more ({len(ids) + limit} in all)"
        )
    sampling = SamplingParams(
        DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        0 if body.top_k in (None, -1) else body.top_k,
        1.0 if body.top_p is None else body.top_p,
    )
    # Compiled here, on the request's thread: the engine's thread only copies it
    grammar = bind(_response_grammar(body.response_format), model.target, body.ignore_eos)
    request = Request(
        ids,
        limit,
        sampling,
        seed=seed_value(body.seed),
        stop=tuple(stop_strings(body.stop)),
        ignore_eos=body.ignore_eos,
        grammar=grammar,
    )
    return Prepared(request, len(ids))
