"""A transformers Llama (random weights from a config, nothing downloaded), its decoder
layers offloaded in one call, in a plain training loop with gradient accumulation.

    pip install 'cpu-offload[hf]'
    python examples/huggingface_llama.py            # small, runs on a CPU
    python examples/huggingface_llama.py --gpu      # larger, bf16 on a GPU
"""

import argparse

import torch
import transformers

import cpu_offload

parser = argparse.ArgumentParser()
parser.add_argument("--gpu", action="store_true")
args = parser.parse_args()
device = "cuda" if args.gpu else "cpu"
hidden, layers, seq, batch = (1024, 8, 2048, 2) if args.gpu else (64, 4, 32, 2)

config = transformers.LlamaConfig(
    vocab_size=1024,
    hidden_size=hidden,
    intermediate_size=4 * hidden,
    num_hidden_layers=layers,
    num_attention_heads=8,
    max_position_embeddings=seq,
    use_cache=False,
)
config._attn_implementation = "sdpa"
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).to(device)
if args.gpu:
    model = model.to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

# model.model.layers is found by itself: offload the first half of the decoder layers.
with cpu_offload.offload_layers(model, num_offloaded=layers // 2):
    for step in range(2):
        for _ in range(2):  # gradient accumulation: forward and backward per micro-batch
            ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
            loss = model(input_ids=ids, labels=ids).loss / 2
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {2 * loss.item():.4f}")
