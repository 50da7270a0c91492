"""The ``cpu-offload`` command line as a whole: its modules, the defaults ``compare`` and
``plan`` share, importing ``--model`` from the current folder, errors before the run."""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import cli_usage_error

import cpu_offload.cli
from cpu_offload.cli import main
from cpu_offload.compare.defaults import CPU_DEFAULTS, GPU_DEFAULTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CLI = Path(cpu_offload.cli.__file__).parent


def _imports(path: Path) -> set[str]:
    """The modules of the cli package that ``path`` imports (relative imports, one dot)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names.add(node.module or "")
            if node.module is None:
                names.update(alias.name for alias in node.names)
    return names


def test_cli_modules_import_down_never_back() -> None:
    # The package imports the commands; a command imports only what they share; what
    # they share imports no command, and nothing imports the package back.
    assert _imports(CLI / "__init__.py") == {"", "compare", "plan"}
    for command in ("compare", "plan"):
        assert _imports(CLI / f"{command}.py") <= {"_model", "_options"}, command
    assert _imports(CLI / "_model.py") <= {"_options"}
    assert _imports(CLI / "_options.py") == set()


def test_plan_then_compare_with_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Only options that are not the model's: the model is the defaults' on both sides.
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--budget", "0.6", "--steps", "1", "--no-measure", "--quiet", "--save",
                 "p.json"]) == 0  # fmt: skip
    assert f"the {CPU_DEFAULTS.layers} layers of gpt" in capsys.readouterr().out
    argv = ["compare", "--plan", "p.json", "--variants", "v2", "--no-optimizer", "--quiet"]
    assert main([*argv, "--steps", "1", "--warmup", "0"]) == 0
    assert "bit-identical to no offloading: none, v2, plan" in capsys.readouterr().out


def test_the_help_of_both_commands_shows_the_same_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    helps = []
    for command in ("compare", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        helps.append(" ".join(capsys.readouterr().out.split()))
    for field in ("hidden", "heads", "seq", "batch", "layers", "dtype"):
        shown = f"{getattr(GPU_DEFAULTS, field)} / {getattr(CPU_DEFAULTS, field)}"
        assert all(f"(default: {shown}" in h for h in helps), field
    sizes = f"{GPU_DEFAULTS.builtin_min_tensor_size} / {CPU_DEFAULTS.builtin_min_tensor_size}"
    assert all(sizes in h for h in helps)


FACTORY = """
import torch
from torch import nn


def factory(seq=8, batch=2):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)])
    return model, lambda: torch.randn(batch, seq, 32, generator=torch.Generator().manual_seed(0))
"""


@pytest.fixture
def console_script_path(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``sys.path`` as the ``cpu-offload`` console script has it: no current folder."""
    path = [p for p in sys.path if p not in ("", os.getcwd())]
    monkeypatch.setattr(sys, "path", path)
    return path


@pytest.fixture
def package_in(tmp_path: Path) -> Iterator[str]:
    """A package ``cwd_pkg_i23`` in ``tmp_path`` (forgotten afterwards)."""
    (tmp_path / "cwd_pkg_i23").mkdir()
    (tmp_path / "cwd_pkg_i23" / "__init__.py").write_text("")
    (tmp_path / "cwd_pkg_i23" / "models.py").write_text(FACTORY)
    yield "cwd_pkg_i23.models:factory"
    for name in [m for m in sys.modules if m.startswith("cwd_pkg_i23")]:
        del sys.modules[name]


