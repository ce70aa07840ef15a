"""A smaller model drafts k tokens autoregressively, with its own KV cache; optionally a token tree, with the top-b
candidates (or b draws) at each of the first positions, and optionally among a reduced vocabulary of frequent tokens
(as in FR-Spec). A draft with another tokenizer than the target's drafts through a `Translation` (cross_vocab.py):
among the tokens both share (`IntersectionSession`, here) or by re-encoding its text (`ReencodeSession`)."""

from __future__ import annotations

from typing import Sequence

import torch

from verispec.argument_checks import whole_number
from verispec.checkpoints.draft_vocab import spread
from verispec.drafters.base import DraftContext, Needs, Proposal, Verdict
from verispec.drafters.cross_vocab import (
    INTERSECTION,
    REENCODE,
    DraftWindow,
    Translation,
    mismatch_error,
    same_tokenizer,
)
from verispec.drafters.draft_model_batch import DraftModelBatch
from verispec.drafters.options import FIXED_K, DraftOptions
from verispec.drafters.reencode import ReencodeSession
from verispec.errors import InvalidArgumentError, TokenizerMismatchError
from verispec.models.protocol import CausalLM
from verispec.retokenize import DraftText
from verispec.sampling import draw, logits_to_probs


def tree_size(k: int, branch: int, branch_depth: int) -> int:
    """Nodes of a tree k deep in which every node above depth `branch_depth` has `branch` children, the rest one."""
    return sum(branch ** min(d, branch_depth) for d in range(1, k + 1))


class DraftModel:
    """A drafter that runs `model`, a smaller model with the target's tokenizer (or another, through `translation`),
    with its own KV cache.

    With `branch` b > 1 it proposes a tree: every node at the first `branch_depth` depths gets b children
    (greedy: the draft's top-b tokens; sampling: b independent draws from its q, as SpecInfer's rule needs),
    deeper nodes one, down to depth k. Each depth is one draft forward over the whole frontier with a tree
    mask; after the verdict the accepted path's cache entries are moved into place and the rest dropped.

    `vocab` (token ids, most frequent first): propose only these tokens, by an LM head over them alone, on a model
    that runs one (`capabilities.vocab_heads`: the native runtime). On the shipped draft the head is most of the
    weights, and 2048 of its rows fit a core's L2 cache where all 8192 do not. The target still scores every token, so
    the output is unchanged; a token outside `vocab` is only never proposed.

    `translation` (`cross_vocab.translation_for`): a draft with another tokenizer drafts among the tokens both share
    (then `vocab` narrows them further) or, in chains, by re-encoding its text; the batched engine does not take it.
    """

    name = "draft"

    def __init__(
        self,
        model: CausalLM,
        k: int = FIXED_K,
        branch: int = DraftOptions.branch,
        branch_depth: int = DraftOptions.branch_depth,
        vocab: torch.Tensor | None = None,
        translation: Translation | None = None,
    ) -> None:
        k = whole_number(k, "k (tokens drafted per step)", 1)
        branch = whole_number(branch, "branch (candidates per tree node)", 1)
        branch_depth = whole_number(branch_depth, "branch_depth (depths that branch)", 1)
        if branch > 1 and not model.capabilities.tree_masks:
            raise InvalidArgumentError(
                f"branch > 1 drafts a token tree, which needs a draft model that takes tree "
                f"masks (the native runtime); {model.name} does not"
            )
        self.model, self.k, self.branch, self.branch_depth = model, k, branch, branch_depth
        self.translation = translation
        if translation is not None and translation.way == REENCODE and branch > 1:
            raise InvalidArgumentError(
                "vocab_map reencode proposes chains (branch 1); vocab_map intersection drafts trees"
            )
        if vocab is not None and not model.capabilities.vocab_heads:
            raise InvalidArgumentError(
                f"a draft vocabulary runs an LM head over part of the vocabulary, which the "
                f"native runtime does; {model.name} does not"
            )
        self.twins = None  # intersection: (draft ids it proposes among, their target ids)
        if translation is not None and translation.way == INTERSECTION:
            self.twins = translation.restrict(None if vocab is None else vocab.to(torch.int64))
            if not len(self.twins[0]):
                raise TokenizerMismatchError(
                    "no token of the draft vocabulary is shared with the target's; "
                    "draft_vocab 0 drafts among every shared token"
                )
            vocab = self.twins[0] if model.capabilities.vocab_heads else None  # (else: the full head, then indexed)
        # The LM head over `vocab` alone (which checks it), and its token ids
        self.head = None if vocab is None else model.vocab_head(vocab.to(device=model.device, dtype=torch.int64))
        self.vocab = None if self.head is None else self.head.ids
        self.width = tree_size(k, branch, branch_depth)
        self.needs = Needs(tree_masks=branch > 1)
        # A chain, on a model that batches; trees are verified through a per-sequence tree mask.
        self.batched = branch == 1 and model.capabilities.batching and translation is None

    def check(self, target: CausalLM) -> None:
        if self.translation is not None:
            self.translation.check(target)
        elif not same_tokenizer(target, self.model):
            vocabs = (m.tokenizer.get_vocab(with_added_tokens=True) for m in (target, self.model))
            if next(vocabs) == next(vocabs):  # one tokenizer, tables of different sizes
                raise TokenizerMismatchError(
                    f"draft {self.model.name} has {self.model.vocab_size} usable tokens, "
                    f"target {target.name} {target.vocab_size}"
                )
            raise mismatch_error(target, self.model, tree=self.branch > 1)

    def begin(self, context: DraftContext) -> DraftModelSession | ReencodeSession:
        if self.translation is None:
            return DraftModelSession(self, context)
        if self.translation.way == INTERSECTION:
            return IntersectionSession(self, context)
        return ReencodeSession(self.model, self.head, self.translation, self.k)

    def begin_batch(self, target: CausalLM, slots: int) -> DraftModelBatch:
        """Drafting for up to `slots` sequences of the batched engine at once (chains only: `batched`)."""
        return DraftModelBatch(self.model, slots, self.head)


