"""Response bodies and server-sent-event chunks in the OpenAI API's shapes, for completions and for chat.

Streams follow the API: `data: {json}\\n\\n` chunks, finish_reason on the last choice chunk, then (with
`stream_options.include_usage`) one chunk with empty choices and the usage, then `data: [DONE]\\n\\n`. verispec's
own numbers (acceptance, tau) ride in an extra top-level field, `verispec`, of the full response and of the chunk
that carries the finish_reason.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from verispec.stats import GenerationStats

# The engine's reasons in the API's words; "abort" (vLLM's word) for a request the server ended at shutdown.
FINISH_REASONS = {
    "eos": "stop",
    "stop_string": "stop",
    "max_new_tokens": "length",
    "context_length": "length",
    "aborted": "abort",
}
DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def verispec_stats(stats: GenerationStats, exact: bool) -> dict:
    """The request's speculation numbers: acceptance of drafted tokens and tau (tokens per target call); and whether
    its tokens are bitwise those it gets alone (`exact`)."""
    return {
        "acceptance_rate": stats.acceptance_rate,
        "tau": stats.tau,
        "target_calls": stats.target_calls,
        "drafted_tokens": stats.proposed,
        "accepted_tokens": stats.accepted,
        "exact": exact,
    }


@dataclass(frozen=True)
class Reply:
    """One response's identity and shape: `kind` "completion" (choices[].text) or "chat" (message / delta)."""

    kind: Literal["completion", "chat"]
    model: str
    exact: bool  # its tokens are bitwise those the request gets alone
    include_usage: bool = False  # streams only: every chunk has "usage" (null but in the last one)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict:
        if self.kind == "completion":
            return {"id": f"cmpl-{self.id}", "object": "text_completion", "created": self.created, "model": self.model}
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": f"chatcmpl-{self.id}", "object": kind, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, counts: dict, stats: GenerationStats) -> dict:
        """The non-streamed response."""
        choice = {"index": 0, "logprobs": None, "finish_reason": FINISH_REASONS[finish_reason]}
        if self.kind == "completion":
            choice["text"] = text
        else:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        return self._head(False) | {"choices": [choice], "usage": counts, "verispec": verispec_stats(stats, self.exact)}

    def role_chunk(self) -> str:
        """Chat streams open with the assistant's role and empty content, as the API's do."""
        return self._chunk(
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        )

    def text_chunk(self, text: str, finish_reason: str | None = None, stats: GenerationStats | None = None) -> str:
        """Newly final text; the last one carries the finish_reason and verispec's stats."""
        reason = None if finish_reason is None else FINISH_REASONS[finish_reason]
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason}
        return self._chunk(choice, {} if stats is None else {"verispec": verispec_stats(stats, self.exact)})

    def usage_chunk(self, counts: dict) -> str:
        return sse(self._head(True) | {"choices": [], "usage": counts})

    def _chunk(self, choice: dict, extra: dict | None = None) -> str:
        body = self._head(True) | {"choices": [choice]} | (extra or {})
        if self.include_usage:
            body["usage"] = None
        return sse(body)
