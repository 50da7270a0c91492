"""Tests of ``cpu_offload._compat``, the one module that asks which PyTorch is running.

The version-dependent decisions are checked for releases on both sides of 2.11 with
explicit version strings, and once more against the torch actually installed, which
differs per entry of the nox matrix (compat/README.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from torch.utils.checkpoint import checkpoint

import cpu_offload
from cpu_offload import _compat
from cpu_offload._layer_call import run_layer_recomputed

BELOW_2_11 = ["2.6.0", "2.9.1+cu126", "2.10.0", "2.10.0+cu128", "2.10.1"]
FROM_2_11 = ["2.11.0", "2.11.0a0+git123", "2.11.0rc1", "2.13.0+cpu", "2.15.0", "3.0.0"]


# ---- parse_torch_version ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.10.0+cu128", "2.10.0"),
        ("2.11.0a0+git123", "2.11.0a0"),
        ("2.13.0+cpu", "2.13.0"),
        ("2.6.0", "2.6.0"),
        ("2.15.0", "2.15.0"),
    ],
)
def test_parse_drops_the_local_suffix(text: str, expected: str) -> None:
    parsed = _compat.parse_torch_version(text)
    assert parsed == Version(expected)
    assert parsed.local is None


def test_parse_keeps_the_pre_release_of_a_nightly() -> None:
    parsed = _compat.parse_torch_version("2.11.0a0+git123")
    assert parsed.release == (2, 11, 0)
    assert parsed.is_prerelease


def test_builds_of_one_release_compare_equal() -> None:
    assert _compat.parse_torch_version("2.10.0+cu128") == _compat.parse_torch_version("2.10.0+cpu")


@pytest.mark.parametrize("text", ["not-a-version", "", "2.x", "torch 2.6"])
def test_parse_rejects_invalid_strings(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        _compat.parse_torch_version(text)


def test_minimum_and_threshold() -> None:
    assert Version("2.6") == _compat.MIN_TORCH
    assert Version("2.11") == _compat.PINNED_ALLOC_IN_CAPTURE


# ---- pinned_alloc_in_capture_supported ----------------------------------------------


@pytest.mark.parametrize("version", BELOW_2_11)
def test_no_pinned_alloc_in_capture_below_2_11(version: str) -> None:
    assert _compat.pinned_alloc_in_capture_supported(version) is False
    assert _compat.pinned_alloc_in_capture_supported(Version(version)) is False


@pytest.mark.parametrize("version", FROM_2_11)
def test_pinned_alloc_in_capture_from_2_11(version: str) -> None:
    # 2.11.0a0 (a nightly of the 2.11 branch) already has pytorch#167507.
    assert _compat.pinned_alloc_in_capture_supported(version) is True
    assert _compat.pinned_alloc_in_capture_supported(Version(version)) is True


# ---- capture_buffer_policy ----------------------------------------------------------


@pytest.mark.parametrize("version", BELOW_2_11 + FROM_2_11)
@pytest.mark.parametrize("capturing", [False, True])
def test_retained_buffers_are_always_kept(version: str, capturing: bool) -> None:
    assert (
        _compat.capture_buffer_policy(
            retain_pinned_cpu_buffers=True, capturing=capturing, version=version
        )
        == "retained"
    )


@pytest.mark.parametrize("version", BELOW_2_11 + FROM_2_11)
def test_eager_without_retention_uses_the_pool(version: str) -> None:
    assert (
        _compat.capture_buffer_policy(
            retain_pinned_cpu_buffers=False, capturing=False, version=version
        )
        == "pool"
    )


@pytest.mark.parametrize("version", FROM_2_11)
def test_capture_without_retention_uses_the_pool_from_2_11(version: str) -> None:
    assert (
        _compat.capture_buffer_policy(
            retain_pinned_cpu_buffers=False, capturing=True, version=version
        )
        == "pool"
    )


@pytest.mark.parametrize("version", BELOW_2_11)
def test_capture_without_retention_is_refused_below_2_11(version: str) -> None:
    with pytest.raises(RuntimeError) as info:
        _compat.capture_buffer_policy(
            retain_pinned_cpu_buffers=False, capturing=True, version=version
        )
    message = str(info.value)
    assert "retain_pinned_cpu_buffers=True" in message
    assert str(Version(version).public) in message  # names the running release
    assert "2.11" in message  # and the release that lifts the limit


# ---- against the torch that is installed --------------------------------------------


def _installed_release() -> tuple[int, int]:
    """(major, minor) of ``torch.__version__``, read without the compat module."""
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    assert m is not None, torch.__version__
    return int(m[1]), int(m[2])


def test_torch_version_is_the_installed_one() -> None:
    assert _compat.TORCH_VERSION.release[:2] == _installed_release()
    assert _compat.TORCH_VERSION.local is None
    assert _compat.TORCH_VERSION >= _compat.MIN_TORCH


def test_installed_torch_decision() -> None:
    """Below 2.11 (the 2.10.0 entry) capture without retention is refused; from 2.11 on
    (the 2.13.0 and later entries) it uses the pool. The expected answer comes from
    ``torch.__version__`` read here, not from the shim."""
    expect_pool = _installed_release() >= (2, 11)
    assert _compat.pinned_alloc_in_capture_supported() is expect_pool
    assert _compat.capture_buffer_policy(False, capturing=False) == "pool"
    assert _compat.capture_buffer_policy(True, capturing=True) == "retained"
    if expect_pool:
        assert _compat.capture_buffer_policy(False, capturing=True) == "pool"
    else:
        with pytest.raises(RuntimeError, match=r"retain_pinned_cpu_buffers=True"):
            _compat.capture_buffer_policy(False, capturing=True)


def test_is_current_stream_capturing_is_false_outside_a_capture() -> None:
    assert _compat.is_current_stream_capturing() is False


@pytest.mark.skipif(torch.version.cuda is None, reason="a build without CUDA has no CUDA calls")
def test_the_stream_calls_behind_the_fast_helpers_exist_on_this_release() -> None:
    # current_cuda_stream and OnCudaStream call these directly (NOTE [Host cost of CUDA
    # stream calls]): every CUDA build of the matrix must have them.
    for name in ("_cuda_getCurrentStream", "_cuda_getDevice", "_cuda_setStream"):
        assert callable(getattr(torch._C, name)), name


@pytest.mark.cuda
def test_current_cuda_stream_is_torchs_current_stream() -> None:
    side = torch.cuda.Stream()
    assert _compat.current_cuda_stream() == torch.cuda.current_stream()
    with torch.cuda.stream(side):
        assert _compat.current_cuda_stream() == side
        assert _compat.current_cuda_stream() is _compat.current_cuda_stream()  # cached
    assert _compat.current_cuda_stream() == torch.cuda.default_stream()


@pytest.mark.cuda
def test_on_cuda_stream_switches_and_restores_like_torch_cuda_stream() -> None:
    outer, inner = torch.cuda.Stream(), torch.cuda.Stream()
    device = torch.cuda.current_device()
    with torch.cuda.stream(outer):
        with _compat.OnCudaStream(inner):
            assert torch.cuda.current_stream() == inner
            x = torch.ones(4, device="cuda") * 2  # work queued on the stream it switched to
        assert torch.cuda.current_stream() == outer
        with pytest.raises(KeyError), _compat.OnCudaStream(inner):
            raise KeyError("restored on the way out of an exception too")
        assert torch.cuda.current_stream() == outer
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert torch.cuda.current_device() == device
    inner.synchronize()
    assert torch.equal(x.cpu(), torch.full((4,), 2.0))


@pytest.mark.parametrize(
    ("device", "version", "expected"),
    [
        ("cuda", "2.6.0", True),
        ("cpu", "2.6.0", True),
        ("cpu", "2.3.0", False),
        ("mps", "2.13.0", False),
    ],
)
def test_fused_optimizer_supported(device: str, version: str, expected: bool) -> None:
    assert _compat.fused_optimizer_supported(device, version) is expected


def test_plain_tensors_are_not_fake_or_functional() -> None:
    assert _compat.is_fake_or_functional(torch.ones(3)) is False


def test_fake_and_functional_tensors_are_recognised() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(3)
    assert _compat.is_fake_or_functional(fake) is True
    functional = torch._to_functional_tensor(torch.ones(3))
    assert type(functional) is torch.Tensor  # the plain-type shortcut must not skip it
    assert _compat.is_fake_or_functional(functional) is True


def test_dynamo_skip_exists_on_this_release() -> None:
    # torch.compile of offloaded models rests on it (cpu_offload._compile): a release of
    # the matrix without it fails here rather than in a compiled model.
    assert _compat.dynamo_skip("cpu_offload.engine") is True


# ---- only the compat module looks at the PyTorch version ----------------------------

_VERSION_LOOKS = re.compile(
    r"torch\.__version__"
    r"|torch\.version\.__version__"
    r"|packaging\.version"
    r"|from\s+packaging\s+import\s+(?:[\w\s,(]*\b)?version\b"
)


def test_only_the_compat_module_looks_at_the_torch_version() -> None:
    package = Path(cpu_offload.__file__).resolve().parent
    sources = sorted(package.rglob("*.py"))
    assert package / "_compat.py" in sources
    offenders = [
        f"{path.relative_to(package)}:{n}: {line.strip()}"
        for path in sources
        if path.name != "_compat.py" or path.parent != package
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _VERSION_LOOKS.search(line)
    ]
    assert not offenders, (
        "only cpu_offload/_compat.py may look at the PyTorch version "
        "(torch.__version__, packaging.version); add a shim there instead:\n" + "\n".join(offenders)
    )


def test_the_grep_pattern_catches_what_it_should() -> None:
    for line in [
        "if torch.__version__ >= '2.11':",
        "from packaging.version import Version",
        "import packaging.version",
        "from packaging import version",
        "from packaging import specifiers, version",
    ]:
        assert _VERSION_LOOKS.search(line), line
    for line in ["from cpu_offload._compat import TORCH_VERSION", "torch.version.cuda"]:
        assert not _VERSION_LOOKS.search(line), line


def test_in_checkpoint_forward_inside_and_outside_checkpoints() -> None:
    x = torch.ones(3, requires_grad=True)
    seen: dict[str, bool] = {}

    def probe(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(t: torch.Tensor) -> torch.Tensor:
            if not _compat.in_backward():
                seen[name] = _compat.in_checkpoint_forward()
                seen[name + " stack"] = _compat._checkpoint_on_call_stack()
            return t.exp()

        return fn

    checkpoint(probe("non-reentrant"), x, use_reentrant=False).sum().backward()
    checkpoint(probe("reentrant"), x, use_reentrant=True).sum().backward()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        probe("other hooks")(x)
    probe("outside")(x)
    assert seen == {
        "non-reentrant": True,
        "non-reentrant stack": True,
        "reentrant": False,  # runs without grad: nothing is saved there
        "reentrant stack": False,
        "other hooks": False,
        "other hooks stack": False,
        "outside": False,
        "outside stack": False,
    }


def test_run_layer_recomputed_runs_the_function_to_its_end_in_backward() -> None:
    x = torch.ones(3, requires_grad=True)
    ends: list[bool] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = t.exp()
        ends.append(True)  # after the last saved tensor
        return y + 1

    with _compat.checkpoint_early_stop_off():
        y = run_layer_recomputed(fn, (x,), {})
    y.sum().backward()
    assert len(ends) == 2  # the forward, and the whole recomputation
    assert torch.equal(x.grad, torch.ones(3).exp())


def test_run_layer_recomputed_gives_the_function_keywords_named_like_checkpoint_options() -> None:
    seen: list[object] = []

    def fn(t: torch.Tensor, debug: object = None, context_fn: object = None) -> torch.Tensor:
        seen.append((debug, context_fn))
        return t.exp()  # saves its result: backward recomputes it

    x = torch.ones(2, requires_grad=True)
    with _compat.checkpoint_early_stop_off():
        y = run_layer_recomputed(fn, (x,), {"debug": "mine", "context_fn": "also mine"})
    y.sum().backward()
    assert seen == [("mine", "also mine")] * 2


def test_autograd_clock_orders_nodes_made_after_it() -> None:
    x = torch.ones(3, requires_grad=True)
    before = x.exp()
    clock = _compat.autograd_clock()
    after = x.exp()
    assert before.grad_fn is not None and after.grad_fn is not None
    assert before.grad_fn._sequence_nr() < clock <= after.grad_fn._sequence_nr()


def test_autograd_clock_is_unknown_without_the_private_function(monkeypatch) -> None:
    monkeypatch.delattr(torch._C._autograd, "_get_sequence_nr")
    assert _compat.autograd_clock() == -1


def test_to_copy_node_type_is_the_node_of_every_dtype_cast() -> None:
    x = torch.ones(3, requires_grad=True)
    node = _compat.to_copy_node_type()
    for cast in (x.to(torch.bfloat16), x.double(), x.half().float(), x.type(torch.float16)):
        assert type(cast.grad_fn) is node
    assert type(x.exp().grad_fn) is not node
    _compat.to_copy_node_type.cache_clear()
    with torch.no_grad(), torch.inference_mode():  # the first call may come in any mode
        assert _compat.to_copy_node_type() is node
