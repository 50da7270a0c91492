"""One random state for every step of a comparison, so that dropout compares exactly.

Offloading does not draw random numbers, so a variant run from the same generator state
as the reference draws the same dropout masks, and any difference left is offloading's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["SameRandomState"]


class SameRandomState:
    """The CPU generator's state (and every CUDA device's, when ``cuda``), taken now.

    :meth:`replay` runs a block from that state and puts back the state it found, so
    the caller's random numbers do not change either.

    Args:
        cuda: Take the CUDA generators too (CUDA must be available).

    Example:
        >>> state = SameRandomState(cuda=False)
        >>> with state.replay():
        ...     first = torch.rand(3)
        >>> with state.replay():
        ...     again = torch.rand(3)
        >>> torch.equal(first, again)
        True
    """

    def __init__(self, cuda: bool) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if cuda else None

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block from the state taken; restore the generators afterwards."""
        devices = list(range(len(self.cuda))) if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)
            yield