@pytest.mark.parametrize("command", [["compare", "--variants", "v2"], ["plan", "--budget", "0.7"]])
def test_model_factory_is_imported_from_the_current_folder(
    command: list[str],
    package_in: str,
    console_script_path: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    argv = [*command, "--model", package_in, "--quiet", "--steps", "1"]
    assert main([*argv, "--min-tensor-size", "64"]) == 0
    assert sys.path == before  # the current folder was on it for the import only
    out = capsys.readouterr().out
    assert "bit-identical to no offloading: none, v2" in out or "| plan " in out


def test_model_factory_not_found_says_where_it_looked_and_how_to_fix_it(
    package_in: str,
    console_script_path: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    err = cli_usage_error(["compare", "--model", package_in, "--quiet"], capsys)
    assert "cannot import 'cwd_pkg_i23.models': No module named 'cwd_pkg_i23'" in err
    assert f"looked in the current folder ({elsewhere})" in err
    assert "Run from the folder that holds 'cwd_pkg_i23'" in err and "PYTHONPATH=" in err


def test_model_factory_whose_own_import_fails_names_what_it_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "needs_missing_i23.py").write_text("import no_such_dependency_i23\n")
    monkeypatch.chdir(tmp_path)
    err = cli_usage_error(["compare", "--model", "needs_missing_i23:make", "--quiet"], capsys)
    assert "cannot import 'needs_missing_i23': importing it raised ModuleNotFoundError" in err
    assert "no_such_dependency_i23" in err and "PYTHONPATH" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--budget", "0.5", "--save", "/nonexistent/dir/plan.json"], "does not exist"),
        (["plan", "--budget", "0.5", "--json", "/nonexistent/dir/f.json"], "does not exist"),
        (["plan", "--budget", "0.5", "--json", "{tmp}"], "is a folder"),
        (["plan", "--budget", "0.5", "--save", "{tmp}"], "is a folder"),
        (["compare", "--json", "{tmp}"], "is a folder"),
        (["compare", "--plot", "{tmp}"], "is a folder"),
    ],
)
def test_outputs_that_cannot_be_written_fail_before_the_run(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = cli_usage_error([a.format(tmp=tmp_path) for a in argv], capsys)
    option = next(a for a in argv if a in ("--save", "--json", "--plot"))
    assert f"error: argument {option}: {option} " in err and message in err
    assert "profiling" not in err and "reference run" not in err  # nothing ran
    last = err.strip().splitlines()[-1]  # the error is one line, after the usage
    assert last.startswith(f"cpu-offload {argv[0]}: error: ") and message in last
    assert "Traceback" not in err


def test_plot_format_matplotlib_cannot_write_fails_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    err = cli_usage_error(["compare", "--plot", str(tmp_path / "out.txt")], capsys)
    assert "--plot" in err and "matplotlib cannot write .txt files; use one of" in err
    assert ".png" in err and ".pdf" in err and ".svg" in err
    assert "reference run" not in err


def test_plot_without_a_suffix_names_the_file_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    argv = ["compare", "--hidden", "32", "--heads", "4", "--seq", "16", "--layers", "3"]
    argv += ["--variants", "v2", "--no-optimizer", "--steps", "1", "--warmup", "0"]
    assert main([*argv, "--min-tensor-size", "64", "--plot", str(tmp_path / "outfile")]) == 0
    written = tmp_path / "outfile.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {written}\n" in capsys.readouterr().err
    assert not (tmp_path / "outfile").exists()


@pytest.mark.parametrize(
    "argv", [["compare", "--hidden", "100000"], ["plan", "--budget", "0.5", "--hidden", "100000"]]
)
def test_a_model_larger_than_memory_is_refused_before_allocating(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = cli_usage_error([*argv, "--device", "cpu"], capsys)  # about 5,400 GiB
    assert "the built-in model of --layers 6, --hidden 100000, --seq 128, --batch 4 needs" in err
    assert "of host memory available: make it smaller" in err and "Traceback" not in err
    assert "profiling" not in err and "reference run" not in err


def test_the_memory_check_compares_with_what_the_host_has(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cpu_offload.compare import _fits
    from cpu_offload.compare.report import format_bytes
    from cpu_offload.models import ModelSpec

    spec = ModelSpec("gpt", CPU_DEFAULTS.hidden, CPU_DEFAULTS.heads, CPU_DEFAULTS.seq,
                     CPU_DEFAULTS.batch, CPU_DEFAULTS.layers)  # fmt: skip
    need = _fits.memory_need(spec)
    assert need.parameters == need.gradients == 6 * 12 * 128 * 128 * 4 + 6 * 13 * 128 * 4
    assert 0 < need.activations < need.total
    monkeypatch.setattr(_fits, "_host_available", lambda: need.total - 1)
    err = cli_usage_error(["plan", "--budget", "0.5", "--device", "cpu"], capsys)
    assert f"needs about {format_bytes(need.total)} (parameters" in err
    assert f"more than the {format_bytes(need.total - 1)} of host memory" in err


def test_plan_layers_has_the_same_upper_bound_as_compare(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cpu_offload.cli._options import MAX_LAYERS

    for argv in (["plan", "--budget", "0.5"], ["compare"]):
        err = cli_usage_error([*argv, "--layers", "100000"], capsys)
        assert f"--layers must be in [1, {MAX_LAYERS}], got 100000" in err
