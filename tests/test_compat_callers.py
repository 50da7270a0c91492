"""The compatibility contract for legacy callers: Transformer Engine scripts run unchanged.

Each script in ``compat/callers/`` is written the way Transformer Engine users wrote it
(only the import line differs), checks its own results bit for bit and ends with
``OK <script> <backend>``. These tests run each one in a fresh interpreter under
``NVTE_CPU_OFFLOAD_V1=0`` and ``=1``: a subprocess, because the switch and the choice of
device are process-wide, and because a caller script must work as its own program.

Also here: the Megatron-Core recipe of ``docs/migration.md``, run against a stand-in
``megatron`` module tree (megatron-core itself is not installed in CI).
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import types
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import cpu_offload

ROOT = Path(__file__).resolve().parents[1]
CALLERS = ROOT / "compat" / "callers"
MIGRATION_DOC = ROOT / "docs" / "migration.md"

SCRIPTS = (
    "megatron_positional.py",
    "v1_async_double_buffer.py",
    "v1_handlers_direct.py",
    "v1_layer_loop.py",
    "v2_cuda_graphs.py",
    "v2_default_scheduling.py",
    "v2_manual_synchronization.py",
)
# Scripts that pass an argument that changes V2's contract: under V1 they must stop with
# a ValueError that names the switch and the argument. (Arguments that only tune V2, such
# as v2_cuda_graphs.py's retain_pinned_cpu_buffers, are ignored under V1 with a warning.)
V2_ONLY = {
    "v2_manual_synchronization.py": "manual_synchronization",
}
TIMEOUT_S = 300


@dataclass(frozen=True)
class Case:
    script: str
    switch: str  # the value of NVTE_CPU_OFFLOAD_V1
    device: str  # "cpu" hides the GPU from the script; "cuda" lets it use one

    @property
    def expect_ok(self) -> bool:
        return not (self.switch == "1" and self.script in V2_ONLY)

    @property
    def backend(self) -> str:
        return "v1" if self.switch == "1" else "v2"

    def __str__(self) -> str:
        return f"{self.device}-V1={self.switch}-{self.script[:-3]}"


def _cases(device: str) -> list[Case]:
    return [Case(s, switch, device) for s in SCRIPTS for switch in ("0", "1")]


CPU_CASES = _cases("cpu")
CUDA_CASES = _cases("cuda")


def _workers() -> int:
    return max(1, min(len(CPU_CASES), os.cpu_count() or 1))


def _run(case: Case) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src")
    env["NVTE_CPU_OFFLOAD_V1"] = case.switch
    if case.device == "cpu":
        # The CPU cases must exercise the CPU stand-in even on a machine with a GPU.
        env["CUDA_VISIBLE_DEVICES"] = ""
        # Several scripts run at once: one share of the cores each, not all of them each.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers()))
    else:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return subprocess.run(
        [sys.executable, str(CALLERS / case.script)],
        cwd=ROOT,  # the scripts write nothing; any cwd works, this one is stable
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def cpu_runs(request: pytest.FixtureRequest):
    """Start every selected CPU case at once (bounded by the cores) and hand out futures.

    Each script spends most of its time importing torch on one core, so running them
    side by side cuts the file's time roughly by the number of cores. Only the cases the
    session will run are started, so ``-k`` selections stay cheap.
    """
    wanted = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or item.get_closest_marker("skip") is not None:
            continue
        case = callspec.params.get("case")
        if isinstance(case, Case) and case.device == "cpu":
            wanted.append(case)
    pool = ThreadPoolExecutor(max_workers=_workers())
    futures: dict[Case, Future[subprocess.CompletedProcess[str]]] = {
        case: pool.submit(_run, case) for case in dict.fromkeys(wanted)
    }
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def _describe(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def _check(case: Case, result: subprocess.CompletedProcess[str]) -> None:
    lines = result.stdout.strip().splitlines()
    if case.expect_ok:
        assert result.returncode == 0, _describe(result)
        assert lines and lines[-1] == f"OK {case.script} {case.backend}", _describe(result)
        if case.script == "v2_cuda_graphs.py":
            skipped = "skipping the CUDA graph capture" in result.stdout
            assert skipped == (case.device == "cpu"), _describe(result)
        return
    # A V2-only script under V1: a clear refusal, not a half-run.
    assert result.returncode != 0, _describe(result)
    assert not any(line.startswith("OK ") for line in lines), _describe(result)
    error = [line for line in result.stderr.splitlines() if line.startswith("ValueError:")]
    assert error, _describe(result)
    assert "NVTE_CPU_OFFLOAD_V1" in error[-1], error[-1]
    assert V2_ONLY[case.script] in error[-1], error[-1]


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_caller_cpu(case: Case, cpu_runs) -> None:
    result = cpu_runs[case].result() if case in cpu_runs else _run(case)
    _check(case, result)


@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA_CASES, ids=str)
def test_caller_cuda(case: Case) -> None:
    # One at a time: the scripts would otherwise compete for the one GPU.
    _check(case, _run(case))


def test_every_script_is_covered_and_listed() -> None:
    on_disk = sorted(p.name for p in CALLERS.glob("*.py"))
    assert on_disk == sorted(SCRIPTS)
    readme = (CALLERS / "README.md").read_text()
    for script in SCRIPTS:
        assert f"`{script}`" in readme, f"{script} is missing from compat/callers/README.md"


def test_scripts_differ_from_te_only_in_imports() -> None:
    # A caller script may name cpu_offload only in import lines: everything else is
    # what a Transformer Engine user wrote.
    for script in SCRIPTS:
        text = (CALLERS / script).read_text()
        body = re.sub(r'^""".*?"""', "", text, count=1, flags=re.S)
        code = "\n".join(
            line
            for line in body.splitlines()
            if not line.lstrip().startswith("#")
            and not line.startswith(("from cpu_offload", "import cpu_offload"))
        )
        assert not re.search(r"\bcpu_offload\b", code), f"{script} uses cpu_offload outside imports"
        assert "transformer_engine" not in text, script


# ---------------------------------------------------------------- Megatron-Core recipe

_BLOCK_SOURCE = '''
import contextlib
import torch

get_cpu_offload_context = None  # Megatron-Core sets it when Transformer Engine imports


class TransformerBlock(torch.nn.Module):
    """Megatron-Core's lookup and call, reduced to what concerns offloading."""

    def __init__(self, config, layers, call_style="positional6"):
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList(layers)
        if get_cpu_offload_context is not None:
            args = [
                config.cpu_offloading,
                config.cpu_offloading_num_layers,
                config.num_layers,
                config.cpu_offloading_activations,
                config.cpu_offloading_weights,
                config.cpu_offloading_double_buffering,
            ]
            if call_style == "keyword":
                out = get_cpu_offload_context(
                    *args,
                    retain_pinned_cpu_buffers=config.cpu_offloading_retain_pinned_cpu_buffers,
                )
            elif call_style == "positional7":
                out = get_cpu_offload_context(
                    *args, config.cpu_offloading_retain_pinned_cpu_buffers
                )
            else:
                out = get_cpu_offload_context(*args)
            self.offload_context, self.group_prefetch_offload_commit_async = out
            config._cpu_offloading_context = (
                self.offload_context if config.cpu_offloading else None
            )
        else:
            assert config.cpu_offloading is False, (
                "CPU Offloading is enabled when TE is not present"
            )
            self.offload_context = contextlib.nullcontext()
            self.group_prefetch_offload_commit_async = None
            config._cpu_offloading_context = None

    def forward(self, hidden_states):
        for layer in self.layers:
            with self.offload_context:
                hidden_states = layer(hidden_states)
            if (
                torch.is_grad_enabled()
                and self.config.cpu_offloading
                and self.group_prefetch_offload_commit_async is not None
            ):
                hidden_states = self.group_prefetch_offload_commit_async(hidden_states)
        return hidden_states
