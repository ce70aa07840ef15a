"""The batched engine: each sequence decoded as `generate` decodes it alone, whatever shares the batch; joining,
leaving and aborting between steps; the target's distribution under sampling; refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafting import break_the_rule_for
from test_verify import P_VALUE_MIN, compare
from verispec import (
    DraftModel,
    InvalidArgumentError,
    Lookahead,
    Method,
    PromptLookup,
    Resources,
    SamplingParams,
    SuffixDecoding,
    build_drafter,
    generate,
    generate_batch,
    kernels,
    load_model,
)
from verispec.checkpoints.random_init import random_pair, tiny_config
from verispec.engine import Engine, Request

# Prompts of different lengths (byte ids); the last repeats itself, so prompt lookup finds something to propose.
PROMPTS = [
    [100, 101, 102, 40, 120, 41, 58, 10, 32, 32],
    [7],
    [50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190, 200, 210, 220, 230, 240],
    [33, 34, 35, 36, 33, 34, 35, 36, 33, 34, 35],
]
N = 24


def drafters(draft):
    auto = build_drafter(Method("draft", "auto"), Resources(draft=draft))  # AdaptiveK: the engine drafts with its inner
    vocab = torch.arange(0, draft.vocab_size, 2)  # the batch drafts by an LM head over these tokens
    return {
        "none": None,
        "draft": DraftModel(draft, 4),
        "draft vocab": DraftModel(draft, 4, vocab=vocab),
        "ngram": PromptLookup(3),
        "auto": auto,
        "suffix": SuffixDecoding(3),
        "suffix tree": SuffixDecoding(3, tree_tokens=5),
    }  # (the engine verifies its likeliest chain)


def alone(target, prompt, drafter=None, **options):
    return generate(target, prompt, drafter, **({"max_new_tokens": N, "ignore_eos": True} | options))


def run(engine: Engine) -> dict[int, list]:
    """Step the engine until it has no work; every request's updates, in order."""
    updates: dict[int, list] = {}
    while engine.has_work:
        for update in engine.step():
            updates.setdefault(update.request_id, []).append(update)
    return updates


def tokens(updates: list) -> list[int]:
    return [t for u in updates for t in u.tokens]


@pytest.mark.parametrize("method", ["none", "draft", "draft vocab", "ngram", "auto", "suffix", "suffix tree"])
def test_greedy_batch_is_identical_to_each_prompt_alone(target, draft, method, single_thread) -> None:
    drafter = drafters(draft)[method]
    results = generate_batch(target, PROMPTS, drafter, max_new_tokens=N, ignore_eos=True, adaptive=False)
    for prompt, result in zip(PROMPTS, results):
        truth = alone(target, prompt)
        assert result.tokens == truth.tokens and result.text == truth.text
        assert result.stop_reason == "max_new_tokens" and result.stats.new_tokens == N
    if method != "none":
        assert sum(r.stats.accepted for r in results) > 0  # speculation did happen


def test_stops_and_budgets_per_sequence(target, draft, single_thread) -> None:
    """Different budgets, stop strings and EOS per request in one batch: each ends as it would alone."""
    truth = alone(target, PROMPTS[0])
    stop = truth.text[5:7]
    engine = Engine(target, DraftModel(draft, 3), adaptive=False)
    options = [
        dict(max_new_tokens=5),
        dict(max_new_tokens=N, stop=(stop,)),
        dict(max_new_tokens=N),
        dict(max_new_tokens=11, ignore_eos=False),
    ]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    ids = [
        engine.add(Request(p, sampling=SamplingParams(), **({"ignore_eos": True} | o)))
        for p, o in zip(prompts, options)
    ]
    updates = run(engine)
    for rid, prompt, o in zip(ids, prompts, options):
        expected = alone(target, prompt, **({"ignore_eos": True} | o))
        got = updates[rid]
        assert tokens(got) == expected.tokens and "".join(u.text for u in got) == expected.text
        assert got[-1].finished and got[-1].finish_reason == expected.stop_reason
        assert not any(u.finished for u in got[:-1])
    assert updates[ids[1]][-1].finish_reason == "stop_string"


