"""Ling checkpoint format: expected tensors (``layout``), strict loading, writing, random/dummy weights."""
