"""V2 default scheduling (the first example of the user guide).

Twelve Linear layers, the first three offloaded; the offload context wraps each layer's
forward and the sync function follows each layer. At the end the same step runs without
offloading, and the loss and every gradient must be bit-identical.
"""

import os
import sys

# Bit-exact comparisons on a GPU need deterministic cuBLAS; this must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

from cpu_offload import backend, get_cpu_offload_context

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    # CPU kernels are deterministic already (and this call imports the compiler stack).
    torch.use_deterministic_algorithms(True)
torch.manual_seed(0)

# Setup (16 * 64 * 512 elements per activation: above the 256 * 1024 default threshold)
num_layers = 12
offloaded_layers = 3
hidden = 512
layers = [torch.nn.Linear(hidden, hidden).to(device) for _ in range(num_layers)]
x0 = torch.randn(16, 64, hidden, device=device)

cpu_offload_context, sync_function = get_cpu_offload_context(
    enabled=True,
    model_layers=num_layers,
    num_layers=offloaded_layers,
)


def train_step(offload):
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    x = x0
    for i in range(num_layers):
        if offload:
            # The context captures the tensors saved for backward.
            with cpu_offload_context:
                x = layers[i](x)
            # Outside the context: marks the end of the layer's forward.
            x = sync_function(x)
        else:
            x = layers[i](x)
    loss = x.square().mean()
    loss.backward()
    grads = [p.grad.clone() for layer in layers for p in layer.parameters()]
    return loss.detach(), grads


results = [train_step(offload=True) for _ in range(2)]
reference = train_step(offload=False)
for loss, grads in results:
    assert torch.equal(loss, reference[0]), f"loss differs: {loss} vs {reference[0]}"
    for i, (g, r) in enumerate(zip(grads, reference[1], strict=True)):
        assert torch.equal(g, r), f"gradient {i} differs"

print(f"OK {os.path.basename(sys.argv[0])} {backend()}")
