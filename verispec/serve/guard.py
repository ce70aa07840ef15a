"""The server's door: every HTTP request is checked for its Host name, its API key (on /v1 routes) and its body's
size before the app parses anything, and refused with OpenAI's error JSON."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from verispec.serve.options import ServeOptions
from verispec.serve.schema import error_body


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:8000" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware in front of the app. A body is read whole (at most `max_body_bytes`) before the app sees it,
    so a huge one is refused with a 413 as its bytes arrive instead of being parsed."""

    def __init__(self, app: ASGIApp, options: ServeOptions) -> None:
        self.app, self.options = app, options
        self._key = None if options.api_key is None else f"Bearer {options.api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # names are lower-case bytes
        if self.options.allowed_hosts is not None:
            name = host_name(headers.get(b"host", b"").decode("latin-1"))
            if name not in self.options.allowed_hosts:
                return await _refuse(
                    scope,
                    send,
                    400,
                    f"the Host header names {name!r}, which this server does not answer to (see --allowed-hosts)",
                    "invalid_host",
                )
        if self._key is not None and scope["path"].startswith("/v1"):
            if not secrets.compare_digest(headers.get(b"authorization", b""), self._key):
                return await _refuse(
                    scope,
                    send,
                    401,
                    "a valid API key is required: send `Authorization: Bearer KEY`",
                    "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"},
                )
        limit = self.options.max_body_bytes
        too_large = f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)"
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > limit:
            return await _refuse(scope, send, 413, too_large, "request_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await _refuse(scope, send, 413, too_large, "request_too_large")
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:  # the body, then the connection's own messages (a disconnect)
            nonlocal body
            if body is None:
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, replay, send)


async def _refuse(
    scope: Scope, send: Send, status: int, message: str, code: str, headers: dict[str, str] | None = None
) -> None:
    response = JSONResponse(error_body(message, code=code), status_code=status, headers=headers)
    await response(scope, _nothing, send)


async def _nothing() -> Message:
    return {"type": "http.disconnect"}
