"""Misuse of HybridDeviceOptimizer, on the CPU: refused where it happens, naming the
argument, leaving the optimizer as it was; and what PyTorch's optimizers allow (state
hooks, resetting state through ``optimizer.state``) works the same way.

CPU tensors stand in for device parameters (``is_device_param``, ``optim_helpers.every_param``),
as in test_optim.py.
"""

from __future__ import annotations

import collections
import copy
import pickle
import time
from typing import Any

import pytest
import torch
from optim_helpers import ADAMW, every_param
from optim_helpers import same_params as _equal
from torch.optim.optimizer import register_optimizer_step_post_hook

from cpu_offload.optim import HybridDeviceOptimizer


def _hdo(params: Any, fraction: float = 0.5, **kwargs: Any) -> HybridDeviceOptimizer:
    return HybridDeviceOptimizer(
        params, offload_fraction=fraction, is_device_param=every_param, **kwargs
    )


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()


# -- construction ----------------------------------------------------------------------------


def test_a_set_of_params_is_refused_as_by_torch() -> None:
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 5, 7)]
    with pytest.raises(TypeError, match=r"params is a set"):
        _hdo(set(params))
    with pytest.raises(TypeError, match=r"params\[0\]\['params'\] is a set"):
        _hdo([{"params": set(params)}])
    _hdo([{"params": params}])  # a list is fine


def test_a_parameter_listed_twice_is_refused() -> None:
    w = torch.nn.Parameter(torch.ones(4))
    with pytest.warns(UserWarning, match="duplicate"):  # PyTorch's own warning first
        with pytest.raises(ValueError, match="lists a parameter twice"):
            _hdo([w, w], fraction=1.0)
    opt = _hdo([torch.nn.Parameter(torch.ones(2))])
    with pytest.warns(UserWarning, match="duplicate"):
        with pytest.raises(ValueError, match="lists a parameter twice"):
            opt.add_param_group({"params": [w, w]})
    assert len(opt.param_groups) == 1  # the refused group is not kept
    opt.add_param_group({"params": [w]})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (torch.optim.LBFGS, "needs a closure"),
        (torch.optim.Optimizer, "not the base class"),
    ],
)
def test_optimizer_classes_it_cannot_step_are_refused(cls: type, match: str) -> None:
    params = [torch.nn.Parameter(torch.randn(4))]
    with pytest.raises(TypeError, match=f"cpu_optimizer_cls.*{match}"):
        _hdo(params, cpu_optimizer_cls=cls)
    with pytest.raises(TypeError, match=f"gpu_optimizer_cls.*{match}"):
        _hdo(params, gpu_optimizer_cls=cls)


def test_numpy_scalars_are_fractions() -> None:
    np = pytest.importorskip("numpy")
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    for value in (np.float32(0.5), np.float64(0.5)):
        assert _hdo(params, fraction=value).offload_fraction == 0.5  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="offload_fraction must be a float"):
        _hdo(params, fraction=True)


def test_is_device_param_must_answer_a_bool() -> None:
    params = [torch.nn.Parameter(torch.randn(4))]
    with pytest.raises(TypeError, match=r"is_device_param must return a bool.*str 'no'"):
        HybridDeviceOptimizer(params, is_device_param=lambda p: "no")


# -- step ------------------------------------------------------------------------------------


def test_a_sparse_gradient_on_an_offloaded_parameter_is_refused_before_any_step() -> None:
    model = _model()
    opt = _hdo(model.parameters(), fraction=0.5, **ADAMW)
    model(torch.randn(4, 8)).sum().backward()
    offloaded = [p for p, e in zip(model.parameters(), opt._entries, strict=True) if e.offloaded]
    offloaded[0].grad = offloaded[0].grad.to_sparse()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"parameter \d+ .* is offloaded and has a torch.sparse"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert not opt.state_dict()["state"]  # nothing was stepped
    offloaded[0].grad = offloaded[0].grad.to_dense()  # the next step goes on
    opt.step()


