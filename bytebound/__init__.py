"""bytebound: a batch-1 decode engine for Ling-3.0-flash (BailingMoeV3) sparse MoE models."""

__version__ = "0.1.0"
