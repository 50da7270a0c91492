"""offload_layers: one call on real models, bit-identical to no offloading (CPU stand-in)."""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import cpu_offload
from cpu_offload import HostTransport, offload_layers
from cpu_offload._layer_stack import offload_schedule
from cpu_offload.v2.schedule import default_synchronization_dict, validate_synchronization_dict

MIN = 256


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=["v2", "v1"])
def backend(request, monkeypatch):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1" if request.param == "v1" else "0")
    return request.param


def _kwargs(backend: str, transport: HostTransport) -> dict:
    # min_tensor_size_to_offload is V2-only (V1 offloads what is marked).
    if backend == "v1":
        return {"transport": transport}
    return {"transport": transport, "min_tensor_size_to_offload": MIN}


Result = list[tuple[torch.Tensor, list[torch.Tensor]]]


def _train(model: nn.Module, batches, loss_fn: Callable[[nn.Module, object], torch.Tensor]):
    out = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
    return out


def _assert_equal(got: Result, want: Result) -> None:
    assert len(got) == len(want)
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want, strict=True):
        assert torch.equal(loss, ref_loss), (loss, ref_loss)
        assert len(grads) == len(ref_grads)
        for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
            assert torch.equal(g, r), f"gradient {i}: max |diff| {(g - r).abs().max()}"


def _sequential(n: int = 5, width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n)])


def _batches(count: int, *shape: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=gen) for _ in range(count)]


def _square(model, x):
    return model(x).square().mean()


def _check(model, batches, loss_fn, backend, **offload):
    """Reference, then offloaded, then after remove(): all three bit-identical."""
    want = _train(model, batches, loss_fn)
    transport = HostTransport()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # k == n-1 warns
        handle = offload_layers(model, **offload, **_kwargs(backend, transport))
    assert handle.backend == (backend if handle.offloaded else None)
    got = _train(model, batches, loss_fn)
    _assert_equal(got, want)
    if handle.offloaded:
        assert transport.bytes_offloaded > 0, "nothing was offloaded"
    handle.remove()
    assert not any("forward" in layer.__dict__ for layer in handle.layers)
    moved = transport.bytes_offloaded
    _assert_equal(_train(model, batches, loss_fn), want)
    assert transport.bytes_offloaded == moved, "offloading continued after remove()"
    return handle


def test_sequential_bit_identical_and_remove_restores(backend):
    model = _sequential()
    handle = _check(model, _batches(3, 32, 64), _square, backend, num_offloaded=2)
    assert handle.num_layers == 5 and handle.offloaded == (0, 1)


def test_transformer_encoder_found_by_itself(backend):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    handle = _check(model, _batches(2, 2, 32, 64), _square, backend, num_offloaded=2)
    assert handle.layers == list(model.layers)


def _llama(layers: int = 4):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _lm_loss(model, tokens):
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def _tokens(count: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 128, (2, 32), generator=gen) for _ in range(count)]


def test_llama_whole_model_bit_identical(backend):
    model = _llama()
    handle = _check(model, _tokens(), _lm_loss, backend, num_offloaded=2)
    assert handle.layers == list(model.model.layers)


def test_llama_offloaded_and_recomputed_layers():
    model = _llama()
    _check(model, _tokens(), _lm_loss, "v2", offloaded=[0, 2], recomputed=[1])


def test_explicit_set_under_v2_bit_identical(monkeypatch):
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    model = _sequential(6)
    _check(model, _batches(2, 32, 64), _square, "v2", offloaded={1, 3, 4})


def test_recompute_only_needs_no_context(monkeypatch):
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    model = _sequential(4)
    want = _train(model, _batches(2, 32, 64), _square)
    with offload_layers(model, recomputed=[0, 1]) as handle:
        assert handle.context is None and handle.backend is None
        # Every layer runs through the handle, which sees where each forward begins.
        assert all("forward" in layer.__dict__ for layer in model)
        _assert_equal(_train(model, _batches(2, 32, 64), _square), want)
    assert not handle.active and "forward" not in model[0].__dict__


