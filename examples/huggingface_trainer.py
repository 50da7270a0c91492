"""The Hugging Face Trainer with a model's decoder layers offloaded: one call before
``Trainer(...)``, nothing else changes. A tiny Llama from a config (random weights,
nothing downloaded) on random tokens, so that it runs anywhere; the Trainer puts it on a
GPU when there is one.

    pip install 'cpu-offload[hf]'   # transformers, and accelerate, which the Trainer needs
    python examples/huggingface_trainer.py

It trains twice, with and without offloading (three optimizer steps of two accumulated
micro-batches, evaluation at the end), prints the bytes moved to host memory and checks
that the training loss and the trained parameters are bit-identical.
"""

import os
import tempfile

# Deterministic kernels, so that the two runs can be compared bit for bit (cuBLAS
# needs this before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import transformers  # noqa: E402

import cpu_offload  # noqa: E402

torch.use_deterministic_algorithms(True)
LAYERS, SEQ = 4, 32

config = transformers.LlamaConfig(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=LAYERS,
    num_attention_heads=8,
    max_position_embeddings=SEQ,
    use_cache=False,
)
config._attn_implementation = "sdpa"
gen = torch.Generator().manual_seed(1)
# The Trainer's default collator stacks these into batches.
tokens = torch.randint(0, config.vocab_size, (16, SEQ), generator=gen)
dataset = [{"input_ids": ids, "labels": ids} for ids in tokens]


def bytes_moved(handle: cpu_offload.OffloadedLayers) -> int:
    """The bytes the offload context has copied to host memory so far."""
    synchronizer = getattr(handle.context, "offload_synchronizer", None)  # V2
    if synchronizer is not None:
        return synchronizer.transport.bytes_offloaded
    return handle.context.offload_handler.transport.bytes_offloaded  # V1


def train(offload: bool) -> tuple[float, list[torch.Tensor], int]:
    """Returns the mean training loss, the trained parameters and the bytes moved."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    handle = None
    if offload:
        # model.model.layers is found by itself. These layers are tiny: every activation
        # is below the default smallest tensor worth offloading (256K elements).
        handle = cpu_offload.offload_layers(
            model, num_offloaded=LAYERS // 2, min_tensor_size_to_offload=1024
        )
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            max_steps=3,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=1e-3,
            seed=0,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=dataset, eval_dataset=dataset[:4]
        )
        result = trainer.train()
        trainer.evaluate()  # under torch.no_grad(): the layers run as they are
    moved = 0
    if handle is not None:
        moved = bytes_moved(handle)
        handle.remove()
    return result.training_loss, [p.detach().cpu() for p in model.parameters()], moved


loss, params, moved = train(offload=True)
print(f"training loss {loss:.4f}")
print(f"offloaded {moved} bytes to host memory")
ref_loss, ref_params, _ = train(offload=False)
same = loss == ref_loss and all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
if not same:
    raise SystemExit("offloading changed the training loss or the trained parameters")
print("training loss and trained parameters bit-identical to training without offloading")
