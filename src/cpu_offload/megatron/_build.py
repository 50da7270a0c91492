"""What the configurations build: the activation-offload context and the optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from cpu_offload.optim import HybridDeviceOptimizer

from ._fields import ActivationOffloadConfig, OptimizerOffloadConfig

_OPTIMIZERS = {"adam": torch.optim.AdamW, "sgd": torch.optim.SGD}


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
    for name in ("overlap_host_step_with_forward", "offload_last_layers", "stream_share"):
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
        stream_share=cfg.stream_share,
        **defaults,
    )
