"""`verispec bench --startup`: how long a fresh process takes from its start to its first generated token, and its
peak resident memory, for `verispec generate --max-new-tokens 1` and (with `--llama-cpp`) llama.cpp's
`llama-completion -n 1` on the same GGUF file at the same thread count, the runs interleaved.

Each run is a whole process, its imports and the model's loading included: what a user waits for. The page cache is
warm (a first untimed run of each reads the file in). llama.cpp gets `-c CONTEXT` (its cache allocated at once; ours
grows as it needs) and `--no-warmup`, so that it too stops after one token.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verispec.bench.llamacpp import BINARIES
from verispec.bench.report import cpu_line, machine
from verispec.checkpoints.gguf_file import is_gguf
from verispec.errors import InvalidArgumentError
from verispec.openmp import child_environment

PROMPT = "def add(a, b):"
CONTEXT = 4096  # llama.cpp's -c: the cache it allocates (the issue that set the goal measured it so)


def commands(target: Path, threads: int, llama_cpp: Path | None) -> dict[str, list[str]]:
    """The command lines timed, by row."""
    rows = {
        "verispec": [
            sys.executable,
            "-m",
            "verispec.cli",
            "generate",
            "--target",
            str(target),
            "--threads",
            str(threads),
            "--max-new-tokens",
            "1",
            PROMPT,
        ]
    }
    if llama_cpp is not None:
        rows["llama.cpp"] = [
            str(llama_cpp / BINARIES["plain"]),
            "-m",
            str(target),
            "-p",
            PROMPT,
            "-n",
            "1",
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(CONTEXT),
            "-no-cnv",
            "--no-warmup",
        ]
    return rows


def run_once(command: list[str]) -> tuple[float, int]:
    """Seconds from the process's start to its exit, and its peak resident memory in bytes."""
    with tempfile.TemporaryFile() as log:  # (a file, not a pipe: llama.cpp's log would fill a pipe and stall)
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=child_environment())
        _, status, usage = os.wait4(process.pid, 0)  # (its own rusage: Popen.wait would not give it)
        seconds = time.perf_counter() - start
        process.returncode = code = os.waitstatus_to_exitcode(status)
        log.seek(0)
        error = log.read().decode(errors="replace").strip().splitlines()
    if code != 0:
        raise InvalidArgumentError(f"{Path(command[0]).name} exited with {code}" + (f": {error[-1]}" if error else ""))
    return seconds, usage.ru_maxrss * 1024


def run_startup(
    target: Path, out: Path, command: str, threads: int = 1, repeats: int = 5, llama_cpp: Path | None = None
) -> Path:
    """Time each row `repeats` times, interleaved, after one untimed run each; write startup.md."""
    if llama_cpp is not None and not is_gguf(target):
        raise InvalidArgumentError(f"--startup with llama.cpp times a GGUF file, which both run; {target} is a folder")
    rows = commands(target, threads, llama_cpp)
    for line in rows.values():
        run_once(line)  # the page cache warm, the kernels built
    runs: dict[str, list[tuple[float, int]]] = {label: [] for label in rows}
    for _ in range(repeats):
        for label, line in rows.items():
            runs[label].append(run_once(line))
    out.mkdir(parents=True, exist_ok=True)
    m = machine()
    md = [
        "# verispec bench --startup\n",
        f"Command: `{command}`  ",
        f"Machine: {cpu_line(m)}, {m['cores']} cores; torch {m['torch']}, Python {m['python']}\n",
        f"From a process's start to its exit after one generated token (`{PROMPT}`), {threads} thread(s), the page "
        f"cache warm, {repeats} runs each, interleaved; median (min-max). Peak RSS: the process's maximum "
        f"resident set. llama.cpp at `-c {CONTEXT} --no-warmup`.\n",
        "| row | start to first token (s) | peak RSS (MB) | command |",
        "|---|---|---|---|",
    ]
    medians = {}
    for label, results in runs.items():
        seconds, rss = [s for s, _ in results], [r / 2**20 for _, r in results]
        medians[label] = statistics.median(seconds), statistics.median(rss)
        md.append(
            f"| {label} | {medians[label][0]:.2f} ({min(seconds):.2f}-{max(seconds):.2f}) | "
            f"{medians[label][1]:.0f} ({min(rss):.0f}-{max(rss):.0f}) | `{' '.join(rows[label][1:])}` |"
        )
    if "llama.cpp" in medians:
        (ours_s, ours_rss), (theirs_s, theirs_rss) = medians["verispec"], medians["llama.cpp"]
        md.append(
            f"\nverispec against llama.cpp: {ours_s / theirs_s:.2f}x its time to the first token, "
            f"{ours_rss / theirs_rss:.2f}x its peak RSS."
        )
    path = out / "startup.md"
    path.write_text("\n".join(md) + "\n")
    return path
