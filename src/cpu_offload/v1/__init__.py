"""Legacy (V1) CPU offloading backend."""