def test_complex_parameters_step_as_with_adamw() -> None:
    # The fused kernels HDO chooses by default take no complex tensors.
    torch.manual_seed(0)
    start = [torch.randn(4, dtype=torch.complex64) for _ in range(2)]
    grads = [torch.randn(4, dtype=torch.complex64) for _ in range(2)]
    results = []
    for make in (lambda ps: torch.optim.AdamW(ps, lr=0.1), lambda ps: _hdo(ps, 0.5, lr=0.1)):
        params = [torch.nn.Parameter(s.clone()) for s in start]
        opt = make(params)
        for _ in range(2):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
        results.append(params)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


# -- state -----------------------------------------------------------------------------------


def test_a_failed_load_leaves_the_optimizer_as_it_was() -> None:
    a, b = _model(), _model()
    opt = _hdo(a.parameters(), **ADAMW)
    plain = torch.optim.AdamW(b.parameters(), **ADAMW)
    _train(a, opt, 3)
    _train(b, plain, 3)
    bad = copy.deepcopy(opt.state_dict())  # a corrupt checkpoint ...
    bad["param_groups"][0]["lr"] = 99.0  # ... whose readable parts differ from the state
    for index in (0, 1, 2):
        bad["state"][index]["exp_avg"] += 1.0
    bad["state"][3]["step"] = "five"
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == ADAMW["lr"]
    _train(a, opt, 1, seed=4)
    _train(b, plain, 1, seed=4)
    assert _equal(a, b)
    assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == [4.0] * 4
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        opt.load_state_dict(None)  # type: ignore[arg-type]


def _hooks_run(make: Any) -> list[str]:
    """The hooks one state_dict() and load_state_dict() of ``make``'s optimizer ran."""
    seen: list[str] = []
    model = _model()
    opt = make(model.parameters())

    def sd_post(o: Any, sd: dict) -> dict:
        seen.append("sd_post")
        return {**sd, "extra": 1}

    def load_pre(o: Any, sd: dict) -> dict:
        seen.append("load_pre")
        return {k: v for k, v in sd.items() if k != "extra"}

    opt.register_state_dict_pre_hook(lambda o: seen.append("sd_pre"))
    opt.register_state_dict_post_hook(sd_post)
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load_post"))
    _train(model, opt, 1)
    sd = opt.state_dict()
    assert sd["extra"] == 1  # the post hook's state dict replaced it
    opt.load_state_dict(sd)  # the pre hook's took the key out again
    return seen


def test_state_dict_hooks_run_as_for_torch_optimizers() -> None:
    want = _hooks_run(lambda ps: torch.optim.AdamW(ps, **ADAMW))
    assert want == ["sd_pre", "sd_post", "load_pre", "load_post"]
    assert _hooks_run(lambda ps: _hdo(ps, **ADAMW)) == want


@pytest.mark.parametrize(
    "reset",
    [
        lambda opt, params: opt.state.clear(),
        lambda opt, params: [opt.state.__setitem__(p, {}) for p in params],
        lambda opt, params: [opt.state.__delitem__(p) for p in params],
        lambda opt, params: [opt.state.pop(p) for p in params],
        lambda opt, params: [opt.state[p]["exp_avg"].zero_() for p in params],
    ],
    ids=["clear", "assign-empty", "del", "pop", "in-place"],
)
def test_state_reset_through_optimizer_state_as_with_adamw(reset: Any) -> None:
    results = []
    for make in (lambda ps: torch.optim.AdamW(ps, **ADAMW), lambda ps: _hdo(ps, **ADAMW)):
        model = _model()
        opt = make(model.parameters())
        _train(model, opt, 2)
        reset(opt, list(model.parameters()))
        _train(model, opt, 2, seed=2)
        results.append((model, [float(s["step"]) for s in opt.state_dict()["state"].values()]))
    (a, steps_a), (b, steps_b) = results
    assert _equal(a, b)
    assert steps_a == steps_b


def test_state_assigned_a_non_empty_dict_is_refused() -> None:
    model = _model()
    opt = _hdo(model.parameters(), **ADAMW)
    _train(model, opt, 1)
    p = next(model.parameters())
    with pytest.raises(TypeError, match="load_state_dict"):
        opt.state[p] = {"step": torch.tensor(5.0)}
    assert float(opt.state[p]["step"]) == 1.0


