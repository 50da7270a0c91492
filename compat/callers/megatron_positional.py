"""The way Megatron-Core drives the offload context.

Its transformer block makes the context with a positional call,
``get_cpu_offload_context(enabled, num_layers, model_layers, activation_offloading,
weight_offloading, double_buffering, retain_pinned_cpu_buffers=...)``, from its config
fields, stores the context as ``config._cpu_offloading_context``, wraps each layer's
forward in it and commits each layer's output only while offloading is on and grad is
enabled. Its linear layers (custom autograd functions that save their input) read
``config._cpu_offloading_context.inside_context`` during forward and mark their input
with ``activation_offloading``. This script does the same on a small model: it checks
``inside_context`` inside and outside, runs an evaluation forward under ``torch.no_grad()``
through the same context, and compares training with a model built with
``cpu_offloading=False``: loss and every gradient must be bit-identical.
"""

import copy
import os
import sys
from types import SimpleNamespace

# Bit-exact comparisons on a GPU need deterministic cuBLAS; this must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

from cpu_offload import backend, get_cpu_offload_context

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    # CPU kernels are deterministic already (and this call imports the compiler stack).
    torch.use_deterministic_algorithms(True)
torch.manual_seed(0)

hidden = 512


def make_config(cpu_offloading):
    return SimpleNamespace(
        num_layers=4,
        hidden_size=hidden,
        cpu_offloading=cpu_offloading,
        cpu_offloading_num_layers=2,
        cpu_offloading_activations=True,
        cpu_offloading_weights=False,
        cpu_offloading_double_buffering=False,
        cpu_offloading_retain_pinned_cpu_buffers=False,
    )


class LinearFunction(torch.autograd.Function):
    # Like Megatron's linear_with_grad_accumulation_and_async_allreduce: saves its input.
    @staticmethod
    def forward(ctx, input_, weight):
        ctx.save_for_backward(input_, weight)
        return torch.matmul(input_, weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        grad_input = torch.matmul(grad_output, weight)
        grad_weight = torch.matmul(
            grad_output.reshape(-1, grad_output.shape[-1]).t(),
            input_.reshape(-1, input_.shape[-1]),
        )
        return grad_input, grad_weight


class ParallelLinear(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)
        self.calls_inside_context = 0

    def forward(self, input_):
        # What Megatron-Core's linear layers do when Transformer Engine is present.
        if self.config._cpu_offloading_context is not None:
            if self.config._cpu_offloading_context.inside_context is True:
                input_.activation_offloading = self.config.cpu_offloading_activations
                self.calls_inside_context += 1
            else:
                raise AssertionError("a layer ran outside the offload context")
        return LinearFunction.apply(input_, self.weight)


class TransformerLayer(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = ParallelLinear(config)
        self.fc2 = ParallelLinear(config)

    def forward(self, hidden_states):
        return self.fc2(torch.nn.functional.gelu(self.fc1(hidden_states)))


class TransformerBlock(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.offload_context, self.group_prefetch_offload_commit_async = get_cpu_offload_context(
            config.cpu_offloading,
            config.cpu_offloading_num_layers,
            config.num_layers,
            config.cpu_offloading_activations,
            config.cpu_offloading_weights,
            config.cpu_offloading_double_buffering,
            retain_pinned_cpu_buffers=config.cpu_offloading_retain_pinned_cpu_buffers,
        )
        config._cpu_offloading_context = self.offload_context if config.cpu_offloading else None
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config) for _ in range(config.num_layers)
        )

    def forward(self, hidden_states):
        for layer in self.layers:
            with self.offload_context:
                hidden_states = layer(hidden_states)
            if torch.is_grad_enabled() and self.config.cpu_offloading:
                hidden_states = self.group_prefetch_offload_commit_async(hidden_states)
        return hidden_states


config = make_config(cpu_offloading=True)
block = TransformerBlock(config).to(device)
plain = TransformerBlock(make_config(cpu_offloading=False)).to(device)
plain.load_state_dict(copy.deepcopy(block.state_dict()))
assert plain.config._cpu_offloading_context is None


def train_step(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


gen = torch.Generator(device).manual_seed(1)
for step in range(2):
    # Megatron's layout: [sequence, batch, hidden].
    x = torch.randn(64, 16, hidden, device=device, generator=gen)
    assert config._cpu_offloading_context.inside_context is False
    loss, grads = train_step(block, x)
    assert config._cpu_offloading_context.inside_context is False
    ref_loss, ref_grads = train_step(plain, x)
    assert torch.equal(loss, ref_loss), f"step {step}: loss differs: {loss} vs {ref_loss}"
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert torch.equal(g, r), f"step {step}: gradient {i} differs"
    if step == 0:
        # Evaluation between training steps: the context must be a pass-through.
        with torch.no_grad():
            out = block(x)
            ref_out = plain(x)
        assert torch.equal(out, ref_out), "evaluation output differs"
        assert config._cpu_offloading_context.inside_context is False

linears = [m for m in block.modules() if isinstance(m, ParallelLinear)]
# Each linear ran inside the context once per training step and once in evaluation.
assert all(m.calls_inside_context == 3 for m in linears), [m.calls_inside_context for m in linears]

print(f"OK {os.path.basename(sys.argv[0])} {backend()}")
