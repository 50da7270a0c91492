"""An advanced V1 caller that builds the offload machinery itself.

Instead of ``get_cpu_offload_context`` it makes the handlers directly (as Megatron-LM's
and Transformer Engine's own tests did): a ``SynchronizedGroupOffloadHandler`` (copies on
the compute stream) and an ``AsyncDoubleBufferGroupOffloadHandler`` (its own streams,
releases spread over the model, prefetching reloads, double buffering), each wrapped in a
``CpuOffloadHookWithOffloadHandler`` and committed with
``GroupCommitFunction.apply(x, handler)``. These names come from the V1 module directly,
so the script runs V1 whatever NVTE_CPU_OFFLOAD_V1 says. Each handler's training must be
bit-identical to the same steps without offloading.
"""

import os
import sys

# Bit-exact comparisons on a GPU need deterministic cuBLAS; this must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

from cpu_offload import backend
from cpu_offload.v1 import (
    AsyncDoubleBufferGroupOffloadHandler,
    CpuOffloadHookWithOffloadHandler,
    GroupCommitFunction,
    SynchronizedGroupOffloadHandler,
    mark_activation_offload,
)

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    # CPU kernels are deterministic already (and this call imports the compiler stack).
    torch.use_deterministic_algorithms(True)
torch.manual_seed(0)

model_layers = 4
num_layers = 2
hidden = 512
# Two-dimensional activations (tokens, hidden): Linear then saves its input itself, so the
# mark on it is seen by the simple attribute check below.
layers = [torch.nn.Linear(hidden, hidden).to(device) for _ in range(model_layers)]


def needs_offloading(tensor):
    # V1's own selection rule: only tensors carrying the mark.
    return getattr(tensor, "activation_offloading", False)


def train_step(x, context=None, handler=None):
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    for layer in layers:
        if context is None:
            x = layer(x)
            continue
        with context:
            mark_activation_offload(x)
            x = layer(x)
        x = GroupCommitFunction.apply(x, handler)
    loss = x.square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for layer in layers for p in layer.parameters()]


handlers = {
    "synchronized": SynchronizedGroupOffloadHandler(
        num_offload_group=num_layers, tensor_need_offloading_checker=needs_offloading
    ),
    "async double buffer": AsyncDoubleBufferGroupOffloadHandler(
        num_offload_group=num_layers,
        num_model_group=model_layers,
        tensor_need_offloading_checker=needs_offloading,
        double_buffering=True,
    ),
}
gen = torch.Generator(device).manual_seed(1)
for name, handler in handlers.items():
    context = CpuOffloadHookWithOffloadHandler(offload_handler=handler)
    for step in range(2):
        x = torch.randn(1024, hidden, device=device, generator=gen)
        loss, grads = train_step(x, context, handler)
        ref_loss, ref_grads = train_step(x)
        assert torch.equal(loss, ref_loss), f"{name}, step {step}: loss differs"
        for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
            assert torch.equal(g, r), f"{name}, step {step}: gradient {i} differs"

print(f"OK {os.path.basename(sys.argv[0])} {backend()}")
