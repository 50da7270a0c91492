"""Two processes on the CPU with the gloo backend: pipelining, data parallel, sharding.

Each test spawns two processes that meet through a file in ``tmp_path`` (no ports, so
parallel test runs cannot collide), run the same training with and without offloading
(the CPU stand-in transport plays the device) and compare with ``torch.equal``. A failed
assertion in a process fails the test with that process's traceback.
"""

from __future__ import annotations

import copy
import datetime
import gc
import io
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from packaging.version import Version
from torch import nn

from cpu_offload import HostTransport
from cpu_offload._compat import TORCH_VERSION
from cpu_offload.pipeline import PipelineStageOffload, plan_pipeline_offload

WORLD = 2
WIDTH, SEQ, MICRO = 32, 8, 2

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)

# torch.distributed.pipelining's schedules and FSDP2 on CPU tensors (gloo) changed after
# 2.6: there the 1F1B order differs and FSDP2 needs CUDA streams (Stream.record_event).
# These runs are checked on the releases of the matrix from 2.10 on.
needs_recent_torch = pytest.mark.skipif(
    TORCH_VERSION < Version("2.10"),
    reason="pipelining schedules and FSDP2 on CPU differ before torch 2.10",
)


# A rank that fails leaves the other waiting in a collective: gloo gives up after
# COLLECTIVE_TIMEOUT, and the test after SPAWN_TIMEOUT whatever happens, so that a broken
# schedule fails the test instead of hanging the suite.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
SPAWN_TIMEOUT_S = 180.0


def spawn(worker: Callable[..., None], tmp_path: Path, *args: object) -> None:
    """Run ``worker(rank, store_file, *args)`` in ``WORLD`` processes; re-raise failures."""
    context = mp.spawn(
        _entry, args=(worker, str(tmp_path / "store"), args), nprocs=WORLD, join=False
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {WORLD} processes did not finish in {SPAWN_TIMEOUT_S:.0f} s")


def _entry(rank: int, worker: Callable[..., None], store: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # two processes share the CI runner's two cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        worker(rank, *args)
        # Tear down in step: what still holds the group (DDP's reducer sits in reference
        # cycles) is collected, and both ranks are done talking, before the group goes.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's finalization: on torch 2.10, gloo's threads can
    # abort a process there ("terminate called without an active exception") after the
    # worker has passed. A failure raised above still reaches mp.spawn's error file.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def blocks(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
        for _ in range(n)
    ]


def batches(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, SEQ, WIDTH, generator=g), torch.randn(n, SEQ, WIDTH, generator=g)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


# -- pipeline ------------------------------------------------------------------------


def _pipeline_worker(rank: int, schedule_name: str, micro: int, prefetch: int) -> None:
    from torch.distributed import pipelining

    layers = blocks(2 * WORLD)[2 * rank : 2 * rank + 2]
    plan = plan_pipeline_offload(schedule_name, WORLD, rank, micro, prefetch=prefetch)
    schedule_cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}

    def train(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        stage = pipelining.PipelineStage(module, rank, WORLD, torch.device("cpu"))
        if isinstance(module, PipelineStageOffload):
            module.attach(stage)
        schedule = schedule_cls[schedule_name](stage, micro, loss_fn=mse)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        losses: list[torch.Tensor] = []
        for step in range(2):
            x, y = batches(step, MICRO * micro)
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                step_losses: list[torch.Tensor] = []
                schedule.step(target=y, losses=step_losses)
                losses += step_losses
            grads = [p.grad.clone() for p in module.parameters()]
            opt.step()
        return losses, grads

    plain_losses, plain_grads = train(nn.Sequential(*copy.deepcopy(layers)))
    transport = HostTransport()
    stage_module = PipelineStageOffload(
        layers, plan, transport=transport, min_tensor_size_to_offload=0
    )
    losses, grads = train(stage_module)
    assert len(losses) == (2 * micro if rank == WORLD - 1 else 0)
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads, strict=True))
    # The stage ran the plan's order, and held on the device what the plan says.
    assert stage_module.observed_resident == list(plan.resident)
    assert (transport.bytes_offloaded > 0) == bool(plan.offloaded)
    assert transport.bytes_offloaded == transport.bytes_reloaded


@needs_recent_torch
@pytest.mark.parametrize(
    ("schedule", "micro", "prefetch"), [("1f1b", 4, 0), ("gpipe", 4, 1)], ids=["1f1b", "gpipe"]
)
def test_two_stage_pipeline_is_bit_identical(tmp_path, schedule, micro, prefetch):
    pytest.importorskip("torch.distributed.pipelining")
    # Both stages offload something: stage 0 waits for backwards, stage 1 only in GPipe.
    assert plan_pipeline_offload(schedule, WORLD, 0, micro, prefetch=prefetch).offloaded
    spawn(_pipeline_worker, tmp_path, schedule, micro, prefetch)


# -- sharded optimizer ----------------------------------------------------------------


def _same_on_all_ranks(tensors: list[torch.Tensor]) -> bool:
    same = True
    for t in tensors:
        first = t.detach().clone()
        dist.broadcast(first, src=0)
        same &= torch.equal(first, t)
    return same


