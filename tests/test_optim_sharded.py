"""The sharding rule of ShardedHybridDeviceOptimizer (its 2-process runs are in
test_distributed_cpu.py)."""

from __future__ import annotations

import io

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


def test_options_of_the_local_optimizer_stay_out_of_the_param_groups(tmp_path):
    # Every keyword that only configures HybridDeviceOptimizer (is_device_param among
    # them) goes to the rank's local optimizer, not into the param groups, where a
    # lambda would make the state dict unpicklable.
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = torch.nn.Linear(4, 4)
        opt = ShardedHybridDeviceOptimizer(
            model.parameters(),
            offload_fraction=0.5,
            is_device_param=lambda p: True,
            offload_last_layers=True,
            lr=1e-2,
        )
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        for group in opt.param_groups:
            assert set(group) == {"params", *opt.defaults}
            assert "is_device_param" not in group and "offload_last_layers" not in group
        assert opt.local is not None
        for group in opt.local.param_groups:
            assert "is_device_param" not in group
        torch.save(opt.state_dict(), io.BytesIO())
    finally:
        dist.destroy_process_group()
