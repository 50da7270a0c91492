"""``cpu-offload compare``: the variants side by side on one model, and the optimizer
section beside them."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._model import builtin_spec, resolve_model
from ._options import (
    add_model_options,
    add_output_option,
    by_device,
    int_in,
    positive,
    positive_float,
)

__all__ = ["add_parser", "run"]


def _variant_list(text: str) -> list[str]:
    """``--variants``: a comma-separated list of known variants, at least one."""
    from ..compare.variants import VARIANTS

    names = [v.strip() for v in text.split(",") if v.strip()]
    allowed = ", ".join(VARIANTS)
    if not names:
        raise argparse.ArgumentTypeError(f"--variants is empty; choose from {allowed}")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--variants: unknown {', '.join(unknown)}; choose from {allowed}"
        )
    return names


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``compare`` subcommand to the ``cpu-offload`` parser's subparsers."""
    from ..compare._table import DEFAULT_WIDTH
    from ..compare.model import DEFAULT_VARIANTS
    from ..compare.variants import VARIANTS

    c = subparsers.add_parser(
        "compare",
        help="run one model under no offloading, V1, V2, checkpointing, save_on_cpu and "
        "optimizer-state offloading",
        description=(
            "Runs the same layers and batch under each variant and reports numerics against "
            "no offloading, peak GPU memory, median step time with its spread, copy "
            "bandwidth and stalls. Without a GPU the layers run on the CPU stand-in: "
            "numerics are real, times and memory are simulated (and said to be). Then "
            "trains the same model with optimizer-state offloading at fractions 0, 0.25, "
            "0.5 and 1.0, overlap on and off, and reports step time, GPU memory of "
            "parameters plus optimizer state and the parameters' difference against no "
            "offloading (without a GPU: a CPU stand-in, memory by accounting). Defaults "
            "that differ by device are given as 'GPU / CPU'."
        ),
        epilog=(
            "Megatron Bridge overrides select configurations: "
            "optimizer.optimizer_offload_fraction=0.5, optimizer.overlap_cpu_optimizer_d2h_h2d=true "
            "(each narrows the optimizer section to that value), optimizer.optimizer=sgd, "
            "model.cpu_offloading_num_layers=4 (same as --offloaded 4), model.num_layers=8 "
            "(same as --layers 8); optimizer.optimizer_cpu_offload=false and "
            "model.cpu_offloading=false skip a section."
        ),
    )
    c.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="Megatron Bridge overrides (see below)",
    )
    add_model_options(c, "The optimizer section runs on the built-in kinds only.")
    c.add_argument(
        "--offloaded",
        type=int,
        help="layers to offload or checkpoint, k in [0, n-1]; or "
        "model.cpu_offloading_num_layers=k (default: 2, 1 with fewer than 4 layers)",
    )
    c.add_argument(
        "--steps",
        type=positive("--steps"),
        help="measured steps per variant (default: about one second of steps, 10 to 50 / 2)",
    )
    c.add_argument(
        "--warmup",
        type=int_in("--warmup", 0),
        help=f"warm-up steps per variant, >= 0 (default: {by_device('warmup')})",
    )
    c.add_argument(
        "--variants",
        type=_variant_list,
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, from: {', '.join(VARIANTS)}; none always runs "
        f"(default: {','.join(DEFAULT_VARIANTS)})",
    )
    c.add_argument(
        "--no-deterministic",
        action="store_true",
        help="allow nondeterministic kernels (the noise floor then shows their effect)",
    )
    c.add_argument(
        "--sim-tflops",
        type=positive_float("--sim-tflops"),
        default=400.0,
        help="simulated mode: assumed device TFLOP/s, > 0 (default: 400)",
    )
    c.add_argument(
        "--sim-link-gbps",
        type=positive_float("--sim-link-gbps"),
        default=50.0,
        help="simulated mode: assumed copy bandwidth each way, GB/s, > 0 (default: 50)",
    )
    sections = c.add_mutually_exclusive_group()
    sections.add_argument(
        "--no-optimizer",
        action="store_true",
        help="skip the optimizer-offloading section",
    )
    sections.add_argument(
        "--optimizer-only",
        action="store_true",
        help="run only the optimizer-offloading section",
    )
    add_output_option(c, "--json", "PATH", "write the full report as JSON")
    add_output_option(
        c,
        "--plot",
        "PATH.png",
        "draw the timeline of one step and memory (needs matplotlib; any format it writes, "
        ".png when the name has no suffix)",
    )
    c.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="add a row 'plan' that runs this per-layer plan (saved by cpu-offload plan "
        "--save for the same model and number of layers)",
    )
    c.add_argument(
        "--wide",
        action="store_true",
        help="each table in one piece, one-line headers, no line wrapped (default: within "
        f"{DEFAULT_WIDTH} columns)",
    )
    c.add_argument("--quiet", action="store_true", help="no progress lines")
    c.set_defaults(run=run, command_parser=c)
    return c


