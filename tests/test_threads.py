"""The thread policy: its default, its environment overrides, and the checks on a count."""

from __future__ import annotations

import os

import pytest
import torch

import verispec
from verispec.errors import InvalidArgumentError
from verispec.threads import default_threads, set_threads, torch_threads


@pytest.fixture(autouse=True)
def _keep_threads(monkeypatch):
    monkeypatch.delenv("VERISPEC_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with torch_threads(torch.get_num_threads()):
        yield


@pytest.mark.parametrize("cores, expected", [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_default_leaves_a_core_free(monkeypatch, cores, expected) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_threads() == expected


def test_environment_overrides_the_default(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    monkeypatch.setenv("VERISPEC_THREADS", "2")  # ours first: OMP_NUM_THREADS may be set for other programs
    assert default_threads() == 2
    assert set_threads() == 2 and torch.get_num_threads() == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_environment_value_is_named(monkeypatch, value) -> None:
    monkeypatch.setenv("VERISPEC_THREADS", value)
    with pytest.raises(InvalidArgumentError, match=r"\$VERISPEC_THREADS must be an integer >= 1"):
        default_threads()


@pytest.mark.parametrize("threads", [0, -1, True, 1.5, "2"])
def test_set_threads_refuses_what_is_not_a_count(threads) -> None:
    before = torch.get_num_threads()
    with pytest.raises(InvalidArgumentError, match="threads must be an integer >= 1"):
        set_threads(threads)
    assert torch.get_num_threads() == before


def test_torch_threads_restores_the_count_even_after_an_error() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with torch_threads(1) as threads:
            assert threads == 1 and torch.get_num_threads() == 1
            raise RuntimeError
    assert torch.get_num_threads() == before


def test_exported_from_the_package() -> None:
    assert verispec.set_threads is set_threads and verispec.torch_threads is torch_threads
    assert verispec.default_threads is default_threads
