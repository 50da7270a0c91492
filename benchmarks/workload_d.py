"""Workload D: this package beside Transformer Engine's offload code, in one process.

Megatron-Core's GPT (local layer spec, 16 layers, h 2048, seq 2048, batch 2, bf16)
offloads its first k layers through its own hooks (``TransformerConfig.cpu_offloading``),
which call ``get_cpu_offload_context`` in Transformer Engine's place
(:func:`cpu_offload.megatron.use_with_megatron_core`). For each k, three models of the
same weights take turns in one process: no offloading, this package's context, and
Transformer Engine's own ``get_cpu_offload_context``. Its code is imported from the folder
that ``te_reference.sh`` builds out of a Transformer Engine checkout (``--te DIR``) and
never enters this repository; without ``--te`` only ours runs beside no offloading.

Each round runs every model for ``--steps`` timed steps, in an order that rotates from
round to round. Reported per model: the median of all its timed steps, the peak of the
step above what was allocated before it (``torch.cuda.max_memory_allocated``; before a
step every model's weights are allocated and no gradients: they are released after each
step, untimed), whether the first step's loss and every gradient equal no offloading bit
for bit (deterministic kernels), and the median over rounds of the ratios
measured *in the same round* (ours / TE, each / no offloading) with their range. A
ratio of medians taken in one round is spared the drift of the link and the host between
processes and, mostly, between rounds: on a lent H100 the pinned host-to-device copy read
44.5 to 55.0 GB/s in six processes of one call.

With ``--budget-te`` a fourth model takes part: our context with ``memory_budget`` set to
the peak Transformer Engine's code reached in its warm-up steps, as a user who moves a job
over from Transformer Engine can give it (NOTE [Bytes that pay] in
``cpu_offload/engine/peak_watch.py``: the offloaded layers keep on the GPU what fits
under the budget and move only the rest).

With ``--margin-shares S,...`` one more model of ours takes part per ``S``: the same
context, whose peak watch leaves ``1/S`` of the peak unused in its byte budgets instead
of the default share (``BUDGET_MARGIN_SHARE``), to compare margins side by side. With
``--without-deferral`` one more takes part whose peak watch defers no release (the
schedule before deferrals, NOTE [Bytes that pay]).

    python benchmarks/workload_d.py --te .te/ref --ks 2,4,8 --json d.json --markdown d.md
    python benchmarks/workload_d.py --te .te/ref --ks 4,8 --margin-shares 128
    python benchmarks/workload_d.py --te .te/ref --ks 2,4,8 --without-deferral
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _models import MEGATRON_VOCAB, init_megatron, megatron_gpt
from _report import (
    bit_identical,
    exact,
    paired_ratios,
    rotated,
    timed_as_users_train,
    write_reports,
)

import cpu_offload
from cpu_offload.compare import measure_link
from cpu_offload.engine.peak_watch import BUDGET_MARGIN_SHARE
from cpu_offload.megatron import use_with_megatron_core

DIMS = dict(layers=16, hidden=2048, heads=16, seq=2048, batch=2)
TE_FILE = Path("_te_ref") / "pytorch" / "cpu_offload.py"
BUDGET_LABEL = "ours, TE's peak as memory_budget"
NO_DEFERRAL_LABEL = "ours, nothing deferred"


def load_te(folder: Path) -> Callable[..., Any]:
    """Transformer Engine's ``get_cpu_offload_context``, from ``te_reference.sh``'s folder.

    The folder goes to the end of ``sys.path``, so that ``cpu_offload`` stays this package
    (the folder's own ``cpu_offload`` stand-in is never imported).

    Raises:
        FileNotFoundError: If ``folder`` holds no ``_te_ref/pytorch/cpu_offload.py``.
    """
    if not (folder / TE_FILE).is_file():
        raise FileNotFoundError(
            f"--te: no {TE_FILE} under {folder}; build it with te_reference.sh TE_GIT_DIR {folder}"
        )
    sys.path.append(str(folder.resolve()))
    module = importlib.import_module("_te_ref.pytorch.cpu_offload")
    te_get = module.get_cpu_offload_context

    def context(
        enabled: bool,
        num_layers: int,
        model_layers: int,
        activations: bool,
        weights: bool,
        double_buffering: bool,
        retain_pinned_cpu_buffers: bool = False,
    ) -> Any:
        # Megatron-Core passes retain_pinned_cpu_buffers seventh; TE has it eighth.
        return te_get(
            enabled,
            num_layers,
            model_layers,
            activations,
            weights,
            double_buffering,
            retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        )

    return context


class Model:
    """One Megatron-Core GPT of the workload, with or without an offload context."""

    def __init__(self, label: str, k: int, context: Callable[..., Any] | None) -> None:
        from megatron.core.transformer import transformer_block

        self.label = label
        transformer_block.get_cpu_offload_context = context  # read once, when the block is built
        self.module, self.loss = megatron_gpt(**DIMS, cpu_offloading_num_layers=k)
        self.times: list[float] = []  # ms, every timed step
        self.rounds: list[float] = []  # ms, the median of each round
        self.peak = 0  # bytes above the allocation before a step, the highest seen
        self.budget = 0  # memory_budget given to our context, if any (bytes)
        self.weights_error = 0  # allocated after building, less what the budget assumed
        self.margin_share: int | None = None  # the peak watch's, where not the default
        self.defer = True  # the peak watch defers releases where room is left

    def synchronizer(self) -> Any:
        """The synchronizer of our context in this model (its decoder's offload context)."""
        for module in self.module.modules():
            sync = getattr(getattr(module, "offload_context", None), "offload_synchronizer", None)
            if sync is not None:
                return sync
        raise RuntimeError(f"{self.label}: no offload context of ours in the model")

    def configure_watch(self) -> None:
        """Give the peak watch (made at the end of the first step) this model's margin
        share and deferral setting, where not the defaults."""
        if self.margin_share is None and self.defer:
            return
        watch = self.synchronizer().peak_watch
        if watch is None:
            raise RuntimeError(f"{self.label}: no peak watch after a step (nothing offloaded?)")
        if self.margin_share is not None:
            watch.margin_share = self.margin_share
        watch.defer = self.defer

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.module.zero_grad(set_to_none=True)
        loss = self.loss(tokens)
        loss.backward()
        return loss.detach()

    def first_step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with exact():
            loss = self.step(tokens)
        grads = [p.grad.clone() for p in self.module.parameters() if p.grad is not None]
        return loss, grads

    def timed(self, tokens: torch.Tensor, steps: int) -> None:
        # The peak statistics are reset before every timed step, as a benchmark of one
        # model would: our context chooses what to keep on the GPU in an iteration that
        # sets a new peak (NOTE [Bytes that pay]), which the models run before it (their
        # peaks are higher) deny it during the warm-up. The gradients go after each step,
        # untimed, so that every step starts from the same allocated memory (the weights
        # of every model): a budget of absolute bytes then means the same for each model.
        ms = []
        for _ in range(steps):
            step_ms, peak = self.measured_step(tokens)
            ms.append(step_ms)
            self.peak = max(self.peak, peak)
        self.times += ms
        self.rounds.append(statistics.median(ms))

    def measured_step(self, tokens: torch.Tensor) -> tuple[float, int]:
        """One step: its milliseconds, and its peak above the memory allocated before it
        (bytes). The gradients are released afterwards, untimed."""
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        self.step(tokens)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        peak = torch.cuda.max_memory_allocated() - before
        self.module.zero_grad(set_to_none=True)
        return ms, peak


def budget_as_te(k: int, te: Model, tokens: torch.Tensor, steps: int, model_bytes: int) -> Model:
    """Our context with ``memory_budget`` at the peak that Transformer Engine's code reached.

    What a user migrating from Transformer Engine can give: the memory the job had. TE's
    peak is the highest of ``steps`` more steps of its model, run after its warm-up. The
    budget is absolute allocated bytes: TE's peak above the memory before its step, plus
    that memory, plus ``model_bytes`` (what building TE's model allocated) for the new
    model's weights. Every model's gradients are released between steps (see
    :meth:`Model.timed`), so each model's steps start from the same memory.
    """
    torch.cuda.synchronize()
    before_te = torch.cuda.memory_allocated()
    peak = max(te.measured_step(tokens)[1] for _ in range(steps))
    budget = before_te + model_bytes + peak  # once the new model's weights are allocated
    with use_with_megatron_core(memory_budget=budget) as handle:
        model = Model(BUDGET_LABEL, k, handle.function)
    torch.cuda.synchronize()
    model.budget = budget
    model.weights_error = torch.cuda.memory_allocated() - (before_te + model_bytes)
    return model


def margin_label(share: int) -> str:
    return f"ours, margin 1/{share}"


def watch_record(model: Model) -> dict[str, Any]:
    """What our peak watch chose for the model's offloaded layers: their byte budgets and
    deferrals (MiB, nonzero), and the layers whose budgets it cut (capped) or whose kept
    view bases it moved again (refused) because a later peak rose inside their windows."""
    watch = model.synchronizer().peak_watch
    if watch is None:
        return {"budgets_mib": {}, "deferrals_mib": {}, "cut": {"capped": [], "refused": []}}

    def mib(per_layer: dict[int, int]) -> dict[int, float]:
        return {layer: b / 2**20 for layer, b in sorted(per_layer.items()) if b}

    return {
        "budgets_mib": mib(watch.budgets),
        "deferrals_mib": mib(watch.deferrals),
        "cut": {"capped": sorted(watch.capped), "refused": sorted(watch.refused)},
    }


def paired(num: Model, den: Model) -> dict[str, float]:
    """The median and range over rounds of ``num``'s round median over ``den``'s."""
    ratios = paired_ratios(num.rounds, den.rounds)
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def run_k(
    k: int,
    none: Model,
    ours_fn: Callable[..., Any],
    te_fn: Callable[..., Any] | None,
    tokens: torch.Tensor,
    want: tuple[torch.Tensor, list[torch.Tensor]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    ours = Model("ours", k, ours_fn)
    variants = []  # ours with other peak-watch settings: a margin share each, no deferral
    for share in args.margin_share_list:
        variants.append(Model(margin_label(share), k, ours_fn))
        variants[-1].margin_share = share
    if args.without_deferral:
        variants.append(Model(NO_DEFERRAL_LABEL, k, ours_fn))
        variants[-1].defer = False
    te: Model | None = None
    te_bytes = 0  # what building one model allocates
    if te_fn is not None:
        torch.cuda.synchronize()
        te_bytes = -torch.cuda.memory_allocated()
        te = Model("te", k, te_fn)
        te_bytes += torch.cuda.memory_allocated()
    models = [none, ours, *variants, *([te] if te is not None else [])]
    exact_ok = {m.label: bit_identical(m.first_step(tokens), want) for m in models[1:]}
    none.times, none.rounds, none.peak = [], [], 0

    def warm_up(m: Model) -> None:
        m.configure_watch()  # its first step (the exactness check) made the peak watch
        for _ in range(args.warmup):
            m.step(tokens)
        m.module.zero_grad(set_to_none=True)

    with timed_as_users_train():
        for m in models:
            warm_up(m)
        # TE's peak is read once its warm-up is done, as users train.
        budgeted: Model | None = None
        if te is not None and args.budget_te:
            budgeted = budget_as_te(k, te, tokens, args.warmup, te_bytes)
    if budgeted is not None:
        exact_ok[budgeted.label] = bit_identical(budgeted.first_step(tokens), want)
        models.append(budgeted)
    with timed_as_users_train():
        if budgeted is not None:
            warm_up(budgeted)
        for r in range(args.rounds):
            for m in rotated(models, r):
                m.timed(tokens, args.steps)
    out: dict[str, Any] = {"k": k, "exact": exact_ok}
    for m in models:
        out[m.label] = {
            "median_ms": statistics.median(m.times),
            "round_medians_ms": m.rounds,
            "peak_gib": m.peak / 2**30,
        }
        if m is not none:
            out[m.label]["x_none"] = paired(m, none)
    for m in [ours, *variants, *([budgeted] if budgeted is not None else [])]:
        out[m.label].update(watch_record(m))
    for m in variants:
        out[m.label]["over_ours"] = paired(m, ours)
        if te is not None:
            out[m.label]["over_te"] = paired(m, te)
    out["margin_shares"] = args.margin_share_list
    out["variants"] = [m.label for m in variants]
    if te is not None:
        out["ours_over_te"] = paired(ours, te)
    if budgeted is not None and te is not None:
        out["budget_gib"] = budgeted.budget / 2**30
        out["budget_weights_error_bytes"] = budgeted.weights_error
        out["ours_budget_over_te"] = paired(budgeted, te)
    # The offloading models (and their host buffers) go with their last references.
    del models, m, budgeted, ours, variants, te
    gc.collect()
    torch.cuda.empty_cache()
    empty_host = getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()  # each k's pinned host buffers differ in size: give them back
    return out


def markdown(
    results: list[dict[str, Any]], device: str, gbps: tuple[float, float, float], te: bool
) -> str:
    lines = [
        f"Measured {datetime.date.today().isoformat()} on {device}, torch {torch.__version__}; "
        f"pinned copy {gbps[0]:.1f} GB/s device to host, {gbps[1]:.1f} host to device, "
        f"{gbps[2]:.1f} both at once.",
        "",
        "| k | no offloading ms | ours ms (x none) | "
        + ("TE ms (x none) | ours / TE (range) | " if te else "")
        + "ours peak GiB | "
        + ("TE peak GiB | " if te else "")
        + "bit-identical |",
        "|---:|---:|---:|"
        + ("---:|---:|" if te else "")
        + "---:|"
        + ("---:|" if te else "")
        + "---|",
    ]
    for r in results:
        row = [str(r["k"]), f"{r['none']['median_ms']:.1f}"]
        row.append(f"{r['ours']['median_ms']:.1f} ({r['ours']['x_none']['median']:.3f})")
        if te:
            row.append(f"{r['te']['median_ms']:.1f} ({r['te']['x_none']['median']:.3f})")
            ot = r["ours_over_te"]
            row.append(f"{ot['median']:.3f} ({ot['min']:.3f} to {ot['max']:.3f})")
        row.append(f"{r['ours']['peak_gib']:.2f}")
        if te:
            row.append(f"{r['te']['peak_gib']:.2f}")
        row.append(", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in r["exact"].items()))
        lines.append("| " + " | ".join(row) + " |")
    budgeted = [r for r in results if BUDGET_LABEL in r]
    if budgeted:
        lines += [
            "",
            f"{BUDGET_LABEL} (the same rounds):",
            "",
            "| k | memory_budget GiB (allocated, all models' weights in) | ms (x none) | / TE (range) | peak GiB | TE peak GiB |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in budgeted:
            b, ot = r[BUDGET_LABEL], r["ours_budget_over_te"]
            lines.append(
                f"| {r['k']} | {r['budget_gib']:.2f} | {b['median_ms']:.1f} "
                f"({b['x_none']['median']:.3f}) | {ot['median']:.3f} ({ot['min']:.3f} to "
                f"{ot['max']:.3f}) | {b['peak_gib']:.2f} | {r['te']['peak_gib']:.2f} |"
            )
    rows = [
        (r, label)
        for r in results
        for label in r.get("variants", [margin_label(s) for s in r.get("margin_shares", [])])
    ]
    if rows:
        lines += [
            "",
            "Our context with other settings of its peak watch (the same rounds; by default "
            f"a margin of 1/{BUDGET_MARGIN_SHARE}, and deferrals):",
            "",
            "| k | model | ms (x none) | / ours (range) | "
            + ("/ TE (range) | " if te else "")
            + "peak GiB | ours peak GiB | budgets MiB | ours' budgets MiB | ours' deferrals MiB |",
            "|---:|---|---:|---:|" + ("---:|" if te else "") + "---:|---:|---|---|---|",
        ]
        for r, label in rows:
            m = r[label]
            row = [str(r["k"]), label, f"{m['median_ms']:.1f} ({m['x_none']['median']:.3f})"]
            ratios = [m["over_ours"]] + ([m["over_te"]] if te else [])
            row += [f"{x['median']:.3f} ({x['min']:.3f} to {x['max']:.3f})" for x in ratios]
            row += [f"{m['peak_gib']:.2f}", f"{r['ours']['peak_gib']:.2f}"]
            row += [_budgets(m["budgets_mib"]), _budgets(r["ours"]["budgets_mib"])]
            row.append(_budgets(r["ours"].get("deferrals_mib", {})))
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _budgets(mib: dict[int, float]) -> str:
    return ", ".join(f"layer {layer}: {b:.0f}" for layer, b in mib.items()) or "none"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--te", type=Path, help="te_reference.sh's output folder (Transformer Engine's code)"
    )
    p.add_argument(
        "--budget-te",
        action="store_true",
        help="also run ours with memory_budget at the peak TE's code reached (needs --te)",
    )
    p.add_argument(
        "--margin-shares",
        default="",
        help="also run ours with its peak watch leaving 1/S of the peak unused in its byte "
        f"budgets, one model per comma-separated S (default share 1/{BUDGET_MARGIN_SHARE})",
    )
    p.add_argument(
        "--without-deferral",
        action="store_true",
        help="also run ours with a peak watch that defers no release",
    )
    p.add_argument("--ks", default="2,4,8", help="layers offloaded, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per model and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args()
    try:
        ks = [int(x) for x in args.ks.split(",")]
    except ValueError:
        p.error(f"--ks: comma-separated integers, got {args.ks!r}")
    for k in ks:
        if not 0 < k < DIMS["layers"]:
            p.error(f"--ks: each k must be in [1, {DIMS['layers'] - 1}], got {k}")
    shares = args.margin_shares.split(",") if args.margin_shares.strip() else []
    try:
        args.margin_share_list = [int(x) for x in shares]
    except ValueError:
        p.error(f"--margin-shares: comma-separated integers, got {args.margin_shares!r}")
    for share in args.margin_share_list:
        if share < 1:
            p.error(f"--margin-shares: each share must be at least 1, got {share}")
        if args.margin_share_list.count(share) > 1:
            p.error(f"--margin-shares: each share once, got {share} more than once")
    for name in ("rounds", "steps", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.budget_te and args.te is None:
        p.error("--budget-te needs --te: the budget is the peak Transformer Engine's code reached")
    if not torch.cuda.is_available():
        p.error("workload D needs a CUDA GPU (and megatron-core)")
    te_fn = load_te(args.te) if args.te is not None else None
    init_megatron()
    handle = use_with_megatron_core()  # the linear layers read HAVE_TE when they run
    ours_fn = handle.function
    tokens = torch.randint(0, MEGATRON_VOCAB, (DIMS["batch"], DIMS["seq"]), device="cuda")
    gbps = measure_link()  # device to host, host to device, both at once
    device = torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, {device}, cpu_offload {cpu_offload.__file__}; "
          f"pinned {gbps[0]:.1f} / {gbps[1]:.1f} GB/s", flush=True)  # fmt: skip
    none = Model("none", 0, None)
    want = none.first_step(tokens)
    results = []
    for k in ks:
        results.append(run_k(k, none, ours_fn, te_fn, tokens, want, args))
        r = results[-1]
        text = f"k={k}: none {r['none']['median_ms']:.1f} ms, ours {r['ours']['median_ms']:.1f} ms"
        if te_fn is not None:
            ot = r["ours_over_te"]
            text += (f", TE {r['te']['median_ms']:.1f} ms; ours / TE {ot['median']:.3f} "
                     f"({ot['min']:.3f} to {ot['max']:.3f}); peaks {r['ours']['peak_gib']:.2f} / "
                     f"{r['te']['peak_gib']:.2f} GiB")  # fmt: skip
        if BUDGET_LABEL in r:
            ob = r["ours_budget_over_te"]
            text += (f"; {BUDGET_LABEL} ({r['budget_gib']:.2f} GiB) "
                     f"{r[BUDGET_LABEL]['median_ms']:.1f} ms, / TE {ob['median']:.3f}, peak "
                     f"{r[BUDGET_LABEL]['peak_gib']:.2f} GiB")  # fmt: skip
        for label in r["variants"]:
            m = r[label]
            text += (f"; {label} {m['median_ms']:.1f} ms, / ours "
                     f"{m['over_ours']['median']:.3f}, peak {m['peak_gib']:.2f} GiB")  # fmt: skip
        text += f"; ours' deferrals MiB {_budgets(r['ours']['deferrals_mib'])}"
        print(text, r["exact"], flush=True)
    handle.remove()
    text = markdown(results, device, gbps, te_fn is not None)
    print(text)
    write_reports(args.json, args.markdown, device, results, text, dims=DIMS, gbps=gbps,
                  rounds=args.rounds, steps=args.steps)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
