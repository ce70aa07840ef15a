"""Tiny random checkpoints, built once per session in temporary folders."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from verispec.checkpoints.random_init import random_checkpoint, random_pair, tiny_config
from verispec.models.native import NativeModel, load_model
from verispec.reference import full_lm_forward, load_params
from verispec.threads import torch_threads
from vocabularies import twin_checkpoint


@pytest.fixture(scope="session")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random target and a draft made of its first layer: they agree on about half the tokens."""
    return random_pair(tmp_path_factory.mktemp("pair"), tiny_config(num_hidden_layers=3), draft_layers=1)


@pytest.fixture(scope="session")
def unrelated_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp("unrelated"), tiny_config(num_hidden_layers=1), seed=99)


# The pair in float32 (not load_model's default, bfloat16 where verispec's kernels run): the tests hold it to float32
# and float64 references, and to greedy identity outside exact mode.
@pytest.fixture(scope="session")
def target(pair_dirs: tuple[Path, Path]) -> NativeModel:
    return load_model(pair_dirs[0], dtype="float32")


@pytest.fixture(scope="session")
def draft(pair_dirs: tuple[Path, Path]) -> NativeModel:
    return load_model(pair_dirs[1], dtype="float32")


@pytest.fixture(scope="session")
def unrelated(unrelated_dir: Path) -> NativeModel:
    return load_model(unrelated_dir, dtype="float32")


@pytest.fixture(scope="session")
def twin_dir(tmp_path_factory: pytest.TempPathFactory, pair_dirs: tuple[Path, Path]) -> Path:
    """The pair's draft with another tokenizer (vocabularies.py)."""
    return twin_checkpoint(pair_dirs[1], tmp_path_factory.mktemp("twin"))


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread: the tensors are tiny, and a busy neighbour core stalls two-thread ops at barriers."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def reference_probs() -> Callable[..., np.ndarray]:
    """Exact next-token probabilities: (B, T, V) float64 softmax(logits / temperature) of the numpy reference's
    forward over token contexts (B, T) of a checkpoint folder."""

    def probs(checkpoint: Path, contexts: np.ndarray, temperature: float = 1.0) -> np.ndarray:
        logits = full_lm_forward(contexts, load_params(checkpoint)) / temperature
        exp = np.exp(logits - logits.max(-1, keepdims=True))
        return exp / exp.sum(-1, keepdims=True)

    return probs
