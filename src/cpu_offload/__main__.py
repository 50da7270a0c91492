"""``python -m cpu_offload``: the same as the ``cpu-offload`` console script."""

from .cli import main

raise SystemExit(main())
