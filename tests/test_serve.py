"""`verispec serve`: the real uvicorn server on a free port, spoken to with the official `openai` client (and raw
HTTP where the wire format itself is under test). Greedy outputs are compared with `verispec.generate` alone."""

from __future__ import annotations

import itertools
import json
import logging
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from verispec.checkpoints.random_init import random_pair, tiny_config
from verispec.cli import main
from verispec.drafters.base import Proposal
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.draft_model_batch import DraftModelBatch
from verispec.engine import Engine
from verispec.errors import DrafterError, InvalidArgumentError
from verispec.generate import generate
from verispec.models.native import NativeModel, load_model
from verispec.serve.app import serving_app
from verispec.serve.server import ServerThread
from verispec.serve.worker import EngineWorker
from verispec.threads import torch_threads

CONTEXT = 2048  # long enough that a stream with ignore_eos outlives the client killed in the middle of it
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, NativeModel, NativeModel]:
    target_dir, draft_dir = random_pair(
        tmp_path_factory.mktemp("serve"), tiny_config(num_hidden_layers=3, max_position_embeddings=CONTEXT)
    )
    return target_dir, load_model(target_dir, dtype="float32"), load_model(draft_dir, dtype="float32")


@pytest.fixture(scope="module")
def server(models: tuple[Path, NativeModel, NativeModel]) -> ServerThread:
    """Speculation with the draft model (k = 3 every step) on a target without a chat template."""
    target_dir, target, draft = models
    app = serving_app(target, DraftModel(draft, 3), target_dir, name="tiny", adaptive=False)
    with torch_threads(1), ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (labels in braces), parsed by prometheus_client's own parser."""
    text = httpx.get(f"{url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def _sse(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a raw event stream, checked to be framed as OpenAI frames them."""
    *events, done, end = response.read().decode().split("\n\n")
    assert (done, end) == ("data: [DONE]", "")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e.removeprefix("data: ") for e in events]


def test_completion(client: openai.OpenAI, models: tuple, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="verispec.serve")  # each finished request's line, as chat prints a turn's
    target = models[1]
    expected = generate(target, "def parse(line):", max_new_tokens=12, ignore_eos=True)
    reply = client.completions.create(
        model="tiny", prompt="def parse(line):", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.object == "text_completion" and reply.model == "tiny"
    assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == "length"
    prompt_tokens = len(target.tokenizer.encode("def parse(line):").ids)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 12)
    assert reply.usage.total_tokens == prompt_tokens + 12
    stats = reply.model_extra["verispec"]
    assert stats["tau"] == pytest.approx(12 / stats["target_calls"]) and stats["drafted_tokens"] > 0
    assert 0 <= stats["acceptance_rate"] <= 1
    line = "(max_new_tokens): [12 tokens, "
    assert any(
        line in r.getMessage() and f"tau {stats['tau']:.2f}, acceptance " in r.getMessage() for r in caplog.records
    )


def test_completion_stream(client: openai.OpenAI, server: ServerThread, models: tuple) -> None:
    expected = generate(models[1], "import os\n", max_new_tokens=20, ignore_eos=True)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="import os\n",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *choices, last = chunks
    assert "".join(c.choices[0].text for c in choices) == expected.text
    assert [c.choices[0].finish_reason for c in choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in choices[:-1]) and all(c.usage is None for c in choices)
    assert last.choices == [] and last.usage.completion_tokens == 20
    body = {
        "model": "tiny",
        "prompt": "import os\n",
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(e) for e in _sse(response)]
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == expected.text
    assert events[-1]["choices"][0]["finish_reason"] == "length" and "tau" in events[-1]["verispec"]


