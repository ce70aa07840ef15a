"""A checkpoint's chat template: messages -> the prompt text the model was trained to continue.

The template is the checkpoint's own (`chat_template` in tokenizer_config.json, or chat_template.jinja, in a folder;
`tokenizer.chat_template` in a GGUF file), or one the user gives in its place (`--chat-template FILE`, as vLLM's
option and llama.cpp's `--chat-template-file`: for a file shipped without one, as llama.cpp's Gemma 3 files are),
rendered by transformers' `apply_chat_template`, the renderer the template was written for. A checkpoint without one,
given none, cannot serve chat: guessing a format would feed the model text it never saw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from verispec.checkpoints.gguf_file import GGUFFile, is_gguf
from verispec.checkpoints.gguf_tokenizer import chat_metadata, read_vocab
from verispec.errors import CheckpointError, InvalidArgumentError

TEMPLATE_FILE = "chat_template.jinja"
WHERE_TEMPLATES_LIVE = (
    "no chat_template in its tokenizer_config.json, no chat_template.jinja; in a GGUF file, no "
    "tokenizer.chat_template"
)  # what a checkpoint without a template lacks


def has_chat_template(checkpoint: Path) -> bool:
    """Whether the checkpoint folder or GGUF file ships a chat template, read without building a tokenizer."""
    if is_gguf(checkpoint):
        return bool(GGUFFile(checkpoint).get("tokenizer.chat_template", str))
    if (checkpoint / TEMPLATE_FILE).is_file():
        return True
    config = checkpoint / "tokenizer_config.json"
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
    def from_folder(cls, folder: Path, template: str | None = None) -> ChatTemplate:
        """A folder's template (`template`: this one instead), held by its transformers tokenizer."""
        from transformers import AutoTokenizer  # on demand: seconds to import, and only chat needs it

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as err:  # transformers raises many types for one broken folder
            raise CheckpointError(f"{folder}: cannot load the tokenizer that holds the chat template ({err})") from None
        if template is not None:
            tokenizer.chat_template = template
        return cls(tokenizer)

    @classmethod
    def from_gguf(cls, tokenizer: Tokenizer, special_tokens: dict[str, str], template: str) -> ChatTemplate:
        """A GGUF file's template, with its special tokens by the names a template uses (`bos_token`, ...), held by
        (a copy of) the file's tokenizer."""
        from transformers import PreTrainedTokenizerFast

        return cls(PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=template, **special_tokens))

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text; a conversation the template refuses (roles out of order, say) is bad input."""
        from jinja2 import TemplateError

        try:
            return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as err:
            raise InvalidArgumentError(f"messages: the model's chat template refused them ({err})") from None


def read_template(path: str | Path) -> str:
    """A chat template's Jinja text from its file (`--chat-template FILE`)."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # (an editor's byte-order mark is no part of it)
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidArgumentError(f"--chat-template {path}: unreadable ({err})") from None
    if not text.strip():
        raise InvalidArgumentError(f"--chat-template {path}: the file is empty")
    return text


def load_chat_template(
    checkpoint: Path, tokenizer: Tokenizer | None = None, template: str | None = None
) -> ChatTemplate | None:
    """The chat template of a checkpoint folder or GGUF file, or `template` (Jinja text) in its place; None where it
    has none and none is given (chat requests are then refused). `tokenizer`: the one a model loaded from the GGUF
    file already holds (`model.tokenizer`), taken instead of building the file's tokenizer a second time (the
    template and special tokens are then read from its metadata alone); a folder's template comes with its own
    transformers tokenizer either way."""
    if is_gguf(checkpoint):
        file = GGUFFile(checkpoint)
        if tokenizer is None:
            vocab = read_vocab(file)
            tokenizer, special_tokens, own = vocab.tokenizer, vocab.special_tokens, vocab.chat_template
        else:
            special_tokens, own = chat_metadata(file)
        template = template or own
        return ChatTemplate.from_gguf(tokenizer, special_tokens, template) if template else None
    if template is None and not has_chat_template(checkpoint):
        return None
    return ChatTemplate.from_folder(checkpoint, template)
