"""Offload half the layers of a plain PyTorch transformer, in one call.

python examples/plain_pytorch.py            # small, runs on a CPU
python examples/plain_pytorch.py --gpu      # larger, on a GPU

It trains twice, with and without offloading, prints the bytes moved to host memory
and checks that the losses and the trained parameters are bit-identical.
"""

import argparse
import os

# Deterministic kernels, so that the two runs can be compared bit for bit (cuBLAS
# needs this before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import cpu_offload  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--gpu", action="store_true")
args = parser.parse_args()
device = "cuda" if args.gpu else "cpu"
width, seq, batch, depth = (1024, 2048, 4, 8) if args.gpu else (64, 32, 4, 4)
# The CPU model is tiny: every activation is below the default smallest tensor worth
# offloading (256K elements), so on the CPU a smaller threshold lets it move some bytes.
options = {} if args.gpu else {"min_tensor_size_to_offload": 1024}
torch.use_deterministic_algorithms(True)


def bytes_moved(handle: cpu_offload.OffloadedLayers) -> int:
    """The bytes the offload context has copied to host memory so far."""
    synchronizer = getattr(handle.context, "offload_synchronizer", None)  # V2
    if synchronizer is not None:
        return synchronizer.transport.bytes_offloaded
    return handle.context.offload_handler.transport.bytes_offloaded  # V1


def train(offload: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Three steps; returns the losses, the trained parameters and the bytes moved."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = None
    if offload:
        # The layer stack (model.layers) is found by itself; the first half is offloaded.
        handle = cpu_offload.offload_layers(model, num_offloaded=depth // 2, **options)
    gen = torch.Generator(device).manual_seed(1)
    losses = []
    for step in range(3):
        x = torch.randn(batch, seq, width, device=device, generator=gen)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # evaluation between steps: nothing is offloaded
            model(x)
        losses.append(loss.detach())
        if offload:
            print(f"step {step}: loss {loss.item():.4f}")
    moved = 0
    if handle is not None:
        moved = bytes_moved(handle)
        handle.remove()  # the model is as it was
    return losses, [p.detach() for p in model.parameters()], moved


losses, params, moved = train(offload=True)
print(f"offloaded {moved} bytes to host memory")
ref_losses, ref_params, _ = train(offload=False)
same = all(torch.equal(a, b) for a, b in zip(losses + params, ref_losses + ref_params, strict=True))
if not same:
    raise SystemExit("offloading changed the losses or the trained parameters")
print("losses and trained parameters bit-identical to training without offloading")
