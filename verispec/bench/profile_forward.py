"""`verispec bench --profile`: where a 1-token forward's time goes, by kind of work, beside the time it takes to
read the weights once, in float32 and bfloat16, ordinary and exact mode, with and without the fast path."""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from verispec import kernels
from verispec.bench.bandwidth import read_bandwidth, weight_bytes
from verispec.bench.report import cpu_line, machine
from verispec.checkpoints.gguf_file import is_gguf
from verispec.kernels.capture import Program
from verispec.models import llama
from verispec.models.native import NativeModel, load_model

MARK = "verispec/"  # the prefix of our labels among the profiler's events
MATMULS = {
    "q_proj": "matmul q, k, v",
    "k_proj": "matmul q, k, v",
    "v_proj": "matmul q, k, v",
    "qkv": "matmul q, k, v",
    "o_proj": "matmul o",
    "o": "matmul o",
    "gate_proj": "matmul gate, up",
    "up_proj": "matmul gate, up",
    "gate_up": "matmul gate, up",
    "down_proj": "matmul down",
    "down": "matmul down",
    "lm_head": "matmul LM head",
    "head": "matmul LM head",
}
BY_CLASS = {
    llama.RMSNorm: "norms",
    llama.Attention: "attention (scores, softmax, values, cache writes)",
    llama.MLP: "silu(gate) * up",
    nn.Embedding: "embedding",
}
OTHER = "other ops (exact mode's row layout and padding, slicing)"
OVERHEAD = "Python, dispatch and the profiler (the profiled forward less its ops)"
REST = "wall time less all ops (Python and dispatch, at least)"
FORWARD = "forward"
KERNEL = "kernel"  # a call into verispec's own kernels (ctypes: no PyTorch op of its own to time)
KERNEL_CALLS = ("attend", "rms_norm", "rotary_", "silu_mul", "gather")  # and each `kernels.Matmul` call
REPLAY = "replayed kernel calls (a captured forward's kernels in one C call)"
KINDS = {
    "plain": "plain",
    "fast": "packed (PyTorch's kernels)",
    "own": "own kernels, op by op",
    "captured": "own kernels, captured and replayed",
}
ORDER = [
    *dict.fromkeys(MATMULS.values()),
    BY_CLASS[llama.Attention],
    "rotary",
    "norms",
    "silu(gate) * up",
    "embedding",
    REPLAY,
    OTHER,
    OVERHEAD,
]


@dataclass
class ForwardProfile:
    """One setting's 1-token forward: the median wall time (no profiler) and the median ms of each kind of work."""

    dtype: str
    exact: bool
    kind: str  # a key of KINDS
    wall_ms: float
    kinds_ms: dict[str, float]
    weight_bytes: int


def _label(name: str, module: nn.Module) -> str | None:
    attribute = name.rsplit(".", 1)[-1]
    if attribute in MATMULS and not isinstance(module, nn.Embedding):
        return MATMULS[attribute]
    return next((label for cls, label in BY_CLASS.items() if isinstance(module, cls)), None)


def _labelled(model: NativeModel, stack: ExitStack) -> None:
    """Wrap each module's forward, and the rotary functions, in a profiler range named for its kind of work."""

    def enter(label: str):
        def hook(*_) -> None:
            ranges.append(record_function(MARK + label).__enter__())

        return hook

    def leave(*_) -> None:
        ranges.pop().__exit__(None, None, None)

    def wrapped(function, label: str):
        def call(*args, **kwargs):
            with record_function(MARK + label):
                return function(*args, **kwargs)

        return call

    ranges: list = []
    for name, module in model.module.named_modules():
        label = _label(name, module)
        if label is not None:
            stack.callback(module.register_forward_pre_hook(enter(label)).remove)
            stack.callback(module.register_forward_hook(leave).remove)
    for function in ("rotary", "apply_rotary"):
        stack.enter_context(mock.patch.object(llama, function, wrapped(getattr(llama, function), "rotary")))
    stack.enter_context(mock.patch.object(kernels.Matmul, "__call__", wrapped(kernels.Matmul.__call__, KERNEL)))
    stack.enter_context(mock.patch.object(Program, "__call__", wrapped(Program.__call__, REPLAY)))
    for function in KERNEL_CALLS:
        call = wrapped(getattr(kernels, function), KERNEL)
        stack.enter_context(
            mock.patch.object(kernels, function, wrapped(call, "rotary") if function == "rotary_" else call)
        )


