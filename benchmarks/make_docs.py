"""Regenerate the measured figures in ``docs/`` from the benchmarks' outputs.

    python benchmarks/make_docs.py

rewrites the tables of ``docs/choosing.md`` (between its ``<!-- BEGIN generated: ... -->``
and ``<!-- END generated: ... -->`` comments) from the newest results in
``benchmarks/results/``: ``activation-*.json`` (workloads A and B, from
``activation_offload.py --json``) and ``optimizer-*.json`` (workload C, from
``optimizer_offload.py --json``; full-size runs are preferred over shrunk ones). With the
benchmarks' printed outputs it also assembles ``docs/benchmarks.md``:

    python benchmarks/activation_offload.py --markdown activation.md --json activation.json
    python benchmarks/optimizer_offload.py > optimizer.md
    python benchmarks/make_docs.py --activation activation.md --optimizer optimizer.md

Each input carries its date, device and PyTorch version, and every figure on the pages
comes from an input, so the pages are regenerated from measurements rather than edited.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parent.parent
GIB = 1024**3

HEADER = """# Benchmarks

All figures on this page were measured by the scripts in `benchmarks/`, every variant of a
table in one process, on the same layers and batch, one after the other; ratios are
against the no-offloading run of the same table. Regenerate the page on your machine with:

```
python benchmarks/activation_offload.py --markdown activation.md --json activation.json
python benchmarks/optimizer_offload.py > optimizer.md
cpu-offload compare --plot docs/compare-timeline.png > compare.txt
python benchmarks/make_docs.py --activation activation.md --optimizer optimizer.md \
    --compare compare.txt --compare-plot compare-timeline.png
```

Step times vary from run to run by a few percent on the same machine (the copies share
the PCIe link and host memory with everything else); compare ratios within one table,
not across tables.

## Activation offloading (workloads A and B)

GPT-style blocks (LayerNorm, qkv projection, causal SDPA, projection, LayerNorm, 4h MLP
with GELU) in bf16. A: h=4096, 32 heads, batch 2, sequence 4096, 16 layers. B: h=2048, 16
heads, batch 4, sequence 2048, 24 layers. k layers are offloaded (V2, V1) or
checkpointed / saved with `save_on_cpu` (the first k in every case).

How to read the tables:

- *peak MiB* is the largest `torch.cuda.max_memory_allocated` above the start of the step,
  with the gradients already allocated (as with `zero_grad(set_to_none=False)`), so it is
  the activation peak of each variant.
- *D2H / H2D GB/s* is the bandwidth of the offload and reload copies, from CUDA events
  around each copy; the pinned-copy line above each table is a plain 256 MiB copy
  measured in the same run.
- *stall ms* is the time the compute stream waited for copies in one step.
- The *transfer-bound floor* is the step time the default schedule reaches with this
  run's per-layer compute times and link bandwidth, from the timeline model
  `cpu_offload.compare.simulate`: no schedule of this kind can do better, and V2 should be
  within 3% of it.
- *reference x none* are step-time ratios measured on an H100 PCIe Gen5 with torch 2.11
  before this package existed, for `torch.utils.checkpoint`,
  `torch.autograd.graph.save_on_cpu` and torchtune's `OffloadActivations` (not run here).
- `v1-async-db` is V1's asynchronous handler with double buffering.

"""

COMPARE = """
## The comparison tool's default model

`cpu-offload compare` with its defaults on the GPU (GPT blocks, h=2048, 16 heads, sequence
2048, batch 2, 8 layers, 2 offloaded, bf16, deterministic kernels): a model small enough
that per-layer overheads show. The output as printed:

"""

OPTIMIZER = """
## Optimizer offloading (workload C)

`HybridDeviceOptimizer` against Megatron's reference ratios (Megatron's HybridDeviceOptimizer,
measured on an H100 80GB HBM3 with 16 host cores, whose fused host AdamW ran at 4.9 G
parameters/s). Rows without a suffix use the defaults: gradients widened to fp32 and
parameters narrowed on the GPU, so the host only steps. "bf16 transfers" rows send both
in bf16 and convert on the host (`grad_copy_dtype="param"`, `param_copy_dtype="param"`).

