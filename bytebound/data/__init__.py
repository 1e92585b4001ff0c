"""Datasets shipped with bytebound (GSM8K) and the prompt formats built on them."""