def _labelled_parent(event):
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(MARK):
        parent = parent.cpu_parent
    return parent


def _kinds(events) -> dict[str, float]:
    """ms of op self time by the innermost labelled range around each op; a call into verispec's kernels counts
    whole (its ctypes call and the ops inside it) for the range around it."""
    kinds: dict[str, float] = {}
    for event in events:
        if event.name == MARK + FORWARD:
            kinds[OVERHEAD] = kinds.get(OVERHEAD, 0.0) + event.cpu_time_total / 1e3
        whole = event.name in (MARK + KERNEL, MARK + REPLAY)
        if event.name.startswith(MARK) and not whole:
            continue
        parent = _labelled_parent(event)
        if not whole and parent is not None and parent.name in (MARK + KERNEL, MARK + REPLAY):
            continue  # counted with its kernel call
        label = OTHER if parent is None or parent.name == MARK + FORWARD else parent.name[len(MARK) :]
        if event.name == MARK + REPLAY:
            label = REPLAY
        spent = (event.cpu_time_total if whole else event.self_cpu_time_total) / 1e3
        kinds[label] = kinds.get(label, 0.0) + spent
        kinds[OVERHEAD] = kinds.get(OVERHEAD, 0.0) - spent
    return kinds


class _Setting:
    """A loaded model with a cache of `context` tokens, ready to time and profile its 1-token forward."""

    def __init__(self, model: NativeModel, context: int) -> None:
        self.model, self.context, self.token = model, context, torch.tensor([[1]])
        self.cache = model.new_cache(context + 1)
        model(torch.arange(context)[None] % model.vocab_size, self.cache)
        self.walls: list[float] = []
        self.profiles: list[dict[str, float]] = []
        for _ in range(3):  # warm-up: first calls choose and prepare kernels
            self.step()

    def step(self) -> None:
        self.model(self.token, self.cache)
        self.cache.truncate(self.context)

    def time(self, forwards: int) -> None:
        for _ in range(forwards):
            start = time.perf_counter()
            self.step()
            self.walls.append((time.perf_counter() - start) * 1e3)

    def profile(self) -> None:
        with ExitStack() as stack:
            _labelled(self.model, stack)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                with record_function(MARK + FORWARD):
                    self.step()
        self.profiles.append(_kinds(prof.events()))

    def result(self) -> tuple[float, dict[str, float]]:
        kinds = {k: statistics.median(p.get(k, 0.0) for p in self.profiles) for k in ORDER}
        return statistics.median(self.walls), kinds


FILE = "file's formats"  # the setting of a GGUF file's own blocks (beside float32 and bfloat16)


def profile_all(
    target_dir: Path, context: int = 256, rounds: int = 15, per_round: int = 3
) -> tuple[list[ForwardProfile], float]:
    """Every setting (float32 and bfloat16, ordinary and exact mode; plain, packed on PyTorch's kernels and on
    verispec's own where this machine has them; a GGUF file's own block formats too, on verispec's), loaded side by
    side and
    measured in turns, `per_round` timed forwards and one profiled forward each per round, with the read bandwidth
    measured in each round too, so that the machine's changing load falls on all alike; medians over the rounds.
    Returns the settings' profiles and the read bandwidth (bytes per second)."""
    on_kernels = ["own", "captured"] if kernels.available(torch.float32) else []
    keys = [
        (dtype, exact, kind)
        for dtype in ("float32", "bfloat16")
        for exact in (False, True)
        for kind in ["plain", "fast", *on_kernels]
    ]
    if is_gguf(target_dir):  # its blocks kept, as `--dtype auto` runs them (only on verispec's kernels)
        keys += [(FILE, exact, kind) for exact in (False, True) for kind in on_kernels]
    settings = {key: _Setting(_load(target_dir, *key), context) for key in keys}
    bandwidths = []
    for _ in range(rounds):
        bandwidths.append(read_bandwidth(repeats=3))
        for setting in settings.values():
            setting.time(per_round)
            setting.profile()
    out = []
    for (dtype, exact, kind), setting in settings.items():
        wall, kinds = setting.result()
        out.append(ForwardProfile(dtype, exact, kind, wall, kinds, weight_bytes(setting.model)))
    return out, statistics.median(bandwidths)


