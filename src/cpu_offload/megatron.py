"""Megatron-style offload configuration: the fields, rules and messages users know.

Megatron-LM configures its two offloading mechanisms through config fields: layer-level
activation offloading through ``TransformerConfig`` (``cpu_offloading``,
``cpu_offloading_num_layers``, ...; section ``model.`` in Megatron Bridge) and
optimizer-state offloading through ``OptimizerConfig`` (``optimizer_cpu_offload``,
``optimizer_offload_fraction``, ...; section ``optimizer.``). This module carries those fields with Megatron's defaults and
validation messages (word for word: users search for them), reads them from any config
object, parses Megatron Bridge's ``key=value`` overrides, and builds the package's
activation-offload context and optimizer from them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

from cpu_offload._megatron_core import MegatronCoreOffload, use_with_megatron_core
from cpu_offload.optim import HybridDeviceOptimizer

__all__ = [
    "ActivationOffloadConfig",
    "MegatronCoreOffload",
    "OptimizerOffloadConfig",
    "apply_overrides",
    "build_optimizer",
    "offload_context",
    "optimizer_class",
    "parse_override",
    "use_with_megatron_core",
]

_C = TypeVar("_C", "ActivationOffloadConfig", "OptimizerOffloadConfig")

# Field kinds, for type checks, override parsing and error messages.
_BOOL, _INT, _FLOAT, _STR, _OPT_STR = "bool", "int", "float", "str", "str or None"

_RECOMPUTE_GRANULARITIES = (None, "full", "selective")
_OPTIMIZERS = {"adam": torch.optim.AdamW, "sgd": torch.optim.SGD}


@dataclass
class ActivationOffloadConfig:
    """Megatron's activation-offloading fields and the model fields they are checked against.

    Field names and defaults are Megatron-LM's (``ModelParallelConfig`` /
    ``TransformerConfig``). Validation runs on construction and in :meth:`validate`
    (call it again after mutating fields) and raises Megatron's messages.

    Attributes:
        cpu_offloading: Master switch.
        cpu_offloading_num_layers: Layers whose activations are offloaded, in
            ``[0, num_layers)``.
        cpu_offloading_activations: Offload activations.
        cpu_offloading_weights: Offload weights (accepted; the V2 engine ignores it with
            a ``DeprecationWarning``).
        cpu_offloading_double_buffering: Double-buffer reloads (accepted; V2 ignores it).
        cpu_offloading_retain_pinned_cpu_buffers: Keep each layer's pinned buffers at
            fixed addresses across iterations (CUDA graphs).
        num_layers: The model's number of transformer layers.
        pipeline_model_parallel_size: Must be 1 with activation offloading.
        recompute_granularity: ``None``, ``"full"`` or ``"selective"``; must be None with
            activation offloading.
        cuda_graph_impl: Megatron's CUDA graph implementation; only ``"none"`` and
            ``"full_iteration"`` combine with activation offloading.
        fine_grained_activation_offloading: Megatron's other (module-level) mechanism;
            exclusive with ``cpu_offloading``.

    Raises:
        TypeError: A field has the wrong type.
        ValueError: A field is out of range or a Megatron rule is broken.

    Example:
        >>> cfg = ActivationOffloadConfig(
        ...     cpu_offloading=True, cpu_offloading_num_layers=4, num_layers=16)
        >>> cfg.cpu_offloading_num_layers
        4
    """

    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False
    cpu_offloading_retain_pinned_cpu_buffers: bool = False
    num_layers: int = 0
    pipeline_model_parallel_size: int = 1
    recompute_granularity: str | None = None
    cuda_graph_impl: str = "none"
    fine_grained_activation_offloading: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check types and Megatron's rules, in Megatron's order.

        Raises:
            TypeError: A field has the wrong type.
            ValueError: With Megatron's message when a rule is broken.
        """
        _check_types(self)
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.pipeline_model_parallel_size < 1:
            raise ValueError(
                "pipeline_model_parallel_size must be >= 1, got "
                f"{self.pipeline_model_parallel_size}"
            )
        if self.recompute_granularity not in _RECOMPUTE_GRANULARITIES:
            raise ValueError(
                "recompute_granularity must be None, 'full' or 'selective', got "
                f"{self.recompute_granularity!r}"
            )
        if self.cpu_offloading and (
            self.cpu_offloading_num_layers < 0 or self.cpu_offloading_num_layers >= self.num_layers
        ):
            raise ValueError(
                f"CPU offloading can be done only for layers less than {self.num_layers}"
            )
        if self.cpu_offloading and self.pipeline_model_parallel_size > 1:
            raise ValueError(
                "Currently there is no support for Pipeline parallelism with CPU offloading"
            )
        if self.cpu_offloading and self.recompute_granularity is not None:
            raise ValueError(
                "CPU offloading does not work when activation recomputation is enabled"
            )
        if self.fine_grained_activation_offloading and self.cpu_offloading:
            raise ValueError(
                "fine_grained_activation_offloading cannot be enabled with cpu_offloading."
            )
        if self.cpu_offloading and self.cuda_graph_impl not in ("none", "full_iteration"):
            raise ValueError("CUDA graphs not supported with CPU offloading.")

    @classmethod
    def from_object(cls, cfg: Any) -> ActivationOffloadConfig:
        """Read the fields from any config object.

        Works with Megatron's ``TransformerConfig``, a Megatron Bridge model provider or
        whole ``ConfigContainer`` (its ``model`` section is used), an OmegaConf node, a
        dict, or an ``argparse.Namespace``. Missing fields keep their defaults; other
        attributes are ignored. Older Megatron configs without ``cuda_graph_impl`` are
        read through ``enable_cuda_graph`` (``"local"``) and ``external_cuda_graph``
        (``"transformer_engine"``).

        Args:
            cfg: The config object.

        Returns:
            A validated :class:`ActivationOffloadConfig`.

        Raises:
            TypeError: A field has the wrong type.
            ValueError: A Megatron rule is broken.

        Example:
            >>> from types import SimpleNamespace
            >>> ActivationOffloadConfig.from_object(
            ...     SimpleNamespace(cpu_offloading=False, num_layers=8)).num_layers
            8
        """
        source = _section(cfg, "model", "cpu_offloading")
        values = _read_fields(cls, source)
        if "cuda_graph_impl" not in values:
            if _read(source, "external_cuda_graph")[1] is True:
                values["cuda_graph_impl"] = "transformer_engine"
            elif _read(source, "enable_cuda_graph")[1] is True:
                values["cuda_graph_impl"] = "local"
        return cls(**values)


