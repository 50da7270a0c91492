"""``cpu-offload plan``: the fastest keep/offload/recompute plan of a model for a budget.

It profiles the model in a few steps (or takes the profile saved with an earlier
plan), plans for the budget, runs the plan and the best single method at the same or
a lower modelled peak, and prints modelled against measured step time and peak.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

from ._model import builtin_spec, resolve_model
from ._options import add_model_options, add_output_option, positive

__all__ = ["add_parser", "parse_budget", "run"]

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_budget(text: str) -> int | float:
    """A budget: bytes with a unit (``12GiB``, ``800MiB``, ``1.5GB``), or a fraction.

    A bare number in ``(0, 1]`` is a fraction of the peak without offloading.

    Args:
        text: What the user wrote.

    Returns:
        Bytes (int) or a fraction (float).

    Raises:
        ValueError: If it is neither, naming the accepted forms.

    Example:
        >>> parse_budget("12GiB"), parse_budget("800MiB"), parse_budget("0.6")
        (12884901888, 838860800, 0.6)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    forms = "a size such as 12GiB, 800MiB or 1.5GB, or a fraction in (0, 1] of the no-offload peak"
    if match is None:
        raise ValueError(f"--budget must be {forms}; got {text!r}")
    value, unit = float(match.group(1)), match.group(2).upper()
    if not unit:
        if 0 < value <= 1:
            return value
        raise ValueError(f"--budget {text!r}: a bare number must be in (0, 1]; for bytes, {forms}")
    if unit not in _UNITS:
        raise ValueError(
            f"--budget {text!r}: unknown unit {match.group(2)!r}; use one of "
            "B, KB, MB, GB, KiB, MiB, GiB, TiB"
        )
    size = value * _UNITS[unit]
    if not math.isfinite(size):
        raise ValueError(f"--budget {text!r} is too large; {forms}")
    nbytes = int(size)
    if nbytes <= 0:
        raise ValueError(f"--budget must be more than 0 bytes, got {text!r}")
    return nbytes


