"""The batched engine in exact mode on verispec's kernels (models/slot_caches.py): each row of a batched forward gets
bitwise the logits its sequence gets alone, whatever shares the forward, so every request's tokens are those it gets
alone; and the engine's key/value memory (engine/kv_budget.py): a context per request, one budget for all, caches
that grow with their tokens."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from test_engine import run, tokens
from tests.gguf_files import bpe_vocab, by_name, gguf_config, write_gguf
from verispec import kernels
from verispec.drafters import DraftModel, PromptLookup, SuffixDecoding
from verispec.drafters.registry import Method, Resources, build_drafter
from verispec.engine import Engine, Request
from verispec.engine import engine as engine_module
from verispec.engine.kv_budget import KVBudget, byte_size
from verispec.errors import ContextLengthError, InvalidArgumentError
from verispec.generate import generate
from verispec.models.cache import FIRST_SLOTS
from verispec.models.native import load_default, load_model
from verispec.sampling import SamplingParams
from verispec.threads import torch_threads

pytestmark = pytest.mark.skipif(
    not kernels.available(torch.float32), reason=f"verispec's kernels do not run here: {kernels.reason()}"
)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory) -> str:
    types = by_name({"q_proj": GGML.Q4_K, "k_proj": GGML.Q5_K, "down": GGML.Q6_K}, GGML.Q8_0)
    return str(write_gguf(tmp_path_factory.mktemp("kq") / "model.gguf", gguf_config(len(bpe_vocab()[0])), types))


@pytest.fixture(scope="module", params=["bfloat16", "float32", "q4_1", "gguf"])
def exact_target(request, pair_dirs, k_quant_file):
    if request.param == "gguf":
        return load_model(k_quant_file, dtype="auto", exact=True)
    if request.param == "q4_1":
        return load_model(pair_dirs[0], quantize="q4_1", exact=True)
    return load_model(pair_dirs[0], dtype=request.param, exact=True)


def test_each_row_of_a_batched_forward_is_its_sequence_alone(exact_target) -> None:
    """Sequences of different cache lengths and row counts in one forward: every real row's logits bitwise equal a
    forward of that sequence alone (as `generate` runs it)."""
    model = exact_target
    generator = torch.Generator().manual_seed(0)
    lengths, counts = [0, 5, 17, 3, 40, 1], [4, 1, 3, 6, 2, 5]
    sequences = [torch.randint(0, 250, (1, n + c), generator=generator) for n, c in zip(lengths, counts)]
    batch = model.new_batch_cache(len(lengths), 128)
    for slot, (n, seq) in enumerate(zip(lengths, sequences)):
        if n:  # a prefill: keys and values stored, no LM head
            assert model.forward_batch(seq[:, :n], batch, [slot], [n], logits=False) is None
    x = torch.zeros(len(lengths), max(counts), dtype=torch.long)
    for b, (n, c, seq) in enumerate(zip(lengths, counts, sequences)):
        x[b, :c] = seq[0, n:]
    logits = model.forward_batch(x, batch, list(range(len(lengths))), counts)
    assert batch.lengths == [n + c for n, c in zip(lengths, counts)]
    for b, (n, c, seq) in enumerate(zip(lengths, counts, sequences)):
        alone = model.new_cache()
        if n:
            model(seq[:, :n], alone)
        assert torch.equal(logits[b, :c], model(seq[:, n:], alone)[0]), f"row {b}"


def drafters(target, draft):
    return {
        "plain": None,
        "draft": DraftModel(draft, 3),
        "ngram": PromptLookup(3),
        "suffix": SuffixDecoding(3),
        "selfquant": build_drafter(Method("selfquant", 3), Resources(target=target)),
    }


PROMPTS = [
    [100, 101, 102, 40, 120, 41, 58, 10, 32, 32],
    [7],
    [50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190, 200],
    [33, 34, 35, 36, 33, 34, 35, 36, 33, 34, 35],
    [9, 8, 7],
    [200, 201],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
    [77] * 6,
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("method", ["plain", "draft", "ngram", "suffix", "selfquant"])
def test_staggered_requests_get_the_tokens_they_get_alone(pair_dirs, method, threads) -> None:
    """Eight requests of mixed prompt lengths and max_new_tokens from 1 to 64, joining two at a time as the engine
    steps (so they join and leave mid-batch): each one's greedy tokens are those of the same request alone."""
    with torch_threads(threads):
        target = load_model(pair_dirs[0], quantize="q4_1", exact=True)
        draft = load_model(pair_dirs[1], quantize="q4_1")
        limits = [64, 1, 33, 17, 5, 48, 2, 25]
        alone = {}
        for i, (prompt, limit) in enumerate(zip(PROMPTS, limits)):
            engine = Engine(target, drafters(target, draft)[method], max_batch=1, adaptive=False)
            engine.add(Request(prompt, limit, GREEDY, ignore_eos=True))
            alone[i] = [t for u in run(engine).values() for t in tokens(u)]
            assert alone[i] == generate(target, prompt, max_new_tokens=limit, ignore_eos=True).tokens
        engine = Engine(target, drafters(target, draft)[method], max_batch=8, adaptive=False)
        assert staggered(engine, limits) == alone and engine.metrics.exact


