"""The V2 schedule: default k-of-n dicts, synchronization_dict validation, layer counts,
and the phase each layer state is in at each step of a hand-driven synchronizer (CPU).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from cpu_offload import HostTransport, v2
from cpu_offload.v2 import DefaultOffloadSynchronizer, ManualOffloadSynchronizer
from cpu_offload.v2.schedule import (
    Point,
    check_layer_counts,
    default_synchronization_dict,
    validate_synchronization_dict,
)

# -- Point ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 16])
def test_point_at_inverts_position_over_the_whole_iteration(n):
    points = [Point.at(p, n) for p in range(2 * n)]
    assert [pt.position(n) for pt in points] == list(range(2 * n))
    assert points[0] == Point(True, 0) and points[-1] == Point(False, 0)


@pytest.mark.parametrize("position", [-1, 8])
def test_point_at_refuses_a_position_outside_the_iteration(position):
    with pytest.raises(
        ValueError,
        match=rf"position must be in \[0, 2 \* num_layers - 1\] = \[0, 7\] for 4 layers.*got {position}",
    ):
        Point.at(position, 4)


# -- default_synchronization_dict ------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "k", "expected"),
    [
        (5, 2, {0: (True, 3, False, 2), 1: (True, 4, False, 3)}),
        (4, 1, {0: (True, 3, False, 2)}),
        (4, 3, {0: (True, 1, False, 0), 1: (True, 2, False, 1), 2: (True, 3, False, 2)}),
        (2, 1, {0: (True, 1, False, 0)}),
        (6, 0, {}),
        (1, 0, {}),
        (8, 3, {0: (True, 5, False, 4), 1: (True, 6, False, 5), 2: (True, 7, False, 6)}),
    ],
)
def test_default_synchronization_dict(n, k, expected):
    got = default_synchronization_dict(k, n)
    assert got == expected
    # Every default schedule is valid and survives validation unchanged.
    assert validate_synchronization_dict(got, n) == expected


# -- validate_synchronization_dict -----------------------------------------------------


@pytest.mark.parametrize(
    "sync",
    [
        {},
        {0: (True, 2, False, 1)},
        {0: (False, 4, False, 3)},  # finish when layer 4's backward begins
        {2: (True, 3, False, 2)},  # reload at the start of its own backward
        {1: (True, 3, True, 4)},  # reload during the forward, after the offload finished
        {1: (True, 3, True, 3)},  # reload at the very point the offload finishes
        {0: [True, 2, False, 1]},  # a list is accepted as the tuple
    ],
)
def test_validate_accepts_valid_dicts(sync):
    out = validate_synchronization_dict(sync, 5)
    assert out == {k: tuple(v) for k, v in sync.items()}
    assert all(isinstance(v, tuple) for v in out.values())


@pytest.mark.parametrize(
    ("sync", "exc", "words"),
    [
        ([(0, (True, 2, False, 1))], TypeError, ["synchronization_dict must be a dict"]),
        (None, TypeError, ["synchronization_dict must be a dict", "NoneType"]),
        ({"0": (True, 2, False, 1)}, TypeError, ["keys", "int", "str"]),
        ({1.0: (True, 2, False, 1)}, TypeError, ["keys", "int", "float"]),
        ({True: (True, 2, False, 1)}, TypeError, ["keys", "int", "bool"]),
        ({5: (True, 2, False, 1)}, ValueError, ["layer id 5", "out of range", "[0, 4]"]),
        ({-1: (True, 2, False, 1)}, ValueError, ["layer id -1", "out of range"]),
        ({0: (True, 2, False)}, TypeError, ["synchronization_dict[0]", "tuple"]),
        ({0: (True, 2, False, 1, 0)}, TypeError, ["synchronization_dict[0]", "tuple"]),
        ({0: "True,2,False,1"}, TypeError, ["synchronization_dict[0]", "tuple"]),
        ({0: (1, 2, False, 1)}, TypeError, ["offload_fwd", "bool"]),
        ({0: (True, 2, "no", 1)}, TypeError, ["reload_fwd", "bool"]),
        ({0: (True, 2.0, False, 1)}, TypeError, ["offload_num", "int"]),
        ({0: (True, 2, False, None)}, TypeError, ["reload_num", "int"]),
        ({0: (True, 5, False, 1)}, ValueError, ["offload_num=5", "out of range"]),
        ({0: (True, 2, False, -1)}, ValueError, ["reload_num=-1", "out of range"]),
        # The offload finishes before / at the layer's own forward.
        ({2: (True, 1, False, 0)}, ValueError, ["must finish after layer 2's own forward"]),
        ({2: (True, 2, False, 1)}, ValueError, ["must finish after layer 2's own forward"]),
        # The reload starts before the offload finished.
        ({0: (True, 3, True, 2)}, ValueError, ["before the offload finishes"]),
        ({0: (False, 1, False, 3)}, ValueError, ["before the offload finishes"]),
        # The reload starts after the layer's own backward began.
        ({2: (True, 3, False, 1)}, ValueError, ["after layer 2's own backward"]),
        ({3: (True, 4, False, 0)}, ValueError, ["after layer 3's own backward"]),
    ],
)
def test_validate_rejects_invalid_dicts(sync, exc, words):
    with pytest.raises(exc) as info:
        validate_synchronization_dict(sync, 5)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_invalid_dict_rejected_when_the_context_is_made():
    with pytest.raises(ValueError, match="before the offload finishes"):
        v2.get_cpu_offload_context(
            True,
            1,
            5,
            synchronization_dict={0: (True, 3, True, 2)},
            transport=HostTransport(),
        )


def test_synchronization_dict_ignores_num_layers():
    # num_layers would be out of range for the default schedule; with a dict it is unused.
    ctx, sync = v2.get_cpu_offload_context(
        True, 7, 4, synchronization_dict={1: (True, 2, False, 1)}, transport=HostTransport()
    )
    assert ctx.offload_synchronizer.schedule.offloaded == frozenset({1})


# -- layer counts ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "n", "exc", "word"),
    [
        (4, 4, ValueError, "[0, 3]"),
        (5, 4, ValueError, "got 5"),
        (-1, 4, ValueError, "got -1"),
        (1, 1, ValueError, "[0, 0]"),
        (0, 0, ValueError, "model_layers must be >= 1"),
        (0, -3, ValueError, "model_layers must be >= 1"),
        (1.0, 4, TypeError, "num_layers must be an int"),
        ("1", 4, TypeError, "num_layers must be an int"),
        (True, 4, TypeError, "num_layers must be an int"),
        (1, 4.0, TypeError, "model_layers must be an int"),
        (1, False, TypeError, "model_layers must be an int"),
    ],
)
def test_layer_count_errors(k, n, exc, word):
    with pytest.raises(exc) as info:
        check_layer_counts(k, n)
    assert word in str(info.value)
    with pytest.raises(exc) as info:
        v2.get_cpu_offload_context(True, k, n, transport=HostTransport())
    assert word.split()[0] in str(info.value)


@pytest.mark.parametrize("n", [2, 3, 6])
def test_warning_only_at_n_minus_1(n):
    with pytest.warns(UserWarning, match=f"num_layers={n - 1} = model_layers - 1"):
        assert check_layer_counts(n - 1, n) == (n - 1, n)
    with pytest.warns(UserWarning, match="overlap"):
        v2.get_cpu_offload_context(True, n - 1, n, transport=HostTransport())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_layer_counts(n - 2, n) == (n - 2, n)
        v2.get_cpu_offload_context(True, n - 2, n, transport=HostTransport())


@pytest.mark.parametrize(("n", "advice"), [(2, "from model_layers=3 on"), (6, "num_layers <= 4")])
def test_n_minus_1_warning_gives_advice_that_exists(n, advice):
    # With two layers it once advised "use num_layers <= 0 for overlap": offloading nothing.
    with pytest.warns(UserWarning) as record:
        check_layer_counts(n - 1, n)
    message = str(record[0].message)
    assert advice in message
    assert "<= 0" not in message


def test_no_warning_for_one_layer_model():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_layer_counts(0, 1) == (0, 1)


def test_default_synchronizer_rejects_bad_k():
    with pytest.raises(
        ValueError, match=r"num_offloaded_layers must be in \[0, num_layers - 1\] = \[0, 3\]"
    ):
        DefaultOffloadSynchronizer(4, 4, transport=HostTransport())
    with pytest.raises(ValueError, match="num_offloaded_layers"):
        DefaultOffloadSynchronizer(4, -1, transport=HostTransport())
    # None means n-1 (the reference's default).
    sync = DefaultOffloadSynchronizer(4, transport=HostTransport())
    assert sync.schedule.offloaded == frozenset({0, 1, 2})


# -- driving a synchronizer by hand ----------------------------------------------------


def _drive(sync, n, size=(32, 32)):
    """One iteration by hand. Returns the phase trace and what was pushed and popped.

    trace[(event, layer_id)] = [state of each layer right after the event]
    """
    trace: dict[tuple[str, int], list[str]] = {}
    pushed: dict[int, tuple[torch.Tensor, object]] = {}
    for expected in range(n):
        layer = sync.fwd_step()
        assert layer == expected
        t = torch.randn(*size)
        pushed[layer] = (t, sync.push_tensor(t))
        trace[("fwd", layer)] = [s.state for s in sync.layers]
    popped: dict[int, torch.Tensor] = {}
    for layer in reversed(range(n)):
        sync.bwd_step(layer)
        trace[("bwd", layer)] = [s.state for s in sync.layers]
        popped[layer] = sync.pop_tensor(pushed[layer][1])
    sync.finish_part_of_bwd()
    trace[("end", 0)] = [s.state for s in sync.layers]
    return trace, pushed, popped


def _steps(n):
    return [("fwd", i) for i in range(n)] + [("bwd", i) for i in reversed(range(n))]


def _check_phases(trace, n, schedule):
    """Each offloaded layer's phase at each step follows ``schedule`` (a sync dict)."""
    steps = _steps(n)
    position = {s: i for i, s in enumerate(steps)}
    for layer in range(n):
        if layer not in schedule:
            assert all(trace[s][layer] == "not_offloaded" for s in steps), layer
            continue
        offload_fwd, offload_num, reload_fwd, reload_num = schedule[layer]
        finish = position[("fwd" if offload_fwd else "bwd", offload_num)]
        reload = position[("fwd" if reload_fwd else "bwd", reload_num)]
        own_fwd = position[("fwd", layer)]
        for i, s in enumerate(steps):
            state = trace[s][layer]
            if i <= own_fwd:
                want = "not_offloaded"  # its forward is still running
            elif i < finish:
                want = "offload_started"
            elif i < reload:
                want = "offload_finished"
            else:
                want = "reload_started"
            assert state == want, (layer, s, state, want)
    assert trace[("end", 0)] == ["not_offloaded"] * n


