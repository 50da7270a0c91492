"""Legacy V1 usage: marked activations, a commit after each layer.

The context is made with the positional call Megatron-LM used,
``get_cpu_offload_context(True, num_layers, model_layers, True, False, False)``. V1
offloads only the tensors marked ``activation_offloading``, so each layer marks the
inputs of the operations that save them (one layer sets the attribute by hand, as some
callers did), and ``x = commit(x)`` follows each layer. Meant for ``NVTE_CPU_OFFLOAD_V1=1``;
under V2 the marks are harmless. At the end the same steps run without offloading, and
the loss and every gradient must be bit-identical.
"""

import os
import sys

# Bit-exact comparisons on a GPU need deterministic cuBLAS; this must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

from cpu_offload import (
    backend,
    get_cpu_offload_context,
    is_cpu_offload_enabled,
    is_current_layer_offloaded,
    mark_activation_offload,
)

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    # CPU kernels are deterministic already (and this call imports the compiler stack).
    torch.use_deterministic_algorithms(True)
torch.manual_seed(0)

model_layers = 4
num_layers = 2  # the first two layers are offloaded
hidden = 512
BY_HAND = 1  # this layer sets the attribute itself instead of calling the marker


class Block(torch.nn.Module):
    def __init__(self, index):
        super().__init__()
        self.index = index
        self.fc1 = torch.nn.Linear(hidden, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)

    def mark(self, t):
        if self.index == BY_HAND:
            t.activation_offloading = True
        else:
            mark_activation_offload(t)

    def forward(self, x):
        # A mark goes on before the operation that saves the tensor for backward; outside
        # the offload context it has no effect.
        self.mark(x)
        h = self.fc1(x)
        self.mark(h)
        h = torch.nn.functional.gelu(h)
        self.mark(h)
        return self.fc2(h)


blocks = [Block(i).to(device) for i in range(model_layers)]
ctx, commit = get_cpu_offload_context(True, num_layers, model_layers, True, False, False)


def train_step(x, offload):
    for block in blocks:
        block.zero_grad(set_to_none=True)
    for i, block in enumerate(blocks):
        if offload:
            with ctx:
                assert is_cpu_offload_enabled()
                assert is_current_layer_offloaded() == (i < num_layers), i
                x = block(x)
            assert not is_cpu_offload_enabled()
            x = commit(x)
        else:
            x = block(x)
    loss = x.square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for block in blocks for p in block.parameters()]


gen = torch.Generator(device).manual_seed(1)
inputs = [torch.randn(16, 64, hidden, device=device, generator=gen) for _ in range(2)]
for step, x in enumerate(inputs):
    loss, grads = train_step(x, offload=True)
    ref_loss, ref_grads = train_step(x, offload=False)
    assert torch.equal(loss, ref_loss), f"step {step}: loss differs: {loss} vs {ref_loss}"
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert torch.equal(g, r), f"step {step}: gradient {i} differs"

print(f"OK {os.path.basename(sys.argv[0])} {backend()}")
