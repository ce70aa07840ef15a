"""Building verispec's CPU kernels (kernels/cpu.cpp) for this machine, once, and loading them with ctypes.

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

SOURCE = Path(__file__).with_name("cpu.cpp")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off"]  # no fused a*b+c but
# where cpu.cpp asks for one: RMSNorm and rotary round as PyTorch does


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
        key = hashlib.sha256("\0".join([SOURCE.read_text(), version, _cpu_id(), *FLAGS]).encode()).hexdigest()[:16]
        folder = Path(os.environ.get("VERISPEC_CACHE") or Path.home() / ".cache" / "verispec") / "kernels"
        library = folder / f"cpu-{key}.so"
        if not library.exists():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as scratch:  # compile aside, then move into place at once
                built = Path(scratch) / library.name
                done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True,
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


def _declare(lib: ctypes.CDLL) -> None:
    pointer, long = ctypes.c_void_p, ctypes.c_long
    for name in ("vs_linear_bf16", "vs_linear_f32"):  # x, ldx, w, bias, y, ldy, M, N, K
        getattr(lib, name).argtypes = [pointer, long, pointer, pointer, pointer, long, long, long, long]
    for name in ("vs_rms_norm_bf16", "vs_rms_norm_f32"):  # x, ldx, w, y, ldy, R, D, eps
        getattr(lib, name).argtypes = [pointer, long, pointer, pointer, long, long, long, ctypes.c_float]
    for name in ("vs_rotary_bf16", "vs_rotary_f32"):  # x, row, head, R, H, D, cos, sin
        getattr(lib, name).argtypes = [pointer, long, long, long, long, long, pointer, pointer]
    for name in ("vs_attend_bf16", "vs_attend_f32"):  # q, q_row, q_head, k, v, kv_head, visible, S, y, R, H, Hkv, D
        getattr(lib, name).argtypes = [pointer, long, long, pointer, pointer, long, pointer, long, pointer, long,
                                       long, long, long]


def library() -> ctypes.CDLL | None:
    """The kernels, built and loaded on first use; None where they are unavailable (see `reason`)."""
    return _load()[0]


def reason() -> str:
    """Why the kernels are or are not in use, in a few words."""
    return _load()[1]
