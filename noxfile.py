"""Sessions of cpu-offload: ``python3 -m nox -l`` lists them.

    tests(torch-X)   the test suite against torch release X of the matrix (compat/README.md)
    lint             ruff check and ruff format --check
    typecheck        mypy on src/cpu_offload, against the CPU wheel of torch 2.13.0
    matrix_summary   what the matrix ran, what it left out and why, and the test totals

CI (``.ci/run``) runs ``python3 -m nox -t ci``: each ``tests`` entry in the order of
``compat/matrix.py`` (required entries always, the others when disk and time allow),
then ``matrix_summary``. The helpers below the sessions do the installing and measuring.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nox
import nox.command

HERE = Path(__file__).resolve().parent


def _load_matrix() -> Any:
    # compat/ is not a package on sys.path; load the matrix module by its path.
    spec = importlib.util.spec_from_file_location("cpu_offload_matrix", HERE / "compat/matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


matrix = _load_matrix()

nox.needs_version = ">=2024.10.9"
# uv where it is installed: each CUDA build of torch is 4-7 GB and uv's cache hardlinks it
# into every venv; plain virtualenv and pip otherwise.
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "typecheck", "tests(torch-2.13.0)"]

#: The only Python that every torch release from 2.6 to 2.15 has wheels for.
PYTHON = "3.11"
PYTEST_ARGS = ("-q", "-n", "2", "-m", "not cuda")

_STARTED = time.monotonic()
_RESULTS: dict[str, dict[str, Any]] = {}


@nox.session(python=PYTHON, tags=["ci"])
@nox.parametrize("torch", [nox.param(e.torch, id=e.id, tags=[e.id]) for e in matrix.ENTRIES])
def tests(session: nox.Session, torch: str) -> None:
    """Test suite against one torch release (CUDA tests are skipped without a GPU)."""
    entry = matrix.entry(torch)
    with _recorded(entry) as row:
        _install_torch_or_skip(session, entry, row)
        _install_package(session, entry, row)
        _check_installed_torch(session, entry, row)
        _run_pytest(session, entry, row)


@nox.session(python=PYTHON, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON, tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy on the package (configured in pyproject.toml), with the local torch wheel."""
    entry = matrix.entry("2.13.0")
    session.install(*_pin_args(session, entry), f"torch=={entry.torch}", env=_pin_env(entry))
    session.install(*_pin_args(session, entry), "-e", ".", "mypy", env=_pin_env(entry))
    session.run("mypy")


@nox.session(venv_backend="none", tags=["ci"])
def matrix_summary(session: nox.Session) -> None:
    """Table of the matrix entries of this nox run; fails if an entry failed or is missing."""
    _print_summary(session)


# --------------------------------------------------------------------------------------
# Helpers of the sessions above.


@contextlib.contextmanager
def _recorded(entry: Any) -> Iterator[dict[str, Any]]:
    """Record one entry's outcome for matrix_summary, whatever happens in the session."""
    row: dict[str, Any] = {"status": None, "reason": "", "torch": "-"}
    _RESULTS[entry.id] = row
    try:
        yield row
    except BaseException:
        if row["status"] is None:
            row["status"] = "FAILED"
        raise
    if row["status"] is None:
        row["status"] = "passed"


def _uv_backend(session: nox.Session) -> bool:
    return session.venv_backend == "uv"


@functools.cache
def _find_links() -> list[Path]:
    """The find-links directories of pip's configuration (uv does not read it)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    return matrix.parse_find_links(out)


def _pin_args(session: nox.Session, entry: Any) -> list[str]:
    """Install arguments that pin the entry's torch: its constraints file, and for uv the
    find-links directories that pip's configuration names."""
    args = ["-c", str(entry.constraints)]
    if _uv_backend(session):
        for d in _find_links():
            args += ["--find-links", str(d)]
    return args


def _pin_env(entry: Any) -> dict[str, str]:
    # For pip: the entry's constraints replace the machine's own constraint file, which
    # caps torch at 2.14.1 here (uv reads neither).
    return {"PIP_CONSTRAINT": str(entry.constraints)}


