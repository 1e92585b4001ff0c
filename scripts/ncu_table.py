#!/usr/bin/env python3
"""Per-kernel table from an Nsight Compute CSV (``ncu --csv --page details``) of ``profile_decode.py --ncu-range``.

The range holds one eager decode step, then a marker kernel (``torch.cuda._sleep``: ``spin_kernel``), then one
verify; rows before the marker are ``decode``, after it ``verify``. For each phase and kernel name: calls, mean
duration (us, ``gpu__time_duration``), DRAM bytes read per call (MB) and the achieved read bandwidth (GB/s),
registers per thread, grid and block size, waves per SM, theoretical and achieved occupancy, warp cycles per issued
instruction, and the three largest stall reasons (``smsp__average_warps_issue_stalled_*_per_issue_active``: warps
stalled on that reason per issued instruction). ncu serialises kernels and flushes the caches before each one
(``--cache-control all``), so a duration is the kernel's own, with its weights and activations from HBM.

    python3 scripts/ncu_table.py ncu.csv > ncu.md
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict

STALL = "smsp__average_warps_issue_stalled_"
MARKER = "spin_kernel"
FIELDS = {
    "Duration": "dur",
    "Registers Per Thread": "regs",
    "Waves Per SM": "waves",
    "Theoretical Occupancy": "occ_th",
    "Achieved Occupancy": "occ",
    "Warp Cycles Per Issued Instruction": "cpi",
    "dram__bytes_read.sum": "dram_rd",
    "DRAM Throughput": "dram_pct",
}
UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "ns": 1e-3, "us": 1.0, "ms": 1e3,
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "KB": 1e-3, "MB": 1.0, "GB": 1e3}


def _num(v: str) -> float | None:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def read(path: str) -> list[dict]:
    """The launches of the CSV in ID order: ``{"name", "grid", "block", metric key: value}`` (durations in us,
    bytes in MB, stall ratios under ``"stall:<reason>"``)."""
    rows: dict[int, dict] = {}
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]        # ncu's own log lines come before the CSV
    for r in csv.DictReader(lines):
        i = int(r["ID"])
        k = rows.setdefault(i, {"name": r["Kernel Name"], "grid": r.get("Grid Size", ""),
                                "block": r.get("Block Size", "")})
        name, unit, val = r["Metric Name"], r.get("Metric Unit", ""), _num(r.get("Metric Value", ""))
        if val is None:
            continue
        val *= UNITS.get(unit, 1.0)
        if name.startswith(STALL):
            k["stall:" + name[len(STALL):].split("_per_issue_active")[0]] = val
        elif name in FIELDS:
            k[FIELDS[name]] = val
    return [rows[i] for i in sorted(rows)]


def table(launches: list[dict]) -> str:
    phase, groups = "decode", defaultdict(list)
    for k in launches:
        if MARKER in k["name"]:
            phase = "verify"
            continue
        groups[(phase, k["name"][:60])].append(k)
    out = []
    for ph in ("decode", "verify"):
        keys = [g for g in groups if g[0] == ph]
        if not keys:
            continue
        tot = sum(sum(k.get("dur", 0) for k in groups[g]) for g in keys)
        n = sum(len(groups[g]) for g in keys)
        out += [f"## {ph}: {n} kernels, {tot:.1f} us summed (ncu: serialised, caches flushed)", "",
                "| kernel | calls | us/call | MB read/call | GB/s | DRAM % | regs | grid | block | waves | occ th/ach % "
                "| cyc/issue | top stalls (warps per issue) |",
                "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|---:|---|"]
        for g in sorted(keys, key=lambda g: -sum(k.get("dur", 0) for k in groups[g])):
            ks = groups[g]

            def mean(f):
                v = [k[f] for k in ks if f in k]
                return sum(v) / len(v) if v else float("nan")
            stalls = defaultdict(float)
            for k in ks:
                for f, v in k.items():
                    if f.startswith("stall:"):
                        stalls[f[6:]] += v / len(ks)
            top = ", ".join(f"{s} {v:.1f}" for s, v in sorted(stalls.items(), key=lambda t: -t[1])[:3])
            dur, mb = mean("dur"), mean("dram_rd")
            out.append(f"| `{g[1]}` | {len(ks)} | {dur:.2f} | {mb:.2f} | {mb / dur * 1e3 if dur else 0:.0f} | "
                       f"{mean('dram_pct'):.0f} | {mean('regs'):.0f} | {ks[0]['grid']} | {ks[0]['block']} | "
                       f"{mean('waves'):.2f} | {mean('occ_th'):.0f}/{mean('occ'):.0f} | {mean('cpi'):.1f} | {top} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    a = ap.parse_args(argv)
    launches = read(a.csv)
    if not launches:
        print(f"{a.csv}: no ncu rows", file=sys.stderr)
        return 1
    print(table(launches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
