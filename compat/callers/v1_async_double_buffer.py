"""Legacy V1 with double buffering, and the deprecated weight offloading.

``get_cpu_offload_context(True, 2, 4, True, True, True)``: activations of two of four
layers offloaded, ``offload_weights=True`` (deprecated: it must warn with a
DeprecationWarning and change nothing) and ``double_buffering=True`` (V1 alternates two
sets of reload buffers across layers and iterations). Several training iterations with an
optimizer step each; every iteration's loss and gradients must be bit-identical to the
same training without offloading.
"""

import copy
import os
import sys
import warnings

# Bit-exact comparisons on a GPU need deterministic cuBLAS; this must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

from cpu_offload import backend, get_cpu_offload_context, mark_activation_offload

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    # CPU kernels are deterministic already (and this call imports the compiler stack).
    torch.use_deterministic_algorithms(True)
torch.manual_seed(0)

model_layers = 4
num_layers = 2
hidden = 512


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.fc(x)
        # The mark goes on before gelu saves h; outside the context it has no effect.
        mark_activation_offload(h)
        return torch.nn.functional.gelu(h)


blocks = torch.nn.ModuleList(Block() for _ in range(model_layers)).to(device)
plain = copy.deepcopy(blocks)  # the same weights, trained without offloading

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ctx, commit = get_cpu_offload_context(True, num_layers, model_layers, True, True, True)
deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
assert deprecations, "offload_weights=True did not emit a DeprecationWarning"
assert "offload_weights" in str(deprecations[0].message), deprecations[0].message


def sgd_step(model, lr=0.1):
    # Plain SGD by hand: torch.optim's first step imports the compiler stack (seconds).
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def train_step(model, x, offload):
    model.zero_grad(set_to_none=True)
    for block in model:
        if offload:
            with ctx:
                x = block(x)
            x = commit(x)
        else:
            x = block(x)
    loss = x.square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    sgd_step(model)
    return loss.detach(), grads


gen = torch.Generator(device).manual_seed(1)
for step in range(3):
    x = torch.randn(16, 64, hidden, device=device, generator=gen)
    loss, grads = train_step(blocks, x, offload=True)
    ref_loss, ref_grads = train_step(plain, x, offload=False)
    assert torch.equal(loss, ref_loss), f"step {step}: loss differs: {loss} vs {ref_loss}"
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert torch.equal(g, r), f"step {step}: gradient {i} differs"

print(f"OK {os.path.basename(sys.argv[0])} {backend()}")
