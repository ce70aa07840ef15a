"""The FastAPI app: OpenAI's completions and chat endpoints over the engine worker, /v1/models, /health, /metrics.

Handlers only check, submit and relay: the engine runs on the worker's thread. Bad input of any kind is answered
with OpenAI's error JSON (400; 404 for an unknown model or path) and never reaches the engine or takes the server
down. A client that goes away, mid-stream or while waiting for a full response, has its request aborted, which frees
its sequence at the engine's next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from verispec.checkpoints.chat_template import load_chat_template
from verispec.checkpoints.tokenizer import longest_token_chars
from verispec.drafters.base import Drafter
from verispec.engine.engine import Engine
from verispec.engine.request import Update
from verispec.errors import ContextLengthError, GrammarError, InvalidArgumentError, VerispecError
from verispec.models.protocol import CausalLM
from verispec.serve.guard import Guard
from verispec.serve.metrics import RequestClock, ServerMetrics
from verispec.serve.options import ServeOptions
from verispec.serve.prepare import Prepared, ServedModel, UnknownModelError, prepare_chat, prepare_completion
from verispec.serve.responses import DONE, Reply, sse, usage
from verispec.serve.schema import ChatRequest, CompletionRequest, error_body
from verispec.serve.worker import EngineFailure, EngineWorker, Ticket

log = logging.getLogger("verispec.serve")


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


def serving_app(
    target: CausalLM,
    drafter: Drafter | None,
    target_dir: Path | None = None,
    *,
    chat_template: str | None = None,
    name: str | None = None,
    max_batch: int = 16,
    adaptive: bool = True,
    options: ServeOptions = ServeOptions(),
    context: int | None = None,
    kv_memory: int | None = None,
) -> FastAPI:
    """The app for a loaded target and drafter (None: plain decoding): served as `name` (default: the target's), with
    the chat template `chat_template` (Jinja text), else `target_dir`'s where it has one, on engines of up to
    `max_batch` sequences that choose each step's draft length (`adaptive`, `-k auto`) or draft the drafter's k every
    step, `context` tokens a request and `kv_memory` bytes of keys and values in all (engine/kv_budget.py);
    `options`: who may call it and what it accepts."""
    if chat_template is not None and target_dir is None:
        raise InvalidArgumentError(
            "a chat template given is rendered with the target checkpoint's special tokens: give its target_dir"
        )
    chat = load_chat_template(target_dir, target.tokenizer, chat_template) if target_dir is not None else None
    engine = Engine(target, drafter, max_batch=max_batch, adaptive=adaptive, context=context, kv_memory=kv_memory)
    longest_text = engine.budget.context * longest_token_chars(target.tokenizer)
    model = ServedModel(
        name or target.name, target, chat, int(time.time()), longest_text, engine.budget.context, engine.metrics.exact
    )
    return create_app(model, engine, options)


def create_app(model: ServedModel, engine: Engine, options: ServeOptions = ServeOptions()) -> FastAPI:
    """The app serving `model` with `engine` (built before serving, so that a bad setup fails first)."""
    worker = EngineWorker(engine)
    metrics = ServerMetrics(lambda: worker.snapshot)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)  # ends what is still in flight (a forced shutdown)

    docs = {} if options.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="verispec", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan, **docs)
    app.state.worker = worker
    app.add_middleware(Guard, options=options)
    _add_error_handlers(app)

    # Encoding a prompt (and rendering a chat) runs on a thread: a long one must not stall every stream's events.
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prepared = await asyncio.to_thread(prepare_completion, model, body)
        reply = Reply("completion", model.name, model.exact, body.include_usage)
        return await _respond(worker, metrics, request, prepared, reply, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        prepared = await asyncio.to_thread(prepare_chat, model, body)
        reply = Reply("chat", model.name, model.exact, body.include_usage)
        return await _respond(worker, metrics, request, prepared, reply, body.stream)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model.name,
            "object": "model",
            "created": model.created,
            "owned_by": "verispec",
            "max_model_len": model.target.context_length,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        """503 when the engine's thread has stopped, or has been inside one step for `stall_seconds` with work."""
        stalled = worker.stalled_for
        status = (
            "engine thread stopped"
            if not worker.alive
            else f"engine stalled: {stalled:.0f} s in one step"
            if stalled > options.stall_seconds
            else "ok"
        )
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _respond(
    worker: EngineWorker, metrics: ServerMetrics, request: Request, prepared: Prepared, reply: Reply, stream: bool
) -> Response:
    clock = metrics.clock()
    ticket = worker.submit(prepared.request, clock.observe)
    try:
        first = await _next_or_gone(ticket, request)
        _raise_failure(first)  # refused by the engine (400) or failed in it (500)
        if stream:
            events = _events(ticket, first, reply, clock, prepared.prompt_tokens)
            return _EngineStream(events, lambda: worker.abort(ticket))
        update, text = first, []
        while True:
            text.append(update.text)
            if update.finished:
                break
            update = await _next_or_gone(ticket, request)
            _raise_failure(update)
    except ClientGone:
        worker.abort(ticket)
        return Response(status_code=499)  # nobody reads it; the code is nginx's "client closed request"
    counts = usage(prepared.prompt_tokens, clock.tokens)
    return JSONResponse(reply.full("".join(text), update.finish_reason, counts, update.stats))


async def _next_or_gone(ticket: Ticket, request: Request) -> Update | Exception:
    """The ticket's next item, or ClientGone if the client disconnects first."""
    item = asyncio.ensure_future(ticket.updates.get())
    gone = asyncio.ensure_future(_disconnect(request))
    done, _ = await asyncio.wait({item, gone}, return_when=asyncio.FIRST_COMPLETED)
    (gone if item in done else item).cancel()
    if item in done:
        return item.result()
    raise ClientGone


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _raise_failure(item: Update | Exception) -> None:
    """The engine's refusal of the request is bad input (400); its failure while running it (EngineFailure, as the
    worker delivers it) or anything else is the server's (500)."""
    if isinstance(item, (VerispecError, EngineFailure)):
        raise item
    if isinstance(item, Exception):
        raise EngineFailure(f"generation failed: {type(item).__name__}: {item}") from item


async def _events(
    ticket: Ticket, update: Update, reply: Reply, clock: RequestClock, prompt_tokens: int
) -> AsyncIterator[str]:
    """The SSE stream of one request, from its first update to [DONE]."""
    if reply.kind == "chat":
        yield reply.role_chunk()
    while True:
        if isinstance(update, Exception):  # the step failed after the stream began: an error event ends it
            yield sse(error_body(f"generation failed: {type(update).__name__}: {update}", kind="server_error"))
            return
        if update.finished:
            yield reply.text_chunk(update.text, update.finish_reason, update.stats)
            break
        if update.text:
            yield reply.text_chunk(update.text)
        update = await ticket.updates.get()
    if reply.include_usage:
        yield reply.usage_chunk(usage(prompt_tokens, clock.tokens))
    yield DONE


class _EngineStream(StreamingResponse):
    """A streamed response that aborts its request however the stream ends (a request already finished is left
    alone), since a stream cut by a disconnect is abandoned rather than closed."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure as OpenAI's error JSON: bad bodies and arguments 400, unknown model or path 404, bugs 500."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        problems, param = [], None
        for e in err.errors():
            where = ".".join(str(part) for part in e["loc"][1:])
            message = e["msg"].removeprefix("Value error, ")
            if e["type"] == "json_invalid":
                where, message = "", f"the body is not valid JSON ({e.get('ctx', {}).get('error', message)})"
            elif not where and e["type"] in ("model_attributes_type", "dict_type", "missing"):
                message = "the body must be a JSON object"
            param = param or where or None
            problems.append(f"{where}: {message}" if where else message)
        return JSONResponse(error_body("; ".join(problems), param=param), status_code=400)

    @app.exception_handler(VerispecError)  # Starlette picks the handler of the closest class
    async def refused(request: Request, err: VerispecError) -> JSONResponse:
        return JSONResponse(error_body(str(err)), status_code=400)

    @app.exception_handler(GrammarError)
    async def bad_grammar(request: Request, err: GrammarError) -> JSONResponse:
        return JSONResponse(error_body(str(err), param="response_format"), status_code=400)

    @app.exception_handler(ContextLengthError)
    async def too_long(request: Request, err: ContextLengthError) -> JSONResponse:
        return JSONResponse(error_body(str(err), code="context_length_exceeded"), status_code=400)

    @app.exception_handler(UnknownModelError)
    async def unknown_model(request: Request, err: UnknownModelError) -> JSONResponse:
        return JSONResponse(error_body(str(err), param="model", code="model_not_found"), status_code=404)

    @app.exception_handler(EngineFailure)
    async def engine_failed(request: Request, err: EngineFailure) -> JSONResponse:
        return JSONResponse(error_body(str(err), kind="server_error"), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(err.detail)), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(
            error_body(f"internal error: {type(err).__name__}: {err}", kind="server_error"), status_code=500
        )
