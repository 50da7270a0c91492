"""Small layer stacks for tests, benchmarks and ``cpu-offload compare``.

Each builder returns an ``nn.ModuleList`` of layers with ``x_i = layer_i(x_{i-1})``,
the shape offloading expects, plus a function that makes a matching input batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTBlock", "ModelSpec", "build_layers", "run_layers", "MODEL_KINDS"]


class GPTBlock(nn.Module):
    """A GPT-style block: LayerNorm, qkv projection, causal SDPA, projection, MLP.

    q, k and v are strided views of one projection output, as in most transformer
    code: the attention kernel saves them, permuted, for backward.

    Args:
        hidden: Model width.
        heads: Attention heads (must divide ``hidden``).
        mlp_ratio: MLP width over model width.
    """

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"heads ({heads}) must divide hidden ({hidden})")
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class _MHABlock(nn.Module):
    """``nn.MultiheadAttention`` (attention weights computed, as in training) with a residual."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x, need_weights=True)
        return x + out


class _LinearGELU(nn.Sequential):
    def __init__(self, hidden: int) -> None:
        super().__init__(nn.Linear(hidden, hidden), nn.GELU())


#: Names accepted by :func:`build_layers`.
MODEL_KINDS = ("gpt", "encoder", "mha", "linear")


@dataclass(frozen=True)
class ModelSpec:
    """What to build: kind, sizes and dtype."""

    kind: str = "gpt"
    hidden: int = 512
    heads: int = 8
    seq: int = 512
    batch: int = 4
    layers: int = 8
    dtype: torch.dtype = torch.float32

    def make_input(self, device: torch.device | str, seed: int = 0) -> torch.Tensor:
        """A deterministic input batch for this model."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randn(self.batch, self.seq, self.hidden, generator=gen, dtype=torch.float32)
        return x.to(device=device, dtype=self.dtype)


def build_layers(spec: ModelSpec, device: torch.device | str, seed: int = 0) -> nn.ModuleList:
    """Build ``spec.layers`` layers of ``spec.kind`` with deterministic weights.

    Raises:
        ValueError: If ``spec.kind`` is not one of :data:`MODEL_KINDS`.
    """
    factories: dict[str, Callable[[], nn.Module]] = {
        "gpt": lambda: GPTBlock(spec.hidden, spec.heads),
        "encoder": lambda: nn.TransformerEncoderLayer(
            spec.hidden, spec.heads, 4 * spec.hidden, dropout=0.0, batch_first=True
        ),
        "mha": lambda: _MHABlock(spec.hidden, spec.heads),
        "linear": lambda: _LinearGELU(spec.hidden),
    }
    if spec.kind not in factories:
        raise ValueError(f"model kind must be one of {', '.join(MODEL_KINDS)}; got {spec.kind!r}")
    torch.manual_seed(seed)
    layers = nn.ModuleList(factories[spec.kind]() for _ in range(spec.layers))
    return layers.to(device=device, dtype=spec.dtype)


def run_layers(
    layers: nn.ModuleList,
    x: torch.Tensor,
    context: object | None = None,
    sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run ``layers`` in sequence, each inside ``context`` and followed by ``sync``."""
    for layer in layers:
        if context is None:
            x = layer(x)
        else:
            with context:  # type: ignore[attr-defined]
                x = layer(x)
        if sync is not None:
            x = sync(x)
    return x
