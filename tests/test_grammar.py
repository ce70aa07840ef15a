"""Grammar-constrained decoding: every method's greedy output under a JSON schema is valid JSON under it and token for
token what constrained plain decoding gives; drafts the grammar forbids are dropped before they cost a row of the
target's forward; the matcher follows the cache; the batched engine and the CLI; bad grammars refused with the reason.
(Sampling's exactness: tests/test_grammar_sampling.py; the server: tests/test_serve_grammar.py.)"""

from __future__ import annotations

import json
import re
from typing import Sequence

import jsonschema
import pytest
import torch

from drafting import OwnSession
from test_drafters import EXAMPLES, PROMPT, built  # noqa: F401 (built: the fixture that builds each example)
from verispec import Engine, Request, SamplingParams, generate, generate_batch
from verispec.cli import main
from verispec.drafters.base import Needs, Proposal
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.ngram import PromptLookup
from verispec.errors import GrammarError, InvalidArgumentError
from verispec.grammar import Grammar, TokenGrammar, bind
from verispec.step import speculative_step
from verispec.tree import depths

pytestmark = pytest.mark.usefixtures("single_thread")

N = 200  # more than any output of these schemas needs: each one ends with the end-of-sequence token

SCHEMAS = {
    "record": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "admin": {"type": "boolean"},
            "role": {"enum": ["user", "staff", "guest"]},
        },
        "required": ["name", "age", "admin", "role"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["point", "tags"],
        "additionalProperties": False,
    },
    "list": {
        "type": "array",
        "minItems": 1,
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
    },
    "choice": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"enum": ["yes", "no"]}, {"type": "null"}]},
}


@pytest.fixture(scope="module")
def grammars(target) -> dict[str, TokenGrammar]:
    return {name: bind(Grammar.json_schema(schema), target) for name, schema in SCHEMAS.items()}


@pytest.fixture(scope="module")
def plain(target, grammars) -> dict[str, list[int]]:
    """Constrained plain decoding: each step the argmax of the target's logits with the forbidden tokens masked."""
    return {name: generate(target, PROMPT, max_new_tokens=N, grammar=g).tokens for name, g in grammars.items()}


def parsed(target, tokens: list[int]) -> object:
    assert tokens[-1] in target.eos_token_ids  # the grammar completed, and then the output ended
    return json.loads(target.tokenizer.decode(tokens[:-1]))


@pytest.mark.parametrize("schema", SCHEMAS)
def test_plain_decoding_gives_json_valid_under_the_schema(target, plain, schema) -> None:
    jsonschema.validate(parsed(target, plain[schema]), SCHEMAS[schema])


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("name", EXAMPLES)
def test_every_method_decodes_exactly_as_constrained_plain_decoding(
    target, built, grammars, plain, name, schema
) -> None:
    out = generate(target, PROMPT, built(name), max_new_tokens=N, grammar=grammars[schema])
    assert out.stop_reason == "eos"
    # Drafts were verified, not all cut (a choice is a token or two long). Re-encoding proposes the draft's own
    # greedy text, which no grammar masks: on this random pair it is what the unconstrained target would say, which
    # the grammar mostly forbids, so it may never be accepted.
    if name not in ("autoregressive", "draft reencode") and schema != "choice":
        assert out.stats.accepted > 0
    jsonschema.validate(parsed(target, out.tokens), SCHEMAS[schema])
    assert out.tokens == plain[schema]


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(regex=r"(ab|cd)[0-9]{2,4}-[xyz]+q"), r"(ab|cd)[0-9]{2,4}-[xyz]+q"),
        (
            dict(grammar='start: item ("," item)* "."\nitem: "yes" | "no" | NUMBER\nNUMBER: /[0-9]{1,3}/'),
            r"(yes|no|[0-9]{1,3})(,(yes|no|[0-9]{1,3}))*\.",
        ),
        (dict(grammar='root ::= "(" [a-c] [a-c]? [a-c]? ")" ("!" | "?")'), r"\([a-c]{1,3}\)[!?]"),  # GBNF
    ],
)
def test_regex_lark_and_gbnf(target, draft, options, match) -> None:
    truth = generate(target, PROMPT, max_new_tokens=60, **options)
    assert truth.stop_reason == "eos" and re.fullmatch(match, truth.text), truth.text
    for drafter in (DraftModel(draft, 4), DraftModel(draft, 3, branch=2), PromptLookup(3)):
        assert generate(target, PROMPT, drafter, max_new_tokens=60, **options).tokens == truth.tokens


class Scripted(OwnSession):
    """Proposes the tokens it is given, every step."""

    name = "scripted"

    def __init__(self, tokens: list[int], parents: list[int]) -> None:
        self.tokens, self.parents, self.verdicts = tokens, parents, []
        self.k, self.width, self.needs = max(depths(parents)), len(tokens), Needs(tree_masks=True)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        return Proposal(self.tokens, None, self.parents) if k >= self.k else Proposal([])

    def accepted(self, verdict) -> None:
        self.verdicts.append(verdict.path)


