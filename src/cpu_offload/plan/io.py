"""Saving and loading plans as JSON, so that a training job need not profile at every start.

The file holds a format name, a version, the choices and the model's figures, and the
profile the plan was made from (when known), so that another budget can be planned
from the file alone. Loading checks every field and names the one that is wrong.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, asdict, fields, replace
from typing import Any

from .model import (  # noqa: F401
    Choice,
    HostCost,
    LayerCost,
    Link,
    PartCost,
    Parts,
    Profile,
    Storage,
    check_choices,
)
from .search import Plan

__all__ = [
    "FORMAT",
    "VERSION",
    "PlanFileError",
    "choice_to_json",
    "load_plan",
    "plan_from_dict",
    "plan_to_dict",
    "save_plan",
]

#: The ``format`` field of a plan file.
FORMAT = "cpu-offload-plan"
#: The version this code writes and reads.
VERSION = 1


class PlanFileError(ValueError):
    """A plan file (or dict) that cannot be read: the message names the field."""


def _profile_to_dict(profile: Profile) -> dict[str, Any]:
    return {
        "device": profile.device,
        "static_bytes": profile.static_bytes,
        "other_ms": profile.other_ms,
        "head_bytes": profile.head_bytes,
        "head_ms": profile.head_ms,
        "head_host_ms": profile.head_host_ms,
        "link": {
            "d2h_gbps": profile.link.d2h_gbps,
            "h2d_gbps": profile.link.h2d_gbps,
            "duplex_gbps": profile.link.duplex_gbps,
            "two_streams": profile.link.two_streams,
        },
        "layers": [
            {
                "forward_ms": c.forward_ms,
                "backward_ms": c.backward_ms,
                "recompute_ms": c.recompute_ms,
                "saved_bytes": c.saved_bytes,
                "offload_bytes": c.offload_bytes,
                "recast_bytes": c.recast_bytes,
                "recast_ms": c.recast_ms,
                "input_bytes": c.input_bytes,
                "workspace_bytes": c.workspace_bytes,
                "host": None if c.host is None else asdict(c.host),
                "storages": [
                    [s.nbytes, s.offload_bytes, s.outside, s.recast_of] for s in c.storages
                ],
                "parts": [
                    {
                        "name": p.name,
                        "forward_ms": p.forward_ms,
                        "host_ms": p.host_ms,
                        "saved": list(p.saved),
                        "inputs": list(p.inputs),
                    }
                    for p in c.parts
                ],
            }
            for c in profile.layers
        ],
    }


def choice_to_json(choice: Choice | Parts) -> object:
    """One layer's choice as a plan file holds it."""
    if isinstance(choice, Parts):
        return {"parts": [[name, c.value] for name, c in choice.choices]}
    return choice.value


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The JSON-ready form of ``plan`` (with its profile, when it has one).

    Example:
        >>> plan = Plan((Choice.OFFLOAD, Choice.KEEP), 100, 3.0, 90)
        >>> plan_to_dict(plan)["choices"]
        ['offload', 'keep']
    """
    out: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "num_layers": len(plan.choices),
        "choices": [choice_to_json(c) for c in plan.choices],
        "budget_bytes": plan.budget_bytes,
        "modelled": {"step_ms": plan.step_ms, "peak_bytes": plan.peak_bytes},
    }
    if plan.profile is not None:
        out["profile"] = _profile_to_dict(plan.profile)
    return out


class _Reader:
    """Typed access to a JSON object, with errors naming the field's path."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, Mapping):
            raise PlanFileError(f"{path} must be a JSON object, got {type(data).__name__}")
        self.data = data
        self.path = path

    def _get(self, key: str) -> object:
        if key not in self.data:
            raise PlanFileError(f"missing field {self.path}.{key}")
        return self.data[key]

    def number(self, key: str, *, positive: bool = False) -> float:
        value = self._get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise PlanFileError(f"{self.path}.{key} must be a number, got {value!r}")
        if value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise PlanFileError(f"{self.path}.{key} must be {bound}, got {value!r}")
        return float(value)

    def optional_number(self, key: str, *, positive: bool = False) -> float | None:
        if self.data.get(key) is None:
            return None
        return self.number(key, positive=positive)

    def count(self, key: str) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanFileError(f"{self.path}.{key} must be an int >= 0, got {value!r}")
        return value

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise PlanFileError(f"{self.path}.{key} must be a string, got {value!r}")
        return value

    def flag(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise PlanFileError(f"{self.path}.{key} must be true or false, got {value!r}")
        return value

    def listing(self, key: str) -> list[object]:
        value = self._get(key)
        if not isinstance(value, list):
            raise PlanFileError(f"{self.path}.{key} must be a list, got {value!r}")
        return value

    def child(self, key: str) -> _Reader:
        return _Reader(self._get(key), f"{self.path}.{key}")


def _host_from(r: _Reader) -> HostCost:
    # Fields with a default are absent from files written before they were measured;
    # those whose default is None are null where not measured.
    values: dict[str, Any] = {
        f.name: r.optional_number(f.name) if f.default is None else r.number(f.name)
        for f in fields(HostCost)
        if f.name in r.data or f.default is MISSING
    }
    return HostCost(**values)


def _storages_from(r: _Reader) -> tuple[Storage, ...]:
    out = []
    for k, item in enumerate(r.listing("storages")):
        path = f"{r.path}.storages[{k}]"
        # A fourth item, the storage it is a saved cast of (or null), is absent from
        # files written before saved casts were rebuilt.
        if (
            not isinstance(item, list)
            or len(item) not in (3, 4)
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item[:2])
            or not isinstance(item[2], bool)
            or item[1] > item[0]
            or not (
                len(item) == 3
                or item[3] is None
                or (_index(item[3], len(r.listing("storages"))) and item[3] != k)
            )
        ):
            raise PlanFileError(
                f"{path} must be [bytes, offload bytes <= bytes, outside (true or false), "
                f"index of another storage it is a cast of, or null], got {item!r}"
            )
        out.append(Storage(item[0], item[1], item[2], item[3] if len(item) == 4 else None))
    return tuple(out)


