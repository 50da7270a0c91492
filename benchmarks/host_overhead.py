"""Host time of V2 offloading: per saved tensor, per layer, and per step of a model.

Offloading is worth its price only if the Python that drives it costs little next to the
step: this benchmark measures that price, on the GPU or on the CPU stand-in.

* **engine**: one synchronizer with the default schedule driven through whole iterations
  (forward steps, saves, copies, releases, reloads, loads, end of backward) with no model
  around it and tiny tensors, so that only host time is measured. ``per tensor`` is the
  cost of one offloaded tensor's round trip, ``per layer`` the cost of one layer's steps
  with nothing saved.
* **pack hook**: V2's pack hook, as the context installs it, for a tensor it keeps
  (below the size threshold, NOTE [Small tensors stay at the door]), beside a hook that
  only detaches: the least a hook can cost per saved tensor.
* **model**: the GPT stack of ``cpu-offload compare`` (on CUDA its default model: 8 layers,
  hidden 2048, 16 heads, seq 2048, batch 2, bf16; on the CPU a small one), run without
  offloading, with V2 and nothing eligible (hooks only), and with V2 offloading k layers
  (with ``--duplex`` also the duplex schedule); beside them the floor of any saved-tensor
  hooks: hooks that only detach what they are given (as V2's do with a tensor they keep,
  NOTE [Kept tensors are detached]), entered around each layer; and on CUDA the floor of
  bare copies of as many bytes at the same points (``_host_floors.BareCopies``). Every step starts
  a new running peak, as if each variant ran alone. For each variant:
  the host time to enqueue one step (no synchronization; on the CPU this is the whole
  step, timed as the thread's CPU time so that other work on the machine disturbs it
  less), the step time, the peak memory on CUDA above what the step starts from, and the
  tensors saved per step.
  Variants run in turns, each turn in a rotated order (so that each variant runs first,
  second, ... equally often over as many turns as there are variants). Two readings of
  each: the best turn (``host x``, ``step x``: best against best), and the median over
  turns of the ratio to no offloading *in the same turn* (``paired``, with its
  interquartile range), which a host whose pace drifts between turns disturbs far less
  than a ratio of bests. The host probe runs before and after each turn; the paired
  ratios are also given over the turns whose probe read within 10% of the run's lower
  quartile (``_report.CalmTurns``), which leaves out the run's slowest turns.
* **profile**: where the host time of the V2 step goes, as a cProfile table of the
  functions of ``cpu_offload`` (and on CUDA a torch.profiler table).

    python benchmarks/host_overhead.py                  # CUDA if available, else the CPU
    python benchmarks/host_overhead.py --device cpu --json host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from _host_floors import BareCopies, SavedCounter, kept, same
from _report import CalmTurns, paired_ratios, probed, quartiles, rotated

from cpu_offload import CudaTransport, HostTransport, Transport, v2
from cpu_offload._compile import outside_compile
from cpu_offload.models import ModelSpec, build_layers

CUDA_SPEC = ModelSpec(kind="gpt", hidden=2048, heads=16, seq=2048, batch=2, layers=8,
                      dtype=torch.bfloat16)  # fmt: skip
CPU_SPEC = ModelSpec(kind="gpt", hidden=64, heads=4, seq=32, batch=2, layers=8)
NEVER = 1 << 62  # a size threshold no tensor reaches: hooks run, nothing is eligible


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _transport(device: str) -> Transport:
    # Named, so that --device cpu measures the stand-in even where CUDA is available.
    return CudaTransport() if device == "cuda" else HostTransport()


def _clock(device: str) -> Callable[[], float]:
    # On the CPU everything runs on this thread: its CPU time is the host time, and a
    # machine shared with other work disturbs it far less than the wall clock.
    return time.perf_counter if device == "cuda" else time.thread_time


# -- engine --------------------------------------------------------------------------


class _RunInBackward(torch.autograd.Function):
    """Calls a function from inside a backward pass, where the engine's hooks run."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, fn: Callable[[], None]) -> torch.Tensor:
        ctx.fn = fn  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fn()  # type: ignore[attr-defined]
        return grad, None