def test_sequences_join_and_leave_between_steps(target, draft, single_thread) -> None:
    """Continuous batching: a short request added later finishes first, and everything matches decoding alone."""
    engine = Engine(target, DraftModel(draft, 4), max_batch=2, adaptive=False)
    long = engine.add(Request(PROMPTS[0], 40, SamplingParams(), ignore_eos=True))
    first = engine.step() + engine.step()
    short = engine.add(Request(PROMPTS[1], 6, SamplingParams(), ignore_eos=True))
    queued = engine.add(Request(PROMPTS[2], 8, SamplingParams(), ignore_eos=True))  # waits for a free slot
    assert engine.metrics.waiting == 2
    updates = run(engine)
    order = []  # request ids in the order they finished
    for rid, got in updates.items():
        order.append((len(got), rid))
    got = {rid: tokens(u) for rid, u in updates.items()}
    got[long] = [t for u in first for t in u.tokens] + got[long]
    assert got[long] == alone(target, PROMPTS[0], DraftModel(draft, 4), max_new_tokens=40).tokens
    assert got[short] == alone(target, PROMPTS[1], max_new_tokens=6).tokens
    assert got[queued] == alone(target, PROMPTS[2], max_new_tokens=8).tokens
    assert len(updates[short]) < len(updates[long])  # the short one did not wait for the long one to end


def test_abort_frees_a_sequence_and_leaves_the_others_identical(target, draft, single_thread) -> None:
    engine = Engine(target, DraftModel(draft, 4), adaptive=False)
    ids = [engine.add(Request(p, N, SamplingParams(), ignore_eos=True)) for p in PROMPTS]
    waiting = Engine(target, max_batch=1)
    queued = [waiting.add(Request(p, N, SamplingParams(), ignore_eos=True)) for p in PROMPTS[:2]]
    waiting.abort(queued[1])  # aborted before it ever ran
    updates = {rid: u for rid, u in run(waiting).items()}
    assert updates[queued[1]][-1].finish_reason == "aborted" and not tokens(updates[queued[1]])
    before = engine.step() + engine.step()
    engine.abort(ids[2])
    after = run(engine)
    assert after[ids[2]][-1].finished and after[ids[2]][-1].finish_reason == "aborted"
    assert len(after[ids[2]]) == 1
    for rid, prompt in zip(ids, PROMPTS):
        if rid != ids[2]:
            got = [t for u in before if u.request_id == rid for t in u.tokens] + tokens(after[rid])
            assert got == alone(target, prompt).tokens
    engine.abort(ids[0])  # already finished: nothing happens
    assert not engine.has_work and engine.metrics.running == 0


def test_metrics_count_the_batch(target, draft, single_thread) -> None:
    engine = Engine(target, DraftModel(draft, 4), adaptive=False)
    for prompt in PROMPTS:
        engine.add(Request(prompt, N, SamplingParams(), ignore_eos=True))
    assert engine.metrics.waiting == 4 and engine.has_work
    run(engine)
    m = engine.metrics
    assert m.generated_tokens == 4 * N and m.finished == 4 and m.running == m.waiting == 0
    assert 0 < m.accepted_tokens <= m.drafted_tokens and m.target_calls == sum(m.steps_by_k) < 4 * N
    assert m.decode_seconds > 0


def test_seeded_sampling_in_a_batch_is_each_prompt_alone(target, draft, single_thread) -> None:
    """Each sequence draws from its own generator, in the order it would alone: with a fixed k, a seeded request
    samples the same tokens in a batch as `generate` does alone (up to the batched forward's rounding)."""
    options = dict(max_new_tokens=N, temperature=1.0, top_k=50, top_p=0.95, ignore_eos=True)
    for drafter in (DraftModel(draft, 3), PromptLookup(3)):
        engine = Engine(target, drafter, adaptive=False)
        ids = [
            engine.add(Request(p, N, SamplingParams(1.0, 50, 0.95), seed=seed, ignore_eos=True))
            for seed, p in enumerate(PROMPTS)
        ]
        got = run(engine)
        for seed, (rid, prompt) in enumerate(zip(ids, PROMPTS)):
            assert tokens(got[rid]) == generate(target, prompt, drafter, seed=seed, **options).tokens


def plain_at_four(batch: int):
    """Costs under which drafting pays for one sequence and not for four: r(n) grows with the batch."""
    return 0.05, lambda n: 1.0 + 0.25 * (batch - 1) * (n - 1)