@dataclass
class OptimizerOffloadConfig:
    """Megatron's optimizer-offloading fields (``OptimizerConfig``), with its defaults.

    Attributes:
        optimizer_cpu_offload: Master switch: :func:`build_optimizer` returns a
            :class:`~cpu_offload.optim.HybridDeviceOptimizer` when on.
        optimizer_offload_fraction: Fraction of the optimizer state on the host, in
            ``[0.0, 1.0]``.
        overlap_cpu_optimizer_d2h_h2d: Pipelined host steps and copies.
        use_torch_optimizer_for_cpu_offload: Accepted for compatibility. Megatron uses
            it to put ``torch.optim`` on the GPU side instead of TE's or Apex's fused
            Adam; here both sides are always ``torch.optim`` classes, so it changes
            nothing.
        pin_cpu_grads: Pin the host gradient buffers.
        pin_cpu_params: Pin the host parameter buffers.
        optimizer: Megatron's optimizer name: ``"adam"`` (AdamW, decoupled weight decay,
            as in Megatron) or ``"sgd"``; checked by :func:`build_optimizer`.
        overlap_host_step_with_forward: Not Megatron's: the host step finishes under
            the next forward (:class:`~cpu_offload.optim.HybridDeviceOptimizer`'s option
            of that name; bit-identical, ``step()`` returns before the offloaded
            parameters are updated and every read of one waits for it).
        offload_last_layers: Not Megatron's: offload the fraction from the end of the
            parameter list instead of its start (the option of that name).

    Raises:
        TypeError: A field has the wrong type.
        ValueError: ``optimizer_offload_fraction`` is outside ``[0.0, 1.0]``.

    Example:
        >>> OptimizerOffloadConfig(optimizer_cpu_offload=True,
        ...                        optimizer_offload_fraction=0.5).optimizer
        'adam'
    """

    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_torch_optimizer_for_cpu_offload: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    optimizer: str = "adam"
    overlap_host_step_with_forward: bool = False
    offload_last_layers: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the types and the fraction's range.

        Raises:
            TypeError: A field has the wrong type.
            ValueError: ``optimizer_offload_fraction`` is outside ``[0.0, 1.0]``.
        """
        _check_types(self)
        fraction = self.optimizer_offload_fraction
        if math.isnan(fraction) or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"optimizer_offload_fraction must be in [0.0, 1.0], got {fraction}")

    @classmethod
    def from_object(cls, cfg: Any) -> OptimizerOffloadConfig:
        """Read the fields from any config object.

        Works with Megatron's ``OptimizerConfig``, a Megatron Bridge ``ConfigContainer``
        (its ``optimizer`` section is used), an OmegaConf node, a dict or a namespace.
        Missing fields keep their defaults; other attributes are ignored.

        Args:
            cfg: The config object.

        Returns:
            A validated :class:`OptimizerOffloadConfig`.

        Raises:
            TypeError: A field has the wrong type.
            ValueError: ``optimizer_offload_fraction`` is outside ``[0.0, 1.0]``.

        Example:
            >>> OptimizerOffloadConfig.from_object(
            ...     {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1}
            ... ).optimizer_offload_fraction
            1.0
        """
        source = _section(cfg, "optimizer", "optimizer_cpu_offload")
        return cls(**_read_fields(cls, source))


# ---------------------------------------------------------------------- field helpers


def _kind(config_cls: type, name: str) -> str:
    annotation = {f.name: f.type for f in fields(config_cls)}[name]
    return {
        "bool": _BOOL,
        "int": _INT,
        "float": _FLOAT,
        "str": _STR,
        "str | None": _OPT_STR,
    }[str(annotation)]


def _check_types(config: ActivationOffloadConfig | OptimizerOffloadConfig) -> None:
    for f in fields(config):
        value = getattr(config, f.name)
        kind = _kind(type(config), f.name)
        if kind == _BOOL:
            ok = isinstance(value, bool)
        elif kind == _INT:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == _FLOAT:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok:
                setattr(config, f.name, float(value))
        elif kind == _STR:
            ok = isinstance(value, str)
        else:
            ok = value is None or isinstance(value, str)
        if not ok:
            raise TypeError(
                f"{f.name} must be {_describe(kind)}, got {type(value).__name__} {value!r}"
            )


def _describe(kind: str) -> str:
    return {
        _BOOL: "a bool (True or False)",
        _INT: "an int",
        _FLOAT: "a float",
        _STR: "a str",
        _OPT_STR: "a str or None",
    }[kind]


def _read(source: Any, name: str) -> tuple[bool, Any]:
    if isinstance(source, Mapping):
        return (True, source[name]) if name in source else (False, None)
    try:
        return True, getattr(source, name)
    except (AttributeError, KeyError):  # OmegaConf raises subclasses of either
        return False, None


def _section(cfg: Any, section: str, probe: str) -> Any:
    # A whole Megatron Bridge ConfigContainer: use its model / optimizer section.
    if _read(cfg, probe)[0]:
        return cfg
    found, sub = _read(cfg, section)
    if found and _read(sub, probe)[0]:
        return sub
    return cfg


def _read_fields(config_cls: type[_C], source: Any) -> dict[str, Any]:
    values = {}
    for f in fields(config_cls):
        found, value = _read(source, f.name)
        if found:
            values[f.name] = value
    return values


# ---------------------------------------------------------------------- overrides

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


# ---------------------------------------------------------------------- builders


def offload_context(config: ActivationOffloadConfig | Any) -> tuple[Any, Callable[..., Any]]:
    """Build the activation-offload context and commit function as Megatron does.

    Calls :func:`cpu_offload.get_cpu_offload_context` with Megatron-LM's positional
    call ``(cpu_offloading, cpu_offloading_num_layers, num_layers,
    cpu_offloading_activations, cpu_offloading_weights, cpu_offloading_double_buffering,
    retain_pinned_cpu_buffers=cpu_offloading_retain_pinned_cpu_buffers)``. Disabled, it
    returns ``(contextlib.nullcontext(), identity)``. As in Megatron, wrap each layer's
    forward in the context and pass its output through the commit function only while
    ``cpu_offloading`` is on and grad is enabled.

    Args:
        config: An :class:`ActivationOffloadConfig` or any object
            :meth:`ActivationOffloadConfig.from_object` reads.

    Returns:
        ``(context, commit_function)``.

    Raises:
        TypeError, ValueError: From the config's validation (Megatron's messages).

    Example:
        >>> ctx, commit = offload_context(ActivationOffloadConfig())  # doctest: +SKIP
        >>> for layer in layers:  # doctest: +SKIP
        ...     with ctx:
        ...         x = layer(x)
        ...     if cfg.cpu_offloading and torch.is_grad_enabled():
        ...         x = commit(x)
    """
    cfg = (
        config
        if isinstance(config, ActivationOffloadConfig)
        else ActivationOffloadConfig.from_object(config)
    )
    cfg.validate()
    # Imported here: the engine's module imports are heavier and this module must import
    # without them (and before them, in the package's own import order).
    import cpu_offload

    return cpu_offload.get_cpu_offload_context(  # type: ignore[attr-defined]
        cfg.cpu_offloading,
        cfg.cpu_offloading_num_layers,
        cfg.num_layers,
        cfg.cpu_offloading_activations,
        cfg.cpu_offloading_weights,
        cfg.cpu_offloading_double_buffering,
        retain_pinned_cpu_buffers=cfg.cpu_offloading_retain_pinned_cpu_buffers,
    )


def optimizer_class(config: OptimizerOffloadConfig) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class Megatron's optimizer name stands for, on both sides.

    Args:
        config: The optimizer config; its ``optimizer`` field is read.

    Returns:
        ``torch.optim.AdamW`` for ``"adam"`` (Megatron's Adam is AdamW, decoupled weight
        decay), ``torch.optim.SGD`` for ``"sgd"``.

    Raises:
        ValueError: If ``config.optimizer`` is neither (the message lists both).

    Example:
        >>> optimizer_class(OptimizerOffloadConfig(optimizer="sgd")).__name__
        'SGD'
    """
    if config.optimizer not in _OPTIMIZERS:
        raise ValueError(
            f"{config.optimizer} optimizer is not supported. optimizer must be one of "
            + ", ".join(repr(k) for k in _OPTIMIZERS)
        )
    return _OPTIMIZERS[config.optimizer]


