"""The engine's counters: what the server exports as metrics, and what the engine chose."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineMetrics:
    """Gauges (`running`, `waiting`, `last_k`, `last_batch`) and cumulative totals since the engine started."""

    running: int = 0  # sequences in the batch
    waiting: int = 0  # requests queued for a free slot
    finished: int = 0  # requests that ended (aborted and failed ones included)
    failed: int = 0  # requests that ended with an error of their own
    generated_tokens: int = 0
    target_calls: int = 0  # batched verification forwards: one per step, whatever the batch size (prefills excluded)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    decode_seconds: float = 0.0  # time spent in `step`, admissions and prefills included
    last_k: int = 0  # the draft length chosen for the last step (0: plain decoding)
    last_batch: int = 0  # sequences in the last step's forward
    steps_by_k: list[int] = field(default_factory=list)  # [k]: steps that drafted k tokens per sequence
    exact: bool = False  # each request's tokens are bitwise those it gets alone (batch-invariant forwards)
    kv_budget_bytes: int = 0  # the keys and values the running requests may hold together (engine/kv_budget.py)
    kv_reserved_bytes: int = 0  # what the running requests reserve of it
    kv_bytes: int = 0  # what the cache holds now

    def record_step(self, k: int, batch: int) -> None:
        self.last_k, self.last_batch = k, batch
        self.steps_by_k += [0] * (k + 1 - len(self.steps_by_k))
        self.steps_by_k[k] += 1
        self.target_calls += 1