class Widths:
    """The target, with the width of each forward it was asked for."""

    def __init__(self, model) -> None:
        self.model, self.widths = model, []

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        self.widths.append(x.shape[1])
        return self.model(x, *args, **kwargs)


def ids(target, text: str) -> list[int]:
    return target.tokenizer.encode(text).ids


def test_a_forbidden_draft_ends_the_proposal_and_costs_no_row(target) -> None:
    grammar = bind(Grammar.regex(r'\{"a": [0-9]\}'), target).start()
    cache = target.new_cache()
    target(torch.tensor([PROMPT[:-1]]), cache)
    spy = Widths(target)
    proposal = Proposal(ids(target, '{"b": 1}'))  # '{' and '"' allowed, 'b' not
    step = speculative_step(spy, cache, PROMPT[-1], proposal, SamplingParams(), torch.Generator(), grammar=grammar)
    assert spy.widths == [3]  # the last committed token and the two allowed drafts
    assert step.path == [0, 1] and step.next_token == ids(target, "a")[0]  # the target's masked argmax
    assert cache.length == len(PROMPT) + 2


def test_a_forbidden_node_drops_its_subtree_and_verdicts_keep_the_drafters_numbering(target) -> None:
    """A tree: node 1 is forbidden, so its child (node 3) goes too; what is verified of node 2's branch is told in
    the drafter's own numbering."""
    a, b, c = ids(target, "1"), ids(target, "x"), ids(target, "2")
    drafter = Scripted([a[0], b[0], c[0], c[0]], parents=[-1, -1, 0, 1])
    out = generate(target, PROMPT, drafter, max_new_tokens=8, regex="[0-9]{6}")
    assert out.tokens == generate(target, PROMPT, max_new_tokens=8, regex="[0-9]{6}").tokens
    assert drafter.verdicts and all(set(path) <= {0, 2} for path in drafter.verdicts)


def test_the_matcher_rolls_back_with_the_cache(target) -> None:
    """Wherever drafting and verification move the matcher, after each commit it allows what a fresh matcher that
    consumed the committed tokens alone allows."""
    bound = bind(Grammar.json_schema(SCHEMAS["list"]), target)
    moved, text = bound.start(), '[{"id": 12, "ok": true}, {"id": 7, "ok": false}]'
    tokens, committed = ids(target, text), 0
    for step, drafted in enumerate((3, 0, 5, 2, 4, 1, 6)):
        moved.check(Proposal(tokens[committed : committed + drafted] + [0]))  # 0 ('!') is never allowed here
        moved.allowed(tokens[committed : committed + 1])  # and a detour
        keep = min(len(tokens), committed + 1 + step % 3)
        moved.commit(tokens[committed:keep])
        committed = keep
        fresh = bound.start()
        fresh.commit(tokens[:committed])
        assert torch.equal(moved.allowed(), fresh.allowed()), step


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(json_schema="{not json"), "not valid JSON"),
        (dict(json_schema=[1]), "must be a JSON object"),
        (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 1}), "minimum (5) is greater than maximum"),
        (dict(json_schema={"$ref": "#/definitions/nope"}), "does not exist"),
        (dict(json_schema={"type": "string", "pattern": "[a-"}), "unclosed character class"),
        (dict(regex="(ab"), "unclosed group"),
        (dict(regex=""), "non-empty string"),
        (dict(grammar="start: missing"), 'unknown name: "missing"'),
        (dict(grammar='root ::= "a" item'), "Rule 'item' not found"),  # GBNF
        (dict(regex="a", json_schema={}), "at most one of json_schema, regex and grammar"),
        (dict(regex="a", ignore_eos=True), "ignore_eos cannot be combined with a grammar"),
    ],
)
def test_bad_grammars_are_refused_with_the_reason(target, options, message) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        generate(target, PROMPT, max_new_tokens=4, **options)


def test_a_vocabulary_that_cannot_complete_the_grammar_is_refused(tmp_path) -> None:
    from verispec.checkpoints.random_init import random_checkpoint, tiny_config
    from verispec.models.native import load_model

    toy = load_model(random_checkpoint(tmp_path, tiny_config(vocab_size=6, eos_token_id=5)))  # ! " # $ % &
    with pytest.raises(GrammarError, match="cannot be completed in this vocabulary"):
        generate(toy, [1, 2], max_new_tokens=4, regex="x+")  # 'x' is not among them