@pytest.mark.parametrize(("n", "k"), [(5, 2), (4, 1), (4, 3), (2, 1), (3, 0), (6, 4)])
def test_default_synchronizer_phases(n, k):
    transport = HostTransport()
    sync = DefaultOffloadSynchronizer(n, k, transport=transport)
    trace, pushed, popped = _drive(sync, n)
    _check_phases(trace, n, default_synchronization_dict(k, n))
    # The rule of the spec, stated directly.
    for i in range(k):
        assert trace[("fwd", n - k + i)][i] == "offload_finished"
        if n - k + i - 1 > i:
            assert trace[("fwd", n - k + i - 1)][i] == "offload_started"
        assert trace[("bwd", n - k + i)][i] == "offload_finished"
        assert trace[("bwd", n - k + i - 1)][i] == "reload_started"
    for layer in range(n):
        t, packed = pushed[layer]
        if layer < k:
            assert not isinstance(packed, torch.Tensor)
            assert torch.equal(popped[layer], t)
            assert popped[layer].data_ptr() != t.data_ptr()
        else:
            assert packed is t  # untouched, at no cost
            assert popped[layer] is t
    nbytes = 32 * 32 * 4
    assert transport.bytes_offloaded == transport.bytes_reloaded == k * nbytes


def test_default_synchronizer_next_iteration():
    transport = HostTransport()
    sync = DefaultOffloadSynchronizer(5, 2, transport=transport)
    _drive(sync, 5)
    allocations = transport.pool.allocations
    assert allocations == 2
    first = sync.iteration
    trace, _, popped = _drive(sync, 5)
    assert sync.iteration == first + 1
    _check_phases(trace, 5, default_synchronization_dict(2, 5))
    assert transport.pool.allocations == allocations


