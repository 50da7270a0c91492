"""PyTorch-version shims: the only module that asks which PyTorch is running.

Everything that behaves differently across the supported PyTorch releases (>= 2.6)
is decided here, from :data:`TORCH_VERSION`, so that the rest of the package never
compares versions. Each decision is a plain function of explicit inputs (the version
among them) so that tests can check it for every release of the nox matrix.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Literal

import torch
import torch.utils.checkpoint as torch_checkpoint
from packaging.version import InvalidVersion, Version

__all__ = [
    "MIN_TORCH",
    "PINNED_ALLOC_IN_CAPTURE",
    "TORCH_VERSION",
    "TORCH_VERSION_STRING",
    "autograd_clock",
    "capture_buffer_policy",
    "CHECKPOINT_EARLY_STOP_KWARG",
    "checkpoint_early_stop_off",
    "current_cuda_stream",
    "OnCudaStream",
    "dynamo_skip",
    "swap_dynamo_callback",
    "fused_optimizer_supported",
    "in_backward",
    "in_checkpoint_forward",
    "is_current_stream_capturing",
    "is_fake_or_functional",
    "parse_torch_version",
    "pinned_alloc_in_capture_supported",
    "queue_backward_callback",
    "to_copy_node_type",
]

#: Oldest PyTorch release this package supports.
MIN_TORCH = Version("2.6")

#: First release whose caching host allocator works with CUDA graph memory pools
#: (pytorch#167507), so that pinned host memory can be allocated during capture.
PINNED_ALLOC_IN_CAPTURE = Version("2.11")


def parse_torch_version(version: str) -> Version:
    """Parse a ``torch.__version__`` string, local suffixes and pre-releases included.

    Args:
        version: A string such as ``"2.10.0+cu128"``, ``"2.11.0a0+git123"`` or
            ``"2.13.0+cpu"``.

    Returns:
        The :class:`packaging.version.Version` of the release *without* its local
        suffix (``+cu128``), so that builds of one release compare equal.

    Raises:
        ValueError: If ``version`` is not a PEP 440 version.
    """
    try:
        parsed = Version(str(version))
    except InvalidVersion as err:
        raise ValueError(f"cannot parse the PyTorch version {version!r}") from err
    return Version(parsed.public)


#: The running PyTorch release (without local suffix).
TORCH_VERSION = parse_torch_version(torch.__version__)

#: The running PyTorch's full version string (``2.11.0+cu130``), for reports.
TORCH_VERSION_STRING = str(torch.__version__)


def _release(version: Version) -> tuple[int, ...]:
    # Compare on the release tuple: a pre-release or nightly such as 2.11.0a0 is built
    # from the 2.11 branch and already carries that branch's features.
    return version.release[:2]


def pinned_alloc_in_capture_supported(version: Version | str | None = None) -> bool:
    """Whether pinned host memory can be allocated while a CUDA graph is captured.

    Args:
        version: The PyTorch version to ask about; the running one by default.

    Returns:
        True from PyTorch 2.11 on (nightlies of 2.11 included), False before.
    """
    v = TORCH_VERSION if version is None else parse_torch_version(str(version))
    return _release(v) >= _release(PINNED_ALLOC_IN_CAPTURE)


def capture_buffer_policy(
    retain_pinned_cpu_buffers: bool,
    capturing: bool,
    version: Version | str | None = None,
) -> Literal["retained", "pool"]:
    """Decide where an offloaded layer's host buffers come from.

    This is the single decision behind ``retain_pinned_cpu_buffers``:

    * ``"retained"``: each layer keeps its pinned buffers at fixed addresses across
      iterations (what the caller asked for).
    * ``"pool"``: buffers come from the shared pinned pool and may be allocated now.

    Below PyTorch 2.11 pinned memory cannot be allocated during CUDA graph capture, so
    a capture without retained buffers is refused here, before anything is captured,
    with an error that names the fix. We refuse rather than turning retention on
    silently: retained buffers must already exist from an eager (warm-up) iteration,
    which a switch made at capture time cannot provide.

    Args:
        retain_pinned_cpu_buffers: The caller's flag.
        capturing: Whether a CUDA graph capture is in progress on the current stream.
        version: The PyTorch version; the running one by default.

    Returns:
        ``"retained"`` or ``"pool"``.

    Raises:
        RuntimeError: If capturing below PyTorch 2.11 without retained buffers.
    """
    if retain_pinned_cpu_buffers:
        return "retained"
    if capturing and not pinned_alloc_in_capture_supported(version):
        v = TORCH_VERSION if version is None else parse_torch_version(str(version))
        raise RuntimeError(
            f"CPU offloading during CUDA graph capture on PyTorch {v} needs "
            "retain_pinned_cpu_buffers=True: pinned host memory cannot be allocated "
            "while a graph is captured before PyTorch 2.11. Pass "
            "get_cpu_offload_context(..., retain_pinned_cpu_buffers=True) and run one "
            "eager iteration (the warm-up) before capturing, or upgrade to PyTorch >= 2.11."
        )
    return "pool"


def is_current_stream_capturing() -> bool:
    """Whether a CUDA graph capture is in progress on the current stream (False without CUDA)."""
    # is_initialized, not is_available: no capture runs before CUDA is initialised, and
    # is_available reads environment variables at every call (NOTE [Host cost of CUDA
    # stream calls]); the optimizer asks this for every gradient.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


# NOTE [Host cost of CUDA stream calls]
# torch.cuda.current_stream() and `with torch.cuda.stream(s)` are Python wrappers that
# find the current device through torch.cuda.is_available(), which reads environment
# variables, at every call: 8 and 18 us of host time on an H100 host with PyTorch 2.11,
# where the C functions they end in take 0.2 us. The engine asks for the current stream
# several times per saved tensor, so those wrappers were a third of its host time per
# offloaded tensor. current_cuda_stream and OnCudaStream call the C functions directly
# (the same ones, with the same arguments, in every supported release) and only once
# CUDA is in use: callers hold CUDA tensors, so CUDA is initialised.

_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def current_cuda_stream() -> torch.cuda.Stream:
    """``torch.cuda.current_stream()`` of the current device, at a fraction of its host cost.

    See NOTE [Host cost of CUDA stream calls]. The :class:`torch.cuda.Stream` objects are
    cached by stream id; streams compare and hash by id, so a cached object equals a new one.
    """
    key = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= 64:  # streams come from a fixed pool: this is rare
            _STREAMS.clear()
        stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        _STREAMS[key] = stream
    return stream


def _set_stream(stream_id: int, device_index: int, device_type: int) -> None:
    # Also makes the stream's device the current one, as torch.cuda.set_stream does.
    torch._C._cuda_setStream(
        stream_id=stream_id, device_index=device_index, device_type=device_type
    )


class OnCudaStream:
    """``with torch.cuda.stream(stream)``, at a fraction of its host cost.

    Makes ``stream`` current on its device for the block, then restores the previous
    current stream of that device and of the current device, and the current device
    (see NOTE [Host cost of CUDA stream calls]). Make one per ``with`` block.
    """

    __slots__ = ("_other", "_previous", "stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        stream = self.stream
        device = torch._C._cuda_getDevice()
        self._previous = torch._C._cuda_getCurrentStream(device)
        self._other = (
            None
            if stream.device_index == device
            else torch._C._cuda_getCurrentStream(stream.device_index)
        )
        _set_stream(stream.stream_id, stream.device_index, stream.device_type)

    def __exit__(self, *exc: object) -> None:
        if self._other is not None:
            _set_stream(*self._other)
        _set_stream(*self._previous)  # on the device current before, which it restores


def fused_optimizer_supported(device_type: str, version: Version | str | None = None) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` runs on ``device_type``.

    Fused AdamW exists for CUDA since PyTorch 2.0 and for the CPU since 2.4, so every
    supported release has both; the function exists so that the answer has one home.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        version: The PyTorch version; the running one by default.

    Returns:
        True if fused AdamW/Adam/SGD kernels exist for that device type.
    """
    v = TORCH_VERSION if version is None else parse_torch_version(str(version))
    if device_type == "cuda":
        return _release(v) >= (2, 0)
    if device_type == "cpu":
        return _release(v) >= (2, 4)
    return False