@pytest.mark.parametrize("drafter", ["none", "draft", "ngram"])
def test_the_batched_engine_decodes_each_request_as_alone(target, draft, grammars, drafter) -> None:
    """Greedy and sampled requests with different grammars (and none) in one batch: each as `generate` alone."""
    make = {"none": lambda: None, "draft": lambda: DraftModel(draft, 3), "ngram": lambda: PromptLookup(3)}[drafter]
    prompts = [PROMPT, PROMPT[:5], [40, 41], PROMPT[3:]]
    asked = [("record", 0.0), (None, 0.0), ("list", 1.0), ("choice", 0.7)]
    engine = Engine(target, make(), max_batch=4, adaptive=False)
    requests = [
        Request(p, N, SamplingParams(temp), seed=i, grammar=grammars.get(schema))
        for i, (p, (schema, temp)) in enumerate(zip(prompts, asked))
    ]
    out = {engine.add(r): [] for r in requests}
    while engine.has_work:
        for update in engine.step():
            assert update.error is None
            out[update.request_id] += update.tokens
    for r, tokens in zip(requests, out.values()):
        alone = generate(
            target,
            r.prompt,
            make(),
            max_new_tokens=N,
            temperature=r.sampling.temperature,
            seed=r.seed,
            grammar=r.grammar,
        )
        assert tokens == alone.tokens
    batch = generate_batch(target, prompts, make(), max_new_tokens=N, json_schema=SCHEMAS["nested"])
    for prompt, result in zip(prompts, batch):
        jsonschema.validate(parsed(target, result.tokens), SCHEMAS["nested"])
        assert result.tokens == generate(target, prompt, max_new_tokens=N, json_schema=SCHEMAS["nested"]).tokens


def test_cli_generate_with_a_schema_a_regex_and_a_grammar(capsys, tmp_path, pair_dirs) -> None:
    target_dir, draft_dir = map(str, pair_dirs)
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMAS["nested"]))
    (tmp_path / "g.lark").write_text('start: "<" WORD ">"\nWORD: /[a-z]{1,6}/')
    (tmp_path / "g.gbnf").write_text('root ::= [0-9] [0-9] "x"')
    base = [
        "generate",
        "Answer:",
        "--target",
        target_dir,
        "--draft",
        draft_dir,
        "-k",
        "3",
        "--max-new-tokens",
        "150",
        "--color",
        "never",
    ]
    for option, shape in (
        (["--json-schema", str(tmp_path / "schema.json")], None),
        (["--regex", "[ab]{2,5}!"], r"[ab]{2,5}!"),
        (["--grammar", str(tmp_path / "g.lark")], r"<[a-z]{1,6}>"),
        (["--grammar", str(tmp_path / "g.gbnf")], r"[0-9]{2}x"),
    ):
        assert main(base + option + ["--compare"]) == 0
        out = capsys.readouterr().out
        text = out.split("\n\n")[0].removeprefix("Answer:")
        if shape is None:
            jsonschema.validate(json.loads(text), SCHEMAS["nested"])
        else:
            assert re.fullmatch(shape, text), text
        assert "stop: eos" in out and "identical to autoregressive: yes" in out


@pytest.mark.parametrize(
    "option, message",
    [
        (["--json-schema", "MISSING"], "--json-schema MISSING: no such file"),
        (["--json-schema", "BAD"], "the JSON schema is not valid JSON"),
        (["--regex", "(x"], "the regex cannot be used"),
        (["--grammar", "BAD"], "the grammar cannot be used"),
        (["--regex", "x", "--grammar", "BAD"], "not allowed with argument"),
    ],
)
def test_cli_refuses_bad_grammars_in_one_line(capsys, tmp_path, pair_dirs, option, message) -> None:
    (tmp_path / "BAD").write_text("start: nothing_here")
    option = [str(tmp_path / o) if o in ("MISSING", "BAD") else o for o in option]
    message = message.replace("MISSING", str(tmp_path / "MISSING"))
    code = main(["generate", "x", "--target", str(pair_dirs[0])] + option)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_the_json_bench_suite_runs_every_row_constrained(tmp_path, pair_dirs, target) -> None:
    """data/bench/json.jsonl: every schema compiles; on it the bench decodes every row under the prompt's schema (the
    baseline too), so greedy rows match it token for token, and runs no peer (they take no grammar)."""
    from verispec.bench.harness import BenchOptions, run_bench
    from verispec.bench.suite import SUITE, read_suite

    suite = read_suite(SUITE.parent / "json.jsonl")
    assert len(suite) >= 12 and all(Grammar.json_schema(item["json_schema"]) for item in suite)
    summary = run_bench(
        *pair_dirs,
        tmp_path,
        [item | {"max_new_tokens": 24} for item in suite[::6]],
        BenchOptions(repeats=1, progress=False, only=["autoregressive", "draft k=4", "ngram k=4"]),
    )
    assert set(summary) == {"autoregressive", "draft k=4", "ngram k=4"}  # (peers were asked for, by default)
    assert all(entry["all"]["exact_match"] == 1.0 for entry in summary.values())
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["info"]["constrained"] and "under each prompt's JSON schema" in (tmp_path / "report.md").read_text()
    first = next(r for r in results["records"] if r["method"] == "autoregressive")
    assert target.tokenizer.decode(first["tokens"]).startswith(("{", "["))