def _load(target_dir: Path, dtype: str, exact: bool, kind: str) -> NativeModel:
    if dtype == FILE:  # the file's blocks are kept only where the model is packed on verispec's kernels at load
        model = load_model(target_dir, dtype="auto", exact=exact)
    else:
        model = load_model(target_dir, dtype=dtype, exact=exact, fast=False)
        if kind != "plain":
            model.pack(16 if exact else 1, own_kernels=kind in ("own", "captured"))
    model.execution.capture = kind == "captured"
    return model


def write_profile(out: Path, target_dir: Path, profiles: list[ForwardProfile], bandwidth: float, command: str) -> Path:
    """forward-profile.md: the settings side by side, ms per kind of work, and each against its weight-read time."""
    m = machine()
    names = [f"{p.dtype} {'exact' if p.exact else 'ordinary'} {p.kind}" for p in profiles]
    lines = [
        "# The 1-token forward, profiled\n",
        f"Command: `{command}`  ",
        f"Target: {target_dir.name}; machine: {cpu_line(m)}, {m['cores']} cores, {m['torch_threads']} thread(s), "
        f"torch {m['torch']}.  ",
        f"Read bandwidth: {bandwidth / 1e9:.1f} GB/s (a timed sum over a 256 MB float32 tensor, at the run's "
        "threads; the median over the rounds below).\n",
        f"One token after 256 cached ones; the {len(profiles)} settings loaded side by side and measured in turns "
        "(each round: 3 timed forwards and 1 profiled forward of each), so that the machine's changing load falls on "
        "all alike. Wall time: median of the unprofiled forwards. Kinds of work: median over the profiled forwards "
        "(torch.profiler; op self time, by the innermost module or rotary call around the op). The profiler's own "
        "cost inflates the ops and sits in the profiled forward's time less its ops', an upper bound on Python and "
        "dispatch; the unprofiled wall time less the ops' time is a lower bound. A call into verispec's kernels "
        "counts whole for the kind of work around it; the residual adds count with the o and down projections, which "
        "add them. Plain: eager F.linear per projection; fast: prepacked and fused matmuls on PyTorch's kernels "
        "(oneDNN, MKL; models/linear.py); own: verispec's kernels (verispec/kernels: matmuls, attention, RMSNorm, "
        "rotary, silu(gate) * up, embedding rows), called one by one from Python; captured: the same kernel calls, "
        "captured once and replayed by one C call (models/captured.py), what `load_model(fast=True)` runs where the "
        "CPU has "
        "them (" + kernels.reason() + ").\n",
        "| setting | ms per forward | weights | weight-read time | forward / weight-read |",
        "|---|---|---|---|---|",
    ]
    for name, p in zip(names, profiles):
        read_ms = p.weight_bytes / bandwidth * 1e3
        lines.append(
            f"| {name} | {p.wall_ms:.2f} | {p.weight_bytes / 1e6:.0f} MB | {read_ms:.2f} ms | "
            f"{p.wall_ms / read_ms:.1f}x |"
        )
    lines += [
        "\n## ms per forward by kind of work\n",
        "| kind | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for kind in ORDER:
        lines.append(f"| {kind} | " + " | ".join(f"{p.kinds_ms[kind]:.2f}" for p in profiles) + " |")
    rest = [max(0.0, p.wall_ms - sum(v for k, v in p.kinds_ms.items() if k != OVERHEAD)) for p in profiles]
    lines.append(f"| {REST} | " + " | ".join(f"{r:.2f}" for r in rest) + " |")
    lines.append("| **wall** | " + " | ".join(f"**{p.wall_ms:.2f}**" for p in profiles) + " |")
    path = out / "forward-profile.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_profile(target_dir: Path, out: Path, command: str, rounds: int = 15) -> Path:
    """Measure the read bandwidth, profile every setting, write forward-profile.md into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    profiles, bandwidth = profile_all(target_dir, rounds=rounds)
    return write_profile(out, target_dir, profiles, bandwidth, command)
