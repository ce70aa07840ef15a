"""Argument types at the entry points: what is accepted (numpy and torch integers, 1-D id tensors and arrays) and
what is refused with InvalidArgumentError before any model runs (bytes, booleans, strings where numbers go)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec import (
    DraftModel,
    InvalidArgumentError,
    LayerSkip,
    Lookahead,
    PromptLookup,
    SamplingParams,
    generate,
    stream,
)
from verispec.argument_checks import MAX_STOP_CHARS, MAX_STOP_STRINGS
from verispec.cli import main

PROMPT = [100, 101, 102, 40, 120, 41, 58, 10]


@pytest.mark.parametrize(
    "prompt",
    [
        torch.tensor(PROMPT),
        torch.tensor(PROMPT, dtype=torch.int32),
        np.array(PROMPT),
        np.array(PROMPT, dtype=np.uint16),
        tuple(PROMPT),
        [np.int64(t) for t in PROMPT],
    ],
    ids=["tensor", "tensor_int32", "array", "array_uint16", "tuple", "numpy_ints"],
)
def test_token_ids_in_any_integer_container_work(target, prompt) -> None:
    expected = generate(target, PROMPT, max_new_tokens=4, ignore_eos=True).tokens
    assert generate(target, prompt, max_new_tokens=4, ignore_eos=True).tokens == expected


@pytest.mark.parametrize(
    "prompt, message",
    [
        (b"def f(x):", "got bytes"),  # iterating bytes gives ints, which are not token ids
        (bytearray(b"abc"), "got bytearray"),
        ([True], "integers"),
        ([100, False], "integers"),
        ([np.True_], "integers"),
        ([1.0, 2.0], "integers"),
        (torch.tensor([PROMPT]), "got a 2-D Tensor"),
        (torch.tensor(5), "got a 0-D Tensor"),
        (torch.tensor(PROMPT, dtype=torch.float32), "of torch.float32"),
        (torch.tensor([True, False]), "of torch.bool"),
        (np.array(PROMPT, dtype=np.float64), "of float64"),
        (np.array([True]), "of bool"),
        (torch.tensor([5, 900]), r"in \[0, 257\)"),
        (None, "got NoneType"),
        (7, "got int"),
        (iter(PROMPT), "got list_iterator"),
    ],
)
def test_prompt_types_are_checked(target, prompt, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        stream(target, prompt)


@pytest.mark.parametrize(
    "stop, message",
    [
        ([1], "list of strings"),
        (b"\n", "list of strings"),
        ([b"\n"], "list of strings"),
        (["ok", None], "list of strings"),
        (3, "list of strings"),
        ("", "must not be empty"),
        (["\n", ""], "must not be empty"),
        (["x"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS} stop strings"),
        ("x" * (MAX_STOP_CHARS + 1), f"at most {MAX_STOP_CHARS} characters"),
        ("x" * 1_000_000, "at most"),
        (["ok", "a\ud800"], "lone surrogate"),
    ],
)
def test_stop_must_be_strings_checked_before_any_work(target, stop, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        stream(target, PROMPT, PromptLookup(2), stop=stop)  # stream() itself raises: nothing has run yet


def test_stop_none_or_tuple_are_fine(target) -> None:
    for stop in (None, ("zzz",)):
        assert generate(target, PROMPT, max_new_tokens=2, stop=stop).tokens


def test_numpy_integers_work_for_seed_and_max_new_tokens(target) -> None:
    options = dict(temperature=0.9, ignore_eos=True)
    expected = generate(target, PROMPT, max_new_tokens=6, seed=3, **options).tokens
    assert generate(target, PROMPT, max_new_tokens=np.int64(6), seed=np.uint32(3), **options).tokens == expected


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(max_new_tokens=4.0), "max_new_tokens"),
        (dict(max_new_tokens="4"), "max_new_tokens"),
        (dict(seed=True), "seed"),
        (dict(seed=False), "seed"),
        (dict(seed="1"), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(seed=-1), "seed"),
        (dict(temperature="0.5"), "temperature"),
        (dict(temperature=None), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(temperature=torch.tensor(0.5)), "temperature"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k="3"), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p="0.9"), "top_p"),
        (dict(top_p=None), "top_p"),
    ],
)
def test_wrong_types_are_invalid_arguments_not_type_errors(target, options, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        stream(target, PROMPT, **options)


def test_sampling_params_take_numpy_scalars_as_plain_numbers() -> None:
    params = SamplingParams(np.float32(0.5), np.int64(3), np.float64(0.9))
    assert params == SamplingParams(0.5, 3, 0.9)
    assert (type(params.temperature), type(params.top_k), type(params.top_p)) == (float, int, float)


@pytest.mark.parametrize("k", ["4", 2.0, True, None, np.float32(3)])
def test_drafter_sizes_must_be_integers(draft, k) -> None:
    makers = [
        lambda: DraftModel(draft, k),
        lambda: DraftModel(draft, 2, branch=k),
        lambda: PromptLookup(k),
        lambda: PromptLookup(2, max_ngram=k),
        lambda: LayerSkip([1], k),
        lambda: Lookahead(ngram=k),
    ]
    for make in makers:
        with pytest.raises(InvalidArgumentError, match="must be an integer"):
            make()


def test_drafter_sizes_take_numpy_integers(draft) -> None:
    assert [
        DraftModel(draft, np.int64(3)).k,
        PromptLookup(np.int32(2)).k,
        LayerSkip([1], np.uint8(5)).k,
        Lookahead(ngram=np.int16(3)).k,
    ] == [3, 2, 5, 2]
    assert type(DraftModel(draft, np.int64(3)).k) is int


def test_cli_refuses_an_empty_stop_string(capsys, pair_dirs) -> None:
    code = main(["generate", "p", "--target", str(pair_dirs[0]), "--stop", "", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("verispec: error:") and err.count("\n") == 1 and "stop strings must not be empty" in err


def test_the_longest_and_most_stop_strings_allowed_work(target) -> None:
    stops = ["x" * MAX_STOP_CHARS] + [f"never{i}" for i in range(MAX_STOP_STRINGS - 1)]
    expected = generate(target, PROMPT, max_new_tokens=6, ignore_eos=True)
    assert generate(target, PROMPT, max_new_tokens=6, ignore_eos=True, stop=stops).tokens == expected.tokens


@pytest.mark.parametrize("prompt", ["\ud800", "ok \udfff then"])
def test_a_lone_surrogate_in_a_prompt_is_refused(target, prompt) -> None:
    with pytest.raises(InvalidArgumentError, match="lone surrogate"):
        generate(target, prompt, max_new_tokens=2)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 5e-324])
def test_a_temperature_below_the_greedy_floor_decodes_greedily(target, temperature) -> None:
    """Positive in float64, 0 in float32: once a 0/0 in the sampler (every request in a server batch failed)."""
    expected = generate(target, PROMPT, max_new_tokens=6, ignore_eos=True).tokens
    assert (
        generate(target, PROMPT, PromptLookup(2), max_new_tokens=6, ignore_eos=True, temperature=temperature).tokens
        == expected
    )


def test_cli_decodes_greedily_below_the_floor_and_refuses_a_vanishing_top_p(capsys, pair_dirs) -> None:
    base = ["generate", "p", "--target", str(pair_dirs[0]), "--max-new-tokens", "3", "--color", "never"]
    assert main([*base, "--temperature", "1e-300"]) == 0
    text = capsys.readouterr().out.split("\n\n")[0]  # the stats line after it holds times
    assert main(base) == 0 and capsys.readouterr().out.split("\n\n")[0] == text
    assert main([*base, "--temperature", "1", "--top-p", "1e-300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verispec: error:") and err.count("\n") == 1 and "top_p must be in" in err
