"""The fast path (`load_model(fast=True)`: prepacked, fused matmuls) computes what the plain path computes, from the
same checkpoint layout, in every way the runtime is called."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from verispec import kernels
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.models.llama import MLP, Attention, Block, Decoder, Embedding, LlamaForCausalLM, RMSNorm
from verispec.models.native import EXACT_ROWS, NativeModel, load_model
from verispec.models.packed import (
    KernelRMSNorm,
    PackedAttention,
    PackedCausalLM,
    PackedMLP,
    Packing,
    pack_model,
    packing,
)

TOKENS = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
CONFIGS = {
    "gqa": tiny_config(num_hidden_layers=2),
    "tied": tiny_config(num_hidden_layers=2, tie_word_embeddings=True),
    "biases": tiny_config(num_hidden_layers=2, qkv_bias=True, o_bias=True),
}


@pytest.fixture(autouse=True)
def one_thread(single_thread: None) -> None:
    """One thread, for speed on a shared machine."""


@pytest.fixture(scope="module", params=list(CONFIGS))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp(request.param), CONFIGS[request.param], seed=3)


@pytest.fixture(scope="module", params=[True, False], ids=["own-kernels", "torch-kernels"])
def own_kernels(request: pytest.FixtureRequest) -> bool:
    if request.param and not kernels.available(torch.float32):
        pytest.skip(f"verispec's kernels do not run on this machine: {kernels.reason()}")
    return request.param


def pair(
    folder: Path, dtype: torch.dtype, exact: bool = False, own_kernels: bool | None = None
) -> tuple[NativeModel, NativeModel]:
    """The plain model and the packed one (on verispec's kernels or PyTorch's; by default where available)."""
    plain, fast = (load_model(folder, dtype=dtype, exact=exact, fast=False) for _ in range(2))
    fast.pack(EXACT_ROWS if exact else 1, own_kernels)
    return plain, fast


def decode(model: NativeModel, **kwargs) -> torch.Tensor:
    """Logits (T, V) of a prefill of 20 tokens, then 4 tokens decoded one at a time."""
    cache = model.new_cache()
    logits = [model(TOKENS[:, :20], cache, **kwargs)[0]]
    logits += [model(TOKENS[:, i : i + 1], cache, **kwargs)[0] for i in range(20, 24)]
    return torch.cat(logits)


def test_fast_loading_packs_and_plain_does_not(folder: Path) -> None:
    plain, fast = pair(folder, torch.float32)
    assert not isinstance(plain.module, PackedCausalLM) and isinstance(fast.module, PackedCausalLM)
    assert fast.module.model.layers[0].self_attn.qkv is not None and fast.module.model.layers[0].mlp.gate_up is not None


@pytest.mark.parametrize("exact", [False, True], ids=["ordinary", "exact"])
def test_bfloat16_fast_logits_match_the_plain_ones(folder: Path, exact: bool, own_kernels: bool) -> None:
    """oneDNN's prepacked bfloat16 matmul is the kernel F.linear runs, fused or not: bitwise the same. verispec's
    kernels sum in another order: as close to the float64 logits as PyTorch's."""
    plain, fast = pair(folder, torch.bfloat16, exact, own_kernels)
    if own_kernels:
        truth = decode(load_model(folder, dtype=torch.float64)).double()
        error = lambda model: float((decode(model).double() - truth).abs().max())
        assert error(fast) <= 1.25 * error(plain)
    else:
        assert torch.equal(decode(fast), decode(plain))


@pytest.mark.parametrize("exact", [False, True], ids=["ordinary", "exact"])
def test_float32_fast_logits_match_the_plain_ones(folder: Path, exact: bool, own_kernels: bool) -> None:
    """In float32 the packed kernels sum in another order: equal to rounding."""
    plain, fast = pair(folder, torch.float32, exact, own_kernels)
    torch.testing.assert_close(decode(fast), decode(plain), rtol=1e-5, atol=1e-5)


def test_the_checkpoint_layout_and_values_are_unchanged(folder: Path) -> None:
    """The fused weights are built from the on-disk q, k, v and gate, up weights, which keep their names and
    values (views of the fused weight), so state dicts and the LM head readers see what plain loading gives."""
    plain, fast = pair(folder, torch.float32)
    a, b = plain.module.state_dict(), fast.module.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[name], b[name]) for name in a)
    assert torch.equal(fast.lm_head_weight, plain.lm_head_weight)
    attention = fast.module.model.layers[1].self_attn
    assert attention.k_proj.weight.untyped_storage().data_ptr() == attention.qkv.weight.untyped_storage().data_ptr()


