"""Every build of verispec's kernels this CPU runs (kernels/build.py): `VERISPEC_ISA` picks one, and the tests that
depend on the build pass on each, so that an AVX-512 machine also proves the AVX2 build that CPUs without AVX-512 take.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verispec import kernels
from verispec.kernels import build as build_module
from verispec.kernels.build import ISAS, chosen_isa, compiler, cpu_flags

TESTS = Path(__file__).parent
# What depends on the build: the kernels themselves, the quantized matmul, captures, exact mode (with PyTorch's
# oneDNN held to AVX2 as well, as on a CPU without AVX-512), the fast path's packing, and every row count on the
# kernels (PyTorch's row counts do not depend on the build and take minutes there)
BUILD_TESTS = [
    "test_kernels.py",
    "test_kernels_gemma.py",
    "test_gguf_gemma3.py",
    "test_quantized_matmul.py",
    "test_capture.py",
    "test_exact.py",
    "test_fast.py",
    "test_row_counts.py",
    "test_kv_dtype.py",
    "test_pool.py",
    "test_gather_blocks.py",
]
SKIP = "not built_once and not (row_counts and torch) and not unpadded"


def test_verispec_isa_asks_for_a_build_and_names_a_bad_one(monkeypatch) -> None:
    monkeypatch.setenv("VERISPEC_ISA", "bogus")
    assert chosen_isa() == (None, "VERISPEC_ISA=bogus is not one of auto, avx512, avx2vnni, avx2")
    for isa, (_, needs) in ISAS.items():
        monkeypatch.setenv("VERISPEC_ISA", isa)
        if needs <= cpu_flags():
            assert chosen_isa() == (isa, f"the {isa} build")
        else:
            assert chosen_isa()[1].startswith(f"this CPU cannot run the {isa} build (it lacks ")


def test_a_build_that_does_not_compile_gives_way_to_the_next_this_cpu_runs(monkeypatch) -> None:
    """A compiler too old for the best build's instructions (AVX-VNNI needs GCC 11): the next build runs, and the
    reason says why; asked for by VERISPEC_ISA, the build that failed is the answer."""
    runs = [isa for isa, (_, needs) in ISAS.items() if needs <= cpu_flags()]
    if len(runs) < 2 or compiler() is None:
        pytest.skip("this CPU runs one build, or there is no compiler")
    tried = []

    def build(compiler_path: str, isa: str):
        tried.append(isa)
        return (None, f"the {isa} build did not compile") if isa == runs[0] else ("loaded", "")

    monkeypatch.setattr(build_module, "_build", build)
    monkeypatch.delenv("VERISPEC_KERNELS", raising=False)  # (a run with the kernels off still tests the choice)
    monkeypatch.setenv("VERISPEC_ISA", "auto")
    assert build_module._load.__wrapped__() == (
        "loaded",
        f"the {runs[1]} build (the {runs[0]} build did not compile)",
        runs[1],
    )
    assert tried == runs[:2]
    monkeypatch.setenv("VERISPEC_ISA", runs[0])
    assert build_module._load.__wrapped__() == (None, f"the {runs[0]} build did not compile", None)


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler: no build of the kernels to test")
@pytest.mark.parametrize("isa", [isa for isa, (_, needs) in ISAS.items() if needs <= cpu_flags()])
def test_every_build_this_cpu_runs_passes_the_tests_that_depend_on_it(isa: str) -> None:
    if isa == kernels.isa():
        pytest.skip(f"the {isa} build is the one this whole run uses")
    # The kernels on (a run with VERISPEC_KERNELS=0 still proves every build), held to the build asked for.
    inherited = {name: value for name, value in os.environ.items() if name != "VERISPEC_KERNELS"}
    env = {**inherited, "VERISPEC_ISA": isa, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-p",
            "no:cacheprovider",
            "-k",
            SKIP,
            *(str(TESTS / name) for name in BUILD_TESTS),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
        cwd=TESTS.parent,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
