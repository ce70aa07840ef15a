"""The speculative loop: token identity with autoregressive greedy decoding, stops, stats, streaming, validation."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import pytest
import torch

from drafting import OwnSession
from verispec import (
    ContextLengthError,
    DraftModel,
    InvalidArgumentError,
    Proposal,
    SamplingParams,
    TokenizerMismatchError,
    Verdict,
    generate,
    load_model,
    stream,
)
from verispec.checkpoints.folder import save_checkpoint
from verispec.checkpoints.random_init import random_checkpoint, random_weights, tiny_config
from verispec.checkpoints.tokenizer import byte_level_tokenizer
from verispec.models.native import NativeModel

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10, 32, 32]  # "def(x):\n  " as byte ids
N = 48


class OracleDrafter(OwnSession):
    """Proposes the target's own greedy continuation, except at chosen positions where it proposes a wrong token."""

    name = "oracle"

    def __init__(self, truth: Sequence[int], errors: set[int], k: int) -> None:
        self.truth, self.errors, self.k, self.width = list(truth), errors, k, k
        self.verdicts: list[tuple[int, int]] = []  # (first position proposed, number accepted)

    def start(self, context) -> None:
        self.prompt_len = len(context.prompt)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        self.pos = len(context) - self.prompt_len
        wanted = range(self.pos, self.pos + k)
        return Proposal([(self.truth[i] + 1) % 256 if i in self.errors else self.truth[i] for i in wanted])

    def accepted(self, verdict: Verdict) -> None:
        self.verdicts.append((self.pos, verdict.num_accepted))


@pytest.fixture(scope="module")
def greedy_truth(target: NativeModel) -> list[int]:
    return generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).tokens


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_identical_with_draft_equal_to_target(target, greedy_truth, k) -> None:
    result = generate(target, PROMPT, DraftModel(target, k), max_new_tokens=N, ignore_eos=True)
    assert result.tokens == greedy_truth
    assert result.stats.accepted == result.stats.proposed  # an always-right drafter
    assert result.stats.target_calls == -(-N // (k + 1))


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_identical_with_unrelated_draft(target, unrelated, greedy_truth, k) -> None:
    result = generate(target, PROMPT, DraftModel(unrelated, k), max_new_tokens=N, ignore_eos=True)
    assert result.tokens == greedy_truth
    assert result.stats.acceptance_rate < 0.2


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_identical_with_partially_accepted_draft(target, draft, greedy_truth, k) -> None:
    result = generate(target, PROMPT, DraftModel(draft, k), max_new_tokens=N, ignore_eos=True)
    assert result.tokens == greedy_truth
    assert 0 < result.stats.accepted < result.stats.proposed


@pytest.mark.parametrize("k", [1, 3, 4, 8])
def test_oracle_drafter_errs_exactly_where_told(target, greedy_truth, k) -> None:
    errors = {0, 5, 6, 13, 30}
    oracle = OracleDrafter(greedy_truth, errors, k)
    result = generate(target, PROMPT, oracle, max_new_tokens=N, ignore_eos=True)
    assert result.tokens == greedy_truth
    pos, expected, calls = 0, [], 0
    while pos < N:  # each step keeps the proposals before the first error, then the target's own token
        k_eff = min(k, N - pos - 1)
        n = min((e for e in errors if pos <= e < pos + k_eff), default=pos + k_eff) - pos
        if k_eff:  # the last token is the target's alone: no drafter call
            expected.append((pos, n))
        pos, calls = pos + n + 1, calls + 1
    assert oracle.verdicts == expected
    assert result.stats.target_calls == calls
    assert result.drafted == [any(p <= i < p + n for p, n in expected) for i in range(N)]


def test_stats_are_consistent(target, draft) -> None:
    s = generate(target, PROMPT, DraftModel(draft, 4), max_new_tokens=N, ignore_eos=True).stats
    assert s.new_tokens == N == s.accepted + s.target_calls  # each call adds its accepted drafts and one token
    assert s.tau == pytest.approx(N / s.target_calls)
    assert s.drafter_calls in (s.target_calls, s.target_calls - 1)  # no proposal when one token is left
    assert sum(s.accepted_by_position) == s.accepted and sum(s.proposed_by_position) == s.proposed
    assert all(a >= b for a, b in zip(s.accepted_by_position, s.accepted_by_position[1:]))
    assert s.total_time >= s.prefill_time + s.draft_time + s.verify_time > 0
    as_dict = s.to_dict()
    assert as_dict["tau"] == s.tau and as_dict["acceptance_by_position"] == s.acceptance_by_position
    assert as_dict["target_calls"] == s.target_calls


def test_eos_stops_and_drops_proposals_after_it(target, greedy_truth) -> None:
    at = 20
    eos = greedy_truth[at]
    cut = greedy_truth.index(eos) + 1
    with_eos = NativeModel(target.module, target.tokenizer, frozenset({eos}), "target-with-eos")
    for drafter in (None, DraftModel(target, 8)):
        result = generate(with_eos, PROMPT, drafter, max_new_tokens=N)
        assert result.tokens == greedy_truth[:cut]
        assert result.stop_reason == "eos"
    # An always-right drafter proposes 8 per step (9 tokens a step); the step that reaches the EOS verifies
    # its proposals only up to the EOS.
    steps_before, rest = divmod(cut, 9)
    assert result.stats.proposed == 8 * steps_before + min(8, rest)


def test_stop_string_truncates_text_and_stream(target, draft, greedy_truth) -> None:
    full = generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).text
    stop = full[12:14]
    steps = stream(target, PROMPT, DraftModel(draft, 4), max_new_tokens=N, ignore_eos=True, stop=[stop])
    streamed = "".join(piece.text for piece in steps)
    result = steps.result
    assert result.stop_reason == "stop_string"
    assert result.text == streamed == full[: full.index(stop)]
    assert result.tokens == greedy_truth[: len(result.tokens)] and len(result.tokens) < N