class _SlowAdamW(torch.optim.AdamW):
    """A host optimizer slow enough that its first step still runs when step() returns."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        time.sleep(0.05)
        return super().step(closure)


def _overlapped(model: torch.nn.Module) -> HybridDeviceOptimizer:
    # The host step runs on a worker thread under the next forward: right after the
    # first step(), the offloaded parameters' state is still being made there.
    return _hdo(
        model.parameters(),
        1.0,
        overlap_host_step_with_forward=True,
        cpu_optimizer_cls=_SlowAdamW,
        **ADAMW,
    )


def test_reading_state_right_after_an_overlapped_step_drops_nothing() -> None:
    a, b = _model(), _model()
    opt = _overlapped(a)
    plain = torch.optim.AdamW(b.parameters(), **ADAMW)
    _train(a, opt, 1)
    _train(b, plain, 1)
    time.sleep(0.5)  # the host step has made the state; the view was made before it
    for p in a.parameters():
        assert isinstance(opt.state[p], dict)  # a read, as code that inspects state does
    _train(a, opt, 1, seed=3)
    _train(b, plain, 1, seed=3)
    opt.synchronize()
    assert _equal(a, b)
    assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == [2.0] * 4


@pytest.mark.parametrize("how", ["clear", "del"])
def test_state_reset_right_after_an_overlapped_step_resets_it(how: str) -> None:
    a, b = _model(), _model()
    opt = _overlapped(a)
    plain = torch.optim.AdamW(b.parameters(), **ADAMW)
    for model, o in ((a, opt), (b, plain)):
        _train(model, o, 1)
        if how == "clear":
            o.state.clear()
        else:
            for p in model.parameters():
                del o.state[p]
        _train(model, o, 1, seed=3)
    opt.synchronize()
    assert _equal(a, b)
    assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == [1.0] * 4


@pytest.mark.parametrize("how", ["clear", "del", "setdefault"])
def test_optimizer_state_shows_a_reset_made_right_after_an_overlapped_step(how: str) -> None:
    model = _model()
    opt = _overlapped(model)
    _train(model, opt, 1)
    time.sleep(0.5)  # the host step has made the state; the view was made before it
    state = opt.state  # the object the caller holds
    params = list(model.parameters())
    if how == "clear":
        state.clear()
    elif how == "del":
        del state[params[0]]
    else:  # a read through setdefault drops nothing
        assert state.setdefault(params[0], {})["step"] == 1.0
    assert opt.state is state
    if how == "setdefault":
        assert len(state) == 4 and len(opt.state_dict()["state"]) == 4
    else:
        assert params[0] not in state and len(state) == (0 if how == "clear" else 3)


@pytest.mark.timeout(60)  # a regression hangs: the host step waits for itself
def test_a_step_hook_that_waits_for_the_host_step_from_inside_it_is_refused() -> None:
    model = _model()
    opt = _overlapped(model)
    errors: list[BaseException] = []

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if isinstance(optimizer, _SlowAdamW):  # a host sub-optimizer, on the host thread
            try:
                opt.state.pop(next(model.parameters()), None)
            except RuntimeError as exc:
                errors.append(exc)

    handle = register_optimizer_step_post_hook(hook)
    try:
        _train(model, opt, 1)
        opt.synchronize()  # returns: the host step did not wait for itself
    finally:
        handle.remove()
    assert errors and "waiting for the host step from inside it" in str(errors[0])


def test_the_optimizer_refuses_to_be_pickled_and_names_state_dict() -> None:
    model = _model()
    opt = _hdo(model.parameters(), **ADAMW)
    for copy_it in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match=r"save optimizer.state_dict\(\)"):
            copy_it(opt)


def test_state_copies_and_pickles_as_a_plain_defaultdict() -> None:
    model = _model()
    opt = _hdo(model.parameters(), **ADAMW)
    _train(model, opt, 1)
    for copied in (opt.state.copy(), copy.copy(opt.state), copy.deepcopy(opt.state)):
        assert type(copied) is collections.defaultdict
        assert len(copied) == len(opt.state) == 4
    loaded = pickle.loads(pickle.dumps(opt.state))
    assert type(loaded) is collections.defaultdict and len(loaded) == 4
    opt.state["note"] = {"any": 1}  # keys that are not parameters are a plain dict's
    _train(model, opt, 1)
    assert opt.state["note"] == {"any": 1}  # and stay across steps
