"""Planner benchmark: plans for several budgets, run and measured beside the single methods.

For each workload (a ``transformers`` Llama built from a config, Megatron-Core's GPT at
two sizes, the second being workload D, and the default model of ``cpu-offload compare``
on a GPU) it measures training steps without a plan, profiles the model, makes a plan
for each budget (a fraction of the measured peak without a plan), applies it with its
budget check and trains, and reports the modelled against the measured step and peak
(the first step's, before any tightening), whether the loss and every gradient of the
first step are bit-identical to the run without a plan, and the fastest single method
(offload the first k, recompute the first k, recompute every layer) whose measured peak
is at or below the plan's, all measured in the same process. Steps are timed as users
train (no ``CUBLAS_WORKSPACE_CONFIG``, no deterministic algorithms: see
``_report.timed_as_users_train``); the numerics are compared afterwards with
deterministic kernels. The host's speed on a shared machine drifts in phases: each
measurement lies between two runs of the profile's host probe, and the figures over the
rounds the probe read calm are reported beside those over every round. The profile
takes the host's times from every round (pace ``"every"``, the default: NOTE [The
host's pace]); each plan is also modelled from the same profile's rounds with the
host's times of the calm rounds only (pace ``"calm"``; not with ``--parts``), to check
which pace models the measured median.

    python benchmarks/plan.py --json plan.json --markdown plan.md
    python benchmarks/plan.py --quick        # smaller models, about a minute
    python benchmarks/plan.py --parts        # plans per part of a layer too

With ``--parts`` the profile has each layer's parts, the plan may choose per part, and
beside it run the plan of whole layers for the same budget, the one-part methods (one
part recomputed or offloaded in every layer, as Megatron-LM's ``recompute_modules``), and
the part whose recomputation frees most recomputed in every layer with the rest of the
first k layers offloaded (Megatron-LM's selective recomputation beside our offloading).
On the ``transformers`` Llama the model's own activation checkpointing of every layer,
with and without its ``offload=True`` (where its version has it), runs among the methods.
``--ks 2,4,8`` limits the single methods to those k, for the large workloads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _plan_methods import recomputed_part_with_offload  # noqa: E402
from _plan_report import markdown, whole_letters  # noqa: E402
from _plan_workloads import WORKLOAD_DIMS, build, own_methods  # noqa: E402
from _report import bit_identical, exact, run_isolated, timed_as_users_train, write_reports  # noqa: E402

from cpu_offload._layer_stack import find_layers  # noqa: E402
from cpu_offload.cli.plan import parse_budget  # noqa: E402
from cpu_offload.plan import (  # noqa: E402
    Choice,
    NoPlanFits,
    PlanOverBudget,
    Profile,
    apply_plan,
    estimate,
    part_methods,
    profile_model,
    search,
    single_methods,
)
from cpu_offload.plan._clock import WARMUP_S  # noqa: E402
from cpu_offload.plan._probe import probed  # noqa: E402
from cpu_offload.plan._rounds import calm, calm_reference  # noqa: E402
from cpu_offload.plan._timing import HostAndDevice  # noqa: E402
from cpu_offload.plan.profile import measure_choices  # noqa: E402


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _first_step(model: nn.Module, step: Callable[[], torch.Tensor]) -> tuple:
    """One step's loss and gradients, kept on the host."""
    for p in _params(model):
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
    loss = step()
    loss.backward()
    return loss.detach().cpu(), [p.grad.cpu() for p in _params(model)]


def _check_plan(model: nn.Module, step: Callable[[], torch.Tensor], plan) -> dict:  # type: ignore[no-untyped-def]
    """Apply ``plan`` with its budget check: the first step's peak, and the plan it runs
    once the check is done (tightened, if the first step went over its budget)."""
    error = None
    with apply_plan(model, plan) as handle:
        step().backward()
        check = handle.watch
        first_peak = check.measured_peak_bytes
        # A plan over budget runs tightened from the next step, which is checked again.
        for _ in range(check.max_tightenings + 2):
            if check.done:
                break
            try:
                step().backward()
            except PlanOverBudget as exc:
                error = str(exc)
                break
        final = check.plan
    return {
        "first_peak": first_peak,
        "final": final,
        "tightened": check.tightened,
        "check_error": error,
    }