def engine_iteration(sync: v2.OffloadSynchronizer, tensors: list[torch.Tensor], k: int) -> None:
    """One iteration: ``len(tensors)`` saves in each of the first ``k`` layers.

    The backward steps run inside a real (one-node) backward pass, as they do in training,
    so that the end-of-backward callback is queued and run by autograd.
    """
    packed: list[list[object]] = []
    for layer in range(sync.num_layers):
        sync.fwd_step()
        packed.append([sync.push_tensor(t) for t in tensors] if layer < k else [])

    def backward() -> None:
        for layer in reversed(range(sync.num_layers)):
            sync.bwd_step(layer)
            for p in packed[layer]:
                sync.pop_tensor(p)

    _RunInBackward.apply(torch.zeros(1, requires_grad=True), backward).sum().backward()


def _time(fn: Callable[[], None], device: str, repeat: int) -> float:
    """Best of five medians of ``repeat`` calls, seconds."""
    medians = []
    clock = _clock(device)
    for _ in range(5):
        times = []
        for _ in range(repeat):
            _sync(device)
            t0 = clock()
            fn()
            times.append(clock() - t0)
        medians.append(statistics.median(times))
    return min(medians)


def engine(device: str, layers: int = 8, k: int = 4, per_layer: int = 16) -> dict:
    """Host time per offloaded tensor and per layer of the engine alone (microseconds)."""
    sync = v2.DefaultOffloadSynchronizer(
        layers, k, transport=_transport(device), policy=lambda t: True
    )
    tensors = [torch.randn(256, device=device) + i for i in range(per_layer)]
    empty: list[torch.Tensor] = []
    for _ in range(3):
        engine_iteration(sync, tensors, k)
    full = _time(lambda: engine_iteration(sync, tensors, k), device, 20)
    bare = _time(lambda: engine_iteration(sync, empty, k), device, 20)
    return {
        "per_tensor_us": (full - bare) / (k * per_layer) * 1e6,
        "per_layer_us": bare / layers * 1e6,
        "layers": layers,
        "offloaded_layers": k,
        "tensors_per_layer": per_layer,
    }


def pack_hook_cost(device: str, repeat: int = 20000) -> dict:
    """Host time of one pack hook call for a kept tensor: V2's and the floor's (microseconds)."""
    ctx, _ = v2.get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=3, transport=_transport(device)
    )
    sync = ctx.offload_synchronizer
    installed = outside_compile(sync.pack_hook)  # as the context installs it (ActiveHooks)
    sync.fwd_step()  # layer 0, offloaded: its tensors go through the hook
    weight = torch.ones(16, device=device, requires_grad=True)
    small = weight * 2  # below the threshold: kept

    def best(fn: Callable[[torch.Tensor], object]) -> float:
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn(small)
            runs.append(time.perf_counter() - t0)
        return min(runs) / repeat * 1e6

    out = {"v2_us": best(installed), "floor_us": best(kept)}
    sync.release_all()
    return out


# -- model ---------------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    kwargs: dict | None  # get_cpu_offload_context arguments; None: no offloading
    host_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    peak_mib: float = 0.0
    saved: int = 0
    ctx: object = None
    sync: object = None


