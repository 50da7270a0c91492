"""V2 manual synchronization (the second example of the user guide).

The caller decides when each layer's activations move: start every layer's offload after
its forward, release the GPU memory, start the reloads before backward. An
``offload_stream`` is passed when CUDA is available. At the end the same step runs
without offloading, and the loss and every gradient must be bit-identical.
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
hidden = 512
layers = [torch.nn.Linear(hidden, hidden).to(device) for _ in range(num_layers)]
x0 = torch.randn(16, 64, hidden, device=device)

# A stream of our own for the copies; there are no CUDA streams without CUDA.
offload_stream = torch.cuda.Stream() if device == "cuda" else None
cpu_offload_context, sync_function, manual_controller = get_cpu_offload_context(
    enabled=True,
    model_layers=num_layers,
    manual_synchronization=True,
    offload_stream=offload_stream,
)


def train_step(offload):
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    x = x0
    for i in range(num_layers):
        if offload:
            with cpu_offload_context:
                x = layers[i](x)
            x = sync_function(x)
            manual_controller.start_offload_layer(i)
        else:
            x = layers[i](x)
    if offload:
        # Each call waits for that layer's offload, then frees its GPU tensors.
        for i in range(num_layers):
            manual_controller.release_activation_forward_gpu_memory(i)
        # Reload in the order backward needs the layers.
        for i in range(num_layers - 1, -1, -1):
            manual_controller.start_reload_layer(i)
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