@pytest.mark.parametrize("which", ["shipped pair", "gguf"])
def test_staggered_requests_on_the_shipped_pair_and_a_block_format_gguf(which, k_quant_file) -> None:
    """The same on the shipped pair (exact bfloat16, its draft model) and on a GGUF's own K-quant blocks (suffix)."""
    if which == "shipped pair":
        target, draft = load_default(exact=True)
        make = lambda: DraftModel(draft, 3)  # noqa: E731
    else:
        target = load_model(k_quant_file, dtype="auto", exact=True)
        make = lambda: SuffixDecoding(3)  # noqa: E731
    limits = [30, 1, 12, 7, 20, 3, 16, 9]
    alone = [
        generate(target, prompt, max_new_tokens=limit, ignore_eos=True).tokens for prompt, limit in zip(PROMPTS, limits)
    ]
    assert staggered(Engine(target, make(), max_batch=8, adaptive=False), limits) == dict(enumerate(alone))


def test_prompts_that_join_together_prefill_in_bounded_forwards(k_quant_file, monkeypatch) -> None:
    """Prompts joining at once are prefilled a window of columns at a time, at most about PREFILL_ROWS real tokens a
    forward (its activations' memory), and every request still gets its tokens alone."""
    target = load_model(k_quant_file, dtype="auto", exact=True)
    limits = [6, 3, 9, 4, 7, 2, 5, 8]
    alone = [
        generate(target, prompt, max_new_tokens=limit, ignore_eos=True).tokens for prompt, limit in zip(PROMPTS, limits)
    ]
    monkeypatch.setattr(engine_module, "PREFILL_ROWS", 10)
    real_rows, forward_batch = [], target.forward_batch

    def counted(tokens, cache, slots, counts, head=None, logits=True):
        if not logits:
            real_rows.append(sum(counts))
        return forward_batch(tokens, cache, slots, counts, head, logits)

    monkeypatch.setattr(target, "forward_batch", counted)
    engine = Engine(target, SuffixDecoding(3), max_batch=8, adaptive=False)
    ids = [engine.add(Request(prompt, limit, GREEDY, ignore_eos=True)) for prompt, limit in zip(PROMPTS, limits)]
    updates = run(engine)
    assert [tokens(updates[i]) for i in ids] == alone
    prompt_tokens = sum(len(prompt) - 1 for prompt in PROMPTS)
    assert sum(real_rows) == prompt_tokens and len(real_rows) > 1 and max(real_rows) <= max(10, len(PROMPTS))


def test_a_seeded_sampled_request_draws_the_same_alone_and_beside_others(pair_dirs) -> None:
    """At a fixed k, its drafts, q and p are its own: the same draws from its own generator."""
    target, draft = load_model(pair_dirs[0], exact=True), load_model(pair_dirs[1])
    sampled = Request(PROMPTS[0], 40, SamplingParams(temperature=0.9, top_p=0.95), seed=7, ignore_eos=True)
    engine = Engine(target, DraftModel(draft, 3), max_batch=4, adaptive=False)
    engine.add(sampled)
    alone = [t for u in run(engine).values() for t in tokens(u)]
    engine = Engine(target, DraftModel(draft, 3), max_batch=4, adaptive=False)
    for prompt in PROMPTS[1:3]:
        engine.add(Request(prompt, 30, SamplingParams(temperature=1.0), seed=3, ignore_eos=True))
    mine = engine.add(sampled)
    assert tokens(run(engine)[mine]) == alone


def test_requests_wait_for_room_in_the_budget_and_one_that_never_fits_is_refused(pair_dirs) -> None:
    target = load_model(pair_dirs[0], quantize="q4_1", exact=True)
    per_position = target.new_batch_cache(1).bytes_per_position
    engine = Engine(target, None, max_batch=8, kv_memory=128 * per_position)  # 128 positions: one request at a time
    with pytest.raises(InvalidArgumentError, match="more than the whole --kv-cache-memory"):
        engine.add(Request(PROMPTS[0], 150, GREEDY, ignore_eos=True))
    ids = [engine.add(Request(prompt, 100, GREEDY, ignore_eos=True)) for prompt in PROMPTS[:3]]
    updates: dict[int, list] = {}
    for update in engine.step():
        updates.setdefault(update.request_id, []).append(update)
    assert engine.metrics.running == 1 and engine.metrics.waiting == 2
    assert 0 < engine.metrics.kv_reserved_bytes <= engine.metrics.kv_budget_bytes == 128 * per_position
    for request_id, done in run(engine).items():
        updates.setdefault(request_id, []).extend(done)
    for request_id, prompt in zip(ids, PROMPTS):
        assert tokens(updates[request_id]) == generate(target, prompt, max_new_tokens=100, ignore_eos=True).tokens
    assert engine.budget.reserved == 0 and engine.cache.nbytes == 0  # every slot's memory given back


