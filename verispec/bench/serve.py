"""`verispec bench-serve`: a running OpenAI-compatible server measured at several numbers of concurrent clients.

Each level runs `requests` streamed greedy completions (EOS ignored, so every server writes the same number of
tokens) through `concurrency` clients that each send their next request as soon as the last one ends. Per level:
throughput (output tokens per second of wall time), time to first token, inter-token latency (the gap between
streamed chunks, one per engine step, as vLLM's serving benchmark measures it; a speculative step's chunk carries
several tokens) and time per output token after the first; and how many answers are identical to the answer that
prompt got alone, from the first server at the first level (one client: each request alone in its batch), so that a
greedy answer that changes with the requests beside it, or with speculation, shows. The client speaks only the
OpenAI API over HTTP (httpx), so it measures verispec's server, vLLM or SGLang alike; `measure_local` serves plain
decoding and speculation from one loaded target in turn and measures both.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from verispec.argument_checks import whole_number
from verispec.drafters.base import Drafter
from verispec.errors import InvalidArgumentError, VerispecError
from verispec.models.protocol import CausalLM
from verispec.threads import torch_threads

LEVELS = (1, 4, 16)


class ServerBenchError(VerispecError):
    """The server under test refused a request or could not be reached."""


@dataclass(frozen=True)
class Workload:
    prompts: list[str]
    concurrency: tuple[int, ...] = LEVELS
    requests: int = 16  # per level, spread over its clients
    max_tokens: int = 128

    def __post_init__(self) -> None:
        if not self.prompts:
            raise InvalidArgumentError("the suite holds no prompts")
        if not self.concurrency or min(self.concurrency) < 1:
            raise InvalidArgumentError(f"--concurrency levels must be >= 1, got {list(self.concurrency)}")
        whole_number(self.requests, "--requests", 1)
        whole_number(self.max_tokens, "--max-tokens", 1)


@dataclass
class Timing:
    """One request as its client saw it (seconds from sending it)."""

    ttft: float
    chunk_gaps: list[float]
    tokens: int
    latency: float
    prompt: str
    text: str


@dataclass
class Level:
    concurrency: int
    requests: int
    tokens: int
    wall: float
    throughput: float  # output tokens / s
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    tpot_mean: float  # (latency - ttft) / (tokens - 1), averaged over requests
    identical: int  # answers identical to their prompt's answer alone (the reference)
    server_peak_rss: float | None = None  # bytes, the server process's peak so far, where its /metrics says it


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Timing:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    arrivals, tokens, text = [], 0, []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise ServerBenchError(f"{url} answered {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if event.get("choices") and event["choices"][0].get("text"):
                arrivals.append(time.perf_counter() - start)
                text.append(event["choices"][0]["text"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if not arrivals:
        raise ServerBenchError(f"{url} streamed no text for a prompt")
    return Timing(arrivals[0], list(np.diff(arrivals)), tokens, time.perf_counter() - start, prompt, "".join(text))


async def _level(url: str, model: str, work: Workload, concurrency: int, reference: dict[str, str]) -> Level:
    """One level; `reference`: each prompt's answer alone (filled from this level's answers where it has none)."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(work.requests):
        queue.put_nowait(work.prompts[i % len(work.prompts)])
    timings: list[Timing] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            timings.append(await _one(client, url, model, queue.get_nowait(), work.max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
        peak_rss = await _server_peak_rss(client, url)
    ttft = [t.ttft for t in timings]
    gaps = [g for t in timings for g in t.chunk_gaps] or [0.0]
    tpot = [(t.latency - t.ttft) / (t.tokens - 1) for t in timings if t.tokens > 1] or [0.0]
    tokens = sum(t.tokens for t in timings)
    for t in timings:
        reference.setdefault(t.prompt, t.text)
    return Level(
        concurrency,
        len(timings),
        tokens,
        wall,
        tokens / wall,
        *np.percentile(ttft, [50, 99]),
        *np.percentile(gaps, [50, 99]),
        float(np.mean(tpot)),
        sum(t.text == reference[t.prompt] for t in timings),
        peak_rss,
    )


async def _server_peak_rss(client: httpx.AsyncClient, url: str) -> float | None:
    """The server's peak resident memory in bytes, as verispec's /metrics gives it; None from a server that does not
    (vLLM, SGLang), so that a bench of theirs still runs."""
    from prometheus_client.parser import text_string_to_metric_families

    from verispec.serve.metrics import PEAK_RSS

    response = await client.get(f"{url}/metrics")
    if response.status_code != 200:
        return None
    for family in text_string_to_metric_families(response.text):
        if family.name == PEAK_RSS:
            return family.samples[0].value
    return None


def served_model(url: str) -> str:
    """The first model a server lists at /v1/models."""
    try:
        listing = httpx.get(f"{url}/v1/models", timeout=30).json()
        return listing["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
        raise ServerBenchError(f"{url}/v1/models: no model listed ({err})") from None


def measure(url: str, work: Workload, reference: dict[str, str] | None = None) -> list[Level]:
    """Every concurrency level of `work` against the server at `url`, after one warm-up request; each answer
    compared with `reference[prompt]`, which the first level fills where it is empty (pass one dict to every server
    measured, the first level at one client: every answer is then held against the prompt's answer alone)."""
    url = url.rstrip("/")
    model = served_model(url)
    reference = {} if reference is None else reference

    async def run() -> list[Level]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            await _one(client, url, model, work.prompts[0], min(8, work.max_tokens))
        return [await _level(url, model, work, c, reference) for c in work.concurrency]

    try:
        return asyncio.run(run())
    except httpx.HTTPError as err:
        raise ServerBenchError(f"{url}: {type(err).__name__}: {err}") from None


def measure_local(
    target: CausalLM,
    drafter: Drafter,
    label: str,
    work: Workload,
    *,
    max_batch: int,
    threads: int,
    adaptive: bool,
    context: int | None = None,
    kv_memory: int | None = None,
) -> dict[str, list[Level]]:
    """Plain decoding, then `drafter`'s speculation (`adaptive`: k chosen per step), each served from `target` on
    this machine (`context` tokens a request, `kv_memory` bytes of keys and values: engine/kv_budget.py) and
    measured."""
    from verispec.serve.app import serving_app  # the server's stack loads on demand
    from verispec.serve.server import ServerThread

    results, reference = {}, {}
    for name, which in (("autoregressive", None), (label, drafter)):
        app = serving_app(target, which, max_batch=max_batch, adaptive=adaptive, context=context, kv_memory=kv_memory)
        with torch_threads(threads), ServerThread(app) as server:
            results[name] = measure(server.url, work, reference)
    return results


def verdict(results: dict[str, list[Level]]) -> list[str]:
    """Where each server stops paying against the first (the baseline): throughput ratios by concurrency."""
    (base_name, base), *others = results.items()
    lines = []
    for name, levels in others:
        ratios = {b.concurrency: level.throughput / b.throughput for b, level in zip(base, levels)}
        shown = ", ".join(f"{c}: {r:.2f}x" for c, r in ratios.items())
        losing = [c for c, r in ratios.items() if r < 1]
        where = (
            f"it stops paying at {losing[0]} concurrent client{'s' if losing[0] > 1 else ''}"
            if losing
            else f"it pays at every level measured (up to {max(ratios)} clients)"
        )
        lines.append(f"{name} vs {base_name}, output-token throughput by concurrency: {shown}; {where}.")
    return lines


def format_table(results: dict[str, list[Level]]) -> str:
    rows = [
        "| server | clients | requests | tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT mean (ms) | "
        "identical to alone | server peak RSS (GiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, levels in results.items():
        rows += [
            f"| {name} | {v.concurrency} | {v.requests} | {v.throughput:.1f} | {1e3 * v.ttft_p50:.0f} / "
            f"{1e3 * v.ttft_p99:.0f} | {1e3 * v.itl_p50:.1f} / {1e3 * v.itl_p99:.1f} | {1e3 * v.tpot_mean:.1f} | "
            f"{v.identical}/{v.requests} | {'-' if v.server_peak_rss is None else f'{v.server_peak_rss / 2**30:.2f}'} |"
            for v in levels
        ]
    return "\n".join(rows)


def write_report(out: Path, results: dict[str, list[Level]], work: Workload, setup: dict) -> Path:
    """report.md (table and verdict) and results.json under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "setup": setup,
        "workload": {
            "concurrency": list(work.concurrency),
            "requests": work.requests,
            "max_tokens": work.max_tokens,
            "prompts": len(work.prompts),
        },
        "results": {name: [asdict(v) for v in levels] for name, levels in results.items()},
    }
    (out / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [
        "# verispec bench-serve",
        "",
        f"{work.requests} streamed greedy completions of {work.max_tokens} tokens (EOS ignored) per level, "
        f"clients sending back to back; setup: " + ", ".join(f"{k}: {v}" for k, v in setup.items()) + ".",
        "",
        format_table(results),
        "",
    ]
    if len(results) > 1:
        lines += verdict(results) + [""]
    lines += [
        "TTFT: from sending a request to its first text. ITL: the gap between streamed chunks (one per engine "
        "step; a speculative chunk carries several tokens). TPOT: a request's time per output token after the "
        "first. Identical to alone: answers whose text is the one their prompt got from the first server at "
        f"{work.concurrency[0]} client{'s' if work.concurrency[0] > 1 else ''}. Server peak RSS: the server "
        "process's peak resident memory since it started, read from its /metrics after the level (`-`: a server "
        "that does not export it); a server measured in this process (no --url) shares it with the clients."
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"
