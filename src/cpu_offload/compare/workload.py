"""What ``compare`` trains: a model, its layer stack, a batch maker and a loss.

The built-in layer kinds, a model of the user's (the Python API, or ``--model
package.module:factory``) and a ``transformers`` model built from a config file
(``--model hf:PATH/config.json``, random weights, nothing downloaded) all become a
:class:`Workload`; the runner only sees that.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._layer_stack import find_layers
from ..models import ModelSpec, build_layers

__all__ = [
    "Workload",
    "default_loss",
    "hf_workload",
    "load_factory",
    "spec_workload",
    "user_workload",
]


class _Chain(nn.Module):
    """Runs a stack of layers one after the other: ``x = layer(x)``."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        values = list(out.values())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    else:
        values = [getattr(out, name) for name in getattr(out, "__dataclass_fields__", {})]
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"the model's output ({type(out).__name__}) holds no tensor to take a loss of")


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(batch)``'s ``.loss`` when it has one, else the mean square of its first tensor."""
    out = model(batch)
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    return _first_tensor(out).float().square().mean()


def _to(batch: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """``batch`` on ``device``; floating-point tensors also in ``dtype`` when given."""
    if isinstance(batch, torch.Tensor):
        if dtype is not None and batch.is_floating_point():
            return batch.to(device=device, dtype=dtype)
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: _to(v, device, dtype) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(v, device, dtype) for v in batch)
    return batch


class _FixedBatch:
    """The first batch ``make`` returns, kept on the host and copied to ``device`` each step.

    Every variant must train on the same batch; a fresh copy each step lets offloading
    free the first layer's input, as in a training loop.
    """

    def __init__(self, make: Callable[[], Any], device: torch.device) -> None:
        self.make = make
        self.device = device
        self.host: Any = None

    def __call__(self) -> Any:
        if self.host is None:
            self.host = _to(self.make(), torch.device("cpu"), None)
        return _to(self.host, self.device, None)


