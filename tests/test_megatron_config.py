"""Tests of cpu_offload.megatron: fields, Megatron's messages, overrides and builders."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

import cpu_offload
from cpu_offload.megatron import (
    ActivationOffloadConfig,
    OptimizerOffloadConfig,
    apply_overrides,
    build_optimizer,
    offload_context,
    parse_override,
)
from cpu_offload.optim import HybridDeviceOptimizer

# Megatron-LM's messages, word for word (seed 001 lists them as the symptoms users search).
MSG_LAYERS = "CPU offloading can be done only for layers less than {}"
MSG_PP = "Currently there is no support for Pipeline parallelism with CPU offloading"
MSG_RECOMPUTE = "CPU offloading does not work when activation recomputation is enabled"
MSG_GRAPHS = "CUDA graphs not supported with CPU offloading."
MSG_FINE_GRAINED = "fine_grained_activation_offloading cannot be enabled with cpu_offloading."


def _raises_exactly(message: str, **fields: Any) -> None:
    with pytest.raises(ValueError) as info:
        ActivationOffloadConfig(**fields)
    assert str(info.value) == message


# ---------------------------------------------------------------------- fields


def test_activation_fields_and_defaults_are_megatrons() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(ActivationOffloadConfig)}
    assert defaults == {
        "cpu_offloading": False,
        "cpu_offloading_num_layers": 0,
        "cpu_offloading_activations": True,
        "cpu_offloading_weights": False,
        "cpu_offloading_double_buffering": False,
        "cpu_offloading_retain_pinned_cpu_buffers": False,
        "num_layers": 0,
        "pipeline_model_parallel_size": 1,
        "recompute_granularity": None,
        "cuda_graph_impl": "none",
        "fine_grained_activation_offloading": False,
    }


def test_optimizer_fields_and_defaults_are_megatrons() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerOffloadConfig)}
    assert defaults == {
        "optimizer_cpu_offload": False,
        "optimizer_offload_fraction": 0.0,
        "overlap_cpu_optimizer_d2h_h2d": False,
        "use_torch_optimizer_for_cpu_offload": False,
        "pin_cpu_grads": True,
        "pin_cpu_params": True,
        "optimizer": "adam",
        # Ours, beyond Megatron's fields: off by default, as Megatron behaves.
        "overlap_host_step_with_forward": False,
        "offload_last_layers": False,
        "stream_share": 0.0,
    }


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize("offloaded", [-1, 8, 9])
def test_layers_message(offloaded: int) -> None:
    _raises_exactly(
        MSG_LAYERS.format(8), cpu_offloading=True, cpu_offloading_num_layers=offloaded, num_layers=8
    )


def test_layers_in_range_accepted() -> None:
    for k in (0, 7):
        ActivationOffloadConfig(cpu_offloading=True, cpu_offloading_num_layers=k, num_layers=8)
    # Megatron's TransformerConfig default num_layers=0 leaves no layer to offload.
    _raises_exactly(MSG_LAYERS.format(0), cpu_offloading=True)


def test_pipeline_message() -> None:
    _raises_exactly(
        MSG_PP,
        cpu_offloading=True,
        cpu_offloading_num_layers=2,
        num_layers=8,
        pipeline_model_parallel_size=2,
    )


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_message(granularity: str) -> None:
    _raises_exactly(
        MSG_RECOMPUTE,
        cpu_offloading=True,
        cpu_offloading_num_layers=2,
        num_layers=8,
        recompute_granularity=granularity,
    )


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_cuda_graph_message(impl: str) -> None:
    _raises_exactly(
        MSG_GRAPHS,
        cpu_offloading=True,
        cpu_offloading_num_layers=2,
        num_layers=8,
        cuda_graph_impl=impl,
    )


def test_full_iteration_graphs_accepted() -> None:
    ActivationOffloadConfig(
        cpu_offloading=True,
        cpu_offloading_num_layers=2,
        num_layers=8,
        cuda_graph_impl="full_iteration",
    )


def test_fine_grained_message() -> None:
    _raises_exactly(
        MSG_FINE_GRAINED,
        cpu_offloading=True,
        cpu_offloading_num_layers=2,
        num_layers=8,
        fine_grained_activation_offloading=True,
    )


def test_rules_apply_only_when_offloading() -> None:
    ActivationOffloadConfig(
        cpu_offloading_num_layers=99,
        pipeline_model_parallel_size=4,
        recompute_granularity="full",
        cuda_graph_impl="local",
        fine_grained_activation_offloading=True,
    )


def test_megatrons_order() -> None:
    # Several rules broken at once: Megatron's __post_init__ reports the first in its order.
    _raises_exactly(
        MSG_PP,
        cpu_offloading=True,
        cpu_offloading_num_layers=2,
        num_layers=8,
        pipeline_model_parallel_size=2,
        recompute_granularity="full",
        cuda_graph_impl="local",
    )
    _raises_exactly(
        MSG_FINE_GRAINED,
        cpu_offloading=True,
        cpu_offloading_num_layers=2,
        num_layers=8,
        fine_grained_activation_offloading=True,
        cuda_graph_impl="local",
    )


def test_validate_after_mutation() -> None:
    cfg = ActivationOffloadConfig(num_layers=4)
    cfg.cpu_offloading = True
    cfg.cpu_offloading_num_layers = 4
    with pytest.raises(ValueError, match=re.escape(MSG_LAYERS.format(4))):
        cfg.validate()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu_offloading", "yes"),
        ("cpu_offloading", 1),
        ("cpu_offloading_num_layers", 2.0),
        ("num_layers", True),
        ("recompute_granularity", 3),
        ("cuda_graph_impl", None),
    ],
)
def test_activation_types(field: str, value: Any) -> None:
    with pytest.raises(TypeError, match=field):
        ActivationOffloadConfig(**{field: value})


def test_activation_ranges() -> None:
    with pytest.raises(ValueError, match="pipeline_model_parallel_size"):
        ActivationOffloadConfig(pipeline_model_parallel_size=0)
    with pytest.raises(ValueError, match="num_layers"):
        ActivationOffloadConfig(num_layers=-1)
    with pytest.raises(ValueError, match="recompute_granularity.*'full'.*'selective'"):
        ActivationOffloadConfig(recompute_granularity="block")


@pytest.mark.parametrize("fraction", [-0.1, 1.01, float("nan")])
def test_optimizer_fraction_range(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"optimizer_offload_fraction must be in \[0.0, 1.0\]"):
        OptimizerOffloadConfig(optimizer_offload_fraction=fraction)


def test_optimizer_types() -> None:
    assert OptimizerOffloadConfig(optimizer_offload_fraction=1).optimizer_offload_fraction == 1.0
    with pytest.raises(TypeError, match="optimizer_offload_fraction"):
        OptimizerOffloadConfig(optimizer_offload_fraction="0.5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer_cpu_offload"):
        OptimizerOffloadConfig(optimizer_cpu_offload=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer_offload_fraction"):
        OptimizerOffloadConfig(optimizer_offload_fraction=True)


# ---------------------------------------------------------------------- from_object


def test_from_namespace_dict_and_argparse() -> None:
    fields = {"cpu_offloading": True, "cpu_offloading_num_layers": 3, "num_layers": 8}
    for source in (SimpleNamespace(**fields), dict(fields), argparse.Namespace(**fields)):
        cfg = ActivationOffloadConfig.from_object(source)
        assert (cfg.cpu_offloading, cfg.cpu_offloading_num_layers, cfg.num_layers) == (True, 3, 8)
        assert cfg.cpu_offloading_activations is True  # missing fields keep defaults


def test_from_object_ignores_other_fields_and_validates() -> None:
    source = SimpleNamespace(
        hidden_size=4096, cpu_offloading=True, num_layers=4, cpu_offloading_num_layers=4
    )
    with pytest.raises(ValueError, match=re.escape(MSG_LAYERS.format(4))):
        ActivationOffloadConfig.from_object(source)


def test_from_bridge_container_sections() -> None:
    container = SimpleNamespace(
        model=SimpleNamespace(cpu_offloading=True, cpu_offloading_num_layers=2, num_layers=4),
        # Megatron's OptimizerConfig has a str field named "optimizer" too.
        optimizer=SimpleNamespace(
            optimizer="adam", optimizer_cpu_offload=True, optimizer_offload_fraction=0.5, lr=1e-4
        ),
    )
    assert ActivationOffloadConfig.from_object(container).cpu_offloading_num_layers == 2
    opt = OptimizerOffloadConfig.from_object(container)
    assert (opt.optimizer_cpu_offload, opt.optimizer_offload_fraction, opt.optimizer) == (
        True,
        0.5,
        "adam",
    )
    assert OptimizerOffloadConfig.from_object(container.optimizer) == opt


def test_from_older_megatron_cuda_graph_flags() -> None:
    base = {"cpu_offloading": True, "cpu_offloading_num_layers": 1, "num_layers": 4}
    with pytest.raises(ValueError, match=re.escape(MSG_GRAPHS)):
        ActivationOffloadConfig.from_object(SimpleNamespace(**base, enable_cuda_graph=True))
    with pytest.raises(ValueError, match=re.escape(MSG_GRAPHS)):
        ActivationOffloadConfig.from_object(SimpleNamespace(**base, external_cuda_graph=True))
    cfg = ActivationOffloadConfig.from_object(SimpleNamespace(**base, enable_cuda_graph=False))
    assert cfg.cuda_graph_impl == "none"


def test_from_omegaconf() -> None:
    omegaconf = pytest.importorskip("omegaconf")
    node = omegaconf.OmegaConf.create(
        {
            "model": {"cpu_offloading": True, "cpu_offloading_num_layers": 2, "num_layers": 8},
            "optimizer": {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1},
        }
    )
    omegaconf.OmegaConf.set_struct(node, True)
    assert ActivationOffloadConfig.from_object(node).num_layers == 8
    assert OptimizerOffloadConfig.from_object(node).optimizer_offload_fraction == 1.0


# ---------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "optimizer.optimizer_offload_fraction=0.5",
            ("optimizer", "optimizer_offload_fraction", 0.5),
        ),
        (
            "optimizer.optimizer_offload_fraction=1",
            ("optimizer", "optimizer_offload_fraction", 1.0),
        ),
        ("model.cpu_offloading_num_layers=4", ("model", "cpu_offloading_num_layers", 4)),
        ("optimizer.optimizer_cpu_offload=True", ("optimizer", "optimizer_cpu_offload", True)),
        ("model.cpu_offloading=false", ("model", "cpu_offloading", False)),
        ("model.cpu_offloading=ON", ("model", "cpu_offloading", True)),
        ("model.cpu_offloading=0", ("model", "cpu_offloading", False)),
        ("model.recompute_granularity=null", ("model", "recompute_granularity", None)),
        ("model.recompute_granularity=None", ("model", "recompute_granularity", None)),
        ("model.recompute_granularity=full", ("model", "recompute_granularity", "full")),
        ('model.cuda_graph_impl="none"', ("model", "cuda_graph_impl", "none")),
        ("model.cuda_graph_impl=none", ("model", "cuda_graph_impl", "none")),
        ("++model.num_layers=16", ("model", "num_layers", 16)),
        ("+optimizer.optimizer='sgd'", ("optimizer", "optimizer", "sgd")),
        (" model.num_layers = 16 ", ("model", "num_layers", 16)),
    ],
)
def test_parse_override(text: str, expected: tuple[str, str, Any]) -> None:
    assert parse_override(text) == expected


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("model.cpu_offloading", "not of the form 'section.key=value'"),
        ("=3", "not of the form"),
        ("trainer.train_iters=20", "unknown override key 'trainer.train_iters'.*'model.<field>'"),
        ("cpu_offloading=True", "unknown override key 'cpu_offloading'"),
        ("model.cpu_offload=True", r"did you mean 'model.cpu_offloading'\?.*Known model keys"),
        ("optimizer.offload_fraction=0.5", "did you mean 'optimizer.optimizer_offload_fraction'"),
        (
            "model.zzz=1",
            r"unknown override key 'model.zzz'\. Known model keys: model.cpu_offloading",
        ),
        ("model.cpu_offloading=maybe", "bad value for model.cpu_offloading: 'maybe' is not a bool"),
        ("model.num_layers=4.0", "bad value for model.num_layers: '4.0' is not an int"),
        ("model.num_layers=four", "is not an int"),
        ("optimizer.optimizer_offload_fraction=half", "is not a float"),
        ("optimizer.optimizer_offload_fraction=nan", "is not a finite float"),
    ],
)
def test_override_errors(text: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        parse_override(text)


def test_apply_overrides() -> None:
    start = OptimizerOffloadConfig()
    act, opt = apply_overrides(
        [
            "model.cpu_offloading_num_layers=4",  # checked against num_layers only at the end
            "model.cpu_offloading=true",
            "model.num_layers=8",
            "optimizer.optimizer_cpu_offload=True",
            "optimizer.optimizer_offload_fraction=0.25",
            "optimizer.optimizer_offload_fraction=0.5",  # a later override wins
            "optimizer.overlap_cpu_optimizer_d2h_h2d=True",
        ],
        optimizer=start,
    )
    assert (act.cpu_offloading, act.cpu_offloading_num_layers, act.num_layers) == (True, 4, 8)
    assert (opt.optimizer_cpu_offload, opt.optimizer_offload_fraction) == (True, 0.5)
    assert opt.overlap_cpu_optimizer_d2h_h2d is True
    assert start == OptimizerOffloadConfig()  # inputs are not modified


def test_apply_overrides_validates_with_megatrons_messages() -> None:
    base = ActivationOffloadConfig(num_layers=8)
    with pytest.raises(ValueError, match=re.escape(MSG_PP)):
        apply_overrides(
            [
                "model.cpu_offloading=True",
                "model.cpu_offloading_num_layers=2",
                "model.pipeline_model_parallel_size=2",
            ],
            activation=base,
        )
    with pytest.raises(ValueError, match=re.escape(MSG_LAYERS.format(8))):
        apply_overrides(["model.cpu_offloading=True", "model.cpu_offloading_num_layers=8"], base)
    with pytest.raises(ValueError, match="optimizer_offload_fraction must be in"):
        apply_overrides(["optimizer.optimizer_offload_fraction=1.5"])


def test_apply_overrides_argument_types() -> None:
    with pytest.raises(TypeError, match="list"):
        apply_overrides("model.cpu_offloading=True")
    with pytest.raises(TypeError, match="override must be a str"):
        apply_overrides([3])  # type: ignore[list-item]


# ---------------------------------------------------------------------- offload_context


def test_offload_context_makes_megatrons_positional_call() -> None:
    cfg = ActivationOffloadConfig(
        cpu_offloading=True,
        cpu_offloading_num_layers=3,
        num_layers=12,
        cpu_offloading_activations=True,
        cpu_offloading_weights=False,
        cpu_offloading_double_buffering=True,
        cpu_offloading_retain_pinned_cpu_buffers=True,
    )
    sentinel = (object(), object())
    with mock.patch.object(
        cpu_offload, "get_cpu_offload_context", create=True, return_value=sentinel
    ) as fake:
        assert offload_context(cfg) is sentinel
    fake.assert_called_once_with(True, 3, 12, True, False, True, retain_pinned_cpu_buffers=True)


def test_offload_context_from_any_object_and_disabled() -> None:
    with mock.patch.object(
        cpu_offload, "get_cpu_offload_context", create=True, return_value=("ctx", "fn")
    ) as fake:
        assert offload_context(SimpleNamespace(num_layers=4)) == ("ctx", "fn")
    # Disabled, Megatron still makes the call (the function returns the disabled pair).
    fake.assert_called_once_with(False, 0, 4, True, False, False, retain_pinned_cpu_buffers=False)


def test_offload_context_validates_before_calling() -> None:
    with mock.patch.object(cpu_offload, "get_cpu_offload_context", create=True) as fake:
        cfg = ActivationOffloadConfig(num_layers=4)
        cfg.cpu_offloading = True
        cfg.recompute_granularity = "full"
        with pytest.raises(ValueError, match=re.escape(MSG_RECOMPUTE)):
            offload_context(cfg)
    fake.assert_not_called()


def test_offload_context_disabled_with_the_real_engine() -> None:
    if not hasattr(cpu_offload, "get_cpu_offload_context"):
        pytest.skip(
            "the activation-offload engine (cpu_offload.get_cpu_offload_context) is not there yet"
        )
    ctx, commit = offload_context(ActivationOffloadConfig())
    assert isinstance(ctx, contextlib.nullcontext)
    x = torch.randn(3, requires_grad=True)
    with ctx:
        y = x * 2
    assert commit(y) is y


# ---------------------------------------------------------------------- build_optimizer


def _params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(4, 4).parameters())


def test_build_plain_optimizers() -> None:
    opt = build_optimizer(_params(), OptimizerOffloadConfig(), lr=1e-3)
    assert type(opt) is torch.optim.AdamW and opt.defaults["lr"] == 1e-3
    opt = build_optimizer(_params(), OptimizerOffloadConfig(optimizer="sgd"), lr=0.1, momentum=0.9)
    assert type(opt) is torch.optim.SGD
    # The fraction alone does nothing without the master switch (as in Megatron).
    opt = build_optimizer(_params(), {"optimizer_offload_fraction": 1.0}, lr=1e-3)
    assert type(opt) is torch.optim.AdamW


def test_build_hybrid_optimizer() -> None:
    cfg = OptimizerOffloadConfig(
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=0.5,
        overlap_cpu_optimizer_d2h_h2d=True,
        pin_cpu_grads=False,
        pin_cpu_params=False,
    )
    opt = build_optimizer(_params(), cfg, lr=1e-3)
    assert isinstance(opt, HybridDeviceOptimizer)
    assert opt.offload_fraction == 0.5 and opt.overlap_cpu_optimizer_d2h_h2d is True
    assert (opt.pin_cpu_grads, opt.pin_cpu_params) == (False, False)
    assert opt.cpu_optimizer_cls is torch.optim.AdamW is opt.gpu_optimizer_cls
    assert opt.param_update_in_fp32 is True  # Megatron's choice
    opt = build_optimizer(_params(), cfg, lr=1e-3, param_update_in_fp32=False)
    assert opt.param_update_in_fp32 is False
    sgd = build_optimizer(_params(), dataclasses.replace(cfg, optimizer="sgd"), lr=0.1)
    assert sgd.cpu_optimizer_cls is torch.optim.SGD  # type: ignore[attr-defined]


def test_build_hybrid_optimizer_with_our_schedule_options() -> None:
    cfg = OptimizerOffloadConfig(
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=0.5,
        overlap_host_step_with_forward=True,
        offload_last_layers=True,
    )
    opt = build_optimizer(_params(), cfg, lr=1e-3)
    assert isinstance(opt, HybridDeviceOptimizer)
    assert opt.overlap_host_step_with_forward is True and opt.offload_last_layers is True
    assert (
        build_optimizer(
            _params(), dataclasses.replace(cfg, offload_last_layers=False), lr=1e-3
        ).offload_last_layers
        is False
    )  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="OptimizerOffloadConfig.offload_last_layers"):
        build_optimizer(_params(), cfg, lr=1e-3, offload_last_layers=False)
    with pytest.raises(TypeError, match="overlap_host_step_with_forward must be a bool"):
        OptimizerOffloadConfig(overlap_host_step_with_forward="yes")  # type: ignore[arg-type]


def test_stream_share_field_reaches_the_optimizer_and_is_checked() -> None:
    cfg = OptimizerOffloadConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    assert build_optimizer(_params(), cfg, lr=1e-3).stream_share == 0.0  # type: ignore[attr-defined]
    # The CPU stand-in has no CUDA parameter to stream: the optimizer says so.
    with pytest.raises(ValueError, match="stream_share=0.5 streams the fp32 state"):
        build_optimizer(
            [torch.nn.Parameter(torch.randn(4, 4))],
            dataclasses.replace(cfg, stream_share=0.5),
            lr=1e-3,
            is_device_param=lambda p: True,
        )
    with pytest.raises(TypeError, match="OptimizerOffloadConfig.stream_share"):
        build_optimizer(_params(), cfg, lr=1e-3, stream_share=0.5)
    with pytest.raises(ValueError, match=r"stream_share must be in \[0.0, 1.0\]"):
        OptimizerOffloadConfig(stream_share=1.5)
    with pytest.raises(TypeError, match="stream_share"):
        OptimizerOffloadConfig(stream_share="half")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer='sgd' has no such path"):
        OptimizerOffloadConfig(optimizer="sgd", stream_share=0.5)
    # Megatron Bridge-style containers carry it like any other field.
    read = OptimizerOffloadConfig.from_object({"optimizer_cpu_offload": True, "stream_share": 0.5})
    assert read.stream_share == 0.5


def test_build_from_bridge_container_and_unknown_optimizer() -> None:
    container = SimpleNamespace(
        optimizer=SimpleNamespace(
            optimizer="adam", optimizer_cpu_offload=True, optimizer_offload_fraction=1.0
        )
    )
    assert isinstance(build_optimizer(_params(), container, lr=1e-3), HybridDeviceOptimizer)
    with pytest.raises(ValueError, match="muon optimizer is not supported.*'adam', 'sgd'"):
        build_optimizer(_params(), OptimizerOffloadConfig(optimizer="muon"))