def run_model(
    spec: ModelSpec,
    device: str,
    k: int,
    duplex: bool,
    turns: int,
    steps: int,
    copies_unwaited: bool = False,
) -> dict:
    layers = build_layers(spec, device)
    x0 = spec.make_input(device)
    on_cpu = device == "cpu"
    small = {"min_tensor_size_to_offload": 0} if on_cpu else {}
    variants = [
        Variant("none", None),
        Variant(
            "hooks floor",
            None,
            ctx=torch.autograd.graph.saved_tensors_hooks(kept, same),
            sync=same,
        ),
        Variant("v2 nothing eligible", {"num_layers": k, "min_tensor_size_to_offload": NEVER}),
        Variant(f"v2 k={k}", {"num_layers": k, **small}),
    ]
    if duplex and device == "cuda":  # the stand-in's copies are synchronous: no second lane
        variants.append(Variant(f"v2 k={k} duplex", {"num_layers": k, "duplex": True, **small}))
    for v in variants:
        if v.kwargs is not None:
            if not v.kwargs.get("duplex"):  # duplex makes its own transport
                v.kwargs["transport"] = _transport(device)
            v.ctx, v.sync = v2.get_cpu_offload_context(
                enabled=True, model_layers=spec.layers, **v.kwargs
            )

    def one_step(v: Variant) -> None:
        x = x0.detach().requires_grad_()
        for layer in layers:
            if v.ctx is None:
                x = layer(x)
            else:
                with v.ctx:  # type: ignore[attr-defined]
                    x = layer(x)
                x = v.sync(x)  # type: ignore[operator]
        x.float().sum().backward()
        for p in layers.parameters():
            p.grad = None

    def warm_up(v: Variant) -> None:
        for _ in range(3):
            _fresh_peak(device)
            one_step(v)

    for v in variants:
        warm_up(v)
    v2_k = next(v for v in variants if v.name == f"v2 k={k}")
    moved = _moved_bytes(v2_k)
    if device == "cuda":  # as many bytes moved at the same points, and nothing else
        bare = [("bare copies", True)] + (
            [("bare copies, no waits", False)] if copies_unwaited else []
        )
        copies = [Variant(name, None) for name, _ in bare]
        for v, (_, wait) in zip(copies, bare, strict=True):
            v.ctx = v.sync = BareCopies(spec.layers, moved, wait=wait)
            warm_up(v)
        variants[2:2] = copies
    counter = SavedCounter()  # the tensors the model saves per step (offloading or not)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        one_step(variants[0])
    for v in variants:
        v.saved = counter.count
    clock = _clock(device)

    def turn_of(turn: int) -> None:
        for v in rotated(variants, turn):
            host, gpu = [], []
            for _ in range(steps):
                _fresh_peak(device)
                _sync(device)
                t0 = clock()
                one_step(v)
                t1 = clock()
                _sync(device)
                t2 = clock()
                host.append((t1 - t0) * 1e3)
                gpu.append((t2 - t0) * 1e3)
            v.host_ms.append(statistics.median(host))
            v.step_ms.append(statistics.median(gpu))

    probes = [probed(turn_of, turn) for turn in range(turns)]
    calm = CalmTurns(probes)
    if device == "cuda":
        for v in variants:  # above what the step starts from (bare copies' buffers too)
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            one_step(v)
            torch.cuda.synchronize()
            v.peak_mib = (torch.cuda.max_memory_allocated() - start) / 2**20
    none = variants[0]
    rows = []
    for v in variants:
        host, step = min(v.host_ms), min(v.step_ms)
        extra = host - min(none.host_ms)
        paired = paired_ratios(v.step_ms, none.step_ms)
        quiet = calm.keep(paired)
        rows.append(
            {
                "variant": v.name,
                "host_ms": host,
                "step_ms": step,
                "host_ratio": host / min(none.host_ms),
                "step_ratio": step / min(none.step_ms),
                "step_ratio_paired": statistics.median(paired),
                "step_ratio_paired_iqr": quartiles(paired),
                # The same over the turns whose host probe read calm (_report.CalmTurns).
                "step_ratio_paired_calm": statistics.median(quiet),
                "step_ratio_paired_calm_iqr": quartiles(quiet),
                "host_ratio_paired": statistics.median(paired_ratios(v.host_ms, none.host_ms)),
                "extra_host_per_layer_us": extra / spec.layers * 1e3,
                "extra_host_per_saved_tensor_us": extra / max(v.saved, 1) * 1e3,
                "saved_tensors": v.saved,
                "peak_mib": v.peak_mib,
                "step_ms_per_turn": v.step_ms,
            }
        )
    bare_copies = next((v for v in variants if v.name == "bare copies"), None)
    return {
        "spec": repr(spec),
        "rows": rows,
        "turn_probes_ms": probes,
        "calm_turns": calm.describe(),
        # V2 over the copies alone, per turn: what V2 adds to moving its bytes.
        "v2_over_bare_copies_paired": None
        if bare_copies is None
        else statistics.median(paired_ratios(v2_k.step_ms, bare_copies.step_ms)),
        # V2's choice of what to keep can change while it runs: the floor copies what it
        # moved after the warm-up, and both readings are shown.
        "v2_moved_mib": {
            "after_warmup": [b / 2**20 for b in moved],
            "at_end": [b / 2**20 for b in _moved_bytes(v2_k)],
        },
        "profile": _profile(v2_k, one_step, device),
    }


