"""Megatron Bridge's ``section.key=value`` overrides, parsed and checked by Megatron's rules."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from ._fields import (
    _BOOL,
    _FLOAT,
    _INT,
    _OPT_STR,
    ActivationOffloadConfig,
    OptimizerOffloadConfig,
    _kind,
)

_SECTIONS: dict[str, type[ActivationOffloadConfig] | type[OptimizerOffloadConfig]] = {
    "model": ActivationOffloadConfig,
    "optimizer": OptimizerOffloadConfig,
}

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse one Megatron Bridge override such as ``optimizer.optimizer_offload_fraction=0.5``.

    The key is ``model.<field>`` (:class:`ActivationOffloadConfig`) or
    ``optimizer.<field>`` (:class:`OptimizerOffloadConfig`); Hydra's ``+`` / ``++``
    prefixes are accepted. The value is parsed for the field's type: bools as
    ``true/false/yes/no/on/off/1/0`` (any case), ints, floats, strings (quotes
    optional), and ``null`` / ``None`` for ``recompute_granularity``.

    Args:
        text: The ``key=value`` string.

    Returns:
        ``(section, field, value)``, e.g. ``("optimizer", "optimizer_offload_fraction", 0.5)``.

    Raises:
        ValueError: Without ``=``, with an unknown section or key (the message lists the
            known keys and the closest match), or a value the field cannot take.

    Example:
        >>> parse_override("model.cpu_offloading_num_layers=4")
        ('model', 'cpu_offloading_num_layers', 4)
    """
    if not isinstance(text, str):
        raise TypeError(f"override must be a str 'section.key=value', got {type(text).__name__}")
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key:
        raise ValueError(
            f"override {text!r} is not of the form 'section.key=value' "
            "(e.g. optimizer.optimizer_offload_fraction=0.5)"
        )
    section, dot, name = key.partition(".")
    if section not in _SECTIONS or not dot:
        raise ValueError(
            f"unknown override key {key!r} in {text!r}: keys are 'model.<field>' "
            "(activation offloading) or 'optimizer.<field>' (optimizer offloading)"
        )
    config_cls = _SECTIONS[section]
    known = [f.name for f in fields(config_cls)]
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean '{section}.{close[0]}'?)" if close else ""
        raise ValueError(
            f"unknown override key {key!r}{hint}. Known {section} keys: "
            + ", ".join(f"{section}.{k}" for k in known)
        )
    return section, name, _parse_value(section, name, _kind(config_cls, name), raw.strip())


def _parse_value(section: str, name: str, kind: str, raw: str) -> Any:
    unquoted = raw[1:-1] if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"" else raw
    where = f"{section}.{name}"
    if kind == _BOOL:
        low = unquoted.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(
            f"bad value for {where}: {raw!r} is not a bool (use true/false, yes/no, on/off, 1/0)"
        )
    if kind == _INT:
        try:
            return int(unquoted, 10)
        except ValueError:
            raise ValueError(f"bad value for {where}: {raw!r} is not an int") from None
    if kind == _FLOAT:
        try:
            value = float(unquoted)
        except ValueError:
            raise ValueError(f"bad value for {where}: {raw!r} is not a float") from None
        if not math.isfinite(value):
            raise ValueError(f"bad value for {where}: {raw!r} is not a finite float")
        return value
    if kind == _OPT_STR and raw in ("null", "None", "none", "~", ""):
        return None
    return unquoted


def apply_overrides(
    overrides: Iterable[str],
    activation: ActivationOffloadConfig | None = None,
    optimizer: OptimizerOffloadConfig | None = None,
) -> tuple[ActivationOffloadConfig, OptimizerOffloadConfig]:
    """Apply Megatron Bridge ``key=value`` overrides to the two configs.

    Overrides apply in order (a later one wins) and the results are validated as a
    whole, so ``model.cpu_offloading=true model.num_layers=8
    model.cpu_offloading_num_layers=4`` is accepted in any order.

    Args:
        overrides: Strings such as ``"optimizer.optimizer_offload_fraction=0.5"``.
        activation: The config to start from (defaults when None); not modified.
        optimizer: The config to start from (defaults when None); not modified.

    Returns:
        ``(activation_config, optimizer_config)``, new objects.

    Raises:
        ValueError: A malformed override, an unknown key, a bad value, or a broken
            Megatron rule in the result (with Megatron's message).
        TypeError: ``overrides`` is a single string rather than a list of them.

    Example:
        >>> act, opt = apply_overrides(["optimizer.optimizer_cpu_offload=True",
        ...                             "optimizer.optimizer_offload_fraction=0.5"])
        >>> opt.optimizer_offload_fraction
        0.5
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'section.key=value' strings, not one str")
    changes: dict[str, dict[str, Any]] = {"model": {}, "optimizer": {}}
    for text in overrides:
        section, name, value = parse_override(text)
        changes[section][name] = value
    act = activation if activation is not None else ActivationOffloadConfig()
    opt = optimizer if optimizer is not None else OptimizerOffloadConfig()
    return (
        dataclasses.replace(act, **changes["model"]),
        dataclasses.replace(opt, **changes["optimizer"]),
    )
