"""A checkpoint's chat template: messages -> the prompt text the model was trained to continue.

The template is the checkpoint's own (`chat_template` in tokenizer_config.json, or chat_template.jinja), rendered by
transformers' `apply_chat_template`, the renderer the template was written for. A checkpoint without one cannot
serve chat: guessing a format would feed the model text it never saw.
"""

from __future__ import annotations

import json
from pathlib import Path

from verispec.errors import CheckpointError, InvalidArgumentError

TEMPLATE_FILE = "chat_template.jinja"


def has_chat_template(folder: Path) -> bool:
    """Whether the checkpoint folder ships a chat template, read without loading a tokenizer."""
    if (folder / TEMPLATE_FILE).is_file():
        return True
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{config}: unreadable ({err})") from None


class ChatTemplate:
    """Renders a conversation with the checkpoint's template, ending where the assistant's reply begins."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer  # on demand: seconds to import, and only chat needs it

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as err:  # transformers raises many types for one broken folder
            raise CheckpointError(f"{folder}: cannot load the tokenizer that holds the chat template ({err})") from None

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text; a conversation the template refuses (roles out of order, say) is bad input."""
        from jinja2 import TemplateError

        try:
            return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as err:
            raise InvalidArgumentError(f"messages: the model's chat template refused them ({err})") from None


def load_chat_template(folder: Path) -> ChatTemplate | None:
    """The folder's chat template, or None where it has none (chat requests are then refused)."""
    return ChatTemplate(folder) if has_chat_template(folder) else None
