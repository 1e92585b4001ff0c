"""Reusable modules of the BailingMoeV3 family; ``bytebound.models`` only wires them together."""
