"""The kernels Gemma 3 adds (verispec/kernels): attention over a sliding window and at another scale, RMSNorm of each
head in place and with a residual, gelu(gate) * up and scaled rows. Each is right to the dtype's rounding, gives a row
the same bits whatever else shares the call, and the same bits at any thread count."""

from __future__ import annotations

import pytest
import torch

from test_kernels import DTYPES, needs_kernels, reference_attention, relative_error
from verispec import kernels
from verispec.kernels.build import pool_threads
from verispec.models.llama import RMSNorm
from verispec.models.packed import KernelRMSNorm, swapped
from verispec.threads import torch_threads

pytestmark = needs_kernels
IDS = ["float32", "bfloat16"]


def last_seen(visible: torch.Tensor, window: int) -> torch.Tensor:
    """The last `window` slots each row sees."""
    after = visible.flip(-1).cumsum(-1).flip(-1)
    return visible & (after <= window)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("window", [1, 5, 40, 1000])
def test_a_sliding_window_attends_over_each_rows_last_slots(dtype: torch.dtype, window: int) -> None:
    generator = torch.Generator().manual_seed(window)
    H, Hkv, D, R, S = 4, 1, 256, 6, 90
    q = torch.randn(1, R, H, D, generator=generator).to(dtype).transpose(1, 2)[0]
    k, v = (torch.randn(Hkv, S, D, generator=generator).to(dtype) for _ in range(2))
    visible = torch.rand(R, S, generator=generator) < 0.5
    visible[:, 0] = True
    y = kernels.attend(q, k, v, visible.to(torch.uint8).contiguous(), window, 100.0)
    expected = reference_attention(
        q.double() * (D / 100.0) ** 0.5, k, v, last_seen(visible, window)
    )  # scores / sqrt(100)
    assert relative_error(y, expected) < (1e-5 if dtype == torch.float32 else 1e-2)
    cut = kernels.attend(q, k, v, last_seen(visible, window).to(torch.uint8).contiguous(), None, 100.0)
    assert torch.equal(y, cut)  # the window is the slots it cuts away, to the bit
    assert torch.equal(kernels.attend(q, k, v, visible.to(torch.uint8).contiguous(), None, float(D)),
                       kernels.attend(q, k, v, visible.to(torch.uint8).contiguous()))  # fmt: skip
    with pytest.raises(ValueError, match="window"):
        kernels.attend(q, k, v, visible.to(torch.uint8).contiguous(), 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_head_norm_normalises_each_head_in_place_as_rms_norm_does(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(4)
    T, H, Hkv, D = 5, 3, 1, 100
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=generator) * 3).to(dtype)
    weight = torch.randn(D, generator=generator).to(dtype)
    heads = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D).transpose(0, 1)
    expected = kernels.rms_norm(heads[:H].contiguous(), weight, 1e-6)
    untouched = qkv[:, H * D :].clone()
    assert kernels.head_norm_(heads[:H], weight, 1e-6) is not None
    assert torch.equal(heads[:H], expected) and torch.equal(qkv[:, H * D :], untouched)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_adds_a_residual_as_residual_plus_the_norm(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    norm = KernelRMSNorm(72, 1e-6).to(dtype)
    norm.weight.data = torch.randn(72, generator=generator).to(dtype)
    x, residual = ((torch.randn(1, 9, 72, generator=generator) * 5).to(dtype) for _ in range(2))
    with torch.inference_mode():
        together = norm(x, residual)
        assert torch.equal(together, residual + kernels.rms_norm(x, norm.weight, norm.eps))
        plain = swapped(norm, RMSNorm)
        assert relative_error(together, plain(x, residual).double()) < (1e-6 if dtype == torch.float32 else 1e-2)
    with pytest.raises(ValueError, match="residual"):
        kernels.rms_norm(x, norm.weight, norm.eps, residual[..., :71])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gelu_tanh_mul_is_right_and_each_row_is_its_own(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(6)
    x = (torch.randn(7, 2 * 37, generator=generator) * 4).to(dtype)
    x[0, :5] = torch.tensor([30.0, -30.0, 0.0, 1e-3, -9.0])  # the tails: gelu(g) is g, 0, 0, about g / 2, ~0
    y = kernels.gelu_tanh_mul(x)
    gate, up = x.double().chunk(2, -1)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert y.shape == (7, 37) and relative_error(y, expected) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert all(torch.equal(kernels.gelu_tanh_mul(x[i : i + 1]), y[i : i + 1]) for i in range(7))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_scale_multiplies_rows_in_place_rounded_as_torch_does(dtype: torch.dtype) -> None:
    x = torch.randn(6, 2 * 45, generator=torch.Generator().manual_seed(7)).to(dtype)
    expected = x[:, :45] * torch.tensor(640**0.5, dtype=dtype)
    rows = x[:, :45]  # strided rows
    assert kernels.scale_(rows, 640**0.5) is rows and torch.equal(rows, expected)


def test_the_new_kernels_give_the_same_bits_at_any_thread_count() -> None:
    generator = torch.Generator().manual_seed(8)
    T, H, D, S = 9, 4, 256, 70
    qkv = torch.randn(T, (H + 2) * D, generator=generator)
    weight = torch.randn(D, generator=generator)
    k, v = (torch.randn(1, S, D, generator=generator) for _ in range(2))
    visible = (torch.rand(T, S, generator=generator) < 0.6).to(torch.uint8)
    gate_up, residual = torch.randn(T, 2 * 300, generator=generator), torch.randn(T, D, generator=generator)

    def compute() -> list[torch.Tensor]:
        heads = qkv.clone()[:, : (H + 1) * D].view(T, H + 1, D).transpose(0, 1)
        kernels.head_norm_(heads, weight, 1e-6)
        y = kernels.attend(heads[:H], k, v, visible, 7, 256.0)
        return [heads, y, kernels.gelu_tanh_mul(gate_up), kernels.scale_(gate_up.clone(), 25.3),
                kernels.rms_norm(qkv[:, :D], weight, 1e-6, residual)]  # fmt: skip

    results = {}
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            assert pool_threads() == threads
            results[threads] = compute()
    for threads, tensors in results.items():
        assert all(torch.equal(a, b) for a, b in zip(results[1], tensors)), f"{threads} threads"
