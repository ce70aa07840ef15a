"""A float16 key/value cache beside float32 activations (`load_model(kv_dtype=)`): the default for block-quantized
weights, as llama.cpp keeps its cache. Every path stores the keys and values rounded to float16 and reads them back
widened, the kernels' (store_kv_f16, attend_f32_f16) and PyTorch's alike."""

from __future__ import annotations

import ctypes

import pytest
import torch

from verispec import kernels
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.cli import main
from verispec.drafters import PromptLookup
from verispec.errors import InvalidArgumentError
from verispec.generate import generate
from verispec.models.cache import saturate_f16
from verispec.models.native import load_model

needs_kernels = pytest.mark.skipif(
    not kernels.available(torch.float32), reason=f"verispec's kernels do not run here: {kernels.reason()}"
)


@pytest.fixture(autouse=True)
def one_thread(single_thread: None) -> None:
    """One thread, for speed on a shared machine (tests/test_pool.py takes every count)."""


@needs_kernels
def test_store_kv_rounds_to_float16_as_torch_does() -> None:
    Hkv, D, S = 2, 40, 9  # D past a whole vector: the last lanes masked
    new = torch.randn(3, 2 * Hkv * D, generator=torch.Generator().manual_seed(3)) * 300
    new[0, :9] = torch.tensor([1e-6, 7e4, -7e4, 6.1e-5, 1e-8, 2049.0, 2051.0, float("inf"), 65519.0])  # subnormal,
    # saturated at float16's largest finite value, ties to even
    keys, values = torch.zeros(Hkv, S, D, dtype=torch.float16), torch.zeros(Hkv, S, D, dtype=torch.float16)
    kernels.store_kv(new[:, : Hkv * D], new[:, Hkv * D :], keys, values, ctypes.c_int64(4))
    for cache, part in ((keys, new[:, : Hkv * D]), (values, new[:, Hkv * D :])):
        expected = part.reshape(3, Hkv, D).transpose(0, 1).clamp(-65504, 65504).half()
        assert torch.equal(cache[:, 4:7].view(torch.int16), expected.view(torch.int16))
        assert torch.equal(saturate_f16(part, cache).half(), part.clamp(-65504, 65504).half())
        assert not cache[:, :4].any() and not cache[:, 7:].any()
    assert keys.isfinite().all() and keys[0, 4, 1] == 65504 == -keys[0, 4, 2]  # saturated, never an infinity
    nan = torch.full((1, 2 * Hkv * D), float("nan"))
    kernels.store_kv(nan[:, : Hkv * D], nan[:, Hkv * D :], keys, values, ctypes.c_int64(8))
    assert keys[:, 8].isnan().all()  # a NaN stays a NaN
    with pytest.raises(ValueError, match="float16 for float32 rows"):
        kernels.store_kv(new[:, : Hkv * D].bfloat16(), new[:, Hkv * D :].bfloat16(), keys, values, ctypes.c_int64(0))
    with pytest.raises(IndexError, match="outside a cache of 9"):
        kernels.store_kv(new[:, : Hkv * D], new[:, Hkv * D :], keys, values, ctypes.c_int64(7))


@needs_kernels
@pytest.mark.parametrize("H, Hkv, D", [(9, 3, 64), (4, 1, 17), (8, 2, 128)])
def test_attention_over_a_float16_cache_is_the_float32_kernel_over_it_widened(H: int, Hkv: int, D: int) -> None:
    """The keys widen exactly, so the bits are the float32 kernel's over the widened cache: each row its own."""
    generator = torch.Generator().manual_seed(H * D)
    R, S = 5, 90
    q = torch.randn(H, R, D, generator=generator)
    k, v = (torch.randn(Hkv, S, D, generator=generator).half() for _ in range(2))
    visible = (torch.rand(R, S, generator=generator) < 0.6).to(torch.uint8)
    visible[:, 0] = 1
    y = kernels.attend(q, k, v, visible)
    assert y.dtype == torch.float32 and torch.equal(y, kernels.attend(q, k.float(), v.float(), visible))
    for r in range(R):
        assert torch.equal(kernels.attend(q[:, r : r + 1], k, v, visible[r : r + 1].contiguous()), y[r : r + 1])
    with pytest.raises(ValueError, match="float32 or bfloat16 tensors of one dtype"):
        kernels.attend(q.bfloat16(), k, v, visible)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    return random_checkpoint(tmp_path_factory.mktemp("kv"), tiny_config())


