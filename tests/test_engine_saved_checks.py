"""A tensor that a pack hook of ours keeps where it is still fails in backward when it
was changed in place after its save, as without hooks (NOTE [Kept tensors keep their
version check] in ``engine/saved_checks.py``): on every path that keeps tensors."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from cpu_offload import HostTransport, offload_layers, v1
from cpu_offload.engine.saved_checks import KeptAsSaved

INPLACE = "modified by an inplace operation"


class ChangesWhatItSaved(nn.Module):
    """Saves ``exp``'s output (8 elements: below every threshold here), then changes it in
    place: without hooks PyTorch refuses the backward, whose gradient would be wrong."""

    def __init__(self, change: bool) -> None:
        super().__init__()
        self.change = change
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.inner(x).exp()
        if self.change:
            z.mul_(2)
        return z * 1


def _layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([ChangesWhatItSaved(True), ChangesWhatItSaved(False)])


def _run(layers: nn.ModuleList) -> torch.Tensor:
    y = torch.randn(2, 8, requires_grad=True)
    for layer in layers:
        y = layer(y)
    return y.sum()


#: offload_layers arguments -> how layer 0 keeps the tensor it changes.
_PATHS: dict[str, dict[str, Any]] = {
    "offloaded, below the size threshold": {"num_offloaded": 1},
    "offloaded, refused by the threshold of every tensor": {
        "num_offloaded": 1,
        "min_tensor_size_to_offload": 1 << 40,
    },
    "kept with its casts rebuilt": {"recast": [0], "min_tensor_size_to_offload": 1},
    "kept with its casts rebuilt, below the size threshold": {
        "recast": [0],
        "min_tensor_size_to_offload": 1 << 40,
    },
    "a kept part beside an offloaded part": {"parts": {0: {"inner": "offload"}}},
}


def test_pytorch_refuses_it_without_hooks():
    with pytest.raises(RuntimeError, match=INPLACE):
        _run(_layers()).backward()


@pytest.mark.parametrize("kwargs", list(_PATHS.values()), ids=list(_PATHS))
def test_offload_layers_refuses_it_too(kwargs: dict[str, Any]):
    layers = _layers()
    kwargs = {"transport": HostTransport(), **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nothing eligible to offload
        with offload_layers(layers, **kwargs):
            loss = _run(layers)
            with pytest.raises(RuntimeError, match=f"{INPLACE}.*saved for backward in layer 0"):
                loss.backward()
            # The next step, without the change, trains as it would without the package.
            layers[0].change = False
            _run(layers).backward()


def test_a_weight_changed_between_forward_and_backward_is_refused():
    # An optimizer step between a forward and its backward: PyTorch refuses it without
    # hooks, since the saved weight is not what the forward used.
    layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def change_weight() -> None:
        with torch.no_grad():
            layers[0].weight.add_(1)

    with pytest.raises(RuntimeError, match=INPLACE):
        loss = _run(layers)
        change_weight()
        loss.backward()
    with offload_layers(layers, num_offloaded=1, transport=HostTransport()):
        loss = _run(layers)
        change_weight()
        with pytest.raises(RuntimeError, match=f"{INPLACE}.*in layer 0"):
            loss.backward()


def _v1_two_layers(change: bool) -> tuple[torch.Tensor, torch.Tensor, list[object]]:
    """Two layers under V1, the first saving ``exp``'s output unmarked (and changing it
    if ``change``): the input, the loss, and what the handler's ``tensor_pop`` got."""
    ctx, sync = v1.get_cpu_offload_context(True, 1, 2, True, False, False)
    seen: list[object] = []
    pop = ctx.offload_handler.tensor_pop

    def record(tag: object, **kwargs: Any) -> torch.Tensor:
        seen.append(tag)
        return pop(tag, **kwargs)

    ctx.offload_handler.tensor_pop = record
    x = torch.randn(8, requires_grad=True)
    with ctx:
        z = (x * 2).exp()  # saves z, unmarked
        if change:
            z.mul_(2)
    z = sync(z)
    with ctx:
        out = z * 1
    return x, sync(out).sum(), seen


def test_v1_refuses_a_changed_tensor_it_did_not_mark():
    # V1 moves marked tensors only: the rest are kept, and checked.
    _, loss, seen = _v1_two_layers(change=True)
    with pytest.raises(RuntimeError, match=f"{INPLACE}.*layer 0 \\(V1\\)"):
        loss.backward()
    assert not seen  # refused before the handler is asked


def test_v1_gives_its_handler_the_kept_tensor_itself():
    x, loss, seen = _v1_two_layers(change=False)
    loss.backward()
    assert seen and all(isinstance(t, torch.Tensor) for t in seen)
    assert torch.equal(x.grad, 2 * (x * 2).exp())


def test_kept_as_saved_detaches_all_but_a_weight_and_keeps_the_version():
    w = torch.ones(3, requires_grad=True)
    made = w * 2
    made.add_(1)  # version 1 at the save
    assert KeptAsSaved(w, "layer 0").tensor is w
    kept = KeptAsSaved(made, "layer 0")
    assert kept.tensor is not made and kept.tensor.grad_fn is None
    assert kept.version == 1 and kept.unpack().data_ptr() == made.data_ptr()
    made.add_(1)
    with pytest.raises(RuntimeError, match="in layer 0 is at version 2; expected version 1"):
        kept.unpack()
