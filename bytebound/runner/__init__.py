"""Runs the model over one request's state: prefill, decode, verify (MTP), CUDA graphs, backend binding."""