def test_no_grad_evaluation_between_steps(backend):
    model = _sequential()
    batches = _batches(3, 32, 64)
    want = _train(model, batches[:2], _square)
    with torch.no_grad():
        want_eval = model(batches[2])
    transport = HostTransport()
    with offload_layers(model, num_offloaded=2, **_kwargs(backend, transport)):
        got = _train(model, batches[:1], _square)
        moved = transport.bytes_offloaded
        with torch.no_grad():
            assert torch.equal(model(batches[2]), want_eval)
        assert transport.bytes_offloaded == moved, "evaluation offloaded something"
        got += _train(model, batches[1:2], _square)
    _assert_equal(got, want)


def test_gradient_accumulation(backend):
    model = _sequential()
    micro = _batches(3, 16, 64)

    def accumulate():
        model.zero_grad(set_to_none=True)
        losses = []
        for x in micro:
            loss = _square(model, x) / len(micro)
            loss.backward()
            losses.append(loss.detach())
        return [(torch.stack(losses), [p.grad.clone() for p in model.parameters()])]

    want = accumulate() + accumulate()
    with offload_layers(model, num_offloaded=2, **_kwargs(backend, HostTransport())):
        got = accumulate() + accumulate()
    _assert_equal(got, want)


@dataclasses.dataclass
class _Out:
    hidden: torch.Tensor
    aux: torch.Tensor