def build_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    config: OptimizerOffloadConfig | Any,
    **defaults: Any,
) -> torch.optim.Optimizer:
    """Build the optimizer Megatron would from an optimizer-offload config.

    With ``optimizer_cpu_offload`` on: a :class:`~cpu_offload.optim.HybridDeviceOptimizer`
    with ``config.optimizer``'s class on both sides (``torch.optim.AdamW`` for
    ``"adam"``, ``torch.optim.SGD`` for ``"sgd"``), the config's fraction, overlap and
    pinning, and ``param_update_in_fp32=True`` (Megatron's choice; pass
    ``param_update_in_fp32=False`` to change it). Otherwise the plain optimizer of that
    class with ``**defaults``.

    Args:
        params: Parameters or param groups.
        config: An :class:`OptimizerOffloadConfig` or any object
            :meth:`OptimizerOffloadConfig.from_object` reads.
        **defaults: Hyperparameters (lr, weight_decay, betas, momentum, fused, ...).

    Returns:
        The optimizer.

    Raises:
        ValueError: Unknown ``config.optimizer`` (allowed: ``"adam"``, ``"sgd"``), or from
            the config's or the optimizer's validation.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = build_optimizer(model.parameters(), OptimizerOffloadConfig(), lr=1e-3)
        >>> type(opt).__name__
        'AdamW'
    """
    cfg = (
        config
        if isinstance(config, OptimizerOffloadConfig)
        else OptimizerOffloadConfig.from_object(config)
    )
    cfg.validate()
    cls = optimizer_class(cfg)
    if not cfg.optimizer_cpu_offload:
        return cls(params, **defaults)
    param_update_in_fp32 = defaults.pop("param_update_in_fp32", True)
    for name in ("overlap_host_step_with_forward", "offload_last_layers"):
        if name in defaults:
            raise TypeError(
                f"build_optimizer: {name} comes from the config "
                f"(OptimizerOffloadConfig.{name}); do not pass it as a keyword too"
            )
    return HybridDeviceOptimizer(
        params,
        offload_fraction=cfg.optimizer_offload_fraction,
        cpu_optimizer_cls=cls,
        gpu_optimizer_cls=cls,
        param_update_in_fp32=param_update_in_fp32,
        pin_cpu_grads=cfg.pin_cpu_grads,
        pin_cpu_params=cfg.pin_cpu_params,
        overlap_cpu_optimizer_d2h_h2d=cfg.overlap_cpu_optimizer_d2h_h2d,
        overlap_host_step_with_forward=cfg.overlap_host_step_with_forward,
        offload_last_layers=cfg.offload_last_layers,
        **defaults,
    )