def _plot_path(parser: argparse.ArgumentParser, path: str) -> str:
    """The file ``--plot`` will write, checked before anything runs.

    matplotlib must be installed and know the format of the suffix; a name without a
    suffix gets matplotlib's default format's (``outfile`` becomes ``outfile.png``).
    """
    try:
        import matplotlib
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        parser.error(
            "--plot needs matplotlib, which is not installed: pip install 'cpu-offload[plot]'"
        )
    suffix = Path(path).suffix.lstrip(".").lower()
    if not suffix:
        suffix = str(matplotlib.rcParams["savefig.format"])
        path = f"{path}.{suffix}"
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if suffix not in formats:
        parser.error(
            f"--plot {path!r}: matplotlib cannot write .{suffix} files; use one of "
            f"{', '.join('.' + f for f in formats)}"
        )
    return path


def run(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: Sequence[str]) -> int:
    """Run ``cpu-offload compare`` with parsed ``args``.

    Args:
        parser: The ``cpu-offload`` parser (it reports unknown options).
        args: What it parsed.
        extra: The arguments it left: Megatron Bridge overrides after the options.

    Returns:
        0; bad input exits with status 2 and a message naming the option.
    """
    compare_parser: argparse.ArgumentParser = args.command_parser
    # Overrides may come anywhere among the options: argparse takes the first run of
    # them as the positional, the later ones come back unparsed (and are checked by
    # parse_override like the others).
    unknown = [e for e in extra if e.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    overrides = [*args.overrides, *extra]
    plot = _plot_path(compare_parser, args.plot) if args.plot else None
    if args.plan and not Path(args.plan).is_file():
        # Before the model is built: a wrong path is reported at once.
        compare_parser.error(f"--plan {args.plan!r}: no such file")
    # Deterministic cuBLAS needs this before CUDA starts, hence before anything else.
    if not args.no_deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    from ..compare._table import DEFAULT_WIDTH
    from ..compare.overrides import select_from_overrides
    from ..compare.plot import write_plot
    from ..compare.report import format_table, write_json
    from ..compare.runner import CompareConfig, run_compare
    from ..models import MODEL_KINDS

    if args.optimizer_only and args.model not in MODEL_KINDS:
        compare_parser.error(
            "--optimizer-only: the optimizer section runs on the built-in kinds only"
        )
    model = resolve_model(compare_parser, args)
    gpu, workload = model.gpu, model.workload
    try:
        selection = select_from_overrides(
            overrides,
            layers=args.layers if workload is None else len(workload.layers),
            offloaded=args.offloaded,
            default_layers=model.defaults.layers,
            activation=not args.optimizer_only,
            optimizer=not args.no_optimizer and workload is None,
        )
    except ValueError as err:
        compare_parser.error(str(err))
    spec = None
    if workload is None:
        spec = builtin_spec(compare_parser, args, model, selection.layers)
    plan = None
    if args.plan:
        plan = _load_plan(compare_parser, args, selection)
    warmup = args.warmup if args.warmup is not None else model.defaults.warmup
    if not args.no_deterministic:
        torch.use_deterministic_algorithms(True)
    config = CompareConfig(
        spec=spec,
        num_offloaded=selection.num_offloaded,
        variants=args.variants,
        steps=args.steps if args.steps else (None if gpu else 2),
        warmup=warmup,
        min_numel=model.min_numel,
        device=model.device,
        deterministic=not args.no_deterministic,
        sim_tflops=args.sim_tflops,
        sim_link_gbps=args.sim_link_gbps,
        activation=selection.activation,
        optimizer=selection.optimizer,
        workload=workload,
        plan=plan,
    )

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"cpu-offload: {msg}", file=sys.stderr, flush=True)

    report = run_compare(config, progress)
    if workload is not None and not args.no_optimizer:
        report.notes.append(
            "The optimizer section runs on the built-in layer kinds only: skipped for this model."
        )
    print(format_table(report, width=None if args.wide else DEFAULT_WIDTH))
    if args.json:
        write_json(report, args.json)
        progress(f"wrote {args.json}")
    if plot is not None:
        write_plot(report, plot)
        progress(f"wrote {plot}")
    return 0


def _load_plan(parser, args, selection):  # type: ignore[no-untyped-def]
    """The plan of ``--plan``, checked against the model's layers (exit 2 otherwise)."""
    from ..plan.apply import check_plan_layers
    from ..plan.io import PlanFileError, load_plan

    if not selection.activation:
        parser.error("--plan: the plan runs in the activation section; drop --optimizer-only")
    try:
        plan = load_plan(args.plan)
        check_plan_layers(plan, selection.layers, "--plan")
    except (OSError, PlanFileError) as err:
        parser.error(f"--plan {args.plan!r}: {err}")
    except ValueError as err:
        parser.error(str(err))
    return plan
