"""Model families. One file per family; each only wires ``bytebound.layers`` together."""