def dynamo_skip(module: str) -> bool:
    """Have TorchDynamo treat ``module`` (a module or package) as PyTorch's own internals.

    Dynamo then neither traces into it (a call from compiled code is a graph break, and
    the function runs as plain Python) nor compiles its functions when they are called
    from compiled code (a saved-tensor hook), while what they call outside it is compiled
    as usual. This is ``torch._dynamo.trace_rules.add``, which every supported release
    has (``tests/test_compat.py`` checks it on each release of the matrix); it imports
    ``torch._dynamo`` (about a second, once per process).

    Args:
        module: A dotted module name, ``"cpu_offload.engine"``.

    Returns:
        False if this PyTorch has no such function (nothing was done), True otherwise.
    """
    from torch._dynamo import trace_rules

    add = getattr(trace_rules, "add", None)
    if add is None:  # pragma: no cover - every supported release has it
        return False
    add(module)
    return True


# TorchDynamo's per-thread frame-evaluation callback: the switch torch.compile sets while
# compiled code runs (so that code called from it is compiled too) and that
# ``torch._dynamo.disable`` clears. The same C function on every supported release.
_set_eval_frame: Callable[[object], object] | None = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "set_eval_frame", None
)


def _no_dynamo(callback: object) -> object:  # pragma: no cover - every release has it
    return None