def _uv_offline_install(session: nox.Session, entry: Any) -> bool:
    """Install the entry's torch from uv's cache alone; True if everything was there."""
    if not _uv_backend(session):
        return False
    uv = "uv"
    with contextlib.suppress(AttributeError, ImportError):
        from nox.virtualenv import UV  # the uv that nox itself uses

        uv = UV
    cmd = [uv, "pip", "install", "--offline", "--python", str(session.virtualenv.location)]
    cmd += [*_pin_args(session, entry), f"torch=={entry.torch}"]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _install_torch_or_skip(session: nox.Session, entry: Any, row: dict[str, Any]) -> None:
    """Decide on free disk and time whether the entry runs; if so, install its torch."""
    t0 = time.monotonic()
    cached = _uv_offline_install(session, entry)
    wheel_found = entry.local_wheel and matrix.local_wheel_found(entry, _find_links())
    free = matrix.free_bytes([session.virtualenv.location, matrix.uv_cache_dir()])
    budget = float(os.environ.get("CPU_OFFLOAD_MATRIX_BUDGET_S", matrix.DEFAULT_BUDGET_S))
    decision = matrix.decide(
        entry,
        free_bytes=free,
        elapsed_s=time.monotonic() - _STARTED,
        budget_s=budget,
        wheel_found=wheel_found,
        cached=cached,
    )
    row["reason"] = decision.reason
    session.log(
        f"matrix entry {entry.id}: {'runs' if decision.run else 'left out'}: {decision.reason}"
    )
    if not decision.run:
        row["status"] = "left out"
        session.skip(decision.reason)
    if not cached:
        session.install(*_pin_args(session, entry), f"torch=={entry.torch}", env=_pin_env(entry))
    row["install_s"] = time.monotonic() - t0


def _install_package(session: nox.Session, entry: Any, row: dict[str, Any]) -> None:
    """The package and its test extra, under the same pin (so torch stays as installed)."""
    t0 = time.monotonic()
    session.install(*_pin_args(session, entry), "-e", ".[test]", env=_pin_env(entry))
    row["install_s"] = row.get("install_s", 0.0) + time.monotonic() - t0


def _check_installed_torch(session: nox.Session, entry: Any, row: dict[str, Any]) -> None:
    """Fail unless the venv's torch is the release the entry pins."""
    out = session.run(
        "python",
        "-W",
        "ignore",
        "-c",
        "import torch; print('TORCH', torch.__version__)",
        silent=True,
    )
    lines = [ln for ln in str(out).splitlines() if ln.startswith("TORCH ")]
    version = lines[-1].split()[1] if lines else "?"
    row["torch"] = version
    if not lines or matrix.release(version) != matrix.release(entry.torch):
        session.error(f"{entry.id}: the venv has torch {version}, the entry pins {entry.torch}")
    session.log(f"{entry.id}: torch {version} installed")


def _run_pytest(session: nox.Session, entry: Any, row: dict[str, Any]) -> None:
    """pytest on 2 workers; exit code 5 (no test collected) is a failure of the entry."""
    junit = Path(session.create_tmp()) / "junit.xml"
    junit.unlink(missing_ok=True)
    t0 = time.monotonic()
    try:
        session.run("python", "-m", "pytest", *PYTEST_ARGS, f"--junitxml={junit}", *session.posargs)
    except nox.command.CommandFailed as err:
        if getattr(err, "return_code", None) == 5:
            row["reason"] = "pytest collected no test (exit code 5)"
            session.error(f"{entry.id}: pytest collected no test (exit code 5)")
        raise
    finally:
        row["tests_s"] = time.monotonic() - t0
        if junit.exists():
            row["counts"] = matrix.pytest_counts(junit)
    if row.get("counts", {}).get("passed", 0) == 0:
        session.error(f"{entry.id}: pytest passed no test")


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} s"


def _print_summary(session: nox.Session) -> None:
    lines = [f"Torch matrix (Python {PYTHON}), in run order:"]
    lines.append(f"  {'entry':<14}{'torch':<15}{'result':<10}{'install':>9}{'tests':>9}  note")
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    problems: list[str] = []
    for entry in matrix.ENTRIES:
        row = _RESULTS.get(entry.id)
        if row is None:
            status, note = "not run", "did not run in this nox invocation"
            row = {}
            if entry.required:
                problems.append(f"{entry.id} (required) did not run")
        else:
            status, note = row["status"], row["reason"]
            if status == "FAILED":
                problems.append(f"{entry.id} failed")
        counts = row.get("counts")
        if counts:
            for k in totals:
                totals[k] += counts[k]
            note = f"{counts['passed']} passed, {counts['failed']} failed, " + (
                f"{counts['skipped']} skipped; {note}"
            )
        lines.append(
            f"  {entry.id:<14}{row.get('torch', '-'):<15}{status:<10}"
            f"{_fmt_s(row.get('install_s')):>9}{_fmt_s(row.get('tests_s')):>9}  {note}"
        )
    outcome = {e.id: _RESULTS.get(e.id, {}).get("status") for e in matrix.ENTRIES}
    ran = [k for k, v in outcome.items() if v in ("passed", "FAILED")]
    left = [k for k, v in outcome.items() if v == "left out"]
    lines.append(f"Ran: {', '.join(ran) or 'none'}. Left out: {', '.join(left) or 'none'}.")
    lines.append(
        f"matrix: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped"
    )
    print("\n".join(lines), flush=True)
    if problems:
        session.error("torch matrix: " + "; ".join(problems))
