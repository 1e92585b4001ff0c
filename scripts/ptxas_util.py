"""The offline-compile scripts' shared step (``kda_ptxas.py``, ``persist_ptxas.py``): ptxas' resource line of a
kernel compiled with ``triton.compile`` for a GPU target, read from its cubin with the ``cuobjdump`` that Triton
bundles (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import tempfile


def resource_usage(kernel) -> str:
    """``REG:.. STACK:.. SHARED:.. LOCAL:..`` of a compiled Triton kernel (``kernel.asm["cubin"]``), or the tail of
    cuobjdump's output when it has no such line."""
    import triton
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return next((ln.strip() for ln in out.splitlines() if "REG:" in ln), out.strip()[-200:])