@dataclass
class Workload:
    """A model to compare on.

    Attributes:
        model: The whole model (its parameters are the ones compared).
        layers: Its layer stack, in forward order (what the variants wrap).
        make_batch: Makes the batch of a step, on the model's device; called once per
            step and the result not kept, so that offloading can free it. It returns
            the same batch every time.
        loss_fn: ``loss_fn(model, batch)`` runs the forward and returns the loss.
        description: How the report names the model.
        facts: Sizes the report shows (hidden, heads, seq, batch, ...; None when unknown).
    """

    model: nn.Module
    layers: list[nn.Module]
    make_batch: Callable[[], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = default_loss
    description: str = "model"
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def spec_workload(spec: ModelSpec, device: torch.device | str) -> Workload:
    """A built-in layer kind: ``spec.layers`` layers, a fixed batch, the mean square loss."""
    device = torch.device(device)
    layers = build_layers(spec, device)
    batch = spec.make_input("cpu")  # one batch, copied to the device for every step

    def make_batch() -> torch.Tensor:
        return batch.to(device)

    return Workload(
        model=_Chain(list(layers)),
        layers=list(layers),
        make_batch=make_batch,
        description=spec.kind,
        facts={"hidden": spec.hidden, "heads": spec.heads, "seq": spec.seq, "batch": spec.batch},
    )


def user_workload(
    model: nn.Module | Sequence[nn.Module],
    make_batch: Callable[[], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    *,
    layers: Sequence[nn.Module] | None = None,
    description: str | None = None,
) -> Workload:
    """A model of the user's, for :func:`~cpu_offload.compare.compare_model`.

    Raises:
        TypeError: If ``make_batch`` or ``loss_fn`` is not callable, or the model has no
            parameters.
        ValueError: If the layer stack cannot be found (pass ``layers``).
    """
    if not callable(make_batch):
        raise TypeError(f"make_batch must be callable, got {type(make_batch).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(model, nn.Module):
        model = _Chain(find_layers(model))
    elif isinstance(model, nn.ModuleList):
        model = _Chain(list(model))
    stack = find_layers(model if layers is None else layers)
    first = next(model.parameters(), None)
    if first is None:
        raise TypeError(f"the model ({type(model).__name__}) has no parameters to train")
    return Workload(
        model=model,
        layers=stack,
        make_batch=_FixedBatch(make_batch, first.device),
        loss_fn=loss_fn or default_loss,
        description=description or type(model).__name__,
    )


@contextlib.contextmanager
def _current_folder_first() -> Iterator[None]:
    """The current folder first on ``sys.path`` for the block, as ``python -m`` puts it.

    The ``cpu-offload`` console script starts with its own folder there instead, so a
    package in the folder it runs from would not be found.
    """
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)


def _import_error(text: str, module_name: str, err: ImportError) -> str:
    """What failed in importing ``module_name``, and how to fix it."""
    missing = getattr(err, "name", None) or ""
    itself = isinstance(err, ModuleNotFoundError) and (
        module_name == missing or module_name.startswith(missing + ".")
    )
    if not itself:
        # The module was found; something it imports was not.
        return (
            f"--model {text!r}: cannot import {module_name!r}: importing it raised "
            f"{type(err).__name__}: {err}"
        )
    top = module_name.partition(".")[0]
    return (
        f"--model {text!r}: cannot import {module_name!r}: {err}; looked in the current "
        f"folder ({os.getcwd()}) and on sys.path. Run from the folder that holds {top!r} "
        f"(a package or {top}.py), or add that folder to PYTHONPATH "
        "(PYTHONPATH=/path/to/that/folder cpu-offload ...)"
    )


def load_factory(text: str) -> Callable[..., Any]:
    """The function named by ``package.module:factory``.

    The module is imported as ``python -m`` would import it: from the current folder
    first, then ``sys.path``.

    Raises:
        ValueError: If ``text`` is not of that form, the module cannot be imported (the
            message says where it looked and how to fix it), or it has no callable of
            that name.
    """
    module_name, sep, attr = text.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {text!r}: expected package.module:factory")
    try:
        with _current_folder_first():
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(_import_error(text, module_name, err)) from None
    factory: Any = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise ValueError(f"--model {text!r}: {module_name} has no callable {attr!r}")
    return factory  # type: ignore[return-value]


def _is_batch(batch: Any) -> bool:
    """Whether ``batch`` is a tensor, or a tuple, list or dict of them (nested)."""
    if isinstance(batch, torch.Tensor):
        return True
    if isinstance(batch, Mapping):
        return bool(batch) and all(_is_batch(v) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return bool(batch) and all(_is_batch(v) for v in batch)
    return False


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, Mapping) else batch
    return [t for v in values for t in _tensors(v)]


def _call_factory(text: str, factory: Callable[..., Any], offered: dict[str, Any]) -> Any:
    """Call the factory with those of ``offered`` it accepts; its failures as ValueError."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing
        params = {}  # type: ignore[assignment]
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if v is not None and (takes_all or k in params)}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    needed = [
        name
        for name, p in params.items()
        if p.default is inspect.Parameter.empty
        and (p.kind in positional or p.kind is inspect.Parameter.KEYWORD_ONLY)
        and name not in kwargs
    ]
    if needed:
        options = [f"--{n}" for n in needed if n in offered]
        others = [n for n in needed if n not in offered]
        how = "; ".join(
            ([f"pass {', '.join(options)}"] if options else [])
            + ([f"give {', '.join(others)} a default"] if others else [])
        )
        raise ValueError(
            f"--model {text!r}: the factory needs {', '.join(repr(n) for n in needed)}, "
            "which the command line does not pass (it passes device, dtype, and seq and "
            f"batch when --seq and --batch are given): {how}"
        )
    try:
        return factory(**kwargs)
    except Exception as err:
        raise ValueError(
            f"--model {text!r}: the factory raised {type(err).__name__}: {err}"
        ) from err


def _trial_forward(text: str, workload: Workload) -> None:
    """One forward of the loss without gradients, to report a failing factory at once.

    The model's buffers (running statistics) and the random state are put back, so
    that the comparison starts from the model the factory made.
    """
    try:
        batch = workload.make_batch()
    except Exception as err:
        raise ValueError(
            f"--model {text!r}: the factory's make_batch raised {type(err).__name__}: {err}"
        ) from err
    if not _is_batch(batch):
        raise ValueError(
            f"--model {text!r}: make_batch must return a tensor, or a tuple, list or dict "
            f"of tensors, got {type(batch).__name__}"
        )
    model = workload.model
    buffers = [(b, b.clone()) for b in model.buffers()]
    devices = [workload.device] if workload.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            workload.loss_fn(model, batch)
    except Exception as err:
        kinds = sorted({str(t.dtype).removeprefix("torch.") for t in _tensors(batch)})
        hint = ""
        if not any(t.is_floating_point() for t in _tensors(batch)):
            hint = " (the batch holds no floating-point tensor: a model that takes floats "
            hint += "needs make_batch to return them)"
        raise ValueError(
            f"--model {text!r}: the first forward of the factory's model on its batch "
            f"({', '.join(kinds)}) failed{hint}: {type(err).__name__}: {err}"
        ) from err
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def factory_workload(
    text: str, device: torch.device | str, dtype: torch.dtype, seq: int | None, batch: int | None
) -> Workload:
    """Call the factory of ``--model package.module:factory`` and wrap what it returns.

    The factory is called with those of ``device``, ``dtype``, ``seq`` and ``batch`` it
    accepts as keyword arguments (``seq`` and ``batch`` only when given). It returns
    ``(model, make_batch)`` or ``(model, make_batch, loss_fn)``; the model is moved to
    ``device`` and ``dtype``, and each batch to ``device`` (floating-point tensors to
    ``dtype``). One forward without gradients checks that they run together.

    Raises:
        ValueError: If the factory cannot be loaded, needs an argument the command line
            cannot pass, raises, or returns something else; if the model has no
            parameters, ``make_batch`` does not return tensors, or the first forward
            fails (the message holds the original error).
    """
    factory = load_factory(text)
    offered = {"device": torch.device(device), "dtype": dtype, "seq": seq, "batch": batch}
    made = _call_factory(text, factory, offered)
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not isinstance(made[0], nn.Module):
        raise ValueError(
            f"--model {text!r}: the factory must return (model, make_batch) or "
            f"(model, make_batch, loss_fn), got {type(made).__name__}"
        )
    model = made[0].to(device=device, dtype=dtype)
    dev = torch.device(device)
    user_make = made[1]

    def make_batch() -> Any:
        return _to(user_make(), dev, dtype)

    loss_fn = made[2] if len(made) == 3 else None
    try:
        if not callable(user_make):
            raise TypeError(f"make_batch must be callable, got {type(user_make).__name__}")
        workload = user_workload(model, make_batch, loss_fn, description=text)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--model {text!r}: {err}") from err
    _trial_forward(text, workload)
    return workload


def hf_workload(
    path: str,
    device: torch.device | str,
    dtype: torch.dtype,
    seq: int,
    batch: int,
    layers: int | None = None,
) -> Workload:
    """A ``transformers`` causal language model built from ``config.json``, random weights.

    Nothing is downloaded: the config file is read, the model built with SDPA
    attention, and trained on random tokens with its own language-model loss.

    Args:
        path: The config file (or the folder holding ``config.json``).
        device: Where the model runs.
        dtype: The parameters' dtype.
        seq: Tokens per sequence.
        batch: Sequences per batch.
        layers: Overrides the config's ``num_hidden_layers`` when given.

    Raises:
        ValueError: If ``transformers`` is not installed, or the config cannot be read.
    """
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "--model hf:...: needs transformers: pip install 'cpu-offload[hf]'"
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"--model hf:{path}: cannot read the config: {err}") from None
    if layers is not None:
        config.num_hidden_layers = layers
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(device=device, dtype=dtype)
    vocab = config.vocab_size
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    dev = torch.device(device)

    def make_batch() -> torch.Tensor:
        return tokens.to(dev)

    def loss_fn(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    return Workload(
        model=model,
        layers=find_layers(model),
        make_batch=make_batch,
        loss_fn=loss_fn,
        description=f"hf:{Path(path).name if Path(path).is_file() else path} "
        f"({type(model).__name__})",
        facts={
            "hidden": getattr(config, "hidden_size", None),
            "heads": getattr(config, "num_attention_heads", None),
            "seq": seq,
            "batch": batch,
        },
    )
