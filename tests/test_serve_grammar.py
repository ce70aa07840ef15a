"""`response_format` in the server, as OpenAI defines it (json_object, json_schema), through the official client:
streamed and not, 16 constrained clients at once, each reply what `verispec.generate` gives alone under the same
grammar; bad schemas answered with a 400 that says why."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import openai
import pytest

from test_serve import CHAT_TEMPLATE
from verispec.checkpoints.random_init import random_pair, tiny_config
from verispec.drafters.draft_model import DraftModel
from verispec.generate import generate
from verispec.models.native import NativeModel, load_model
from verispec.serve.app import serving_app
from verispec.serve.server import ServerThread
from verispec.threads import torch_threads

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    },
]
LIMIT = 120  # tokens: more than any of these schemas' outputs needs


class Served:
    def __init__(self, target: NativeModel, draft: NativeModel, client: openai.OpenAI, url: str) -> None:
        self.target, self.draft, self.client, self.url = target, draft, client, url

    def alone(self, message: str, schema: dict | None, **sampling) -> str:
        """What `generate` writes alone for one user message, put through the server's chat template, drafting as
        the server does (a fixed k = 3: a seeded sequence draws the same whatever shares its batch)."""
        ids = self.target.tokenizer.encode(f"<user>{message}\n<assistant>", add_special_tokens=False).ids
        return generate(
            self.target, ids, DraftModel(self.draft, 3), max_new_tokens=LIMIT, json_schema=schema, **sampling
        ).text


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    """A target with a chat template, served with the draft model at k = 3 every step."""
    target_dir, draft_dir = random_pair(
        tmp_path_factory.mktemp("serve-grammar"), tiny_config(num_hidden_layers=3, max_position_embeddings=512)
    )
    config = json.loads((target_dir / "tokenizer_config.json").read_text())
    (target_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    target, draft = load_model(target_dir, dtype="float32"), load_model(draft_dir, dtype="float32")
    app = serving_app(target, DraftModel(draft, 3), target_dir, name="tiny", adaptive=False)
    with torch_threads(1), ServerThread(app) as srv:
        yield Served(target, draft, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0), srv.url)


def json_schema(i: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"shape{i}", "schema": SCHEMAS[i], "strict": True}}


def chat(served: Served, message: str, response_format: dict, stream: bool, **options) -> tuple[str, str]:
    """(content, finish_reason) of one chat completion."""
    reply = served.client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": message}],
        max_tokens=LIMIT,
        response_format=response_format,
        stream=stream,
        **options,
    )
    if not stream:
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    chunks = list(reply)
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_replies_are_valid_and_as_generate_alone(served: Served, stream: bool) -> None:
    for i, schema in enumerate(SCHEMAS):
        message = f"Describe item {i} as JSON."
        content, reason = chat(served, message, json_schema(i), stream, temperature=0)
        assert reason == "stop"
        jsonschema.validate(json.loads(content), schema)
        assert content == served.alone(message, schema, temperature=0)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_replies(served: Served, stream: bool) -> None:
    """Any JSON object: a random model may go on past the limit, but what it writes is one object so far."""
    content, reason = chat(served, "JSON, please.", {"type": "json_object"}, stream, temperature=0)
    assert content.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(content), dict)
    assert content == served.alone("JSON, please.", {"type": "object"}, temperature=0)
    completion = served.client.completions.create(
        model="tiny",
        prompt="x =",
        max_tokens=LIMIT,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert completion.choices[0].text.startswith("{")


def test_16_concurrent_constrained_clients(served: Served) -> None:
    """Greedy and seeded sampled streams with different schemas (and one with none) share the batch; each gets what
    it would get alone."""
    results: list[tuple[str, str] | None] = [None] * 16
    start = threading.Barrier(16)

    def options(i: int) -> dict:
        sampled = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0}
        return sampled | {"response_format": json_schema(i % 3) if i != 5 else {"type": "text"}}

    def run(i: int) -> None:
        start.wait()
        results[i] = chat(served, f"Item {i} as JSON.", stream=True, **options(i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (content, reason) in enumerate(results):
        schema = None if i == 5 else SCHEMAS[i % 3]
        sampling = {k: v for k, v in options(i).items() if k in ("temperature", "seed")}
        assert content == served.alone(f"Item {i} as JSON.", schema, **sampling), i
        if schema is not None:
            assert reason == "stop"
            jsonschema.validate(json.loads(content), schema)


@pytest.mark.parametrize(
    "response_format, words",
    [
        ({"type": "json_schema"}, "json_schema goes with type json_schema"),
        ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "json_schema goes with type json_schema"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema.name"),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}},
            },
            "minimum (3) is greater than maximum (1)",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wood"}}}, "the JSON schema cannot"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/none"}}}, "does not exist"),
    ],
)
def test_bad_response_formats_get_a_400_that_says_why(served: Served, response_format: dict, words: str) -> None:
    for path, body in (
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("completions", {"prompt": "hi"}),
    ):
        response = httpx.post(
            f"{served.url}/v1/{path}", json={"model": "tiny", "response_format": response_format, **body}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error", error
    with pytest.raises(openai.BadRequestError, match="ignore_eos cannot be combined with a grammar"):
        served.client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_object"},
            extra_body={"ignore_eos": True},
        )
