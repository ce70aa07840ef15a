"""Building verispec's CPU kernels (kernels/*.cpp) for this machine, once, and loading them with ctypes.

The same sources are built for one of three instruction sets, whichever is the best this CPU has:
- `avx512`: AVX-512 (F, BW, VL, DQ) with bfloat16 dot products and VNNI (AMD Zen 4 and later, Intel Sapphire
  Rapids and later);
- `avx2vnni`: `avx2` with AVX-VNNI (Intel Alder Lake and later): the quantized matmul's int8 dot products on 256 bits;
- `avx2`: x86-64-v3 (AVX2, FMA, F16C: Intel Haswell, AMD Zen and later), bfloat16 widened to float32.
`VERISPEC_ISA=avx2` (or `avx2vnni`, `avx512`) asks for one; `auto` (the default) takes the best, or where that does
not compile (an older compiler), the next. The library is compiled at first
use with the system's C++ compiler and cached under `$VERISPEC_CACHE` (default `~/.cache/verispec`), keyed by the
source, the compiler and the instruction set, so a one-shot CLI call pays the compile only the first time. The
sources compile as separate units side by side, one process per core this process may run on (attention's kernels,
most of the compile, as three units: one per type of query and cache), then link into one library. No compiler, a
CPU without the instructions asked for, or `VERISPEC_KERNELS=0` in the environment: the kernels are unavailable,
`reason()` says why, and the runtime keeps PyTorch's own kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from verispec.kernels import cores

# Linked into one library (named, not globbed: a stale source left by an old install stays out)
SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "linear.cpp",
        "quant.cpp",
        "pack.cpp",
        "attend.cpp",
        "rows.cpp",
        "tokens.cpp",
        "replay.cpp",
        "pool.cpp",
    )
]
HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "pool.h")]
# Units compiled apart (a source and its defines): attend.cpp's three types, each alone (VS_ATTEND)
UNITS = [
    (source, [f"-DVS_ATTEND={i}"]) if source.name == "attend.cpp" else (source, [])
    for source in SOURCES
    for i in (range(3) if source.name == "attend.cpp" else [0])
]
FLAGS = [
    "-O3",
    "-shared",
    "-fPIC",
    "-pthread",
    "-std=c++17",
    "-ffp-contract=off",
]  # no fused a*b+c but where the source asks
# for one: RMSNorm and rotary round as PyTorch does
# Each build: its compiler flags, and the /proc/cpuinfo flags a CPU needs to run it (best first)
ISAS = {
    "avx512": (
        ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"},
    ),
    "avx2vnni": (["-march=x86-64-v3", "-mavxvnni"], {"avx2", "fma", "f16c", "avx_vnni"}),
    "avx2": (["-march=x86-64-v3"], {"avx2", "fma", "f16c"}),
}


_requested: int | None = None  # the pool's count, set last (verispec.set_threads); None: the default at load


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags, as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def _asked() -> str:
    """The build VERISPEC_ISA asks for ("auto" where none)."""
    return os.environ.get("VERISPEC_ISA", "auto").strip().lower() or "auto"


def chosen_isa() -> tuple[str | None, str]:
    """The build to use here (None where none runs), and why: the best this CPU runs, or the one VERISPEC_ISA asks
    for."""
    asked = _asked()
    if asked != "auto" and asked not in ISAS:
        return None, f"VERISPEC_ISA={asked} is not one of auto, {', '.join(ISAS)}"
    flags = cpu_flags()
    for isa, (_, needs) in ISAS.items():
        if asked in ("auto", isa) and needs <= flags:
            return isa, f"the {isa} build"
    if asked != "auto":
        return None, f"this CPU cannot run the {asked} build (it lacks {' '.join(sorted(ISAS[asked][1] - flags))})"
    return None, "this CPU has neither AVX-512 with bfloat16 dot products nor AVX2 with FMA and F16C"


def compiler() -> str | None:
    """The C++ compiler the kernels are built with ($CXX, else the first on PATH), None where there is none."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _compile(compiler_path: str, flags: list[str], scratch: Path, built: Path) -> str | None:
    """Compile the units side by side and link them into `built`; None, or the first failure's last line."""

    def run(command: list[str]) -> str | None:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no message"])[-1]

    objects = [scratch / f"{i}-{source.stem}.o" for i, (source, _) in enumerate(UNITS)]
    commands = [
        [compiler_path, *flags, *defines, "-c", str(source), "-o", str(obj)]
        for (source, defines), obj in zip(UNITS, objects)
    ]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=max(1, min(len(commands), cores))) as pool:
        failed = [error for error in pool.map(run, commands) if error is not None]
    return failed[0] if failed else run([compiler_path, *flags, *map(str, objects), "-o", str(built)])


