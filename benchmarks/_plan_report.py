"""The tables ``plan.py`` prints: per workload, each plan's modelled and measured step and
peak beside the fastest single method, from the results it records."""

from __future__ import annotations

import datetime
import statistics

import torch

from cpu_offload.plan.search import LETTERS

__all__ = ["markdown", "pace_text", "whole_letters"]


def pace_text(factor: float | None, scale: float | None = None) -> str:
    """The profile's pace factor (NOTE [A GPU at its power limit]) and its scale of
    recomputation (NOTE [Recomputation at the pace of steady training]), where recorded."""
    text = "" if factor is None else f"; device times scaled by {factor:.3f} to steady pace"
    if scale is not None:
        text += f", recomputation by {scale:.3f}"
    return text


def whole_letters(choices: tuple) -> str:  # type: ignore[type-arg]
    """``K``/``O``/``R``/``C`` per layer of a whole-layer plan."""
    return "".join(LETTERS[c] for c in choices)


def _parts_text(parts: dict[str, dict[str, str]]) -> str:
    """The layers planned part by part, those alike together: ``layers 0-3: core recompute``."""
    groups: dict[str, list[int]] = {}
    for j, choices in parts.items():
        text = ", ".join(f"{name} {c}" for name, c in choices.items()) or "all kept"
        groups.setdefault(text, []).append(int(j))
    return "; ".join(
        f"layers {','.join(map(str, js))}: {text}"
        for text, js in sorted(groups.items(), key=lambda g: g[1])
    )


def _calm_text(row: dict, singles: dict) -> str:
    """The plan's figures over the rounds its host probe read calm."""
    if row["calm_ms"] is None:
        return "no calm round"
    text = f"{row['calm_ms']:.1f} ({row['calm_rounds']}), {row['model_step_error_calm']:+.1%}"
    best = row["best_single_calm"]
    if best is not None:
        text += (
            f", {best} ({singles[best]['calm_ms']:.1f}, {singles[best]['calm_rounds']}), "
            f"{row['speedup_vs_best_single_calm']:.2f}x"
        )
    missing = row.get("singles_without_calm_round", 0)
    return text + (f"; {missing} method(s) at <= peak without a calm round" if missing else "")


def _calm_host_text(row: dict) -> str:
    """The plan's model error (against the median) with the host's times of the calm
    rounds only, where modelled."""
    error = row.get("model_step_error_calm_host")
    return "" if error is None else f" [{error:+.1%}]"


def _spread(round_medians: list[float]) -> float:
    """How far a configuration's rounds lie apart: (slowest - fastest) / median."""
    return (max(round_medians) - min(round_medians)) / statistics.median(round_medians)


def markdown(
    results: list[dict], device: str, rounds: int, steps: int, warmup: int, warmup_s: float = 0.0
) -> str:
    """The Markdown of ``results`` (``plan.py``'s JSON ``results``), measured as the
    other arguments say."""
    gib = 2**30
    out = [
        f"Measured {datetime.date.today().isoformat()} on {device}, torch {torch.__version__}; "
        f"median over {rounds} rounds that take the configurations in turn, each the median "
        f"of {steps} steps after {warmup} and {warmup_s:g} s of untimed steps back to back "
        "(timed without CUBLAS_WORKSPACE_CONFIG and "
        "deterministic algorithms, as users train); "
        "peak of torch.cuda.max_memory_allocated (the first step's for the model "
        "error, before any tightening by the budget check); budgets are fractions of the "
        "measured peak without a plan; exact: the first step's loss and every gradient "
        "bit-identical to no plan.",
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
            f"{res['none']['modelled'][0]:.1f} ms, {res['none']['modelled'][1] / gib:.2f} GiB"
            + pace_text(res.get("pace_factor"), res.get("recompute_scale"))
            + ")",
            "",
            "| budget GiB | plan | modelled ms / GiB | measured ms / GiB | spread of the rounds "
            "| model error step (fastest round) [calm host's model] / peak | exact | best single method at <= peak | its ms / GiB "
            "| plan speedup | calm rounds: plan ms (rounds), model error, best single (ms, rounds), speedup |",
            "|---:|---|---:|---:|---:|---:|---|---|---:|---:|---|",
        ]
        for r in res["rows"]:
            if "error" in r:
                out.append(f"| {r['budget_bytes'] / gib:.2f} | {r['error']} | | | | | | | | | |")
                continue
            best = r["best_single_measured"]
            plan = r["plan"]
            if r["final_plan"] != plan:
                plan += f" (tightened to {r['final_plan']})"
            out.append(
                f"| {r['budget_bytes'] / gib:.2f} | {plan} | {r['modelled'][0]:.1f} / "
                f"{r['modelled'][1] / gib:.2f} | {r['measured'][0]:.1f} / "
                f"{r['measured'][1] / gib:.2f}{'' if r['within_budget'] else ' (over)'} | "
                f"{_spread(r['round_medians_ms']):.1%} | "
                f"{r['model_step_error']:+.1%} ({r['model_step_error_fastest']:+.1%})"
                f"{_calm_host_text(r)} / {r['model_peak_error']:+.1%} | "
                f"{'yes' if r['exact'] else 'NO'} | {r['best_single'] or '-'} | "
                + ("-" if best is None else f"{best[0]:.1f} / {best[1] / gib:.2f}")
                + " | "
                + (
                    "-"
                    if r["speedup_vs_best_single"] is None
                    else f"{r['speedup_vs_best_single']:.2f}x"
                )
                + f" | {_calm_text(r, res['singles'])} |"
            )
        for r in res["rows"]:
            if r.get("parts"):
                out += ["", f"Plan {r['plan']} part by part: {_parts_text(r['parts'])}."]
        out.append("")
    return "\n".join(out)
