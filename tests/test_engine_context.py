"""engine.context and engine.active: the `with` block both front-ends share."""

from __future__ import annotations

import pytest
import torch
from helpers import error_in_another_thread, top_saved_tensor_hooks

from cpu_offload import is_cpu_offload_enabled
from cpu_offload.engine.active import ActiveHooks
from cpu_offload.engine.context import OffloadContextBase


class _Recording(OffloadContextBase):
    """Packs each saved tensor as a tuple, and records what the base class called."""

    def __init__(self, fail_open: bool = False) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.fail_open = fail_open

    def _open(self) -> ActiveHooks:
        self.calls.append("open")
        if self.fail_open:
            raise ValueError("refused")
        return ActiveHooks(self, self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        self.calls.append("pack")
        return ("packed", t.detach())

    def _unpack(self, packed: tuple[str, torch.Tensor]) -> torch.Tensor:
        self.calls.append("unpack")
        return packed[1]

    def _abort(self) -> None:
        self.calls.append("abort")

    def _on_exit(self) -> None:
        self.calls.append("exit")


def test_block_installs_the_hooks_and_marks_the_context_active():
    ctx = _Recording()
    x = torch.randn(4, requires_grad=True)
    assert not is_cpu_offload_enabled()
    with ctx as entered:
        assert entered is ctx and ctx.inside_context and is_cpu_offload_enabled()
        y = (x * x).sum()
    assert not ctx.inside_context and not is_cpu_offload_enabled()
    assert top_saved_tensor_hooks() is None
    y.backward()
    assert torch.equal(x.grad, 2 * x.detach())
    assert ctx.calls == ["open", "pack", "pack", "exit", "unpack", "unpack"]


def test_an_exception_in_the_block_aborts():
    ctx = _Recording()
    with pytest.raises(KeyError):
        with ctx:
            raise KeyError("boom")
    assert ctx.calls == ["open", "abort"]
    assert not is_cpu_offload_enabled() and top_saved_tensor_hooks() is None
    with ctx:  # usable again
        pass


def test_a_refused_entry_leaves_nothing_behind():
    ctx = _Recording(fail_open=True)
    with pytest.raises(ValueError, match="refused"):
        ctx.__enter__()
    assert not ctx.inside_context and not is_cpu_offload_enabled()
    assert top_saved_tensor_hooks() is None
    ctx.fail_open = False
    with ctx:  # the thread's claim was given back
        assert ctx.inside_context


def test_nested_entry_is_an_error():
    ctx = _Recording()
    with ctx:
        with pytest.raises(RuntimeError, match="nested"):
            ctx.__enter__()
        assert ctx.inside_context


def test_a_second_thread_is_refused_while_the_first_is_inside():
    ctx = _Recording()

    def enter_and_leave() -> None:
        with ctx:
            pass

    with ctx:
        error = error_in_another_thread(enter_and_leave)
    assert "second thread" in str(error)


def test_the_base_class_needs_open():
    with pytest.raises(NotImplementedError, match="_open"):
        OffloadContextBase().__enter__()
    assert not is_cpu_offload_enabled()


@pytest.mark.parametrize("backend", ["v2", "v1"])
def test_a_dropped_context_frees_its_host_buffers_without_the_garbage_collector(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A context held its hooks and the hooks their owner: the cycle kept the context, its
    # synchronizer and its transport's host buffers alive until the garbage collector ran,
    # which it does on counts of Python objects, not bytes.
    import gc
    import weakref

    from torch import nn

    from cpu_offload import HostTransport, get_cpu_offload_context, mark_activation_offload

    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1" if backend == "v1" else "0")
    import torch._dynamo  # noqa: F401  (imported once per process by the first context)

    layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
    x = torch.randn(32, 64, requires_grad=True)
    transport = HostTransport()
    kwargs = {} if backend == "v1" else {"min_tensor_size_to_offload": 16}
    ctx, sync = get_cpu_offload_context(True, 2, 4, transport=transport, **kwargs)
    gc.disable()
    try:
        for _ in range(2):
            h = x
            for layer in layers:
                with ctx:
                    mark_activation_offload(h)
                    h = layer(h)
                h = sync(h)
            h.square().mean().backward()
        assert transport.bytes_offloaded > 0
        refs = [weakref.ref(ctx), weakref.ref(transport)]
        del ctx, sync, transport, h
        assert [r() for r in refs] == [None, None], "the context or its transport is alive"
    finally:
        gc.enable()
