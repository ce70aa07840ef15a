"""EAGLE drafting (Li et al. 2024): a one-layer head autoregresses on the target's own features.

The loop hands the session the target's final-normed feature f_i of every committed token but the last. The head
reads (f_i, embedding of x_{i+1}) and predicts f_{i+1}, whose logits (through the target's LM head) give the next
draft token; drafting goes on from its own predicted features. The head keeps a KV cache over the committed
positions only: entries built from predicted features are cut after every verdict, and the true features that the
verdict brings are fed at the next proposal.

With `tree=(top_k, total)` it drafts EAGLE-2's dynamic tree instead of a chain: from the root, each of k depths
expands the `top_k` frontier nodes with the highest product of draft probabilities (one head forward for the
whole frontier, through a tree mask over the head's cache), each proposing its own `top_k` best children; then
every node drawn is reranked by that product and the best `total` (ancestors rank above their descendants) go to
the target as one tree. The candidates are fixed, not sampled, so under sampling they go with one-hot q, for which
SpecInfer's rule (draws without replacement from p) stays lossless.

`vocab` (optional) restricts the draft's LM head to a subset of frequent tokens (as FR-Spec and EAGLE-3 do): the
8192-wide LM head is most of the head's cost on a small target, and verification stays exact because the target
still scores the full vocabulary; a token outside the subset is simply never proposed.

An EAGLE-3 head (heads/eagle3.py) drafts the same way from the target's fused low, middle and high features (the
blocks its `feature_layers` name) and over its own LM head and draft vocabulary (`own_vocab`); a head declares both.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from verispec.argument_checks import whole_number
from verispec.drafters.base import DraftContext, Needs, Proposal, Verdict
from verispec.drafters.options import FIXED_K
from verispec.errors import IncompatibleTargetError, InvalidArgumentError
from verispec.heads.eagle import EagleHead
from verispec.heads.eagle3 import Eagle3Head
from verispec.models.linear import matmul_by
from verispec.models.protocol import FINAL, CausalLM
from verispec.sampling import constrain, draw

# EAGLE-2's tree as the bench and the head cards run it, 6 deep: 2 expanded per depth, 10 verified: of the shapes tried
# on the shipped pair in exact bfloat16 (more expanded, fewer or more verified), the one that paid best where every
# verified row costs. `Method("eagle", EAGLE_TREE_DEPTH, EAGLE_TREE)` is
# `--method eagle -k 6 --tree-top-k 2 --tree-tokens 10`.
EAGLE_TREE_DEPTH, EAGLE_TREE = 6, {"tree_top_k": 2, "tree_tokens": 10}


class Eagle:
    name = "eagle"
    batched = False  # its head's cache and the target's features are one sequence's
    needs = Needs(hidden_states=(FINAL,))

    def __init__(
        self,
        head: EagleHead | Eagle3Head,
        k: int = FIXED_K,
        vocab: torch.Tensor | None = None,
        tree: tuple[int, int] | None = None,
    ) -> None:
        self.head, self.k = head, whole_number(k, "k (tokens drafted per step)", 1)
        if vocab is not None and head.own_vocab is not None:
            raise InvalidArgumentError(
                f"this EAGLE-3 head drafts over its own {len(head.own_vocab)}-token "
                "vocabulary; it takes no other draft vocabulary"
            )
        self.vocab = head.own_vocab if vocab is None else vocab.to(torch.long)
        self.tree = (
            None
            if tree is None
            else (whole_number(tree[0], "tree top_k", 1), whole_number(tree[1], "tree total tokens", 1))
        )
        self.width = self.k if tree is None else self.tree[1]
        self.needs = Needs(hidden_states=head.feature_layers, tree_masks=tree is not None)
        self._lm_head: tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None = None

    def lm_head(self, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The draft's LM head: the head's own, or the target's over the draft vocabulary as a prepacked matmul
        built once per target weight (packing takes milliseconds: not once per generation)."""
        if self.head.own_vocab is not None:
            return self.head.logits
        if self._lm_head is None or self._lm_head[0] is not weight:
            self._lm_head = weight, matmul_by(weight if self.vocab is None else weight[self.vocab])
        return self._lm_head[1]

    def check(self, target: CausalLM) -> None:
        c = self.head.config
        if (c.hidden_size, c.vocab_size) != (target.hidden_size, target.lm_head_weight.shape[0]):
            raise IncompatibleTargetError(
                f"this EAGLE head has features of {c.hidden_size} and a vocabulary of "
                f"{c.vocab_size}; {target.name} has {target.hidden_size} and "
                f"{target.lm_head_weight.shape[0]}"
            )
        if max(self.head.feature_layers) >= target.num_layers:
            raise IncompatibleTargetError(
                f"this EAGLE head reads blocks {list(self.head.feature_layers)}; {target.name} has {target.num_layers}"
            )

    def begin(self, context: DraftContext) -> EagleSession:
        return EagleSession(self, context)


