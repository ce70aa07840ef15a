"""Running the app under uvicorn: in the foreground with a graceful shutdown (`verispec serve`), or on a thread
(tests, `verispec bench-serve`).

On SIGINT or SIGTERM uvicorn stops accepting connections and waits for the open ones; the worker lets in-flight
requests finish for `grace` seconds and then ends them (their streams close with finish_reason "abort" and [DONE]),
so every client gets a complete response. Connections still open `SHUTDOWN_MARGIN` seconds after the grace (a client
that never reads its stream) are closed. A second Ctrl-C quits at once.
"""

from __future__ import annotations

import copy
import signal
import threading
import time
from types import FrameType

import uvicorn
import uvicorn.config
from fastapi import FastAPI

from verispec.argument_checks import whole_number
from verispec.errors import InvalidArgumentError
from verispec.serve.options import SHUTDOWN_MARGIN


class GracefulServer(uvicorn.Server):
    """uvicorn's server, telling the engine worker to drain when asked to exit."""

    def __init__(self, config: uvicorn.Config, grace: float) -> None:
        super().__init__(config)
        self.grace = grace

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self.config.app.state.worker.drain(self.grace)

    @property
    def port(self) -> int:
        """The port it listens on (the one the OS chose, where asked for port 0)."""
        return self.servers[0].sockets[0].getsockname()[1]


def check_server_options(port: int, grace: float, max_batch: int) -> None:
    """`verispec serve`'s own options, checked before any model loads."""
    if not 0 <= port < 65536:
        raise InvalidArgumentError(f"--port must be in [0, 65535], got {port}")
    if not grace >= 0:  # also refuses nan
        raise InvalidArgumentError(f"--shutdown-grace must be >= 0 seconds, got {grace}")
    whole_number(max_batch, "--max-batch", 1)


def _config(
    app: FastAPI, host: str, port: int, log_level: str, grace: float, log_config: dict = uvicorn.config.LOGGING_CONFIG
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=grace + SHUTDOWN_MARGIN,
        log_config=log_config,
    )


def run_server(app: FastAPI, host: str, port: int, grace: float) -> None:
    """Serve in the foreground until SIGINT/SIGTERM, logging each finished request's speed, tau and acceptance
    beside uvicorn's own lines."""
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["loggers"]["verispec.serve"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    GracefulServer(_config(app, host, port, "info", grace, log_config), grace).run()


class ServerThread:
    """The app served on a thread, at 127.0.0.1 on a free port: `with ServerThread(app) as server: server.url`."""

    def __init__(self, app: FastAPI, grace: float = 0.0, log_level: str = "warning") -> None:
        self.server = GracefulServer(_config(app, "127.0.0.1", 0, log_level, grace), grace)
        self._thread = threading.Thread(target=self.server.run, name="verispec-uvicorn", daemon=True)
        self.url = ""  # set once it listens

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.port}"
        return self

    def shutdown(self, timeout: float = 60.0) -> None:
        """What SIGTERM does: drain, finish or end in-flight requests, stop; waits for the thread."""
        self.server.handle_exit(signal.SIGTERM, None)
        self._thread.join(timeout)

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