def test_stop_strings_and_seeds(client: openai.OpenAI, models: tuple) -> None:
    full = generate(models[1], "x = ", max_new_tokens=30, ignore_eos=True).text
    stop = full[10:12]
    reply = client.completions.create(
        model="tiny", prompt="x = ", max_tokens=30, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].text == full[: full.index(stop)]
    sampled = [
        client.completions.create(
            model="tiny", prompt="x = ", max_tokens=16, temperature=1.0, seed=7, top_p=0.9, extra_body={"top_k": 50}
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_chat_refused_without_template(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


def test_chat_with_template(models: tuple, tmp_path: Path) -> None:
    target_dir, target, _ = models
    chat_dir = tmp_path / "chat"
    chat_dir.mkdir()
    for file in target_dir.iterdir():
        (chat_dir / file.name).write_bytes(file.read_bytes())
    config = json.loads((chat_dir / "tokenizer_config.json").read_text())
    (chat_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]
    prompt = target.tokenizer.encode("<system>Be brief.\n<user>Write a loop.\n<assistant>", add_special_tokens=False)
    expected = generate(target, prompt.ids, max_new_tokens=10, ignore_eos=True).text
    with torch_threads(1), ServerThread(serving_app(target, None, chat_dir, name="chat")) as srv:
        chat = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        reply = chat.chat.completions.create(
            model="chat", messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens == len(prompt.ids) and reply.usage.completion_tokens == 10
        chunks = list(
            chat.chat.completions.create(
                model="chat",
                messages=messages,
                max_completion_tokens=10,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_chat_with_a_template_given_in_place_of_none(models: tuple) -> None:
    """`verispec serve --chat-template FILE`: a target shipped without a template serves chat by the one given."""
    target_dir, target, _ = models
    messages = [{"role": "user", "content": "Write a loop."}]
    prompt = target.tokenizer.encode("<user>Write a loop.\n<assistant>", add_special_tokens=False)
    expected = generate(target, prompt.ids, max_new_tokens=6, ignore_eos=True).text
    app = serving_app(target, None, target_dir, chat_template=CHAT_TEMPLATE, name="given")
    with torch_threads(1), ServerThread(app) as srv:
        chat = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        reply = chat.chat.completions.create(
            model="given", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
    assert reply.choices[0].message.content == expected and reply.usage.prompt_tokens == len(prompt.ids)
    with pytest.raises(InvalidArgumentError, match="target_dir"):  # its special tokens are the checkpoint's
        serving_app(target, None, None, chat_template=CHAT_TEMPLATE)


def test_concurrent_streams_match_single_requests(client: openai.OpenAI, models: tuple) -> None:
    prompts = [f"def f{i}(x):\n    return x" for i in range(16)]
    expected = [generate(models[1], p, max_new_tokens=24).text for p in prompts]
    texts, start = [None] * 16, threading.Barrier(16)

    def run(i: int) -> None:
        start.wait()
        stream = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=24, temperature=0, stream=True)
        texts[i] = "".join(chunk.choices[0].text for chunk in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert texts == expected


KILLED_CLIENT = """
import sys, time, httpx
body = {"model": "tiny", "prompt": "a", "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
with httpx.stream("POST", sys.argv[1] + "/v1/completions", json=body, timeout=60) as response:
    for line in response.iter_lines():
        if line.startswith("data: "):
            print("streaming", flush=True)
            time.sleep(60)
"""


def test_client_killed_mid_stream(client: openai.OpenAI, server: ServerThread) -> None:
    aborted = 'verispec_requests_finished_total{finish_reason="aborted"}'
    before = _metrics(server.url).get(aborted, 0)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "streaming\n"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    while _metrics(server.url).get(aborted, 0) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    after = _metrics(server.url)
    assert after[aborted] == before + 1 and after["verispec_requests_running"] == 0
    assert client.completions.create(model="tiny", prompt="b", max_tokens=3).usage.completion_tokens >= 1


BAD = [  # (path, raw body, status, words of the message)
    ("completions", "{not json", 400, "not valid JSON"),
    ("completions", "[1, 2]", 400, "must be a JSON object"),
    (
        "completions",
        '{"model": "tiny", "prompt": "a", "max_tokens": "8"}',
        400,
        "max_tokens: Input should be a valid integer",
    ),
    ("completions", '{"model": "tiny", "prompt": "a", "temperature": true}', 400, "temperature"),
    ("completions", '{"model": "tiny", "prompt": "a", "top_k": 2.5}', 400, "top_k"),
    ("completions", '{"model": "tiny", "prompt": "a", "mystery": 1}', 400, "mystery: Extra inputs are not permitted"),
    ("completions", '{"model": "tiny", "prompt": "a", "max_tokens": 0}', 400, "max_tokens must be an integer >= 1"),
    ("completions", '{"model": "tiny", "prompt": "a", "max_tokens": 2048}', 400, "maximum context length is 2048"),
    ("completions", '{"model": "tiny", "prompt": "a", "n": 2}', 400, "n=2 is not supported"),
    ("completions", '{"model": "tiny", "prompt": "a", "best_of": 3}', 400, "best_of=3 is not supported"),
    ("completions", '{"model": "tiny", "prompt": "a", "presence_penalty": 0.5}', 400, "presence_penalty"),
    ("completions", '{"model": "tiny", "prompt": ""}', 400, "the prompt is empty"),
    ("completions", '{"model": "tiny", "prompt": ["a", "b"]}', 400, "batch of 2 prompts"),
    ("completions", json.dumps({"model": "tiny", "prompt": [65] * CONTEXT}), 400, "the context holds 2048"),
    ("completions", '{"model": "tiny", "prompt": [999999]}', 400, "token ids must be integers in"),
    ("completions", '{"model": "tiny", "prompt": "a", "temperature": -1}', 400, "temperature must be"),
    ("completions", '{"model": "tiny", "prompt": "a", "top_p": 0}', 400, "top_p must be in"),
    ("completions", '{"model": "tiny", "prompt": "a", "stop": [""]}', 400, "stop strings must not be empty"),
    (
        "completions",
        '{"model": "tiny", "prompt": "a", "stream_options": {"include_usage": true}}',
        400,
        "only allowed with stream",
    ),
    ("completions", '{"model": "other", "prompt": "a"}', 404, "does not exist"),
    ("chat/completions", '{"model": "tiny", "messages": []}', 400, "messages must not be empty"),
    ("chat/completions", '{"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}', 400, "role"),
]


@pytest.mark.parametrize("path, body, status, words", BAD, ids=[f"{i}-{b[:30]}" for i, (_, b, _, _) in enumerate(BAD)])
def test_bad_requests(server: ServerThread, path: str, body: str, status: int, words: str) -> None:
    response = httpx.post(f"{server.url}/v1/{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_bad_request_through_openai_keeps_serving(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="a", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="a")
    assert client.models.list().data[0].id == "tiny"
    assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].text is not None


def test_health_and_metrics(server: ServerThread, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt="q", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    samples = _metrics(server.url)  # the parser raises on anything that is not Prometheus text
    for name in (
        "verispec_requests_running",
        "verispec_requests_waiting",
        "verispec_generation_tokens_total",
        "verispec_acceptance_rate",
        "verispec_mean_tokens_per_target_call",
        "verispec_time_per_output_token_seconds_count",
        "verispec_time_to_first_token_seconds_count",
    ):
        assert name in samples
    assert samples["verispec_generation_tokens_total"] >= 8 and samples["verispec_mean_tokens_per_target_call"] >= 1
    assert 0 < samples["verispec_acceptance_rate"] <= 1 and samples["verispec_time_per_output_token_seconds_count"] >= 1
    # The server runs in this process: its peak is this process's, and never below what it holds now.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert samples["process_resident_memory_bytes"] <= samples["verispec_process_peak_resident_memory_bytes"] <= peak


@pytest.mark.parametrize("grace, max_tokens, reason", [(60.0, 30, "length"), (0.0, 2000, "abort")])
def test_shutdown_finishes_or_ends_in_flight(models: tuple, grace: float, max_tokens: int, reason: str) -> None:
    """What SIGTERM does: with time to spare a stream runs to its end; past the grace it ends, cleanly, with
    finish_reason "abort"; either way the client gets [DONE] and the server stops."""
    target_dir, target, draft = models
    events, started = [], threading.Event()
    app = serving_app(target, DraftModel(draft, 3), target_dir, name="tiny")

    def run(url: str) -> None:
        body = {
            "model": "tiny",
            "prompt": "z",
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in filter(None, response.iter_lines()):
                started.set()
                events.append(line)

    with torch_threads(1), ServerThread(app, grace=grace) as srv:
        reader = threading.Thread(target=run, args=(srv.url,))
        reader.start()
        assert started.wait(30)
        srv.shutdown()
        reader.join(30)
        assert not srv.alive
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == reason


class _BreaksOnce(DraftModel):
    """A draft model whose batch drafting breaks once, at its third proposal: one engine step raises mid-request."""

    broke = False

    def begin_batch(self, target: NativeModel, slots: int) -> DraftModelBatch:
        session = super().begin_batch(target, slots)
        calls, propose = itertools.count(), session.propose

        def breaking(contexts: dict, ks: dict) -> dict[int, Proposal]:
            if next(calls) == 2 and not self.broke:
                self.broke = True
                raise DrafterError("the drafter broke")  # a VerispecError, yet the server's failure: a 500
            return propose(contexts, ks)

        session.propose = breaking
        return session


@pytest.mark.parametrize("stream", [False, True])
def test_failed_engine_step_fails_its_request_only(models: tuple, stream: bool) -> None:
    """A non-streamed request gets a 500 (a drafter breaking its protocol is the server's failure, not bad input), a
    stream an error event; the engine rolled back, and the server serves on with it."""
    target_dir, target, draft = models
    app = serving_app(target, _BreaksOnce(draft, 2), target_dir, name="t", adaptive=False)
    with torch_threads(1), ServerThread(app) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        failure = openai.APIError if stream else openai.InternalServerError  # an error event; a 500
        with pytest.raises(failure, match="the drafter broke"):
            reply = client.completions.create(
                model="t", prompt="a", max_tokens=30, stream=stream, extra_body={"ignore_eos": True}
            )
            if stream:
                list(reply)
        assert client.completions.create(model="t", prompt="a", max_tokens=4).usage.completion_tokens >= 1
        assert httpx.get(f"{srv.url}/health").status_code == 200


@pytest.mark.parametrize("option", [["--port", "70000"], ["--shutdown-grace", "-1"], ["--max-batch", "0"]])
def test_serve_cli_refuses_bad_options(option: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--target", "/nonexistent", *option]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: ") and err.count("\n") == 1 and option[0] in err


def test_a_second_signal_never_moves_the_drain_deadline_later(models: tuple) -> None:
    worker = EngineWorker(Engine(models[1], None, max_batch=1))
    worker.drain(5.0)
    first = worker._drain_at
    worker.drain(60.0)  # a second Ctrl-C with the same grace, later: the first deadline stands
    assert worker._drain_at == first
    worker.drain(0.0)
    assert worker._drain_at < first