class EagleSession:
    def __init__(self, drafter: Eagle, context: DraftContext) -> None:
        self.head, self.target = drafter.head, context.target
        self.sampling, self.generator, self.grammar = context.sampling, context.generator, context.grammar
        weight = self.target.lm_head_weight
        self.vocab = drafter.vocab
        self.lm_head = drafter.lm_head(weight)  # over V or |subset| rows
        self.tree = drafter.tree
        extra = drafter.k * (1 if self.tree is None else self.tree[0])  # the drafts' entries, cut after the verdict
        self.cache = self.head.new_cache(context.cache.max_len + extra, weight.dtype, weight.device)
        self.features = context.hidden.flatten(1)  # (n, D or 3D): committed features not yet fed to the head
        self._committed = len(context.prompt)

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Proposal:
        """Feed the new true features with their next tokens, then draft k tokens from predicted features."""
        fed, n = self.cache.length, len(context)
        self._committed = n
        k = min(k, self.cache.max_len - (n - 1) - (0 if self.tree is None else self.tree[0] * k) + 1)
        if k < 1 or fed + len(self.features) == 0:  # nothing to predict from yet (a one-token prompt)
            return Proposal([])
        nxt = torch.tensor(context[fed + 1 : n], device=self.features.device)  # x_{i+1} for each fed feature
        predicted = self.head(self.features[None], self.target.embed(nxt)[None], self.cache)[0, -1]
        self.features = self.features[:0]
        if self.tree is not None:
            return self._propose_tree(predicted, n, k)
        tokens, q = [], []
        for i in range(k):
            drawn = self._draw(predicted, tokens)
            if drawn is None:  # nothing the grammar allows is in the draft vocabulary
                break
            token, q_i = drawn
            tokens.append(token)
            q += [] if q_i is None else [q_i]
            if i < k - 1:  # (f^, the token just drafted) predicts the next feature
                embedding = self.target.embed(torch.tensor([[token]], device=predicted.device))
                predicted = self.head(predicted[None, None], embedding, self.cache)[0, -1]
        return Proposal(tokens, torch.stack(q) if q else None)

    def _propose_tree(self, root: torch.Tensor, n: int, k: int) -> Proposal:
        """EAGLE-2: grow k depths from the root's predicted feature, expanding the best `top_k` nodes each time."""
        top_k, total = self.tree
        committed = self.cache.length  # n - 1 entries, all from true features
        tokens, parents, scores = [], [], []  # every node drawn, its parent, its log product of draft probabilities
        predicted = {-1: root}  # expanded node -> the feature its children follow
        slots: dict[int, int] = {}  # expanded node -> its entry in the head's cache
        paths: dict[int, list[int]] = {-1: []}  # node -> the tokens from the root to it (what the grammar follows)
        frontier = [-1]
        for depth in range(1, k + 1):
            log_q = self._log_q(torch.stack([predicted[node] for node in frontier]), [paths[n] for n in frontier])
            best, ids = log_q.topk(min(top_k, log_q.shape[-1]), dim=-1)  # each node's own top_k children
            children = []
            for row, node in enumerate(frontier):
                for lp, i in zip(best[row].tolist(), ids[row].tolist()):
                    if lp == -torch.inf:  # the grammar forbids it (and every lower-ranked one)
                        break
                    token = i if self.vocab is None else int(self.vocab[i])
                    paths[len(tokens)] = [*paths[node], token]
                    children.append(len(tokens))
                    tokens.append(token)
                    parents.append(node)
                    scores.append((0.0 if node < 0 else scores[node]) + lp)
            if depth == k or not children:
                break
            frontier = sorted(children, key=lambda c: -scores[c])[:top_k]  # stable: a parent beats a tied child
            for node, feature in zip(frontier, self._expand(frontier, tokens, parents, predicted, slots, committed, n)):
                predicted[node] = feature
        # Log probabilities are <= 0, so a node never outranks its parent: the best `total` form a tree.
        keep = sorted(sorted(range(len(tokens)), key=lambda c: -scores[c])[:total])
        index = {old: new for new, old in enumerate(keep)} | {-1: -1}
        return Proposal([tokens[c] for c in keep], None, [index[parents[c]] for c in keep])

    def _expand(
        self,
        frontier: list[int],
        tokens: list[int],
        parents: list[int],
        predicted: dict,
        slots: dict[int, int],
        committed: int,
        n: int,
    ) -> torch.Tensor:
        """The head over the frontier's nodes in one forward: each reads its parent's predicted feature and its own
        token, at position n - 2 + its depth, and sees the committed entries, its ancestors' and its own."""
        T, length, device = len(frontier), self.cache.length, predicted[-1].device
        mask = torch.zeros(T, length + T, dtype=torch.bool)
        mask[:, :committed] = True
        depths = []
        for row, node in enumerate(frontier):
            ancestor, depth = parents[node], 1
            while ancestor >= 0:
                mask[row, slots[ancestor]], ancestor, depth = True, parents[ancestor], depth + 1
            mask[row, length + row] = True
            slots[node] = length + row
            depths.append(depth)
        features = torch.stack([predicted[parents[node]] for node in frontier])[None]
        ids = torch.tensor([[tokens[node] for node in frontier]], device=device)
        positions = torch.tensor(depths, device=device) + n - 2
        return self.head(features, self.target.embed(ids), self.cache, positions, mask.to(device))[0]

    def _log_q(self, features: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """(F, draft vocabulary) log-probabilities of the head's next token after each feature (-inf where the grammar
        forbids it after that node's path: the candidates are fixed, so they need not be renormalised)."""
        logits = self.lm_head(features)
        logits = logits if self.vocab is not None else logits[:, : self.target.vocab_size]
        log_q = torch.log_softmax(logits.float(), -1)
        if self.grammar is None:
            return log_q
        allowed = torch.stack([self.grammar.allowed(path) for path in paths]).to(log_q.device)
        return constrain(log_q, allowed if self.vocab is None else allowed[:, self.vocab])

    def _draw(self, feature: torch.Tensor, drafted: list[int]) -> tuple[int, torch.Tensor | None] | None:
        """A draft token (in the target's ids) after the tokens `drafted` in this proposal, and its q over the full
        vocabulary when sampling; None where the grammar allows none of the draft vocabulary."""
        logits = self.lm_head(feature)
        if self.vocab is None:
            full = logits[: self.target.vocab_size]
        else:
            full = torch.full((self.target.vocab_size,), float("-inf"), dtype=logits.dtype, device=logits.device)
            full[self.vocab] = logits  # outside the subset q is zero
        if self.grammar is not None and (full := self.grammar.constrain(full, drafted)) is None:
            return None
        return draw(full, self.sampling, self.generator)

    def accepted(self, verdict: Verdict) -> None:
        """Entries built from predicted features go; the verdict's true features wait for the next proposal."""
        self.cache.truncate(min(self.cache.length, self._committed - 1))
        self.features = torch.cat((self.features, verdict.hidden.flatten(1)))
