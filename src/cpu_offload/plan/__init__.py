"""Plan activation memory per layer: keep, offload or recompute, for a memory budget."""
