"""A transformers Llama (random weights from a config, nothing downloaded), its decoder
layers offloaded in one call, in a plain training loop with gradient accumulation.

    pip install 'cpu-offload[hf]'
    python examples/huggingface_llama.py            # small, runs on a CPU
    python examples/huggingface_llama.py --gpu      # larger, bf16 on a GPU

It trains twice, with and without offloading, prints the bytes moved to host memory
and checks that the losses and the trained parameters are bit-identical.
"""

import argparse
import os

# Deterministic kernels, so that the two runs can be compared bit for bit (cuBLAS
# needs this before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import transformers  # noqa: E402

import cpu_offload  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--gpu", action="store_true")
args = parser.parse_args()
device = "cuda" if args.gpu else "cpu"
hidden, layers, seq, batch = (1024, 8, 2048, 2) if args.gpu else (64, 4, 32, 2)
# The CPU model is tiny: every activation is below the default smallest tensor worth
# offloading (256K elements), so on the CPU a smaller threshold lets it move some bytes.
options = {} if args.gpu else {"min_tensor_size_to_offload": 1024}
torch.use_deterministic_algorithms(True)

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


def bytes_moved(handle: cpu_offload.OffloadedLayers) -> int:
    """The bytes the offload context has copied to host memory so far."""
    synchronizer = getattr(handle.context, "offload_synchronizer", None)  # V2
    if synchronizer is not None:
        return synchronizer.transport.bytes_offloaded
    return handle.context.offload_handler.transport.bytes_offloaded  # V1


def train(offload: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Two steps of two micro-batches; returns the losses, parameters and bytes moved."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    if args.gpu:
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device).manual_seed(1)
    losses = []
    moved = 0
    # model.model.layers is found by itself: offload the first half of the decoder layers
    # (none at all for the reference run).
    num_offloaded = layers // 2 if offload else 0
    with cpu_offload.offload_layers(model, num_offloaded=num_offloaded, **options) as handle:
        for step in range(2):
            for _ in range(2):  # gradient accumulation: forward and backward per micro-batch
                ids = torch.randint(
                    0, config.vocab_size, (batch, seq), device=device, generator=gen
                )
                loss = model(input_ids=ids, labels=ids).loss / 2
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            if offload:
                print(f"step {step}: loss {2 * loss.item():.4f}")
        if offload:
            moved = bytes_moved(handle)
    return losses, [p.detach() for p in model.parameters()], moved


losses, params, moved = train(offload=True)
print(f"offloaded {moved} bytes to host memory")
ref_losses, ref_params, _ = train(offload=False)
same = all(torch.equal(a, b) for a, b in zip(losses + params, ref_losses + ref_params, strict=True))
if not same:
    raise SystemExit("offloading changed the losses or the trained parameters")
print("losses and trained parameters bit-identical to training without offloading")
