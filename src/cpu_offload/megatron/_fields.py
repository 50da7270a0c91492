"""Megatron's two offload configurations: their fields, defaults, checks and messages.

The messages are Megatron-LM's, word for word (users search for them). The helpers at
the end read the fields from any config object (a dataclass, a mapping, OmegaConf).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from cpu_offload.optim._split import check_offload_fraction

_C = TypeVar("_C", "ActivationOffloadConfig", "OptimizerOffloadConfig")

# Field kinds, for type checks, override parsing and error messages.
_BOOL, _INT, _FLOAT, _STR, _OPT_STR = "bool", "int", "float", "str", "str or None"

_RECOMPUTE_GRANULARITIES = (None, "full", "selective")


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
        stream_share: Not Megatron's: the share of the offloaded state stepped on the
            GPU, streamed from host memory during the step (the option of that name;
            AdamW only; bit-identical to stepping those parameters on the GPU).

    Raises:
        TypeError: A field has the wrong type.
        ValueError: ``optimizer_offload_fraction`` or ``stream_share`` is outside
            ``[0.0, 1.0]``.

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
    stream_share: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the types and the fraction's range.

        Raises:
            TypeError: A field has the wrong type.
            ValueError: ``optimizer_offload_fraction`` or ``stream_share`` is outside
                ``[0.0, 1.0]``.
        """
        _check_types(self)
        for name in ("optimizer_offload_fraction", "stream_share"):
            check_offload_fraction(getattr(self, name), name)
        share = self.stream_share
        if share > 0.0 and self.optimizer != "adam":
            raise ValueError(
                f"stream_share={share} streams AdamW's state through the GPU; "
                f"optimizer={self.optimizer!r} has no such path: use optimizer='adam' or "
                "stream_share=0.0"
            )

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
