"""Checkpoints of HybridDeviceOptimizer: its state dict, loading one, state placement.

The state dict is a plain optimizer's (indices in param-group order), so it loads into
one and the reverse; each loaded state value goes to the side and dtype of the tensor
its sub-optimizer steps (:func:`place_state_value`).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from copy import deepcopy
from typing import Any

import torch

from ._entries import Entry

__all__ = [
    "StateView",
    "run_load_hooks",
    "run_state_dict_hooks",
    "adopt_param_writes",
    "install_state",
    "match_loaded_groups",
    "pack_state_dict",
    "place_state_value",
    "state_view",
]


def pack_state_dict(
    param_groups: Sequence[Mapping[str, Any]], state: Mapping[torch.Tensor, Mapping[str, Any]]
) -> dict[str, Any]:
    """A plain optimizer's state dict of ``param_groups`` and per-parameter ``state``."""
    groups: list[dict[str, Any]] = []
    index = 0
    indices: dict[int, int] = {}
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(index, index + len(group["params"])))
        for p in group["params"]:
            indices[id(p)] = index
            index += 1
        groups.append(packed)
    packed_state = {indices[id(p)]: dict(s) for p, s in state.items() if id(p) in indices}
    return {"state": packed_state, "param_groups": groups}


def match_loaded_groups(
    param_groups: Sequence[Mapping[str, Any]], state_dict: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], dict[torch.Tensor, dict[str, Any]]]:
    """The param groups and the per-parameter state that ``state_dict`` gives.

    Returns:
        The new param groups (hyperparameters from the state dict, parameters from
        ``param_groups``) and each parameter's loaded state (not yet copied).

    Raises:
        ValueError: If the groups or their sizes do not match ``param_groups``.
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("state_dict must be a mapping with 'state' and 'param_groups' entries")
    saved_groups = deepcopy(list(state_dict["param_groups"]))
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    for group, saved in zip(param_groups, saved_groups, strict=True):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(
                "loaded state dict contains a parameter group "
                "that doesn't match the size of optimizer's group"
            )
    id_map: dict[Any, torch.Tensor] = {}
    for group, saved in zip(param_groups, saved_groups, strict=True):
        id_map.update(zip(saved["params"], group["params"], strict=True))
    new_groups = []
    for group, saved in zip(param_groups, saved_groups, strict=True):
        saved["params"] = group["params"]
        if "param_names" in group and "param_names" not in saved:
            saved["param_names"] = group["param_names"]
        new_groups.append(saved)
    by_param = {id_map[k]: dict(v) for k, v in state_dict["state"].items() if k in id_map}
    return new_groups, by_param


def _group_of(optimizer: torch.optim.Optimizer, inner: torch.Tensor) -> dict[str, Any]:
    for group in optimizer.param_groups:
        if any(p is inner for p in group["params"]):
            return group
    raise RuntimeError("internal error: a parameter is missing from its sub-optimizer")


def place_state_value(key: str, value: Any, inner: torch.Tensor, group: Mapping[str, Any]) -> Any:
    """Copy one loaded state value to the side and dtype its sub-optimizer expects.

    PyTorch's policy, applied to the tensor the sub-optimizer steps (the host copy or the
    fp32 master), so that fp32 moments of a bf16 model stay fp32: ``step`` is a float32
    tensor on the parameter's device for fused or capturable optimizers and a host tensor
    otherwise; floating state takes the parameter's dtype and device. Always copies, so
    that two optimizers never share state tensors.

    Args:
        key: The state key (``"step"``, ``"exp_avg"``, ...).
        value: The loaded value.
        inner: The tensor the sub-optimizer steps.
        group: The sub-optimizer's param group of ``inner``.

    Returns:
        The value to put into the sub-optimizer's state.

    Example:
        >>> group = {"fused": False}
        >>> place_state_value("exp_avg", torch.ones(2), torch.zeros(2, dtype=torch.float64), group)
        tensor([1., 1.], dtype=torch.float64)
    """
    if isinstance(value, Mapping):
        return {k: place_state_value(k, v, inner, group) for k, v in value.items()}
    if key == "step":
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(float(value), dtype=torch.float32)
        if on_device:
            return value.to(dtype=torch.float32, device=inner.device, copy=True)
        return value.to(device="cpu", copy=True)
    if isinstance(value, torch.Tensor):
        if inner.is_floating_point() and value.is_floating_point():
            return value.to(dtype=inner.dtype, device=inner.device, copy=True)
        return value.to(device=inner.device, copy=True)
    return deepcopy(value)


@torch.no_grad()
def install_state(
    entries: Sequence[Entry], state_by_param: Mapping[torch.Tensor, Mapping[str, Any]]
) -> None:
    """Put each parameter's saved state into its sub-optimizer (fp32 masters included)."""
    for entry in entries:
        saved = state_by_param.get(entry.param)
        if not saved:
            continue
        assert entry.optimizer is not None
        group = _group_of(entry.optimizer, entry.inner)
        new_state: dict[str, Any] = {}
        for key, value in saved.items():
            if key == "master_param":
                if entry.master and isinstance(value, torch.Tensor):
                    entry.inner.copy_(value)
                continue
            new_state[key] = place_state_value(key, value, entry.inner, group)
        entry.optimizer.state[entry.inner] = new_state