#: ``swap_dynamo_callback(callback)``: set TorchDynamo's frame-evaluation callback of this
#: thread and return the previous one (None while no compiled code runs). ``None``
#: switches Dynamo's frame evaluation off: Python functions called afterwards run as
#: written, none is compiled, until the previous callback is set back. What
#: ``torch._dynamo.disable`` does, without its wrapper objects. The C function itself,
#: not a Python wrapper around it: the saved-tensor hooks call it twice per saved tensor
#: (NOTE [torch.compile and the offload engine] in ``_compile.py``).
swap_dynamo_callback: Callable[[object], object] = _set_eval_frame or _no_dynamo


def is_fake_or_functional(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake or functional tensor (no real storage to copy)."""
    if torch._is_functional_tensor(tensor):
        return True
    if type(tensor) is torch.Tensor:
        # Asked for every saved tensor: a plain tensor that is not functional is not fake
        # (fake tensors are a subclass), so the general test below is skipped.
        return False
    return _is_fake(tensor)


def _is_fake(tensor: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - every supported release has it
        return False
    return bool(is_fake(tensor))


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass that is running now finishes.

    Must be called from inside a backward pass (a hook).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def autograd_clock() -> int:
    """The sequence number the calling thread's next autograd node will get.

    Nodes are numbered in the order the forward creates them, per thread, so a node whose
    ``_sequence_nr()`` is at least this value was made after this call. Uses
    ``torch._C._autograd._get_sequence_nr``, which every supported release has; where it
    is missing, -1 (callers then assume nothing about the order).
    """
    peek = getattr(torch._C._autograd, "_get_sequence_nr", None)
    return -1 if peek is None else int(peek())


@functools.cache
def to_copy_node_type() -> type:
    """The class of the autograd node that ``tensor.to(dtype)`` (``aten._to_copy``) makes.

    Taken from a real node once, not matched by name.
    """
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.zeros(1, requires_grad=True)
        return type(x.to(torch.float64).grad_fn)


def in_backward() -> bool:
    """Whether the calling thread runs inside a backward pass (a hook, or a recomputation).

    Uses ``torch._C._current_graph_task_id``, which is -1 outside backward in every
    supported release.
    """
    return torch._C._current_graph_task_id() != -1


#: Whether ``torch.utils.checkpoint.checkpoint`` takes ``early_stop`` (PyTorch 2.9 on);
#: before, only the process-wide ``set_checkpoint_early_stop`` context manager sets it.
CHECKPOINT_EARLY_STOP_KWARG = (
    "early_stop" in inspect.signature(torch_checkpoint.checkpoint).parameters
)


def checkpoint_early_stop_off() -> contextlib.AbstractContextManager[None]:
    """Where ``checkpoint`` has no ``early_stop`` argument (before PyTorch 2.9), the
    process-wide switch that turns early stop off for the checkpoints started inside;
    elsewhere nothing (:func:`cpu_offload._layer_call.run_layer_recomputed` passes the
    argument).

    Entered by the engine around a recomputed layer's call, outside the frame
    ``torch.compile`` traces: a checkpoint another thread starts meanwhile runs without
    early stop too, which only costs it time.

    Example:
        >>> with checkpoint_early_stop_off():
        ...     pass
    """
    if CHECKPOINT_EARLY_STOP_KWARG:
        return contextlib.nullcontext()
    return torch_checkpoint.set_checkpoint_early_stop(False)


def in_checkpoint_forward() -> bool:
    """Whether the innermost saved-tensor hooks are those of a checkpoint's forward.

    Inside the forward of ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` the
    checkpoint's hooks replace each saved tensor by a placeholder and recompute it in
    backward; an offload context entered there must leave them in charge (NOTE
    [Offloading inside a checkpoint] in :mod:`cpu_offload.engine.context`). A
    checkpoint's pack hook closes over its ``_CheckpointFrame``; that is how it is told
    from any other hook.

    Returns:
        True inside a non-reentrant checkpoint's forward (selective checkpointing too),
        False elsewhere (a reentrant checkpoint runs its forward without grad, so
        nothing is saved there). Before PyTorch 2.8 the hook stack cannot be read, and
        the answer is whether ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
        is being called further up the stack: True also where other hooks were pushed
        inside that checkpoint, and False for checkpoints that do not go through that
        function (``torch.distributed._composable.checkpoint``).

    Example:
        >>> in_checkpoint_forward()
        False
        >>> x = torch.ones(2, requires_grad=True)
        >>> seen = []
        >>> _ = torch.utils.checkpoint.checkpoint(
        ...     lambda t: seen.append(in_checkpoint_forward()) or t * 2, x, use_reentrant=False
        ... )
        >>> seen
        [True]
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return _checkpoint_on_call_stack()
    hooks = top(False)
    if hooks is None:
        return False
    # The package's own recomputation (NOTE [A lean recomputation] in
    # cpu_offload._recompute) says so on the hooks' owner.
    if getattr(getattr(hooks[0], "__self__", None), "recomputes_in_backward", False):
        return True
    frame_type = getattr(torch_checkpoint, "_CheckpointFrame", None)
    if frame_type is None:  # pragma: no cover - every supported release has it
        return False
    cells = getattr(hooks[0], "__closure__", None) or ()
    for cell in cells:
        try:
            if isinstance(cell.cell_contents, frame_type):
                return True
        except ValueError:  # an empty cell
            continue
    return False


#: The code of ``torch.utils.checkpoint.checkpoint`` itself (under its decorators).
_CHECKPOINT_CODE = inspect.unwrap(torch_checkpoint.checkpoint).__code__


def _checkpoint_on_call_stack() -> bool:
    """:func:`in_checkpoint_forward` where the hook stack cannot be read (before 2.8):
    whether a non-reentrant ``checkpoint`` call is running further up this thread's
    stack, its function being called, or the package's own recomputation's forward."""
    from ._recompute import run_recomputed

    ours = run_recomputed.__code__
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is ours:
            return True
        if frame.f_code is _CHECKPOINT_CODE and frame.f_locals.get("use_reentrant") is False:
            return True
        frame = frame.f_back
    return False
