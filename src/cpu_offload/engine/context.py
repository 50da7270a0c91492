"""The ``with`` block of an offload context, shared by the V1 and V2 front-ends.

Entering claims the context for the calling thread, pushes the saved-tensor hooks and
marks the context active (what ``is_cpu_offload_enabled()`` reports); leaving undoes all
three, and an exception that leaves the block lets the front-end end what it started.
Subclasses decide which hooks a block gets (:meth:`OffloadContextBase._open`) and what
a failed block ends (:meth:`OffloadContextBase._abort`).
"""

# NOTE [Offloading inside a checkpoint]
# A layer may run inside the forward of a non-reentrant activation checkpoint that the
# model applies itself (transformers' gradient_checkpointing_enable, a CheckpointWrapper,
# torch.utils.checkpoint around a block). The checkpoint's saved-tensor hooks keep
# nothing of what the layer saves: each tensor becomes a placeholder, recomputed in
# backward. Saved-tensor hooks nest, and only the innermost pair sees a tensor: pushed
# inside the checkpoint, the offload hooks would take every tensor the checkpoint means
# to drop, copy it to the host and back, and hold the reloaded copies until the layer's
# backward: more bytes moved, and a higher peak than the checkpoint alone. So a block
# entered inside a checkpoint's forward pushes no saved-tensor hooks: the layer still
# counts in the schedule, and the checkpoint frees what it promises. What the checkpoint
# does keep, the layer's inputs, it saves before its own hooks are pushed: to offload
# those, the offload context must be entered around the checkpoint, not inside it, which
# offload_layers arranges where it can (NOTE [Layers that checkpoint themselves] in
# cpu_offload.layers).

from __future__ import annotations

from types import TracebackType

from .._compat import in_checkpoint_forward
from .._compile import keep_engine_out_of_compile, outside_compile
from .._log import logger
from .active import ActiveHooks, ContextOwner

__all__ = ["OffloadContextBase"]


class OffloadContextBase:
    """Saved-tensor hooks and active-context state around one layer's forward.

    Attributes:
        inside_context: True only inside the ``with`` block.
    """

    def __init__(self) -> None:
        keep_engine_out_of_compile()  # see NOTE [torch.compile and the offload engine]
        self.inside_context = False
        self._hooks: ActiveHooks | None = None
        self._owner = ContextOwner()

    def is_current_layer_offloaded(self) -> bool:
        """Whether the layer whose forward runs in this block is offloaded."""
        return False

    def _layer_pending(self) -> bool:
        """Whether a layer entered earlier still waits for its sync (see ContextOwner)."""
        return False

    def _open(self) -> ActiveHooks:
        """The hooks for the block being entered; may raise (nothing is pushed yet)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _open")

    def _abort(self) -> None:
        """Called when an exception leaves the ``with`` block."""

    def _on_exit(self) -> None:
        """Called when the ``with`` block ends without an exception."""

    @outside_compile  # see NOTE [torch.compile and the offload engine]
    def __enter__(self) -> OffloadContextBase:
        owner = self._owner
        owner.claim(self._layer_pending())
        try:
            hooks = self._open()
            if hooks.has_hooks and in_checkpoint_forward():
                # See NOTE [Offloading inside a checkpoint].
                logger.debug("offload context entered inside a checkpoint: no hooks pushed")
                hooks = ActiveHooks(self)
            hooks.__enter__()  # last step: nothing after it can fail
        except BaseException:
            owner.release()
            raise
        self._hooks = hooks
        self.inside_context = True
        return self

    @outside_compile
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.inside_context = False
        self._owner.release()
        hooks, self._hooks = self._hooks, None
        if hooks is None:
            return
        hooks.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            self._abort()
        else:
            self._on_exit()
