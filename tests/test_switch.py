"""The NVTE_CPU_OFFLOAD_V1 switch: accepted values, the backend the top-level function
picks, V2-only arguments under V1, and when the variable is read.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cpu_offload
from cpu_offload import HostTransport
from cpu_offload._switch import ENV_VAR, use_v1
from cpu_offload.v1 import CpuOffloadHookWithOffloadHandler
from cpu_offload.v2 import OffloadContext
from cpu_offload.v2.context import DEFAULT_MIN_TENSOR_SIZE

SRC = Path(__file__).resolve().parents[1] / "src"

TRUE = ["1", "true", "True", "TRUE", "yes", "YES", "on", "On", "  1 ", "\ttrue\n"]
FALSE = ["0", "false", "False", "no", "NO", "off", "OFF", "", "   ", " 0 "]
BAD = ["2", "maybe", "v1", "10", "y", "n", "-1", "true1", "enable"]


def test_variable_name():
    assert ENV_VAR == "NVTE_CPU_OFFLOAD_V1"


@pytest.mark.parametrize("value", TRUE)
def test_true_values(value, monkeypatch):
    assert use_v1({ENV_VAR: value}) is True
    monkeypatch.setenv(ENV_VAR, value)
    assert use_v1() is True
    assert cpu_offload.backend() == "v1"


@pytest.mark.parametrize("value", FALSE)
def test_false_values(value, monkeypatch):
    assert use_v1({ENV_VAR: value}) is False
    monkeypatch.setenv(ENV_VAR, value)
    assert use_v1() is False
    assert cpu_offload.backend() == "v2"


def test_unset(monkeypatch):
    assert use_v1({}) is False
    assert use_v1({"OTHER": "1"}) is False
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert use_v1() is False
    assert cpu_offload.backend() == "v2"


@pytest.mark.parametrize("value", BAD)
def test_rejected_values(value, monkeypatch):
    with pytest.raises(ValueError) as info:
        use_v1({ENV_VAR: value})
    msg = str(info.value)
    assert ENV_VAR in msg and repr(value) in msg
    for accepted in ("1/true/yes/on", "0/false/no/off", "unset", "any case"):
        assert accepted in msg, msg
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(ValueError, match=ENV_VAR):
        cpu_offload.backend()
    with pytest.raises(ValueError, match=ENV_VAR):
        cpu_offload.get_cpu_offload_context()  # even disabled: the backend is chosen first


# -- the backend the top-level function picks ------------------------------------------


@pytest.mark.parametrize("value", [None, "0", "false", ""])
def test_top_level_is_v2(value, monkeypatch):
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)
    ctx, sync = cpu_offload.get_cpu_offload_context(True, 1, 3, transport=HostTransport())
    assert isinstance(ctx, OffloadContext)
    assert ctx.offload_synchronizer.schedule.offloaded == frozenset({0})
    ctx, sync, manual = cpu_offload.get_cpu_offload_context(
        True, 1, 3, manual_synchronization=True, transport=HostTransport()
    )
    assert manual is ctx.offload_synchronizer


@pytest.mark.parametrize("value", ["1", "true", "ON"])
def test_top_level_is_v1(value, monkeypatch):
    monkeypatch.setenv(ENV_VAR, value)
    ctx, commit = cpu_offload.get_cpu_offload_context(True, 1, 3)
    assert isinstance(ctx, CpuOffloadHookWithOffloadHandler)
    assert ctx.offload_handler.num_offload_group == 1
    assert ctx.offload_handler.num_model_group == 3
    # V1 allows k == n (V2 does not).
    ctx, commit = cpu_offload.get_cpu_offload_context(True, 3, 3, True, False, True)
    assert ctx.offload_handler.double_buffering is True
    transport = HostTransport()
    ctx, commit = cpu_offload.get_cpu_offload_context(True, 1, 2, transport=transport)
    assert ctx.offload_handler.transport is transport


def test_top_level_v1_disabled(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    ctx, commit = cpu_offload.get_cpu_offload_context()
    assert isinstance(ctx, contextlib.nullcontext)
    t = torch.randn(2)
    assert commit(t) is t


def test_top_level_v1_runs_a_layer_loop(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    ctx, commit = cpu_offload.get_cpu_offload_context(True, 1, 2)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(2)]
    x = torch.randn(8, 16)
    ref = layers[1](layers[0](x)).sum()
    for layer in layers:
        cpu_offload.mark_activation_offload(x)
        with ctx:
            x = layer(x)
        x = commit(x)
    assert torch.equal(x.sum(), ref)
    x.sum().backward()
    assert ctx.offload_handler.transport.bytes_offloaded == 8 * 16 * 4


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"manual_synchronization": True}, "manual_synchronization"),
        ({"synchronization_dict": {0: (True, 1, False, 0)}}, "synchronization_dict"),
        ({"synchronization_dict": {}}, "synchronization_dict"),
    ],
)
@pytest.mark.parametrize("enabled", [True, False])
def test_contract_arguments_rejected_under_v1(kwargs, name, enabled, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    with pytest.raises(ValueError) as info:
        cpu_offload.get_cpu_offload_context(enabled, 1, 2, **kwargs)
    msg = str(info.value)
    assert name in msg and ENV_VAR in msg, msg
    monkeypatch.setenv(ENV_VAR, "0")  # the same call is fine under V2
    cpu_offload.get_cpu_offload_context(enabled, 1, 3, **kwargs, transport=HostTransport())


def test_both_contract_arguments_named_together(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "yes")
    with pytest.raises(ValueError) as info:
        cpu_offload.get_cpu_offload_context(
            True, 1, 2, manual_synchronization=True, synchronization_dict={}
        )
    msg = str(info.value)
    assert "manual_synchronization and synchronization_dict are V2-only" in msg, msg


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"retain_pinned_cpu_buffers": True}, ["retain_pinned_cpu_buffers"]),
        ({"min_tensor_size_to_offload": 1}, ["min_tensor_size_to_offload"]),
        ({"memory_budget": 1 << 30}, ["memory_budget"]),
        (
            {"retain_pinned_cpu_buffers": True, "min_tensor_size_to_offload": 0},
            ["retain_pinned_cpu_buffers", "min_tensor_size_to_offload"],
        ),
    ],
)
def test_tuning_arguments_warn_once_under_v1(kwargs, names, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    with pytest.warns(UserWarning) as record:
        ctx, commit = cpu_offload.get_cpu_offload_context(True, 1, 2, **kwargs)
    assert isinstance(ctx, CpuOffloadHookWithOffloadHandler)
    ours = [str(w.message) for w in record if "no effect under V1" in str(w.message)]
    assert len(ours) == 1, ours
    assert all(name in ours[0] for name in names), ours[0]
    assert record[0].filename == __file__


def test_tuning_arguments_quiet_when_disabled_under_v1(monkeypatch, recwarn):
    monkeypatch.setenv(ENV_VAR, "1")
    ctx, _ = cpu_offload.get_cpu_offload_context(False, 1, 2, retain_pinned_cpu_buffers=True)
    assert isinstance(ctx, contextlib.nullcontext)
    assert not [w for w in recwarn if "no effect under V1" in str(w.message)]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"retain_pinned_cpu_buffers": 1}, "retain_pinned_cpu_buffers"),
        ({"min_tensor_size_to_offload": 1.5}, "min_tensor_size_to_offload"),
        ({"offload_stream": object()}, "offload_stream"),
        ({"memory_budget": 1.5e9}, "memory_budget"),
    ],
)
def test_tuning_arguments_type_checked_under_v1(kwargs, name, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    with pytest.raises(TypeError, match=name):
        cpu_offload.get_cpu_offload_context(True, 1, 2, **kwargs)


def test_megatron_positional_call_with_retained_buffers_under_v1(tmp_path):
    """Megatron-Core's call, with the variable set before the process starts, trains."""
    script = textwrap.dedent(
        """
        import warnings
        import torch
        import cpu_offload
        from cpu_offload.v1 import CpuOffloadHookWithOffloadHandler

        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            ctx, commit = cpu_offload.get_cpu_offload_context(
                True, 1, 2, True, False, False, retain_pinned_cpu_buffers=True
            )
        assert isinstance(ctx, CpuOffloadHookWithOffloadHandler), type(ctx)
        ours = [w for w in record if "no effect under V1" in str(w.message)]
        assert len(ours) == 1, [str(w.message) for w in record]
        torch.manual_seed(0)
        layers = [torch.nn.Linear(16, 16) for _ in range(2)]
        x0 = torch.randn(8, 16, requires_grad=True)
        x = x0
        for layer in layers:
            with ctx:
                cpu_offload.mark_activation_offload(x)
                x = layer(x)
            x = commit(x)
        x.sum().backward()
        grads = [p.grad.clone() for layer in layers for p in layer.parameters()]
        for layer in layers:
            layer.zero_grad()
        y0 = x0.detach().requires_grad_()
        layers[1](layers[0](y0)).sum().backward()
        ref = [p.grad for layer in layers for p in layer.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(grads, ref))
        assert torch.equal(x0.grad, y0.grad)
        print("trained")
        """
    )
    env = dict(os.environ)
    env[ENV_VAR] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["trained"], proc.stdout


