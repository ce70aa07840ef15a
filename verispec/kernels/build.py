"""Building verispec's CPU kernels (kernels/*.cpp) for this machine, once, and loading them with ctypes.

The library is compiled at first use with the system's C++ compiler for this very CPU (`-march=native`: the
kernels need AVX-512 with its bfloat16 dot product, as on Zen 4, Sapphire Rapids and later) and cached under
`$VERISPEC_CACHE` (default `~/.cache/verispec`), keyed by the source, the compiler and the CPU, so a one-shot CLI
call pays the compile (a few seconds) only the first time. No compiler, a CPU without those instructions, or
`VERISPEC_KERNELS=0` in the environment: the kernels are unavailable, `reason()` says why, and the runtime keeps
PyTorch's own kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

# Compiled together into one library (named, not globbed: a stale source left by an old install stays out)
SOURCES = [Path(__file__).with_name(name)
           for name in ("linear.cpp", "attend.cpp", "rows.cpp", "tokens.cpp", "replay.cpp")]
HEADER = Path(__file__).with_name("simd.h")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off"]  # no fused a*b+c but
# where the source asks for one: RMSNorm and rotary round as PyTorch does


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library, or None with the reason."""
    if os.environ.get("VERISPEC_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return None, "disabled by VERISPEC_KERNELS"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"no kernels for {platform.machine()}"
    compiler = _compiler()
    if compiler is None:
        return None, "no C++ compiler found (set CXX)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        texts = [path.read_text() for path in (*SOURCES, HEADER)]
        key = hashlib.sha256("\0".join([*texts, version, _cpu_id(), *FLAGS]).encode()).hexdigest()[:16]
        folder = Path(os.environ.get("VERISPEC_CACHE") or Path.home() / ".cache" / "verispec") / "kernels"
        library = folder / f"cpu-{key}.so"
        if not library.exists():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as scratch:  # compile aside, then move into place at once
                built = Path(scratch) / library.name
                done = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)], capture_output=True,
                                      text=True, timeout=300)
                if done.returncode != 0:
                    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
                    return None, f"the kernels did not compile ({compiler}): {last}"
                os.replace(built, library)
        lib = ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"the kernels could not be built or loaded: {error}"
    if not lib.vs_available():
        if "avx512_bf16" in _cpu_id():
            return None, f"{compiler} does not target AVX-512 with bfloat16 dot products (too old?)"
        return None, "this CPU lacks AVX-512 with bfloat16 dot products"
    _declare(lib)
    return lib, "built for this CPU"


KERNELS = ("linear_bf16", "linear_f32", "attend_bf16", "attend_f32", "rms_norm_bf16", "rms_norm_f32", "rotary_bf16",
           "rotary_f32", "silu_mul_bf16", "silu_mul_f32", "gather", "store_kv")  # each vs_<name>(const int64_t *)


def _declare(lib: ctypes.CDLL) -> None:
    for name in KERNELS:
        kernel = getattr(lib, f"vs_{name}")
        kernel.argtypes, kernel.restype = [ctypes.c_void_p], ctypes.c_int
    lib.vs_replay.argtypes, lib.vs_replay.restype = [ctypes.c_void_p, ctypes.c_long], ctypes.c_long


def library() -> ctypes.CDLL | None:
    """The kernels, built and loaded on first use; None where they are unavailable (see `reason`)."""
    return _load()[0]


def reason() -> str:
    """Why the kernels are or are not in use, in a few words."""
    return _load()[1]
