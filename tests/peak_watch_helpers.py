"""Stand-ins shared by the peak watch's tests (NOTE [Bytes that pay]): the running peak a
test sets, random windows, and a small GPT on the CPU whose attention saves strided
views of one projection."""

from __future__ import annotations

import random

from helpers import StepResult, step

from cpu_offload import HostTransport
from cpu_offload.engine.peak_watch import Window
from cpu_offload.models import ModelSpec, build_layers


class Reads:
    """The running peak the watch reads: set by the test before each read."""

    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


class PeakTransport(HostTransport):
    """The CPU stand-in with a running peak the test raises where it wants the step's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def peak_allocated(self) -> int:
        return self.peak


def random_windows(rng: random.Random) -> tuple[int, list[Window]]:
    """A random number of points, and one to four windows within them."""
    points = rng.randint(3, 12)
    windows = []
    for layer in range(rng.randint(1, 4)):
        start = rng.randint(0, points - 2)
        windows.append(Window(layer, start, rng.randint(start + 1, points - 1)))
    return points, windows


def small_gpt(layers: int):
    """A small GPT of ``layers`` blocks on the CPU, its input maker and a step without
    offloading. Its attention saves q, k and v as strided views of one projection."""
    spec = ModelSpec(kind="gpt", hidden=64, heads=4, seq=64, batch=2, layers=layers)
    blocks = build_layers(spec, "cpu")

    def make():
        return spec.make_input("cpu", seed=1)

    ref: StepResult = step(blocks, make)
    return blocks, make, ref
