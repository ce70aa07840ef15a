"""The counters decoding keeps: one generation's (`GenerationStats`: tokens, target calls, acceptance by position,
where the time went) and the batched engine's (`EngineMetrics`: its gauges and totals since it started); and the
process's peak resident memory (`peak_resident_bytes`).

The rest is read from these: serve/metrics.py exports the engine's and each finished request's as Prometheus
metrics, and bench/summary.py turns a bench run's records into the report's numbers."""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass, field


def peak_resident_bytes() -> int:
    """This process's peak resident memory since it started, in bytes (Linux's ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_calls: int = 0  # verification forwards (one per step), prefill excluded
    drafter_calls: int = 0  # propose() calls
    proposed: int = 0
    accepted: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    steps_by_depth: list[int] = field(default_factory=list)  # [d]: target calls that verified a proposal d deep
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0

    def record_step(self, proposed: int, accepted: int) -> None:
        self.steps_by_depth += [0] * (proposed + 1 - len(self.steps_by_depth))
        self.steps_by_depth[proposed] += 1
        for i in range(proposed):
            self.record_position(i, 1, i < accepted)
        self.proposed += proposed
        self.accepted += accepted

    def record_position(self, i: int, proposed: int, accepted: int) -> None:
        """Add to the counts of draft position i (0-based) only."""
        grow = i + 1 - len(self.proposed_by_position)
        if grow > 0:
            self.proposed_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        self.proposed_by_position[i] += proposed
        self.accepted_by_position[i] += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per target call, the correction or bonus token included."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p for a, p in zip(self.accepted_by_position, self.proposed_by_position)]

    @property
    def other_time(self) -> float:
        return max(0.0, self.total_time - self.prefill_time - self.draft_time - self.verify_time)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time else 0.0

    def line(self) -> str:
        """One line for a person: speed, tau and acceptance (a chat turn's, a served request's)."""
        line = f"[{self.new_tokens} tokens, {self.tokens_per_second:.1f} tok/s, tau {self.tau:.2f}"
        return line + (f", acceptance {self.acceptance_rate:.0%}]" if self.drafter_calls else "]")

    def to_dict(self) -> dict:
        derived = ("acceptance_rate", "tau", "acceptance_by_position", "other_time", "tokens_per_second")
        return asdict(self) | {name: getattr(self, name) for name in derived}


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
