"""Compare no offloading, V1, V2, checkpointing and save_on_cpu on a model of your own.

    python examples/compare_my_model.py

The same model from the command line: ``cpu-offload compare --model
examples.compare_my_model:factory`` (run from the repository root).
"""

import torch
from torch import nn

from cpu_offload.compare import compare_model, format_table


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def factory(seq: int = 32, batch: int = 8):
    """(model, make_batch, loss_fn): what ``--model module:factory`` expects."""
    torch.manual_seed(0)

    def make_batch():
        gen = torch.Generator().manual_seed(0)
        return torch.randn(batch, seq, 64, generator=gen), torch.randint(
            0, 10, (batch, seq), generator=gen
        )

    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    return Net(), make_batch, loss_fn


if __name__ == "__main__":
    model, make_batch, loss_fn = factory()
    report = compare_model(model, make_batch, loss_fn, steps=2, warmup=1)
    print(format_table(report))
    print(f"v2 offloaded {report.result('v2').bytes_offloaded_per_step} bytes per step")
