"""The one thread that runs the engine: requests come in through a thread-safe queue, updates go back to the asyncio
loop with `call_soon_threadsafe`, so no HTTP handler ever waits on a model.

The engine is single-threaded by contract: only this thread calls `add`, `abort` and `step`. A handler submits a
`Ticket` and reads its `updates` queue: `Update`s, or one exception (the engine refused the request, or a step
failed), after which nothing more comes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from verispec.engine.engine import Engine
from verispec.engine.metrics import EngineMetrics
from verispec.engine.request import Request, Update

log = logging.getLogger("verispec.serve")


@dataclass(eq=False)
class Ticket:
    """One submitted request, as its handler sees it."""

    request: Request
    loop: asyncio.AbstractEventLoop
    observe: Callable[[Update | Exception], None]  # sees every item, also those of a request whose client is gone
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    engine_id: int | None = None  # set by the worker once the engine took it

    def receive(self, item: Update | Exception) -> None:
        """Runs on the event loop's thread."""
        self.observe(item)
        self.updates.put_nowait(item)


@dataclass(frozen=True)
class Snapshot:
    """The engine's counters after the worker's latest step, plus requests not yet handed to the engine."""

    metrics: EngineMetrics
    queued: int


class EngineFailure(Exception):
    """The engine failed while running a request (the worker logged why); answered with a 500, the server goes on."""


class EngineWorker:
    """Owns the engine and the thread that drives it; `start`, `submit`, `abort`, `drain`, `stop`."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, Ticket | None]] = queue.SimpleQueue()
        self._live: dict[int, Ticket] = {}  # engine id -> ticket; touched by the worker thread only
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        self._drain_at: float | None = None  # monotonic time at which in-flight requests are ended
        self._beat = time.monotonic()  # when the thread last went round its loop
        self._idle = True  # waiting for a command with nothing to step
        self.snapshot = Snapshot(dataclasses.replace(engine.metrics), 0)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stalled_for(self) -> float:
        """Seconds the thread has been inside one step (or a prefill) while it had work; 0 while it waits idle."""
        return 0.0 if self._idle else time.monotonic() - self._beat

    def submit(self, request: Request, observe: Callable[[Update], None]) -> Ticket:
        """Queue a request (from the event loop's thread); its updates arrive on the ticket, each seen first by
        `observe`."""
        ticket = Ticket(request, asyncio.get_running_loop(), observe)
        self._inbox.put(("add", ticket))
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """End the request at the engine's next step (its client went away); safe after it finished."""
        self._inbox.put(("abort", ticket))

    def drain(self, grace: float) -> None:
        """Let in-flight requests run for `grace` more seconds, then end them (finish_reason "abort").

        Only sets a number, so a signal handler may call it while the thread it interrupted holds any lock.
        """
        deadline = time.monotonic() + grace  # a second signal never moves an earlier deadline later
        self._drain_at = deadline if self._drain_at is None else min(self._drain_at, deadline)

    def stop(self, timeout: float = 10.0) -> None:
        """End every request and the thread."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    def _run(self) -> None:
        stopping = False
        while not (stopping and not self._engine.has_work):
            idle = not self._engine.has_work
            while True:  # every command waiting now; block for one only when there is nothing to step
                self._idle = idle and not stopping
                try:
                    command, ticket = self._inbox.get(block=self._idle)
                except queue.Empty:
                    break
                finally:
                    self._beat, self._idle = time.monotonic(), False
                idle = False
                if command == "stop":
                    stopping = True
                    self._end_all()
                elif command == "add":
                    self._add(ticket, stopping)
                elif self._live.get(ticket.engine_id) is ticket:  # still running (not failed, not finished)
                    self._engine.abort(ticket.engine_id)
            if self._drain_at is not None and time.monotonic() >= self._drain_at:
                self._end_all()
            if self._engine.has_work:
                self._step()
            self._beat = time.monotonic()
            self.snapshot = Snapshot(dataclasses.replace(self._engine.metrics), self._inbox.qsize())

    def _add(self, ticket: Ticket, stopping: bool) -> None:
        if stopping:
            self._deliver(ticket, RuntimeError("the server is shutting down"))
            return
        try:
            ticket.engine_id = self._engine.add(ticket.request)
        except Exception as err:  # the engine refused it (a VerispecError), or failed on it: that request only
            self._deliver(ticket, err)
            return
        self._live[ticket.engine_id] = ticket

    def _step(self) -> None:
        try:
            updates = self._engine.step()
        except Exception as err:  # a bug or a drafter breaking its protocol: fail what is in flight, keep serving
            # The engine rolled every slot back to its committed tokens (and put joining requests back in its queue),
            # so it serves on; the requests it was running end here, as the server's failure (a 500), not bad input.
            log.exception("engine step failed; ending the %d requests in flight", len(self._live))
            failure = EngineFailure(f"generation failed: {type(err).__name__}: {err}")
            for engine_id, ticket in self._live.items():
                self._engine.abort(engine_id)
                self._deliver(ticket, failure)
            self._live.clear()
            return
        for update in updates:
            ticket = self._live.get(update.request_id)
            if update.error is not None:  # that request's own failure (logged here); the others went on
                log.error("request %d failed", update.request_id, exc_info=update.error)
            if update.finished:
                self._live.pop(update.request_id, None)
                if update.error is None:  # the server's log, before the client has its answer: what chat prints
                    log.info("request %d (%s): %s", update.request_id, update.finish_reason, update.stats.line())
            if ticket is not None:
                self._deliver(
                    ticket,
                    update
                    if update.error is None
                    else EngineFailure(f"generation failed: {type(update.error).__name__}: {update.error}"),
                )

    def _end_all(self) -> None:
        for engine_id in self._live:
            self._engine.abort(engine_id)

    @staticmethod
    def _deliver(ticket: Ticket, item: Update | Exception) -> None:
        try:
            ticket.loop.call_soon_threadsafe(ticket.receive, item)
        except RuntimeError:  # the loop is closed: the server is gone, and nobody waits for this
            pass
