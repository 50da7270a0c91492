"""Tests of ``compat/matrix.py``: the torch matrix table and the free-space decision.

CPU only, no nox needed: the decision is a function of explicit numbers.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GB = 10**9


def _load_matrix():
    spec = importlib.util.spec_from_file_location("cpu_offload_matrix", ROOT / "compat/matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


matrix = _load_matrix()
LOCAL = matrix.entry("2.13.0")
BELOW = matrix.entry("2.10.0")
OLDEST = matrix.entry("2.6.0")
NEWEST = matrix.entry("2.15.0")


# ---- the table ----------------------------------------------------------------------


def test_the_matrix_has_the_releases_the_project_promises() -> None:
    releases = [e.torch for e in matrix.ENTRIES]
    assert {"2.6.0", "2.10.0", "2.13.0", "2.15.0"} <= set(releases)
    assert len(set(releases)) == len(releases)
    assert any(matrix.release(r) < (2, 11, 0) for r in releases)
    assert any(matrix.release(r) >= (2, 11, 0) for r in releases)


def test_required_entries_come_first_and_are_the_local_wheel_and_one_below_2_11() -> None:
    required = [e.torch for e in matrix.ENTRIES if e.required]
    assert set(required) == {"2.13.0", "2.10.0"}
    flags = [e.required for e in matrix.ENTRIES]
    assert flags == sorted(flags, reverse=True), "required entries must run first"
    assert LOCAL.local_wheel and not BELOW.local_wheel


@pytest.mark.parametrize("e", matrix.ENTRIES, ids=lambda e: e.id)
def test_each_entry_has_a_constraints_file_pinning_its_torch(e) -> None:
    assert e.constraints == ROOT / "compat" / f"torch-{e.torch}.txt"
    pins = [
        line.split("#", 1)[0].strip()
        for line in e.constraints.read_text().splitlines()
        if line.split("#", 1)[0].strip()
    ]
    assert pins == [f"torch=={e.torch}"]


@pytest.mark.parametrize("e", matrix.ENTRIES, ids=lambda e: e.id)
def test_the_readme_table_lists_each_entry(e) -> None:
    readme = (ROOT / "compat/README.md").read_text()
    assert re.search(rf"^\|\s*`?{re.escape(e.id)}`?\s*\|", readme, re.M), e.id


def test_entry_lookup() -> None:
    assert matrix.entry("2.10.0").id == "torch-2.10.0"
    with pytest.raises(KeyError, match="no matrix entry"):
        matrix.entry("1.0.0")


# ---- the free-space and time decision -----------------------------------------------


def test_plenty_of_disk_runs_everything() -> None:
    for e in matrix.ENTRIES:
        d = matrix.decide(e, free_bytes=60 * GB, elapsed_s=0, wheel_found=True)
        assert d.run, (e.id, d.reason)


def test_optional_cuda_entry_is_left_out_when_the_disk_is_short() -> None:
    d = matrix.decide(OLDEST, free_bytes=5 * GB, elapsed_s=0)
    assert not d.run
    assert "only 5.0 GB free" in d.reason


def test_the_disk_threshold_is_the_cuda_build_plus_margin() -> None:
    need = matrix.CUDA_BUILD_BYTES + matrix.MARGIN_BYTES
    assert need >= 7 * GB  # a CUDA build of torch takes 5-7 GB
    assert matrix.decide(NEWEST, free_bytes=need, elapsed_s=0).run
    assert not matrix.decide(NEWEST, free_bytes=need - 1, elapsed_s=0).run


@pytest.mark.parametrize("free", [0, 300 * 10**6, 5 * GB])
def test_required_entries_run_even_on_a_full_disk_and_say_so(free: int) -> None:
    for e in (LOCAL, BELOW):
        d = matrix.decide(e, free_bytes=free, elapsed_s=10_000, wheel_found=True)
        assert d.run
        assert d.reason.startswith("required")
    assert "anyway" in matrix.decide(BELOW, free_bytes=free, elapsed_s=0).reason


def test_the_local_wheel_needs_little_disk_but_a_missing_one_means_a_cuda_build() -> None:
    assert LOCAL.needed_bytes(wheel_found=True) < 4 * GB
    assert LOCAL.needed_bytes(wheel_found=False) == OLDEST.needed_bytes(wheel_found=False)
    d = matrix.decide(LOCAL, free_bytes=4 * GB, elapsed_s=0, wheel_found=True)
    assert d.run and "anyway" not in d.reason and "local CPU wheel" in d.reason


def test_a_cached_entry_needs_no_disk() -> None:
    d = matrix.decide(OLDEST, free_bytes=1 * GB, elapsed_s=0, cached=True)
    assert d.run and "cache" in d.reason


def test_optional_entries_are_left_out_past_the_time_budget() -> None:
    d = matrix.decide(NEWEST, free_bytes=60 * GB, elapsed_s=70 * 60, budget_s=75 * 60)
    assert not d.run and "budget" in d.reason
    assert matrix.decide(NEWEST, free_bytes=60 * GB, elapsed_s=10 * 60, budget_s=75 * 60).run


def test_the_default_budget_leaves_room_within_the_ci_limit() -> None:
    ci_limit_s = 90 * 60
    assert matrix.DEFAULT_BUDGET_S <= ci_limit_s - 10 * 60
    expected = sum(e.expected_s for e in matrix.ENTRIES)
    assert expected <= matrix.DEFAULT_BUDGET_S


# ---- the measuring helpers ----------------------------------------------------------


def test_free_bytes_takes_the_smallest_and_measures_missing_paths_at_their_parent(
    tmp_path: Path,
) -> None:
    free = matrix.free_bytes([tmp_path, tmp_path / "not" / "there"])
    assert free > 0
    with pytest.raises(ValueError):
        matrix.free_bytes([])


def test_parse_find_links_from_pip_config_and_env(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    listing = (
        f":env:.find-links='{a}'\nglobal.cert='/etc/ssl/certs/ca.crt'\n"
        f"global.find-links='{b} /does/not/exist'\n"
    )
    assert matrix.parse_find_links(listing, {"PIP_FIND_LINKS": str(a)}) == [a, b]
    assert matrix.parse_find_links("", {}) == []


def test_local_wheel_found(tmp_path: Path) -> None:
    assert not matrix.local_wheel_found(LOCAL, [tmp_path])
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    assert matrix.local_wheel_found(LOCAL, [tmp_path])
    assert not matrix.local_wheel_found(LOCAL, [tmp_path], python_tag="cp312")


def test_uv_cache_dir() -> None:
    assert matrix.uv_cache_dir({"UV_CACHE_DIR": "/x/uv"}) == Path("/x/uv")
    assert matrix.uv_cache_dir({"XDG_CACHE_HOME": "/c", "HOME": "/h"}) == Path("/c/uv")
    assert matrix.uv_cache_dir({"HOME": "/h"}) == Path("/h/.cache/uv")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.10.0+cu128", (2, 10, 0)),
        ("2.11.0a0+git123", (2, 11, 0)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.6", (2, 6, 0)),
    ],
)
def test_release(text: str, expected: tuple[int, int, int]) -> None:
    assert matrix.release(text) == expected


def test_pytest_counts(tmp_path: Path) -> None:
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="10" '
        'failures="1" errors="1" skipped="3"/></testsuites>'
    )
    assert matrix.pytest_counts(xml) == {"passed": 5, "failed": 2, "skipped": 3}


# ---- CI runs exactly the README's command -------------------------------------------


def _ci_command() -> str:
    lines = [
        line.strip()
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return lines[-1]


def test_ci_runs_the_matrix_with_nox_and_uv() -> None:
    command = _ci_command()
    assert "nox" in command and "uv" in command and "-t ci" in command


def test_ci_runs_exactly_the_readme_tests_command() -> None:
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.skip("README.md is not written yet")
    assert _ci_command() in readme.read_text(), (
        ".ci/run must run exactly the tests command that README.md gives"
    )