def _fresh_peak(device: str) -> None:
    # Each step starts a new running peak, as if each variant ran alone: V2 chooses what
    # to keep in an iteration that sets a new peak (NOTE [Bytes that pay]), which a
    # variant run before it with a higher peak would otherwise deny it.
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _moved_bytes(v: Variant) -> list[int]:
    """Bytes each offloaded layer of a V2 variant moved in its last step."""
    sync = v.ctx.offload_synchronizer  # type: ignore[attr-defined]
    return [sync.layers[i].moved_bytes for i in sorted(sync.schedule.offloaded)]


def _profile(v: Variant, one_step: Callable[[Variant], None], device: str) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        one_step(v)
    _sync(device)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats("tottime")
    stats.print_stats("cpu_offload", 25)
    text = out.getvalue()
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
            for _ in range(3):
                one_step(v)
            torch.cuda.synchronize()
        text += tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("-k", type=int, default=2, help="layers offloaded in the model runs")
    p.add_argument("--duplex", action="store_true", help="also run the duplex schedule")
    p.add_argument(
        "--copies-unwaited",
        action="store_true",
        help="on CUDA, also the bare copies without their waits (the copies' weight alone)",
    )
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(1)
    spec = CUDA_SPEC if device == "cuda" else CPU_SPEC
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))  # fmt: skip
    eng = engine(device)
    print(
        f"engine: {eng['per_tensor_us']:.1f} us per offloaded tensor (round trip), "
        f"{eng['per_layer_us']:.1f} us per layer with nothing saved"
    )
    hook = pack_hook_cost(device)
    print(
        f"pack hook for a kept tensor: V2 {hook['v2_us']:.2f} us, "
        f"hooks that only detach {hook['floor_us']:.2f} us"
    )
    model = run_model(
        spec, device, args.k, args.duplex, args.turns, args.steps, args.copies_unwaited
    )
    print(f"model: {model['spec']}")
    mv = model["v2_moved_mib"]
    print(f"V2 moved MiB per offloaded layer: after the warm-up {mv['after_warmup']}, "
          f"at the end {mv['at_end']}")  # fmt: skip
    print(
        f"{'variant':24s} {'host ms':>8s} {'step ms':>8s} {'host x':>7s} {'step x':>7s} "
        f"{'+us/layer':>10s} {'+us/saved':>10s} {'saved':>6s} {'peak MiB':>9s}"
    )
    for r in model["rows"]:
        print(
            f"{r['variant']:24s} {r['host_ms']:8.2f} {r['step_ms']:8.2f} "
            f"{r['host_ratio']:7.3f} {r['step_ratio']:7.3f} "
            f"{r['extra_host_per_layer_us']:10.1f} {r['extra_host_per_saved_tensor_us']:10.2f} "
            f"{r['saved_tensors']:6d} {r['peak_mib']:9.0f}"
        )
    print(f"paired over {args.turns} turns (median of the per-turn ratio to none, and its "
          "interquartile range):")  # fmt: skip
    for r in model["rows"][1:]:
        lo, hi = r["step_ratio_paired_iqr"]
        print(
            f"  {r['variant']:24s} step x {r['step_ratio_paired']:.4f} [{lo:.4f}, {hi:.4f}]"
            f"  host x {r['host_ratio_paired']:.3f}"
        )
    print(f"the same over the {model['calm_turns']}:")
    for r in model["rows"][1:]:
        lo, hi = r["step_ratio_paired_calm_iqr"]
        print(f"  {r['variant']:24s} step x {r['step_ratio_paired_calm']:.4f} [{lo:.4f}, {hi:.4f}]")
    if model["v2_over_bare_copies_paired"] is not None:
        print(
            f"  v2 k={args.k} over bare copies, paired: {model['v2_over_bare_copies_paired']:.4f}"
        )
    if not args.no_profile:
        print(model["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "engine": eng,
                       "pack_hook": hook, "model": model}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
