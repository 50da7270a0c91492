"""The comparison tool on the CPU: the timeline model, the runner and the command line."""

from __future__ import annotations

import json

import pytest
from helpers import cli_usage_error

from cpu_offload.cli import main
from cpu_offload.compare.simulate import LayerProfile, simulate

MIB = 2**20


def _profiles(n=8, fwd=1.0, mib=100):
    return [LayerProfile(fwd, 2 * fwd, mib * MIB, mib * MIB, 10 * MIB) for _ in range(n)]


def test_model_without_offloading_is_compute_and_all_layers():
    sim = simulate(_profiles(), "none", 0, 50.0)
    assert sim.step_ms == pytest.approx(8 * 3.0)
    assert sim.peak_bytes == 8 * 100 * MIB
    assert sim.stall_ms == 0


def test_model_default_schedule_keeps_n_minus_k_layers_and_overlaps_when_the_link_is_fast():
    sim = simulate(_profiles(), "v2", 2, 1000.0)  # copies of 0.1 ms under 1 ms layers
    assert sim.peak_bytes <= 6 * 100 * MIB + 100 * MIB  # n-k layers, plus one in flight
    assert sim.step_ms == pytest.approx(8 * 3.0, rel=0.02)


def test_model_default_schedule_is_transfer_bound_on_a_slow_link():
    # 100 MiB at 5 GB/s is ~21 ms a copy, against 1 ms of compute per layer.
    sim = simulate(_profiles(), "v2", 4, 5.0)
    copy_ms = 100 * MIB / 5e9 * 1e3
    assert sim.step_ms >= 4 * copy_ms  # at least the offloads, one stream
    assert sim.stall_ms > 0
    lanes = {s.lane for s in sim.spans}
    assert {"compute", "offload", "reload", "stall"} <= lanes


def test_model_checkpoint_recomputes_and_save_on_cpu_copies_on_the_compute_stream():
    base = simulate(_profiles(), "none", 0, 50.0).step_ms
    ckpt = simulate(_profiles(), "checkpoint", 4, 50.0)
    assert ckpt.step_ms == pytest.approx(base + 4 * 1.0)
    soc = simulate(_profiles(), "save_on_cpu", 4, 50.0)
    assert soc.step_ms == pytest.approx(base + 8 * (100 * MIB / 50e9 * 1e3))


def test_model_rejects_unknown_variant_and_bad_k():
    with pytest.raises(ValueError, match="variant must be one of"):
        simulate(_profiles(), "magic", 1, 50.0)
    with pytest.raises(ValueError, match="num_offloaded"):
        simulate(_profiles(), "v2", 9, 50.0)


SMALL = (
    "compare --hidden 32 --heads 4 --seq 32 --batch 4 --layers 4 --offloaded 2"
    " --min-tensor-size 1024 --quiet --steps 1 --warmup 0"
).split()


def test_cli_runs_every_variant_bit_exact_and_says_it_is_simulated(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main([*SMALL, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text
    assert (
        "bit-identical to no offloading: none, v1-sync, v1-async, v2, checkpoint, save_on_cpu"
        in text
    )
    data = json.loads(out.read_text())
    assert data["simulated"] is True
    names = [r["name"] for r in data["results"]]
    assert names == ["none", "v1-sync", "v1-async", "v2", "checkpoint", "save_on_cpu"]
    for r in data["results"]:
        assert r["max_loss_diff"] == 0 and r["max_grad_diff"] == 0
    v2 = next(r for r in data["results"] if r["name"] == "v2")
    none = data["results"][0]
    assert v2["peak_bytes"] < none["peak_bytes"]
    assert v2["bytes_offloaded_per_step"] > 0
    assert "transfer-bound floor of the default schedule (model): v2" in text


def test_cli_floor_line_only_when_v2_ran(capsys):
    assert main([*SMALL, "--variants", "checkpoint", "--no-optimizer"]) == 0
    text = capsys.readouterr().out
    assert "checkpoint" in text and "transfer-bound floor" not in text


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert main([*SMALL, "--variants", "v2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--offloaded", "4"], "--offloaded must be in"),
        (["--variants", "v3"], "unknown v3"),
        (["--heads", "5"], "must divide --hidden"),
        (["--layers", "0"], "--layers must be >= 1"),
        (["--min-tensor-size", "-1"], "--min-tensor-size must be >= 0"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--variants", ","], "--variants is empty; choose from none, v1-sync,"),
        (["--variants", ""], "--variants is empty; choose from none, v1-sync,"),
        (["--device", "gpu"], "invalid choice: 'gpu'"),
    ],
)
def test_cli_bad_arguments_name_the_option(args, message, capsys):
    err = cli_usage_error([*SMALL, *args], capsys)
    assert message in err
    assert "cpu-offload compare: error:" in err  # the subcommand reports its own options


@pytest.mark.parametrize("option", ["--sim-link-gbps", "--sim-tflops"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "fast"])
def test_cli_simulation_figures_must_be_positive_numbers(option, value, capsys):
    err = cli_usage_error(["compare", f"{option}={value}", "--quiet"], capsys)
    assert f"{option} must be a" in err and repr(value) in err


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_cli_output_in_a_missing_folder_fails_before_the_run(option, tmp_path, capsys):
    path = tmp_path / "missing" / "out.file"
    err = cli_usage_error(["compare", option, str(path)], capsys)
    assert option in err and "does not exist" in err
    assert "cpu-offload: reference run" not in err  # nothing ran


def test_cli_layers_has_an_upper_bound(capsys):
    from cpu_offload.cli._options import MAX_LAYERS

    err = cli_usage_error(["compare", "--layers", str(MAX_LAYERS + 1)], capsys)
    assert f"--layers must be in [1, {MAX_LAYERS}]" in err


def test_cli_missing_matplotlib_is_reported_before_the_run(monkeypatch, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    err = cli_usage_error(["compare", "--plot", str(tmp_path / "t.png")], capsys)
    assert "--plot needs matplotlib" in err and "reference run" not in err


def test_cli_version(capsys):
    from cpu_offload import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"cpu-offload {__version__}"


def test_cli_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in (
        "--model",
        "--hidden",
        "--heads",
        "--seq",
        "--batch",
        "--layers",
        "--offloaded",
        "--dtype",
        "--steps",
        "--warmup",
        "--variants",
        "--device",
        "--min-tensor-size",
        "--sim-tflops",
        "--sim-link-gbps",
    ):
        after = text.split(f"{option} ", 2)[-1]
        help_text = after.split(" --", 1)[0]
        assert "default" in help_text, f"{option}: {help_text!r}"


def test_cli_default_offloaded_fits_the_layers(capsys):
    argv = "compare --hidden 32 --heads 4 --seq 16 --batch 2 --layers 2 --no-optimizer"
    assert main([*argv.split(), "--variants", "v2", "--min-tensor-size", "64", *SMALL[-5:]]) == 0
    assert "k=1 offloaded" in " ".join(capsys.readouterr().out.split())  # lines wrapped
