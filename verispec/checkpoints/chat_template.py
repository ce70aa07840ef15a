"""A checkpoint's chat template: messages -> the prompt text the model was trained to continue.

The template is the checkpoint's own (`chat_template` in tokenizer_config.json, or chat_template.jinja, in a folder;
`tokenizer.chat_template` in a GGUF file), rendered by transformers' `apply_chat_template`, the renderer the template
was written for. A checkpoint without one cannot serve chat: guessing a format would feed the model text it never
saw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verispec.checkpoints.gguf_file import GGUFFile, is_gguf
from verispec.checkpoints.gguf_tokenizer import GGUFVocab, read_vocab
from verispec.errors import CheckpointError, InvalidArgumentError

TEMPLATE_FILE = "chat_template.jinja"
WHERE_TEMPLATES_LIVE = (
    "no chat_template in its tokenizer_config.json, no chat_template.jinja; in a GGUF file, no "
    "tokenizer.chat_template"
)  # what a checkpoint without a template lacks


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
    """Renders a conversation with the checkpoint's template, ending where the assistant's reply begins.
    `tokenizer` is the transformers tokenizer that holds it (`from_folder`, `from_gguf`)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_folder(cls, folder: Path) -> ChatTemplate:
        from transformers import AutoTokenizer  # on demand: seconds to import, and only chat needs it

        try:
            return cls(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
        except Exception as err:  # transformers raises many types for one broken folder
            raise CheckpointError(f"{folder}: cannot load the tokenizer that holds the chat template ({err})") from None

    @classmethod
    def from_gguf(cls, vocab: GGUFVocab) -> ChatTemplate:
        """A GGUF file's template, with its special tokens by the names a template uses (`bos_token`, ...)."""
        from transformers import PreTrainedTokenizerFast

        return cls(
            PreTrainedTokenizerFast(
                tokenizer_object=vocab.tokenizer, chat_template=vocab.chat_template, **vocab.special_tokens
            )
        )

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text; a conversation the template refuses (roles out of order, say) is bad input."""
        from jinja2 import TemplateError

        try:
            return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as err:
            raise InvalidArgumentError(f"messages: the model's chat template refused them ({err})") from None


def load_chat_template(checkpoint: Path) -> ChatTemplate | None:
    """The chat template of a checkpoint folder or GGUF file, or None where it has none (chat requests are then
    refused)."""
    if is_gguf(checkpoint):
        vocab = read_vocab(GGUFFile(checkpoint))
        return ChatTemplate.from_gguf(vocab) if vocab.chat_template else None
    return ChatTemplate.from_folder(checkpoint) if has_chat_template(checkpoint) else None
