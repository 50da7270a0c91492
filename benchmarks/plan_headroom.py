"""What plans part by part can gain over plans of whole layers, in the planner's own model.

Reads the profile that ``plan.py --parts --json`` saved with its results, and for each
budget searches the best plan with parts and the best of whole layers: where the model's
best plan with parts is only a few percent faster than its best of whole layers, no plan
of these choices can be much faster on that model and budget, whatever the measurement.

    python benchmarks/plan_headroom.py benchmarks/results/plan-D-parts-h100-2026-11-26-fifth.json \\
        --budgets 17.33GiB,13.06GiB,9.72GiB
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from cpu_offload.cli.plan import parse_budget
from cpu_offload.plan import Choice, NoPlanFits, estimate, search
from cpu_offload.plan.io import _profile_from, _Reader
from cpu_offload.plan.model import Profile


def profile_of(result: dict[str, Any]) -> Profile:
    """The profile ``plan.py`` saved (``dataclasses.asdict`` form) as a :class:`Profile`."""
    raw = json.loads(json.dumps(result["profile"]))
    for layer in raw["layers"]:
        layer["storages"] = [
            [s["nbytes"], s["offload_bytes"], s["outside"], s.get("recast_of")]
            for s in layer["storages"]
        ]
    return _profile_from(_Reader(raw, "profile"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a JSON file written by plan.py --parts --json")
    parser.add_argument("--budgets", required=True, help="comma-separated, e.g. 12GiB,9.5GiB")
    args = parser.parse_args()
    with open(args.results) as f:
        data = json.load(f)
    results = data if isinstance(data, list) else data.get("results", [data])
    gib = 2**30
    for result in results:
        if "profile" not in result:
            continue
        profile = profile_of(result)
        keep = estimate(profile, [Choice.KEEP] * profile.num_layers)
        print(
            f"{result['workload']}: no plan modelled {keep.step_ms:.1f} ms, {keep.peak_bytes / gib:.2f} GiB"
        )
        for text in args.budgets.split(","):
            budget = parse_budget(text)
            try:
                parts, whole = search(profile, budget), search(profile, budget, parts=False)
            except NoPlanFits as err:
                print(f"  {text}: {err}")
                continue
            print(
                f"  {text}: parts {parts.step_ms:.1f} ms {parts.peak_bytes / gib:.2f} GiB "
                f"{parts.describe()}; whole layers {whole.step_ms:.1f} ms "
                f"{whole.peak_bytes / gib:.2f} GiB {whole.describe()}; "
                f"parts / whole {parts.step_ms / whole.step_ms:.3f}"
            )


if __name__ == "__main__":
    main()