def test_k_follows_the_batch_size(target, draft, single_thread) -> None:
    """Four sequences with different budgets: after the first step (which tries the drafter), plain steps while
    three or four share the batch, drafting once one is left; the chosen k is reported, and every output is still
    the target's own."""
    engine = Engine(target, DraftModel(draft, 4), costs=plain_at_four)
    budgets = [3, 6, 9, 30]
    ids = [engine.add(Request(p, n, SamplingParams(), ignore_eos=True)) for p, n in zip(PROMPTS, budgets)]
    chosen, got = [], {}
    while engine.has_work:
        for update in engine.step():
            got.setdefault(update.request_id, []).extend(update.tokens)
        chosen.append((engine.metrics.last_batch, engine.last_k))
    assert chosen[0] == (4, 1)  # r(2) = 1.75 makes k = 1 the most promising
    assert {k for b, k in chosen[1:] if b >= 3} == {0} and max(k for b, k in chosen if b == 1) == 4
    assert engine.metrics.steps_by_k[0] >= 3 and sum(engine.metrics.steps_by_k[1:]) > 0
    for rid, prompt, n in zip(ids, PROMPTS, budgets):
        assert got[rid] == alone(target, prompt, max_new_tokens=n).tokens


@pytest.mark.parametrize("fail_at", [1, 4])
def test_a_failed_step_leaves_every_sequence_consistent(target, draft, fail_at, single_thread) -> None:
    """The target fails in the prefill (call 1: the requests go back to the queue) or in the middle of a step
    (call 4: every slot, target and draft, is rolled back to its committed tokens); the engine goes on to the outputs
    each prompt has alone."""

    class Failing:
        calls = 0

        def __getattr__(self, name):
            return getattr(target, name)

        def forward_batch(self, *args, **options):
            self.calls += 1
            if self.calls == fail_at:
                raise RuntimeError("interrupted")
            return target.forward_batch(*args, **options)

    engine = Engine(Failing(), DraftModel(draft, 4), adaptive=False)
    ids = [engine.add(Request(p, N, SamplingParams(), ignore_eos=True)) for p in PROMPTS]
    got = {rid: [] for rid in ids}
    for _ in range(fail_at - 2 if fail_at > 1 else 0):  # the prefill and the steps before the failing call
        for update in engine.step():
            got.setdefault(update.request_id, []).extend(update.tokens)
    with pytest.raises(RuntimeError):
        engine.step()
    for rid, updates in run(engine).items():
        got[rid] += tokens(updates)
    for rid, prompt in zip(ids, PROMPTS):
        assert got[rid] == alone(target, prompt).tokens


