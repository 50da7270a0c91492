"""measure_link's arguments (the measurement itself: test_link_cuda.py)."""

from __future__ import annotations

import pytest

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