def _release_pinned_cache() -> None:
    """Give the pinned host memory that PyTorch keeps cached back to the system.

    Each configuration's host buffers go back to PyTorch's pinned-memory cache when it is
    removed, and the cache keeps them for later allocations of the same sizes; workload
    D's configurations take about 1 GB of host buffers per offloaded layer, in sizes that
    differ between configurations.
    """
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _alternated(  # type: ignore[no-untyped-def]
    model: nn.Module,
    step: Callable[[], torch.Tensor],
    configs: dict[str, list | Callable[[], contextlib.AbstractContextManager]],
    rounds: int,
    steps: int,
    warmup: int,
    warmup_s: float = 0.0,
) -> dict[str, dict]:
    """Each configuration's median step and peak, measured in ``rounds`` rounds that take
    the configurations in turn: a drift of the host's speed during the run then touches
    all of them alike instead of the few measured while it lasted. A configuration is a
    plan's choices, or a function that installs a model's own method (its context manager
    removes it again), run with every layer kept.

    Each measurement also lies between two runs of the profile's host probe (NOTE [The
    host's pace] in ``cpu_offload/plan/_rounds.py``): ``calm_ms`` is the median of the
    rounds whose probe read the host calm, the speed the pace ``"calm"`` models."""
    keep = [Choice.KEEP] * len(find_layers(model))
    medians: dict[str, list[float]] = {label: [] for label in configs}
    probes: dict[str, list[float]] = {label: [] for label in configs}
    peaks: dict[str, int] = {}

    def run(config: Any) -> tuple[float, int | None]:
        with config() if callable(config) else contextlib.nullcontext():
            choices = keep if callable(config) else config
            return measure_choices(
                model, step, choices, steps=steps, warmup=warmup, warmup_s=warmup_s
            )

    for _ in range(rounds):
        for label, config in configs.items():
            (ms, peak), probe = probed(lambda config=config: run(config))
            probes[label].append(probe)
            assert peak is not None
            _release_pinned_cache()
            medians[label].append(ms)
            peaks[label] = max(peaks.get(label, 0), peak)
    reference = calm_reference(ms for values in probes.values() for ms in values)
    out = {}
    for label, ms in medians.items():
        quiet = [t for t, ok in zip(ms, calm(probes[label], reference), strict=True) if ok]
        out[label] = {
            "measured": [statistics.median(ms), peaks[label]],
            "round_medians_ms": ms,
            "round_probes_ms": probes[label],
            "calm_ms": statistics.median(quiet) if quiet else None,
            "calm_rounds": len(quiet),
        }
    return out


def _exact(model: nn.Module, step: Callable[[], torch.Tensor], plans: list) -> list[bool]:  # type: ignore[type-arg]
    """Whether each plan's first step (loss and every gradient) is bit-identical to no plan."""
    with exact():
        reference = _first_step(model, step)
        same = []
        for plan in plans:
            with apply_plan(model, plan, check_budget=False):
                loss, grads = _first_step(model, step)
            same.append(bit_identical((loss, grads), reference))
    return same


def _run(  # type: ignore[no-untyped-def]
    name: str,
    quick: bool,
    fractions: list[float],
    rounds: int,
    steps: int,
    warmup: int,
    parts: bool = False,
    ks: list[int] | None = None,
    warmup_s: float = 0.0,
) -> dict:
    model, step = build(name, quick)
    with timed_as_users_train():
        result = _timed(model, step, name, fractions, rounds, steps, warmup, parts, ks, warmup_s)
    plans = result.pop("plans")
    for row, same in zip(
        (r for r in result["rows"] if "plan" in r), _exact(model, step, plans), strict=True
    ):
        row["exact"] = same
    return result


