"""ZeRO-1 style sharding of :class:`HybridDeviceOptimizer` over a data-parallel group.

Every rank of a data-parallel group holds the same parameters and, after the gradient
all-reduce, the same gradients. Instead of each rank keeping the optimizer state of all
parameters, each parameter is *owned* by one rank: only its owner keeps its state (with
``offload_fraction`` of the owner's share on the host) and steps it, and the owner then
broadcasts the new values, so that every rank holds the same parameters after each step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ._hybrid import KEYWORD_OPTIONS, HybridDeviceOptimizer

__all__ = ["ShardedHybridDeviceOptimizer", "shard_parameters"]


def shard_parameters(numels: Iterable[int], world_size: int) -> list[int]:
    """The owner rank of each parameter: contiguous runs of about equal element counts.

    Parameters are taken in order and given to ranks 0, 1, ... in turn, each rank's run
    ending once its elements reach its share of the total; every rank gets the same
    answer from the same sizes, without communicating.

    Args:
        numels: Element count of each parameter, in param-group order.
        world_size: Ranks of the data-parallel group (>= 1).

    Returns:
        The owner rank of each parameter.

    Raises:
        ValueError: If ``world_size < 1`` or a count is negative.

    Example:
        >>> shard_parameters([4, 4, 4, 4], 2)
        [0, 0, 1, 1]
    """
    sizes = list(numels)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if any(n < 0 for n in sizes):
        raise ValueError("numels must be >= 0")
    total = sum(sizes)
    owners, done = [], 0
    for n in sizes:
        # The rank whose share the middle of this parameter falls into.
        middle = done + n / 2
        rank = min(int(middle * world_size / total), world_size - 1) if total else 0
        owners.append(rank)
        done += n
    return owners


class ShardedHybridDeviceOptimizer(torch.optim.Optimizer):
    """A :class:`HybridDeviceOptimizer` whose state is sharded over data-parallel ranks.

    Each rank builds the same optimizer over the same parameters; each parameter is
    owned by one rank (:func:`shard_parameters`), which alone keeps its state in a
    :class:`HybridDeviceOptimizer` (so each rank offloads ``offload_fraction`` of *its
    own* shard to the host) and steps it. ``step()`` then broadcasts every parameter
    from its owner, one collective per owner rank and dtype, so parameters are identical
    on all ranks afterwards. Gradients must already be the same on every rank (reduced
    by ``DistributedDataParallel``, or by the caller) when ``step()`` runs; only the
    owner's are read.

    It is a :class:`torch.optim.Optimizer` over all parameters: ``param_groups`` changes
    (learning-rate schedulers) reach the owned part at the next ``step()``.
    ``state_dict()`` holds this rank's shard; load it on the same rank of a group of
    the same size.

    Args:
        params: Parameters or param-group dicts, the same on every rank.
        process_group: The data-parallel group; the default group when None.
        **kwargs: For :class:`HybridDeviceOptimizer` (``offload_fraction``, the
            optimizer classes, hyperparameters ...). ``early_grad_copy`` defaults to
            False here: the gradient all-reduce rewrites the gradients after backward.

    Raises:
        RuntimeError: If ``torch.distributed`` is not initialized.
        ValueError / TypeError: As :class:`HybridDeviceOptimizer`.

    Example:
        >>> opt = ShardedHybridDeviceOptimizer(model.parameters(), offload_fraction=1.0,
        ...                                    lr=1e-3)  # doctest: +SKIP
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ShardedHybridDeviceOptimizer needs torch.distributed to be initialized "
                "(dist.init_process_group) before it is built"
            )
        defaults = {k: v for k, v in kwargs.items() if k not in _HDO_ONLY}
        items: list[Any] = list(params)
        if not items:
            raise ValueError("params is empty: pass model.parameters() or param-group dicts")
        super().__init__(items, defaults)
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        everything = [p for g in self.param_groups for p in g["params"]]
        #: Owner rank of each parameter, in param-group order.
        self.owners = shard_parameters([p.numel() for p in everything], self.world_size)
        owner_of = {id(p): r for p, r in zip(everything, self.owners, strict=True)}
        self._owned_ids = {i for i, r in enumerate(self.owners) if r == self.rank}
        groups = [
            {**g, "params": [p for p in g["params"] if owner_of[id(p)] == self.rank]}
            for g in self.param_groups
        ]
        kwargs.setdefault("early_grad_copy", False)
        #: The optimizer of this rank's shard (None if the rank owns nothing).
        self.local: HybridDeviceOptimizer | None = (
            HybridDeviceOptimizer(groups, **kwargs) if self._owned_ids else None
        )
        # Parameters each owner broadcasts, split by dtype (one flat buffer each).
        self._broadcasts: list[tuple[int, list[torch.Tensor]]] = []
        for owner in range(self.world_size):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p, r in zip(everything, self.owners, strict=True):
                if r == owner:
                    by_dtype.setdefault(p.dtype, []).append(p)
            src = dist.get_global_rank(process_group, owner) if process_group else owner
            self._broadcasts += [(src, ps) for ps in by_dtype.values()]

    @property
    def owned_mask(self) -> list[bool]:
        """Per parameter in param-group order: True when this rank owns it."""
        return [r == self.rank for r in self.owners]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step this rank's shard, then give every rank every owner's new values.

        Args:
            closure: Re-evaluates the model and returns the loss; called once.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.local is not None:
            for outer, inner in zip(self.param_groups, self.local.param_groups, strict=True):
                inner.update({k: v for k, v in outer.items() if k != "params"})
            self.local.step()
            # With overlap_host_step_with_forward, step() returns before the copies
            # back have landed: the broadcast below reads the parameters directly.
            self.local.synchronize()
        for src, params in self._broadcasts:
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=src, group=self.process_group)
            if src != dist.get_rank():
                offset = 0
                for p in params:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of all parameters (owned or not)."""
        super().zero_grad(set_to_none)
        if self.local is not None:
            self.local.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the local optimizer's state dict and the sharding."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "owners": list(self.owners),
            "local": None if self.local is None else self.local.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a shard saved by :meth:`state_dict` on the same rank of the same sharding.

        Raises:
            ValueError: If the shard was saved by another rank, group size or sharding.
        """
        mine = (self.rank, self.world_size, list(self.owners))
        saved = (state_dict.get("rank"), state_dict.get("world_size"), state_dict.get("owners"))
        if saved != mine:
            raise ValueError(
                f"this shard was saved by rank {saved[0]} of {saved[1]} with another "
                f"sharding; this optimizer is rank {self.rank} of {self.world_size}"
            )
        if self.local is not None:
            self.local.load_state_dict(state_dict["local"])


# Arguments of HybridDeviceOptimizer that are not hyperparameters of a param group: its
# named parameters and the options it takes through **defaults.
_HDO_ONLY = KEYWORD_OPTIONS | {
    name
    for name in inspect.signature(HybridDeviceOptimizer.__init__).parameters
    if name not in ("self", "params", "defaults")
}