def _index(value: object, size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size


def _parts_from(r: _Reader, num_storages: int) -> tuple[PartCost, ...]:
    out = []
    for k, item in enumerate(r.listing("parts")):
        pr = _Reader(item, f"{r.path}.parts[{k}]")
        indices: dict[str, tuple[int, ...]] = {}
        for key in ("saved", "inputs"):
            values = pr.listing(key)
            checked = [
                v
                for v in values
                if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < num_storages
            ]
            if len(checked) != len(values):
                raise PlanFileError(
                    f"{pr.path}.{key} must list storage indices in [0, {num_storages - 1}], "
                    f"got {values!r}"
                )
            indices[key] = tuple(checked)
        out.append(
            PartCost(
                pr.text("name"),
                pr.number("forward_ms"),
                pr.number("host_ms"),
                indices["saved"],
                indices["inputs"],
            )
        )
    return tuple(out)


def _choice_from(i: int, raw: object) -> object:
    """A layer's choice as :func:`cpu_offload.plan.model.check_choices` takes it."""
    if not isinstance(raw, Mapping):
        return raw
    pairs = raw.get("parts")
    if set(raw) != {"parts"} or not isinstance(pairs, list):
        raise PlanFileError(
            f'plan.choices[{i}] must be a choice or {{"parts": [[name, choice], ...]}}, got {raw!r}'
        )
    out = []
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise PlanFileError(
                f"plan.choices[{i}].parts must hold [name, choice] pairs, got {pair!r}"
            )
        try:
            out.append((pair[0], Choice(pair[1])))
        except ValueError:
            raise PlanFileError(
                f"plan.choices[{i}].parts: {pair[0]!r} has no choice {pair[1]!r}"
            ) from None
    return Parts(tuple(out))


def _profile_from(r: _Reader) -> Profile:
    link = r.child("link")
    layers = []
    for i, item in enumerate(r.listing("layers")):
        lr = _Reader(item, f"{r.path}.layers[{i}]")
        cost = LayerCost(
            forward_ms=lr.number("forward_ms"),
            backward_ms=lr.number("backward_ms"),
            recompute_ms=lr.optional_number("recompute_ms"),
            saved_bytes=lr.count("saved_bytes"),
            offload_bytes=lr.count("offload_bytes"),
            # Absent from files written before saved casts were rebuilt.
            recast_bytes=lr.count("recast_bytes") if "recast_bytes" in lr.data else 0,
            recast_ms=lr.number("recast_ms") if "recast_ms" in lr.data else 0.0,
            input_bytes=lr.count("input_bytes"),
            workspace_bytes=lr.count("workspace_bytes"),
            # Absent from files written before the host's time was measured.
            host=_host_from(lr.child("host")) if lr.data.get("host") is not None else None,
            # Absent from files written before parts were profiled.
            storages=_storages_from(lr) if "storages" in lr.data else (),
        )
        if lr.data.get("parts"):
            cost = replace(cost, parts=_parts_from(lr, len(cost.storages)))
        if cost.offload_bytes + cost.recast_bytes > cost.saved_bytes:
            raise PlanFileError(
                f"{lr.path}.offload_bytes + recast_bytes ({cost.offload_bytes} + "
                f"{cost.recast_bytes}) must be at most saved_bytes ({cost.saved_bytes})"
            )
        layers.append(cost)
    return Profile(
        tuple(layers),
        Link(
            d2h_gbps=link.number("d2h_gbps", positive=True),
            h2d_gbps=link.number("h2d_gbps", positive=True),
            duplex_gbps=link.optional_number("duplex_gbps", positive=True),
            two_streams=link.flag("two_streams"),
        ),
        static_bytes=r.count("static_bytes"),
        other_ms=r.number("other_ms"),
        device=r.text("device"),
        # Absent from files written before the head was measured.
        head_bytes=r.count("head_bytes") if "head_bytes" in r.data else 0,
        # Absent from files written before the head's time was modelled apart.
        head_ms=r.number("head_ms") if "head_ms" in r.data else 0.0,
        head_host_ms=r.number("head_host_ms") if "head_host_ms" in r.data else 0.0,
    )


def plan_from_dict(data: object) -> Plan:
    """The plan a dict of :func:`plan_to_dict` describes.

    Raises:
        PlanFileError: If a field is missing or wrong (the message names it), the
            format or version is not this one, or the choices do not match the layers.

    Example:
        >>> plan = Plan((Choice.OFFLOAD, Choice.KEEP), 100, 3.0, 90)
        >>> plan_from_dict(plan_to_dict(plan)) == plan
        True
    """
    r = _Reader(data, "plan")
    if r.text("format") != FORMAT:
        raise PlanFileError(f"plan.format must be {FORMAT!r}, got {r.data['format']!r}")
    version = r.count("version")
    if version != VERSION:
        raise PlanFileError(
            f"plan.version {version} is not supported (this version of cpu-offload reads "
            f"version {VERSION}); make the plan again"
        )
    n = r.count("num_layers")
    raw = [_choice_from(i, c) for i, c in enumerate(r.listing("choices"))]
    try:
        choices = check_choices(raw, n)
    except ValueError as exc:
        raise PlanFileError(f"plan.{exc}") from None
    modelled = r.child("modelled")
    profile = _profile_from(r.child("profile")) if r.data.get("profile") is not None else None
    if profile is not None and profile.num_layers != n:
        raise PlanFileError(
            f"plan.profile.layers has {profile.num_layers} entries, plan.num_layers is {n}"
        )
    if profile is not None:
        try:  # per part choices against the profiled parts
            choices = check_choices(choices, n, profile.layers)
        except ValueError as exc:
            raise PlanFileError(f"plan.{exc}") from None
    budget = r.count("budget_bytes")
    try:  # what a Plan refuses (a budget of 0, say), as a field of the file
        return Plan(
            choices,
            budget,
            modelled.number("step_ms"),
            modelled.count("peak_bytes"),
            profile,
        )
    except ValueError as exc:
        raise PlanFileError(f"{r.path}: {exc}") from None


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write ``plan`` (and its profile, when it has one) to ``path`` as JSON.

    The text is made before the file is opened, so that a plan that cannot be written
    leaves an existing file as it was.

    Raises:
        TypeError: If ``plan`` is not a :class:`Plan`.
        OSError: If the file cannot be written.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
        >>> save_plan(Plan((Choice.KEEP,), 10, 1.0, 5), path)
        >>> load_plan(path).choices
        (<Choice.KEEP: 'keep'>,)
    """
    if not isinstance(plan, Plan):
        raise TypeError(
            f"plan must be a Plan (from search() or load_plan()), got {type(plan).__name__}"
        )
    text = json.dumps(plan_to_dict(plan), indent=2) + "\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan :func:`save_plan` wrote.

    Raises:
        OSError: If the file cannot be read.
        PlanFileError: If it is not JSON, or a field is missing or wrong (named, with
            the file's path).
    """
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFileError(f"{os.fspath(path)}: not JSON ({exc})") from None
    try:
        return plan_from_dict(data)
    except PlanFileError as exc:
        raise PlanFileError(f"{os.fspath(path)}: {exc}") from None