def _timed(  # type: ignore[no-untyped-def]
    model: nn.Module,
    step: Callable[[], torch.Tensor],
    name: str,
    fractions: list[float],
    rounds: int,
    steps: int,
    warmup: int,
    parts: bool = False,
    ks: list[int] | None = None,
    warmup_s: float = 0.0,
) -> dict:
    n = len(find_layers(model))
    keep_choices = [Choice.KEEP] * n
    _, none_peak = measure_choices(model, step, keep_choices, steps=steps, warmup=warmup)
    assert none_peak is not None
    with _runners() as runners:
        profile = profile_model(model, step, steps=steps, warmup=warmup, parts=parts)
    # The same rounds with the host's times of the calm rounds only (without parts: their
    # host probes run after the profile's own).
    pace, calm_host, calm_scale = _paces(runners[0] if runners else None, parts)
    wanted = None if ks is None else {f"k={k}" for k in ks}
    methods = {
        m: c
        for m, c in single_methods(n).items()
        if wanted is None or m.split()[-1] in wanted | {"all"}
    }
    if parts:
        methods |= part_methods(profile)
        methods |= recomputed_part_with_offload(profile, ks or (n // 4, n // 2))
    own = own_methods(model)

    # The plans for the budgets, each applied once with its budget check; with parts,
    # the plan of whole layers for the same budget runs beside them as a method.
    checked = []
    for fraction in fractions:
        budget = int(fraction * none_peak) if fraction <= 1 else int(fraction)
        try:
            plan = search(profile, budget)
        except NoPlanFits as err:
            checked.append((fraction, budget, None, str(err)))
            continue
        checked.append((fraction, budget, plan, _check_plan(model, step, plan)))
        if parts:
            with contextlib.suppress(NoPlanFits):
                whole = search(profile, budget, parts=False).choices
                methods[f"whole-layer plan {whole_letters(whole)}"] = whole

    # No plan, every method and every plan, timed in alternating rounds.
    configs: dict[str, list | Callable] = {"none": keep_choices, **methods, **own}
    for fraction, _, plan, got in checked:
        if plan is not None:
            configs[f"plan {fraction}"] = list(got["final"].choices)
    timed = _alternated(model, step, configs, rounds, steps, warmup, warmup_s)

    keep = estimate(profile, keep_choices)
    singles = {}
    for label, choices in methods.items():
        est = estimate(profile, choices)
        singles[label] = {"modelled": [est.step_ms, est.peak_bytes], **timed[label]}
        singles[label]["modelled_calm_host_ms"] = (
            None if calm_host is None else estimate(calm_host, choices).step_ms
        )
    for label in own:
        singles[label] = {"modelled": None, **timed[label]}
    rows, plans = [], []
    for fraction, budget, plan, got in checked:
        if plan is None:
            rows.append({"fraction": fraction, "budget_bytes": budget, "error": got})
            continue
        plans.append(plan)
        ms, peak = timed[f"plan {fraction}"]["measured"]
        final = got["final"]
        fits = [(v["measured"][0], k) for k, v in singles.items() if v["measured"][1] <= peak]
        best = min(fits) if fits else None
        calm_ms = timed[f"plan {fraction}"]["calm_ms"]
        calm_fits = [
            (v["calm_ms"], k)
            for k, v in singles.items()
            if v["measured"][1] <= peak and v["calm_ms"] is not None
        ]
        best_calm = min(calm_fits) if calm_fits and calm_ms is not None else None
        # Methods at or below the plan's peak with no calm round are left out of
        # best_calm: say how many.
        uncounted = sum(
            1 for v in singles.values() if v["measured"][1] <= peak and v["calm_ms"] is None
        )
        calm_host_ms = None if calm_host is None else estimate(calm_host, final.choices).step_ms
        rows.append(
            {
                "fraction": fraction,
                "budget_bytes": budget,
                "plan": plan.describe(),
                "final_plan": final.describe(),
                "parts": {str(j): p for j, p in final.parts.items()},
                "tightened": got["tightened"],
                "check_error": got["check_error"],
                # The model of the plan that ran (the tightened one, if the check made one).
                "modelled": [final.step_ms, final.peak_bytes],
                "measured": [ms, peak],
                "round_medians_ms": timed[f"plan {fraction}"]["round_medians_ms"],
                "first_step_peak": got["first_peak"],
                "within_budget": peak <= 1.01 * budget,
                "model_step_error": final.step_ms / ms - 1,
                # Against the plan's fastest round: the host's slow phases only add time.
                "model_step_error_fastest": final.step_ms
                / min(timed[f"plan {fraction}"]["round_medians_ms"])
                - 1,
                "model_peak_error": plan.peak_bytes / got["first_peak"] - 1,
                # Against the rounds of a calm host (NOTE [The host's pace]).
                "calm_ms": calm_ms,
                "calm_rounds": timed[f"plan {fraction}"]["calm_rounds"],
                "model_step_error_calm": None if calm_ms is None else final.step_ms / calm_ms - 1,
                # The same plan modelled with the host's times of the calm rounds only.
                "modelled_calm_host_ms": calm_host_ms,
                "model_step_error_calm_host": None
                if calm_host_ms is None
                else calm_host_ms / ms - 1,
                "best_single_calm": None if best_calm is None else best_calm[1],
                "singles_without_calm_round": uncounted,
                "speedup_vs_best_single_calm": None
                if best_calm is None
                else best_calm[0] / calm_ms,
                "best_single": None if best is None else best[1],
                "best_single_measured": None if best is None else singles[best[1]]["measured"],
                "speedup_vs_best_single": None if best is None else best[0] / ms,
            }
        )
    return {
        "workload": name,
        "layers": n,
        "none": {
            "modelled": [keep.step_ms, keep.peak_bytes],
            "modelled_calm_host_ms": None
            if calm_host is None
            else estimate(calm_host, keep_choices).step_ms,
            **timed["none"],
        },
        "link_gbps": [profile.link.d2h_gbps, profile.link.h2d_gbps, profile.link.duplex_gbps],
        # The device's pace in steady training against the profile's (plan/_clock.py).
        "pace_factor": None if pace is None else pace[0],
        # What the costs of recomputation were scaled by to steady training's (ditto).
        "recompute_scale": None if pace is None else pace[1],
        "recompute_scale_calm_host": calm_scale,
        # The whole profile, so that a change to the model can be checked against these
        # measurements without the GPU.
        "profile": dataclasses.asdict(profile),
        "profile_calm_host": None if calm_host is None else dataclasses.asdict(calm_host),
        "rows": rows,
        "singles": singles,
        "plans": plans,
    }


def _paces(
    runner: HostAndDevice | None, parts: bool
) -> tuple[tuple[float, float] | None, Profile | None, float | None]:
    """The main profile's pace factor and recomputation scale, the profile of the calm
    rounds (not with parts: their host probes run after the profile's own), and the
    recomputation scale solved for that one. ``at_steady_pace`` overwrites the runner's
    scale, so the main one is read first. All None without a runner (the CPU stand-in's
    one time per layer)."""
    if runner is None:
        return None, None, None
    pace = (runner.pace_factor, runner.recompute_scale)
    if parts:
        return pace, None, None
    calm_host = runner.at_steady_pace(runner.rebuild("calm"))
    return pace, calm_host, runner.recompute_scale


@contextlib.contextmanager
def _runners() -> Iterator[list[HostAndDevice]]:
    """The :class:`HostAndDevice` runners that profile the model inside the block."""
    runners: list[HostAndDevice] = []
    real = HostAndDevice.profile

    def recorded(self: HostAndDevice, *args: Any, **kwargs: Any) -> Any:
        runners.append(self)
        return real(self, *args, **kwargs)

    HostAndDevice.profile = recorded  # type: ignore[method-assign]
    try:
        yield runners
    finally:
        HostAndDevice.profile = real  # type: ignore[method-assign]


def _isolated(name: str, args: argparse.Namespace) -> dict:
    # One process per workload: each starts from an empty GPU (and D's process group).
    argv = ["--one", name, "--budgets", args.budgets, "--steps", str(args.steps)]
    argv += ["--parts"] if args.parts else []
    argv += ["--ks", args.ks] if args.ks else []
    argv += ["--warmup", str(args.warmup), "--warmup-s", str(args.warmup_s)]
    argv += ["--rounds", str(args.rounds)]
    return run_isolated(__file__, argv + (["--quick"] if args.quick else []), {"workload": name})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models (about a minute)")
    parser.add_argument(
        "--parts", action="store_true", help="plan per part of a layer too (see the notes)"
    )
    parser.add_argument(
        "--workloads",
        default="llama,megatron,D,compare",
        help=f"comma-separated, of: {', '.join(WORKLOAD_DIMS)}",
    )
    parser.add_argument(
        "--budgets",
        default="0.8,0.6,0.45",
        help="fractions of the measured peak without a plan, or sizes (11.94GiB)",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds that take the configurations in turn"
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="timed steps per configuration and round"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps before each configuration's"
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=WARMUP_S,
        help="then untimed steps back to back for this many seconds, so that a GPU at its"
        " power limit is timed at the pace of steady training (0: none)",
    )
    parser.add_argument(
        "--ks",
        help="the k of the single methods (offload or recompute the first k), comma-separated;"
        " every k by default",
    )
    parser.add_argument("--json", help="write all figures as JSON")
    parser.add_argument("--markdown", help="write the tables as Markdown")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    try:
        fractions = [float(parse_budget(f)) for f in args.budgets.split(",")]
    except ValueError as err:
        parser.error(str(err).replace("--budget", "--budgets"))
    try:
        ks = [int(k) for k in args.ks.split(",")] if args.ks else None
    except ValueError:
        parser.error(f"--ks: expected comma-separated integers, got {args.ks!r}")
    if not 0 <= args.warmup_s < float("inf"):
        parser.error(f"--warmup-s: expected a number of seconds >= 0, got {args.warmup_s!r}")
    if ks is not None and any(k < 1 for k in ks):
        parser.error(f"--ks: each k must be at least 1, got {args.ks!r}")
    if args.one:
        result = _run(
            args.one,
            args.quick,
            fractions,
            args.rounds,
            args.steps,
            args.warmup,
            args.parts,
            ks,
            args.warmup_s,
        )
        print(json.dumps(result, default=str))
        return 0
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOAD_DIMS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; choose from {', '.join(WORKLOAD_DIMS)}")
    for needs, kind in (("megatron.core", "megatron"), ("transformers", "llama")):
        try:
            __import__(needs)
        except ImportError:
            skipped = [w for w in names if WORKLOAD_DIMS[w][0] == kind]
            print(f"{needs} does not import: {skipped} skipped", file=sys.stderr)
            names = [w for w in names if w not in skipped]
    device = torch.cuda.get_device_name()
    results: list[dict] = []
    for name in names:
        print(f"plan benchmark: workload {name}", file=sys.stderr, flush=True)
        results.append(_isolated(name, args))
        md = markdown(results, device, args.rounds, args.steps, args.warmup, args.warmup_s)
        write_reports(args.json, args.markdown, device, results, md, quick=args.quick)
    print(markdown(results, device, args.rounds, args.steps, args.warmup, args.warmup_s))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
