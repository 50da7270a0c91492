"""The ``cpu-offload`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _positive(name: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``cpu-offload`` parser and its ``compare`` subparser."""
    from .compare.variants import VARIANTS
    from .models import MODEL_KINDS

    parser = argparse.ArgumentParser(
        prog="cpu-offload",
        description="Offload activations to host memory; compare V1, V2 and the alternatives.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "compare",
        help="run one model under no offloading, V1, V2, checkpointing, save_on_cpu and "
        "optimizer-state offloading",
        description=(
            "Runs the same layers and batch under each variant and reports numerics against "
            "no offloading, peak GPU memory, median step time, copy bandwidth and stalls. "
            "Without a GPU the layers run on the CPU stand-in: numerics are real, times and "
            "memory are simulated (and said to be). Then trains the same model with "
            "optimizer-state offloading at fractions 0, 0.25, 0.5 and 1.0, overlap on and "
            "off, and reports step time, GPU memory of parameters plus optimizer state and "
            "the parameters' difference against no offloading (without a GPU: a CPU "
            "stand-in, memory by accounting, CPU times)."
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
    c.add_argument("--model", choices=MODEL_KINDS, default="gpt", help="layer kind (default gpt)")
    c.add_argument("--hidden", type=_positive("--hidden"), help="model width")
    c.add_argument("--heads", type=_positive("--heads"), help="attention heads")
    c.add_argument("--seq", type=_positive("--seq"), help="sequence length")
    c.add_argument("--batch", type=_positive("--batch"), help="batch size")
    c.add_argument("--layers", type=_positive("--layers"), help="number of layers (n)")
    c.add_argument(
        "--offloaded",
        type=int,
        help="layers to offload or checkpoint (k, default 2); or model.cpu_offloading_num_layers=k",
    )
    c.add_argument(
        "--dtype", choices=sorted(_DTYPES), help="bf16 on a GPU, fp32 on the CPU by default"
    )
    c.add_argument("--steps", type=_positive("--steps"), help="measured steps per variant")
    c.add_argument(
        "--warmup", type=int, help="warm-up steps per variant (2 on a GPU, 1 on the CPU)"
    )
    c.add_argument(
        "--variants",
        default="v1-sync,v1-async,v2,checkpoint,save_on_cpu",
        help=f"comma-separated, from: {', '.join(VARIANTS)} (none always runs)",
    )
    c.add_argument("--device", choices=("cuda", "cpu"), help="cuda when available")
    c.add_argument(
        "--min-tensor-size",
        type=int,
        help="smallest tensor to offload, in elements (262144 on a GPU; 8192 on the "
        "CPU, whose default model is small)",
    )
    c.add_argument(
        "--no-deterministic",
        action="store_true",
        help="allow nondeterministic kernels (the noise floor then shows their effect)",
    )
    c.add_argument(
        "--sim-tflops",
        type=float,
        default=400.0,
        help="simulated mode: assumed device TFLOP/s (default 400)",
    )
    c.add_argument(
        "--sim-link-gbps",
        type=float,
        default=50.0,
        help="simulated mode: assumed copy bandwidth each way, GB/s (default 50)",
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
    c.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    c.add_argument("--plot", metavar="PATH.png", help="draw the timeline of one step and memory")
    c.add_argument("--quiet", action="store_true", help="no progress lines")
    from .plan.cli import add_plan_parser

    add_plan_parser(sub)
    return parser, c


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``cpu-offload`` and ``python -m cpu_offload``.

    Args:
        argv: The arguments (``sys.argv[1:]`` when None).

    Returns:
        The exit status (0). Bad arguments exit with status 2 and a message naming them.
    """
    parser, compare_parser = _parser()
    # Overrides may come anywhere among the options: argparse takes the first run of
    # them as the positional, the later ones come back unparsed (and are checked by
    # parse_override like the others).
    args, extra = parser.parse_known_args(argv)
    if args.command == "plan":
        from .plan.cli import run_plan

        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return run_plan(args)
    unknown = [e for e in extra if e.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    overrides = [*args.overrides, *extra]
    # Deterministic cuBLAS needs this before CUDA starts, hence before anything else.
    if not args.no_deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    from .compare.overrides import select_from_overrides
    from .compare.report import format_table, write_json, write_plot
    from .compare.runner import CompareConfig, run_compare
    from .compare.variants import VARIANTS
    from .models import ModelSpec

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    gpu = device == "cuda"
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    try:
        selection = select_from_overrides(
            overrides,
            layers=args.layers,
            offloaded=args.offloaded,
            default_layers=8 if gpu else 6,
            activation=not args.optimizer_only,
            optimizer=not args.no_optimizer,
        )
    except ValueError as err:
        compare_parser.error(str(err))
    spec = ModelSpec(
        kind=args.model,
        hidden=args.hidden or (2048 if gpu else 128),
        heads=args.heads or (16 if gpu else 4),
        seq=args.seq or (2048 if gpu else 128),
        batch=args.batch or (2 if gpu else 4),
        layers=selection.layers,
        dtype=getattr(torch, _DTYPES[args.dtype or ("bf16" if gpu else "fp32")]),
    )
    k = selection.num_offloaded
    if spec.hidden % spec.heads:
        parser.error(f"--heads ({spec.heads}) must divide --hidden ({spec.hidden})")
    min_numel = args.min_tensor_size
    if min_numel is None:
        min_numel = 256 * 1024 if gpu else 8 * 1024
    if min_numel < 0:
        parser.error("--min-tensor-size must be >= 0")
    warmup = args.warmup if args.warmup is not None else (2 if gpu else 1)
    if warmup < 0:
        parser.error("--warmup must be >= 0")
    if not args.no_deterministic:
        torch.use_deterministic_algorithms(True)
    config = CompareConfig(
        spec=spec,
        num_offloaded=k,
        variants=variants,
        steps=args.steps or (10 if gpu else 2),
        warmup=warmup,
        min_numel=min_numel,
        device=device,
        deterministic=not args.no_deterministic,
        sim_tflops=args.sim_tflops,
        sim_link_gbps=args.sim_link_gbps,
        activation=selection.activation,
        optimizer=selection.optimizer,
    )

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"cpu-offload: {msg}", file=sys.stderr, flush=True)

    report = run_compare(config, progress)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        progress(f"wrote {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        progress(f"wrote {args.plot}")
    return 0
