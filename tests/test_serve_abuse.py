"""The server against hostile and careless clients (loopback only, bounded in count and time): one request never fails
or stalls the others. Each reproduction of issue 27 is here: a vanishing temperature, a row that fails in the
engine, a megabyte stop string, a huge body, a lone surrogate, a stuck engine; then the security options and a
bounded fuzz over every field."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from drafting import break_the_rule_for
from verispec.checkpoints.random_init import random_pair, tiny_config
from verispec.cli import main
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.draft_model_batch import DraftModelBatch
from verispec.errors import DrafterError
from verispec.generate import generate
from verispec.models.native import NativeModel, load_model
from verispec.serve.app import serving_app
from verispec.serve.options import API_KEY_ENV, ServeOptions, allowed_hosts, api_key
from verispec.serve.server import ServerThread
from verispec.threads import torch_threads

CONTEXT = 2048
PROMPTS = ["def parse(line):", "import os\n", "class Node:", "for i in range("]
POISON = "\x07\x07\x07"  # a prompt that starts with it makes the test drafter fail (test_a_failing_draft_...)
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
STEP_SLEEP = 0.004  # the test drafter's pause per step, so that a long stream outlasts the hostile requests


class _Drafter(DraftModel):
    """The draft model, slowed a little, whose batched drafting raises whenever a context starts with POISON."""

    def begin_batch(self, target: NativeModel, slots: int) -> DraftModelBatch:
        session = super().begin_batch(target, slots)
        poison, propose = target.tokenizer.encode(POISON).ids, session.propose

        def drafting(contexts: dict, ks: dict) -> dict:
            time.sleep(STEP_SLEEP)
            if any(list(context[: len(poison)]) == poison for context in contexts.values()):
                raise DrafterError("the poisoned draft")
            return propose(contexts, ks)

        session.propose = drafting
        return session


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, NativeModel, NativeModel]:
    """A tiny random pair; the target's folder has a chat template, so chat requests get as far as generation."""
    target_dir, draft_dir = random_pair(
        tmp_path_factory.mktemp("abuse"), tiny_config(num_hidden_layers=3, max_position_embeddings=CONTEXT)
    )
    config = json.loads((target_dir / "tokenizer_config.json").read_text())
    (target_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    return target_dir, load_model(target_dir, dtype="float32"), load_model(draft_dir, dtype="float32")


@pytest.fixture(scope="module")
def server(models: tuple) -> ServerThread:
    target_dir, target, draft = models
    app = serving_app(target, _Drafter(draft, 3), target_dir, name="tiny", adaptive=False)
    with torch_threads(1), ServerThread(app) as srv:
        yield srv


def _solo(models: tuple, prompt: str, tokens: int) -> str:
    return generate(models[1], prompt, max_new_tokens=tokens, ignore_eos=True).text


def _body(prompt: str, tokens: int, **extra: object) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, **extra}