class StateView(defaultdict):  # type: ignore[type-arg]
    """``HybridDeviceOptimizer.state``: each parameter's live sub-optimizer state.

    Read as PyTorch's optimizers' ``state``; the state tensors are the live ones, so an
    in-place change reaches the optimizer. Dropping a parameter's entry (``del``,
    ``pop``, ``clear()``, or assigning ``{}``) drops its sub-optimizer's state, so that
    the next step starts it afresh, as it does for PyTorch's optimizers; the host step
    still running from ``step()`` is waited for first. Assigning a non-empty dict to a
    parameter is refused: :meth:`~HybridDeviceOptimizer.load_state_dict` places state on
    the side each parameter is stepped on. Copied or pickled, it is a plain
    ``defaultdict``.

    Args:
        entries: The optimizer's entries.
        settle: Waits for the host step still running (the optimizer's ``synchronize``),
            held weakly: the view must not keep its optimizer alive.
    """

    def __init__(self, entries: Sequence[Entry], settle: Callable[[], None]) -> None:
        super().__init__(dict)
        self._entries: dict[torch.Tensor, Entry] = {}
        self._settle_ref = weakref.WeakMethod(settle)  # type: ignore[arg-type]
        self.refill(entries)

    def refill(self, entries: Sequence[Entry]) -> None:
        """Show the state of ``entries`` now (after a step or a rebuild), in place, so
        that a reference to ``optimizer.state`` stays current; keys that are not
        parameters stay."""
        for key in [k for k in self if k in self._entries]:
            super().__delitem__(key)
        self._entries = {entry.param: entry for entry in entries}
        self._fill()

    def _settle(self) -> None:
        settle = self._settle_ref()
        if settle is not None:
            settle()

    def _fill(self) -> None:
        for entry in self._entries.values():
            assert entry.optimizer is not None
            sub_state = entry.optimizer.state.get(entry.inner)
            if not sub_state:
                continue
            if entry.master:
                sub_state["master_param"] = entry.inner
            super().__setitem__(entry.param, sub_state)

    def _before_change(self) -> None:
        # A host step still running creates state the view does not show yet.
        self._settle()
        self._fill()

    def _drop(self, key: Any) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.optimizer is not None:
            entry.optimizer.state.pop(entry.inner, None)

    def __missing__(self, key: Any) -> dict[str, Any]:
        # Reading a parameter without state, as from a defaultdict: nothing to drop.
        value: dict[str, Any] = {}
        super().__setitem__(key, value)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self._entries and value is not self.get(key):
            if value:
                raise TypeError(
                    "HybridDeviceOptimizer.state: assign {} (or del) to reset a parameter's "
                    "state; to set state, load it with load_state_dict()"
                )
            self._before_change()
            self._drop(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        if key in self._entries:
            self._before_change()
        super().__delitem__(key)
        self._drop(key)

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self._entries:
            self._before_change()
            self._drop(key)
        return super().pop(key, *default)

    def popitem(self) -> tuple[Any, Any]:
        self._before_change()
        key, value = super().popitem()
        self._drop(key)
        return key, value

    def clear(self) -> None:
        self._settle()
        for key in self._entries:
            self._drop(key)
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> StateView:  # type: ignore[override,misc]
        self.update(other)
        return self

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key in self._entries:
            self._before_change()  # its state may be being made by the host step
        if key not in self:
            self[key] = {} if default is None else default
        return self[key]

    def copy(self) -> defaultdict:  # type: ignore[type-arg,override]
        return defaultdict(dict, self)

    def __copy__(self) -> defaultdict:  # type: ignore[type-arg,override]
        return self.copy()

    def __reduce__(self) -> tuple[Any, ...]:
        return (defaultdict, (dict,), None, None, iter(self.items()))


def state_view(entries: Sequence[Entry], settle: Callable[[], None]) -> StateView:
    """Each parameter's live sub-optimizer state, with ``master_param`` for fp32 masters;
    ``settle`` waits for a host step still running (see :class:`StateView`)."""
    return StateView(entries, settle)


@torch.no_grad()
def adopt_param_writes(entries: Sequence[Entry]) -> None:
    """Bring host copies and fp32 masters up to parameters written by others.

    A parameter written outside the optimizer (``model.load_state_dict`` after the
    optimizer's, an in-place edit) has a new version counter. Its copy takes the new
    values, except that a fp32 master whose rounding equals the parameter is kept: that
    is a model checkpoint of the same training state loaded after the optimizer's, and
    the master holds the bits the parameter's dtype cannot.
    """
    for entry in entries:
        if not entry.has_copy or entry.param._version == entry.param_version:
            continue
        param = entry.param.detach()
        if not (entry.master and torch.equal(param, entry.inner.to(param.device, param.dtype))):
            entry.inner.copy_(param)
        entry.note_param_written()


def run_state_dict_hooks(
    optimizer: torch.optim.Optimizer, make: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """``make()`` between the hooks of ``optimizer.register_state_dict_pre_hook`` and
    ``register_state_dict_post_hook``, as ``torch.optim.Optimizer.state_dict`` runs them
    (a post hook may return a state dict that replaces it)."""
    for pre in getattr(optimizer, "_optimizer_state_dict_pre_hooks", {}).values():
        pre(optimizer)
    state_dict = make()
    for post in getattr(optimizer, "_optimizer_state_dict_post_hooks", {}).values():
        result = post(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def run_load_hooks(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    load: Callable[[Mapping[str, Any]], None],
) -> None:
    """``load(state_dict)`` between the hooks of ``register_load_state_dict_pre_hook`` and
    ``register_load_state_dict_post_hook``, as ``torch.optim.Optimizer.load_state_dict``
    runs them (on a shallow copy; a pre hook may return a state dict that replaces it)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            "state_dict must be a mapping from state_dict() (here or of a plain "
            f"optimizer), got {type(state_dict).__name__}"
        )
    state_dict = dict(state_dict)
    for pre in getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", {}).values():
        result = pre(optimizer, state_dict)
        if result is not None:
            state_dict = result
    load(state_dict)
    for post in getattr(optimizer, "_optimizer_load_state_dict_post_hooks", {}).values():
        post(optimizer)
