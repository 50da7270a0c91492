"""The planner's model against measurement for whole-layer plans you name, on one model.

Profiles the model once, then times each plan (``K``/``O``/``R`` per layer) in rounds
that take the plans in turn, each measurement between two runs of the profile's host
probe, and prints the modelled step beside the measured median, fastest round and the
rounds' probes: where plans that share most layers disagree with the model by different
amounts, the layers they differ in are where the model misses. With ``--trace`` it also
writes a ``torch.profiler`` chrome trace of two steps of each plan named there.

    python benchmarks/plan_variants.py                  # the Llama of plan.py, 8 plans
    python benchmarks/plan_variants.py --workload megatron --plans KKKKKKKKKKKK,OOKKKKKKKKKK

The default plans have 12 letters (the Llama and the Megatron-Core GPT of ``plan.py``);
for workload D (16 layers) or compare's model (8) name plans of their length.
    python benchmarks/plan_variants.py --trace ORRORRRKKRRR --out traces/
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _plan_workloads import WORKLOAD_DIMS, build  # noqa: E402
from _report import timed_as_users_train  # noqa: E402
from plan import _alternated  # noqa: E402

from cpu_offload._layer_stack import find_layers  # noqa: E402
from cpu_offload.layers import offload_layers  # noqa: E402
from cpu_offload.plan import Choice, estimate, profile_model  # noqa: E402
from cpu_offload.plan.costs import offload_layers_arguments  # noqa: E402
from cpu_offload.plan.io import _profile_to_dict  # noqa: E402
from cpu_offload.plan.model import check_choices  # noqa: E402

LETTERS = {"K": Choice.KEEP, "O": Choice.OFFLOAD, "R": Choice.RECOMPUTE, "C": Choice.RECAST}
DEFAULT_PLANS = (
    "KKKKKKKKKKKK,ORRORRRKKRRR,KRRKRRRKKRRR,RRRRRRRKKRRR,"
    "RRRRRRRRRRRR,OKKOKKKKKKKK,OOKKKKKKKKKK,ORRORRRRRRRR"
)


def _choices(plan: str, n: int) -> list[Choice]:
    if len(plan) != n or set(plan) - set(LETTERS):
        raise SystemExit(f"--plans: {plan!r} is not {n} letters of K, O, R and C")
    return [LETTERS[c] for c in plan]


def _trace(
    model: torch.nn.Module, step: Callable[[], torch.Tensor], plan: str, n: int, out: Path
) -> None:
    arguments = offload_layers_arguments(check_choices(_choices(plan, n), n))
    with offload_layers(model, **arguments):
        for _ in range(3):
            step().backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step().backward()
            torch.cuda.synchronize()
    raw = out / f"trace-{plan}.json"
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="llama", choices=sorted(WORKLOAD_DIMS))
    p.add_argument("--plans", default=DEFAULT_PLANS, help="comma-separated, a letter a layer")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--trace", default="", help="comma-separated plans to trace")
    p.add_argument("--out", default=".", help="folder for the profile JSON and the traces")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("this benchmark needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, step = build(args.workload, False)
    n = len(find_layers(model))
    plans = [s.strip() for s in args.plans.split(",") if s.strip()]
    configs = {plan: _choices(plan, n) for plan in plans}
    with timed_as_users_train():
        profile = profile_model(model, step, steps=args.steps, warmup=args.warmup)
        (out / f"profile-{args.workload}.json").write_text(json.dumps(_profile_to_dict(profile)))
        timed = _alternated(model, step, configs, args.rounds, args.steps, args.warmup)
        print(
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}; workload {args.workload}"
        )
        for plan in plans:
            est, t = estimate(profile, configs[plan]), timed[plan]
            rounds = t["round_medians_ms"]
            print(
                f"{plan} modelled {est.step_ms:6.1f} ms | measured median {t['measured'][0]:6.1f}"
                f" fastest {min(rounds):6.1f} ({est.step_ms / t['measured'][0] - 1:+.1%} /"
                f" {est.step_ms / min(rounds) - 1:+.1%}) | rounds"
                f" {[round(x, 1) for x in rounds]} probes"
                f" {[round(x, 1) for x in t['round_probes_ms']]}",
                flush=True,
            )
        for plan in filter(None, (s.strip() for s in args.trace.split(","))):
            _trace(model, step, plan, n, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
