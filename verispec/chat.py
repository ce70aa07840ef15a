"""A conversation with a target: its messages rendered by the checkpoint's chat template, and the target's KV cache
kept across turns, so that a turn prefills only the tokens the cache does not hold yet.

Each turn renders the whole conversation and encodes it; the cache is cut back to the longest prefix it shares with
the tokens it was filled from (a reply re-encoded from its text may split differently from how it was generated,
and llama.cpp's server keeps its cache the same way), and `stream` prefills the rest.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Sequence

from verispec.detokenize import Piece
from verispec.drafters.base import Drafter
from verispec.errors import InvalidArgumentError
from verispec.generate import Generation, Stream, stream
from verispec.models.protocol import CausalLM

Messages = list[dict[str, str]]


class Chat:
    """`say(text)` streams the assistant's reply to one more user message; `reset()` starts over.

    `render(messages)` is the checkpoint's chat template (`verispec.checkpoints.chat_template.ChatTemplate.render`):
    the prompt text, ending where the assistant's reply begins, special tokens included. `options` are `stream`'s;
    without `max_new_tokens` a reply runs to the end of its turn (the room left in the context).
    """

    def __init__(
        self,
        target: CausalLM,
        render: Callable[[Messages], str],
        drafter: Drafter | None = None,
        *,
        system: str | None = None,
        **options: Any,
    ) -> None:
        self.target, self.render, self.drafter, self.options = target, render, drafter, options
        self.system = system
        width = 0 if drafter is None else drafter.width
        self.cache = target.new_cache(target.context_length + max(0, width - 1))
        self.reset()

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self.messages: Messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        self._cached: list[int] = []  # the tokens the cache was filled from, of which it holds the first `length`
        self.cache.truncate(0)

    def say(self, text: str) -> Stream:
        """Add a user message and stream the reply; once the stream ends (or is closed), the reply is part of the
        conversation."""
        if not isinstance(text, str) or not text:
            raise InvalidArgumentError("a chat message must be a non-empty string")
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.target.tokenizer.encode(self.render(messages), add_special_tokens=False).ids
        budget = self.options.get("max_new_tokens") or self.target.context_length  # None: to the end of the turn
        if len(ids) + 1 > self.target.context_length:
            raise InvalidArgumentError(
                f"the conversation has {len(ids)} tokens: no room left in the model's "
                f"context of {self.target.context_length}; /reset to start over"
            )
        self.cache.truncate(min(self.cache.length, _common(self._cached, ids), len(ids) - 1))
        options = self.options | {"max_new_tokens": min(budget, self.target.context_length - len(ids))}
        steps = stream(self.target, ids, self.drafter, cache=self.cache, **options)
        return Stream(self._turn(steps, messages, ids), steps.stats)

    def _turn(self, steps: Stream, messages: Messages, ids: list[int]) -> Generator[Piece, None, Generation]:
        """The reply's pieces; when the stream ends or is closed early (Ctrl-C), the reply joins the conversation
        and the cache is known to hold the tokens it was filled from."""
        pieces = []
        try:
            for piece in steps:
                pieces.append(piece.text)
                yield piece
        finally:
            steps.close()
            result = steps.result
            self.messages = [
                *messages,
                {"role": "assistant", "content": result.text if result is not None else "".join(pieces)},
            ]
            held = [*ids, *result.tokens] if result is not None else ids  # a closed stream's tokens are not known
            self.cache.truncate(min(self.cache.length, len(held) - 1))
            self._cached = held[: self.cache.length]
        return result


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
