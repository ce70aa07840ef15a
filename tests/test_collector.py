"""Importing verispec pauses Python's garbage collector and, at the end, freezes what the import made and collects
again as the importer did (verispec/collector.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("collecting", [True, False])
def test_the_import_leaves_collection_as_it_found_it_with_its_objects_frozen(collecting) -> None:
    code = (
        "import gc\n"
        f"{'' if collecting else 'gc.disable()'}\n"
        "import verispec\n"
        "print(gc.isenabled(), gc.get_freeze_count() > 0)\n"
        "class Cycle: pass\n"  # made after the import: collected as ever
        "a, b = Cycle(), Cycle(); a.b, b.a = b, a; del a, b\n"
        "print(gc.collect() >= 2)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ([str(collecting)] * 2 + ["True"])