class _TupleLayer(nn.Module):
    """Takes keyword arguments and returns a tuple, a list or a dataclass."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(64, 64)

    def forward(self, x, *, scale: torch.Tensor, mask: torch.Tensor | None = None):
        h = torch.tanh(self.linear(x)) * scale
        if mask is not None:
            h = h * mask
        aux = h.sum()
        if self.kind == "tuple":
            return h, aux
        if self.kind == "list":
            return [h, aux]
        return _Out(h, aux)


class _TupleModel(nn.Module):
    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_TupleLayer(k) for k in kinds)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        mask = (x > -1).to(x.dtype)
        aux = 0.0
        for layer in self.layers:
            out = layer(x, scale=self.scale, mask=mask)
            x, a = (out.hidden, out.aux) if isinstance(out, _Out) else out
            aux = aux + a
        return x.square().mean() + 1e-3 * aux


def test_tuple_list_dataclass_outputs_and_keyword_arguments(backend):
    model = _TupleModel(["tuple", "dataclass", "list", "tuple"])
    _check(model, _batches(2, 16, 64), lambda m, x: m(x), backend, num_offloaded=2)


def test_huggingface_model_output_is_synced():
    transformers = pytest.importorskip("transformers")

    class _Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(64, 64)

        def forward(self, x):
            return transformers.modeling_outputs.BaseModelOutput(
                last_hidden_state=torch.relu(self.linear(x))
            )

    torch.manual_seed(0)
    layers = nn.ModuleList(_Layer() for _ in range(3))

    def loss_fn(model, x):
        for layer in model:
            x = layer(x).last_hidden_state
        return x.square().mean()

    _check(layers, _batches(2, 16, 64), loss_fn, "v2", num_offloaded=1)


def test_failed_step_then_training_continues_exactly(backend):
    model = _sequential()
    batches = _batches(2, 32, 64)
    want = _train(model, batches, _square)

    def fail(module, args):
        raise RuntimeError("out of memory (simulated)")

    with offload_layers(model, num_offloaded=2, **_kwargs(backend, HostTransport())):
        # A forward that stops between two layers: layer 3 never runs.
        hook = model[3].register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="simulated"):
            model(batches[0])
        hook.remove()
        got = _train(model, batches, _square)
    _assert_equal(got, want)


def test_bad_output_type_is_a_clear_error_and_recovers(monkeypatch):
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)

    class _DictLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return {"h": self.linear(x)}

    layers = nn.ModuleList(_DictLayer() for _ in range(2))
    offload_layers(layers, num_offloaded=1, transport=HostTransport())
    with pytest.raises(TypeError, match="layer 0 returned a dict"):
        layers[0](torch.randn(2, 8))


def test_num_offloaded_range_under_v1(monkeypatch):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    with pytest.raises(ValueError, match=r"num_offloaded must be in \[0, 4\] .* V1"):
        offload_layers(_sequential(4), 5)
    offload_layers(_sequential(4), 4, transport=HostTransport()).remove()  # all 4 is allowed


def test_errors_name_the_argument(monkeypatch):
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    model = _sequential(4)
    with pytest.raises(ValueError, match="not both"):
        offload_layers(model, 1, offloaded=[0])
    with pytest.raises(ValueError, match="both offloaded and recomputed"):
        offload_layers(model, 2, recomputed=[1, 2])
    with pytest.raises(ValueError, match="offloaded: layer index 4 is out of range"):
        offload_layers(model, offloaded=[4])
    with pytest.raises(TypeError, match="recomputed must hold ints"):
        offload_layers(model, recomputed=["0"])
    # The range is the backend's: 5 of 4 once said "[0, 4]", and then 4 was refused too.
    for k in (5, 4):
        with pytest.raises(ValueError, match=r"num_offloaded must be in \[0, 3\] .* V2"):
            offload_layers(model, k)
    with pytest.raises(ValueError, match="nothing to do"):
        offload_layers(model)
    with pytest.raises(TypeError, match="sets model_layers, num_layers itself"):
        offload_layers(model, 1, num_layers=2, model_layers=4)
    # A misspelled context argument fails at the call, with or without an offloaded
    # layer (none makes no context, and a later reassign would have been the first to
    # see it); nothing stays wrapped.
    for choice in ({"num_offloaded": 1}, {"recomputed": [0]}, {"recast": [0]}):
        with pytest.raises(
            TypeError,
            match="an unexpected keyword argument 'min_tensor_size_to_ofload'; the "
            "offload context takes .*min_tensor_size_to_offload, transport",
        ):
            offload_layers(model, min_tensor_size_to_ofload=4, **choice)
    offload_layers(model, recomputed=[0], min_tensor_size_to_offload=4).remove()
    with pytest.raises(ValueError, match="could not find the layer stack of Linear"):
        offload_layers(nn.Linear(2, 2), 1)
    with pytest.raises(TypeError, match="entry 1 of the layer sequence"):
        offload_layers([nn.Linear(2, 2), "x"], 1)
    with pytest.raises(ValueError, match="the same module appears twice"):
        offload_layers([model[0], model[0]], 1)
    handle = offload_layers(model, 1, transport=HostTransport())
    with pytest.raises(ValueError, match="already wrapped"):
        offload_layers(model, 1)
    handle.remove()
    handle.remove()  # a second remove does nothing


def test_v1_refuses_a_set_that_is_not_the_first_layers(monkeypatch):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    with pytest.raises(ValueError, match="V1 backend .* offloads only the first k layers"):
        offload_layers(_sequential(4), offloaded=[1, 2])
    # The first k, given as a set, are fine.
    offload_layers(_sequential(4), offloaded=[1, 0], transport=HostTransport()).remove()


def test_remove_refuses_to_drop_a_later_wrapper(monkeypatch):
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    model = _sequential(3)
    handle = offload_layers(model, 1, transport=HostTransport())
    model[1].forward = lambda x: x
    with pytest.raises(RuntimeError, match="was replaced after offload_layers wrapped it"):
        handle.remove()


def test_a_layer_with_its_own_forward_attribute_gets_it_back(monkeypatch):
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    model = _sequential(3)
    own = model[0].forward
    model[0].forward = own  # an instance attribute already there (another library's)
    handle = offload_layers(model, 1, transport=HostTransport())
    handle.remove()
    assert model[0].__dict__["forward"] is own


def test_offload_schedule_extends_the_default_rule():
    for n in range(1, 7):
        for k in range(n):
            assert offload_schedule(frozenset(range(k)), n) == default_synchronization_dict(k, n)
        for m in range(1, n):
            for subset in itertools.combinations(range(n), m):
                schedule = offload_schedule(frozenset(subset), n)
                assert validate_synchronization_dict(schedule, n) == schedule


def test_exported_from_the_package():
    assert cpu_offload.offload_layers is offload_layers
    assert "offload_layers" in cpu_offload.__all__


# -- copies of a wrapped model, and the order of the layers ------------------------------


def test_deepcopy_of_a_wrapped_model_runs_its_own_weights(backend):
    import copy

    model = _sequential()
    batches = _batches(2, 16, 64)
    want = _train(model, batches, _square)
    transport = HostTransport()
    handle = offload_layers(model, num_offloaded=2, **_kwargs(backend, transport))
    twin = copy.deepcopy(model)  # an EMA or reference copy, made while wrapped
    for p in twin.parameters():
        torch.nn.init.zeros_(p)
    with torch.no_grad():
        assert torch.equal(twin(batches[0]), torch.zeros(16, 64))
    moved = transport.bytes_offloaded
    twin_loss = _square(twin, batches[0])
    twin_loss.backward()  # runs plainly: outside the original's schedule
    assert transport.bytes_offloaded == moved
    _assert_equal(_train(model, batches, _square), want)
    handle.remove()


def test_saving_a_wrapped_model_loads_a_plain_one(tmp_path):
    model = _sequential()
    x = _batches(1, 16, 64)[0]
    handle = offload_layers(model, num_offloaded=2, transport=HostTransport())
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    loaded_loss = _square(loaded, x)
    loaded_loss.backward()
    handle.remove()


@pytest.mark.parametrize(
    ("order", "cause"),
    [
        ([0, 1, 1], "layer 1 ran twice in a row"),
        ([0, 1, 3], "layer(s) 2 did not run between layers 1 and 3"),
        ([0, 1, 2, 1], "layer 1 ran again after layer 2"),
        ([2], "the forward began at layer 2"),
    ],
)
def test_layers_run_out_of_order_fail_at_the_call_then_train_exactly(backend, order, cause):
    model = _sequential()
    batches = _batches(2, 16, 64)
    want = _train(model, batches, _square)
    handle = offload_layers(model, num_offloaded=2, **_kwargs(backend, HostTransport()))
    x = batches[0].requires_grad_()
    with pytest.raises(RuntimeError, match=re_escape(cause)):
        for i in order:
            x = model[i](x)
    _assert_equal(_train(model, batches, _square), want)
    handle.remove()


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_models_own_checkpointing_recomputes_outside_the_schedule(backend):
    # Layers checkpointed by the model itself rerun their forward inside backward; the
    # rerun must not count as a new forward of the offload schedule.
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, inner: nn.Sequential) -> None:
            super().__init__()
            self.layers = inner

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x

    model = Checkpointed(_sequential())
    batches = _batches(2, 16, 64)
    want = _train(model, batches, _square)
    handle = offload_layers(model, num_offloaded=2, **_kwargs(backend, HostTransport()))
    _assert_equal(_train(model, batches, _square), want)
    handle.remove()


def test_remove_frees_the_host_buffers_without_waiting_for_the_garbage_collector(backend):
    # A benchmark that applied one configuration after another on a large model ran out
    # of host memory on pinned buffers that nothing used any more: remove() drops them at
    # once, while the handle (and its transport) is still held, without the garbage
    # collector.
    import gc
    import weakref

    model = _sequential()
    transport = HostTransport()
    handle = offload_layers(model, num_offloaded=3, **_kwargs(backend, transport))
    x = torch.randn(32, 64)
    for _ in range(2):
        marked = x.clone().requires_grad_()
        model(marked).square().mean().backward()
    free = [buf for bucket in transport.pool._free.values() for buf in bucket]
    assert free and transport.pool.allocated_bytes > 0, "no host buffer was used"
    refs = [weakref.ref(buf) for buf in free]
    del free
    gc.disable()
    try:
        handle.remove()
        assert transport.pool.allocated_bytes == 0
        assert not any(ref() is not None for ref in refs), "a host buffer is still alive"
    finally:
        gc.enable()
