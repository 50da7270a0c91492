"""measure_link's arguments and its choice among repeats (the measurement itself:
test_link_cuda.py)."""

from __future__ import annotations

import pytest

from cpu_offload._link import fastest_clean
from cpu_offload.compare import measure_link


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"nbytes": 0}, ValueError, "nbytes must be at least 1, got 0"),
        ({"repeats": 0}, ValueError, "repeats must be at least 1, got 0"),
        ({"repeats": 2.5}, TypeError, "repeats must be an int, got float"),
        ({"nbytes": True}, TypeError, "nbytes must be an int, got bool"),
    ],
)
def test_bad_arguments_are_refused_before_any_device_work(kwargs, error, match):
    with pytest.raises(error, match=match):
        measure_link(**kwargs)


def test_the_fastest_clean_repeat_counts_and_a_late_one_does_not():
    times = iter([3.0, 2.0, 9.0, 2.5])
    late = iter([False, False, True, False])
    holds = []

    def run(hold):
        holds.append(hold)
        return next(times), next(late)

    # The 9 ms repeat ran after the spin had ended: left out, and the spin doubles.
    assert fastest_clean(run, repeats=3, hold=50) == (2.0, 100)
    assert holds == [50, 50, 50, 100]


def test_repeats_that_are_always_late_end_and_the_fastest_of_them_counts():
    calls = []

    def run(hold):
        calls.append(hold)
        return 10.0 - len(calls), True

    ms, hold = fastest_clean(run, repeats=2, hold=1)
    assert len(calls) == 4  # at most twice the repeats asked for
    assert (ms, hold) == (6.0, 16)