The host sets the pace: the offloaded part cannot finish before backward plus the host
AdamW over its parameters, so the step time scales with the host's own AdamW speed (the
last table). On lent machines of the same kind that speed varied from run to run and
machine to machine (3.1 to 4.8 G parameters/s for the same 64 M-element step), so compare
our ratios with Megatron's knowing the host they ran on.

"""


# ---------------------------------------------------------------------- docs/choosing.md


def _newest(
    folder: Path,
    pattern: str,
    date_of: Callable[[dict[str, Any]], str],
    full: Callable[[dict[str, Any]], bool],
) -> tuple[Path, dict[str, Any]]:
    """The newest result file matching ``pattern``: full-size runs first, then by date."""
    found = []
    for path in sorted(folder.glob(pattern)):
        data = json.loads(path.read_text())
        found.append(((full(data), date_of(data), path.name), path, data))
    if not found:
        raise SystemExit(f"make_docs: no {pattern} in {folder}: run the benchmark with --json")
    _, path, data = max(found, key=lambda item: item[0])
    return path, data


def _source(path: Path, date: str, device: str, torch_version: str, extra: str = "") -> str:
    rel = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
    return f"Measured {date[:10]} on {device}, torch {torch_version}{extra} (`{rel.as_posix()}`)."


def _x(value: float) -> str:
    return f"{value:.2f}x"


class _Activation:
    """Workloads A and B: one entry per (workload, k), as activation_offload.py wrote them."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data
        self.entries = data["results"]

    def source(self) -> str:
        return _source(self.path, self.data["date"], self.data["device"], self.data["torch"])

    @staticmethod
    def name(entry: dict[str, Any]) -> str:
        return f"{entry['workload']}, k={entry['k']} of {entry['n']}"

    @staticmethod
    def cost_per_gib(entry: dict[str, Any], variant: str) -> float:
        """Step time added per GiB of activation peak removed (ms/GiB)."""
        none, row = entry["rows"]["none"], entry["rows"][variant]
        freed = (none["peak_mib"] - row["peak_mib"]) / 1024
        return (row["step_ms"] - none["step_ms"]) / freed if freed > 0 else float("inf")

    def table(self) -> str:
        def cell(row: dict[str, Any]) -> str:
            return f"{_x(row['step_ratio'])} / {row['peak_mib']:,.0f} MiB"

        lines = [
            "| workload, offloaded layers | no offloading: step / activation peak "
            "| V2 offloading: step / peak | V1 (async): step / peak "
            "| checkpointing: step / peak | `save_on_cpu`: step / peak |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for e in self.entries:
            rows = e["rows"]
            none = rows["none"]
            lines.append(
                f"| {self.name(e)} | {none['step_ms']:.0f} ms / {none['peak_mib']:,.0f} MiB "
                f"| {cell(rows['v2'])} | {cell(rows['v1-async'])} | {cell(rows['checkpoint'])} "
                f"| {cell(rows['save_on_cpu'])} |"
            )
        return "\n".join([*lines, "", self.source()])


class _Optimizer:
    """Workload C: one row per configuration, as optimizer_offload.py wrote them."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data
        self.meta = data["meta"]
        self.rows = data["rows"]
        self.base = next(r for r in self.rows if r["offload_fraction"] == 0.0)

    def source(self) -> str:
        m = self.meta
        w = m["workload"]
        size = "" if w.get("full_size", True) else "; a SHRUNK run, not workload C's size"
        extra = f", {m['host_cores']} host cores{size}"
        return _source(self.path, m["date"], m["device"], m["torch"], extra)

    def fractions(self) -> list[float]:
        return sorted({r["offload_fraction"] for r in self.rows if r["offload_fraction"] > 0})

    def fastest(self, fraction: float) -> dict[str, Any]:
        return min(
            (r for r in self.rows if r["offload_fraction"] == fraction), key=lambda r: r["step_ms"]
        )

    def cost_per_gib(self, row: dict[str, Any]) -> float:
        """Step time added per GiB of optimizer state moved off the GPU (ms/GiB)."""
        freed = (self.base["device_state_bytes"] - row["device_state_bytes"]) / GIB
        return (row["step_ms"] - self.base["step_ms"]) / freed if freed > 0 else float("inf")

    def table(self) -> str:
        lines = [
            "| configuration | step ms | x no offloading | GPU optimizer state GiB "
            "| GPU peak GiB | host step ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in self.rows:
            lines.append(
                f"| {r['label']} | {r['step_ms']:.1f} | {_x(r['step_ms'] / self.base['step_ms'])} "
                f"| {r['device_state_bytes'] / GIB:.2f} | {r['peak_allocated_bytes'] / GIB:.2f} "
                f"| {r['host_step_ms']:.1f} |"
            )
        w = self.meta["workload"]
        model = (
            f"{w['blocks']} MLP blocks, h={w['hidden']}, {w['parameters'] / 1e9:.3g} B "
            f"parameters in bf16, {w['tokens']} tokens, AdamW on fp32 master copies; "
            f"medians of {w['steps']} steps."
        )
        return "\n".join([*lines, "", model + " " + self.source()])


def _decision_table(act: _Activation, opt: _Optimizer) -> str:
    """The quick-decision table, its last column filled from the measurements."""
    state0 = opt.base["device_state_bytes"] / GIB
    fractions = opt.fractions()
    fastest = {f: opt.fastest(f) for f in fractions}

    def opt_cost(f: float) -> str:
        r = fastest[f]
        return (
            f"{f:g}: {r['device_state_bytes'] / GIB:.1f} GiB at "
            f"{_x(r['step_ms'] / opt.base['step_ms'])}"
        )

    def act_cost(e: dict[str, Any], variant: str = "v2") -> str:
        none, row = e["rows"]["none"], e["rows"][variant]
        return (
            f"{e['workload']} k={e['k']}/{e['n']}: {none['peak_mib'] / 1024:.1f} -> "
            f"{row['peak_mib'] / 1024:.1f} GiB at {_x(row['step_ratio'])}"
        )

    full = max(fractions)
    pp = (
        f"C: all {state0:.1f} GiB of optimizer state off the GPU at "
        f"{_x(fastest[full]['step_ms'] / opt.base['step_ms'])} ({fastest[full]['label']})"
    )
    activation = "; ".join(act_cost(e) for e in act.entries)
    tunable = (
        f"C, state left on the GPU: no offloading {state0:.1f} GiB; "
        + "; ".join(opt_cost(f) for f in fractions)
        + " (the fastest configuration of each fraction)"
    )
    best_act = min(
        ((e, v) for e in act.entries for v in ("v2", "v1-async")),
        key=lambda ev: ev[0]["rows"][ev[1]]["step_ratio"],
    )
    best_opt = min(fastest.values(), key=lambda r: r["step_ms"])
    throughput = (
        f"cheapest measured: activation {_x(best_act[0]['rows'][best_act[1]]['step_ratio'])} "
        f"({best_act[1]}, {best_act[0]['workload']} k={best_act[0]['k']}), optimizer "
        f"{_x(best_opt['step_ms'] / opt.base['step_ms'])} ({best_opt['label']})"
    )
    per_gib_opt = ", ".join(f"{f:g}: {opt.cost_per_gib(fastest[f]):.0f}" for f in fractions)
    per_gib_act = ", ".join(
        f"{e['workload']} k={e['k']}: {act.cost_per_gib(e, 'v2'):.0f}" for e in act.entries
    )
    moderate = f"ms of step time per GiB freed: optimizer fraction {per_gib_opt}; V2 {per_gib_act}"
    gap = max(
        act.entries,
        key=lambda e: e["rows"]["v2"]["step_ratio"] - e["rows"]["checkpoint"]["step_ratio"],
    )
    recompute = (
        f"{gap['workload']} k={gap['k']}/{gap['n']}: checkpointing "
        f"{_x(gap['rows']['checkpoint']['step_ratio'])} at "
        f"{gap['rows']['checkpoint']['peak_mib'] / 1024:.1f} GiB, V2 "
        f"{_x(gap['rows']['v2']['step_ratio'])} at {gap['rows']['v2']['peak_mib'] / 1024:.1f} GiB"
    )
    rows = [
        (
            "The model needs pipeline parallelism (PP > 1), e.g. a large MoE model",
            "Optimizer offloading: Megatron's activation offloading requires PP=1",
            pp,
        ),
        (
            "PP=1 fits and activations take most of the GPU memory",
            "Activation offloading (V2), while its copies fit under the layers' compute",
            activation,
        ),
        (
            "You want to trade memory for speed a step at a time",
            "Optimizer offloading: `optimizer.optimizer_offload_fraction` between 0 and 1",
            tunable,
        ),
        (
            "Step time matters more than memory",
            "Neither: both add copies (and host work) to every step",
            throughput,
        ),
        (
            "Memory is only moderately short",
            "The kind that frees a GiB for the least step time on your model: offload "
            "a few layers, or a small fraction of the optimizer state",
            moderate,
        ),
        (
            "Activations are large against the layers' compute",
            "Try activation checkpointing too: recomputing can cost less than copying",
            recompute,
        ),
        (
            "CUDA graphs are needed",
            "Optimizer offloading; activation offloading only inside one full-iteration "
            'graph (`cuda_graph_impl="full_iteration"`), not with per-layer graphs',
            "not measured here",
        ),
    ]
    lines = ["| situation | choose | what it cost in our measurements |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    sources = [s[0].lower() + s[1:] for s in (act.source(), opt.source())]
    lines += ["", f"Workloads A and B: {sources[0]} Workload C: {sources[1]}"]
    return "\n".join(lines)


def _fill(text: str, blocks: dict[str, str], where: Path) -> str:
    """Replace each generated block of ``text`` by its new content."""
    for name, body in blocks.items():
        pattern = re.compile(
            rf"(<!-- BEGIN generated: {name} [^>]*-->).*?(<!-- END generated: {name} -->)",
            re.S,
        )
        if not pattern.search(text):
            raise SystemExit(
                f"make_docs: {where} has no '<!-- BEGIN generated: {name} ... -->' / "
                f"'<!-- END generated: {name} -->' pair"
            )
        text = pattern.sub(lambda m, body=body: f"{m.group(1)}\n{body}\n{m.group(2)}", text)
    return text


def write_choosing(results: Path, out: Path) -> None:
    """Regenerate the measured tables of ``docs/choosing.md`` from ``results``."""
    act = _Activation(*_newest(results, "activation-*.json", lambda d: d["date"], lambda d: True))
    opt = _Optimizer(
        *_newest(
            results,
            "optimizer-*.json",
            lambda d: d["meta"]["date"],
            lambda d: bool(d["meta"]["workload"].get("full_size", True)),
        )
    )
    blocks = {
        "decision": _decision_table(act, opt),
        "activation": act.table(),
        "optimizer": opt.table(),
    }
    out.write_text(_fill(out.read_text(), blocks, out))
    print(f"wrote {out} (from {act.path.name} and {opt.path.name})")


# ---------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--activation",
        help="markdown from activation_offload.py (with it, docs/benchmarks.md is written)",
    )
    parser.add_argument("--optimizer", help="markdown printed by optimizer_offload.py")
    parser.add_argument("--compare", help="text printed by cpu-offload compare")
    parser.add_argument("--compare-plot", help="its --plot picture, relative to docs/")
    parser.add_argument("--out", default=str(ROOT / "docs/benchmarks.md"))
    parser.add_argument(
        "--results",
        default=str(ROOT / "benchmarks/results"),
        help="folder of the benchmarks' JSON results (default benchmarks/results)",
    )
    parser.add_argument(
        "--choosing",
        default=str(ROOT / "docs/choosing.md"),
        help="the page whose generated tables are rewritten (default docs/choosing.md)",
    )
    args = parser.parse_args()
    write_choosing(Path(args.results), Path(args.choosing))
    if args.activation is None:
        if args.optimizer or args.compare:
            parser.error(
                "--optimizer and --compare go into docs/benchmarks.md: give --activation too"
            )
        return 0
    text = HEADER + Path(args.activation).read_text().strip() + "\n"
    if args.compare:
        table = Path(args.compare).read_text().strip()
        text += COMPARE + "```\n" + table + "\n```\n"
        if args.compare_plot:
            text += f"\n![timeline of one step]({args.compare_plot})\n"
    if args.optimizer:
        body = Path(args.optimizer).read_text()
        # The optimizer benchmark's own title is replaced by this page's section title.
        # So is its closing "wrote PATH" line, which names a path on the measuring machine.
        body = "\n".join(
            line
            for line in body.splitlines()
            if not line.startswith("# ") and not line.startswith("wrote ")
        )
        text += OPTIMIZER + body.strip() + "\n"
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