def _budget_type(text: str) -> int | float:
    try:
        return parse_budget(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to the ``cpu-offload`` parser's subparsers."""

    p = subparsers.add_parser(
        "plan",
        help="choose per layer (or part of a layer): keep, offload or recompute, for a "
        "memory budget",
        description=(
            "Profiles the model in a few steps, chooses per layer, or per part of a layer "
            "(its attention core, its MLP, ...), whether to keep, offload or recompute its "
            "activations so that the modelled peak stays within the budget and the modelled "
            "step is fastest, then runs the plan, the best single method (offload k, "
            "recompute k, recompute all) and the best one-part method (one part recomputed "
            "or offloaded in every layer, as Megatron-LM's recompute_modules) at the same or "
            "a lower modelled peak, and prints modelled against measured step and peak and "
            "what each layer keeps, offloads and recomputes. Without a GPU the layers run on "
            "the CPU stand-in: times are CPU times and there is no device memory to measure."
        ),
    )
    p.add_argument(
        "--budget",
        required=True,
        type=_budget_type,
        help="peak device memory allowed: 12GiB, 800MiB, 1.5GB, or 0.6 (a fraction of the "
        "peak without offloading)",
    )
    add_model_options(p)
    p.add_argument("--steps", type=positive("--steps"), help="timed steps (default 3)")
    p.add_argument("--load", metavar="PLAN.json", help="take the profile from a saved plan")
    add_output_option(p, "--save", "PLAN.json", "save the plan (with its profile)")
    add_output_option(p, "--json", "PATH", "write the figures as JSON")
    p.add_argument("--no-measure", action="store_true", help="print the model's figures only")
    p.add_argument(
        "--no-parts",
        action="store_true",
        help="keep, offload or recompute whole layers only (by default each layer's parts, "
        "such as its attention core and its MLP, may be kept, offloaded or recomputed on "
        "their own, and a kept layer may cast its saved casts again in backward)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(run=run, command_parser=p)
    return p


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def run(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: Sequence[str]) -> int:
    """Run ``cpu-offload plan`` with parsed ``args``.

    Args:
        parser: The ``cpu-offload`` parser (it reports unknown arguments).
        args: What it parsed.
        extra: The arguments it left (an error: ``plan`` takes no overrides).

    Returns:
        0; bad input (a budget no plan fits, an unreadable plan file) exits with status 2
        and a message.
    """
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    import torch

    from ..compare.workload import spec_workload
    from ..plan._clock import WARMUP_S
    from ..plan.io import PlanFileError, choice_to_json, load_plan, save_plan
    from ..plan.methods import best_single_methods, part_methods, single_methods
    from ..plan.model import Choice, estimate
    from ..plan.profile import measure_choices, profile_model
    from ..plan.search import NoPlanFits, search

    plan_parser: argparse.ArgumentParser = args.command_parser
    steps = args.steps or 3
    # The same model options, defaults and checks as compare.
    choice = resolve_model(plan_parser, args)
    device, min_numel, gpu = choice.device, choice.min_numel, choice.gpu
    workload = choice.workload
    if workload is None:
        spec = builtin_spec(plan_parser, args, choice, args.layers or choice.defaults.layers)
        workload = spec_workload(spec, device)
    model, num_layers = workload.model, len(workload.layers)

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"cpu-offload plan: {msg}", file=sys.stderr, flush=True)

    def step() -> torch.Tensor:
        return workload.loss_fn(model, workload.make_batch())

    if args.load:
        try:
            profile = load_plan(args.load).profile
        except (OSError, PlanFileError) as err:
            plan_parser.error(f"--load: {err}")
        if profile is None:
            plan_parser.error(f"--load {args.load}: the file holds no profile to plan from")
        if profile.num_layers != num_layers:
            plan_parser.error(
                f"--load {args.load}: its profile has {profile.num_layers} layers, the "
                f"model {num_layers}"
            )
    else:
        progress(f"profiling the {num_layers} layers of {workload.description} on {device}")
        profile = profile_model(
            model,
            step,
            steps=steps,
            min_tensor_size_to_offload=min_numel,
            parts=not args.no_parts,
        )
    n = profile.num_layers
    keep = estimate(profile, [Choice.KEEP] * n)
    budget = args.budget
    if isinstance(budget, float):
        # At least one byte: a fraction too small for that gets "no plan fits" as well.
        budget = max(1, int(budget * keep.peak_bytes))
    try:
        plan = search(profile, budget, parts=not args.no_parts)
    except NoPlanFits as err:
        plan_parser.error(f"--budget: {err}")
    rows: list[dict[str, Any]] = [
        {"name": "no offloading", "choices": (Choice.KEEP,) * n, "modelled": keep},
        {
            "name": f"plan {plan.describe()}",
            "choices": plan.choices,
            "modelled": estimate(profile, plan.choices),
        },
    ]
    for label, methods in (
        ("best single method", single_methods(n)),
        ("best one-part method", {} if args.no_parts else part_methods(profile)),
    ):
        best = best_single_methods(profile, plan.peak_bytes, methods) if methods else None
        if best is not None:
            rows.append(
                {"name": f"{label}: {best[0]}", "choices": methods[best[0]], "modelled": best[1]}
            )
    for row in rows:
        row["measured"] = (None, None)
        if not args.no_measure:
            progress(f"running {row['name']}")
            # At the pace the model is of: steady training (NOTE [A GPU at its power
            # limit] in plan/_clock.py).
            row["measured"] = measure_choices(
                model,
                step,
                row["choices"],
                steps=steps,
                warmup_s=WARMUP_S,
                min_tensor_size_to_offload=min_numel,
            )
    print(
        f"Plan for the {n} layers of {workload.description} on {profile.device}, budget {_gib(budget)} GiB "
        f"({budget / keep.peak_bytes:.2f} of the modelled peak without offloading); "
        f"offloaded layers {list(plan.offloaded)}, recomputed {list(plan.recomputed)}"
        + (f", casts rebuilt {list(plan.recast)}" if plan.recast else "")
        + (f", part by part {sorted(plan.parts)}." if plan.parts else ".")
    )
    if not gpu:
        print("CPU stand-in: measured times are CPU times; no device memory is measured.")
    print()
    print("| configuration | modelled step ms | modelled peak GiB | step ms | peak GiB |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        est, (ms, peak) = row["modelled"], row["measured"]
        print(
            f"| {row['name']} | {est.step_ms:.1f} | {_gib(est.peak_bytes)} | {_ms(ms)} | "
            f"{_gib(peak)} |"
        )
    print()
    _print_layers(profile, plan)
    if args.save:
        save_plan(plan, args.save)
        progress(f"wrote {args.save}")
    if args.json:
        out = [
            {
                "name": r["name"],
                "choices": [choice_to_json(c) for c in r["choices"]],
                "modelled_step_ms": r["modelled"].step_ms,
                "modelled_peak_bytes": r["modelled"].peak_bytes,
                "measured_step_ms": r["measured"][0],
                "measured_peak_bytes": r["measured"][1],
            }
            for r in rows
        ]
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"device": profile.device, "budget_bytes": budget, "rows": out}, fh, indent=2)
        progress(f"wrote {args.json}")
    return 0


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f}"


def _print_layers(profile: Any, plan: Any) -> None:
    """Per layer, what the plan does with it and its bytes; per part, where it has any."""
    from ..plan.model import Choice, Parts
    from ..plan.usage import layer_bytes

    print(
        "| layer | choice | kept MiB | offloaded MiB | recomputed MiB | casts rebuilt MiB | parts |"
    )
    print("|---:|---|---:|---:|---:|---:|---|")
    for j, (cost, choice) in enumerate(zip(profile.layers, plan.choices, strict=True)):
        kept, moved, rerun, rebuilt = layer_bytes(cost, choice)
        parts = ""
        if isinstance(choice, Parts):
            shown = []
            for part, (_, c) in zip(cost.parts, choice.choices, strict=True):
                size = sum(cost.storages[i].nbytes for i in part.saved)
                shown.append(f"{part.name} {c.value} {_mib(size)}")
            parts = "; ".join(shown)
        name = "part by part" if isinstance(choice, Parts) else Choice(choice).value
        print(
            f"| {j} | {name} | {_mib(kept)} | {_mib(moved)} | {_mib(rerun)} | {_mib(rebuilt)} "
            f"| {parts} |"
        )
