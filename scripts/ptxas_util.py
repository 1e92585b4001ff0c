"""The offline-compile scripts' shared steps (``kda_ptxas.py``, ``persist_ptxas.py``, ``split_ptxas.py``,
``gemv_ptxas.py``): the compile of one kernel specialisation for a GPU target (:func:`compile_kernel`), ptxas'
resource line of the compiled kernel (:func:`resource_usage`) and its SASS (:func:`sass`), read from its cubin with
the ``cuobjdump`` / ``nvdisasm`` that Triton bundles (no GPU needed)."""

from __future__ import annotations

import re
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


def load_use(sass_text: str, opcode: str = "LDG.E.128") -> list[tuple[int, int]]:
    """For each unpredicated ``opcode`` load in ``sass_text`` (nvdisasm output): ``(instructions until the first
    later instruction that reads one of its destination registers, loads of the same kind issued in between,
    predicated ones included)``: how
    far ptxas hoists a load above its use, and how many such loads a warp has in flight when the use stalls. Reads
    straight-line order (branches ignored); a 16-byte load writes 4 consecutive registers."""
    ins = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", sass_text)]
    out = []
    for i, t in enumerate(ins):
        m = re.match(re.escape(opcode) + r"\S*\s+R(\d+),", t)
        if not m:
            continue
        dst = set(range(int(m.group(1)), int(m.group(1)) + 4))
        loads = 0
        for j in range(i + 1, len(ins)):
            op, _, args = ins[j].partition(" ")
            if op.startswith("@"):                      # a predicated instruction: its opcode follows the guard
                op, _, args = args.partition(" ")
            regs = [set(int(x) for x in re.findall(r"\bR(\d+)\b", a)) for a in args.split(",")]
            # the first operand is written by most instructions; stores and mma read it (mma: also its sources)
            reads = set().union(*regs[1:]) if len(regs) > 1 else set()
            if op.startswith(("ST", "RED", "ATOM")) and regs:
                reads |= regs[0]
            if reads & dst:
                out.append((j - i, loads))
                break
            if op.startswith(opcode):
                loads += 1
    return out


def resource_fields(line: str) -> dict[str, int]:
    """The numeric fields of a :func:`resource_usage` line, e.g. ``{"REG": 72, "STACK": 0, "SHARED": 1024, ...}``."""
    return {k: int(v) for k, v in re.findall(r"\b([A-Z]+(?:\[\d+\])?):(\d+)", line)}


def cap_rule(regs: int, num_warps: int, shared_bytes: int = 0) -> int:
    """The register cap the twenty-seventh session's data follow (docs/perf/session27-h100-nr/): the largest
    ``maxnreg`` (a multiple of 8, or 255) at which as many programs stay resident per SM as ptxas' own ``regs``
    give (``kernels.triton_moe_persist.programs_per_sm``: the CUDA occupancy rules). It is at least ``regs``
    rounded up to 8, the registers a thread is allocated anyway; a cap there still changes ptxas' schedule (it
    spends them on hoisting loads). ptxas may use fewer than the cap.

    Raises:
        ValueError: not even one program of ``regs`` registers fits (nothing to keep)."""
    from bytebound.kernels.triton_moe_persist import programs_per_sm
    p = programs_per_sm(regs, shared_bytes, num_warps)
    if p == 0:
        raise ValueError(f"no program of {num_warps} warps at {regs} registers fits on an SM")
    cap = min(-(-regs // 8) * 8, 255)
    while cap < 255 and programs_per_sm(min(cap + 8, 255), shared_bytes, num_warps) >= p:
        cap = min(cap + 8, 255)         # 255, ptxas' ceiling, is allocated as 256
    return cap
