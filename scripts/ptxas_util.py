"""The offline-compile scripts' shared steps (``kda_ptxas.py``, ``persist_ptxas.py``, ``split_ptxas.py``,
``gemv_ptxas.py``): the compile of one kernel specialisation for a GPU target (:func:`compile_kernel`), ptxas'
resource line of the compiled kernel (:func:`resource_usage`) and its SASS (:func:`sass`), read from its cubin with
the ``cuobjdump`` / ``nvdisasm`` that Triton bundles (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import tempfile


def _cubin_tool(kernel, tool: str, *args: str, check: bool = False) -> str:
    """The standard output of Triton's bundled ``tool`` (``cuobjdump``, ``nvdisasm``) run with ``args`` on a compiled
    Triton kernel's cubin (``kernel.asm["cubin"]``, written to a temporary file); ``check``: a failing tool raises
    ``subprocess.CalledProcessError``."""
    import triton
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    try:
        return subprocess.run([path, *args, f.name], capture_output=True, text=True, check=check).stdout
    finally:
        os.unlink(f.name)


def resource_usage(kernel) -> str:
    """``REG:.. STACK:.. SHARED:.. LOCAL:..`` of a compiled Triton kernel (``kernel.asm["cubin"]``), or the tail of
    cuobjdump's output when it has no such line."""
    out = _cubin_tool(kernel, "cuobjdump", "--dump-resource-usage")
    return next((ln.strip() for ln in out.splitlines() if "REG:" in ln), out.strip()[-200:])


def sass(kernel) -> str:
    """The SASS of a compiled Triton kernel, as ``nvdisasm -c`` prints it.

    Raises:
        subprocess.CalledProcessError: nvdisasm failed (no SASS to read, rather than an empty listing)."""
    return _cubin_tool(kernel, "nvdisasm", "-c", check=True)


def compile_kernel(fn, const: dict, types: dict, arch: int, options: dict, gluon: bool = False, default=None,
                   aligned=None):
    """``triton.compile`` of one specialisation of the ``@triton.jit`` (or, with ``gluon``, ``@gluon.jit``) kernel
    ``fn`` for ``sm_<arch>``, with no GPU: arguments named in ``const`` are constexprs, the others get their type
    from ``types`` (or ``default(name)`` when given; a missing name is a KeyError otherwise). Arguments for which
    ``aligned(name, type)`` holds (default: the pointers) are declared 16-divisible, as Triton specialises them at a
    real launch on the engine's tensors. ``options``: ``num_warps`` (and ``num_stages``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        from triton.compiler import ASTSource as source
    aligned = aligned or (lambda name, ty: ty.startswith("*"))
    sig, attrs = {}, {}
    for n, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        else:
            sig[name] = types[name] if default is None else types.get(name, default(name))
        if sig[name] != "constexpr" and aligned(name, sig[name]):
            attrs[(n,)] = [["tt.divisibility", 16]]
    return triton.compile(source(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)
