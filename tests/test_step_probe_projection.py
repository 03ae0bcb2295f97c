"""StepProbe.project against the formula it replaced: the four rows concatenated into one tensor (the
int8 signs converted on the call), blocks of BLOCK summed in the gradient's dtype, the blocks in
float64. Recorded projections and the check's judging depend on these bits, so equality is bitwise."""

from __future__ import annotations

import itertools

import pytest
import torch

from zerosim.checks.grad_accounting import BLOCK
from zerosim.monitor.step_probe import PROJECTIONS, StepProbe

SIZES = (1, 2, 63, 64, 65, 127, 128, 1000, 4097, 8704, 65536 + 17, 262656)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def reference(g: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The projection as it was computed before: ``signs`` the int8 +-1 vectors."""
    flat = g.detach().reshape(-1)
    n = flat.numel()
    s = signs[:, :n]
    rows = [flat.unsqueeze(0) * s.to(flat.dtype), flat.abs().unsqueeze(0), (flat * flat).unsqueeze(0)]
    parts = torch.cat(rows)
    whole = n // BLOCK * BLOCK
    sums = parts[:, :whole].reshape(parts.shape[0], -1, BLOCK).sum(-1).to(torch.float64).sum(-1)
    return sums + parts[:, whole:].to(torch.float64).sum(-1)


def int8_signs(length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0x5EED)
    return torch.randint(0, 2, (PROJECTIONS, length), generator=gen, dtype=torch.int8) * 2 - 1


@pytest.fixture(scope="module")
def probe() -> StepProbe:
    model = torch.nn.Linear(512, 512 + 1)  # the largest parameter: 262,656 elements
    return StepProbe(model, None, "ddp", every=1, replay_every=None, max_grad_norm=None)


def test_signs_are_the_int8_draw_in_the_gradient_dtype(probe: StepProbe) -> None:
    length = max(p.numel() for p in probe.params)
    for dtype in DTYPES:
        cached = probe._sign_vectors(1, torch.zeros(1, dtype=dtype))
        assert cached.dtype == dtype and cached.shape == (PROJECTIONS, length)
        assert torch.equal(cached, int8_signs(length).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_projection_bitwise_equals_the_concatenated_formula(probe: StepProbe, dtype: torch.dtype) -> None:
    signs = int8_signs(max(p.numel() for p in probe.params))
    gen = torch.Generator().manual_seed(7)
    for size, scale in itertools.product(SIZES, (1e-3, 3.0)):
        # values in the dtype's range with large and small magnitudes, some exact zeros and duplicates
        g = (torch.randn(size, generator=gen, dtype=torch.float64) * scale).to(dtype)
        g[:: 7] = 0
        if size > 3:
            g[1] = g[2]
        got, want = probe.project(g), reference(g, signs)
        assert got.dtype == torch.float64 and got.shape == (PROJECTIONS + 2,)
        assert got.numpy().tobytes() == want.numpy().tobytes(), (dtype, size, scale, got, want)


def test_projection_of_shaped_and_strided_gradients(probe: StepProbe) -> None:
    signs = int8_signs(max(p.numel() for p in probe.params))
    gen = torch.Generator().manual_seed(11)
    for dtype in DTYPES:
        matrix = torch.randn(513, 512, generator=gen).to(dtype)
        for g in (matrix, matrix.t(), matrix[:, ::3], matrix[5:9]):
            assert probe.project(g).numpy().tobytes() == reference(g, signs).numpy().tobytes()
