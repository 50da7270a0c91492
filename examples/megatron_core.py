"""Megatron-Core's GPTModel (local layer spec, no Transformer Engine) offloading through
cpu_offload, switched on with Megatron-Core's own config fields.

Needs megatron-core and a GPU (Megatron-Core's model-parallel state uses NCCL):

    pip install megatron-core
    python examples/megatron_core.py

Without megatron-core (or without a GPU) it says so and exits.
"""

import os
import sys

import torch

from cpu_offload.megatron import use_with_megatron_core

try:
    from megatron.core import parallel_state
except ImportError:
    print("megatron-core is not installed: pip install megatron-core")
    sys.exit(0)
if not torch.cuda.is_available():
    print("Megatron-Core's GPTModel needs a GPU here; nothing to run")
    sys.exit(0)

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
torch.distributed.init_process_group("nccl", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
torch.manual_seed(0)
model_parallel_cuda_manual_seed(0)

seq, batch, vocab = 1024, 2, 1024
handle = use_with_megatron_core()  # before the model is built
config = TransformerConfig(
    num_layers=8,
    hidden_size=1024,
    num_attention_heads=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    cpu_offloading=True,
    cpu_offloading_num_layers=4,
)
model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=seq)
model = model.cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(batch, -1)
mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device="cuda"), diagonal=1)
for step in range(3):
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
    loss = model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step}: loss {loss.item():.4f}")
handle.remove()
parallel_state.destroy_model_parallel()
torch.distributed.destroy_process_group()
