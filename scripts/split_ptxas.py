"""Compile the ``split`` MoE kernels (``kernels.triton_moe_split``, Gluon) for sm_90 without a GPU and print
ptxas' resource usage (registers, spills, shared memory) per config: a compile and register-pressure check that
runs on a CPU machine, for a tiling before it goes to the device.

Pointers are declared 16-divisible, as Triton specialises them at a real launch on the engine's tensors, and the
routing ids int64, as the engine's router writes them (with int32 ids kernel A at M = 4 gets 64 registers instead
of the 72 it runs with: docs/perf/session27-h100-nr/).

    python scripts/split_ptxas.py [--m 1,4] [--config '{"BI": 64, "KP": 2, "KC": 5, "SG": 4}'] [--shared 1] [--sched]
        [--cap-rule]

``--sched`` also prints the order in which ptxas issues each kernel's 16-byte global loads and its mma instructions
(:func:`issue_order`): how many weight loads a warp has in flight when its first mma issues; and how far ptxas
hoists each load above its first use (``ptxas_util.load_use``: with a register cap ``NR`` at or above its own
count ptxas hoists further, docs/perf/session27-h100-nr/). The source pipelines
kernel A's chunks two ahead (``KC``); the SASS does not keep that (docs/perf/session24-h100-rk/). Without
``--config`` it compiles ``SPLIT_DEFAULT``, not the committed table's entries; ``--shared 0`` leaves the shared slot's
path out of kernel A's order. ``--cap-rule`` compiles kernel A without a cap and with ``ptxas_util.cap_rule``'s and
prints registers, programs per SM and loads in flight of both (how the twenty-eighth session chose its candidates).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ptxas_util  # noqa: E402  (scripts/ptxas_util.py)

LING = dict(h=2560, i=768, k=8)


def compile_split(m: int, cfg: dict, shared: bool = True, arch: int = 90, h: int = LING["h"], i: int = LING["i"],
                  k: int = LING["k"], limit: bool = True):
    """``(config, kernel A, kernel B)`` compiled as ``launch_split`` specialises them for ``m`` tokens (both take
    their compile-time arguments from ``triton_moe_split.split_constexprs``)."""
    from bytebound.kernels import triton_moe_split as ts
    from bytebound.kernels.device import maxnreg
    c = ts.fit_split_config(cfg, h, i)
    ca, cb = ts.split_constexprs(m, k, h, i, c, shared, limit, True, int(c.get("pdl_in", 0)))
    a = ptxas_util.compile_kernel(ts._moe_gateup_split, ca,
                 dict(x_ptr="*bf16", ids_ptr="*i64", tw_ptr="*fp32", w13_ptr="*i32", s13_ptr="*u8", act_ptr="*bf16",
                      part_ptr="*fp32", cnt_ptr="*i32", lut_ptr="*i32", limit="fp32", sw13_ptr="*i32",
                      ss13_ptr="*i32", slimit="fp32"), arch,
                 dict(num_warps=c["num_warps"], **maxnreg(c.get("NR"))), gluon=True)
    b = ptxas_util.compile_kernel(ts._moe_down_split, cb,
                 dict(act_ptr="*bf16", ids_ptr="*i64", w2_ptr="*i32", s2_ptr="*u8", out_ptr="*bf16", part_ptr="*fp32",
                      cnt_ptr="*i32", lut_ptr="*i32", sw2_ptr="*i32", ss2_ptr="*i32", tw_ptr="*fp32",
                      pa_ptr="*fp32", limit="fp32", slimit="fp32"), arch,
                 dict(num_warps=c["down_warps"], **maxnreg(c.get("NR2"))), gluon=True)
    return c, a, b


def issue_order(kernel) -> str:
    """The SASS issue order of a compiled kernel's 16-byte global loads and mma instructions as a string: ``L`` an
    unpredicated ``LDG.E.128`` (any suffix, e.g. ``.STRONG.GPU``), ``b`` a predicated one, ``M`` an ``HMMA``; read
    with :func:`ptxas_util.sass` (no GPU). In kernel A's routed path the unpredicated loads are the weight
    tiles and the predicated ones the masked B operand (x); in kernel B's slot loop (``SG > 1``) the weight loads are
    predicated too (a slot may be skipped), so there the two letters say only predicated or not."""
    ops = [ln for ln in ptxas_util.sass(kernel).splitlines() if re.search(r"LDG\.E\.128(\.\S+)*\s|HMMA", ln)]
    return "".join("M" if "HMMA" in ln else ("b" if re.search(r"@!?U?P\d", ln) else "L") for ln in ops)


def _sched_line(name: str, kernel) -> str:
    seq = issue_order(kernel)
    first = seq.find("M")
    lu = ptxas_util.load_use(ptxas_util.sass(kernel))
    hoist = (f"\n    unpredicated 16-byte loads: median {sorted(d for d, _ in lu)[len(lu) // 2]} instructions from load to "
             f"first use, on average {sum(n for _, n in lu) / len(lu):.2f} more such loads issued in between"
             if lu else "")
    return (f"  {name} issue order (L unpredicated 16-byte load, b predicated, M mma): {seq.count('L')} L, "
            f"{seq.count('M')} M, "
            f"{seq[:first].count('L') if first >= 0 else seq.count('L')} L before the first M\n    {seq[:120]}{hoist}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--m", default="1,4")
    ap.add_argument("--config", action="append", default=[], help="JSON overrides of SPLIT_DEFAULT (repeatable)")
    ap.add_argument("--shared", type=int, default=1)
    ap.add_argument("--sched", action="store_true", help="also print each kernel's load / mma issue order")
    ap.add_argument("--cap-rule", action="store_true",
                    help="also compile kernel A without its NR and with the cap ptxas_util.cap_rule gives: registers, "
                         "programs per SM and 16-byte loads in flight of each")
    a = ap.parse_args(argv)
    for m in (int(v) for v in a.m.split(",")):
        for cj in a.config or ["{}"]:
            c, ka, kb = compile_split(m, json.loads(cj), bool(a.shared), a.arch)
            print(f"M={m} {json.dumps(c, sort_keys=True)}\n  A: {ptxas_util.resource_usage(ka)}\n"
                  f"  B: {ptxas_util.resource_usage(kb)}", flush=True)
            if a.sched:
                print(_sched_line("A", ka) + "\n" + _sched_line("B", kb), flush=True)
            if a.cap_rule:
                print(cap_rule_line(m, c, ka, bool(a.shared), a.arch), flush=True)
    return 0


def cap_rule_line(m: int, cfg: dict, ka, shared: bool, arch: int) -> str:
    """Kernel A of ``cfg`` (``ka``: as compiled for it) without a register cap and with ``ptxas_util.cap_rule``'s
    (the largest that keeps the program count, docs/perf/session27-h100-nr/), each as registers, stack frame,
    programs per SM and the mean 16-byte loads a warp has in flight (``load_use``); x warps x programs = loads in
    flight per SM, the figure the twenty-seventh session's NR 80 raised (5.5 -> 8.0 per warp at 3 x 8 warps)."""
    from bytebound.kernels.triton_moe_persist import programs_per_sm
    nw = int(cfg["num_warps"])

    def fields(k) -> dict[str, int]:
        f = ptxas_util.resource_fields(ptxas_util.resource_usage(k))
        if "REG" not in f:
            raise ValueError(f"no REG: field in kernel A's resource line {ptxas_util.resource_usage(k)!r}")
        return f

    def row(k, f) -> str:
        p = programs_per_sm(f["REG"], k.metadata.shared, nw)
        lu = ptxas_util.load_use(ptxas_util.sass(k))
        fl = sum(n for _, n in lu) / len(lu) if lu else 0.0
        return (f"{f['REG']} registers, stack {f.get('STACK', '?')} B, {p} programs per SM, {fl:.2f} loads in "
                f"flight per warp ({fl * nw * p:.0f} per SM)")

    free = {k: v for k, v in cfg.items() if k != "NR"}
    if cfg.get("NR") is not None:       # ka has the config's own cap: compile it without
        _, ka, _ = compile_split(m, free, shared, arch)
    fa = fields(ka)
    own = fa["REG"]
    cap = ptxas_util.cap_rule(own, nw, ka.metadata.shared)
    out = f"  A without NR: {row(ka, fa)}"
    # compile at the cap even when it only reaches its own count's allocation unit (59 -> 64): ptxas, given the
    # cap, spends those registers on hoisting loads (DQ 1 at M = 1: 2.5 -> 5.4 in flight, docs/perf/session28-h100-caps)
    if cap > own:
        _, kc, _ = compile_split(m, dict(free, NR=cap), shared, arch)
        out += f"\n  A with NR {cap} (cap rule): {row(kc, fields(kc))}"
    else:
        out += f"\n  cap rule: {cap}, ptxas already uses all of it"
    return out


if __name__ == "__main__":
    raise SystemExit(main())
