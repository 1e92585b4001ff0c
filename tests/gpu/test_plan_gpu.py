"""Issue 18 on a real GPU: the triton MoE configs resolve by capability on this device, the bound fast paths
record their verify width, and the engine refuses a wider speculative verify at start-up (CPU twins with a mocked
device: tests/test_moe_configs.py, tests/test_verify_width.py)."""

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU: run scripts/gpu_check.sh on the device")]

NANO = Path(__file__).resolve().parents[2] / "models" / "ling-nano"


def test_moe_config_source_on_this_device():
    from bytebound.kernels import moe_host as tm
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    cfg, source = tm.resolve_config(512, 2560, 768, 8, 1)
    if name == "NVIDIA H200":
        assert source == "tuned for NVIDIA H200" and cfg["variant"] == "split"
    elif (major, minor) == (9, 0):
        assert source == "sm_90 default (tuned on NVIDIA H200)" and cfg["variant"] == "split"
    else:
        assert source.startswith("untuned class default") or source.startswith("tuned for ")


@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
def test_engine_records_fast_path_widths_and_refuses_a_wider_verify():
    from bytebound.engine.engine import Engine
    from bytebound.errors import ConfigError
    from bytebound.kernels.limits import MAX_VERIFY_M
    from bytebound.verify import build_manifest
    e = Engine(model=str(NANO), device="cuda", lm_head="fp8", speculative_steps=MAX_VERIFY_M - 1, max_model_len=512)
    fp = e.plan.fast_paths
    assert fp["moe[triton]"] == fp["linear[triton]"] == fp["router[triton]"] == MAX_VERIFY_M
    assert fp["lm_head[triton] (fp8)"] == MAX_VERIFY_M and e.plan.max_verify_m == MAX_VERIFY_M
    man = build_manifest(e)
    assert man["levers"]["mtp"]["max_verify_m"] == MAX_VERIFY_M
    assert sorted(man["levers"]["moe"]["tuning"]) == [f"M={m}" for m in range(1, MAX_VERIFY_M + 1)]
    # the FP8 projections (ling-nano's linears are FP8 128x128 blocks): every bound shape with its GEMV path per M
    gemv = man["levers"]["linear"]["gemv"]
    assert gemv and all(sorted(d) == sorted([f"M={m}" for m in range(1, MAX_VERIFY_M + 1)] + ["layers"])
                        and d["layers"] >= 1 for d in gemv.values()), gemv
    assert all(v.split(" ")[0] in ("mma", "dot", "fma", "not") for d in gemv.values()
               for kk, v in d.items() if kk.startswith("M="))
    from bytebound.verify import format_manifest
    assert sum(ln.strip().startswith("gemv ") for ln in format_manifest(man).splitlines()) == len(gemv)
    with pytest.raises(ConfigError, match=f"--speculative-num-steps {MAX_VERIFY_M}: the verify runs"):
        Engine(model=str(NANO), device="cuda", speculative_steps=MAX_VERIFY_M, max_model_len=512)
