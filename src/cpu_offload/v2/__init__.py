"""Refactored (V2) CPU offloading backend."""
