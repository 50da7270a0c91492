"""The optimizer section of ``cpu-offload compare`` and its Megatron Bridge overrides.

On the CPU the optimizer runs as a stand-in that treats CPU parameters as device
parameters (the optimizer's ``is_device_param`` argument), so the split, the host/device
state accounting and the numerics are those of a GPU run. The CUDA test at the end
runs the section on a GPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli_usage_error
from optim_helpers import every_param as _every_param

import cpu_offload.compare.optimizer as optimizer_module
from cpu_offload.cli import main
from cpu_offload.compare import (
    OptimizerCompareConfig,
    OptimizerVariant,
    default_optimizer_variants,
    run_optimizer_compare,
    select_from_overrides,
)
from cpu_offload.compare.report import format_optimizer_table
from cpu_offload.megatron import parse_override
from cpu_offload.models import ModelSpec
from cpu_offload.optim import (
    HybridDeviceOptimizer,
    measure_optimizer,
    optimizer_device_state_bytes,
    optimizer_state_bytes,
)

# A model small enough that a whole optimizer section takes about a second on the CPU.
TINY = (
    "compare --hidden 32 --heads 4 --seq 16 --batch 2 --layers 4"
    " --min-tensor-size 256 --quiet --steps 2 --warmup 1"
).split()

DEFAULT_NAMES = [
    "0 (no offload)",
    "0.25, overlap on",
    "0.25, overlap off",
    "0.5, overlap on",
    "0.5, overlap off",
    "1, overlap on",
    "1, overlap off",
]

SPEC = ModelSpec(kind="gpt", hidden=32, heads=4, seq=16, batch=2, layers=4)


def _run_cli(tmp_path, *args: str) -> tuple[str, dict]:
    out = tmp_path / "report.json"
    assert main([*TINY, "--json", str(out), *args]) == 0
    return out.read_text(), json.loads(out.read_text())


# ---------------------------------------------------------------------- the default run


def test_default_run_has_both_sections_and_says_the_optimizer_is_a_stand_in(tmp_path, capsys):
    _, data = _run_cli(tmp_path)
    text = " ".join(capsys.readouterr().out.split())  # the lines wrapped, joined again
    assert [r["name"] for r in data["results"]][0] == "none"  # activation variants ran
    opt = data["optimizer"]
    assert [r["name"] for r in opt["results"]] == DEFAULT_NAMES
    assert opt["stand_in"] is True and opt["optimizer"] == "AdamW"
    assert opt["param_update_in_fp32"] is True
    assert "optimizer offloading: HybridDeviceOptimizer, AdamW" in text
    assert "accounted, CPU stand-in" in text and "step ms (CPU, not a GPU)" in text
    assert "STAND-IN" in text and "NOT representative of a GPU" in text
    for name in DEFAULT_NAMES:
        assert name in text
    assert "): " + "; ".join(DEFAULT_NAMES) in text  # all within 1e-3 of no offloading
    assert "BEYOND" not in text


def test_default_run_numerics_and_accounting(tmp_path):
    _, data = _run_cli(tmp_path, "--optimizer-only")
    rows = {r["name"]: r for r in data["optimizer"]["results"]}
    base = rows["0 (no offload)"]
    # A second run without offloading: exactly the reference.
    assert base["max_param_diff"] == 0.0 and base["max_loss_diff"] == 0.0
    assert base["host_state_bytes"] == 0 and base["host_numel"] == 0
    total_state = base["device_state_bytes"]
    assert total_state > 0
    for name, r in rows.items():
        assert r["max_param_diff"] <= 1e-3, name
        assert r["max_loss_diff"] <= 1e-3, name
        assert r["max_master_diff"] is None  # fp32 parameters: no master copies
        # The state only moves between the sides.
        assert r["device_state_bytes"] + r["host_state_bytes"] == total_state, name
        assert r["device_bytes"] == r["param_bytes"] + r["device_state_bytes"]
        assert r["device_ratio"] == pytest.approx(r["device_bytes"] / base["device_bytes"])
        assert r["step_ratio"] == pytest.approx(r["step_ms"] / base["step_ms"])
        assert r["peak_allocated_bytes"] == 0  # nothing measured on a GPU here
    # The split is per parameter: each fraction moves at least its share, the whole
    # model at 1.0, with overlap on and off alike.
    for f in (0.25, 0.5, 1.0):
        on, off = rows[f"{f:g}, overlap on"], rows[f"{f:g}, overlap off"]
        assert on["device_state_bytes"] == off["device_state_bytes"]
        assert on["host_state_bytes"] >= f * total_state * 0.9
        assert on["host_numel"] > 0
    assert rows["1, overlap on"]["device_state_bytes"] == 0
    assert rows["1, overlap on"]["device_bytes"] == base["param_bytes"]
    drops = [rows[f"{f:g}, overlap on"]["device_bytes"] for f in (0.25, 0.5, 1.0)]
    assert base["device_bytes"] > drops[0] > drops[1] > drops[2]


def test_param_differences_are_computed_from_the_trained_parameters(monkeypatch):
    # A configuration that changes its parameters after every step: the report must
    # see it in the parameters and the losses, and only in that configuration's row.
    class Perturbed(HybridDeviceOptimizer):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            loss = super().step(closure)
            if self.offload_fraction == 1.0:
                with torch.no_grad():
                    self.param_groups[0]["params"][0].add_(1e-2)
            return loss

    monkeypatch.setattr(optimizer_module, "HybridDeviceOptimizer", Perturbed)
    config = OptimizerCompareConfig(
        variants=(OptimizerVariant(0.5), OptimizerVariant(1.0, overlap=False))
    )
    report = run_optimizer_compare(SPEC, config, device="cpu", steps=2, warmup=1)
    rows = {r.name: r for r in report.results}
    assert list(rows) == ["0 (no offload)", "0.5, overlap on", "1, overlap off"]
    assert rows["0.5, overlap on"].max_param_diff == 0.0
    # The optimizer adopts writes made to its parameters between steps, as a plain one
    # does: the shifts of the three steps (one warm-up) add up (give or take what the
    # shifted losses changed in the updates).
    assert rows["1, overlap off"].max_param_diff == pytest.approx(3e-2, abs=1e-3)
    assert rows["1, overlap off"].max_loss_diff > 0.0
    assert rows["0.5, overlap on"].max_loss_diff == 0.0
    assert not rows["1, overlap off"].within_tolerance()
    assert rows["0.5, overlap on"].within_tolerance()
    assert report.result("1, overlap off") is rows["1, overlap off"]
    with pytest.raises(KeyError, match=r"no row named '0.75'; rows: 0 \(no offload\), 0.5"):
        report.result("0.75")
    text = format_optimizer_table(report)
    assert "BEYOND 1e-3 of no offloading: 1, overlap off" in text
    assert "within 1e-3 of no offloading (loss; parameters, through fp32 masters where" in text


def test_bf16_model_compares_fp32_masters():
    spec = ModelSpec(kind="linear", hidden=64, layers=3, batch=2, seq=8, dtype=torch.bfloat16)
    config = OptimizerCompareConfig(variants=(OptimizerVariant(0.5),))
    report = run_optimizer_compare(spec, config, device="cpu", steps=2, warmup=0)
    base, half = report.results
    assert base.max_master_diff == 0.0 and half.max_master_diff is not None
    assert half.max_master_diff <= 1e-3
    # bf16 parameters (2 bytes) with fp32 master + two moments (12 bytes) each.
    numel = base.param_bytes // 2
    assert base.device_state_bytes == pytest.approx(12 * numel, rel=0.01)
    assert any("fp32 masters" in note for note in report.notes)


def test_plot_of_the_optimizer_section(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "o.png"
    assert (
        main(
            [*TINY, "--optimizer-only", "optimizer.optimizer_offload_fraction=0.5"]
            + [
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- selection


def test_default_variants():
    assert [v.name for v in default_optimizer_variants()] == DEFAULT_NAMES
    config = OptimizerCompareConfig()
    assert config.runs() == default_optimizer_variants()
    # The run without offloading is always first, once.
    config = OptimizerCompareConfig(variants=(OptimizerVariant(0.5), OptimizerVariant(0.5)))
    assert [v.name for v in config.runs()] == ["0 (no offload)", "0.5, overlap on"]


@pytest.mark.parametrize(
    "overrides, names",
    [
        ([], DEFAULT_NAMES),
        (
            ["optimizer.optimizer_offload_fraction=0.5"],
            ["0 (no offload)", "0.5, overlap on", "0.5, overlap off"],
        ),
        (
            [
                "optimizer.optimizer_cpu_offload=True",
                "optimizer.optimizer_offload_fraction=0.5",
                "optimizer.overlap_cpu_optimizer_d2h_h2d=true",
            ],
            ["0 (no offload)", "0.5, overlap on"],
        ),
        (
            ["optimizer.overlap_cpu_optimizer_d2h_h2d=off"],
            ["0 (no offload)", "0.25, overlap off", "0.5, overlap off", "1, overlap off"],
        ),
        (
            ["++optimizer.optimizer_offload_fraction=0.3"],
            [DEFAULT_NAMES[0], "0.3, overlap on", "0.3, overlap off"],
        ),
        (["optimizer.optimizer_offload_fraction=0"], ["0 (no offload)"]),
        (
            [
                "optimizer.optimizer_offload_fraction=0.5",
                "optimizer.overlap_host_step_with_forward=true",
            ],
            [
                "0 (no offload)",
                "0.5, overlap on, host step under forward",
                "0.5, overlap off, host step under forward",
            ],
        ),
        (
            [
                "optimizer.optimizer_offload_fraction=1.0",
                "optimizer.overlap_cpu_optimizer_d2h_h2d=true",
                "optimizer.overlap_host_step_with_forward=true",
                "optimizer.offload_last_layers=true",
            ],
            ["0 (no offload)", "1, overlap on, host step under forward, last layers"],
        ),
        (
            [
                "optimizer.optimizer_offload_fraction=1.0",
                "optimizer.overlap_cpu_optimizer_d2h_h2d=true",
                "optimizer.overlap_host_step_with_forward=true",
                "optimizer.stream_share=0.5",
            ],
            ["0 (no offload)", "1, overlap on, host step under forward, 0.5 streamed"],
        ),
    ],
)
def test_optimizer_overrides_narrow_the_default_set(overrides, names):
    selection = select_from_overrides(overrides, layers=None, offloaded=None, default_layers=6)
    assert selection.optimizer is not None
    assert [v.name for v in selection.optimizer.runs()] == names
    assert selection.activation and selection.layers == 6 and selection.num_offloaded == 2


def test_other_optimizer_keys_are_taken_as_they_are():
    selection = select_from_overrides(
        ["optimizer.optimizer=sgd", "optimizer.pin_cpu_grads=false"],
        layers=None,
        offloaded=None,
        default_layers=6,
    )
    assert selection.optimizer is not None
    assert selection.optimizer.optimizer_cls() is torch.optim.SGD
    assert selection.optimizer.hyperparameters()["momentum"] == 0.9
    assert selection.optimizer.pin_cpu_grads is False


def test_host_step_under_forward_through_the_overrides_is_exact(tmp_path):
    # The optimizer section on the CPU stand-in, through the Megatron Bridge overrides:
    # the host step under the next forward trains to the same parameters and losses.
    _, data = _run_cli(
        tmp_path,
        "--optimizer-only",
        "optimizer.optimizer_offload_fraction=0.5",
        "optimizer.overlap_host_step_with_forward=true",
        "optimizer.offload_last_layers=true",
    )
    rows = {r["name"]: r for r in data["optimizer"]["results"]}
    assert sorted(rows) == [
        "0 (no offload)",
        "0.5, overlap off, host step under forward, last layers",
        "0.5, overlap on, host step under forward, last layers",
    ]
    for name, r in rows.items():
        # Both sides step on the CPU here: the same arithmetic wherever a parameter is.
        assert r["max_param_diff"] == 0.0 and r["max_loss_diff"] == 0.0, name
        if not name.startswith("0 "):
            assert r["host_numel"] > 0 and r["host_step_ms"] > 0, name


def test_switches_skip_sections():
    off = select_from_overrides(
        ["optimizer.optimizer_cpu_offload=false"], layers=None, offloaded=None, default_layers=6
    )
    assert off.optimizer is None and off.activation
    only = select_from_overrides(
        ["model.cpu_offloading=false"], layers=None, offloaded=None, default_layers=6
    )
    assert only.optimizer is not None and not only.activation


def test_model_overrides_select_k_and_layers(tmp_path):
    _, data = _run_cli(
        tmp_path,
        "--no-optimizer",
        "--variants",
        "v2",
        "model.cpu_offloading_num_layers=1",
    )
    assert data["config"]["offloaded"] == 1 and data["config"]["layers"] == 4
    assert data["optimizer"] is None
    assert [r["name"] for r in data["results"]] == ["none", "v2"]
    layers = select_from_overrides(
        ["model.num_layers=3"], layers=None, offloaded=None, default_layers=6
    )
    # The default k fits the layers: 1 of 3 (2 would leave no room for overlap).
    assert (layers.layers, layers.num_offloaded) == (3, 1)
    # The same value through the flag and the override is fine.
    same = select_from_overrides(
        ["model.cpu_offloading_num_layers=3", "model.cpu_offloading_weights=false"],
        layers=6,
        offloaded=3,
        default_layers=8,
    )
    assert (same.layers, same.num_offloaded) == (6, 3)


def test_overrides_mix_with_options(tmp_path):
    out = tmp_path / "r.json"
    argv = [*TINY, "optimizer.optimizer_offload_fraction=1.0", "--optimizer-only"]
    argv += ["--json", str(out), "optimizer.overlap_cpu_optimizer_d2h_h2d=false"]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["results"] == [] and data["noise_floor_loss"] is None
    assert [r["name"] for r in data["optimizer"]["results"]] == ["0 (no offload)", "1, overlap off"]


# ---------------------------------------------------------------------- errors


def _parse_error(text: str) -> str:
    with pytest.raises(ValueError) as err:
        parse_override(text)
    return str(err.value)


@pytest.mark.parametrize(
    "override",
    [
        "optimizer.offload_fraction=0.5",  # unknown key, with the closest match
        "model.cpu_offload=true",
        "trainer.lr=1",  # unknown section
        "optimizer.optimizer_offload_fraction=half",  # not a float
        "optimizer.overlap_cpu_optimizer_d2h_h2d=maybe",  # not a bool
        "model.cpu_offloading_num_layers=2.5",  # not an int
    ],
)
def test_bad_override_exits_2_with_the_parse_message(override, capsys):
    message = _parse_error(override)
    stderr = cli_usage_error([*TINY, override], capsys)
    assert "cpu-offload compare: error: " + message in stderr


def test_unknown_key_message_names_the_closest_key(capsys):
    with pytest.raises(SystemExit):
        main([*TINY, "optimizer.offload_fraction=0.5"])
    assert "did you mean 'optimizer.optimizer_offload_fraction'?" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["optimizer.optimizer_offload_fraction=1.5"],
            "optimizer_offload_fraction must be in [0.0, 1.0], got 1.5",
        ),
        (
            ["model.cpu_offloading_num_layers=4"],
            "CPU offloading can be done only for layers less than 4",
        ),
        (
            ["model.cpu_offloading_num_layers=-1"],
            "CPU offloading can be done only for layers less than 4",
        ),
        (
            ["model.recompute_granularity=full"],
            "CPU offloading does not work when activation recomputation",
        ),
        (["model.pipeline_model_parallel_size=2"], "no support for Pipeline parallelism"),
        (
            ["--offloaded", "1", "model.cpu_offloading_num_layers=2"],
            "--offloaded 1 and model.cpu_offloading_num_layers=2 disagree",
        ),
        (["model.num_layers=8"], "--layers 4 and model.num_layers=8 disagree"),
        (
            ["--no-optimizer", "optimizer.optimizer_offload_fraction=0.5"],
            "--no-optimizer skips the optimizer section",
        ),
        (["model.cpu_offloading_double_buffering=true"], "does not vary this field"),
        (
            ["optimizer.optimizer=muon"],
            "muon optimizer is not supported. optimizer must be one of 'adam', 'sgd'",
        ),
        (["--optimizer-only", "optimizer.optimizer_cpu_offload=false"], "nothing to compare"),
        (["model.cpu_offloading=false", "--no-optimizer"], "nothing to compare"),
        (["--no-optimizer", "--optimizer-only"], "not allowed with argument"),
        (["optimizer.optimizer_offload_fraction"], "is not of the form 'section.key=value'"),
        (["--steps", "1", "stray"], "override 'stray' is not of the form"),
        (["model.num_layers=4", "--quiet", "stray"], "override 'stray' is not of the form"),
        (["model.num_layers=4", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_selection_exits_2_naming_it(args, message, capsys):
    assert message in cli_usage_error([*TINY, *args], capsys)


def test_variant_and_config_validation():
    with pytest.raises(ValueError, match="offload_fraction"):
        OptimizerVariant(1.5)
    with pytest.raises(TypeError, match="overlap must be a bool"):
        OptimizerVariant(0.5, overlap=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stream_share must be in \[0.0, 1.0\]"):
        OptimizerVariant(0.5, stream_share=-0.5)
    with pytest.raises(TypeError, match="stream_share must be a float in"):
        OptimizerVariant(0.5, stream_share=True)  # type: ignore[arg-type]
    assert OptimizerVariant(0.5, stream_share=0.25).name == "0.5, overlap on, 0.25 streamed"
    with pytest.raises(ValueError, match="at least one"):
        OptimizerCompareConfig(variants=())
    with pytest.raises(ValueError, match="device must be 'cuda' or 'cpu'"):
        run_optimizer_compare(SPEC, OptimizerCompareConfig(), device="tpu")


# ---------------------------------------------------------------------- measurement


def _tiny_model(dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(dtype)


def test_state_bytes_by_side_on_the_stand_in():
    model = _tiny_model()
    x = torch.randn(3, 8)
    opt = HybridDeviceOptimizer(
        model.parameters(), offload_fraction=0.5, is_device_param=_every_param, lr=1e-3
    )
    model(x).square().mean().backward()
    opt.step()
    sides = optimizer_state_bytes(opt)
    # Two moments per element plus a 4-byte step per parameter, split by the mask.
    params = list(model.parameters())
    expected = [8 * p.numel() + 4 for p in params]
    mask = opt.offload_mask
    assert any(mask) and not all(mask)
    assert sides.host == sum(b for b, off in zip(expected, mask, strict=True) if off)
    assert sides.device == sum(b for b, off in zip(expected, mask, strict=True) if not off)
    # By location alone everything is on the host: the stand-in's device is the CPU.
    assert optimizer_device_state_bytes(opt) == 0
    # Real use never treats CPU parameters as device parameters.
    with pytest.warns(UserWarning, match="offloads nothing"):
        plain = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3)
    model(x).square().mean().backward()
    plain.step()
    assert optimizer_state_bytes(plain).device == 0


def test_measure_optimizer_records_losses_and_calls_back():
    model = _tiny_model()
    x = torch.randn(3, 8)
    seen: list[HybridDeviceOptimizer] = []
    m = measure_optimizer(
        model,
        lambda mod: mod(x).square().mean(),
        offload_fraction=1.0,
        steps=2,
        warmup=1,
        is_device_param=_every_param,
        on_finish=seen.append,
        lr=1e-2,
    )
    assert len(m.losses) == 3 and m.losses[2] < m.losses[0]  # it trains
    assert (
        len(seen) == 1 and isinstance(seen[0], HybridDeviceOptimizer) and all(seen[0].offload_mask)
    )
    assert m.state_bytes_device_side == 0 and m.state_bytes_host_side > 0


# ---------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
def test_optimizer_section_on_the_gpu(deterministic):
    spec = ModelSpec(kind="linear", hidden=1024, layers=8, batch=4, seq=64)
    report = run_optimizer_compare(spec, OptimizerCompareConfig(), device="cuda", steps=8, warmup=2)
    assert not report.stand_in and report.device != "cpu"
    rows = {r.name: r for r in report.results}
    base = rows["0 (no offload)"]
    assert base.max_param_diff == 0.0 and base.max_loss_diff == 0.0
    assert base.device_state_bytes > 0 and base.peak_allocated_bytes > 0
    for f in (0.25, 0.5, 1.0):
        for overlap in ("on", "off"):
            r = rows[f"{f:g}, overlap {overlap}"]
            # GPU state falls in proportion to the fraction (per-parameter split).
            assert r.device_state_bytes / base.device_state_bytes == pytest.approx(1 - f, abs=0.05)
            assert r.max_param_diff <= 1e-3 and r.max_loss_diff <= 1e-3
            assert r.peak_allocated_bytes < base.peak_allocated_bytes


@pytest.mark.cuda
def test_accounted_state_bytes_match_the_gpu(deterministic):
    model = _tiny_model().cuda()
    x = torch.randn(3, 8, device="cuda")
    for fraction in (0.0, 0.5, 1.0):
        opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=fraction, lr=1e-3)
        model(x).square().mean().backward()
        opt.step()
        assert optimizer_state_bytes(opt).device == optimizer_device_state_bytes(opt)


@pytest.mark.cuda
def test_optimizer_section_on_the_gpu_bf16_gpt(deterministic):
    spec = ModelSpec(
        kind="gpt", hidden=512, heads=8, seq=256, batch=2, layers=4, dtype=torch.bfloat16
    )
    config = OptimizerCompareConfig(variants=(OptimizerVariant(0.5), OptimizerVariant(1.0)))
    report = run_optimizer_compare(spec, config, device="cuda", steps=8, warmup=2)
    for r in report.results:
        assert r.max_master_diff is not None and r.max_master_diff <= 1e-3, r.name
        assert r.max_loss_diff <= 1e-3 and r.within_tolerance(), r.name
    base, half, full = report.results
    # bf16 parameters stay; the fp32 master and moments (12 bytes a parameter) move.
    assert full.device_state_bytes == 0 and full.device_bytes == base.param_bytes
    assert half.device_state_bytes / base.device_state_bytes == pytest.approx(0.5, abs=0.1)