def test_a_cache_holds_float16_by_default_only_beside_block_quantized_weights(folder) -> None:
    assert load_model(folder, dtype="float32").kv_dtype == torch.float32
    assert load_model(folder, dtype="bfloat16", fast=False).kv_dtype == torch.bfloat16
    model = load_model(folder, kv_dtype="float16")
    cache = model.new_cache(20)
    assert model.kv_dtype == cache.k.dtype == model.new_batch_cache(2, 20).k.dtype == torch.float16
    with pytest.raises(InvalidArgumentError, match=r"activations' dtype \(torch.float32\), or float16; got torch"):
        load_model(folder, dtype="float32", kv_dtype="bfloat16")
    with pytest.raises(InvalidArgumentError, match=r"\(torch.bfloat16\); got torch.float16"):
        load_model(folder, dtype="bfloat16", fast=False, kv_dtype="float16")
    with pytest.raises(InvalidArgumentError, match="unknown dtype"):
        load_model(folder, kv_dtype="float8")


@needs_kernels
def test_a_quantized_model_keeps_a_float16_cache_unless_asked(folder) -> None:
    """A sequence's cache, which verispec's attention widens as it reads; the batched engine's PyTorch attention
    would widen it every layer, so its cache holds float16 only when asked."""
    model = load_model(folder, quantize="q4_1")
    assert model.kv_dtype == torch.float16 and model.new_batch_cache(2, 20).k.dtype == torch.float32
    assert load_model(folder, quantize="q4_1", kv_dtype="float32").kv_dtype == torch.float32


@pytest.mark.parametrize("fast", [True, False], ids=["packed", "plain"])
def test_every_path_reads_the_float16_cache_alike(folder, fast: bool) -> None:
    """The kernels' forward (where they run), PyTorch's and the batched one give the same logits over a float16 cache
    (within float32 rounding), near the float32 cache's; and in exact mode greedy speculation is plain greedy
    decoding."""
    tokens = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(5))
    model = load_model(folder, fast=fast, kv_dtype="float16")
    wide = load_model(folder, fast=False, dtype="float32")
    logits = model(tokens, model.new_cache(40))
    by_torch = load_model(folder, fast=False, kv_dtype="float16")(tokens, model.new_cache(40))
    batch = model.new_batch_cache(2, 40)
    batched = model.forward_batch(tokens.expand(2, -1), batch, [0, 1], [24, 24])
    assert torch.allclose(logits, by_torch, atol=1e-5, rtol=1e-5)
    assert torch.allclose(batched[0], logits[0], atol=1e-5, rtol=1e-5)
    assert torch.allclose(logits, wide(tokens, wide.new_cache(40)), atol=2e-2)
    assert not torch.equal(logits, wide(tokens, wide.new_cache(40)))  # the cache did round
    exact, prompt = load_model(folder, fast=fast, exact=True, kv_dtype="float16"), [5, 6, 7, 5, 6, 7, 5, 6]
    plain = generate(exact, prompt, None, max_new_tokens=24).tokens
    assert generate(exact, prompt, PromptLookup(3), max_new_tokens=24).tokens == plain


def test_the_cli_takes_a_cache_dtype_and_refuses_one_the_activations_do_not_go_with(pair_dirs, capsys) -> None:
    target, draft = map(str, pair_dirs)
    args = ["generate", "x = 1", "--max-new-tokens", "6", "--threads", "1", "--color", "never", "--target", target]
    assert main([*args, "--draft", draft, "--dtype", "float32", "--kv-dtype", "float16", "--compare"]) == 0
    assert "identical to autoregressive: yes" in capsys.readouterr().out
    assert main([*args, "--kv-dtype", "float16"]) == 0  # --dtype auto: float32 activations for the cache
    capsys.readouterr()
    assert main([*args, "--dtype", "float32", "--kv-dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a key/value cache holds the activations' dtype" in err
    assert main([*args, "--backend", "transformers", "--kv-dtype", "float16"]) == 2
    assert "a cache dtype is a mode of the native runtime" in capsys.readouterr().err
