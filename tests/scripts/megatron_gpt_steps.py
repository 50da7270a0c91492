"""Train Megatron-Core's GPT (local layer spec) for a few steps with and without offloading.

Run as a script by tests/test_megatron_gpt_cuda.py, in its own process: the backend
(``NVTE_CPU_OFFLOAD_V1``), the process group and Megatron's global state are per process.
Megatron-Core finds the offload context where Transformer Engine would provide it, as
docs/migration.md describes. Prints one line, ``OK <backend> peak <offloaded> <plain>``,
after checking that every loss and gradient of every step is bit-identical.

Usage: megatron_gpt_steps.py [--retain] [--k K] [--steps N]
"""

import argparse
import os
import socket

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

import cpu_offload

parser = argparse.ArgumentParser()
parser.add_argument(
    "--retain", action="store_true", help="cpu_offloading_retain_pinned_cpu_buffers"
)
parser.add_argument("--k", type=int, default=2)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

torch.use_deterministic_algorithms(True)

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


os.environ["MASTER_ADDR"] = "127.0.0.1"
os.environ["MASTER_PORT"] = str(_free_port())  # not an inherited one: another test may hold it

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import layers as mcore_layers  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import transformer_block as mcore_block  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

torch.distributed.init_process_group("nccl", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)


def get_cpu_offload_context(
    enabled,
    num_layers,
    model_layers,
    activation_offloading,
    weight_offloading,
    double_buffering,
    retain_pinned_cpu_buffers=False,
):
    return cpu_offload.get_cpu_offload_context(
        enabled,
        num_layers,
        model_layers,
        activation_offloading,
        weight_offloading,
        double_buffering,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
    )


mcore_block.get_cpu_offload_context = get_cpu_offload_context
mcore_layers.HAVE_TE = True

LAYERS, HIDDEN, HEADS, SEQ, BATCH, VOCAB = 4, 512, 8, 512, 2, 1024


def build(k):
    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        cpu_offloading=k > 0,
        cpu_offloading_num_layers=k,
        cpu_offloading_retain_pinned_cpu_buffers=args.retain and k > 0,
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    return Float16Module(cfg, model.cuda())


gen = torch.Generator(device="cuda").manual_seed(0)
batches = [
    torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=gen) for _ in range(args.steps)
]
pos = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, -1)
mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device="cuda"), diagonal=1)


def train(model):
    """Each step's loss and gradients, with an SGD update between steps; and the peak."""
    params = [p for p in model.parameters() if p.requires_grad]
    out, peak = [], 0
    for tokens in batches:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean()
        loss.backward()
        torch.cuda.synchronize()
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
        out.append((loss.detach().clone(), [p.grad.clone() for p in params]))
        with torch.no_grad():
            for p in params:
                p.sub_(1e-2 * p.grad)
    return out, peak


plain, plain_peak = train(build(0))
offloaded, offloaded_peak = train(build(args.k))
for step, ((la, ga), (lb, gb)) in enumerate(zip(offloaded, plain, strict=True)):
    assert torch.equal(la, lb), f"step {step}: loss {la.item()} vs {lb.item()}"
    for i, (a, b) in enumerate(zip(ga, gb, strict=True)):
        assert torch.equal(a, b), f"step {step}: gradient {i} differs"
print(f"OK {cpu_offload.backend()} peak {offloaded_peak} {plain_peak}")
