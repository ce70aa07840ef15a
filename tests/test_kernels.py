"""verispec's CPU kernels (verispec/kernels): right to the dtype's rounding, and a row's bits independent of the
other rows and of where its keys sit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from verispec import kernels
from verispec.checkpoints.random_init import random_checkpoint, tiny_config
from verispec.errors import InvalidArgumentError
from verispec.kernels.build import ISAS, chosen_isa, cpu_flags
from verispec.models.greedy import argmax as greedy_argmax
from verispec.models.layout import apply_rotary
from verispec.models.llama import RMSNorm
from verispec.models.native import load_model
from verispec.models.packed import Packing, packing
from verispec.threads import torch_threads

DTYPES = [torch.float32, torch.bfloat16]
HERE = kernels.available(torch.float32)
needs_kernels = pytest.mark.skipif(not HERE, reason=f"verispec's kernels do not run here: {kernels.reason()}")


def test_an_x86_cpu_with_avx2_runs_the_kernels() -> None:
    """So that on such a machine (every x86-64 CPU of the last decade, this project's and CI's) no test of the
    kernels can skip: a missing compiler or an unwritable cache folder shows here."""
    if not {"avx2", "fma", "f16c"} <= cpu_flags() or os.environ.get("VERISPEC_KERNELS") == "0":
        pytest.skip("this CPU lacks AVX2 with FMA and F16C, or the kernels are turned off")
    assert HERE, kernels.reason()
    best = next(isa for isa, (_, needs) in ISAS.items() if needs <= cpu_flags())  # ISAS lists the best first
    assert kernels.isa() == os.environ.get("VERISPEC_ISA", best)


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.double() - reference).abs().max() / reference.abs().max())


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("N, K", [(512, 1408), (100, 37), (64, 64), (3, 5), (130, 512)])
def test_linear_is_right_and_each_row_is_its_own(dtype: torch.dtype, N: int, K: int) -> None:
    generator = torch.Generator().manual_seed(N + K)
    w, bias = torch.randn(N, K, generator=generator).to(dtype), torch.randn(N, generator=generator)
    x = torch.randn(17, K, generator=generator).to(dtype)
    y = kernels.Matmul(w, bias)(x)
    reference = x.double() @ w.double().T + bias.double()
    assert y.dtype == dtype and y.shape == (17, N)
    assert relative_error(y, reference) < (1e-5 if dtype == torch.float32 else 1e-2)
    for lo, hi in [(0, 1), (3, 4), (5, 7), (2, 5), (4, 8), (1, 14), (16, 17)]:
        assert torch.equal(kernels.Matmul(w, bias)(x[lo:hi]), y[lo:hi]), (lo, hi)


@needs_kernels
def test_linear_takes_strided_rows_and_leading_dims() -> None:
    w = torch.randn(70, 48).bfloat16()
    x = torch.randn(2, 3, 96).bfloat16()[..., ::2]  # a last dim with stride 2
    y = kernels.Matmul(w)(x)
    assert y.shape == (2, 3, 70)
    assert torch.equal(y, kernels.Matmul(w)(x.contiguous().view(6, 48)).view(2, 3, 70))


@needs_kernels
def test_pack_lays_out_blocks_of_the_builds_width_zero_padded() -> None:
    cols = 64 if kernels.isa() == "avx512" else 16
    w = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)
    packed = kernels.pack(w)
    assert packed.shape == (1, 5, cols, 1)
    assert torch.equal(packed[0, :, :3, 0], w.T) and not packed[0, :, 3:].any()
    packed = kernels.pack(w.bfloat16())  # pairs of inputs side by side, an odd K padded with zeros
    assert packed.shape == (1, 3, cols, 2)
    assert torch.equal(packed[0, 0, :3], w[:, :2].bfloat16()) and not packed[0, 2, :3, 1].any()


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    H, R, D = q.shape
    group = H // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = (q.double() @ k.transpose(-1, -2)) / D**0.5
    p = scores.masked_fill(~visible.bool()[None], float("-inf")).softmax(-1)
    return (p @ v).transpose(0, 1).reshape(R, H * D)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("H, Hkv, D", [(8, 8, 64), (6, 2, 24), (4, 1, 17), (9, 3, 64), (14, 2, 64), (8, 2, 128)])
def test_attention_is_right_over_each_rows_visible_slots(dtype: torch.dtype, H: int, Hkv: int, D: int) -> None:
    generator = torch.Generator().manual_seed(H * D)
    R, S = 6, 90
    q = torch.randn(1, R, H, D, generator=generator).to(dtype).transpose(1, 2)[0]  # (H, R, D), strided as the model's
    k, v = (torch.randn(Hkv, S, D, generator=generator).to(dtype) for _ in range(2))
    visible = torch.rand(R, S, generator=generator) < 0.4
    visible[:, 0] = True
    y = kernels.attend(q, k, v, visible.to(torch.uint8).contiguous())
    assert y.dtype == dtype and y.shape == (R, H * D)
    assert relative_error(y, reference_attention(q, k, v, visible)) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_rows_attention_is_the_same_wherever_its_keys_sit_and_whatever_else_runs(dtype: torch.dtype) -> None:
    """A token decoded alone sees slots 0..n-1; the same token as a tree node sees them scattered among slots it
    does not see (here NaN, so a masked-but-read slot would show). Same keys in the same order: the same bits."""
    generator = torch.Generator().manual_seed(1)
    H, D, n = 4, 32, 70
    keys, values = (torch.randn(H, n, D, generator=generator).to(dtype) for _ in range(2))
    q = torch.randn(H, 3, D, generator=generator).to(dtype)
    alone = kernels.attend(q[:, 1:2], keys, values, torch.ones(1, n, dtype=torch.uint8))

    S = 2 * n + 5
    slots = torch.randperm(S, generator=generator)[:n].sort().values  # in order, scattered
    k, v = torch.full((H, S, D), float("nan"), dtype=dtype), torch.full((H, S, D), float("nan"), dtype=dtype)
    k[:, slots], v[:, slots] = keys, values
    visible = torch.zeros(3, S, dtype=torch.uint8)
    visible[1, slots] = 1
    visible[0, slots[:10]] = visible[2, slots[-5:]] = 1  # other rows see other slots
    assert torch.equal(kernels.attend(q, k, v, visible)[1], alone[0])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("H, Hkv, D", [(9, 3, 64), (14, 2, 64), (8, 2, 128), (6, 2, 24)])
def test_a_heads_attention_is_the_same_whatever_heads_share_its_keys(
    dtype: torch.dtype, H: int, Hkv: int, D: int
) -> None:
    """The kernel takes the heads of a key head together (a key read once for all of them); each head's bits are
    still those of that head attended alone."""
    generator = torch.Generator().manual_seed(H + D)
    R, S = 3, 150
    q = torch.randn(H, R, D, generator=generator).to(dtype)
    k, v = (torch.randn(Hkv, S, D, generator=generator).to(dtype) for _ in range(2))
    visible = (torch.rand(R, S, generator=generator) < 0.7).to(torch.uint8)
    visible[:, 0] = 1
    together = kernels.attend(q, k, v, visible).view(R, H, D)
    group = H // Hkv
    for h in (0, group - 1, H - 1):
        alone = kernels.attend(
            q[h : h + 1].contiguous(), k[h // group : h // group + 1], v[h // group : h // group + 1], visible
        )
        assert torch.equal(together[:, h], alone)


def run_python(code: str, **env: str) -> str:
    """`code`'s output in a fresh interpreter with `env` on top of this one's, the kernels on unless `env` says."""
    inherited = {name: value for name, value in os.environ.items() if name != "VERISPEC_KERNELS"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**inherited, **env}
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


CHECK = "from verispec import kernels; import torch; print(kernels.available(torch.float32), '|', kernels.reason())"


@needs_kernels
def test_the_kernels_are_built_once_into_the_cache_folder(tmp_path) -> None:
    assert run_python(CHECK, VERISPEC_CACHE=str(tmp_path)) == f"True | the {kernels.isa()} build"
    built = list((tmp_path / "kernels").glob(f"{kernels.isa()}-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert run_python(CHECK, VERISPEC_CACHE=str(tmp_path)).startswith("True")
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_without_the_kernels_the_runtime_keeps_torchs_and_says_why(tmp_path) -> None:
    assert run_python(CHECK, VERISPEC_KERNELS="0") == "False | disabled by VERISPEC_KERNELS"
    said = run_python(CHECK, VERISPEC_CACHE=str(tmp_path), CXX="false")
    # Where no build runs here at all (another architecture lists none of the flags), that is the reason given.
    assert said.startswith(f"False | the {chosen_isa()[0]} build did not compile" if chosen_isa()[0] else "False | ")
    code = (
        "from verispec.checkpoints.random_init import random_checkpoint, tiny_config; import pathlib, torch; "
        "from verispec.models.native import load_model; from verispec.models.packed import packing; "
        f"m = load_model(random_checkpoint(pathlib.Path({str(tmp_path)!r}) / 'm', tiny_config()), exact=True); "
        "print(packing(m.module).kernels, tuple(m(torch.tensor([[1, 2, 3]]), m.new_cache()).shape))"
    )
    assert run_python(code, VERISPEC_KERNELS="0") == "False (1, 3, 257)"


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("D", [64, 100, 6])
def test_rms_norm_and_rotary_round_as_the_pytorch_model_does(dtype: torch.dtype, D: int) -> None:
    generator = torch.Generator().manual_seed(D)
    norm = RMSNorm(D, 1e-6).to(dtype)
    norm.weight.data = torch.randn(D, generator=generator).to(dtype)
    x = (torch.randn(5, D, generator=generator) * 3).to(dtype)
    with torch.inference_mode():  # float32 keeps the sum of squares' order, which is PyTorch's own business
        if dtype == torch.bfloat16:
            assert torch.equal(kernels.rms_norm(x, norm.weight, norm.eps), norm(x))
        else:
            torch.testing.assert_close(kernels.rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-6, atol=1e-6)
    q = torch.randn(1, 5, 3, D, generator=generator).to(dtype).transpose(1, 2)[0]  # (H, R, D), strided
    cos, sin = (torch.randn(5, D, generator=generator).to(dtype) for _ in range(2))
    expected = apply_rotary(q, cos, sin)
    assert torch.equal(kernels.rotary_(q.clone(), cos, sin), expected)
    assert torch.equal(kernels.rotary_(q, cos, sin), expected) and torch.equal(q, expected)  # in place


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_residual_is_added_as_residual_plus_the_product(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    w, x = torch.randn(70, 48, generator=generator).to(dtype), torch.randn(1, 9, 48, generator=generator).to(dtype)
    residual = torch.randn(1, 9, 70, generator=generator).to(dtype)
    matmul = kernels.Matmul(w, torch.randn(70, generator=generator))
    assert torch.equal(matmul(x, residual), residual + matmul(x))
    with pytest.raises(ValueError, match="residual"):
        matmul(x, residual[..., :69])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_silu_mul_is_right_and_each_row_is_its_own(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 2 * 37, generator=generator) * 4).to(dtype)
    y = kernels.silu_mul(x)
    gate, up = x.double().chunk(2, -1)
    assert y.shape == (7, 37) and relative_error(y, torch.nn.functional.silu(gate) * up) < (
        1e-6 if dtype == torch.float32 else 1e-2
    )
    assert all(torch.equal(kernels.silu_mul(x[i : i + 1]), y[i : i + 1]) for i in range(7))


@needs_kernels
def test_gather_and_store_kv_copy_rows_and_refuse_out_of_range() -> None:
    import ctypes

    table = torch.randn(10, 6).bfloat16()
    assert torch.equal(kernels.gather(table, torch.tensor([3, 0, 9])), table[[3, 0, 9]])
    with pytest.raises(IndexError, match="outside the 10 rows"):
        kernels.gather(table, torch.tensor([3, 10]))
    wide = kernels.gather(table, torch.tensor([3, 0, 9]), torch.float32)  # widened exactly (a twin's embedding)
    assert wide.dtype == torch.float32 and torch.equal(wide, table[[3, 0, 9]].float())
    with pytest.raises(IndexError, match="outside the 10 rows"):
        kernels.gather(table, torch.tensor([-1]), torch.float32)
    with pytest.raises(ValueError, match="widens bfloat16 ones to float32"):
        kernels.gather(table.float(), torch.tensor([1]), torch.bfloat16)
    keys, values = torch.zeros(2, 8, 3), torch.zeros(2, 8, 3)
    new = torch.randn(2, 12)  # rows of [k heads | v heads]
    kernels.store_kv(new[:, :6], new[:, 6:], keys, values, ctypes.c_int64(5))
    assert torch.equal(keys[:, 5:7], new[:, :6].view(2, 2, 3).transpose(0, 1))
    assert torch.equal(values[:, 5:7], new[:, 6:].view(2, 2, 3).transpose(0, 1)) and not keys[:, :5].any()
    with pytest.raises(IndexError, match="slots 7 .. 8 outside a cache of 8"):
        kernels.store_kv(new[:, :6], new[:, 6:], keys, values, ctypes.c_int64(7))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_argmax_is_torchs_ties_infinities_and_nan_included(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    for V in (1, 15, 16, 17, 8191, 8192):
        x = torch.randn(6, V, generator=generator).to(dtype)
        assert torch.equal(kernels.argmax(x), x.argmax(-1)), V
    x = torch.zeros(5, 40, dtype=dtype)
    x[0, [9, 33]] = 1  # a tie: the first
    x[1] = -float("inf")
    x[2, [7, 30]], x[2, 3] = float("nan"), float("inf")  # the first NaN, over inf
    x[3, 31], x[4] = -0.0, -1.0
    x[4, [2, 39]] = float("inf")
    assert kernels.argmax(x).tolist() == x.argmax(-1).tolist() == [9, 0, 7, 0, 2]
    wide = torch.randn(3, 50, generator=generator).to(dtype)
    assert torch.equal(kernels.argmax(wide[:, :40]), wide[:, :40].argmax(-1))  # rows of a wider tensor


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("own", [True, False], ids=["kernels", "pytorch"])
def test_the_greedy_argmax_is_torchs_for_any_shape(monkeypatch, dtype: torch.dtype, own: bool) -> None:
    """models/greedy.argmax, which sampling, verification and a model's own greedy chain all take: torch.argmax's
    answer for a row, rows, rows in a batch and strided views, on verispec's kernel and where it does not run."""
    if own and not HERE:
        pytest.skip(f"verispec's kernels do not run here: {kernels.reason()}")
    if not own:
        monkeypatch.setattr(kernels, "available", lambda *args: False)
    x = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(6)).to(dtype)
    x[0, 1, [4, 9]] = 10  # a tie: the first
    x[1, 2, 7] = float("nan")  # a NaN counts as the largest
    for logits in (x[0, 0], x[0], x, x[..., :40], x[:, :, ::2], x.transpose(0, 1)):
        assert torch.equal(greedy_argmax(logits), logits.argmax(-1)), tuple(logits.shape)


