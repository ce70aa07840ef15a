"""A draft model with another tokenizer than the target's: the two ways it can draft, and which applies.

intersection (token-level intersection, TLI; Timor et al. 2025, vLLM's heterogeneous vocabularies): the draft
    proposes only tokens both vocabularies share, each as the target's id for the same bytes. Its q over the target's
    vocabulary is its own distribution restricted to the shared tokens and renormalised (zero elsewhere), and each
    proposal is a draw from exactly that q, so speculative sampling's rule keeps every output token distributed as
    under the target; greedy decoding takes the draft's argmax among the shared tokens. Chains and trees.
reencode (universal assisted decoding, UAD; transformers' assistant with its own tokenizer): the draft writes text
    in its own tokens, greedily; the text is encoded with the target's tokenizer and proposed up to where more text
    could still change its tokens. Greedy decoding stays exact, as with any proposal. Under sampling the proposal is
    a guess the committed text fixes (as prompt lookup's is) and is verified with a one-hot q: accepted with
    probability p(x), else the next token drawn from p without x, which again keeps every output token distributed
    as under the target; the draft's own probabilities, over its tokens, are not used, since no q over the target's
    tokens follows from them. Chains only.

In both ways the draft reads the committed text in its own tokens (`DraftText`), within its context length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from tokenizers import Tokenizer

from verispec.errors import InvalidArgumentError, TokenizerMismatchError
from verispec.models.protocol import CausalLM, SequenceCache
from verispec.retokenize import DraftText, Encoder
from verispec.vocab_map import VocabMap, shared_tokens, token_table

INTERSECTION, REENCODE, AUTO = "intersection", "reencode", "auto"
WAYS = (INTERSECTION, REENCODE, AUTO)


def same_tokenizer(target: CausalLM, draft: CausalLM) -> bool:
    """Whether both map text to ids identically and score the same ids (speculation can then compare ids)."""
    return target.vocab_size == draft.vocab_size and target.tokenizer.get_vocab(
        with_added_tokens=True
    ) == draft.tokenizer.get_vocab(with_added_tokens=True)


@dataclass(frozen=True)
class Translation:
    """How a draft with its own tokenizer drafts for targets with one tokenizer: `way` (INTERSECTION or REENCODE),
    both tokenizers' tables, and the tokens they share."""

    way: str
    target_tokenizer: Tokenizer
    target: Encoder
    draft: Encoder
    shared: VocabMap

    def check(self, target: CausalLM) -> None:
        """Refuse a target with another tokenizer than the one this translation was built for."""
        if target.tokenizer is not self.target_tokenizer and (
            target.vocab_size != self.shared.target_size
            or target.tokenizer.get_vocab(with_added_tokens=True)
            != self.target_tokenizer.get_vocab(with_added_tokens=True)
        ):
            raise TokenizerMismatchError(
                f"the draft's vocab_map {self.way} was built for another tokenizer than {target.name}'s"
            )

    def restrict(self, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft ids, their target twins) the intersection drafts among: the shared tokens, or those of the draft
        vocabulary `vocab` (most frequent first) that are shared, in its order."""
        if vocab is None:
            return self.shared.draft_ids, self.shared.target_ids
        twin = torch.full((self.shared.draft_size,), -1, dtype=torch.int64)
        twin[self.shared.draft_ids] = self.shared.target_ids
        kept = vocab[twin[vocab] >= 0]
        return kept, twin[kept]

    def proposal(self, drafted: Sequence[int]) -> list[int]:
        """The target's tokens for the draft's text `drafted` (reencode): up to a control token of the draft, which
        ends its text, or else the tokens the text has in common with itself less its last draft token (more text
        could re-merge those at the end)."""
        special = self.draft.table.special
        cut = next((i for i, t in enumerate(drafted) if t in special), None)
        if cut is not None:
            return self.target.encode(self.draft.bytes_of(drafted[:cut]))
        whole = self.target.encode(self.draft.bytes_of(drafted))
        shorter = self.target.encode(self.draft.bytes_of(drafted[:-1]))
        n = next((i for i, (a, b) in enumerate(zip(whole, shorter)) if a != b), min(len(whole), len(shorter)))
        return whole[:n]


class DraftWindow:
    """What the draft's cache holds of the committed text re-encoded in its tokens (`fed`, which the session keeps
    up to date as it feeds proposals), and at most `limit` tokens of it: past that the draft reads the last half of
    its limit only, from position 0 again (a fresh cache), so that a long generation keeps drafting."""

    def __init__(self, text: DraftText, limit: int) -> None:
        self.text, self.limit = text, max(1, limit)
        self.offset = 0  # the first token of text.ids the draft reads
        self.fed: list[int] = []

    def sync(self, cache: SequenceCache, context: Sequence[int]) -> list[int]:
        """The draft's tokens for `context` (committed target tokens), within the window; the cache cut back to what
        it holds of them, at least their last one left unseen (its logits are the first draft step's)."""
        same = self.text.update(context) - self.offset
        ids = self.text.ids
        if len(ids) - self.offset > self.limit:
            self.offset, same, self.fed = len(ids) - self.limit // 2, 0, []
        ids = ids[self.offset :]
        i, n = max(0, min(same, len(self.fed))), min(len(self.fed), len(ids))
        while i < n and self.fed[i] == ids[i]:
            i += 1
        cache.truncate(max(0, min(i, len(ids) - 1, cache.length)))
        self.fed = ids[: cache.length]
        return ids


def _tables(target: CausalLM, draft: CausalLM) -> tuple[Encoder, Encoder, VocabMap]:
    t, d = (token_table(model.tokenizer) for model in (target, draft))
    for model, table in ((target, t), (draft, d)):
        if table is None:
            raise TokenizerMismatchError(
                f"draft {draft.name} and target {target.name} use different tokenizers, and neither vocab_map applies: "
                f"{model.name}'s tokenizer is neither byte-level nor SentencePiece-style, so its tokens cannot be read "
                "back as text byte for byte (only a draft with the target's own tokenizer drafts for it)"
            )
    return (
        Encoder(target.tokenizer, t),
        Encoder(draft.tokenizer, d),
        shared_tokens(t, d, target.vocab_size, draft.vocab_size),
    )


def _applies(shared: VocabMap, tree: bool) -> dict[str, str]:
    """way -> why it does not apply here ("" where it does)."""
    return {
        INTERSECTION: "" if len(shared) else "the vocabularies share no token",
        REENCODE: "re-encoded text is proposed as a chain, and branch > 1 asks for a tree" if tree else "",
    }


def _ways_line(shared: VocabMap, tree: bool) -> str:
    """What a mismatch error says would work."""
    share = len(shared) / shared.target_size
    says = {
        INTERSECTION: "vocab_map intersection (--vocab-map intersection) would draft among the "
        f"{len(shared)} tokens both share ({share:.1%} of the target's {shared.target_size}), lossless under greedy "
        "decoding and sampling",
        REENCODE: "vocab_map reencode (--vocab-map reencode) would re-encode the draft's greedy text into the "
        "target's tokens (chains; lossless under greedy decoding and, as a one-hot guess, sampling)",
    }
    why = _applies(shared, tree)
    usable = [says[way] for way in (INTERSECTION, REENCODE) if not why[way]]
    return "; ".join(usable) if usable else "neither vocab_map applies: " + "; ".join(why.values())


def mismatch_error(target: CausalLM, draft: CausalLM, tree: bool = False) -> TokenizerMismatchError:
    """The error for a draft whose tokenizer differs from the target's, saying which vocab_map would draft."""
    head = (
        f"draft {draft.name} and target {target.name} use different tokenizers "
        f"({draft.tokenizer.get_vocab_size()} vs {target.tokenizer.get_vocab_size()} tokens)"
    )
    try:
        _, _, shared = _tables(target, draft)
    except TokenizerMismatchError as err:
        return err
    return TokenizerMismatchError(f"{head}; {_ways_line(shared, tree)}")


def translation_for(target: CausalLM, draft: CausalLM, way: str, tree: bool = False) -> Translation | None:
    """How `draft` drafts for `target` by `way`: INTERSECTION or REENCODE as asked (also for a draft with the
    target's own tokenizer), or AUTO: none for the same tokenizer, else the intersection where the vocabularies
    share tokens, else re-encoding. `tree`: the proposals are trees (branch > 1), which re-encoding does not make.
    A way that does not apply is a TokenizerMismatchError that says which would."""
    if way not in WAYS:
        raise InvalidArgumentError(f"vocab_map must be one of {', '.join(WAYS)}, got {way!r}")
    if way == AUTO and same_tokenizer(target, draft):
        return None
    t, d, shared = _tables(target, draft)
    why = _applies(shared, tree)
    if way == AUTO:
        way = next((w for w in (INTERSECTION, REENCODE) if not why[w]), None)
        if way is None:
            raise TokenizerMismatchError(
                f"draft {draft.name} and target {target.name} use different tokenizers; {_ways_line(shared, tree)}"
            )
    elif why[way]:
        raise TokenizerMismatchError(
            f"vocab_map {way} does not apply to draft {draft.name} and target {target.name}: "
            f"{why[way]}; {_ways_line(shared, tree)}"
        )
    return Translation(way, target.tokenizer, t, d, shared)
