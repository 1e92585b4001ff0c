"""MTP (NEXTN) speculative decoding: chain drafting, one M-token verify, exact rollback, lossless acceptance."""