class DraftModelSession:
    """The draft's cache holds the committed tokens it has seen plus its own proposals, minus the last one.

    After the target's verdict it rolls back to the accepted tokens; the target's correction (and
    the last proposal, when everything was accepted) is fed at the start of the next `propose`,
    in the same forward as the first draft step.
    """

    def __init__(self, drafter: DraftModel, context: DraftContext) -> None:
        self.model, self.k, self.width = drafter.model, drafter.k, drafter.width
        self.branch, self.branch_depth = drafter.branch, drafter.branch_depth
        self.vocab, self.head = drafter.vocab, drafter.head
        self.sampling, self.generator, self.grammar = context.sampling, context.generator, context.grammar
        self.cache = self.model.new_cache(self._cache_size(context))
        self._context_len = len(context.prompt)
        self._slots: dict[int, int] = {}  # tree node -> its entry's offset after the committed tokens

    def _cache_size(self, context: DraftContext) -> int:
        """As long as the target's (it fits prompt and answer), plus the width - k slots a tree's other branches
        take."""
        return min(self.model.context_length, context.cache.max_len) + self.width - self.k

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        ids = self._draft_context(context)
        self._context_len, self._slots = len(ids), {}
        # the cache must hold context + k - 1 tokens; a tree's other nodes above depth k fit in the width - k more
        k = min(k, self.cache.max_len - (self.width - self.k) - len(ids))
        if k < 1 or not ids:
            return Proposal([])
        unseen = torch.tensor([ids[self.cache.length :]], device=self.model.device)
        chain = self.sampling.greedy and self.branch == 1 and self.grammar is None  # (a grammar masks every draft)
        if chain and self.model.capabilities.greedy_chains:  # the model's own loop
            return Proposal(self._as_target(self.model.greedy_chain(unseen, self.cache, k, self.head)))
        logits = self._logits(unseen, self.cache, logits_to_keep=1)[0, -1]
        if self.branch > 1:
            return self._propose_tree(logits, k)
        tokens, q = [], []
        for i in range(k):
            if self.grammar is not None and (logits := self.grammar.constrain(logits, tokens)) is None:
                break  # nothing the grammar allows is in the draft's vocabulary
            token, q_i = draw(logits, self.sampling, self.generator)
            tokens.append(token)
            q += [] if q_i is None else [q_i]
            if i < k - 1:
                logits = self._logits(torch.tensor([[self._as_draft(token)]], device=self.model.device), self.cache)[
                    0, -1
                ]
        return Proposal(tokens, torch.stack(q) if q else None)

    def _draft_context(self, context: Sequence[int]) -> Sequence[int]:
        """The draft's tokens for the committed ones, the first `cache.length` of them in its cache: the same."""
        return context

    def _as_target(self, drafted: list[int]) -> list[int]:
        """The draft model's token ids as the target's (the same here)."""
        return drafted

    def _as_draft(self, token: int) -> int:
        """A proposed token as the draft model's input (the same here)."""
        return token

    def _logits(self, *args, **kwargs) -> torch.Tensor:
        """A draft forward's logits (..., V); over a draft vocabulary, by the LM head over it, -inf elsewhere."""
        if self.head is None:
            return self.model(*args, **kwargs)[..., : self.model.vocab_size]
        return spread(self.model(*args, head=self.head, **kwargs), self.vocab, self.model.vocab_size)

    def _propose_tree(self, root_logits: torch.Tensor, k: int) -> Proposal:
        """Grow the tree a depth at a time, from the logits at the last committed token (already in the cache)."""
        start, V = self._context_len, self.model.vocab_size if self.vocab is None else len(self.vocab)
        tokens: list[int] = []
        parents: list[int] = []
        qs: list[torch.Tensor] = []
        sees: dict[int, list[int]] = {-1: []}  # node -> cache offsets of its ancestors' entries
        paths: dict[int, list[int]] = {-1: []}  # node -> the tokens from the root to it (what the grammar follows)
        frontier, frontier_logits = [-1], root_logits[None]
        for d in range(1, k + 1):
            n = self.branch if d <= self.branch_depth else 1
            children = []
            for parent, logits in zip(frontier, frontier_logits):
                if self.grammar is not None and (logits := self.grammar.constrain(logits, paths[parent])) is None:
                    continue  # no child the grammar allows is in the draft's vocabulary
                if self.sampling.greedy:  # distinct candidates; q stays one-hot, as greedy verification needs
                    best = logits.topk(min(n, V))
                    picks, q = best.indices[best.values > -torch.inf].tolist(), None  # (the grammar may allow fewer)
                else:  # independent draws from q: SpecInfer's rule is lossless for exactly these
                    q = logits_to_probs(logits, self.sampling)
                    picks = torch.multinomial(q, n, replacement=True, generator=self.generator).tolist()
                for token in picks:
                    paths[len(tokens)] = [*paths[parent], token]
                    children.append(len(tokens))
                    tokens.append(token)
                    parents.append(parent)
                    if q is not None:
                        qs.append(q)
            if d == k or not children:
                break
            # Nodes below an end-of-sequence token too: the loop drops them and tells the verdict in our numbering.
            frontier, frontier_logits = children, self._score(children, tokens, parents, sees, start, d)
        return Proposal(tokens, torch.stack(qs) if qs else None, parents)

    def _score(
        self, frontier: list[int], tokens: list[int], parents: list[int], sees: dict[int, list[int]], start: int, d: int
    ) -> torch.Tensor:
        """One draft forward over the frontier (all at depth d): each sees the committed tokens, its
        ancestors and itself. Returns their logits (len(frontier), V)."""
        T, length = len(frontier), self.cache.length
        mask = torch.zeros(T, length + T, dtype=torch.bool)
        mask[:, :start] = True
        for row, node in enumerate(frontier):
            parent = parents[node]
            sees[node] = sees[parent] + ([self._slots[parent]] if parent >= 0 else [])
            mask[row, [start + s for s in sees[node]]] = True
            mask[row, length + row] = True
            self._slots[node] = length - start + row
        device = self.model.device
        x = torch.tensor([[self._as_draft(tokens[node]) for node in frontier]], device=device)
        positions = torch.full((T,), start - 1 + d, device=device)
        return self._logits(x, self.cache, mask.to(device), positions)[0]

    def accepted(self, verdict: Verdict) -> None:
        if self.branch == 1:
            self.cache.truncate(min(self.cache.length, self._context_len + verdict.num_accepted))
            return
        # Every accepted node but the last has children, so it was scored; the last may not have been.
        offsets = [self._slots[i] for i in verdict.path if i in self._slots]
        if offsets:
            self.cache.keep(self._context_len, offsets)
        else:
            self.cache.truncate(min(self.cache.length, self._context_len))