@needs_kernels
def test_next_token_steps_a_greedy_chain() -> None:
    import ctypes

    logits = torch.tensor([0.0, 3.0, 5.0, 5.0, 1.0]).bfloat16()
    out, token, position = torch.zeros(3, dtype=torch.int64), torch.tensor([7]), torch.tensor([4])
    visible, length = torch.tensor([1, 1, 1, 1, 0, 0, 0], dtype=torch.uint8), ctypes.c_int64(3)
    # the forward stored slots 3 and 4
    kernels.program([kernels.next_token(logits[:4], out, 1, token, position, visible, length, 2)])()
    assert out.tolist() == [0, 2, 0] and token.item() == 2 and position.item() == 5 and length.value == 5
    assert visible.tolist() == [1, 1, 1, 1, 0, 1, 0]  # (slot 4 is the caller's to set: the row before saw it)
    length.value = 6
    kernels.program([kernels.next_token(logits, out, 2, token, position, visible, length, 1)])()  # a chain's last
    assert length.value == 7 and visible.tolist() == [1, 1, 1, 1, 0, 1, 0]  # no slot left to see
    with pytest.raises(ValueError, match="i = 3"):
        kernels.next_token(logits, out, 3, token, position, visible, length, 1)
    ids = torch.tensor([40, 41, 42, 43, 44])  # logits over these tokens: the argmax (2) names token 42
    kernels.program([kernels.next_token(logits, out, 0, token, position, visible, length, 1, ids)])()
    assert out[0].item() == token.item() == 42
    with pytest.raises(ValueError, match="ids int64 \\(5,\\)"):
        kernels.next_token(logits, out, 0, token, position, visible, length, 1, ids[:4])