@cache
def _load() -> tuple[ctypes.CDLL | None, str, str | None]:
    """The loaded library, or None with the reason, and the build loaded. Where the best build does not compile (a
    compiler too old for its instructions) and none was asked for, the next one this CPU runs is tried."""
    if os.environ.get("VERISPEC_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return None, "disabled by VERISPEC_KERNELS", None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"no kernels for {platform.machine()}", None
    isa, why = chosen_isa()
    if isa is None:
        return None, why, None
    compiler_path = compiler()
    if compiler_path is None:
        return None, "no C++ compiler found (set CXX)", None
    # asked for, that build; else every build this CPU runs, best first (chosen_isa's is the first)
    builds = [isa] if _asked() != "auto" else [name for name, (_, needs) in ISAS.items() if needs <= cpu_flags()]
    failures = []
    for build in builds:
        lib, failed = _build(compiler_path, build)
        if lib is not None:
            return lib, f"the {build} build" + (f" ({failures[0]})" if failures else ""), build
        failures.append(failed)
    return None, failures[0], None


def _build(compiler_path: str, isa: str) -> tuple[ctypes.CDLL | None, str]:
    """The library for one build, compiled here unless cached, or None and why."""
    flags = [*FLAGS, *ISAS[isa][0]]
    try:
        version = subprocess.run([compiler_path, "--version"], capture_output=True, text=True, timeout=30).stdout
        texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
        key = hashlib.sha256("\0".join([*texts, version, *flags]).encode()).hexdigest()[:16]
        folder = Path(os.environ.get("VERISPEC_CACHE") or Path.home() / ".cache" / "verispec") / "kernels"
        library = folder / f"{isa}-{key}.so"
        if not library.exists():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as scratch:  # compile aside, then move into place at once
                built = Path(scratch) / library.name
                failed = _compile(compiler_path, flags, Path(scratch), built)
                if failed is not None:
                    return None, f"the {isa} build did not compile ({compiler_path}): {failed}"
                os.replace(built, library)
        lib = ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"the kernels could not be built or loaded: {error}"
    if not lib.vs_available():
        return None, f"{compiler_path} does not target the {isa} build's instructions (too old?)"
    _declare(lib)
    lib.vs_set_threads(_requested or _first_count())
    return lib, ""


KERNELS = (
    "linear_bf16",
    "linear_f32",
    "linear_q8_0",
    "linear_q4_0",
    "linear_q4_1",
    "linear_q5_0",
    "linear_q5_1",
    "linear_q4_k",
    "linear_q5_k",
    "linear_q6_k",
    "attend_bf16",
    "attend_f32",
    "attend_f32_f16",
    "rms_norm_bf16",
    "rms_norm_f32",
    "head_norm_bf16",
    "head_norm_f32",
    "rotary_bf16",
    "rotary_f32",
    "silu_mul_bf16",
    "silu_mul_f32",
    "gelu_tanh_mul_bf16",
    "gelu_tanh_mul_f32",
    "scale_bf16",
    "scale_f32",
    "gather",
    "gather_widen",
    "gather_blocks",
    "store_kv",
    "store_kv_f16",
    "pack_quantized",
)  # each vs_<name>(const int64_t *)


def _declare(lib: ctypes.CDLL) -> None:
    for name in KERNELS:
        kernel = getattr(lib, f"vs_{name}")
        kernel.argtypes, kernel.restype = [ctypes.c_void_p], ctypes.c_int
    lib.vs_replay.argtypes, lib.vs_replay.restype = [ctypes.c_void_p, ctypes.c_long], ctypes.c_long
    lib.vs_replay_timed.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    lib.vs_replay_timed.restype = ctypes.c_long
    lib.vs_cols.argtypes, lib.vs_cols.restype = [], ctypes.c_long
    lib.vs_set_threads.argtypes, lib.vs_set_threads.restype = [ctypes.c_long], ctypes.c_int
    lib.vs_threads.argtypes, lib.vs_threads.restype = [], ctypes.c_long
    lib.vs_max_threads.argtypes, lib.vs_max_threads.restype = [], ctypes.c_long


def _first_count() -> int:
    """The pool's count where none was set: the default, or the physical cores where the environment's is not a count
    (verispec.threads reports that when it is asked for the default)."""
    try:
        return cores.default_threads()
    except ValueError:
        return cores.physical_cores()


def set_pool_threads(threads: int) -> None:
    """The kernels' thread count (`verispec.set_threads` sets it with torch's), applied now or when they load."""
    global _requested
    _requested = threads
    if _load.cache_info().currsize and library() is not None:
        library().vs_set_threads(threads)


def requested_threads() -> int | None:
    """The count set last, None where none was."""
    return _requested


def pool_threads() -> int:
    """The thread count the loaded kernels run on (1 where none are loaded)."""
    return library().vs_threads() if _load.cache_info().currsize and library() is not None else 1


def library() -> ctypes.CDLL | None:
    """The kernels, built and loaded on first use; None where they are unavailable (see `reason`)."""
    return _load()[0]


def reason() -> str:
    """Why the kernels are or are not in use, in a few words ("the avx512 build", or why none runs)."""
    return _load()[1]


def isa() -> str | None:
    """The build the loaded kernels are ("avx512", "avx2vnni" or "avx2"), None where none runs."""
    return _load()[2]