@pytest.mark.parametrize("where", ["rule", "draft"])
def test_one_sequence_failing_ends_it_alone(target, draft, where, monkeypatch, single_thread) -> None:
    """The acceptance rule (its sampling) or the batch's drafting raises for one sequence only (the one whose prompt
    is [7]): that request ends with finish_reason "error" and the exception; the others decode as they do alone,
    and generate_batch raises the failure."""
    poisoned = PROMPTS[1]
    if where == "rule":
        break_the_rule_for(monkeypatch, 13)
    drafter = _Poisoned(draft, 4, poisoned if where == "draft" else None)
    engine = Engine(target, drafter, adaptive=False)
    sampling = [SamplingParams(1.0, 13) if p is poisoned and where == "rule" else SamplingParams() for p in PROMPTS]
    ids = [engine.add(Request(p, N, sampling[i], seed=1, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    updates = run(engine)
    for rid, prompt in zip(ids, PROMPTS):
        last = updates[rid][-1]
        if prompt is poisoned:
            assert last.finish_reason == "error" and isinstance(last.error, RuntimeError)
        else:
            assert last.error is None and tokens(updates[rid]) == alone(target, prompt).tokens
    assert engine.metrics.failed == 1 and not engine.has_work
    if where == "draft":
        with pytest.raises(RuntimeError, match="the draft failed"):
            generate_batch(target, PROMPTS, drafter, max_new_tokens=N, ignore_eos=True, adaptive=False)


class _Poisoned(DraftModel):
    """A draft model whose batched drafting raises for a context that starts with `poisoned` (None: never)."""

    def __init__(self, model, k, poisoned):
        super().__init__(model, k)
        self.poisoned = poisoned

    def begin_batch(self, target, slots):
        session = super().begin_batch(target, slots)
        propose = session.propose

        def drafting(contexts, ks):
            if self.poisoned and any(list(c[: len(self.poisoned)]) == self.poisoned for c in contexts.values()):
                raise RuntimeError("the draft failed")
            return propose(contexts, ks)

        session.propose = drafting
        return session


def test_refuses_drafters_and_targets_that_do_not_batch(target, draft, pair_dirs) -> None:
    """Exact mode batches on verispec's kernels only (tests/test_engine_exact.py), a draft model's too."""
    exact_draft = DraftModel(load_model(pair_dirs[1], exact=True))
    for drafter in (
        Lookahead(),
        DraftModel(draft, 4, branch=2),
        *(() if kernels.available(torch.float32) else (exact_draft,)),
    ):
        with pytest.raises(InvalidArgumentError, match=f"drafter {drafter.name} does not batch"):
            Engine(target, drafter)
    if kernels.available(torch.float32):
        assert Engine(load_model(pair_dirs[0], exact=True), exact_draft).metrics.exact
    else:
        with pytest.raises(InvalidArgumentError, match="cannot decode a batch"):
            Engine(load_model(pair_dirs[0], exact=True))


@pytest.mark.parametrize(
    "request_options, message",
    [
        (dict(prompt=[]), "empty"),
        (dict(prompt=[1, 999]), "token ids"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(seed=-1), "seed"),
        (dict(stop=("",)), "stop"),
        (dict(sampling=0.5), "SamplingParams"),
    ],
)
def test_bad_requests_are_refused(target, request_options, message) -> None:
    engine = Engine(target)
    fields = dict(prompt=[1, 2], max_new_tokens=4, sampling=SamplingParams()) | request_options
    with pytest.raises(InvalidArgumentError, match=message):
        engine.add(Request(**fields))
    assert not engine.has_work


# ---------------------------------------------------------------------------------------------------------------
# Sampling: every sequence of a mixed batch follows the target's distribution (two tokens, a vocabulary of 6).

VOCAB, SAMPLE_PROMPTS, DRAWS = 6, ([1, 4, 2], [3, 0, 5, 5, 2, 1]), 2000


def test_sampling_in_a_batch_follows_the_target(tmp_path, reference_probs, single_thread) -> None:
    """Two prompts interleaved, 8 sequences per step, a draft model drafting 2: the first two tokens of each
    prompt's generations are distributed as the target's joint."""
    config = tiny_config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64, num_hidden_layers=2
    )
    target_dir, draft_dir = random_pair(tmp_path, config, draft_layers=1, seed=2)
    target, draft = load_model(target_dir), load_model(draft_dir)
    engine = Engine(target, DraftModel(draft, 2), max_batch=8, adaptive=False)
    sampling = SamplingParams(temperature=1.0)
    ids = [
        engine.add(Request(list(SAMPLE_PROMPTS[seed % 2]), 2, sampling, seed=seed, ignore_eos=True))
        for seed in range(DRAWS)
    ]
    updates, batches = {}, []
    while engine.has_work:
        for update in engine.step():
            updates.setdefault(update.request_id, []).extend(update.tokens)
        batches.append(engine.metrics.last_batch)
    assert max(batches) == 8
    assert engine.metrics.accepted_tokens > 0 and engine.metrics.accepted_tokens < engine.metrics.drafted_tokens
    for which, prompt in enumerate(SAMPLE_PROMPTS):
        contexts = np.array([list(prompt) + [x] for x in range(VOCAB)])
        probs = reference_probs(target_dir, contexts)
        joint = probs[0, -2][:, None] * probs[:, -1]  # p(x) p(y | x)
        counts = np.zeros((VOCAB, VOCAB))
        for rid in ids[which::2]:
            counts[tuple(updates[rid])] += 1
        pvalue, tv = compare(counts.ravel(), joint.ravel())
        assert pvalue > P_VALUE_MIN and tv < (joint.size / (DRAWS / 2)) ** 0.5, (which, pvalue, tv)