@needs_kernels
def test_causal_rows_writes_a_causal_forwards_positions_and_visible_slots() -> None:
    import ctypes

    positions, visible, length = (
        torch.zeros(3, dtype=torch.int64),
        torch.full((3, 7), 9, dtype=torch.uint8),
        ctypes.c_int64(2),
    )
    kernels.program([kernels.causal_rows(positions, visible, length, 1)])()  # after 2 slots and 1 more
    assert positions.tolist() == [3, 4, 5]
    assert torch.equal(visible, (torch.arange(7) <= positions[:, None]).to(torch.uint8))
    length.value = 5  # rows at 6, 7, 8 of 7 slots: refused, as a replay's kernel call
    with pytest.raises(IndexError, match="refused its inputs"):
        kernels.program([kernels.causal_rows(positions, visible, length, 1)])()
    with pytest.raises(ValueError, match="causal_rows"):
        kernels.causal_rows(positions, visible[:2], length)


@needs_kernels
def test_a_program_runs_programs_inside_it() -> None:
    table, index = torch.arange(12.0).view(6, 2), torch.tensor([4, 1])
    y = torch.zeros(2, 2)
    inner = kernels.program([("gather", [table, 6, 2, index, 2, 2, y, 2, 4])])
    kernels.program([kernels.run(inner)] * 2)()
    assert torch.equal(y, table[[4, 1]])
    index[0] = 6  # out of range: the inner program fails, so the outer one does
    with pytest.raises(IndexError, match="call \\(0 of 2\\)"):
        kernels.program([kernels.run(inner)] * 2)()