@pytest.mark.parametrize("start", [5, 12])
def test_stats_count_only_the_drafts_a_stop_string_kept(target, start) -> None:
    """With the target as its own draft every proposal is right, so a stop string inside a step cuts accepted
    drafts: the stats count what was kept, as the per-token `drafted` flags do."""
    full = generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).text
    result = generate(
        target, PROMPT, DraftModel(target, 8), max_new_tokens=N, ignore_eos=True, stop=[full[start : start + 2]]
    )
    assert result.stop_reason == "stop_string"
    assert result.stats.accepted == sum(result.drafted) < result.stats.proposed
    assert sum(result.stats.accepted_by_position) == result.stats.accepted


@pytest.mark.parametrize("start", [3, 9, 16, 25, 33])
def test_stop_strings_keep_greedy_identity(target, draft, start) -> None:
    """The tokens end with the one that completed the stop string, whatever the drafter and step boundaries."""
    full = generate(target, PROMPT, max_new_tokens=N, ignore_eos=True).text
    stop = full[start : start + 3]
    plain = generate(target, PROMPT, max_new_tokens=N, ignore_eos=True, stop=[stop])
    assert plain.stop_reason == "stop_string" and plain.text == full[: full.index(stop)]
    decode = target.tokenizer.decode
    assert stop in decode(PROMPT[-4:] + plain.tokens) and stop not in decode(PROMPT[-4:] + plain.tokens[:-1])
    for k in (2, 4, 8):
        spec = generate(target, PROMPT, DraftModel(draft, k), max_new_tokens=N, ignore_eos=True, stop=[stop])
        assert (spec.tokens, spec.text) == (plain.tokens, plain.text)
        assert len(spec.drafted) == len(spec.tokens) == spec.stats.new_tokens


def test_any_of_several_eos_ids_stops(target, greedy_truth) -> None:
    first, second = greedy_truth[30], greedy_truth[12]
    cut = min(greedy_truth.index(first), greedy_truth.index(second)) + 1
    model = NativeModel(target.module, target.tokenizer, frozenset({first, second}), "two-eos")
    assert generate(model, PROMPT, DraftModel(target, 5), max_new_tokens=N).tokens == greedy_truth[:cut]


def test_stream_pieces_join_to_text(target, draft) -> None:
    steps = stream(target, "def f(x):", DraftModel(draft, 3), max_new_tokens=30)
    pieces = list(steps)
    assert "".join(p.text for p in pieces) == steps.result.text
    assert [p.drafted for p in pieces] == steps.result.drafted


def test_context_length_is_a_clean_stop(tmp_path) -> None:
    small = load_model(random_checkpoint(tmp_path, tiny_config(max_position_embeddings=48)))
    prompt = list(range(40, 80))  # 40 tokens
    plain = generate(small, prompt, max_new_tokens=100, ignore_eos=True)
    spec = generate(small, prompt, DraftModel(small, 6), max_new_tokens=100, ignore_eos=True)
    assert plain.stop_reason == spec.stop_reason == "context_length"
    assert plain.tokens == spec.tokens and len(plain.tokens) == 8
    assert len(generate(small, list(range(47)), max_new_tokens=5).tokens) == 1
    with pytest.raises(ContextLengthError):
        generate(small, list(range(48)), max_new_tokens=5)