def test_v2_only_defaults_pass_under_v1(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    ctx, commit = cpu_offload.get_cpu_offload_context(
        True,
        1,
        2,
        True,
        False,
        False,
        False,
        False,
        None,
        synchronization_dict=None,
        min_tensor_size_to_offload=DEFAULT_MIN_TENSOR_SIZE,
    )
    assert isinstance(ctx, CpuOffloadHookWithOffloadHandler)


def test_num_layers_none_under_v1(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    with pytest.raises(TypeError, match="num_layers"):
        cpu_offload.get_cpu_offload_context(True, None, 2)


def test_variable_read_at_each_call(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    ctx, _ = cpu_offload.get_cpu_offload_context(True, 1, 3, transport=HostTransport())
    assert isinstance(ctx, CpuOffloadHookWithOffloadHandler)
    monkeypatch.setenv(ENV_VAR, "0")
    ctx, _ = cpu_offload.get_cpu_offload_context(True, 1, 3, transport=HostTransport())
    assert isinstance(ctx, OffloadContext)
    monkeypatch.delenv(ENV_VAR)
    ctx, _ = cpu_offload.get_cpu_offload_context(True, 1, 3, transport=HostTransport())
    assert isinstance(ctx, OffloadContext)
    monkeypatch.setenv(ENV_VAR, "on")
    ctx, _ = cpu_offload.get_cpu_offload_context(True, 1, 3, transport=HostTransport())
    assert isinstance(ctx, CpuOffloadHookWithOffloadHandler)


def test_invalid_value_fails_at_the_call_not_at_import():
    script = textwrap.dedent(
        f"""
        import os
        import cpu_offload.v1
        import cpu_offload.v2
        import cpu_offload
        from cpu_offload.v1 import CpuOffloadHookWithOffloadHandler
        from cpu_offload.v2 import OffloadContext

        print("imported")
        # Both backends stay usable directly whatever the variable says.
        assert cpu_offload.v2.get_cpu_offload_context()[1](3) == 3
        assert cpu_offload.v1.get_cpu_offload_context()[1](4) == 4
        try:
            cpu_offload.get_cpu_offload_context(True, 1, 2)
        except ValueError as err:
            assert "{ENV_VAR}" in str(err), err
            print("refused")
        os.environ["{ENV_VAR}"] = "1"  # set after import: read at the next call
        ctx, _ = cpu_offload.get_cpu_offload_context(True, 1, 2)
        assert isinstance(ctx, CpuOffloadHookWithOffloadHandler), type(ctx)
        os.environ["{ENV_VAR}"] = "off"
        ctx, _ = cpu_offload.get_cpu_offload_context(True, 1, 3)
        assert isinstance(ctx, OffloadContext), type(ctx)
        print("switched")
        """
    )
    env = dict(os.environ)
    env[ENV_VAR] = "maybe"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""  # the defaults must then be the CPU stand-in
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["imported", "refused", "switched"], proc.stdout


# -- warnings through the top-level function -------------------------------------------


@pytest.mark.parametrize(
    ("value", "args", "category"),
    [
        ("0", (True, 1, 3, True, True), DeprecationWarning),
        ("0", (True, 2, 3), UserWarning),
        ("1", (True, 1, 3, True, True), DeprecationWarning),
    ],
)
def test_top_level_warnings_point_at_the_caller(value, args, category, monkeypatch):
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.warns(category) as record:
        cpu_offload.get_cpu_offload_context(*args, transport=HostTransport())
    ours = [w for w in record if issubclass(w.category, category)]
    assert ours and all(w.filename == __file__ for w in ours), [w.filename for w in ours]
