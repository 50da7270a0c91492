"""Planner benchmark: plans for several budgets, run and measured beside the single methods.

For each workload (A of ``activation_offload.py``, the default model of
``cpu-offload compare`` on a GPU, and Megatron-Core's GPT, workload D, when
``megatron.core`` imports) it profiles the model, makes a plan for each budget (a
fraction of the modelled peak without offloading), runs it, and reports modelled
against measured step and peak; then the fastest single method (offload the first k,
recompute the first k, recompute every layer) whose measured peak is at or below the
plan's, all measured in the same process.

    python benchmarks/plan.py --json plan.json --markdown plan.md
    python benchmarks/plan.py --quick        # smaller models, about a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import run_isolated, write_reports  # noqa: E402
from activation_offload import WORKLOADS  # noqa: E402

from cpu_offload.models import ModelSpec, build_layers, run_layers  # noqa: E402
from cpu_offload.plan import Choice, estimate, profile_model, search, single_methods  # noqa: E402
from cpu_offload.plan.profile import measure_choices  # noqa: E402
from cpu_offload.plan.search import NoPlanFits  # noqa: E402

GPT = {
    "A": WORKLOADS["A"],
    # cpu-offload compare's default model on a GPU.
    "compare": dict(hidden=2048, heads=16, batch=2, seq=2048, layers=8),
}
QUICK = {
    "A": dict(hidden=2048, heads=16, batch=2, seq=2048, layers=8),
    "compare": dict(hidden=1024, heads=8, batch=2, seq=1024, layers=8),
}
MEGATRON = dict(layers=16, hidden=2048, heads=16, seq=2048, batch=2, vocab=32768)
MEGATRON_QUICK = dict(layers=8, hidden=1024, heads=8, seq=1024, batch=2, vocab=32768)


def _gpt(dims: dict) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    spec = ModelSpec(kind="gpt", dtype=torch.bfloat16, **dims)
    layers = build_layers(spec, "cuda")
    x = spec.make_input("cuda")
    return layers, lambda: run_layers(layers, x).float().square().mean()


def _megatron(dims: dict) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    # Megatron-Core's GPTModel, local layer spec (no Transformer Engine), bf16 through its
    # Float16Module, on one GPU; offload_layers finds module.decoder.layers.
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29519")
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(
        num_layers=dims["layers"],
        hidden_size=dims["hidden"],
        num_attention_heads=dims["heads"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    gpt = GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        vocab_size=dims["vocab"],
        max_sequence_length=dims["seq"],
    )
    model = Float16Module(cfg, gpt.cuda())
    b, s = dims["batch"], dims["seq"]
    tokens = torch.randint(0, dims["vocab"], (b, s), device="cuda")
    labels = torch.roll(tokens, -1, 1)
    pos = torch.arange(s, device="cuda").unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device="cuda"), diagonal=1)
    return model, lambda: model(tokens, pos, mask, labels=labels).float().mean()


def _run(name: str, quick: bool, fractions: list[float], steps: int) -> dict:
    if name == "D":
        model, step = _megatron(MEGATRON_QUICK if quick else MEGATRON)
    else:
        model, step = _gpt((QUICK if quick else GPT)[name])
    profile = profile_model(model, step, steps=steps)
    n = profile.num_layers
    keep = estimate(profile, [Choice.KEEP] * n)

    def measured(choices) -> tuple[float, int]:  # type: ignore[no-untyped-def]
        ms, peak = measure_choices(model, step, choices, steps=steps)
        assert peak is not None
        return ms, peak

    none_ms, none_peak = measured([Choice.KEEP] * n)
    # Every single method, measured once; each budget compares against the fastest of
    # them whose measured peak is at or below the plan's.
    singles = {}
    for label, choices in single_methods(n).items():
        est = estimate(profile, choices)
        ms, peak = measured(choices)
        singles[label] = {"modelled": [est.step_ms, est.peak_bytes], "measured": [ms, peak]}
    rows = []
    for fraction in fractions:
        budget = int(fraction * keep.peak_bytes)
        try:
            plan = search(profile, budget)
        except NoPlanFits as err:
            rows.append({"fraction": fraction, "budget_bytes": budget, "error": str(err)})
            continue
        ms, peak = measured(plan.choices)
        fits = [(v["measured"][0], k) for k, v in singles.items() if v["measured"][1] <= peak]
        best = min(fits) if fits else None
        rows.append(
            {
                "fraction": fraction,
                "budget_bytes": budget,
                "plan": plan.describe(),
                "modelled": [plan.step_ms, plan.peak_bytes],
                "measured": [ms, peak],
                "within_budget": peak <= budget,
                "model_step_error": plan.step_ms / ms - 1,
                "model_peak_error": plan.peak_bytes / peak - 1,
                "best_single": None if best is None else best[1],
                "best_single_measured": None if best is None else singles[best[1]]["measured"],
                "speedup_vs_best_single": None if best is None else best[0] / ms,
            }
        )
    return {
        "workload": name,
        "layers": n,
        "none": {"modelled": [keep.step_ms, keep.peak_bytes], "measured": [none_ms, none_peak]},
        "link_gbps": [profile.link.d2h_gbps, profile.link.h2d_gbps, profile.link.duplex_gbps],
        # The whole profile, so that a change to the model can be checked against these
        # measurements without the GPU.
        "profile": dataclasses.asdict(profile),
        "rows": rows,
        "singles": singles,
    }


def _markdown(results: list[dict], device: str) -> str:
    gib = 2**30
    out = [
        f"Measured {datetime.date.today().isoformat()} on {device}, torch {torch.__version__}; "
        "median step, peak of torch.cuda.max_memory_allocated.",
        "",
    ]
    for res in results:
        if "error" in res:
            out += [f"Workload {res['workload']}: {res['error']}", ""]
            continue
        none = res["none"]["measured"]
        out += [
            f"#### Workload {res['workload']}, {res['layers']} layers (no offloading: "
            f"{none[0]:.1f} ms, {none[1] / gib:.2f} GiB; modelled "
            f"{res['none']['modelled'][0]:.1f} ms, {res['none']['modelled'][1] / gib:.2f} GiB)",
            "",
            "| budget GiB | plan | modelled ms / GiB | measured ms / GiB | model error step / peak "
            "| best single method at <= peak | its ms / GiB | plan speedup |",
            "|---:|---|---:|---:|---:|---|---:|---:|",
        ]
        for r in res["rows"]:
            if "error" in r:
                out.append(f"| {r['budget_bytes'] / gib:.2f} | {r['error']} | | | | | | |")
                continue
            best = r["best_single_measured"]
            out.append(
                f"| {r['budget_bytes'] / gib:.2f} | {r['plan']} | {r['modelled'][0]:.1f} / "
                f"{r['modelled'][1] / gib:.2f} | {r['measured'][0]:.1f} / "
                f"{r['measured'][1] / gib:.2f}{'' if r['within_budget'] else ' (over)'} | "
                f"{r['model_step_error']:+.1%} / {r['model_peak_error']:+.1%} | "
                f"{r['best_single'] or '-'} | "
                + ("-" if best is None else f"{best[0]:.1f} / {best[1] / gib:.2f}")
                + " | "
                + (
                    "-"
                    if r["speedup_vs_best_single"] is None
                    else f"{r['speedup_vs_best_single']:.2f}x"
                )
                + " |"
            )
        out.append("")
    return "\n".join(out)


def _isolated(name: str, args: argparse.Namespace) -> dict:
    # One process per workload: each starts from an empty GPU (and D's process group).
    argv = ["--one", name, "--budgets", args.budgets, "--steps", str(args.steps)]
    return run_isolated(__file__, argv + (["--quick"] if args.quick else []), {"workload": name})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models (about a minute)")
    parser.add_argument("--workloads", default="A,compare,D", help="comma-separated: A, compare, D")
    parser.add_argument(
        "--budgets", default="0.8,0.6,0.4", help="fractions of the modelled no-offload peak"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--json", help="write all figures as JSON")
    parser.add_argument("--markdown", help="write the tables as Markdown")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    fractions = [float(f) for f in args.budgets.split(",")]
    if args.one:
        print(json.dumps(_run(args.one, args.quick, fractions, args.steps), default=str))
        return 0
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if "D" in names:
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            print("megatron.core does not import: workload D skipped", file=sys.stderr)
            names.remove("D")
    device = torch.cuda.get_device_name()
    results: list[dict] = []
    for name in names:
        print(f"plan benchmark: workload {name}", file=sys.stderr, flush=True)
        results.append(_isolated(name, args))
        md = _markdown(results, device)
        write_reports(args.json, args.markdown, device, results, md, quick=args.quick)
    print(_markdown(results, device))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
