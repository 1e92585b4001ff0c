#!/usr/bin/env python3
"""Tune fla-core's KDA kernels at Ling-3.0-flash shapes and write the bundle ``kernels.fla_configs`` ships.

Starts a full-scale engine with synthetic (dummy) weights and fla-core autotuning (the shipped configs are not
applied: ``FLA_CACHE_MODE=disabled``), runs prefill-only requests of the given lengths (the chunk lengths the
engine uses) and a short greedy decode, then writes every tuned config to ``--out/fla_<arch>.json``. Copy that file
to ``bytebound/kernels/configs/`` to ship it. Prints device, date and commit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "bytebound/assets/configs/ling-3.0-flash.json"))
    ap.add_argument("--lens", default="100,2048,8192,9000", help="prompt lengths (comma-separated)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    os.environ["FLA_CACHE_MODE"] = "disabled"       # autotune everything here (apply() then leaves fla alone)
    import torch

    from bytebound.bench.report import git_commit
    from bytebound.engine.engine import Engine, EngineConfig
    from bytebound.kernels import fla_configs
    from bytebound.sampling import SamplingParams
    lens = [int(v) for v in args.lens.split(",")]
    print(f"device {torch.cuda.get_device_name()}  date {datetime.date.today()}  commit {git_commit()}  "
          "weights synthetic", flush=True)
    eng = Engine(EngineConfig(model=args.model, load_format="dummy", device="cuda", lm_head="fp8",
                              max_model_len=max(lens) + 64))
    g = torch.Generator().manual_seed(0)
    for n in lens:
        ids = torch.randint(16, eng.model.cfg.vocab_size - 1000, (n,), generator=g).tolist()
        t = time.perf_counter()
        eng.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        print(f"prompt {n}: {time.perf_counter() - t:.1f} s (tuning included)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fla_{fla_configs.arch('cuda')}.json"
    bundle = fla_configs.dump(path)
    print(f"wrote {path}: {len(bundle['kernels'])} kernels: {', '.join(bundle['kernels'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
