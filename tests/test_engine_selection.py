"""engine.selection: which saved tensors are candidates, and which layouts copy whole."""

from __future__ import annotations

import pytest
import torch

from cpu_offload import mark_not_offload
from cpu_offload.engine.selection import ActivationPolicy, is_dense


def _on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


@pytest.mark.parametrize(
    ("make", "dense"),
    [
        (lambda: torch.randn(4, 5, 6), True),
        (lambda: torch.randn(4, 5, 6).permute(2, 0, 1), True),  # attention layouts
        (lambda: torch.randn(4, 1, 6).transpose(0, 1), True),  # size-1 dims are free
        (lambda: torch.randn(4, 6)[:, :3], False),  # a strided slice
        (lambda: torch.randn(4, 1).expand(4, 6), False),  # overlapping (stride 0)
        (lambda: torch.randn(8)[::2], False),
    ],
)
def test_is_dense(make, dense):
    assert is_dense(make()) is dense


def test_policy_takes_a_large_plain_activation():
    policy = ActivationPolicy(16, _on_cpu)
    assert policy(torch.randn(4, 4))
    assert not policy(torch.randn(3, 5))  # below the size threshold


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.Parameter(torch.randn(8, 8)),
        lambda: torch.nn.Parameter(torch.randn(8, 8)).t(),  # Linear saves weight.t()
        lambda: torch.randn(8, 8).to_sparse(),
    ],
)
def test_policy_refuses_weights_and_sparse_tensors(make):
    assert not ActivationPolicy(1, _on_cpu)(make())


def test_policy_refuses_marked_and_foreign_tensors():
    policy = ActivationPolicy(1, _on_cpu)
    kept = torch.randn(8, 8)
    mark_not_offload(kept)
    assert not policy(kept) and not policy(kept[1:])  # views of a marked tensor too
    weight = torch.randn(8, 8)
    weight.is_weight = True
    assert not policy(weight)
    assert not ActivationPolicy(1, lambda t: False)(torch.randn(8, 8))


def test_policy_refuses_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.randn(8, 8)
    assert not ActivationPolicy(1, lambda t: True)(fake)
