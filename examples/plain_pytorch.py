"""Offload half the layers of a plain PyTorch transformer, in one call.

python examples/plain_pytorch.py            # small, runs on a CPU
python examples/plain_pytorch.py --gpu      # larger, on a GPU
"""

import argparse

import torch
from torch import nn

import cpu_offload

parser = argparse.ArgumentParser()
parser.add_argument("--gpu", action="store_true")
args = parser.parse_args()
device = "cuda" if args.gpu else "cpu"
width, seq, batch, depth = (1024, 2048, 4, 8) if args.gpu else (64, 32, 4, 4)

torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
model = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

# The layer stack (model.layers) is found by itself; the first half is offloaded.
handle = cpu_offload.offload_layers(model, num_offloaded=depth // 2)
for step in range(3):
    x = torch.randn(batch, seq, width, device=device)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():  # evaluation between steps: nothing is offloaded
        model(x)
    print(f"step {step}: loss {loss.item():.4f}")
handle.remove()  # the model is as it was