class _Stream(threading.Thread):
    """A greedy streamed completion read on a thread: its text, when each event came, and how it ended."""

    def __init__(self, url: str, prompt: str, tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, _body(prompt, tokens, stream=True)
        self.text, self.times, self.events = "", [], []
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.times.append(time.monotonic())
                    self.events.append(line.removeprefix("data: "))
                    self.started.set()
        self.started.set()
        self.text = "".join(json.loads(e)["choices"][0]["text"] for e in self.events[:-1] if "choices" in e)

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    def gap(self, start: float, end: float) -> float:
        """The longest wait between events (or the window's ends) within [start, end]."""
        inside = [start, *(t for t in self.times if start < t < end), min(end, self.times[-1])]
        return max(b - a for a, b in zip(inside, inside[1:]))


def _finished(url: str, reason: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    line = f'verispec_requests_finished_total{{finish_reason="{reason}"}} '
    return next((float(row.split()[-1]) for row in text.splitlines() if row.startswith(line)), 0.0)


def test_a_vanishing_temperature_fails_nobody(server: ServerThread, models: tuple) -> None:
    """temperature 1e-300 is 0 in float32: it once failed its own request and every stream in flight with it."""
    streams = [_Stream(server.url, p, 60) for p in PROMPTS[:3]]
    for s in streams:
        s.start()
        s.started.wait(30)
    for value in ({"temperature": 1e-300}, {"temperature": 5e-324}, {"temperature": 1e-45, "top_p": 0.5}):
        reply = httpx.post(f"{server.url}/v1/completions", json={**_body("x", 4), **value}, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == _solo(models, "x", 4)
    reply = httpx.post(f"{server.url}/v1/completions", json={**_body("x", 4), "temperature": 1, "top_p": 1e-300})
    assert reply.status_code == 400 and "top_p must be in" in reply.json()["error"]["message"]
    for s, prompt in zip(streams, PROMPTS):
        s.join(60)
        assert s.done and s.text == _solo(models, prompt, 60)


@pytest.mark.parametrize("stream", [False, True])
def test_a_row_failing_in_the_engine_ends_that_request_alone(
    server: ServerThread, models: tuple, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The acceptance rule raising for one row (top_k 13 marks it here) ends that request with a 500 (streamed or
    not: it fails before its first token), counted in /metrics; the streams beside it finish as they would alone."""
    break_the_rule_for(monkeypatch, 13)
    errors = _finished(server.url, "error")
    streams = [_Stream(server.url, p, 60) for p in PROMPTS[:3]]
    for s in streams:
        s.start()
        s.started.wait(30)
    body = {**_body("x", 8), "temperature": 1.0, "top_k": 13, "stream": stream}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)  # failed at its first step: a 500
    error = reply.json()["error"]
    assert reply.status_code == 500 and error["type"] == "server_error" and "invalid probability" in error["message"]
    for s, prompt in zip(streams, PROMPTS):
        s.join(60)
        assert s.done and s.text == _solo(models, prompt, 60)
    assert _finished(server.url, "error") == errors + 1
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_failing_draft_ends_its_request_alone(server: ServerThread, models: tuple) -> None:
    """The drafter raises for the whole batch while one context starts with POISON: each sequence drafts again alone,
    and only the poisoned one ends."""
    streams = [_Stream(server.url, p, 60) for p in PROMPTS[:3]]
    for s in streams:
        s.start()
        s.started.wait(30)
    reply = httpx.post(f"{server.url}/v1/completions", json=_body(f"{POISON}b", 8), timeout=60)
    assert reply.status_code == 500 and "the poisoned draft" in reply.json()["error"]["message"]
    for s, prompt in zip(streams, PROMPTS):
        s.join(60)
        assert s.done and s.text == _solo(models, prompt, 60)


def test_huge_requests_neither_fail_nor_stall_the_others(server: ServerThread, models: tuple) -> None:
    """A 1 MB stop string (once a minute of quadratic matching on the engine's thread), a 10 MB body (once seconds
    of encoding on the event loop) and a prompt longer than the context can hold are refused at once, while a
    stream beside them keeps its pace and its output."""
    stream = _Stream(server.url, PROMPTS[0], 500)
    stream.start()
    stream.started.wait(30)
    start = time.monotonic()
    replies = [
        httpx.post(f"{server.url}/v1/completions", json=_body("def f(x):", 8, stop="x" * 1_000_000), timeout=60),
        httpx.post(f"{server.url}/v1/completions", json=_body("x" * 10_000_000, 8), timeout=60),
        httpx.post(f"{server.url}/v1/completions", json=_body("y" * 300_000, 8), timeout=60),
        httpx.post(f"{server.url}/v1/completions", json=_body("q", 8, stop=["a"] * 17), timeout=60),
        httpx.get(f"{server.url}/health", timeout=60),
    ]
    end = time.monotonic()
    assert [r.status_code for r in replies] == [400, 413, 400, 400, 200]
    assert "at most 1024 characters" in replies[0].json()["error"]["message"]
    assert replies[1].json()["error"]["code"] == "request_too_large"
    assert replies[2].json()["error"]["code"] == "context_length_exceeded"
    assert "at most 16 stop strings" in replies[3].json()["error"]["message"]
    stream.join(120)
    assert stream.done and stream.text == _solo(models, PROMPTS[0], 500)
    assert stream.times[-1] > end, "the stream ended before the hostile requests did: nothing was measured"
    assert stream.gap(start, end) < 2.0


@pytest.mark.parametrize(
    "path, body",
    [
        ("completions", '{"model": "tiny", "prompt": "\\ud800"}'),
        ("completions", '{"model": "tiny", "prompt": "ok", "stop": "\\udfff"}'),
        ("chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ],
)
def test_a_lone_surrogate_is_bad_input(server: ServerThread, path: str, body: str) -> None:
    response = httpx.post(f"{server.url}/v1/{path}", content=body, headers={"content-type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error"
    assert "lone surrogate" in error["message"]


def test_health_fails_while_the_engine_is_stuck(models: tuple) -> None:
    target_dir, target, draft = models
    stuck = threading.Event()

    class Stuck(DraftModel):
        def begin_batch(self, target: NativeModel, slots: int) -> DraftModelBatch:
            session = super().begin_batch(target, slots)
            propose = session.propose

            def drafting(contexts: dict, ks: dict) -> dict:
                stuck.wait(30)
                return propose(contexts, ks)

            session.propose = drafting
            return session

    app = serving_app(
        target, Stuck(draft, 2), target_dir, name="t", adaptive=False, options=ServeOptions(stall_seconds=0.3)
    )
    with torch_threads(1), ServerThread(app) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200  # idle is not stuck
        worker = threading.Thread(
            target=httpx.post,
            args=(f"{srv.url}/v1/completions",),
            kwargs={"json": {"model": "t", "prompt": "a", "max_tokens": 3}, "timeout": 60},
        )
        worker.start()
        deadline = time.monotonic() + 20
        while (health := httpx.get(f"{srv.url}/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health.status_code == 503 and "stalled" in health.json()["status"]
        stuck.set()
        worker.join(30)
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_api_key_hosts_and_docs(models: tuple) -> None:
    target_dir, target, _ = models
    options = ServeOptions(api_key="sekrit", allowed_hosts=("127.0.0.1",), docs=False)
    with torch_threads(1), ServerThread(serving_app(target, None, target_dir, name="t", options=options)) as srv:
        for key in ("wrong", "sekri"):
            with pytest.raises(openai.AuthenticationError, match="API key"):
                openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0).models.list()
        assert httpx.post(f"{srv.url}/v1/completions", json={}).status_code == 401
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekrit", max_retries=0)
        assert client.completions.create(model="t", prompt="a", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(f"{srv.url}/health").status_code == 200  # only /v1 needs the key
        rebound = httpx.get(
            f"{srv.url}/v1/models", headers={"Host": "evil.example:80", "Authorization": "Bearer sekrit"}
        )
        assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"
        assert [httpx.get(f"{srv.url}{p}").status_code for p in ("/docs", "/redoc", "/openapi.json")] == [404] * 3
    with torch_threads(1), ServerThread(serving_app(target, None, target_dir, name="t")) as srv:
        assert httpx.get(f"{srv.url}/openapi.json").status_code == 200


def test_hosts_default_to_loopback_names_on_loopback() -> None:
    assert allowed_hosts("127.0.0.1", None) == allowed_hosts("::1", None) == allowed_hosts("localhost", None)
    assert "localhost" in allowed_hosts("127.0.0.1", None)
    assert allowed_hosts("0.0.0.0", None) is None and allowed_hosts("127.0.0.1", "*") is None
    assert allowed_hosts("0.0.0.0", "api.example, [::1]") == ("api.example", "::1")


def test_the_api_key_comes_from_the_flag_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key(None) == "from-env" and api_key("flag") == "flag" and api_key("") == ""
    monkeypatch.setenv(API_KEY_ENV, "")
    assert api_key(None) is None
    monkeypatch.delenv(API_KEY_ENV)
    assert api_key(None) is None


def test_a_client_that_never_finishes_its_request_cannot_hold_shutdown_open(
    models: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half a body, and then nothing: uvicorn waits for that connection at shutdown, until the margin after the
    grace has passed (shortened here); without a graceful-shutdown timeout it would wait for ever."""
    monkeypatch.setattr("verispec.serve.server.SHUTDOWN_MARGIN", 0.5)
    with (
        torch_threads(1),
        ServerThread(serving_app(models[1], None, name="t"), grace=0.0) as srv,
        socket.create_connection(("127.0.0.1", srv.server.port)) as stalled,
    ):
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model":'
        )
        time.sleep(0.3)  # the request has begun: the app waits for the rest of its body
        start = time.monotonic()
        srv.shutdown(timeout=20)
        assert not srv.alive and time.monotonic() - start < 10


@pytest.mark.parametrize(
    "option",
    [
        ["--max-body-bytes", "0"],
        ["--health-stall", "0"],
        ["--api-key", ""],
        ["--health-stall", "nan"],
        ["--allowed-hosts", ","],
    ],
)
def test_serve_cli_refuses_bad_security_options(option: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--target", "/nonexistent", *option]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: ") and err.count("\n") == 1


HOSTILE = [
    float("nan"),
    float("inf"),
    float("-inf"),
    5e-324,
    -5e-324,
    1e-300,
    1e308,
    -1e308,
    0,
    -1,
    2**63,
    2**64,
    -(2**63),
    "",
    "\x00",
    "\ud800",
    "a\x00b",
    "\U0010ffff",
    [],
    {},
    None,
    True,
    [[]],
    [None],
    "9" * 400,
    3.5,
]
FIELDS = [
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "n",
    "user",
    "model",
    "logit_bias",
    "stream_options",
    "ignore_eos",
]


def test_fuzz_every_field_with_hostile_values(server: ServerThread, models: tuple) -> None:
    """Each field of a small valid request set to hostile values (NaN and infinities as Python's json writes them,
    denormals, huge and empty values, NUL, surrogates, wrong types), and a random mix of several: never a 5xx,
    always OpenAI's error JSON when refused, and the server answers as before afterwards. Bounded: about 400
    requests of at most 4 tokens."""
    base = {"model": "tiny", "prompt": "z", "max_tokens": 4}
    cases = [{**base, field: value} for field in FIELDS for value in HOSTILE]
    rng = random.Random(27)
    cases += [{**base, **{f: rng.choice(HOSTILE) for f in rng.sample(FIELDS, 3)}} for _ in range(40)]
    cases += [{**base, "prompt": [{"role": "user", "content": value}]} for value in HOSTILE]  # chat's messages
    started = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for case in cases:
            body = json.dumps(case)  # NaN and Infinity as bare words, lone surrogates as \ud800 escapes
            for path in ("/v1/completions", "/v1/chat/completions"):
                if path.endswith("chat/completions"):
                    body = body.replace('"prompt"', '"messages"', 1)
                response = http.post(path, content=body, headers={"content-type": "application/json"})
                assert response.status_code < 500, (case, response.text)
                if response.status_code != 200:
                    error = response.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"} and error["message"], case
                elif case.get("stream") is not True:
                    assert response.json()["object"] in ("text_completion", "chat.completion")
    assert time.monotonic() - started < 90
    assert httpx.get(f"{server.url}/health").status_code == 200
    reply = httpx.post(f"{server.url}/v1/completions", json=_body(PROMPTS[1], 12), timeout=60).json()
    assert reply["choices"][0]["text"] == _solo(models, PROMPTS[1], 12)
