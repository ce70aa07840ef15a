"""Tiny random checkpoints, built once per session in temporary folders."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from verispec.models.native import NativeModel, load_model
from verispec.models.random_init import random_checkpoint, random_pair, tiny_config


@pytest.fixture(scope="session")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random target and a draft made of its first layer: they agree on about half the tokens."""
    return random_pair(tmp_path_factory.mktemp("pair"), tiny_config(num_hidden_layers=3), draft_layers=1)


@pytest.fixture(scope="session")
def unrelated_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp("unrelated"), tiny_config(num_hidden_layers=1), seed=99)


@pytest.fixture(scope="session")
def target(pair_dirs: tuple[Path, Path]) -> NativeModel:
    return load_model(pair_dirs[0])


@pytest.fixture(scope="session")
def draft(pair_dirs: tuple[Path, Path]) -> NativeModel:
    return load_model(pair_dirs[1])


@pytest.fixture(scope="session")
def unrelated(unrelated_dir: Path) -> NativeModel:
    return load_model(unrelated_dir)


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread: the tensors are tiny, and a busy neighbour core stalls two-thread ops at barriers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