class IntersectionSession(DraftModelSession):
    """Drafting among the tokens both vocabularies share (vocab_map intersection): the draft reads the committed text
    re-encoded in its tokens (`DraftText`, within its context length) and proposes the target's ids of the shared
    tokens. Its logits are spread over the target's vocabulary, -inf at every token it does not share, so q is its
    distribution restricted to the shared tokens and renormalised, over the target's ids: each proposal a draw from
    that q, which the target's rule (and a grammar's mask) take as they take any draft's."""

    def __init__(self, drafter: DraftModel, context: DraftContext) -> None:
        super().__init__(drafter, context)
        translation, (self.among, self.proposes) = drafter.translation, drafter.twins
        self.target_vocab = context.target.vocab_size
        self.twin_of = dict(zip(self.proposes.tolist(), self.among.tolist()))  # target id -> draft id
        self.target_of = torch.full((self.model.vocab_size,), -1, dtype=torch.int64)
        self.target_of[self.among] = self.proposes
        self.vocab = self.among  # what a tree's top-b is taken among
        self.proposes = self.proposes.to(self.model.device)
        self.among = self.among.to(self.model.device)
        self.window = DraftWindow(
            DraftText(translation.target.table, translation.draft), self.cache.max_len - self.width - 1
        )
        self._proposal, self._ids = Proposal([]), []

    def _cache_size(self, context: DraftContext) -> int:
        return self.model.context_length  # the window keeps the draft's tokens within it, whatever the target's

    def _draft_context(self, context: Sequence[int]) -> Sequence[int]:
        self._ids = self.window.sync(self.cache, context)
        return self._ids

    def _as_target(self, drafted: list[int]) -> list[int]:
        return self.target_of[drafted].tolist()

    def _as_draft(self, token: int) -> int:
        return self.twin_of[token]

    def _logits(self, *args, **kwargs) -> torch.Tensor:
        """A draft forward's logits over the target's vocabulary (..., target V), -inf at the tokens not shared."""
        if self.head is not None:
            shared = self.model(*args, head=self.head, **kwargs)
        else:
            shared = self.model(*args, **kwargs)[..., self.among]
        return spread(shared, self.proposes, self.target_vocab)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        self._proposal = super().propose(context, k)
        return self._proposal

    def accepted(self, verdict: Verdict) -> None:
        super().accepted(verdict)  # the cache: the draft's context, then the accepted path's tokens it has seen
        path = [self.twin_of[self._proposal.tokens[i]] for i in verdict.path]
        self.window.fed = (self._ids + path)[: self.cache.length]
