"""Activation-offloading benchmark: workloads A and B of the spec, side by side.

For each workload and k it runs, in one process and on the same layers and batch: no
offloading, V2's default schedule, V1's asynchronous handler, ``save_on_cpu`` and
activation checkpointing of the same k layers; and it computes the transfer-bound floor
of the default schedule from the measured per-layer compute and the measured link.

    python benchmarks/activation_offload.py --json out.json --markdown out.md
    python benchmarks/activation_offload.py --small   # a one-minute version

Targets (checked and printed): V2 within 3% of the floor; offload and reload
bandwidth at least 90% of the pinned copy measured in the same run; V2's activation peak
at most (n-k)/n of no offloading plus one layer; V2 faster than save_on_cpu.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict

import torch
from _report import run_isolated, write_reports

from cpu_offload.compare.runner import CompareConfig, run_compare
from cpu_offload.models import ModelSpec

WORKLOADS = {
    "A": dict(hidden=4096, heads=32, batch=2, seq=4096, layers=16),
    "B": dict(hidden=2048, heads=16, batch=4, seq=2048, layers=24),
}
SMALL = {"A-small": dict(hidden=1024, heads=8, batch=2, seq=1024, layers=8)}
VARIANTS = ("v2", "v1-async", "v1-async-db", "save_on_cpu", "checkpoint")
#: Measured before the project on an H100 PCIe (SPEC.md section 7): step-time ratios.
REFERENCE = {
    ("A", 4): {"checkpoint": 1.07, "save_on_cpu": 1.74, "torchtune": 3.51},
    ("A", 8): {"checkpoint": 1.12, "save_on_cpu": 2.54, "torchtune": 6.64},
    ("B", 6): {"checkpoint": 1.08, "save_on_cpu": 2.20, "torchtune": 6.10},
    ("B", 12): {"checkpoint": 1.13, "save_on_cpu": 3.44, "torchtune": 11.18},
}


def _run(name: str, dims: dict, k: int, steps: int) -> dict:
    spec = ModelSpec(kind="gpt", dtype=torch.bfloat16, **dims)
    config = CompareConfig(
        spec=spec,
        num_offloaded=k,
        variants=VARIANTS,
        steps=steps,
        warmup=2,
        deterministic=False,
        device="cuda",
    )
    report = run_compare(
        config, lambda m: print(f"  {name} k={k}: {m}", file=sys.stderr, flush=True)
    )
    none = report.result("none")
    n = spec.layers
    per_layer = none.peak_bytes / n
    rows = {}
    for r in report.results:
        rows[r.name] = {
            "step_ms": r.step_ms,
            "step_ratio": r.step_ms / none.step_ms,
            "peak_mib": r.peak_bytes / 2**20,
            "peak_ratio": r.peak_bytes / none.peak_bytes,
            "offload_gbps": r.offload_gbps,
            "reload_gbps": r.reload_gbps,
            "stall_ms": r.stall_ms,
            "max_loss_diff": r.max_loss_diff,
            "max_grad_diff": r.max_grad_diff,
        }
    v2 = report.result("v2")
    floor = report.floor_ms["v2"]
    link = min(report.link_d2h_gbps, report.link_h2d_gbps)
    checks = {
        "v2 within 3% of the floor": v2.step_ms <= 1.03 * floor,
        "offload bandwidth >= 90% of pinned copy": (v2.offload_gbps or 0)
        >= 0.9 * report.link_d2h_gbps,
        "reload bandwidth >= 90% of pinned copy": (v2.reload_gbps or 0)
        >= 0.9 * report.link_h2d_gbps,
        "peak <= (n-k)/n of none + one layer": v2.peak_bytes
        <= (n - k) / n * none.peak_bytes + per_layer,
        "faster than save_on_cpu": v2.step_ms < report.result("save_on_cpu").step_ms,
    }
    return {
        "workload": name,
        "k": k,
        "n": n,
        "rows": rows,
        "floor_ms": floor,
        "floor_duplex_ms": report.floor_ms.get("v2-duplex"),
        "link_gbps": {
            "d2h": report.link_d2h_gbps,
            "h2d": report.link_h2d_gbps,
            "both": report.link_duplex_gbps,
        },
        "noise_floor": [report.noise_floor_loss, report.noise_floor_grad],
        "checks": checks,
        "link_min": link,
        "config": asdict(config.spec) | {"dtype": "bfloat16"},
    }


def _markdown(results: list[dict], device: str) -> str:
    out = [
        f"Measured {datetime.date.today().isoformat()} on {device}, torch {torch.__version__}, "
        "bf16, median of the measured steps, all variants in one process on the same layers.",
        "",
    ]
    for res in results:
        n, k = res["n"], res["k"]
        none = res["rows"]["none"]
        link = res["link_gbps"]
        out += [
            f"#### Workload {res['workload']}, k={k} of {n} "
            f"(no offloading: {none['step_ms']:.1f} ms, {none['peak_mib']:,.0f} MiB peak)",
            "",
            f"Pinned copy in the same run: D2H {link['d2h']:.1f} GB/s, H2D {link['h2d']:.1f} GB/s. "
            f"Transfer-bound floor of the default schedule: {res['floor_ms']:.1f} ms "
            f"({res['floor_ms'] / none['step_ms']:.2f}x).",
            "",
            "| variant | step ms | x none | peak MiB | x none | D2H GB/s | H2D GB/s | stall ms | reference x none |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        ref = REFERENCE.get((res["workload"], k), {})
        for name, row in res["rows"].items():

            def f(v, spec):
                return "-" if v is None else format(v, spec)

            out.append(
                f"| {name} | {row['step_ms']:.1f} | {row['step_ratio']:.2f} | {row['peak_mib']:,.0f} | "
                f"{row['peak_ratio']:.2f} | {f(row['offload_gbps'], '.1f')} | {f(row['reload_gbps'], '.1f')} | "
                f"{f(row['stall_ms'], '.1f')} | {f(ref.get(name), '.2f')} |"
            )
        if "torchtune" in ref:
            out.append(
                f"| torchtune OffloadActivations (reference, not run) | | | | | | | | {ref['torchtune']:.2f} |"
            )
        out += [
            "",
            "Targets: "
            + "; ".join(f"{c}: {'met' if ok else 'NOT met'}" for c, ok in res["checks"].items()),
            "",
        ]
    return "\n".join(out)


def _run_isolated(name: str, k: int, steps: int, small: bool) -> dict:
    argv = ["--one", f"{name}:{k}", "--steps", str(steps)] + (["--small"] if small else [])
    return run_isolated(__file__, argv, {"workload": name, "k": k})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a small workload (about a minute)")
    parser.add_argument("--workloads", default="A,B", help="comma-separated: A, B")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write all figures as JSON")
    parser.add_argument("--markdown", help="write the tables as Markdown")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # NAME:K, run in this process
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    table = SMALL if args.small else WORKLOADS
    if args.one:
        name, k = args.one.split(":")
        print(json.dumps(_run(name, table[name], int(k), args.steps), default=str))
        return 0
    names = list(SMALL) if args.small else [w.strip() for w in args.workloads.split(",")]
    plan = [(name, table[name]["layers"] // d) for name in names for d in (4, 2)]
    device = torch.cuda.get_device_name()
    results: list[dict] = []
    for name, k in plan:
        results.append(_run_isolated(name, k, args.steps, args.small))
        # Written after every workload, so that a run cut short keeps what it measured.
        done = [r for r in results if "error" not in r]
        md = _markdown(done, device)
        md += "".join(
            f"\nWorkload {r['workload']} k={r['k']} failed: {r['error']}\n"
            for r in results
            if "error" in r
        )
        write_reports(args.json, args.markdown, device, results, md)
    print(md)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
