"""When an offloaded part's layer queues its copies (NOTE [Parts of a layer]): once its last
offloaded part has run, beside the rest of the layer, with its memory and its saved casts
let go at the same points as before (CPU stand-in)."""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref

import pytest
import torch
from test_layer_parts import MIN, Block, _assert_equal, _batches, _blocks, _run, _train
from torch import nn

from cpu_offload import HostTransport, offload_layers, start_offload
from cpu_offload.engine.layer_state import OffloadableLayerState

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D = 32


def _events(model: nn.Sequential, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Each layer state's start_offload, and the start of each block's attention and MLP
    with the phase layer 0's state is in then, in order."""
    events: list[tuple[str, str]] = []
    start = OffloadableLayerState.start_offload
    states: list[OffloadableLayerState] = []

    def recorded(self: OffloadableLayerState, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        events.append(("copies", self.name))
        states.append(self)
        start(self, *args, **kwargs)

    def started(name: str, layer: str):  # type: ignore[no-untyped-def]
        def hook(*_):  # type: ignore[no-untyped-def]
            phase = next((s.phase.value for s in states if s.name == "layer 0"), "-")
            events.append((name, layer, phase))

        return hook

    monkeypatch.setattr(OffloadableLayerState, "start_offload", recorded)
    for i, block in enumerate(model):
        for name in ("attn", "mlp"):
            getattr(block, name).register_forward_pre_hook(started(name, f"layer {i}"))
    return events


@pytest.mark.parametrize(
    ("parts", "copies_after"),
    [
        ({"norm1": "offload"}, None),  # queued before the rest of the layer runs
        ({"norm1": "offload", "attn": "offload"}, "attn"),  # after the last offloaded one
        ({"norm1": "offload", "mlp": "recompute"}, None),
    ],
)
def test_a_layers_copies_are_queued_after_its_last_offloaded_part(
    parts, copies_after, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    model = _blocks()
    batches = _batches()
    want = _train(model, batches)
    events = _events(model, monkeypatch)
    plan = {i: dict(parts) for i in range(3)}
    got, transport, _ = _run(model, batches, parts=plan)
    _assert_equal(got, want)
    assert transport.bytes_offloaded > 0
    first = [e[:2] for e in events[: events.index(("mlp", "layer 0", "offload_started")) + 1]]
    expected = [("attn", "layer 0"), ("mlp", "layer 0")]
    at = 0 if copies_after is None else 1
    assert first == expected[:at] + [("copies", "layer 0")] + expected[at:]
    # Layer 0's memory goes at the schedule's point, layer 1's start, not with its copies.
    layer1 = next(e for e in events if e[:2] == ("attn", "layer 1"))
    assert layer1[2] == "offload_finished"
    assert events.count(("copies", "layer 2")) == len(batches)


class Twice(Block):
    """A block whose first norm runs twice in one forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(self.norm1(x))
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def test_an_offloaded_part_run_again_after_its_layers_copies_keeps_what_it_saves() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Twice() for _ in range(3)])
    batches = _batches()
    want = _train(model, batches)
    part = {"norm1": "offload"}
    got, transport, _ = _run(model, batches, parts={0: part, 1: part})
    _assert_equal(got, want)
    # The first call of each norm moves its input; the second keeps its own.
    x = batches[0]
    assert transport.bytes_offloaded == len(batches) * 2 * x.numel() * x.element_size()


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Outer(nn.Module):
    """Calls another part of its layer, which is not its submodule, when asked."""

    def __init__(self, inner: Inner) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.__dict__["inner"] = inner

    def forward(self, x: torch.Tensor, call_inner: bool = False) -> torch.Tensor:
        if call_inner:
            x = self.inner(x)
        return torch.sigmoid(self.lin(x))  # saves after the inner part returned


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.outer = Outer(self.inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.outer(x)
        return x + self.outer(h, call_inner=True)  # the inner part ends inside the outer


def test_copies_wait_for_the_outermost_offloaded_part() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Nested() for _ in range(3)])
    batches = _batches()
    want = _train(model, batches)
    got, transport, _ = _run(model, batches, parts={0: {"outer": "offload", "inner": "offload"}})
    _assert_equal(got, want)
    assert transport.bytes_offloaded > 0


class CastPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D).bfloat16())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.exp().to(torch.bfloat16)  # exp saves its output; t is a cast of it
        self.cast = weakref.ref(t)
        return t * self.w, t  # saves t, rebuilt in backward from exp's output


class CastLayer(nn.Module):
    """Changes the part's saved cast after the part: in place, or behind the version
    counter and then marked with start_offload; after a gradient taken inside the layer
    (``"grad, ..."``) or not."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.part = CastPart()
        self.lin = nn.Linear(D, D)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, t = self.part(x)
        if self.how.startswith("grad"):  # a penalty's gradient, taken inside the layer
            torch.autograd.grad(y.float().sum(), self.part.w, retain_graph=True)
        if self.how.endswith("in place"):
            t.mul_(2)
        elif self.how.endswith("marked"):
            t.data.mul_(2)
            start_offload(t)
        return x + self.lin(y.float())


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


def _cast_model(how: str) -> nn.Sequential:
    # Five layers: layer 1's memory goes at layer 4's start, its casts at its own end.
    torch.manual_seed(0)
    return nn.Sequential(Plain(), CastLayer(how), Plain(), Plain(), Plain())


def test_a_saved_cast_is_rebuilt_and_goes_at_its_layers_end() -> None:
    model = _cast_model("unchanged")
    batches = _batches()
    part = model[1].part
    alive = []  # whether the cast lives once the next layer runs
    model[2].lin.register_forward_pre_hook(lambda *_: alive.append(part.cast() is not None))
    want = _train(model, batches)
    got, transport, handle = _run(model, batches, parts={1: {"part": "offload"}})
    _assert_equal(got, want)
    assert alive == [True] * len(batches) + [False] * len(batches)  # without, then with
    states = handle.context.offload_synchronizer.layers
    assert states[1].recast_bytes == batches[0].numel() * 2  # the bf16 cast, not moved
    assert transport.bytes_offloaded == len(batches) * batches[0].numel() * 4


@pytest.mark.parametrize("how", ["in place", "grad, in place"])
def test_a_saved_cast_changed_in_place_after_the_part_fails_in_backward(how: str) -> None:
    model = _cast_model(how)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _train(model, _batches(1))  # as without offloading
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _run(model, _batches(1), parts={1: {"part": "offload"}})


def test_a_gradient_inside_the_layer_reads_its_saved_tensors_on_the_device() -> None:
    # After the copies were queued, as before them: no release, no reload, no warning.
    model = _cast_model("grad")
    batches = _batches()
    want = _train(model, batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, transport, _ = _run(model, batches, parts={1: {"part": "offload"}})
    _assert_equal(got, want)
    assert transport.bytes_offloaded == len(batches) * batches[0].numel() * 4


class MarksLate(Block):
    """A block that marks its input complete after its first norm saved it."""

    marks = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        if self.marks:
            start_offload(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def _marking(kind: str) -> tuple[nn.Sequential, dict, str]:
    if kind == "saved input":
        torch.manual_seed(0)
        return nn.Sequential(*[MarksLate() for _ in range(3)]), {0: {"norm1": "offload"}}, "0"
    how = {"saved cast": "marked", "saved cast, after a gradient": "grad, marked"}[kind]
    return _cast_model(how), {1: {"part": "offload"}}, "1"


def _stop_marking(layers: nn.Sequential) -> None:
    for layer in layers:
        if isinstance(layer, MarksLate):
            layer.marks = False
        elif isinstance(layer, CastLayer):
            layer.how = layer.how.replace("marked", "unchanged")


@pytest.mark.parametrize("kind", ["saved input", "saved cast", "saved cast, after a gradient"])
def test_start_offload_after_the_last_offloaded_part_is_refused(kind: str) -> None:
    layers, parts, index = _marking(kind)
    batches = _batches()
    handle = offload_layers(
        layers, parts=parts, transport=HostTransport(), min_tensor_size_to_offload=MIN
    )
    with handle:
        with pytest.raises(
            RuntimeError, match=rf"start_offload\(\) on a tensor layer {index} saved"
        ):
            layers(batches[0])
        # Marked no more, the same handle trains exactly from the next step on.
        _stop_marking(layers)
        got = _train(layers, batches)
    _assert_equal(got, _train(layers, batches))


def _manual(layers: int):  # type: ignore[no-untyped-def]
    """V2's context, sync function and manual synchronizer for ``layers`` layers."""
    from cpu_offload.v2 import get_cpu_offload_context

    return get_cpu_offload_context(
        True,
        model_layers=layers,
        manual_synchronization=True,
        transport=HostTransport(),
        min_tensor_size_to_offload=1,
    )


def test_a_manual_start_in_the_layers_forward_lets_its_casts_go_at_its_end() -> None:
    torch.manual_seed(0)
    w = torch.randn(D).bfloat16().requires_grad_()
    x = torch.randn(64, D, requires_grad=True)

    def step(offload: bool, change: bool) -> torch.Tensor:
        w.grad = x.grad = None
        ctx, sync, manual = _manual(layers=1)
        with ctx if offload else contextlib.nullcontext():
            t = x.exp().to(torch.bfloat16)
            y = t * w
            if offload:
                manual.start_offload_layer(0)  # in the layer's own forward
            if change:
                t.mul_(2)
        del t
        if offload:
            y = sync(y)
            manual.release_activation_forward_gpu_memory(0)
            manual.start_reload_layer(0)
        y.float().sum().backward()
        return w.grad.clone()

    for offload in (False, True):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            step(offload, change=True)
    assert torch.equal(step(True, change=False), step(False, change=False))


@pytest.mark.parametrize("inside", [True, False])
def test_a_manual_start_lets_the_casts_go_at_the_forward_end_or_at_once(inside: bool) -> None:
    # Inside the layer's `with` block the rest of its forward may still change a cast;
    # after it (as PipelineStageOffload calls it) nothing can, and the cast goes at once.
    torch.manual_seed(0)
    w = torch.randn(D).bfloat16().requires_grad_()
    x = torch.randn(64, D, requires_grad=True)
    (x.exp().to(torch.bfloat16) * w * 2).float().sum().backward()
    want = w.grad.clone()
    w.grad = None
    ctx, sync, manual = _manual(layers=2)
    with ctx:
        t = x.exp().to(torch.bfloat16)
        y = t * w
        cast = weakref.ref(t)
        del t  # the engine's entry holds it now
        if inside:
            manual.start_offload_layer(0)
    y = sync(y)
    if not inside:
        manual.start_offload_layer(0)
    assert (cast() is not None) == inside
    with ctx:  # layer 1's start ends layer 0's forward
        z = y * 2
    assert cast() is None
    z = sync(z)
    manual.release_activation_forward_gpu_memory(0)
    manual.start_reload_layer(0)
    z.float().sum().backward()
    assert torch.equal(w.grad, want)


class FailsAfterPart(Block):
    """A block that can raise after its first norm, an offloaded part, has run."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        if self.fail:
            raise ValueError("after the part")
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


@pytest.mark.parametrize("how", ["no backward", "raises after the part"])
def test_a_forward_cut_after_its_copies_were_queued_leaves_nothing(how: str) -> None:
    from helpers import StepTensors

    torch.manual_seed(0)
    model = nn.Sequential(*[FailsAfterPart() for _ in range(4)])
    batches = _batches()
    want = _train(model, batches)
    transport = HostTransport()
    handle = offload_layers(
        model,
        parts={i: {"norm1": "offload"} for i in range(3)},
        transport=transport,
        min_tensor_size_to_offload=MIN,
    )
    with handle:
        with StepTensors() as live:
            if how == "no backward":
                model(batches[0]).square().mean()
            else:
                model[1].fail = True
                with pytest.raises(ValueError, match="after the part"):
                    model(batches[0])
                model[1].fail = False
        # The next steps are exact, and release what the cut forward made; the host
        # buffers it took stay in the pool for reuse until the pool lets them go.
        got = _train(model, batches)
        transport.pool.clear()
        gc.collect()
        assert live.live_bytes(model) == 0
    _assert_equal(got, want)
