"""The package's own recomputation on CUDA (NOTE [A lean recomputation] in
cpu_offload._recompute): the RNG states of the devices of inputs passed in containers, and
backward passes whose saved tensors are read by the engine's CPU and CUDA threads at once."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.functional import dropout

from cpu_offload._recompute import run_recomputed

pytestmark = pytest.mark.cuda


def _plain(fn: Any, *args: Any) -> Any:
    return fn(*args)


def test_inputs_in_a_container_draw_the_forwards_masks() -> None:
    def f(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        return dropout(a.sin(), 0.5) * b

    def step(run: Any) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(256, 256, device="cuda", requires_grad=True)
        b = torch.randn(256, 256, device="cuda", requires_grad=True)
        torch.manual_seed(3)
        run(f, (a, b)).sum().backward()
        assert a.grad is not None and b.grad is not None
        return a.grad, b.grad

    torch.manual_seed(0)
    want = step(_plain)
    torch.manual_seed(0)
    got = step(run_recomputed)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cpu_and_cuda_threads_read_one_recomputation() -> None:
    # Saved tensors on the CPU and on CUDA: the engine's CPU thread and CUDA thread unpack
    # them at once; one recomputation serves both, with the forward's RNG states.
    runs: list[int] = []

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        u, v = a, b
        for _ in range(4):
            u = dropout(u.sin(), 0.1)
            v = dropout(v.sin(), 0.1)
        return u.sum().cpu() + v.sum()

    def step(run: Any, a0: torch.Tensor, b0: torch.Tensor) -> list[torch.Tensor]:
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        torch.manual_seed(1)
        run(f, a, b).backward()
        assert a.grad is not None and b.grad is not None
        return [a.grad, b.grad, torch.rand(1), torch.rand(1, device="cuda")]

    for _ in range(5):
        a0 = torch.randn(2048, 2048, device="cuda")
        b0 = torch.randn(1_000_000)
        want = step(_plain, a0, b0)
        runs.clear()
        got = step(run_recomputed, a0, b0)
        assert len(runs) == 2  # the forward and one recomputation
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
