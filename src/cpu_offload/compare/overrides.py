"""Megatron Bridge ``key=value`` overrides on the ``cpu-offload compare`` command line.

The overrides are parsed and validated by :mod:`cpu_offload.megatron` (Megatron's keys,
values and messages); this module decides what they select in the comparison:

* ``model.cpu_offloading_num_layers`` is k of the activation variants and
  ``model.num_layers`` the model's layers (the same as ``--offloaded`` / ``--layers``;
  giving both forms with different values is an error);
* ``model.cpu_offloading=false`` skips the activation variants and
  ``optimizer.optimizer_cpu_offload=false`` the optimizer section (``true`` is implied);
* the other ``optimizer.*`` keys select the optimizer configurations
  (:meth:`~cpu_offload.compare.optimizer.OptimizerCompareConfig.from_megatron`);
* the other ``model.*`` keys are accepted at their defaults only: the comparison does
  not vary them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..megatron import ActivationOffloadConfig, apply_overrides, parse_override
from .optimizer import OptimizerCompareConfig

__all__ = ["CompareSelection", "default_offloaded", "select_from_overrides"]

# model.* keys the comparison acts on; the others must keep their defaults.
_MODEL_KEYS = ("cpu_offloading", "cpu_offloading_num_layers", "num_layers")


@dataclass(frozen=True)
class CompareSelection:
    """What to compare, from the command line's options and overrides together.

    Attributes:
        layers: The model's layers.
        num_offloaded: k: layers offloaded (or checkpointed) by the activation variants.
        activation: Run the activation variants.
        optimizer: The optimizer section, or None to skip it.
    """

    layers: int
    num_offloaded: int
    activation: bool
    optimizer: OptimizerCompareConfig | None


def _merge(flag: str, flag_value: int | None, key: str, given: dict[str, Any]) -> int | None:
    """The value of an option that has a flag form and an override form."""
    if key not in given:
        return flag_value
    if flag_value is not None and flag_value != given[key]:
        raise ValueError(
            f"{flag} {flag_value} and {key}={given[key]} disagree: give one of them "
            "(they set the same thing)"
        )
    value: int = given[key]
    return value


def default_offloaded(num_layers: int) -> int:
    """The default k for ``num_layers`` layers: 2, keeping two layers on the GPU when short.

    Example:
        >>> [default_offloaded(n) for n in (1, 2, 3, 4, 16)]
        [0, 1, 1, 2, 2]
    """
    if num_layers < 2:
        return 0
    return min(2, max(1, num_layers - 2))


_default_k = default_offloaded  # the parameter of the same name hides it below


def select_from_overrides(
    overrides: Sequence[str],
    *,
    layers: int | None,
    offloaded: int | None,
    default_layers: int,
    default_offloaded: int | None = None,
    activation: bool = True,
    optimizer: bool = True,
) -> CompareSelection:
    """Combine the comparison's options with Megatron Bridge overrides.

    Args:
        overrides: ``section.key=value`` strings, e.g.
            ``["optimizer.optimizer_offload_fraction=0.5"]``.
        layers: ``--layers`` (None when not given).
        offloaded: ``--offloaded`` (None when not given).
        default_layers: The model's layers when neither form gives them.
        default_offloaded: k when neither form gives it; by default
            :func:`default_offloaded` of the model's layers.
        activation: False for ``--optimizer-only``.
        optimizer: False for ``--no-optimizer``.

    Returns:
        The selection.

    Raises:
        ValueError: An override that :func:`~cpu_offload.megatron.parse_override` refuses
            (unknown key, bad value), a Megatron rule broken (Megatron's message), a flag
            and an override that disagree, ``--no-optimizer`` beside ``optimizer.*``
            overrides, a ``model.*`` key the comparison does not vary set to another
            value than its default, ``--offloaded`` outside ``[0, layers - 1]``, or
            nothing left to compare.

    Example:
        >>> s = select_from_overrides(["optimizer.optimizer_offload_fraction=0.5"],
        ...                           layers=None, offloaded=None, default_layers=6)
        >>> [v.name for v in s.optimizer.variants]
        ['0 (no offload)', '0.5, overlap on', '0.5, overlap off']
    """
    given: dict[str, Any] = {}
    for text in overrides:
        section, name, value = parse_override(text)
        given[f"{section}.{name}"] = value
    n = _merge("--layers", layers, "model.num_layers", given)
    n = default_layers if n is None else n
    k_override = "model.cpu_offloading_num_layers" in given
    k = _merge("--offloaded", offloaded, "model.cpu_offloading_num_layers", given)
    if k is None:
        k = _default_k(n) if default_offloaded is None else default_offloaded

    # Megatron's rules (and messages) for what the overrides set, on the resolved model.
    start = ActivationOffloadConfig(cpu_offloading=True, num_layers=n)
    act, opt = apply_overrides(overrides, activation=start)
    for name in (f.name for f in dataclasses.fields(act)):
        key = f"model.{name}"
        if (
            key in given
            and name not in _MODEL_KEYS
            and getattr(act, name) != getattr(ActivationOffloadConfig(), name)
        ):
            raise ValueError(
                f"{key}={given[key]!r}: cpu-offload compare does not vary this field; it "
                f"acts on {', '.join('model.' + k for k in _MODEL_KEYS)} and every "
                "optimizer.* key. Leave it at its default "
                f"({getattr(ActivationOffloadConfig(), name)!r})"
            )

    optimizer_keys = sorted(k for k in given if k.startswith("optimizer."))
    selecting = [k for k in optimizer_keys if k != "optimizer.optimizer_cpu_offload"]
    if not optimizer and selecting:
        raise ValueError(
            f"--no-optimizer skips the optimizer section, but {', '.join(selecting)} "
            "select optimizer configurations: drop one or the other"
        )
    run_activation = activation and act.cpu_offloading
    # Megatron's switch defaults to off; here it is implied unless set to false.
    run_optimizer = optimizer and given.get("optimizer.optimizer_cpu_offload", True)
    if not run_activation and not run_optimizer:
        raise ValueError(
            "nothing to compare: the activation variants are off (--optimizer-only or "
            "model.cpu_offloading=false) and so is the optimizer section (--no-optimizer "
            "or optimizer.optimizer_cpu_offload=false)"
        )
    if run_activation and not k_override and not 0 <= k <= n - 1:
        raise ValueError(f"--offloaded must be in [0, {n - 1}] (layers - 1), got {k}")
    names = {k.partition(".")[2] for k in optimizer_keys}
    return CompareSelection(
        layers=n,
        num_offloaded=k,
        activation=run_activation,
        optimizer=OptimizerCompareConfig.from_megatron(opt, names) if run_optimizer else None,
    )
