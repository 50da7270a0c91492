"""Offloading on two GPUs: DDP, FSDP2, a pipeline and the sharded optimizer.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src \\
        torchrun --nproc_per_node=2 benchmarks/multi_gpu.py --json multi_gpu.json
    ... --small      # a one-minute version
    ... --only ddp   # one part: ddp, fsdp2, pipeline-gpipe, pipeline-1f1b, sharded-optim

Every part trains the same model twice (or more) in one process per GPU with
deterministic kernels, and checks on every rank:

* DDP and FSDP2 (``fully_shard`` per GPT block), the V2 context per block with the
  default schedule: losses and gradients bit-identical to the same parallel run without
  offloading, and the step's activation peak falls by at least half of the bytes held
  on the host at the end of the forward;
* the pipeline (2 stages, ``torch.distributed.pipelining``, GPipe and 1F1B), each stage
  a :class:`cpu_offload.PipelineStageOffload`: the same, with the most bytes held on
  the host at once;
* the sharded optimizer under DDP: parameters bit-identical to an unsharded
  :class:`~cpu_offload.optim.HybridDeviceOptimizer` of the same fraction and identical
  across ranks; each rank holds half of the host state.

Step times (median, slowest rank) are printed beside no offloading. The exit status is
1 if a check failed on any rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from cpu_offload import (  # noqa: E402
    PipelineStageOffload,
    get_cpu_offload_context,
    plan_pipeline_offload,  # noqa: E402
)
from cpu_offload.models import ModelSpec, build_layers  # noqa: E402
from cpu_offload.optim import HybridDeviceOptimizer, ShardedHybridDeviceOptimizer  # noqa: E402
from cpu_offload.v2.context import DEFAULT_MIN_TENSOR_SIZE  # noqa: E402

MIB = 1 << 20
#: "cuda", or "cpu" for a dry run of the script's logic (gloo, no memory figures).
DEVICE = "cuda"
#: Smallest tensor offloaded (elements); 0 in the dry run, whose tensors are tiny.
MIN_SIZE = DEFAULT_MIN_TENSOR_SIZE
PARTS = ("ddp", "fsdp2", "pipeline-gpipe", "pipeline-1f1b", "sharded-optim")


class Stack(nn.Module):
    """Blocks in sequence, each under the offload context when one is given."""

    def __init__(self, blocks: nn.ModuleList, offloaded: int) -> None:
        super().__init__()
        self.blocks = blocks
        self.ctx: Any = None
        self.sync: Any = None
        if offloaded:
            self.ctx, self.sync = get_cpu_offload_context(
                enabled=True,
                num_layers=offloaded,
                model_layers=len(blocks),
                min_tensor_size_to_offload=MIN_SIZE,
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

    def host_bytes(self) -> int:
        return (
            0
            if self.ctx is None
            else int(self.ctx.offload_synchronizer.get_offloaded_total_size_mb() * MIB)
        )


class Result(dict):
    """losses, grads, peak (bytes), host (bytes), times (s) of one run on this rank."""


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _peak_step(fn: Callable[..., None], *args: Any) -> tuple[int, float]:
    """Run ``fn(*args)``; its peak above the memory allocated before it, and its time."""
    if DEVICE == "cpu":
        start = time.perf_counter()
        fn(*args)
        return 0, time.perf_counter() - start
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, time.perf_counter() - start


def data_parallel(kind: str, spec: ModelSpec, offloaded: int, steps: int) -> Result:
    rank = dist.get_rank()
    model = Stack(build_layers(spec, DEVICE), offloaded)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped: nn.Module = DDP(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        wrapped = fully_shard(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    out = Result(losses=[], peak=0, host=0, times=[])
    for step in range(steps):
        x = spec.make_input(DEVICE, seed=2 * step + rank)
        opt.zero_grad(set_to_none=True)
        host: list[int] = []

        def run(x: torch.Tensor, host: list[int]) -> None:
            y = wrapped(x)
            host.append(model.host_bytes())
            loss = y.float().square().mean()
            del y
            loss.backward()
            out["losses"].append(loss.detach())

        peak, seconds = _peak_step(run, x, host)
        del x
        if step:  # the first step allocates buffers and pools: not measured
            out["peak"] = max(out["peak"], peak)
            out["host"] = max(out["host"], host[0])
            out["times"].append(seconds)
        out["grads"] = [_full(p.grad).clone() for p in wrapped.parameters()]
        opt.step()
    return out


def pipeline(schedule_name: str, spec: ModelSpec, offload: bool, steps: int, micro: int) -> Result:
    from torch.distributed import pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = build_layers(spec, DEVICE)
    per = len(layers) // world
    mine = list(layers)[rank * per : (rank + 1) * per]
    prefetch = 0 if schedule_name == "1f1b" else 1  # 2-stage 1F1B saves only without it
    plan = plan_pipeline_offload(schedule_name, world, rank, micro, prefetch=prefetch)
    module: nn.Module = (
        PipelineStageOffload(mine, plan, min_tensor_size_to_offload=MIN_SIZE)
        if offload
        else nn.Sequential(*mine)
    )
    stage = pipelining.PipelineStage(
        module, rank, world, torch.device(DEVICE, rank) if DEVICE == "cuda" else torch.device("cpu")
    )
    host_samples = [0]
    if isinstance(module, PipelineStageOffload):
        module.attach(stage)

        def sample(*_: Any) -> None:
            host_samples.append(
                int(sum(s.get_offloaded_total_size_mb() for s in module.synchronizers) * MIB)
            )

        module.register_forward_pre_hook(sample)
    cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule_name]
    schedule = cls(stage, micro, loss_fn=lambda y, t: (y.float() - t.float()).square().mean())
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    out = Result(losses=[], peak=0, host=0, times=[])
    whole = dataclasses.replace(spec, batch=spec.batch * micro)  # spec.batch per micro-batch
    for step in range(steps):
        x = whole.make_input(DEVICE, seed=step)
        target = whole.make_input(DEVICE, seed=1000 + step)
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []

        def run(x: torch.Tensor, target: torch.Tensor, losses: list[torch.Tensor]) -> None:
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=target, losses=losses)

        peak, seconds = _peak_step(run, x, target, losses)
        out["losses"] += [loss.detach() for loss in losses]
        if step:
            out["peak"] = max(out["peak"], peak)
            out["times"].append(seconds)
        out["grads"] = [p.grad.clone() for p in module.parameters()]
        opt.step()
    out["host"] = max(host_samples)
    return out


def sharded_optimizer(spec: ModelSpec, sharded: bool, steps: int) -> Result:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = DDP(nn.Sequential(*build_layers(spec, DEVICE)))
    kwargs: dict[str, Any] = dict(offload_fraction=1.0, lr=1e-3, early_grad_copy=False)
    opt: torch.optim.Optimizer = (
        ShardedHybridDeviceOptimizer(model.parameters(), **kwargs)
        if sharded
        else HybridDeviceOptimizer(model.parameters(), **kwargs)
    )
    out = Result(losses=[], peak=0, host=0, times=[])
    for step in range(steps):
        x = spec.make_input(DEVICE, seed=2 * step + rank)
        opt.zero_grad(set_to_none=True)

        def run(x: torch.Tensor) -> None:
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            out["losses"].append(loss.detach())

        peak, seconds = _peak_step(run, x)
        if step:
            out["peak"] = max(out["peak"], peak)
            out["times"].append(seconds)
    local = opt.local if isinstance(opt, ShardedHybridDeviceOptimizer) else opt
    states = [] if local is None else list(local.state.values())
    out["host"] = sum(
        t.numel() * t.element_size()
        for s in states
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.device.type == "cpu"
    )
    out["grads"] = [p.detach().clone() for p in model.parameters()]  # the parameters
    return out


def _equal(a: Result, b: Result) -> bool:
    pairs = list(zip(a["losses"], b["losses"], strict=True))
    pairs += list(zip(a["grads"], b["grads"], strict=True))
    return all(torch.equal(x, y) for x, y in pairs)


def _same_on_all_ranks(tensors: list[torch.Tensor]) -> bool:
    same = True
    for t in tensors:
        first = t.clone()
        dist.broadcast(first, src=0)
        same = same and torch.equal(first, t)
    return same


def _slowest(times: list[float]) -> float:
    t = torch.tensor([statistics.median(times) if times else 0.0], device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_part(part: str, spec: ModelSpec, steps: int) -> dict[str, Any]:
    """Both runs of one part on this rank: the checks and the numbers."""
    k = spec.layers // 2
    if part in ("ddp", "fsdp2"):
        base, off = (data_parallel(part, spec, n, steps) for n in (0, k))
        checks = {"bit_identical": _equal(base, off)}
    elif part.startswith("pipeline"):
        name = part.split("-")[1]
        base, off = (pipeline(name, spec, o, steps, micro=4) for o in (False, True))
        checks = {"bit_identical": _equal(base, off)}
    else:
        base, off = (sharded_optimizer(spec, s, steps) for s in (False, True))
        checks = {
            "bit_identical": _equal(base, off),
            "ranks_identical": _same_on_all_ranks(off["grads"]),
            "host_state_halved": off["host"] * dist.get_world_size() <= base["host"] * 1.01,
        }
    if part != "sharded-optim" and DEVICE == "cuda":
        # Offloading saves at least half of what it holds on the host; a pipeline stage
        # whose plan keeps everything (the last stage of 1F1B) holds nothing there.
        checks["peak_falls"] = base["peak"] - off["peak"] >= 0.5 * off["host"]
        anywhere = torch.tensor([float(off["host"])], device=DEVICE)
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        checks["offloaded"] = anywhere.item() > 0 and (off["host"] > 0 or "pipeline" in part)
    return {
        "checks": checks,
        "peak_mib": (base["peak"] / MIB, off["peak"] / MIB),
        "host_mib": (base["host"] / MIB, off["host"] / MIB),
        "step_ms": (1e3 * _slowest(base["times"]), 1e3 * _slowest(off["times"])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="small model, few steps")
    parser.add_argument("--only", choices=PARTS, action="append", help="run only these parts")
    parser.add_argument("--json", help="write the results of rank 0 here")
    parser.add_argument("--cpu", action="store_true", help="dry run of the logic on CPUs")
    args = parser.parse_args(argv)
    global DEVICE, MIN_SIZE
    DEVICE = "cpu" if args.cpu else "cuda"
    MIN_SIZE = 0 if args.cpu else MIN_SIZE
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank = dist.get_rank()
    if not args.cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.use_deterministic_algorithms(True)
    dims = (
        dict(hidden=512, heads=8, seq=512, batch=4, layers=4)
        if args.small
        else dict(hidden=2048, heads=16, seq=2048, batch=2, layers=8)
    )
    if args.cpu:
        dims = dict(hidden=64, heads=4, seq=16, batch=4, layers=4)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    spec = ModelSpec(kind="gpt", dtype=dtype, **dims)
    steps = 3 if args.small else 6
    results: dict[str, Any] = {}
    failed = 0
    for part in args.only or PARTS:
        result = run_part(part, spec, steps)
        ok = torch.tensor([int(all(result["checks"].values()))], device=DEVICE)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        result["passed_on_all_ranks"] = bool(ok.item())
        failed += not result["passed_on_all_ranks"]
        results[part] = result
        if rank == 0:
            (p0, p1), (h0, h1), (t0, t1) = (result[k] for k in ("peak_mib", "host_mib", "step_ms"))
            print(
                f"{part:15s} peak {p0:8.1f} -> {p1:8.1f} MiB  host {h0:7.1f} -> {h1:7.1f} MiB  "
                f"step {t0:7.1f} -> {t1:7.1f} ms  checks {result['checks']} "
                f"{'PASS' if result['passed_on_all_ranks'] else 'FAIL'}",
                flush=True,
            )
    if rank == 0 and args.json:
        name = "cpu" if args.cpu else torch.cuda.get_device_name()
        meta = {"torch": torch.__version__, "device": name, "spec": dims}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
