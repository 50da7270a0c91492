"""The ``cpu-offload`` command line as a whole: its modules, the defaults ``compare`` and
``plan`` share, importing ``--model`` from the current folder, errors before the run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
