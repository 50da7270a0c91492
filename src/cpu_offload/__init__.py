"""cpu-offload: move GPU memory of PyTorch training to pinned host memory and back."""

__version__ = "0.1.0"
