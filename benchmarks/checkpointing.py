"""Offloading beside a model's own activation checkpointing: a transformers Llama.

A Llama built from a config, with ``gradient_checkpointing_enable(use_reentrant=False)``:
its checkpoint keeps each decoder layer's input and recomputes the rest. Measured in one
process, alternating, ``--repeats`` times each, on the same weights and batch:

* ``checkpoint``: the model's checkpointing alone;
* ``checkpoint + hf offload``: transformers' own ``offload=True``, which moves the
  checkpointed inputs to pinned host memory with ``save_on_cpu`` (on the compute stream);
* ``checkpoint + offload_layers k``: :func:`cpu_offload.offload_layers` with ``k`` layers,
  which moves the same inputs on its own stream, asynchronously.

Every variant's loss and gradients must be bit-identical to checkpointing alone (checked
with deterministic kernels on the first step of each repeat); the timed steps run as users
train, without ``CUBLAS_WORKSPACE_CONFIG`` (``_report.timed_as_users_train``). Two
configurations by default: the one of
the issue that measured offloading's old cost beside checkpointing (h 2048, 8 layers,
seq 2048, batch 4), and a long sequence over many layers, where the checkpointed inputs
are a large part of the peak.

    python benchmarks/checkpointing.py --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import statistics
import sys

import torch
from _models import LLAMA_VOCAB, llama
from _report import bit_identical, exact, run_isolated, timed_as_users_train, write_reports

CONFIGS = {
    "h2048-L8-s2048-b4": dict(hidden=2048, layers=8, seq=2048, batch=4),
    "h1024-L32-s16384-b1": dict(hidden=1024, layers=32, seq=16384, batch=1),
}


def _run(name: str, steps: int, repeats: int) -> dict:
    import cpu_offload

    dims = CONFIGS[name]
    model = llama(dims["hidden"], dims["layers"], dims["seq"])
    n = dims["layers"]
    ids = torch.randint(0, LLAMA_VOCAB, (dims["batch"], dims["seq"]), device="cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    hf_offload = "offload" in inspect.signature(model.gradient_checkpointing_enable).parameters

    def configure(variant: str):  # type: ignore[no-untyped-def]
        kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
        if variant == "checkpoint + hf offload":
            kwargs["offload"] = True
        model.gradient_checkpointing_enable(**kwargs)
        if variant.startswith("checkpoint + offload_layers"):
            return cpu_offload.offload_layers(model, int(variant.rsplit(" ", 1)[1]))
        return None

    def step() -> torch.Tensor:
        for p in params:
            p.grad.zero_()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    variants = ["checkpoint"]
    if hf_offload:
        variants.append("checkpoint + hf offload")
    variants += [f"checkpoint + offload_layers {k}" for k in (n // 2, n - 1)]
    times: dict[str, list[float]] = {v: [] for v in variants}
    peaks: dict[str, int] = dict.fromkeys(variants, 0)
    same: dict[str, bool] = {}
    reference = None
    for _ in range(repeats):
        for variant in variants:
            handle = configure(variant)
            with exact():  # warm-up, and the numerics
                loss = step()
            grads = [p.grad.clone() for p in params]
            if reference is None:
                reference = (loss, grads)
            elif variant not in same:
                same[variant] = bit_identical((loss, grads), reference)
            del grads
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with timed_as_users_train():
                for _ in range(steps):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    torch.cuda.synchronize()
                    times[variant].append(start.elapsed_time(end))
            peaks[variant] = max(peaks[variant], torch.cuda.max_memory_allocated())
            if handle is not None:
                handle.remove()
    base = statistics.median(times["checkpoint"])
    rows = {
        v: {
            "step_ms": statistics.median(times[v]),
            "step_ratio": statistics.median(times[v]) / base,
            "peak_bytes": peaks[v],
            "peak_ratio": peaks[v] / peaks["checkpoint"],
            "exact": same.get(v, True),
        }
        for v in variants
    }
    return {
        "config": name,
        "dims": dims,
        "input_bytes": dims["batch"] * dims["seq"] * dims["hidden"] * 2,
        "rows": rows,
        "hf_offload": hf_offload,
    }


def _markdown(results: list[dict], device: str) -> str:
    import transformers

    out = [
        f"Measured {datetime.date.today().isoformat()} on {device}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; bf16, median step of every repeat "
        "(alternating), peak of torch.cuda.max_memory_allocated.",
        "",
    ]
    for res in results:
        if "error" in res:
            out += [f"{res['config']}: {res['error']}", ""]
            continue
        d = res["dims"]
        out += [
            f"#### Llama h {d['hidden']}, {d['layers']} layers, seq {d['seq']}, batch {d['batch']} "
            f"(each checkpointed input {res['input_bytes'] / 2**20:.0f} MiB)",
            "",
            "| variant | step ms | x checkpoint | peak GiB | x checkpoint | bit-identical |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for name, r in res["rows"].items():
            out.append(
                f"| {name} | {r['step_ms']:.1f} | {r['step_ratio']:.3f} | "
                f"{r['peak_bytes'] / 2**30:.3f} | {r['peak_ratio']:.3f} | "
                f"{'yes' if r['exact'] else 'NO'} |"
            )
        out.append("")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    if args.one:
        print(json.dumps(_run(args.one, args.steps, args.repeats)))
        return 0
    device = torch.cuda.get_device_name()
    results = []
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        if name not in CONFIGS:
            parser.error(f"--configs: unknown {name!r}; choose from {', '.join(CONFIGS)}")
        print(f"checkpointing benchmark: {name}", file=sys.stderr, flush=True)
        argv = ["--one", name, "--steps", str(args.steps), "--repeats", str(args.repeats)]
        results.append(run_isolated(__file__, argv, {"config": name}))
        md = _markdown(results, device)
        write_reports(args.json, args.markdown, device, results, md)
    print(md)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