def _sharded_worker(rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cpu_offload.optim import ShardedHybridDeviceOptimizer

    model = nn.Sequential(*blocks(2))
    reference = DDP(copy.deepcopy(model))
    model = DDP(model)
    opt = ShardedHybridDeviceOptimizer(
        model.parameters(), offload_fraction=0.5, lr=1e-2, foreach=False
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    for step in range(3):
        x, y = batches(WORLD * step + rank, 2)  # each rank its own data
        for net, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            mse(net(x), y).backward()
            if step == 2:
                o.param_groups[0]["lr"] = 5e-3  # what a scheduler does
            o.step()
    params = list(model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(params, reference.parameters(), strict=True))
    assert _same_on_all_ranks(params)
    # This rank keeps state for its own shard only; the shards cover every parameter.
    assert opt.local is not None
    assert len(opt.local.state) == sum(opt.owned_mask)
    counts = [torch.zeros(len(params)) for _ in range(WORLD)]
    dist.all_gather(counts, torch.tensor(opt.owned_mask, dtype=torch.float32))
    assert torch.equal(sum(counts), torch.ones(len(params)))
    with pytest.raises(ValueError, match="saved by rank"):
        opt.load_state_dict({**opt.state_dict(), "rank": 1 - rank})
    opt.load_state_dict(opt.state_dict())


def test_sharded_optimizer_matches_adamw_and_keeps_ranks_identical(tmp_path):
    spawn(_sharded_worker, tmp_path)


def _sharded_options_worker(rank: int) -> None:
    # Every keyword that only configures HybridDeviceOptimizer (is_device_param among
    # them) goes to the rank's local optimizer, not into the param groups, where a
    # lambda would make the state dict unpicklable.
    from cpu_offload.optim import ShardedHybridDeviceOptimizer

    model = nn.Linear(4, 4)
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


def test_options_of_the_local_optimizer_stay_out_of_the_param_groups(tmp_path):
    # In processes of their own: a process group made and destroyed in the test process
    # has hung in destroy_process_group on torch 2.6, holding the GIL.
    spawn(_sharded_options_worker, tmp_path)


# -- DDP and FSDP2 with the offload context per block -------------------------------


class RecordingTransport(HostTransport):
    """The CPU stand-in, noting the size and dtype of every tensor it offloads."""

    def __init__(self) -> None:
        super().__init__()
        self.offloaded: list[tuple[tuple[int, ...], torch.dtype]] = []

    def offload(self, src: torch.Tensor, ready: object | None, dst: torch.Tensor) -> None:
        self.offloaded.append((tuple(src.shape), src.dtype))
        super().offload(src, ready, dst)


class Stack(nn.Module):
    """Blocks in sequence, each under the offload context when one is given."""

    def __init__(self, blocks: list[nn.Module], transport: HostTransport | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.ctx = self.sync = None
        if transport is not None:
            from cpu_offload import get_cpu_offload_context

            self.ctx, self.sync = get_cpu_offload_context(
                enabled=True,
                num_layers=len(blocks) - 1,
                model_layers=len(blocks),
                min_tensor_size_to_offload=0,
                transport=transport,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.ctx is None:
                x = block(x)
            else:
                with self.ctx:
                    x = block(x)
                x = self.sync(x)
        return x


def _fully_shard() -> Callable[..., nn.Module] | None:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            return None
    return fully_shard


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _parallel_worker(rank: int, kind: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(transport: HostTransport | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        one_call = kind == "fsdp2-offload_layers"
        model = Stack(blocks(3), None if one_call else transport)
        if kind == "ddp":
            model = DDP(model)
        else:
            fully_shard = _fully_shard()
            assert fully_shard is not None
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            if one_call and transport is not None:
                from cpu_offload import offload_layers

                # The one-call API on the FSDP2-wrapped blocks: the first 2 of 3 layers,
                # as the hand-written Stack offloads.
                offload_layers(
                    model.blocks, num_offloaded=2, min_tensor_size_to_offload=0, transport=transport
                )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, grads = [], []
        for step in range(3):
            x, y = batches(WORLD * step + rank, 2)
            opt.zero_grad()
            loss = mse(model(x), y)
            loss.backward()
            losses.append(loss.detach())
            grads = [_full(p.grad).clone() for p in model.parameters()]
            opt.step()
        return losses, grads

    plain = train(None)
    transport = RecordingTransport()
    offloaded = train(transport)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], offloaded[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain[1], offloaded[1], strict=True))
    # The host held exactly what the same blocks offload without any wrapper: no
    # parameter, shard, unsharded parameter or gradient of DDP or FSDP2.
    alone = RecordingTransport()
    model = Stack(blocks(3), alone)
    for step in range(3):
        x, y = batches(WORLD * step + rank, 2)
        mse(model(x), y).backward()
    assert transport.offloaded == alone.offloaded and alone.offloaded
    assert transport.bytes_offloaded == transport.bytes_reloaded


def test_ddp_with_offloaded_blocks_is_bit_identical(tmp_path):
    spawn(_parallel_worker, tmp_path, "ddp")


@needs_recent_torch
def test_fsdp2_per_block_with_offloaded_blocks_is_bit_identical(tmp_path):
    if _fully_shard() is None:
        pytest.skip("this torch has no fully_shard (FSDP2)")
    spawn(_parallel_worker, tmp_path, "fsdp2")


@needs_recent_torch
def test_offload_layers_on_an_fsdp2_wrapped_model_is_bit_identical(tmp_path):
    if _fully_shard() is None:
        pytest.skip("this torch has no fully_shard (FSDP2)")
    spawn(_parallel_worker, tmp_path, "fsdp2-offload_layers")
