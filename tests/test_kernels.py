"""verispec's CPU kernels (verispec/kernels): right to the dtype's rounding, and a row's bits independent of the
other rows and of where its keys sit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from verispec import kernels

DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.skipif(not kernels.available(torch.float32),
                                reason=f"verispec's kernels do not run on this machine: {kernels.reason()}")


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.double() - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("N, K", [(512, 1408), (100, 37), (64, 64), (3, 5), (130, 512)])
def test_linear_is_right_and_each_row_is_its_own(dtype: torch.dtype, N: int, K: int) -> None:
    generator = torch.Generator().manual_seed(N + K)
    w, bias = torch.randn(N, K, generator=generator).to(dtype), torch.randn(N, generator=generator)
    x = torch.randn(17, K, generator=generator).to(dtype)
    y = kernels.linear(x, kernels.pack(w), N, bias)
    reference = x.double() @ w.double().T + bias.double()
    assert y.dtype == dtype and y.shape == (17, N)
    assert relative_error(y, reference) < (1e-5 if dtype == torch.float32 else 1e-2)
    for lo, hi in [(0, 1), (3, 4), (5, 7), (2, 5), (4, 8), (1, 14), (16, 17)]:
        assert torch.equal(kernels.linear(x[lo:hi], kernels.pack(w), N, bias), y[lo:hi]), (lo, hi)


def test_linear_takes_strided_rows_and_leading_dims() -> None:
    w = torch.randn(70, 48).bfloat16()
    x = torch.randn(2, 3, 96).bfloat16()[..., ::2]  # a last dim with stride 2
    y = kernels.linear(x, kernels.pack(w), 70)
    assert y.shape == (2, 3, 70)
    assert torch.equal(y, kernels.linear(x.contiguous().view(6, 48), kernels.pack(w), 70).view(2, 3, 70))


def test_pack_lays_out_blocks_of_64_columns_zero_padded() -> None:
    w = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)
    packed = kernels.pack(w)
    assert packed.shape == (1, 5, 64, 1)
    assert torch.equal(packed[0, :, :3, 0], w.T) and not packed[0, :, 3:].any()
    packed = kernels.pack(w.bfloat16())  # pairs of inputs side by side, an odd K padded with zeros
    assert packed.shape == (1, 3, 64, 2)
    assert torch.equal(packed[0, 0, :3], w[:, :2].bfloat16()) and not packed[0, 2, :3, 1].any()


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    H, R, D = q.shape
    group = H // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = (q.double() @ k.transpose(-1, -2)) / D ** 0.5
    p = scores.masked_fill(~visible.bool()[None], float("-inf")).softmax(-1)
    return (p @ v).transpose(0, 1).reshape(R, H * D)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("H, Hkv, D", [(8, 8, 64), (6, 2, 24), (4, 1, 17)])
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


def run_python(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


CHECK = "from verispec import kernels; import torch; print(kernels.available(torch.float32), '|', kernels.reason())"


def test_the_kernels_are_built_once_into_the_cache_folder(tmp_path) -> None:
    assert run_python(CHECK, VERISPEC_CACHE=str(tmp_path)) == "True | built for this CPU"
    built = list((tmp_path / "kernels").glob("cpu-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert run_python(CHECK, VERISPEC_CACHE=str(tmp_path)).startswith("True")
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_without_the_kernels_the_runtime_keeps_torchs_and_says_why(tmp_path) -> None:
    assert run_python(CHECK, VERISPEC_KERNELS="0") == "False | disabled by VERISPEC_KERNELS"
    said = run_python(CHECK, VERISPEC_CACHE=str(tmp_path), CXX="false")
    assert said.startswith("False | the kernels did not compile")
    code = ("from verispec.models.random_init import random_checkpoint, tiny_config; import pathlib, torch; "
            "from verispec.models.native import load_model; "
            f"m = load_model(random_checkpoint(pathlib.Path({str(tmp_path)!r}) / 'm', tiny_config()), exact=True); "
            "print(m.module.own_kernels, tuple(m(torch.tensor([[1, 2, 3]]), m.new_cache()).shape))")
    assert run_python(code, VERISPEC_KERNELS="0") == "False (1, 3, 257)"
