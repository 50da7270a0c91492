"""The ``NVTE_CPU_OFFLOAD_V1`` switch between the V1 and V2 backends.

The variable is read each time a top-level function that differs between the backends
is called (not once at import), so that a program, a test or a notebook that sets it
before making its offload context gets the backend it asked for, and an invalid value
fails where the backend is chosen, with an error naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["ENV_VAR", "use_v1"]

ENV_VAR = "NVTE_CPU_OFFLOAD_V1"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def use_v1(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``NVTE_CPU_OFFLOAD_V1`` selects the V1 backend.

    Args:
        environ: The environment to read; ``os.environ`` by default.

    Returns:
        True for 1/true/yes/on, False for 0/false/no/off, empty or unset (any case,
        surrounding spaces ignored).

    Raises:
        ValueError: For any other value, naming the variable and the accepted values.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_VAR)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{ENV_VAR}={raw!r} is not understood: use 1/true/yes/on for the V1 backend, "
        "0/false/no/off (or leave it unset or empty) for V2; any case"
    )
