"""What a server allows: who may call it (an API key, the Host names it answers to), how large a request may be,
whether it shows its API docs, and how long the engine may be stuck before /health says so."""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass

from verispec.argument_checks import whole_number
from verispec.errors import InvalidArgumentError

API_KEY_ENV = "VERISPEC_API_KEY"  # read where --api-key is not given
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
MAX_BODY_BYTES = 4 * 1024 * 1024  # the default limit on a request body
STALL_SECONDS = 30.0  # the default time the engine may spend in one step, while it has work, before /health fails
SHUTDOWN_MARGIN = 5.0  # seconds after the drain's grace that uvicorn gives open connections before it closes them


@dataclass(frozen=True)
class ServeOptions:
    """`api_key`: required as `Authorization: Bearer KEY` on every /v1 route (None: open); `allowed_hosts`: the
    Host header names answered (None: any); `docs`: /docs, /redoc and /openapi.json; `max_body_bytes`: larger
    bodies get a 413; `stall_seconds`: /health answers 503 once the engine has been in one step that long."""

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    docs: bool = True
    max_body_bytes: int = MAX_BODY_BYTES
    stall_seconds: float = STALL_SECONDS

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise InvalidArgumentError("--api-key must not be empty")
        whole_number(self.max_body_bytes, "--max-body-bytes", 1)
        if not (math.isfinite(self.stall_seconds) and self.stall_seconds > 0):
            raise InvalidArgumentError(f"--health-stall must be > 0 seconds, got {self.stall_seconds}")


def api_key(flag: str | None) -> str | None:
    """The key a server requires: `--api-key` where given (even empty, which ServeOptions refuses), else
    $VERISPEC_API_KEY where set and not empty, else none."""
    return flag if flag is not None else os.environ.get(API_KEY_ENV) or None


def allowed_hosts(bind: str, names: str | None) -> tuple[str, ...] | None:
    """The Host names a server bound to `bind` answers: `names` (comma-separated; "*" for any) where given, else the
    loopback names when it listens on loopback only (so that a web page whose name resolves to 127.0.0.1, DNS
    rebinding, cannot read its replies), else any."""
    if names is not None:
        hosts = tuple(n.strip().lower().removeprefix("[").removesuffix("]") for n in names.split(",") if n.strip())
        if not hosts:
            raise InvalidArgumentError("--allowed-hosts needs at least one name (or * for any)")
        return None if "*" in hosts else hosts
    try:
        loopback = ipaddress.ip_address(bind).is_loopback
    except ValueError:
        loopback = bind.lower() == "localhost"
    return LOOPBACK_NAMES if loopback else None