def test_packing_puts_packed_modules_in_the_maths_places(folder: Path, own_kernels: bool) -> None:
    """llama.py's modules carry no fast path: `pack_model` puts its subclasses in their places, holding the very
    parameters under the same names, and what runs on the kernels is declared once (`packing`). Packed again on
    PyTorch's kernels, the norms are the plain ones again."""
    module = load_model(folder, dtype=torch.float32, fast=False).module
    parameters = dict(module.named_parameters(remove_duplicate=False))
    plain = {LlamaForCausalLM, Decoder, Embedding, nn.ModuleList, Block, Attention, MLP, RMSNorm, nn.Linear}
    assert {type(part) for part in module.modules()} <= plain
    packed = pack_model(module, 1, own_kernels)
    assert packing(packed) == Packing(kernels=own_kernels, attention=own_kernels)
    block = packed.model.layers[0]
    assert (type(block.self_attn), type(block.mlp)) == (PackedAttention, PackedMLP)
    norm = KernelRMSNorm if own_kernels else RMSNorm
    assert type(block.input_layernorm) is norm and type(packed.model.norm) is norm
    again = pack_model(packed, 1, own_kernels=False)
    assert packing(again) == Packing(kernels=False, attention=False) and type(again.model.norm) is RMSNorm
    for model in (packed, again):
        mine = dict(model.named_parameters(remove_duplicate=False))
        assert mine.keys() == parameters.keys() and all(mine[name] is p for name, p in parameters.items())


def test_hidden_states_layer_subsets_and_tree_masks_take_the_fast_path(folder: Path, own_kernels: bool) -> None:
    plain, fast = pair(folder, torch.float32, own_kernels=own_kernels)
    close = lambda x, y: torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    close(decode(fast, layers=[1]), decode(plain, layers=[1]))
    for model_out in zip(*(m(TOKENS, m.new_cache(), hidden=[0, -1]) for m in (fast, plain))):
        close(*model_out)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    outs = []
    for model in (fast, plain):
        cache = model.new_cache()
        model(TOKENS[:, :8], cache)
        outs.append(model(TOKENS[:, 8:11], cache, mask, torch.tensor([8, 9, 9])))
    close(*outs)


def test_only_cpu_float32_and_bfloat16_are_packed(folder: Path) -> None:
    assert not isinstance(load_model(folder, dtype=torch.float64).module, PackedCausalLM)


def test_outside_inference_mode_the_plain_linears_run(folder: Path, own_kernels: bool) -> None:
    """Head training reads a loaded target's module under autocast, and with gradients into a head through its LM
    head: there the packed kernels (no backward, no autocast) stand aside."""
    plain, fast = pair(folder, torch.float32, own_kernels=own_kernels)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(fast.module(TOKENS)[0], plain.module(TOKENS)[0])
    feature = torch.randn(2, 3, fast.hidden_size, requires_grad=True)
    fast.module.head(feature).sum().backward()
    torch.testing.assert_close(feature.grad, plain.lm_head_weight.sum(0).expand(2, 3, -1))


def test_where_onednn_cannot_prepack_bfloat16_the_fused_weight_runs_through_pytorch(tmp_path: Path) -> None:
    """A CPU without AVX-512 (AVX2 only) cannot take oneDNN's bfloat16 weight reorder. ONEDNN_MAX_CPU_ISA=AVX2 makes
    this CPU such a one, in a child process: packing still succeeds and the logits stay bitwise the plain ones."""
    script = """
import sys, torch
from verispec.models.linear import _prepacked_here
from tests.test_fast import pair, decode
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
torch.set_num_threads(1)
assert not _prepacked_here(torch.bfloat16), "oneDNN still prepacks bfloat16 under ONEDNN_MAX_CPU_ISA=AVX2"
folder = random_checkpoint(sys.argv[1], tiny_config(num_hidden_layers=2), seed=3)
for exact in (False, True):
    plain, fast = pair(folder, torch.bfloat16, exact, own_kernels=False)
    assert fast.module.head is not None
    assert torch.equal(decode(fast), decode(plain))
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "VERISPEC_KERNELS": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env=env,
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
