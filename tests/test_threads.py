"""The thread policy: its default, its environment overrides, the checks on a count, and the count reaching both
torch and verispec's kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import verispec
from verispec import kernels
from verispec.errors import InvalidArgumentError
from verispec.kernels.build import library, pool_threads
from verispec.threads import MAX_THREADS, default_threads, physical_cores, set_threads, torch_threads


@pytest.fixture(autouse=True)
def _keep_threads(monkeypatch):
    monkeypatch.delenv("VERISPEC_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with torch_threads(torch.get_num_threads()):
        yield


@pytest.mark.parametrize("cores", [1, 2, 4, 16])
def test_default_is_the_physical_cores(monkeypatch, cores) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr("verispec.kernels.cores.physical_cores", lambda: cores)
    assert default_threads() == cores


def test_hyper_threads_of_one_core_count_once(tmp_path) -> None:
    """Two logical CPUs on each of two cores of one package: two physical cores."""
    for cpu, core in {0: 0, 1: 1, 2: 0, 3: 1}.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert physical_cores({0, 1, 2, 3}, tmp_path) == 2 and physical_cores({0, 2}, tmp_path) == 1


def test_unreadable_topology_counts_every_cpu(tmp_path) -> None:
    assert physical_cores({0, 1, 2}, tmp_path) == 3


def test_environment_overrides_the_default(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    monkeypatch.setenv("VERISPEC_THREADS", "2")  # ours first: OMP_NUM_THREADS may be set for other programs
    assert default_threads() == 2
    assert set_threads() == 2 and torch.get_num_threads() == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_environment_value_is_named(monkeypatch, value) -> None:
    monkeypatch.setenv("VERISPEC_THREADS", value)
    with pytest.raises(InvalidArgumentError, match=r"\$VERISPEC_THREADS must be an integer from 1 to 1024"):
        default_threads()


@pytest.mark.parametrize("threads", [0, -1, True, 1.5, "2", MAX_THREADS + 1])
def test_set_threads_refuses_what_is_not_a_count(threads) -> None:
    before = torch.get_num_threads()
    with pytest.raises(InvalidArgumentError, match="threads must be an integer from 1 to 1024"):
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


@pytest.mark.skipif(not kernels.available(torch.float32), reason="verispec's kernels do not run here")
def test_the_count_reaches_the_kernels_pool_and_is_restored() -> None:
    with torch_threads(3):
        assert pool_threads() == 3 and torch.get_num_threads() == 3
        with torch_threads(1):
            assert pool_threads() == 1
        assert pool_threads() == 3
    assert library().vs_set_threads(0) == -1 and library().vs_set_threads(MAX_THREADS + 1) == -1
    assert library().vs_max_threads() == MAX_THREADS


@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_import_sets_openmps_wait_policy_unless_given_and_llama_cpp_gets_its_own(given) -> None:
    """torch's OpenMP threads sleep after an op (not spin on the kernels' cores), unless the environment says
    otherwise; a child program (llama.cpp) gets the environment without the policy verispec chose for itself."""
    env = {name: value for name, value in os.environ.items() if name != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    code = (
        "import os, verispec; from verispec.openmp import child_environment; "
        "print(os.environ['OMP_WAIT_POLICY'], child_environment().get('OMP_WAIT_POLICY'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.stdout.split() == (["PASSIVE", "None"] if given is None else [given, given])
