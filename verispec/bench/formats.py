"""`verispec bench --formats`: a target's forward in every weight format verispec's kernels run, beside each format's
weight-read time: the 1-token step, and r(n), the time for n tokens over the time for 1, for n = 1 .. 16 (what
verification of a chain or tree of n - 1 drafts costs, in units of a plain step).

The formats: float32 and bfloat16 (every weight in the dtype), Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 (the projections in
the block format, the LM head in Q8_0, float32 activations: `load_model(quantize=)`), and a GGUF file's own formats
(`dtype="auto"`), beside its default float16 key/value cache and a float32 one. All are loaded at once and timed in
turns, round by round (medians over the rounds), after the cache holds `context` tokens; at one thread, and again
at the run's thread count where that is more, each beside the read bandwidth measured at that count.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from verispec import kernels
from verispec.bench.bandwidth import read_bandwidth, weight_bytes
from verispec.bench.report import cpu_line, machine
from verispec.checkpoints.blocks import FORMATS
from verispec.checkpoints.gguf_file import is_gguf
from verispec.models.captured import CapturedForward
from verispec.models.native import NativeModel, load_model
from verispec.models.precision import formats
from verispec.models.timing import forward_seconds
from verispec.threads import torch_threads

WIDTHS = tuple(range(1, 17))
SETTINGS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    **{fmt: dict(dtype="float32", quantize=fmt) for fmt in FORMATS},
}


def settings(target: Path) -> dict[str, dict]:
    """Each format's load options (a GGUF target's own formats too, as "file", and beside a float32 cache rather
    than its default float16 one)."""
    file = {"file": dict(dtype="auto"), "file, float32 cache": dict(dtype="auto", kv_dtype="float32")}
    return SETTINGS | (file if is_gguf(target) else {})


def measure(
    models: dict[str, NativeModel], rounds: int, context: int
) -> tuple[dict[str, dict[int, float]], dict[str, float], float]:
    """Seconds of a forward of n tokens for each model and n, the median over `rounds` rounds in turns; each model's
    1-token step over its weight-read time, the median over the rounds of the step over the read time at that
    moment (the read bandwidth measured just before the step: a shared host's moves within minutes); and
    the median read bandwidth (bytes per second)."""
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in WIDTHS} for name in models}
    ratios: dict[str, list[float]] = {name: [] for name in models}
    bandwidths = []
    for _ in range(rounds):
        for name, model in models.items():
            bandwidths.append(read_bandwidth(repeats=3))
            for n in WIDTHS:
                times[name][n].append(forward_seconds(model, n, context, repeats=5 if n == 1 else 3))
            ratios[name].append(times[name][1][-1] / (weight_bytes(model) / bandwidths[-1]))
    return (
        {name: {n: statistics.median(ts) for n, ts in by_n.items()} for name, by_n in times.items()},
        {name: statistics.median(r) for name, r in ratios.items()},
        statistics.median(bandwidths),
    )


def by_kernel(model: NativeModel, context: int, repeats: int = 21) -> dict[str, float]:
    """Seconds of a 1-token step's captured forward in each kernel, by name (medians of timed replays), after
    `context` cached tokens. Empty where the step is not captured (verispec's kernels do not run)."""
    cache = model.new_cache(context + 1)  # alive while the replays write into it
    model(torch.arange(context)[None] % model.vocab_size, cache)
    model(torch.tensor([[1]]), cache)  # replays the step's capture into this cache, which it is then bound to
    steps = [
        c
        for c in model.execution.captured.values()
        if isinstance(c, CapturedForward) and c.rows == 1 and c.bound() is cache
    ]
    return steps[0].program.timed(repeats) if steps else {}


def _split(kernels_s: dict[str, float]) -> str:
    """The matmuls (by format) and the rest, as shares of the replay."""
    total = sum(kernels_s.values()) or 1.0
    parts = sorted(kernels_s.items(), key=lambda item: -item[1])
    return ", ".join(f"{name} {seconds / total:.0%}" for name, seconds in parts if seconds / total >= 0.01)


def run_formats(target: Path, out: Path, command: str, rounds: int = 7, context: int = 256, threads: int = 1) -> Path:
    """Load the target in every format, time them at one thread and at `threads`, write formats.md into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        models = {name: load_model(target, **options) for name, options in settings(target).items()}
        where = machine()
        sections = []
        for count in sorted({1, threads}):
            with torch_threads(count):
                seconds, step_over_read, bandwidth = measure(models, rounds, context)
                kernel_s = {name: by_kernel(model, context) for name, model in models.items()}
            sections += _section(models, count, seconds, step_over_read, bandwidth, kernel_s)
    lines = [
        f"# Forward by weight format: {target.name}",
        "",
        f"Command: `{command}`  ",
        f"Machine: {cpu_line(where)}, {where['cores']} cores; torch {where['torch']}, Python {where['python']}; "
        f"verispec's kernels: {kernels.reason()}  ",
        f"After {context} cached tokens; medians of {rounds} rounds in turns, at each thread count. Step / read "
        "is the median over the rounds of the step over the read time (the weights' bytes over the read "
        "bandwidth at that thread count, measured just before it: the floor under a 1-token step).",
        "",
        *sections,
    ]
    path = out / "formats.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _section(
    models: dict[str, NativeModel],
    threads: int,
    seconds: dict[str, dict[int, float]],
    step_over_read: dict[str, float],
    bandwidth: float,
    kernel_s: dict[str, dict[str, float]],
) -> list[str]:
    """The report's lines for one thread count."""
    lines = [
        f"## {threads} thread{'s' if threads > 1 else ''}",
        "",
        f"Read bandwidth: {bandwidth / 1e9:.1f} GB/s (the median of the rounds).",
        "",
        "| format | linears | cache | weights (MB) | weight-read (ms) | 1-token step (ms) | step / read | "
        + " | ".join(f"r({n})" for n in WIDTHS[1:])
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * (len(WIDTHS) - 1),
    ]
    for name, model in models.items():
        size, one = weight_bytes(model), seconds[name][1]
        kinds = ", ".join(f"{k} x {v}" for k, v in formats(model.module).items())
        cache = str(model.kv_dtype).removeprefix("torch.")
        lines.append(
            f"| {name} | {kinds} | {cache} | {size / 1e6:.0f} | {size / bandwidth * 1e3:.2f} | "
            f"{one * 1e3:.2f} | {step_over_read[name]:.2f}x | "
            + " | ".join(f"{seconds[name][n] / one:.2f}" for n in WIDTHS[1:])
            + " |"
        )
    lines += [
        "",
        "Where a 1-token step's replay spends its time, by kernel (timed replays of its captured forward; "
        "the rest of the step is Python around it):",
        "",
        "| format | replay (ms) | step less replay (ms) | by kernel |",
        "|---|---|---|---|",
    ]
    for name in models:
        replay = sum(kernel_s[name].values())
        lines.append(
            f"| {name} | {replay * 1e3:.2f} | {(seconds[name][1] - replay) * 1e3:.2f} | "
            f"{_split(kernel_s[name]) or '(not captured: no kernels here)'} |"
        )
    return lines + [""]
