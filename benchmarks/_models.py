"""The real models the GPU benchmarks (and the planner's GPU test) build, in one place.

A ``transformers`` Llama from a config (random weights, nothing downloaded) and
Megatron-Core's GPTModel with its local layer spec (no Transformer Engine) in bf16
through its Float16Module, on one GPU.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
from torch import nn

LLAMA_VOCAB = 32000
MEGATRON_VOCAB = 32768


def llama(hidden: int, layers: int, seq: int, seed: int = 0) -> nn.Module:
    """A ``LlamaForCausalLM`` of ``layers`` decoder layers, bf16 on the GPU, in train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(2.6875 * hidden),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        vocab_size=LLAMA_VOCAB,
        max_position_embeddings=seq,
    )
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()


def init_megatron() -> None:
    """Start a one-rank NCCL process group (on a free port) and Megatron's model-parallel
    state, unless a process group is up already."""
    from megatron.core import parallel_state

    if torch.distributed.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def megatron_gpt(
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    batch: int,
    vocab: int = MEGATRON_VOCAB,
    *,
    cpu_offloading_num_layers: int = 0,
) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """Megatron-Core's GPT and ``loss(tokens)``: the mean of its per-token losses.

    Starts a one-rank process group and Megatron's model-parallel state the first time
    (:func:`init_megatron`). With ``cpu_offloading_num_layers`` k > 0, Megatron's own
    offloading of its first k layers is on: its block takes its context from
    ``megatron.core.transformer.transformer_block.get_cpu_offload_context`` when built.
    Every call builds the same weights.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_megatron()
    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        cpu_offloading=cpu_offloading_num_layers > 0,
        cpu_offloading_num_layers=cpu_offloading_num_layers,
    )
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=seq)
    model = Float16Module(config, gpt.cuda())
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(batch, -1)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device="cuda"), diagonal=1)

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean()

    return model, loss
