"""The torch-release matrix: what each entry pins, and whether it runs here.

Pure Python (no nox, no torch), so that ``noxfile.py`` imports it and
``tests/test_matrix.py`` tests it on any machine. The decision whether an entry runs
is :func:`decide`, a function of explicit numbers (free disk, elapsed time), so that it
can be tested without filling a disk.

Each entry's pin lives in ``compat/torch-<release>.txt``, a pip/uv constraints file that
is passed to *every* install of that entry (torch itself, then the package with its
test extra), so that installing ``cpu-offload`` can never pull another torch.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

COMPAT_DIR = Path(__file__).resolve().parent

GiB = 1024**3

#: Disk an install from the registry takes: a CUDA build of torch with its nvidia-*
#: wheels, unpacked in uv's cache (the venv hardlinks into it). Measured: 7.2 GB for
#: torch 2.10.0 (cu128); the cu13 builds are of the same size or larger.
CUDA_BUILD_BYTES = 8 * GiB
#: Disk the CPU wheel on this machine takes once unpacked, with torch's dependencies.
LOCAL_WHEEL_BYTES = 1 * GiB
#: Kept free beyond an entry's own install (pytest, logs, the rest of the machine).
MARGIN_BYTES = 2 * GiB

#: Wall time CI gives one run of ``.ci/run`` is 90 minutes; an optional entry is started
#: only if it is expected to end by this point, leaving room for clone, setup and the
#: entries already started.
DEFAULT_BUDGET_S = 75 * 60


@dataclass(frozen=True)
class Entry:
    """One torch release of the matrix."""

    torch: str
    #: Required entries always run; optional ones only when disk and time allow.
    required: bool
    #: Why this release is in the matrix (one line, shown in the summary).
    why: str
    #: Expected from a find-links directory (pip's own configuration) as a CPU wheel.
    local_wheel: bool = False
    #: Expected wall time of install plus tests on 2 cores, for the time budget.
    expected_s: int = 8 * 60

    @property
    def id(self) -> str:
        """The nox parameter id and tag: ``torch-2.10.0``."""
        return f"torch-{self.torch}"

    @property
    def constraints(self) -> Path:
        """The constraints file that pins this entry: ``compat/torch-2.10.0.txt``."""
        return COMPAT_DIR / f"torch-{self.torch}.txt"

    def needed_bytes(self, wheel_found: bool) -> int:
        """Free disk this entry needs before it starts (install plus margin)."""
        install = LOCAL_WHEEL_BYTES if (self.local_wheel and wheel_found) else CUDA_BUILD_BYTES
        return install + MARGIN_BYTES


#: In run order: the required entries first, so that the optional ones are decided on
#: the disk and time that remain after them.
ENTRIES: tuple[Entry, ...] = (
    Entry(
        "2.13.0",
        required=True,
        why="the CPU wheel that lies on this machine (find-links)",
        local_wheel=True,
        expected_s=4 * 60,
    ),
    Entry(
        "2.10.0",
        required=True,
        why="below 2.11: no pinned allocation during CUDA graph capture",
    ),
    Entry("2.6.0", required=False, why="oldest supported release"),
    Entry("2.15.0", required=False, why="newest release on PyPI"),
)


def entry(torch: str) -> Entry:
    """The entry for a torch release string such as ``"2.10.0"``."""
    for e in ENTRIES:
        if e.torch == torch:
            return e
    raise KeyError(f"no matrix entry for torch {torch!r}; entries: {[e.torch for e in ENTRIES]}")


@dataclass(frozen=True)
class Decision:
    """Whether an entry runs now, and the plain-words reason."""

    run: bool
    reason: str


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def decide(
    e: Entry,
    *,
    free_bytes: int,
    elapsed_s: float,
    budget_s: float = DEFAULT_BUDGET_S,
    wheel_found: bool = False,
    cached: bool = False,
) -> Decision:
    """Decide whether matrix entry ``e`` runs, given the disk and time left.

    Args:
        e: The entry.
        free_bytes: Free disk where the venvs and uv's cache live (the smaller of both).
        elapsed_s: Seconds since the matrix started.
        budget_s: Seconds after which no optional entry should still be running.
        wheel_found: Whether the entry's local CPU wheel was found in a find-links directory.
        cached: Whether the entry's packages are already in uv's cache (an offline
            install succeeded), so that it needs no new disk.

    Returns:
        A :class:`Decision`. Required entries always run (the reason then warns when the
        disk looks too small, and the install fails loudly if it is); optional entries
        are left out when they would not fit on the disk or in the time budget.
    """
    need = 0 if cached else e.needed_bytes(wheel_found)
    source = (
        "from uv's cache"
        if cached
        else ("local CPU wheel" if e.local_wheel and wheel_found else "CUDA build from PyPI")
    )
    disk_ok = free_bytes >= need
    if e.required:
        if disk_ok:
            return Decision(True, f"required; {source}; {_gb(free_bytes)} free")
        return Decision(
            True,
            f"required, so run anyway although only {_gb(free_bytes)} is free and the "
            f"{source} needs about {_gb(need)}",
        )
    if not disk_ok:
        return Decision(
            False,
            f"only {_gb(free_bytes)} free on disk, the {source} needs about {_gb(need)}",
        )
    if elapsed_s + e.expected_s > budget_s:
        return Decision(
            False,
            f"{elapsed_s / 60:.1f} min elapsed, about {e.expected_s / 60:.0f} min more would "
            f"pass the time budget of {budget_s / 60:.0f} min",
        )
    return Decision(True, f"optional; {source}; {_gb(free_bytes)} free")


def free_bytes(paths: Iterable[str | os.PathLike[str]]) -> int:
    """The smallest free space among the file systems holding ``paths``.

    A path that does not exist yet is measured at its nearest existing parent.
    """
    free: list[int] = []
    for p in paths:
        path = Path(p).resolve()
        while not path.exists():
            path = path.parent
        free.append(shutil.disk_usage(path).free)
    if not free:
        raise ValueError("no path given")
    return min(free)


def uv_cache_dir(environ: dict[str, str] | None = None) -> Path:
    """Where uv keeps its cache (``UV_CACHE_DIR``, else the XDG cache home)."""
    env = os.environ if environ is None else environ
    if env.get("UV_CACHE_DIR"):
        return Path(env["UV_CACHE_DIR"])
    xdg = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".cache")
    return Path(xdg) / "uv"


def parse_find_links(pip_config_list: str, environ: dict[str, str] | None = None) -> list[Path]:
    """Find-links directories that pip is configured with and that exist.

    uv does not read pip's configuration, so the local wheels pip would find must be
    named to uv explicitly. ``PIP_FIND_LINKS`` (space-separated) comes first, then the
    ``find-links`` values of ``pip config list`` output such as
    ``global.find-links='/opt/wheels'``.
    """
    env = os.environ if environ is None else environ
    values: list[str] = env.get("PIP_FIND_LINKS", "").split()
    for line in pip_config_list.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip().endswith("find-links"):
            values.extend(value.strip().strip("'\"").split())
    out: list[Path] = []
    for v in values:
        path = Path(v.removeprefix("file://"))
        if path.is_dir() and path not in out:
            out.append(path)
    return out


def local_wheel_found(e: Entry, find_links: Iterable[Path], python_tag: str = "cp311") -> bool:
    """Whether a CPU wheel of the entry's torch for ``python_tag`` is in ``find_links``."""
    pattern = f"torch-{e.torch}+cpu-{python_tag}-*.whl"
    return any(any(Path(d).glob(pattern)) for d in find_links)


def release(version: str) -> tuple[int, int, int]:
    """``"2.10.0+cu128"`` -> ``(2, 10, 0)``; ``"2.11.0a0+git1"`` -> ``(2, 11, 0)``."""
    m = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version.strip())
    if m is None:
        raise ValueError(f"not a version: {version!r}")
    return int(m[1]), int(m[2] or 0), int(m[3] or 0)


def pytest_counts(junit_xml: str | os.PathLike[str]) -> dict[str, int]:
    """Passed, failed (failures plus errors) and skipped test counts of a junit XML file."""
    import xml.etree.ElementTree as ET

    root = ET.parse(junit_xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in total:
            total[k] += int(s.get(k, 0))
    failed = total["failures"] + total["errors"]
    return {
        "passed": total["tests"] - failed - total["skipped"],
        "failed": failed,
        "skipped": total["skipped"],
    }
