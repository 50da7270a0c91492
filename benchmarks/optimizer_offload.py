"""Workload C of SPEC section 7: optimizer-state offloading against Megatron's reference.

8 residual MLP blocks (h=4096; Linear h->4h, GELU, Linear 4h->h; no bias; 1.07 B
parameters) in bf16 on 8192 tokens, AdamW through fp32 master copies. Measures the
no-offload step (everything on the GPU), HybridDeviceOptimizer at fractions 0.25 / 0.5 /
1.0 with overlap on and off (and, overlapped, with bf16 transfers converted on the host),
the GPU memory of
the optimizer state, and the host ``torch.optim.AdamW`` throughput alone (fused,
foreach, for-loop), and prints a markdown table with Megatron's reference ratios beside
ours. The reference ratios were measured at the full size on an H100 80GB HBM3 with 16
host cores; shrunk runs (``--hidden`` etc.) are for smoke tests only.

With ``--peer PATH`` (Megatron-LM's ``hybrid_optimizer.py``, or a folder holding it),
Megatron's HybridDeviceOptimizer also runs beside ours in the same process, both with
fused ``torch.optim.AdamW`` on each side, timed as whole training iterations back to
back (so that a host step finishing under the next forward is counted where it is
waited for): Megatron's, ours, ours with ``overlap_host_step_with_forward`` and ours
with that and ``offload_last_layers``, and with those and a share of the offloaded state
streamed through the GPU (``stream_share``, ``--stream-shares``), per fraction and overlap
setting; ours with early gradient copies on and off where ``--early-grad-copy both`` asks
for it. Each setting
runs ``--rounds`` rounds that alternate the optimizers; a row is the median of its rounds.

Usage::

    python benchmarks/optimizer_offload.py                      # full workload C
    python benchmarks/optimizer_offload.py --peer .peer --early-grad-copy both
    python benchmarks/optimizer_offload.py --hidden 1024 --blocks 4 --tokens 2048 --steps 3
    python benchmarks/optimizer_offload.py --json results/optimizer_offload.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cpu_offload.optim import measure_host_optimizer_throughput, measure_optimizer

GIB = 1024**3

# Megatron's HybridDeviceOptimizer on workload C (SPEC section 7): step time relative to
# no offloading, overlap on / off, and GPU memory of parameters' optimizer state (GiB).
MEGATRON_RATIO = {0.25: (1.62, 1.88), 0.5: (2.40, 2.83), 1.0: (3.73, 4.86)}
MEGATRON_STATE_GIB = {0.0: 16.1, 0.25: 12.1, 0.5: 8.1, 1.0: 0.06}
MEGATRON_NO_OFFLOAD_MS = 95.0
MEGATRON_HOST_ADAMW = {"fused": 4.9e9, "foreach": 0.84e9, "forloop": 0.76e9}


class Block(torch.nn.Module):
    """One residual MLP block: ``x + fc2(gelu(fc1(x)))``, no biases."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def build_model(hidden: int, blocks: int, device: torch.device) -> torch.nn.Sequential:
    """The workload's model, in bf16 on ``device``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = torch.nn.Sequential(*(Block(hidden) for _ in range(blocks)))
    return model.to(torch.bfloat16)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size h (default 4096)")
    parser.add_argument("--blocks", type=int, default=8, help="MLP blocks (default 8)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (default 8192)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row (default 2)")
    parser.add_argument(
        "--fractions",
        default="0.25,0.5,1.0",
        help="comma-separated offload fractions (default 0.25,0.5,1.0)",
    )
    parser.add_argument(
        "--copy-dtype",
        choices=["master", "param", "both"],
        default="both",
        help="dtype of the gradient and parameter transfers: 'master' (fp32, converted on "
        "the GPU; the default of HybridDeviceOptimizer), 'param' (bf16, converted on the "
        "host), or both (the 'param' rows overlapped only)",
    )
    parser.add_argument(
        "--host-numel",
        type=int,
        default=None,
        help="elements for the host AdamW throughput (default: min(model size, 2^27))",
    )
    parser.add_argument(
        "--host-impls",
        default="fused,foreach,forloop",
        help="host AdamW implementations to time alone (default fused,foreach,forloop)",
    )
    parser.add_argument(
        "--peer",
        type=Path,
        default=None,
        help="Megatron-LM's hybrid_optimizer.py (or a folder holding it): run its "
        "HybridDeviceOptimizer beside ours",
    )
    parser.add_argument(
        "--early-grad-copy",
        choices=["auto", "on", "off", "both"],
        default="auto",
        help="early gradient copies in the side-by-side rows of ours (default auto: the "
        "optimizer's default; both: one row each, to choose per fraction)",
    )
    parser.add_argument(
        "--stream-shares",
        default="0.5",
        help="with --peer: also run ours under forward with the last layers offloaded and "
        "this share of the offloaded state streamed through the GPU (stream_share), one row "
        "per comma-separated share (default 0.5; empty for none)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="with --peer: alternating rounds of every side-by-side row (default 3)",
    )
    parser.add_argument(
        "--megatron-arguments-only",
        action="store_true",
        help="with --peer: of ours, run only the row with Megatron's arguments (more rounds "
        "in the same time, to compare the two classes as a user who switches would)",
    )
    parser.add_argument(
        "--side-by-side-only",
        action="store_true",
        help="with --peer: skip the rows measured step by step and the host AdamW timings",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    for name in ("hidden", "blocks", "tokens", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    args.fraction_list = _shares(parser, "--fractions", args.fractions)
    if args.peer is not None and not args.peer.exists():
        parser.error(f"--peer: {args.peer} does not exist (Megatron-LM's hybrid_optimizer.py)")
    args.stream_share_list = _shares(parser, "--stream-shares", args.stream_shares)
    args.impl_list = [x.strip() for x in args.host_impls.split(",") if x.strip()]
    bad = set(args.impl_list) - {"fused", "foreach", "forloop"}
    if bad:
        parser.error(f"--host-impls: unknown {sorted(bad)}; allowed fused, foreach, forloop")
    return args


def _shares(parser: argparse.ArgumentParser, flag: str, text: str) -> list[float]:
    """Comma-separated numbers in (0, 1] (a parser error naming ``flag`` otherwise)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{flag} must be comma-separated numbers, got {text!r}")
    if any(not 0.0 < v <= 1.0 for v in values):
        parser.error(f"{flag} must lie in (0, 1]")
    return values


