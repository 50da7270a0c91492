"""Assemble ``docs/benchmarks.md`` from the outputs of the two benchmarks.

    python benchmarks/activation_offload.py --markdown activation.md --json activation.json
    python benchmarks/optimizer_offload.py > optimizer.md
    python benchmarks/make_docs.py --activation activation.md --optimizer optimizer.md

Each input already carries its date, device and PyTorch version; this script adds the
commands and the reading guide around them, so that the page is always regenerated from
measurements rather than edited by hand.
"""

from __future__ import annotations

import argparse
from pathlib import Path

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
- *reference x none* are the ratios measured before this package existed, on an H100
  PCIe before this package existed, for `torch.utils.checkpoint`, `torch.autograd.graph.save_on_cpu` and
  torchtune's `OffloadActivations` (not run here).
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

`HybridDeviceOptimizer` against Megatron's reference ratios (Megatron's HybridDeviceOptimizer, measured on
an H100 80GB HBM3 with 16 host cores). "fp32 back" rows copy the updated fp32 master
weights back and narrow them on the GPU; the other rows narrow on the host and copy bf16.

"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--activation", required=True, help="markdown from activation_offload.py")
    parser.add_argument("--optimizer", help="markdown printed by optimizer_offload.py")
    parser.add_argument("--compare", help="text printed by cpu-offload compare")
    parser.add_argument("--compare-plot", help="its --plot picture, relative to docs/")
    parser.add_argument("--out", default=str(Path(__file__).parent.parent / "docs/benchmarks.md"))
    args = parser.parse_args()
    text = HEADER + Path(args.activation).read_text().strip() + "\n"
    if args.compare:
        table = Path(args.compare).read_text().strip()
        text += COMPARE + "```\n" + table + "\n```\n"
        if args.compare_plot:
            text += f"\n![timeline of one step]({args.compare_plot})\n"
    if args.optimizer:
        body = Path(args.optimizer).read_text()
        # The optimizer benchmark's own title is replaced by this page's section title.
        body = "\n".join(line for line in body.splitlines() if not line.startswith("# "))
        text += OPTIMIZER + body.strip() + "\n"
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
