"""Plans for three budgets on a real model, trained and measured against each budget.

Run as a script by tests/test_plan_cuda.py, in its own process (Megatron-Core's process
group and global state are per process, and each model starts from an empty GPU). For
the model it measures the peak of training steps without a plan, profiles the model,
makes a plan for each budget (a fraction of that peak), applies it (with its budget
check) and trains the same steps; every loss and gradient must be bit-identical to the
run without a plan. Prints one JSON line: per budget, the plan (or why none fits), the
modelled and measured step and peak, each step's peak, and the steps whose loss or
gradients differ from the run without a plan (none, for the test to pass).

Usage: plan_budget_steps.py {llama,megatron} [--fractions 0.8,0.6,0.45] [--steps 3]
"""

import argparse
import json
import os
import statistics
import sys
import warnings
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

# The models the benchmarks build, from benchmarks/_models.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _models import llama, megatron_gpt  # noqa: E402

from cpu_offload.plan import NoPlanFits, PlanOverBudget, apply_plan, profile_model, search

parser = argparse.ArgumentParser()
parser.add_argument("model", choices=["llama", "megatron"])
parser.add_argument("--fractions", default="0.8,0.6,0.45")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--layers", type=int, default=8)
parser.add_argument("--hidden", type=int, default=512)
parser.add_argument("--seq", type=int, default=1024)
parser.add_argument("--batch", type=int, default=4)
args = parser.parse_args()
torch.use_deterministic_algorithms(True)


def _llama():
    model = llama(args.hidden, args.layers, args.seq)
    return model, lambda ids: model(input_ids=ids, labels=ids).loss


def _megatron():
    return megatron_gpt(args.layers, args.hidden, args.hidden // 64, args.seq, args.batch)


BUILD = {"llama": _llama, "megatron": _megatron}[args.model]
gen = torch.Generator(device="cuda").manual_seed(0)
batches = [
    torch.randint(0, 32000, (args.batch, args.seq), device="cuda", generator=gen)
    for _ in range(args.steps)
]


def train(model, loss_of, handle=None):
    """Each step's loss, gradients, peak and time, with an SGD update between steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for ids in batches:
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = loss_of(ids)
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        out.append(
            {
                # On the host: what is kept for the comparison takes no device memory.
                "loss": loss.detach().cpu(),
                "grads": [p.grad.cpu() for p in params],
                "peak": torch.cuda.max_memory_allocated(),
                "ms": start.elapsed_time(end),
            }
        )
        with torch.no_grad():
            for p in params:
                p.sub_(1e-2 * p.grad)
    return out


model, loss_of = BUILD()
plain = train(model, loss_of)
none_peak = max(s["peak"] for s in plain)
del model, loss_of
torch.cuda.empty_cache()


def _profile():
    model, loss_of = BUILD()
    return profile_model(model, lambda: loss_of(batches[0]), steps=3)


profile = _profile()
torch.cuda.empty_cache()
none_ms = statistics.median(s["ms"] for s in plain[1:])
result = {"model": args.model, "none_peak": none_peak, "none_ms": none_ms, "budgets": []}
result["profile_keep"] = [profile.static_bytes, profile.head_bytes, profile.other_ms]
for fraction in [float(f) for f in args.fractions.split(",")]:
    model, loss_of = BUILD()
    budget = int(fraction * none_peak)
    try:
        plan = search(profile, budget)
    except NoPlanFits as exc:
        result["budgets"].append({"fraction": fraction, "budget": budget, "no_plan": str(exc)})
        continue
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = apply_plan(model, plan)
        try:
            steps = train(model, loss_of, handle)
        except PlanOverBudget as exc:
            error, steps = str(exc), []
    check = handle.watch
    differ = [
        f"step {step}: " + ("loss" if not torch.equal(got["loss"], want["loss"]) else "gradients")
        for step, (got, want) in enumerate(zip(steps, plain[: len(steps)], strict=True))
        if not torch.equal(got["loss"], want["loss"])
        or not all(torch.equal(a, b) for a, b in zip(got["grads"], want["grads"], strict=True))
    ]
    result["budgets"].append(
        {
            "fraction": fraction,
            "budget": budget,
            "plan": plan.describe(),
            "final_plan": check.plan.describe(),
            "tightened": check.tightened,
            "modelled_peak": plan.peak_bytes,
            "modelled_ms": plan.step_ms,
            "first_peak": check.measured_peak_bytes,
            "step_peaks": [s["peak"] for s in steps],
            "measured_ms": statistics.median(s["ms"] for s in steps[1:]) if steps else None,
            "warnings": [str(w.message) for w in caught if "peaked at" in str(w.message)],
            "error": error,
            "differ": differ,
        }
    )
    handle.remove()
    del model, loss_of, handle, check, steps
    torch.cuda.empty_cache()
print(json.dumps(result))