'''

_LAYERS_SOURCE = '''
import torch

HAVE_TE = False


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, weight):
        ctx.save_for_backward(input_, weight)
        return torch.matmul(input_, weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        grad_weight = torch.matmul(
            grad_output.reshape(-1, grad_output.shape[-1]).t(),
            input_.reshape(-1, input_.shape[-1]),
        )
        return torch.matmul(grad_output, weight), grad_weight


class ColumnParallelLinear(torch.nn.Module):
    """Megatron-Core's offloading check in its linear layers' forward."""

    def __init__(self, config, size):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.randn(size, size) / size**0.5)

    def forward(self, input_):
        if self.config._cpu_offloading_context is not None:
            if self.config._cpu_offloading_context.inside_context is True:
                if not HAVE_TE:
                    assert self.config.cpu_offloading is False, (
                        "CPU Offloading cannot be enabled while TE is not present"
                    )
                else:
                    input_.activation_offloading = self.config.cpu_offloading_activations
        return _LinearFunction.apply(input_, self.weight)
'''


def _module(name: str, source: str | None = None) -> types.ModuleType:
    module = types.ModuleType(name)
    if source is not None:
        # Executed in the module's own namespace, so that the class reads the module's
        # globals at call time, as Megatron-Core's does.
        exec(compile(source, f"<fake {name}>", "exec"), module.__dict__)
    return module


@pytest.fixture
def fake_megatron(monkeypatch: pytest.MonkeyPatch):
    """A ``megatron.core`` module tree with the two places the recipe patches."""
    tree = {
        "megatron": _module("megatron"),
        "megatron.core": _module("megatron.core"),
        "megatron.core.transformer": _module("megatron.core.transformer"),
        "megatron.core.transformer.transformer_block": _module(
            "megatron.core.transformer.transformer_block", _BLOCK_SOURCE
        ),
        "megatron.core.tensor_parallel": _module("megatron.core.tensor_parallel"),
        "megatron.core.tensor_parallel.layers": _module(
            "megatron.core.tensor_parallel.layers", _LAYERS_SOURCE
        ),
    }
    for name, module in tree.items():
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(tree[parent], child, module)
    return tree


def _recipe_code() -> str:
    """The Python block of docs/migration.md that follows the ``megatron-recipe`` marker."""
    text = MIGRATION_DOC.read_text()
    match = re.search(r"<!-- megatron-recipe -->\s*```python\n(.*?)```", text, flags=re.S)
    assert match, "docs/migration.md has no Python block after <!-- megatron-recipe -->"
    return match.group(1)


def _config(cpu_offloading: bool, retain: bool = False) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        num_layers=4,
        cpu_offloading=cpu_offloading,
        cpu_offloading_num_layers=2,
        cpu_offloading_activations=True,
        cpu_offloading_weights=False,
        cpu_offloading_double_buffering=False,
        cpu_offloading_retain_pinned_cpu_buffers=retain,
    )


def _train(block, inputs):
    results = []
    for x in inputs:
        block.zero_grad(set_to_none=True)
        loss = block(x).square().mean()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in block.parameters()]))
    return results


def test_megatron_without_recipe_refuses_offloading(fake_megatron) -> None:
    # What Megatron-Core does without Transformer Engine: the reason for the recipe.
    tb = fake_megatron["megatron.core.transformer.transformer_block"]
    with pytest.raises(AssertionError, match="TE is not present"):
        tb.TransformerBlock(_config(True), [])


@pytest.mark.parametrize("call_style", ["positional6", "positional7", "keyword"])
@pytest.mark.parametrize("switch", ["0", "1"])
def test_megatron_recipe_routes_to_cpu_offload(
    fake_megatron, monkeypatch: pytest.MonkeyPatch, switch: str, call_style: str
) -> None:
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", switch)
    calls = []
    real = cpu_offload.get_cpu_offload_context

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_offload, "get_cpu_offload_context", recording)
    exec(compile(_recipe_code(), str(MIGRATION_DOC), "exec"), {"__name__": "recipe"})

    tb = fake_megatron["megatron.core.transformer.transformer_block"]
    layers_mod = fake_megatron["megatron.core.tensor_parallel.layers"]
    assert layers_mod.HAVE_TE is True
    assert tb.get_cpu_offload_context is not None

    torch.manual_seed(0)
    config = _config(True)
    linears = [layers_mod.ColumnParallelLinear(config, 512) for _ in range(config.num_layers)]
    block = tb.TransformerBlock(config, linears, call_style)
    assert calls == [
        ((True, 2, 4, True, False, False), {"retain_pinned_cpu_buffers": False}),
    ], calls
    assert config._cpu_offloading_context is block.offload_context
    assert block.offload_context.inside_context is False

    plain_config = _config(False)
    plain_linears = copy.deepcopy(linears)
    for layer in plain_linears:
        layer.config = plain_config
    plain = tb.TransformerBlock(plain_config, plain_linears, call_style)
    assert plain_config._cpu_offloading_context is None

    # The linear layers mark their inputs (the V1 mark) only inside the context.
    marked = []
    original_apply = layers_mod._LinearFunction.apply

    def watching_apply(input_, weight):
        marked.append(getattr(input_, "activation_offloading", False))
        return original_apply(input_, weight)

    monkeypatch.setattr(layers_mod._LinearFunction, "apply", watching_apply)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(64, 16, 512, generator=gen) for _ in range(2)]
    got = _train(block, inputs)
    assert marked == [True] * (2 * config.num_layers)
    want = _train(plain, inputs)
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want, strict=True):
        assert torch.equal(loss, ref_loss)
        for g, r in zip(grads, ref_grads, strict=True):
            assert torch.equal(g, r)
    handler = getattr(block.offload_context, "offload_handler", None)
    transport = (
        handler.transport
        if handler is not None
        else block.offload_context.offload_synchronizer.transport
    )
    assert transport.bytes_offloaded > 0, "nothing was offloaded through the recipe"


def test_megatron_recipe_seventh_positional_is_retain_pinned(
    fake_megatron, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Megatron-Core versions that pass retain_pinned_cpu_buffers as the seventh positional
    # argument: the recipe's wrapper must read it as that, not as manual_synchronization.
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "0")
    exec(compile(_recipe_code(), str(MIGRATION_DOC), "exec"), {"__name__": "recipe"})
    tb = fake_megatron["megatron.core.transformer.transformer_block"]
    config = _config(True, retain=True)
    block = tb.TransformerBlock(config, [], "positional7")
    assert block.offload_context.offload_synchronizer.retain_pinned_cpu_buffers is True


def test_megatron_offload_context_helper_matches_recipe_call(monkeypatch) -> None:
    # cpu_offload.megatron.offload_context makes the same call from Megatron's fields.
    from cpu_offload.megatron import offload_context

    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    calls = []
    real = cpu_offload.get_cpu_offload_context

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_offload, "get_cpu_offload_context", recording)
    ctx, commit = offload_context(
        types.SimpleNamespace(cpu_offloading=True, cpu_offloading_num_layers=2, num_layers=4)
    )
    assert calls == [((True, 2, 4, True, False, False), {"retain_pinned_cpu_buffers": False})]
    assert hasattr(ctx, "inside_context")
    assert callable(commit)


# ---------------------------------------------------------------- known gaps in src/


def test_v1_mark_on_commit_output_reaches_linears_saved_view(monkeypatch) -> None:
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    ctx, commit = cpu_offload.v1.get_cpu_offload_context(True, 2, 3)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512) for _ in range(3)]
    x = torch.randn(16, 64, 512)
    for layer in layers:
        with ctx:
            cpu_offload.mark_activation_offload(x)
            x = layer(x)
        x = commit(x)
    x.sum().backward()
    one_input = 16 * 64 * 512 * 4
    # The first two layers are offloaded; each saved one marked input.
    assert ctx.offload_handler.transport.bytes_offloaded == 2 * one_input