@needs_kernels
def test_the_wrappers_refuse_what_would_read_out_of_bounds() -> None:
    w = torch.randn(70, 48).bfloat16()
    with pytest.raises(ValueError, match="takes CPU torch.bfloat16 rows of 48"):
        kernels.Matmul(w)(torch.randn(2, 48))  # float32 rows, bfloat16 weight
    with pytest.raises(ValueError, match="rows of 48"):
        kernels.Matmul(w)(torch.randn(2, 50).bfloat16())
    with pytest.raises(ValueError, match="bias"):
        kernels.Matmul(w, torch.zeros(69))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.Matmul(w.half())
    q, k = torch.randn(2, 1, 16), torch.randn(2, 9, 16)
    with pytest.raises(ValueError, match="visible"):
        kernels.attend(q, k, k, torch.ones(1, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="at most 256"):
        kernels.attend(
            torch.randn(1, 1, 300), torch.randn(1, 3, 300), torch.randn(1, 3, 300), torch.ones(1, 3, dtype=torch.uint8)
        )
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.rms_norm(torch.randn(2, 8).half(), torch.ones(8).half(), 1e-6)


@needs_kernels
def test_a_head_wider_than_the_attention_kernel_attends_through_pytorch(tmp_path, single_thread) -> None:
    """The matmuls still run on the kernels; attention (head_dim 320 > 256) takes SDPA, or `FixedWidthKeys` in exact
    mode."""
    folder = random_checkpoint(tmp_path, tiny_config(head_dim=320, num_attention_heads=2, num_key_value_heads=1))
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    for exact in (False, True):
        model = load_model(folder, exact=exact)
        assert packing(model.module) == Packing(kernels=True, attention=False)
        cache = model.new_cache()
        whole = model(tokens, cache)[0]
        cache.truncate(2)
        torch.testing.assert_close(model(tokens[:, 2:], cache)[0], whole[2:], rtol=1e-5, atol=1e-5)


def test_an_attention_mask_must_be_boolean(tmp_path) -> None:
    model = load_model(random_checkpoint(tmp_path, tiny_config()))
    with pytest.raises(InvalidArgumentError, match="True where a token sees"):
        model(torch.tensor([[1, 2]]), model.new_cache(), mask=torch.zeros(2, 2))


@needs_kernels
def test_a_model_takes_the_kernels_at_any_thread_count(tmp_path) -> None:
    """The kernels run on their own pool at any count: a model never falls back to PyTorch's for a count."""
    folder = random_checkpoint(tmp_path, tiny_config())
    for threads in (1, 2, 3):
        with torch_threads(threads):
            assert packing(load_model(folder).module).kernels