@pytest.mark.parametrize(
    "schedule",
    [
        # Offloads finish in backward; reloads in forward and backward.
        {0: (False, 4, False, 1), 2: (True, 4, True, 4), 1: (True, 3, False, 3)},
        {3: (False, 4, False, 3)},
        {0: (True, 1, False, 0), 1: (True, 2, False, 1)},
    ],
)
def test_custom_synchronization_dict_phases(schedule):
    n = 5
    transport = HostTransport()
    sync = DefaultOffloadSynchronizer(
        n, synchronization_dict=validate_synchronization_dict(schedule, n), transport=transport
    )
    trace, pushed, popped = _drive(sync, n)
    _check_phases(trace, n, schedule)
    for layer in range(n):
        t, packed = pushed[layer]
        assert torch.equal(popped[layer], t)
        assert (packed is t) == (layer not in schedule)
    assert transport.bytes_offloaded == len(schedule) * 32 * 32 * 4


def test_offloaded_layer_without_tensors_moves_nothing():
    sync = DefaultOffloadSynchronizer(3, 1, transport=HostTransport())
    for _ in range(3):
        sync.fwd_step()  # nothing pushed
    assert sync.get_offloaded_total_size_mb() == 0
    for layer in reversed(range(3)):
        sync.bwd_step(layer)
    sync.finish_part_of_bwd()
    assert [s.state for s in sync.layers] == ["not_offloaded"] * 3
    assert sync.transport.bytes_offloaded == sync.transport.pool.allocations == 0


