"""torch.compile with offloading, on the CPU: the whole model, each layer, the loop by hand.

Each test compares a compiled model with offloading against the same model compiled the
same way without it: loss, every gradient and the input's gradient, bit for bit, over two
steps (the second reuses the compiled code and the host buffers). The ``aot_eager``
backend runs the AOTAutograd path that Inductor runs (the compiled function whose saved
tensors the hooks see) in a second or two; one ``slow`` test runs Inductor itself.
See NOTE [torch.compile and the offload engine] in ``cpu_offload._compile``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu_offload import HostTransport, get_cpu_offload_context, offload_layers
from cpu_offload._compile import TRACEABLE_MODULES, engine_modules
from cpu_offload.engine import selection

BACKEND = "aot_eager"
MIN = 64  # elements: every activation of these small layers is offloaded


class Block(nn.Module):
    """A pre-norm transformer block, defined here as a user's model would define it."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        h = self.norm1(x)
        q, k, v = (
            proj(h).view(b, s, self.heads, w // self.heads).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, w))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    """Blocks and a final norm; ``graph_breaks``: a graph break before and after each block.

    Offloading runs its engine between layers as plain Python, so a model compiled as a
    whole compiles into the graphs these breaks give (see docs/compile.md).
    """

    def __init__(self, layers: int, graph_breaks: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(32)
        self.graph_breaks = graph_breaks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.graph_breaks:
                torch._dynamo.graph_break()
            x = layer(x)
            if self.graph_breaks:
                torch._dynamo.graph_break()
        return self.norm(x)


def _pair(layers: int = 4, graph_breaks: bool = False) -> tuple[Model, Model]:
    torch.manual_seed(0)
    model = Model(layers, graph_breaks)
    offloaded = copy.deepcopy(model)
    offloaded.graph_breaks = False
    return model, offloaded


def loop(m: Model, context: Any, sync: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's forward written as the hand-written loop of get_cpu_offload_context."""

    def run(x: torch.Tensor) -> torch.Tensor:
        for layer in m.layers:
            with context:
                x = layer(x)
            x = sync(x)
        return m.norm(x)

    return run


def _steps(run: Callable[[torch.Tensor], torch.Tensor], model: nn.Module, steps: int = 2):
    """Loss, every gradient and the input's gradient of each step."""
    torch.manual_seed(1)
    x = torch.randn(2, 16, 32)
    results = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_()
        loss = run(inp).square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((loss.detach(), inp.grad, grads))
    return results


def _assert_exact(reference, offloaded) -> None:
    for step, ((la, xa, ga), (lb, xb, gb)) in enumerate(zip(reference, offloaded, strict=True)):
        assert torch.equal(la, lb), f"step {step}: loss {la.item()} vs {lb.item()}"
        assert torch.equal(xa, xb), f"step {step}: input gradient differs"
        for i, (a, b) in enumerate(zip(ga, gb, strict=True)):
            assert torch.equal(a, b), f"step {step}: gradient {i} differs by {(a - b).abs().max()}"


@pytest.fixture(autouse=True)
def _fresh_compile_caches() -> Iterator[None]:
    # Compiled code is cached on code objects (Block.forward): each test starts afresh.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["v2", "v1"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "v1":
        monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    else:
        monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    return request.param


def _offload(model: nn.Module, backend: str, transport: HostTransport, **kwargs):
    if backend == "v2":
        kwargs["min_tensor_size_to_offload"] = MIN
    return offload_layers(model, transport=transport, **kwargs)


def test_whole_model_compiled_after_offload_layers(backend: str) -> None:
    ref, model = _pair()
    expected = _steps(torch.compile(ref, backend=BACKEND), ref)
    transport = HostTransport()
    _offload(model, backend, transport, num_offloaded=2)
    _assert_exact(expected, _steps(torch.compile(model, backend=BACKEND), model))
    assert transport.bytes_offloaded > 0, "nothing was offloaded"


def test_transformer_encoder_compiled_after_offload_layers() -> None:
    # The report: RuntimeError "self.stride(-1) must be 1 to view Byte as Float" raised
    # from HostBufferPool.view, which Dynamo had compiled into a graph.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    ref = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    model = copy.deepcopy(ref)
    expected = _steps(torch.compile(ref, backend=BACKEND), ref)
    transport = HostTransport()
    offload_layers(model, num_offloaded=2, transport=transport, min_tensor_size_to_offload=MIN)
    _assert_exact(expected, _steps(torch.compile(model, backend=BACKEND), model))
    assert transport.bytes_offloaded > 0


@pytest.mark.parametrize("order", ["compile_then_offload", "offload_then_compile", "replace"])
def test_each_layer_compiled(order: str) -> None:
    # Layers compiled before offload_layers wraps them may use fullgraph=True: each layer
    # is one graph, the engine runs outside it. Compiled after (layer.compile() of a
    # wrapped layer), the wrapper is compiled with the layer from PyTorch 2.15 on: a graph
    # break, which fullgraph=True refuses.
    fullgraph = order != "offload_then_compile"
    ref, model = _pair()
    transport = HostTransport()
    if order == "offload_then_compile":
        _offload(model, "v2", transport, num_offloaded=2)
    for m in (ref, model):
        for i, layer in enumerate(m.layers):
            if order == "replace":
                m.layers[i] = torch.compile(layer, backend=BACKEND, fullgraph=fullgraph)
            else:
                layer.compile(backend=BACKEND, fullgraph=fullgraph)
    if order != "offload_then_compile":
        _offload(model, "v2", transport, num_offloaded=2)
    _assert_exact(_steps(ref, ref), _steps(model, model))
    assert transport.bytes_offloaded > 0


def test_recomputed_layer_under_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    # The recomputation in backward runs the compiled code of the forward: offload_layers
    # traces PyTorch's checkpoint with the layer (cpu_offload._layer_call), not the
    # package's eager recomputation (NOTE [A lean recomputation]), which runs uncompiled.
    import cpu_offload._layer_call as layer_call

    eager: list[object] = []
    real = layer_call.run_recomputed

    def counted(*args: object) -> object:
        eager.append(args[0])
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(layer_call, "run_recomputed", counted)
    ref, model = _pair()
    expected = _steps(torch.compile(ref, backend=BACKEND), ref)
    transport = HostTransport()
    _offload(model, "v2", transport, num_offloaded=1, recomputed=[2])
    _assert_exact(expected, _steps(torch.compile(model, backend=BACKEND), model))
    assert transport.bytes_offloaded > 0
    assert eager == []
    _steps(model, model)  # the same layers, eager
    assert len(eager) > 0


@pytest.mark.parametrize("compiled", ["loop", "layers"])
def test_hand_written_loop(compiled: str) -> None:
    ref, model = _pair(4)
    transport = HostTransport()
    ctx, sync = get_cpu_offload_context(
        True, 2, 4, transport=transport, min_tensor_size_to_offload=MIN
    )

    plain = (contextlib.nullcontext(), lambda t: t)
    if compiled == "loop":
        expected = _steps(torch.compile(loop(ref, *plain), backend=BACKEND), ref)
        got = _steps(torch.compile(loop(model, ctx, sync), backend=BACKEND), model)
    else:
        for m in (ref, model):
            for layer in m.layers:
                layer.compile(backend=BACKEND, fullgraph=True)
        expected = _steps(loop(ref, *plain), ref)
        got = _steps(loop(model, ctx, sync), model)
    _assert_exact(expected, got)
    assert transport.bytes_offloaded > 0


def test_engine_is_never_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """One graph per layer class, none of the engine: no recompilation at all.

    Were the saved-tensor hooks compiled (as they were when they ran inside a compiled
    layer), each new shape of saved tensor would recompile them; were the wrapped layers
    compiled with their wrapping state, each layer would. The hooks only ever see the
    real tensors the compiled function saves, never a fake or functional one.
    """
    seen: list[bool] = []
    real_test = selection.is_fake_or_functional

    def spy(tensor: torch.Tensor) -> bool:
        seen.append(real_test(tensor))
        return seen[-1]

    monkeypatch.setattr(selection, "is_fake_or_functional", spy)
    _, model = _pair(6)
    transport = HostTransport()
    _offload(model, "v2", transport, num_offloaded=4)
    compiled = torch.compile(model, backend=BACKEND)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _steps(compiled, model, steps=2)
    assert transport.bytes_offloaded > 0
    assert seen and not any(seen), "a saved-tensor hook saw a fake or functional tensor"


class _FramesDynamoCompiles(logging.Handler):
    """The functions TorchDynamo starts compiling, from its debug log (one line each)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.started: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("torchdynamo start compiling"):
            # "torchdynamo start compiling <name> <file>:<line>, stack ..."
            self.started.append(" ".join(message.split()[3:5]).rstrip(","))


@contextlib.contextmanager
def _frames_dynamo_compiles() -> Iterator[list[str]]:
    logger = logging.getLogger("torch._dynamo.convert_frame")
    handler, level = _FramesDynamoCompiles(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.started
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.parametrize(
    ("driver", "backend"),
    # V1 offloads only marked tensors: with offload_layers, each layer's input.
    [("offload_layers", "v2"), ("offload_layers", "v1"), ("loop", "v2")],
    indirect=["backend"],
)
def test_dynamo_compiles_the_layers_and_nothing_the_engine_calls(driver: str, backend: str) -> None:
    """Nothing the engine calls is compiled: not the ``__init__`` that ``dataclasses``
    writes (file ``<string>``), which crashed Dynamo on CUDA in PyTorch 2.11, nor the
    user's callbacks. The whole training step is compiled, so that the backward hooks too
    run under the compiled step (its ``backward()`` is a graph break)."""
    ref, model = _pair()
    transport = HostTransport()
    if driver == "offload_layers":
        _offload(model, backend, transport, num_offloaded=2)
        forward: Callable[[torch.Tensor], torch.Tensor] = model
    else:
        ctx, sync = get_cpu_offload_context(
            True, 2, 4, transport=transport, min_tensor_size_to_offload=MIN
        )
        forward = loop(model, ctx, sync)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = forward(x).square().mean()
        loss.backward()
        return loss.detach()

    compiled = torch.compile(step, backend=BACKEND)
    x = torch.randn(2, 16, 32)
    with _frames_dynamo_compiles() as started:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = compiled(x.clone().requires_grad_())
            grads = [p.grad.clone() for p in model.parameters()]
    ref_loss = ref(x).square().mean()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss.detach())
    for g, r in zip(grads, (p.grad for p in ref.parameters()), strict=True):
        assert torch.equal(g, r)
    assert transport.bytes_offloaded > 0
    assert any("forward" in frame for frame in started), started  # the log was read
    outside = [f for f in started if "cpu_offload" in f and "_layer_call" not in f]
    assert not outside, f"Dynamo compiled engine code: {outside}"
    assert not [f for f in started if "<string>" in f], started


@pytest.mark.parametrize("driver", ["offload_layers", "loop"])
def test_fullgraph_of_the_whole_model_is_refused_naming_cpu_offload(driver: str) -> None:
    # Offloading needs a graph break at each layer (the engine runs as plain Python).
    _, model = _pair()
    run: Callable[[torch.Tensor], torch.Tensor] = model
    if driver == "offload_layers":
        offload_layers(model, num_offloaded=1, min_tensor_size_to_offload=MIN)
    else:
        ctx, sync = get_cpu_offload_context(True, 1, 4, min_tensor_size_to_offload=MIN)
        run = loop(model, ctx, sync)

    compiled = torch.compile(run, backend=BACKEND, fullgraph=True)
    # Dynamo's own error: a function in a file of cpu_offload, or the context it cannot enter.
    with pytest.raises(Exception, match="cpu_offload|OffloadContext") as err:
        _steps(compiled, model, steps=1)
    assert "dynamo" in type(err.value).__module__


def test_engine_modules_are_registered_and_models_are_not() -> None:
    names = set(engine_modules())
    for engine in ("engine", "v1", "v2", "layers", "_compat", "pipeline", "optim"):
        assert f"cpu_offload.{engine}" in names
    for traceable in TRACEABLE_MODULES:
        assert f"cpu_offload.{traceable}" not in names


def test_inductor_compiles_in_the_test_process() -> None:
    # tests/conftest.py sets TORCHINDUCTOR_COMPILE_THREADS before Inductor reads it: read
    # later, Inductor would start its pool of forked compile workers in every test process.
    from torch._inductor import config

    assert config.compile_threads == int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])


@pytest.mark.slow
def test_inductor_whole_model_and_each_layer() -> None:
    pytest.importorskip("setuptools", reason="Inductor's C++ builder imports setuptools")
    # Against one graph of the whole model Inductor may fuse across a layer boundary and
    # round differently; the model with the engine's graph breaks is the exact reference.
    ref, model = _pair(graph_breaks=True)
    expected = _steps(torch.compile(ref), ref)
    transport = HostTransport()
    handle = _offload(model, "v2", transport, num_offloaded=2)
    _assert_exact(expected, _steps(torch.compile(model), model))
    handle.remove()
    torch._dynamo.reset()
    for m in (ref, model):
        for layer in m.layers:
            layer.compile()
    _offload(model, "v2", transport, num_offloaded=1, recomputed=[2])
    _assert_exact(_steps(ref, ref), _steps(model, model))
    assert transport.bytes_offloaded > 0
