"""The step's lane failing part-way (``cpu_offload/optim/_step.py``): readers are marked
for what was queued, and the lane's error is the one raised, an error of the marking
added to it, never raised in its place."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from cpu_offload.optim._step import _mark_after_failure


class _Overlap:
    def __init__(self, fails: bool) -> None:
        self.fails = fails
        self.marked: list[Any] = []

    def mark_queued(self, entries: list[Any]) -> None:
        self.marked.append(list(entries))
        if self.fails:
            raise RuntimeError("marking failed")


def test_the_queued_entries_are_marked_and_nothing_is_added() -> None:
    overlap = _Overlap(fails=False)
    failed = RuntimeError("the lane failed")
    _mark_after_failure(overlap, ["a", "b"], failed)  # type: ignore[arg-type,list-item]
    assert overlap.marked == [["a", "b"]]
    assert not getattr(failed, "__notes__", [])


def test_an_error_of_the_marking_goes_onto_the_lanes_error() -> None:
    overlap = _Overlap(fails=True)
    failed = RuntimeError("the lane failed")
    if sys.version_info >= (3, 11):
        _mark_after_failure(overlap, ["a"], failed)  # type: ignore[arg-type,list-item]
        assert failed.__notes__ == [
            "marking the streamed parameters for their readers also failed: "
            "RuntimeError('marking failed')"
        ]
    else:
        with pytest.warns(RuntimeWarning, match="marking failed"):
            _mark_after_failure(overlap, ["a"], failed)  # type: ignore[arg-type,list-item]
    assert overlap.marked == [["a"]]


def test_an_interrupt_of_the_marking_is_not_swallowed() -> None:
    class _Interrupted(_Overlap):
        def mark_queued(self, entries: list[Any]) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _mark_after_failure(_Interrupted(False), [], RuntimeError("x"))  # type: ignore[arg-type]