def test_max_new_tokens_is_exact(target, draft) -> None:
    for n in (1, 2, 5, 13):
        assert len(generate(target, PROMPT, DraftModel(draft, 8), max_new_tokens=n, ignore_eos=True).tokens) == n


def test_abandoned_stream_leaves_drafter_consistent(target, draft, greedy_truth) -> None:
    drafter = DraftModel(draft, 4)

    class Failing:  # the target fails in the middle of the third verification
        def __init__(self) -> None:
            self.calls = 0

        def __getattr__(self, name):
            return getattr(target, name)

        def __call__(self, tokens, cache, mask=None, positions=None, **options):
            self.calls += 1
            if self.calls == 4:  # prefill, then three steps
                raise RuntimeError("interrupted")
            return target(tokens, cache, mask, positions, **options)

    failing = Failing()
    steps = stream(failing, PROMPT, drafter, max_new_tokens=N, ignore_eos=True)
    emitted = []
    with pytest.raises(RuntimeError):
        for piece in steps:
            emitted.append(piece)
    assert emitted  # the failure came mid-stream; the drafter's next generation starts clean
    assert generate(target, PROMPT, drafter, max_new_tokens=N, ignore_eos=True).tokens == greedy_truth


def test_closing_a_stream_early(target, draft, greedy_truth) -> None:
    steps = stream(target, PROMPT, DraftModel(draft, 4), max_new_tokens=N, ignore_eos=True)
    first = [piece for piece, _ in zip(steps, range(3))]
    steps.close()
    assert len(first) == 3 and steps.result is None


def test_sampling_is_reproducible_with_a_seed(target, draft) -> None:
    options = dict(max_new_tokens=32, temperature=1.0, top_k=50, top_p=0.95, ignore_eos=True)
    a = generate(target, PROMPT, DraftModel(draft, 4), seed=7, **options)
    b = generate(target, PROMPT, DraftModel(draft, 4), seed=7, **options)
    c = generate(target, PROMPT, DraftModel(draft, 4), seed=8, **options)
    assert a.tokens == b.tokens != c.tokens


def test_padded_draft_embedding_with_same_tokenizer_is_fine(tmp_path, target, greedy_truth, pair_dirs) -> None:
    from verispec.reference import load_params

    params = load_params(pair_dirs[0])
    config = replace(params.pop("config"), vocab_size=300)  # embedding table padded past the 257 real tokens
    pad = lambda w: torch.cat((torch.as_tensor(w), torch.zeros(300 - w.shape[0], w.shape[1], dtype=torch.float64)))
    params = {k: pad(v) if k in ("model.embed_tokens.weight", "lm_head.weight") else v for k, v in params.items()}
    padded = load_model(save_checkpoint(tmp_path, config, params, byte_level_tokenizer()))
    assert padded.vocab_size == target.vocab_size == 257
    assert generate(target, PROMPT, DraftModel(padded, 4), max_new_tokens=N, ignore_eos=True).tokens == greedy_truth


def test_different_tokenizers_are_refused(tmp_path, target) -> None:
    other = byte_level_tokenizer()
    other.add_special_tokens(["<|pad|>"])
    config = tiny_config(vocab_size=258, num_hidden_layers=1)
    weights = random_weights(config, 1)
    foreign = load_model(save_checkpoint(tmp_path, config, weights, other))
    with pytest.raises(TokenizerMismatchError, match="different tokenizers"):
        generate(target, PROMPT, DraftModel(foreign, 4), max_new_tokens=4)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(prompt=""), "empty"),
        (dict(prompt=[]), "empty"),
        (dict(prompt=[5, 900]), "token ids"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_arguments_raise_invalid_argument(target, options, message) -> None:
    prompt = options.pop("prompt", PROMPT)
    with pytest.raises(InvalidArgumentError, match=message):
        stream(target, prompt, None, **options)


def test_k_must_be_positive(draft) -> None:
    with pytest.raises(InvalidArgumentError, match="k"):
        DraftModel(draft, 0)


def test_sampling_params_are_shared_with_the_drafter(target, draft) -> None:
    seen = {}

    class Spy(DraftModel):
        def begin(self, context):
            seen["sampling"] = context.sampling
            return super().begin(context)

    generate(target, PROMPT, Spy(draft, 2), max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9, seed=0)
    assert seen["sampling"] == SamplingParams(0.7, 5, 0.9)