def test_a_context_per_request(pair_dirs) -> None:
    target = load_model(pair_dirs[0], exact=True)
    engine = Engine(target, None, max_batch=2, context=32)
    with pytest.raises(ContextLengthError, match="context length is 32"):
        engine.add(Request([5] * 40, 4, GREEDY))
    with pytest.raises(InvalidArgumentError, match="--max-model-len must be from 1"):
        Engine(target, None, context=target.context_length + 1)


def test_a_huge_context_and_batch_hold_only_what_their_tokens_need(tmp_path) -> None:
    """A model whose context is a million positions, served 64 at a time: nothing is allocated for the context, and
    the caches hold what their tokens need (a cache without rows starts at FIRST_SLOTS and doubles)."""
    config = gguf_config(len(bpe_vocab()[0]), max_position_embeddings=2**20)
    huge = write_gguf(tmp_path / "huge.gguf", config, by_name({}, GGML.Q8_0))
    model = load_model(str(huge), dtype="auto", exact=True)
    engine = Engine(model, SuffixDecoding(3), max_batch=64, context=2**20, kv_memory=byte_size("64MiB"))
    assert engine.cache.nbytes == 0
    for prompt in PROMPTS:
        engine.add(Request(prompt, 20, GREEDY, ignore_eos=True))
    run(engine)
    assert engine.metrics.kv_budget_bytes == 64 * 2**20
    cache = model.new_cache()
    assert cache.k.shape[3] == cache.slots == FIRST_SLOTS and cache.max_len == 2**20
    model(torch.zeros(1, FIRST_SLOTS + 5, dtype=torch.long), cache)
    assert cache.k.shape[3] == cache.slots == 2 * FIRST_SLOTS and cache.length == FIRST_SLOTS + 5


def test_byte_sizes() -> None:
    assert [byte_size(s) for s in ("2GiB", "512MiB", "1.5G", "1000", "3kb")] == [
        2 * 2**30,
        512 * 2**20,
        int(1.5 * 2**30),
        1000,
        3000,
    ]
    for bad in ("", "GiB", "2 parsecs", "-"):
        with pytest.raises(ValueError):
            byte_size(bad)
    assert KVBudget.context_for(32768, None) == 8192 and KVBudget.context_for(2048, None) == 2048


def staggered(engine: Engine, limits: list[int]) -> dict[int, list[int]]:
    """PROMPTS[i] with max_new_tokens limits[i], added two at a time between the engine's steps: each one's tokens."""
    ids, updates = {}, {}
    for i in range(0, len(PROMPTS), 2):
        for j in (i, i + 1):
            ids[engine.add(Request(PROMPTS[j], limits[j], GREEDY, ignore_eos=True))] = j
        for update in engine.step():
            updates.setdefault(update.request_id, []).append(update)
    for request_id, done in run(engine).items():
        updates.setdefault(request_id, []).extend(done)
    return {i: tokens(updates[request_id]) for request_id, i in ids.items()}


@pytest.mark.parametrize("method", ["suffix", "draft"])
def test_the_server_answers_staggered_concurrent_requests_as_it_answers_each_alone(pair_dirs, method) -> None:
    """Through HTTP: eight streams started a few milliseconds apart, prompts of mixed lengths and max_tokens, each
    answered with the text it gets alone; the response and /metrics say the answers are exact."""
    import threading
    import time

    import httpx

    from verispec.serve.app import serving_app
    from verispec.serve.server import ServerThread

    target, draft = load_model(pair_dirs[0], quantize="q4_1", exact=True), load_model(pair_dirs[1], quantize="q4_1")
    prompts = [
        "def parse_header(line):",
        "import os\n",
        "class Stack:\n    def push(self, item):",
        "x = [",
        "for i in range(10):",
        "# sort the list\n",
        "def f(a, b):\n    return",
        "while True:",
    ]
    limits = [40, 1, 64, 9, 23, 2, 50, 17]
    drafter = DraftModel(draft, 3) if method == "draft" else SuffixDecoding(3)
    with torch_threads(2), ServerThread(serving_app(target, drafter, name="t", max_batch=8)) as server:

        def ask(prompt: str, limit: int) -> dict:
            body = {"model": "t", "prompt": prompt, "max_tokens": limit, "temperature": 0, "ignore_eos": True}
            return httpx.post(f"{server.url}/v1/completions", json=body, timeout=300).json()

        alone = [ask(p, n)["choices"][0]["text"] for p, n in zip(prompts, limits)]
        together: dict[int, dict] = {}

        def client(i: int) -> None:
            time.sleep(0.003 * i)
            together[i] = ask(prompts[i], limits[i])

        clients = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert [together[i]["choices"][0]["text"] for i in range(len(prompts))] == alone
    assert all(together[i]["verispec"]["exact"] for i in together)
    assert "verispec_exact 1.0" in metrics and "verispec_kv_cache_budget_bytes 2.147483648e+09" in metrics
