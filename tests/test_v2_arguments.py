"""V2's ``get_cpu_offload_context`` arguments: disabled (types checked, values not), the
legacy flags, and the errors for bad values, streams and transports (no GPU needed).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import cpu_offload
from cpu_offload import HostTransport, v2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- disabled and legacy arguments -----------------------------------------------------


def _assert_disabled(result, manual=False):
    assert len(result) == (3 if manual else 2)
    ctx, sync = result[:2]
    assert isinstance(ctx, contextlib.nullcontext)
    t = torch.randn(3)
    assert sync(t) is t
    if manual:
        assert result[2] is None


def test_disabled_defaults():
    _assert_disabled(v2.get_cpu_offload_context())
    _assert_disabled(v2.get_cpu_offload_context(manual_synchronization=True), manual=True)
    _assert_disabled(v2.get_cpu_offload_context(False, 1, 1))


def test_disabled_checks_only_types():
    # Out-of-range values are fine when disabled...
    _assert_disabled(v2.get_cpu_offload_context(False, 99, 1))
    _assert_disabled(v2.get_cpu_offload_context(False, -1, 0))
    _assert_disabled(v2.get_cpu_offload_context(False, 5, 4, synchronization_dict={9: 1}))
    _assert_disabled(v2.get_cpu_offload_context(False, 1, 1, False, False))
    # ... wrong types are not.
    with pytest.raises(TypeError, match="num_layers"):
        v2.get_cpu_offload_context(False, 1.5, 4)
    with pytest.raises(TypeError, match="model_layers"):
        v2.get_cpu_offload_context(False, 1, "4")
    with pytest.raises(TypeError, match="double_buffering"):
        v2.get_cpu_offload_context(False, 1, 4, True, False, 1)
    with pytest.raises(TypeError, match="enabled"):
        v2.get_cpu_offload_context("yes", 1, 4)


def test_disabled_does_not_range_check_min_size():
    _assert_disabled(v2.get_cpu_offload_context(False, min_tensor_size_to_offload=-1))


def test_offload_weights_deprecated():
    with pytest.warns(DeprecationWarning, match="offload_weights"):
        ctx, sync = v2.get_cpu_offload_context(True, 1, 4, True, True, transport=HostTransport())
    assert isinstance(ctx, v2.OffloadContext)  # activations are still offloaded


def test_only_weights_gives_the_disabled_pair():
    with pytest.warns(DeprecationWarning):
        result = v2.get_cpu_offload_context(True, 1, 4, False, True, transport=HostTransport())
    _assert_disabled(result)
    with pytest.warns(DeprecationWarning):
        result = v2.get_cpu_offload_context(True, 1, 4, False, True, False, True)
    _assert_disabled(result, manual=True)


def test_nothing_to_offload():
    with pytest.raises(ValueError, match="nothing to offload"):
        v2.get_cpu_offload_context(True, 1, 4, False, False, transport=HostTransport())


@pytest.mark.parametrize(
    "value, error",
    [(-1, ValueError), (1.5, TypeError), ("256", TypeError), (None, TypeError), (True, TypeError)],
)
def test_bad_min_tensor_size(value, error):
    with pytest.raises(error, match="min_tensor_size_to_offload"):
        v2.get_cpu_offload_context(True, 1, 4, min_tensor_size_to_offload=value)


@pytest.mark.parametrize("stream", ["stream", 0, object()])
def test_offload_stream_must_be_a_cuda_stream(stream, monkeypatch):
    message = r"offload_stream must be a torch.cuda.Stream or None, got "
    with pytest.raises(TypeError, match=message):
        v2.get_cpu_offload_context(True, 1, 4, offload_stream=stream)
    # The top-level function checks it under either backend (V1 then ignores it).
    for v1 in ("0", "1"):
        monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", v1)
        with pytest.raises(TypeError, match=message):
            cpu_offload.get_cpu_offload_context(True, 1, 4, offload_stream=stream)


@pytest.mark.parametrize("transport", ["host", HostTransport, object()])
def test_bad_transport(transport):
    with pytest.raises(TypeError, match="transport"):
        v2.get_cpu_offload_context(True, 1, 4, transport=transport)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only default")
def test_default_transport_without_cuda_is_the_stand_in():
    ctx, _ = v2.get_cpu_offload_context(True, 1, 4)
    assert isinstance(ctx.offload_synchronizer.transport, HostTransport)
