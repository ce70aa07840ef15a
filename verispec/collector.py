"""Python's cyclic garbage collector while verispec is imported. Importing torch and verispec makes a few hundred
thousand objects (modules, classes, functions, torch's operator tables) that live as long as the process; the
collector, which runs every few hundred allocations, would traverse them again and again while they are made, and
in every full collection after. So it is paused from the package's first import (this module, imported first) to
the import's end (`resume`), where what exists is frozen (`gc.freeze`: never traversed again) and collection goes on
as before. Objects made later are collected as ever; objects that existed before `import verispec` are frozen too,
so one of them is not freed should it become cyclic garbage (`gc.unfreeze()` undoes the freezing); so is the cyclic
garbage the import itself left, which is small and would take the very collection the pause saves to free."""

from __future__ import annotations

import gc

COLLECTING = gc.isenabled()  # as the importer had it
gc.disable()


def resume() -> None:
    """The import's end: freeze what exists and collect again, if the importer did."""
    if COLLECTING:
        gc.freeze()
        gc.enable()
