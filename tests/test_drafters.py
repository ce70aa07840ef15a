"""Every registered drafter through the same checks: greedy identity with plain decoding, consistency after an
abandoned stream, one drafter shared by interleaved generations, and a clear refusal of a target that lacks
what it needs. Also the registry's own refusals, and the target's hidden states as the loop hands them over."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from drafting import OwnSession
from verispec import IncompatibleTargetError, InvalidArgumentError, generate, kernels, stream
from verispec.checkpoints.draft_vocab import save_draft_vocab
from verispec.drafters.adaptive import AdaptiveK, AdaptiveSession
from verispec.drafters.base import Needs, Proposal, Verdict
from verispec.drafters.draft_model import DraftModel, DraftModelSession
from verispec.drafters.registry import FAMILIES, Method, Resources, build_drafter, check_method
from verispec.heads.eagle import EagleHead, head_config, save_head
from verispec.heads.medusa import MedusaHeads, save_heads
from verispec.models.native import load_model
from verispec.models.protocol import FINAL, Capabilities
from verispec.train.loop import init_weights

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32, 100, 101, 102]  # "def(x):\n  def" as byte ids
N = 24

EXAMPLES = {
    "autoregressive": Method("autoregressive"),
    "draft": Method("draft", 3),
    "draft tree": Method("draft", 3, {"branch": 2, "branch_depth": 2}),
    "draft vocab": Method("draft", 3, {"draft_vocab": 100}),  # its 100 most frequent tokens, saved by `built`
    # the ways of a draft with another tokenizer, here over the same one (the intersection: every token)
    "draft intersection": Method("draft", 3, {"vocab_map": "intersection", "draft_vocab": 100}),
    "draft intersection tree": Method("draft", 3, {"vocab_map": "intersection", "branch": 2}),
    "draft reencode": Method("draft", 3, {"vocab_map": "reencode"}),
    "ngram": Method("ngram", 3, {"max_ngram": 2}),
    "layerskip": Method("layerskip", 3, {"skip": [1]}),
    "selfquant": Method("selfquant", 3, {"skip": [1]}),  # a q4_0 twin of the target, on verispec's kernels
    "selfquant tree": Method("selfquant", 3, {"branch": 2, "format": "q8_0"}),
    "lookahead": Method("lookahead", None, {"window": 3, "ngram": 3, "candidates": 3}),
    "eagle": Method("eagle", 3),  # with a random head, saved by the `built` fixture
    "eagle tree": Method("eagle", 3, {"tree_top_k": 2, "tree_tokens": 6}),
    "medusa": Method("medusa", None, {"tree_tokens": 8}),  # random heads, saved by `built` too
    "suffix": Method("suffix", 3),  # with its history shared by the generations of each test
    "suffix tree": Method("suffix", 3, {"tree_tokens": 4, "spec_factor": 2.0, "history_tokens": 0}),
}

pytestmark = pytest.mark.usefixtures("single_thread")


def test_every_family_has_an_example() -> None:
    assert {method.family for method in EXAMPLES.values()} == set(FAMILIES)


@pytest.fixture(scope="module")
def truth(target) -> list[int]:
    return generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).tokens


@pytest.fixture(scope="module")
def built(tmp_path_factory, target, draft):
    """name -> that example's drafter, built by the registry (an EAGLE example gets a random head's folder)."""
    torch.manual_seed(0)
    head = EagleHead(head_config(target.config))
    init_weights(head)
    heads = {
        "eagle": save_head(head, tmp_path_factory.mktemp("eagle"), "random"),
        "medusa": save_heads(
            MedusaHeads.from_target(target.lm_head_weight.detach(), 2), tmp_path_factory.mktemp("medusa"), "random"
        ),
    }

    vocab_dir = tmp_path_factory.mktemp("draft-vocab")
    save_draft_vocab(vocab_dir, torch.randint(0, 50, (draft.vocab_size,), generator=torch.Generator().manual_seed(0)))

    def build(name: str):
        method = EXAMPLES[name]
        if method.family == "selfquant" and not kernels.available(torch.float32):
            pytest.skip(f"a quantized twin runs on verispec's kernels, which do not run here: {kernels.reason()}")
        return build_drafter(
            method, Resources(draft=draft, target=target, head_dir=heads.get(method.family), draft_dir=vocab_dir)
        )

    return build


@pytest.mark.parametrize("name", EXAMPLES)
def test_greedy_identity(target, built, truth, name) -> None:
    assert generate(target, PROMPT, built(name), max_new_tokens=N, ignore_eos=True).tokens == truth


@pytest.mark.parametrize("name", EXAMPLES)
def test_abandoned_streams_leave_target_and_drafter_consistent(target, built, truth, name) -> None:
    drafter = built(name)
    closed = stream(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True)
    assert len([piece for piece, _ in zip(closed, range(3))]) == 3
    closed.close()  # abandoned mid-generation

    class Failing:  # the target fails in the third verification
        calls = 0

        def __getattr__(self, name):
            return getattr(target, name)

        def __call__(self, *args, **options):
            self.calls += 1
            if self.calls == 4:
                raise RuntimeError("interrupted")
            return target(*args, **options)

    with pytest.raises(RuntimeError, match="interrupted"):
        for _ in stream(Failing(), PROMPT, drafter, max_new_tokens=N, ignore_eos=True):
            pass
    assert generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True).tokens == truth


@pytest.mark.parametrize("name", EXAMPLES)
def test_one_drafter_serves_interleaved_generations(target, built, name) -> None:
    """Two live streams of one drafter, stepped in turn, each give what they give alone (greedy and seeded; a
    drafter with a history shared across generations proposes from what ran before, and so draws differently under
    sampling: greedy both)."""
    drafter = built(name)
    shared = getattr(drafter, "history", None) is not None
    runs = [(PROMPT, {}), (PROMPT[3:], {} if shared else dict(temperature=1.0, seed=7))]
    alone = [
        generate(target, prompt, drafter, max_new_tokens=N, ignore_eos=True, **options).tokens
        for prompt, options in runs
    ]
    streams = [
        stream(target, prompt, drafter, max_new_tokens=N, ignore_eos=True, **options) for prompt, options in runs
    ]
    iterators, live = [iter(s) for s in streams], [True, True]
    while any(live):
        for i, it in enumerate(iterators):
            live[i] = live[i] and next(it, None) is not None
    assert [s.result.tokens for s in streams] == alone


@pytest.mark.parametrize("name", [name for name in EXAMPLES if name != "autoregressive"])
def test_auto_switches_every_family_off_and_on(target, built, truth, name, monkeypatch) -> None:
    """`auto` over every family: steps that ask for k = 0 (nothing proposed, not even a side branch) between
    drafted ones keep the session right; then the controller's own choices, on this machine's timings."""
    drafter = AdaptiveK(built(name))
    monkeypatch.setattr(AdaptiveSession, "choose", lambda self, limit: limit if len(self.chosen) % 2 else 0)
    out = generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True)
    assert out.tokens == truth
    assert out.stats.steps_by_depth[0] >= out.stats.target_calls // 2
    monkeypatch.undo()
    assert generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True).tokens == truth


class CausalOnly:
    """The target behind a protocol that offers no capability beyond a causal chain."""

    capabilities = Capabilities()

    def __init__(self, target) -> None:
        self.target = target

    def __getattr__(self, name):
        return getattr(self.target, name)

    def __call__(self, tokens, cache, mask=None, positions=None, *, logits_to_keep=0, **options):
        assert mask is None and positions is None and not options
        return self.target(tokens, cache, logits_to_keep=logits_to_keep)


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_target_without_what_the_drafter_needs_is_refused(target, built, truth, name) -> None:
    drafter = built(name)
    if drafter is None or drafter.needs == Needs():
        assert generate(CausalOnly(target), PROMPT, drafter, max_new_tokens=N, ignore_eos=True).tokens == truth
    else:
        with pytest.raises(IncompatibleTargetError, match="needs .* of the target"):
            stream(CausalOnly(target), PROMPT, drafter, max_new_tokens=N)


@pytest.mark.parametrize(
    "method, message",
    [
        (Method("hydra"), "unknown method 'hydra'"),
        (Method("ngram", 3, {"window": 2}), "method ngram takes no option window"),
        (Method("autoregressive", 2), "method autoregressive takes no k"),
        (Method("lookahead", 3), "--ngram-size"),
        (Method("draft", 0), "must be an integer >= 1"),
        (Method("draft", True), "must be an integer >= 1"),
        (Method("draft", "fast"), "must be an integer >= 1"),
        (Method("autoregressive", "auto"), "takes no k, auto included"),
    ],
)
def test_registry_refuses_bad_methods_before_loading(method, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        check_method(method)


def test_registry_needs_its_resources() -> None:
    with pytest.raises(InvalidArgumentError, match="needs a draft model"):
        build_drafter(Method("draft", 2))
    with pytest.raises(InvalidArgumentError, match="layerskip.json"):
        build_drafter(Method("layerskip", 2))
    assert check_method(Method("draft", 2, {"branch": 2})) == Needs(tree_masks=True)
    assert Method("draft", 4, {"branch": 2}).label == "draft k=4 branch=2"


class WithoutChains:
    """A model as it is, but without greedy chains of its own: drafted a forward at a time."""

    def __init__(self, model) -> None:
        self.model, self.capabilities = model, replace(model.capabilities, greedy_chains=False)

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


@pytest.mark.parametrize("how", ["chain", "forwards", "tree", "sampled"])
def test_a_draft_vocabulary_bounds_every_proposal(target, draft, truth, how, monkeypatch) -> None:
    vocab = torch.arange(0, draft.vocab_size, 3)
    model = WithoutChains(draft) if how == "forwards" else draft
    drafter = DraftModel(model, 3, branch=2 if how == "tree" else 1, vocab=vocab)
    proposals, propose = [], DraftModelSession.propose
    monkeypatch.setattr(
        DraftModelSession,
        "propose",
        lambda self, context, k: proposals.append(propose(self, context, k)) or proposals[-1],
    )
    out = generate(
        target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True, seed=0, temperature=1.0 if how == "sampled" else 0.0
    )
    drafted = {token for proposal in proposals for token in proposal.tokens}
    assert drafted and drafted <= set(vocab.tolist())
    assert how == "sampled" or out.tokens == truth


def test_a_draft_models_folder_chooses_its_draft_vocabulary(tmp_path, pair_dirs, draft) -> None:
    folder = tmp_path / "draft"
    shutil.copytree(pair_dirs[1], folder)
    save_draft_vocab(folder, torch.arange(draft.vocab_size))  # counts: the highest ids most frequent
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"verispec": {"draft_vocab": 50}}))
    chosen = build_drafter(Method("draft", 3), Resources(draft=load_model(folder), draft_dir=folder))
    assert chosen.vocab.tolist() == list(range(draft.vocab_size - 1, draft.vocab_size - 51, -1))
    assert build_drafter(Method("draft", 3, {"draft_vocab": 0}), Resources(draft=draft, draft_dir=folder)).vocab is None
    assert build_drafter(Method("draft", 3), Resources(draft=draft)).vocab is None  # no folder: every token
    with pytest.raises(InvalidArgumentError, match="draft_vocab reads the draft's token frequencies"):
        build_drafter(Method("draft", 3, {"draft_vocab": 5}), Resources(draft=draft))
    with pytest.raises(InvalidArgumentError, match="draft vocabulary of"):
        DraftModel(draft, 3, vocab=torch.tensor([0, draft.vocab_size]))
    with pytest.raises(InvalidArgumentError, match="draft_vocab must be an integer >= 0"):
        build_drafter(Method("draft", 3, {"draft_vocab": -1}), Resources(draft=draft))
    without = WithoutChains(draft)
    without.capabilities = replace(draft.capabilities, vocab_heads=False)  # (as a transformers model)
    with pytest.raises(InvalidArgumentError, match="native runtime does"):
        DraftModel(without, 3, vocab=torch.tensor([1, 2]))
    assert build_drafter(Method("draft", 3), Resources(draft=without, draft_dir=folder)).vocab is None


# ---------------------------------------------------------------------------------------------------------------
# hidden states


def test_forward_returns_the_hidden_states_asked_for(target) -> None:
    x = torch.tensor([PROMPT])
    logits, hidden = target(x, target.new_cache(), hidden=[0, 2, FINAL])
    assert hidden.shape == (1, len(PROMPT), 3, target.hidden_size)
    with torch.inference_mode():
        assert torch.equal(target.module.lm_head(hidden[:, :, 2]), logits)  # FINAL is what the LM head reads
    _, first = target(x, target.new_cache(), layers=[0], hidden=[0])
    assert torch.equal(first[:, :, 0], hidden[:, :, 0])  # block 0's output does not depend on later blocks
    with pytest.raises(ValueError, match="do not run"):
        target(x, target.new_cache(), layers=[0, 1], hidden=[2])


class HiddenSpy(OwnSession):
    """Proposes the target's greedy continuation with an error every third step, and keeps the hidden states."""

    name, k, width = "hidden-spy", 3, 3
    needs = Needs(hidden_states=(1, FINAL))

    def __init__(self, truth: list[int]) -> None:
        self.truth = truth

    def start(self, context) -> None:
        self.prompt_len, self.steps, self.seen = len(context.prompt), 0, [context.hidden]

    def propose(self, context, k: int) -> Proposal:
        at, self.steps = len(context) - self.prompt_len, self.steps + 1
        tokens = self.truth[at : at + k]
        if self.steps % 3 == 0:
            tokens[-1] = (tokens[-1] + 1) % 256
        return Proposal(tokens)

    def accepted(self, verdict: Verdict) -> None:
        assert verdict.hidden.shape[0] == 1 + len(verdict.path)
        self.seen.append(verdict.hidden)


def test_the_loop_hands_the_drafter_hidden_states_of_every_committed_token(target, truth) -> None:
    """The prompt's (but its last token's) at begin, then at each step the last committed token's and the accepted
    ones': joined, they are the hidden states of one forward over the whole text but its last token."""
    spy = HiddenSpy(truth)
    result = generate(target, PROMPT, spy, max_new_tokens=N, ignore_eos=True)
    assert result.tokens == truth and spy.seen[0].shape == (len(PROMPT) - 1, 2, target.hidden_size)
    text = PROMPT + truth
    _, full = target(torch.tensor([text[:-1]]), target.new_cache(), hidden=[1, FINAL])
    torch.testing.assert_close(torch.cat(spy.seen), full[0], atol=1e-5, rtol=1e-4)
