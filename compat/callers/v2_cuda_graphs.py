"""V2 with CUDA graphs (the third example of the user guide).

The offloaded model is wrapped with ``torch.cuda.make_graphed_callables``, which captures
its whole forward and backward (offload and reload copies included) and replays them. The
graphed model's loss and gradients must be bit-identical to those of the same model
graphed without offloading. Without CUDA there are no graphs: the script says so and runs
the offloaded model eagerly against the plain eager model instead.
"""

import copy
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

# retain_pinned_cpu_buffers=True keeps each layer's host buffers at fixed addresses, which
# graph capture needs before PyTorch 2.11 and which does no harm after it: one script for
# every PyTorch version.
cpu_offload_context, sync_function = get_cpu_offload_context(
    enabled=True,
    model_layers=num_layers,
    num_layers=offloaded_layers,
    retain_pinned_cpu_buffers=True,
)


class OffloadedModel(torch.nn.Module):
    def __init__(self, layers, offload):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.offload = offload

    def forward(self, x):
        for layer in self.layers:
            if self.offload:
                with cpu_offload_context:
                    x = layer(x)
                x = sync_function(x)
            else:
                x = layer(x)
        return x


plain_layers = copy.deepcopy(layers)  # the same weights, never offloaded
model = OffloadedModel(layers, offload=True)
plain = OffloadedModel(plain_layers, offload=False)
sample_input = (torch.randn(16, 64, hidden, device=device),)

if device == "cuda":
    # Warm-up runs inside make_graphed_callables; the copies are captured with the compute.
    model = torch.cuda.make_graphed_callables(model, sample_input)
    plain = torch.cuda.make_graphed_callables(plain, sample_input)
else:
    print("CUDA is not available: skipping the CUDA graph capture, running the model eagerly")


def train_step(m, params, x):
    for p in params:
        p.grad = None
    out = m(x)
    loss = out.square().mean()
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in params]


offloaded_params = [p for layer in layers for p in layer.parameters()]
plain_params = [p for layer in plain_layers for p in layer.parameters()]
for step in range(2):
    x = torch.randn(16, 64, hidden, device=device)
    loss, grads = train_step(model, offloaded_params, x)
    ref_loss, ref_grads = train_step(plain, plain_params, x)
    assert torch.equal(loss, ref_loss), f"step {step}: loss differs: {loss} vs {ref_loss}"
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert torch.equal(g, r), f"step {step}: gradient {i} differs"

print(f"OK {os.path.basename(sys.argv[0])} {backend()}")