def _row(
    label: str, m: Any, base_ms: float, reference: float | None, ref_state: float | None
) -> dict[str, Any]:
    d = m.to_dict()
    d["label"] = label
    d["ratio"] = m.step_ms / base_ms
    d["megatron_ratio"] = reference
    d["state_gib"] = m.device_state_bytes / GIB
    d["megatron_state_gib"] = ref_state
    d["host_params_per_s"] = m.host_numel / (m.host_step_ms / 1e3) if m.host_step_ms > 0 else None
    return d


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the process exit code."""
    args = _parse(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("warning: no CUDA GPU: running on the CPU, for a smoke test only", file=sys.stderr)
    model = build_model(args.hidden, args.blocks, device)
    numel = sum(p.numel() for p in model.parameters())
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=gen, device=device).to(torch.bfloat16)

    def loss_fn(m: torch.nn.Module) -> torch.Tensor:
        return m(x).float().square().mean()

    full_size = (args.hidden, args.blocks, args.tokens) == (4096, 8, 8192)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host_cpu": _cpu_name(),
        "host_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "hidden": args.hidden,
            "blocks": args.blocks,
            "tokens": args.tokens,
            "parameters": numel,
            "steps": args.steps,
            "warmup": args.warmup,
            "full_size": full_size,
        },
    }
    print(f"# Optimizer offloading, workload C ({'full size' if full_size else 'SHRUNK'})\n")
    print(f"- date: {meta['date']}")
    print(f"- device: {meta['device']}; torch {meta['torch']} (CUDA {meta['cuda']})")
    print(
        f"- host: {meta['host_cpu']}, {meta['host_cores']} cores, {meta['torch_threads']} torch threads"
    )
    print(
        f"- model: {args.blocks} blocks, h={args.hidden}, {numel / 1e9:.3g} B parameters (bf16), "
        f"{args.tokens} tokens; AdamW on fp32 master copies; {args.steps} timed steps after "
        f"{args.warmup} warm-up, medians"
    )
    if not full_size:
        print("- Megatron's reference columns are for the full-size workload only")
    print()

    side: list[dict[str, Any]] = []
    if args.peer is not None:
        if not cuda:
            print("error: --peer needs a CUDA GPU (Megatron's optimizer is CUDA-only)")
            return 2
        side = side_by_side(args, device, loss_fn)
        if args.side_by_side_only:
            _write_json(args, {"meta": meta, "side_by_side": side})
            return 0

    kw: dict[str, Any] = {"lr": 1e-4, "weight_decay": 0.01, "param_update_in_fp32": True}
    run = {"steps": args.steps, "warmup": args.warmup, **kw}
    base = measure_optimizer(model, loss_fn, offload_fraction=0.0, **run)
    rows = [_row("no offload", base, base.step_ms, 1.0, MEGATRON_STATE_GIB[0.0])]
    for fraction in args.fraction_list:
        ref = MEGATRON_RATIO.get(fraction, (None, None))
        ref_state = MEGATRON_STATE_GIB.get(fraction)
        first = "param" if args.copy_dtype == "param" else "master"
        variants = [(True, first), (False, first)]
        if args.copy_dtype == "both":
            variants.append((True, "param"))
        for overlap, copy_dtype in variants:
            m = measure_optimizer(
                model,
                loss_fn,
                offload_fraction=fraction,
                overlap_cpu_optimizer_d2h_h2d=overlap,
                param_copy_dtype=copy_dtype,
                grad_copy_dtype=copy_dtype,
                **run,
            )
            label = f"{fraction:g}, overlap {'on' if overlap else 'off'}"
            if copy_dtype == "param":
                label += ", bf16 transfers"
            row = _row(label, m, base.step_ms, ref[0] if overlap else ref[1], ref_state)
            row["grad_copy_dtype"] = copy_dtype
            rows.append(row)

    host_numel = args.host_numel or min(numel, 1 << 27)
    host: dict[str, float] = {}
    for impl in args.impl_list:
        host[impl] = measure_host_optimizer_throughput(
            host_numel, implementation=impl, steps=3, warmup=1, lr=1e-4, weight_decay=0.01
        )

    print(
        "| configuration | step ms | x no-offload | Megatron x | fwd+bwd ms | optimizer ms "
        "| host step ms | host G params/s | GPU state GiB | Megatron GiB | early copies reused |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        host_rate = None if r["host_params_per_s"] is None else r["host_params_per_s"] / 1e9
        print(
            f"| {r['label']} | {r['step_ms']:.1f} | {r['ratio']:.2f}x | "
            f"{_fmt(r['megatron_ratio'], '.2f')}{'x' if r['megatron_ratio'] else ''} | "
            f"{r['forward_backward_ms']:.1f} | {r['optimizer_ms']:.1f} | {r['host_step_ms']:.1f} | "
            f"{_fmt(host_rate, '.2f')} | {r['state_gib']:.2f} | {_fmt(r['megatron_state_gib'], '.2f')} | "
            f"{r['early_copies_reused']:.0f} |"
        )
    print()
    print(
        f"Host torch.optim.AdamW alone on {host_numel / 1e6:.3g} M fp32 elements "
        "(Megatron's reference machine: fused 4.9, foreach 0.84, for-loop 0.76 G params/s):\n"
    )
    print("| implementation | G params/s | reference |")
    print("|---|---:|---:|")
    for impl, rate in host.items():
        print(f"| {impl} | {rate / 1e9:.2f} | {MEGATRON_HOST_ADAMW[impl] / 1e9:.2f} |")
    print(
        f"\nReference no-offload step: {MEGATRON_NO_OFFLOAD_MS:.0f} ms; ours: {base.step_ms:.1f} ms."
    )

    if args.json is not None:
        payload = {
            "meta": meta,
            "side_by_side": side,
            "rows": rows,
            "host_adamw_params_per_s": host,
            "host_adamw_numel": host_numel,
            "reference": {
                "megatron_ratio_overlap_on_off": {str(k): v for k, v in MEGATRON_RATIO.items()},
                "megatron_state_gib": {str(k): v for k, v in MEGATRON_STATE_GIB.items()},
                "megatron_no_offload_ms": MEGATRON_NO_OFFLOAD_MS,
                "megatron_host_adamw_params_per_s": MEGATRON_HOST_ADAMW,
            },
        }
        _write_json(args, payload)
    return 0


def _write_json(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    if args.json is None:
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.json}")


def side_by_side(
    args: argparse.Namespace, device: torch.device, loss_fn: Any
) -> list[dict[str, Any]]:
    """Megatron's HDO and ours on fresh copies of the model, timed the same way."""
    from _peer_hdo import load_peer, time_training

    from cpu_offload.optim import HybridDeviceOptimizer

    peer = load_peer(args.peer)
    common: dict[str, Any] = {
        "cpu_optimizer_cls": torch.optim.AdamW,
        "gpu_optimizer_cls": torch.optim.AdamW,
        "param_update_in_fp32": True,
        "lr": 1e-4,
        "weight_decay": 0.01,
        "fused": True,
    }
    early = {"auto": [None], "on": [True], "off": [False], "both": [True, False]}
    ours_variants: list[tuple[str, dict[str, Any]]] = []
    for e in early[args.early_grad_copy]:
        extra = {} if e is None else {"early_grad_copy": e}
        tag = "" if e is None else f", early copies {'on' if e else 'off'}"
        ours_variants += [
            (f"ours{tag}", {**extra}),
            (
                f"ours, host step under forward{tag}",
                {"overlap_host_step_with_forward": True, **extra},
            ),
            (
                f"ours, under forward, last layers offloaded{tag}",
                {"overlap_host_step_with_forward": True, "offload_last_layers": True, **extra},
            ),
        ]
    for share in args.stream_share_list:
        for e in early[args.early_grad_copy]:
            extra = {} if e is None else {"early_grad_copy": e}
            tag = "" if e is None else f", early copies {'on' if e else 'off'}"
            ours_variants.append(
                (
                    f"ours, under forward, last layers offloaded, {share:g} streamed{tag}",
                    {
                        "overlap_host_step_with_forward": True,
                        "offload_last_layers": True,
                        "stream_share": share,
                        **extra,
                    },
                )
            )
    if args.megatron_arguments_only:
        # Megatron's arguments: none of ours' own options beyond the gradient copies'.
        ours_variants = [(n, e) for n, e in ours_variants if set(e) <= {"early_grad_copy"}]
    rows: list[dict[str, Any]] = []
    settings = [(0.0, True)] + [(f, o) for f in args.fraction_list for o in (True, False)]
    for fraction, overlap in settings:
        kw = {**common, "offload_fraction": fraction, "overlap_cpu_optimizer_d2h_h2d": overlap}
        candidates: list[tuple[str, Any, dict[str, Any]]] = [("Megatron", peer, {})]
        candidates += [(name, HybridDeviceOptimizer, extra) for name, extra in ours_variants]
        if fraction == 0.0:
            candidates = candidates[:2]
        # Rounds alternate the candidates, so that a drift of the host (its memory
        # bandwidth bounds the host step) reaches all of them alike; each round starts
        # one candidate later, so that none always holds the same place in a round.
        per_round: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in candidates}
        for round_index in range(args.rounds):
            shift = round_index % len(candidates)
            for name, cls, extra in candidates[shift:] + candidates[:shift]:
                model = build_model(args.hidden, args.blocks, device)
                params = list(model.parameters())
                result = time_training(
                    model,
                    loss_fn,
                    lambda cls=cls, extra=extra, params=params, kw=kw: cls(params, **kw, **extra),
                    args.steps,
                    args.warmup,
                )
                per_round[name].append(result)
                del model, params
        for name, results in per_round.items():
            times = [r["iteration_ms"] for r in results]
            row = dict(results[-1])
            row.update(
                name=name,
                fraction=fraction,
                overlap=overlap,
                iteration_ms=statistics.median(times),
                round_ms=times,
                peak_allocated_gib=max(r["peak_allocated_gib"] for r in results),
            )
            rows.append(row)
    megatron = {
        (r["fraction"], r["overlap"]): r["iteration_ms"] for r in rows if r["name"] == "Megatron"
    }
    print(
        "Side by side with Megatron's HybridDeviceOptimizer (whole iterations, back to back; "
        f"median of {args.rounds} alternating rounds, each the median of {args.steps} "
        "iterations):\n"
    )
    print(
        "| fraction | overlap | optimizer | iteration ms | / Megatron | rounds ms "
        "| GPU state GiB | peak GiB | checksum |"
    )
    print("|---:|---|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        ratio = r["iteration_ms"] / megatron[(r["fraction"], r["overlap"])]
        print(
            f"| {r['fraction']:g} | {'on' if r['overlap'] else 'off'} | {r['name']} | "
            f"{r['iteration_ms']:.1f} | {ratio:.3f} | "
            f"{' / '.join(f'{t:.1f}' for t in r['round_ms'])} | {r['state_gib']:.2f} | "
            f"{r['peak_allocated_gib']:.2f} | {r['checksum']:.6g} |"
        )
    print()
    return rows


if __name__ == "__main__":
    sys.exit(main())
