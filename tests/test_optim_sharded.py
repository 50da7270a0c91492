"""The sharding rule of ShardedHybridDeviceOptimizer (its runs in a process group are in
test_distributed_cpu.py, in processes of their own)."""

from __future__ import annotations

import pytest
import torch

from cpu_offload.optim import ShardedHybridDeviceOptimizer, shard_parameters


def test_shards_are_contiguous_and_balanced():
    assert shard_parameters([4, 4, 4, 4], 2) == [0, 0, 1, 1]
    assert shard_parameters([10, 1, 1, 1, 1, 10], 2) == [0, 0, 0, 1, 1, 1]
    assert shard_parameters([100, 1, 1], 4) == [1, 3, 3]
    assert shard_parameters([3, 3], 1) == [0, 0]
    owners = shard_parameters([7] * 10, 3)
    assert owners == sorted(owners) and set(owners) == {0, 1, 2}


def test_bad_sharding_arguments():
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        shard_parameters([1], 0)
    with pytest.raises(ValueError, match="numels must be >= 0"):
        shard_parameters([-1], 2)


def test_needs_an_initialized_process_group():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialized"):
        ShardedHybridDeviceOptimizer([torch.nn.Parameter(torch.ones(2))], lr=0.1)