def test_is_layer_offloaded():
    sync = DefaultOffloadSynchronizer(5, 2, transport=HostTransport())
    assert [sync.is_layer_offloaded(i) for i in range(5)] == [True, True, False, False, False]


# -- the manual synchronizer -----------------------------------------------------------


def _manual(n=3):
    sync = ManualOffloadSynchronizer(n, transport=HostTransport())
    tensors = []
    for _ in range(n):
        sync.fwd_step()
        t = torch.randn(16, 16)
        tensors.append((t, sync.push_tensor(t)))
    return sync, tensors


def _assert_state_error(info, method, state, allowed):
    msg = str(info.value)
    assert method in msg and f"'{state}'" in msg and allowed in msg, msg


def test_manual_release_before_start():
    sync, _ = _manual()
    with pytest.raises(RuntimeError) as info:
        sync.release_activation_forward_gpu_memory(1)
    _assert_state_error(
        info, "release_activation_forward_gpu_memory", "not_offloaded", "offload_started"
    )


def test_manual_reload_before_release():
    sync, _ = _manual()
    with pytest.raises(RuntimeError) as info:
        sync.start_reload_layer(0)
    _assert_state_error(info, "start_reload", "not_offloaded", "offload_finished")
    sync.start_offload_layer(0)
    with pytest.raises(RuntimeError) as info:
        sync.start_reload_layer(0)
    _assert_state_error(info, "start_reload", "offload_started", "offload_finished")
    with pytest.raises(RuntimeError) as info:
        sync.start_offload_layer(0)
    _assert_state_error(info, "start_offload", "offload_started", "not_offloaded")


def test_manual_round_trip_and_untouched_layers():
    sync, tensors = _manual()
    sync.start_offload_layer(1)
    sync.release_activation_forward_gpu_memory(1)
    sync.start_reload_layer(1)
    assert [s.state for s in sync.layers] == ["not_offloaded", "reload_started", "not_offloaded"]
    for layer in reversed(range(3)):
        sync.bwd_step(layer)
        t, packed = tensors[layer]
        out = sync.pop_tensor(packed)
        assert torch.equal(out, t)
        # A layer for which nothing was called is simply not offloaded.
        assert (out is t) == (layer != 1)
    sync.finish_part_of_bwd()
    assert sync.transport.bytes_offloaded == 16 * 16 * 4


@pytest.mark.parametrize(
    ("layer_id", "exc"), [(3, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)]
)
def test_manual_layer_id_checked(layer_id, exc):
    sync, _ = _manual()
    for method in (
        sync.start_offload_layer,
        sync.release_activation_forward_gpu_memory,
        sync.start_reload_layer,
    ):
        with pytest.raises(exc, match="layer_id"):
            method(layer_id)
