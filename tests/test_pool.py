"""verispec's kernels on many threads (kernels/pool.cpp): every kernel, and a whole model, gives bitwise the same
results at any thread count and any row count; greedy output is the same at one thread and two; the pool survives a
busy core, concurrent callers and a fork."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from tests.gguf_files import bpe_vocab, by_name, gguf_config, write_gguf
from tests.test_quantized_matmul import random_weight
from verispec import kernels
from verispec.checkpoints.blocks import KEPT
from verispec.drafters import DraftModel, LayerSkip, Lookahead, PromptLookup, SuffixDecoding
from verispec.drafters.registry import Method, Resources, build_drafter
from verispec.generate import generate
from verispec.kernels.build import pool_threads
from verispec.models.native import load_model
from verispec.models.packed import packing
from verispec.threads import torch_threads

pytestmark = pytest.mark.skipif(
    not kernels.available(torch.float32), reason=f"verispec's kernels do not run here: {kernels.reason()}"
)
THREADS = [1, 2, 3, 4]  # more than this machine's cores is fine: the bits cannot depend on the count
ROWS = range(1, 17)


def at_each_count(compute) -> dict[int, list[torch.Tensor]]:
    """compute() at every thread count in THREADS (a list of tensors each time)."""
    out = {}
    for threads in THREADS:
        with torch_threads(threads):
            assert pool_threads() == threads
            out[threads] = compute()
    return out


def assert_all_equal(results: dict[int, list[torch.Tensor]]) -> None:
    for threads, tensors in results.items():
        for i, (one, other) in enumerate(zip(results[1], tensors)):
            assert torch.equal(one, other), f"output {i} differs at {threads} threads"


@pytest.mark.parametrize("fmt", sorted(KEPT) + ["float32", "bfloat16"])
def test_a_matmul_gives_the_same_bits_at_any_thread_count_and_row_count(fmt: str) -> None:
    generator = torch.Generator().manual_seed(5)
    N, K = 1000, 512  # 63 column blocks of 16 (16 of 64 on AVX-512's float matmul), the last one partial
    if fmt in KEPT:
        matmul, dtype = kernels.Matmul(random_weight(fmt, N, K, generator).blocks, torch.randn(N), fmt), torch.float32
    else:
        dtype = getattr(torch, fmt)
        matmul = kernels.Matmul(torch.randn(N, K, generator=generator).to(dtype), torch.randn(N))
    x = torch.randn(16, K, generator=generator).to(dtype)
    residual = torch.randn(16, N, generator=generator).to(dtype)
    results = at_each_count(lambda: [matmul(x[:rows]) for rows in ROWS] + [matmul(x[:7], residual[:7])])
    assert_all_equal(results)
    for threads in THREADS:  # and the first row's bits are its own, whatever rows share its call
        assert all(torch.equal(results[threads][rows - 1][0], results[1][0][0]) for rows in ROWS)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("heads", [(4, 2), (9, 3), (12, 2), (3, 3)])
def test_attention_gives_the_same_bits_at_any_thread_count(cache: str, heads: tuple[int, int]) -> None:
    """Split by rows, key heads and parts of their groups of query heads: a head's numbers are its own."""
    H, Hkv = heads
    generator = torch.Generator().manual_seed(H)
    dtype = torch.float32 if cache == "float16" else getattr(torch, cache)
    D, S = 64, 70
    k, v = (torch.randn(Hkv, S, D, generator=generator).to(getattr(torch, cache)) for _ in range(2))
    q = torch.randn(H, 16, D, generator=generator).to(dtype)
    visible = (torch.rand(16, S, generator=generator) < 0.7).to(torch.uint8)
    visible[:, 0] = 1
    assert_all_equal(at_each_count(lambda: [kernels.attend(q[:, :rows], k, v, visible[:rows]) for rows in ROWS]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_row_wise_kernels_give_the_same_bits_at_any_thread_count(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=generator).to(dtype)  # enough rows to be split
    weight, cos, sin = (
        torch.randn(96, generator=generator).to(dtype),
        *torch.randn(2, 64, 32, generator=generator).to(dtype),
    )

    def compute() -> list[torch.Tensor]:
        rotated = x.clone().view(64, 3, 32).transpose(0, 1)
        kernels.rotary_(rotated, cos, sin)
        return [kernels.rms_norm(x, weight, 1e-5), kernels.silu_mul(x), rotated.transpose(0, 1).reshape(64, 96)]

    assert_all_equal(at_each_count(compute))


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory) -> str:
    """A model in K-quants and Q8_0, its LM head tied to a Q6_K embedding."""
    types = by_name({"q_proj": GGML.Q4_K, "k_proj": GGML.Q5_K, "down": GGML.Q6_K, "embed": GGML.Q6_K}, GGML.Q8_0)
    config = gguf_config(len(bpe_vocab()[0]), tie_word_embeddings=True)
    return str(write_gguf(tmp_path_factory.mktemp("kq") / "model.gguf", config, types))


@pytest.mark.parametrize("precision", ["gguf", "q4_1", "float32", "bfloat16", "float16-cache"])
def test_a_models_logits_are_the_same_bits_at_any_thread_count(precision: str, k_quant_file: str, pair_dirs) -> None:
    """Prefills of 1 to 16 rows, and single tokens after them (captured replays included), at 1 to 4 threads."""
    if precision == "gguf":
        model = load_model(k_quant_file, dtype="auto")
    elif precision == "q4_1":
        model = load_model(pair_dirs[0], quantize="q4_1")
    elif precision == "float16-cache":
        model = load_model(pair_dirs[0], dtype="float32", kv_dtype="float16")
    else:
        model = load_model(pair_dirs[0], dtype=precision)
    assert packing(model.module).kernels
    tokens = torch.randint(0, 250, (1, 20), generator=torch.Generator().manual_seed(2))

    def compute() -> list[torch.Tensor]:
        out = []
        for rows in ROWS:
            cache = model.new_cache()
            out.append(model(tokens[:, :rows], cache)[0])
            for i in range(rows, rows + 3):  # decoding steps: captured on the first shapes, replayed after
                out.append(model(tokens[:, i : i + 1], cache)[0])
        return out

    assert_all_equal(at_each_count(compute))


METHODS = {
    "draft": lambda draft, target: DraftModel(draft, 4),
    "draft_tree": lambda draft, target: DraftModel(draft, 3, branch=2, branch_depth=2),
    "ngram": lambda draft, target: PromptLookup(4),
    "suffix": lambda draft, target: SuffixDecoding(4),
    "suffix_tree": lambda draft, target: SuffixDecoding(4, tree_tokens=6),
    "lookahead": lambda draft, target: Lookahead(window=4, ngram=3, candidates=3),
    "layerskip": lambda draft, target: LayerSkip([1], 3),
    "selfquant": lambda draft, target: build_drafter(Method("selfquant", 3), Resources(target=target)),
}


@pytest.mark.parametrize("method", [None, *METHODS])
def test_greedy_output_of_every_method_is_the_same_at_one_thread_and_two(method: str | None, pair_dirs) -> None:
    outputs = []
    for threads in (1, 2):
        with torch_threads(threads):
            target, draft = load_model(pair_dirs[0], quantize="q4_1"), load_model(pair_dirs[1], quantize="q4_1")
            drafter = None if method is None else METHODS[method](draft, target)
            outputs.append(generate(target, "def f(x):", drafter, max_new_tokens=40, ignore_eos=True).tokens)
    assert outputs[0] == outputs[1]


def test_a_busy_core_slows_the_pool_but_never_changes_or_stops_it() -> None:
    """Another process spinning on one of the cores this process runs on: every call still completes with the same
    bits (a worker on that core runs in time slices; the others, and the caller, take its chunks)."""
    generator = torch.Generator().manual_seed(9)
    matmul = kernels.Matmul(random_weight("q4_k", 2048, 1024, generator).blocks, None, "q4_k")
    x = torch.randn(8, 1024, generator=generator)
    with torch_threads(1):
        expected = [matmul(x[:rows]) for rows in (1, 3, 8)]
    cpus = sorted(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(busy.pid, {cpus[0]})
        for threads in (2, len(cpus) + 1):
            with torch_threads(threads):
                for _ in range(50):
                    assert all(torch.equal(matmul(x[:rows]), y) for rows, y in zip((1, 3, 8), expected))
    finally:
        busy.kill()
        busy.wait()


def test_concurrent_callers_each_get_their_own_bits() -> None:
    """The pool takes one caller at a time; another runs its call on its own thread, with the same bits."""
    generator = torch.Generator().manual_seed(4)
    matmul = kernels.Matmul(random_weight("q8_0", 512, 512, generator).blocks, None, "q8_0")
    inputs = [torch.randn(r, 512, generator=generator) for r in (1, 2, 5, 9)]
    with torch_threads(1):
        expected = [matmul(x) for x in inputs]
    failures = []

    def run(i: int) -> None:
        for _ in range(200):
            if not torch.equal(matmul(inputs[i]), expected[i]):
                failures.append(i)

    with torch_threads(2):
        callers = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
    assert not failures


def _in_child(queue) -> None:
    generator = torch.Generator().manual_seed(4)
    matmul = kernels.Matmul(random_weight("q4_0", 256, 256, generator).blocks, None, "q4_0")
    queue.put(matmul(torch.ones(3, 256)).sum().item())


def test_a_forked_child_runs_the_kernels_on_its_own_pool() -> None:
    """A fork has none of the parent's worker threads: the child starts its own (and never waits for the parent's)."""
    with torch_threads(2):
        _in_child(parent := multiprocessing.get_context("fork").Queue())  # the parent's pool is started
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_in_child, args=(queue,))
        child.start()
        child.join(timeout=120)
    assert child.exitcode == 0 and queue.get(timeout=5) == parent.get(timeout=5)
