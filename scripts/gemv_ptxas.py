"""Compile the FP8 GEMV (``kernels.triton_fp8._fp8_gemv``) for a GPU target without a GPU and print ptxas' resource
usage and the instruction mix of its SASS per config: a register and instruction-count check that runs on a CPU
machine (Triton's bundled ptxas and nvdisasm).

    python scripts/gemv_ptxas.py [--arch 90] [--n 2560 --k 4096] [--m 1,4] [--configs '[{"BN":16,...}]'] [--sass]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)


def compile_one(n: int, k: int, m: int, cfg: dict, arch: int = 90):
    """(resource line, Counter of SASS opcodes) of one config (fitted by ``fit_gemv_config``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from bytebound.kernels import triton_fp8 as tf
    c = tf.fit_gemv_config(cfg, n, k, m)
    fn = tf._fp8_gemv
    const = dict(K=k, SK=triton.cdiv(k, 128), M=m, BN=c["BN"], BK=c["BK"], KS=c["KS"], SPLIT=c["SPLIT"], SBN=128,
                 SBK=128, EVEN_N=n % c["BN"] == 0, EVEN_K=k % c["KS"] == 0, DOT=c["DOT"], PRE=c["PRE"], PF=c["PF"], PDL=c["PDL"], HW=True,
                 NT=32 * c["num_warps"])
    types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", o_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32")
    sig, attrs = {}, {}
    for i, a in enumerate(fn.arg_names):
        sig[a] = "constexpr" if a in const else types.get(a, "i32")
        if sig[a].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    kern = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=c["num_warps"], num_stages=c["num_stages"]))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kern.asm["cubin"])
    res = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                         text=True).stdout
    sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    ops = collections.Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    line = next((ln.strip() for ln in res.splitlines() if "REG:" in ln), res.strip()[-200:])
    return c, line, ops, sass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--n", type=int, default=2560)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", default="1,4")
    ap.add_argument("--configs", default='[{"BN": 16, "BK": 256, "num_warps": 4}]')
    ap.add_argument("--sass", action="store_true", help="print the whole SASS")
    a = ap.parse_args(argv)
    for m in (int(x) for x in a.m.split(",")):
        for cfg in json.loads(a.configs):
            c, line, ops, sass = compile_one(a.n, a.k, m, cfg, a.arch)
            top = ", ".join(f"{k} {v}" for k, v in ops.most_common(14))
            print(f"M={m} {json.dumps({k: c[k] for k in ('BN', 'BK', 'KS', 'SPLIT', 'num_warps', 'DOT', 'PRE', 'PF')})}: "
                  f"{line}\n    {top}", flush=True)
            if a.sass:
                print(sass)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
