"""Shared fixtures of the CPU suite and the ``gpu`` marker skip.

Checkpoints are written once per session by the real writer (``bytebound.checkpoint.writer``) from seeded
random models, so every test that loads one exercises the real loader.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
NANO_TOKENIZER = ROOT / "models" / "ling-nano"
sys.path.insert(0, str(TESTS))          # tests/hf_ref.py is importable as ``hf_ref`` from every test module

# Without a GPU, Triton kernels can only run in its interpreter, and Triton's own jitted library functions
# (tl.zeros, tl.sigmoid, ...) are built for the mode Triton was first imported in: set the mode before anything
# imports Triton, so a kernel test works whatever ran before it in the session.
# (BYTEBOUND_TRITON_COMPILE_ONLY=1: a subprocess that compiles kernels offline for a GPU target, not interpreted.)
if not torch.cuda.is_available() and os.environ.get("BYTEBOUND_TRITON_COMPILE_ONLY") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tiny models run thousands of microsecond-sized ops: one intra-op thread is fastest, and with two threads on
# a busy 2-core machine every op waits for the other thread (measured 2.7 ms vs 400 ms per decode step).
torch.set_num_threads(1)

GPU_SKIP_REASON = "needs a CUDA GPU: run scripts/gpu_check.sh on the device"

# FP8 block 32x32 (instead of 128x128) so the tiny config's scale grids are not all 1x1: a transposed or
# mis-sized grid is then a real layout error, and FP8 block boundaries fall inside the tiny matrices.
QUANT_TINY = dict(method="fp8", weight_block_size=(32, 32), scale_fmt="ue8m0",
                  modules_to_not_convert=("lm_head", "b_proj"), routed_experts="mxfp4", routed_group_size=32)


def pytest_configure(config):
    # pyproject registers the markers too; repeated here so the suite also runs from a bare checkout.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU with a reason)")
    config.addinivalue_line("markers", "slow: longer CPU test")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def quant_tiny():
    from bytebound.config import QuantConfig
    return QuantConfig(**QUANT_TINY)


def make_model(cfg=None, seed: int = 0, **init):
    """A plain fp32 model of ``cfg`` (default ``tiny_config()``) with non-trivial seeded weights."""
    from bytebound.checkpoint.synthetic import random_model
    from bytebound.config import tiny_config
    from hf_ref import init_sensitive_
    return init_sensitive_(random_model(cfg or tiny_config(), seed=seed), seed=seed, **init)


@pytest.fixture(scope="session")
def tiny_model():
    """Plain fp32 tiny model (``tiny_config()``), sensitive init, seed 0. Do not modify in place."""
    return make_model()


@pytest.fixture(scope="session")
def plain_ckpt(tmp_path_factory, tiny_model):
    """``tiny_model`` written as a single fp32 ``model.safetensors`` (+ ling-nano tokenizer files)."""
    from bytebound.checkpoint.writer import save_pretrained
    return save_pretrained(tiny_model, tmp_path_factory.mktemp("plain_ckpt"), float_dtype=torch.float32,
                           tokenizer_dir=NANO_TOKENIZER)


@pytest.fixture(scope="session")
def quant_ckpt(tmp_path_factory, tiny_model):
    """``tiny_model`` quantised (FP8 32x32 block dense linears, MXFP4 routed experts, fp32 rest), sharded
    into several files with ``model.safetensors.index.json``, with the ling-nano tokenizer files."""
    from bytebound.checkpoint.writer import save_pretrained
    return save_pretrained(tiny_model, tmp_path_factory.mktemp("quant_ckpt"), quant=quant_tiny(),
                           float_dtype=torch.float32, max_shard_bytes=24_000, tokenizer_dir=NANO_TOKENIZER)


def nano_model(seed: int = 0):
    """A tiny model whose vocabulary is the ling-nano tokenizer's (6144 ids, EOS 3 / pad 0). The LM-head rows
    of the four special tokens are zeroed so random weights never emit them by accident (logit 0 is below the
    maximum of 6140 random logits)."""
    from bytebound.config import tiny_config
    cfg = tiny_config(vocab_size=6144, eos_token_id=3, pad_token_id=0)
    m = make_model(cfg, seed=seed)
    with torch.no_grad():
        m.lm_head.weight[:4] = 0
    return m


@pytest.fixture(scope="session")
def nano_ckpt(tmp_path_factory):
    """A quantised tiny checkpoint with the ling-nano tokenizer (``bytebound generate`` end to end)."""
    from bytebound.checkpoint.writer import save_pretrained
    return save_pretrained(nano_model(), tmp_path_factory.mktemp("nano_ckpt"), quant=quant_tiny(),
                           tokenizer_dir=NANO_TOKENIZER)


@pytest.fixture
def row_wise(monkeypatch):
    """Every linear one row at a time, so a verify's projections do the arithmetic of decode steps
    (tests/test_state_protocol.py, test_mtp_cpu.py's ``test_rollback_exact_with_row_wise_linear``)."""
    lin = torch.nn.functional.linear

    def linear(x, w, b=None):
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.cat([lin(x2[i:i + 1], w, b) for i in range(x2.shape[0])], 0)
        return out.view(*x.shape[:-1], w.shape[0])
    monkeypatch.setattr(torch.nn.functional, "linear", linear)


@pytest.fixture(scope="session")
def tiny_random_ckpt(tmp_path_factory):
    """A plain random tiny checkpoint with the ling-nano tokenizer (bench and server tests)."""
    from bytebound.checkpoint.synthetic import random_model
    from bytebound.checkpoint.writer import save_pretrained
    from bytebound.config import tiny_config
    d = tmp_path_factory.mktemp("tiny-ckpt")
    save_pretrained(random_model(tiny_config(vocab_size=6144, eos_token_id=3, pad_token_id=0)), d,
                    tokenizer_dir=NANO_TOKENIZER)
    return d


@contextlib.contextmanager
def triton_kernels(module: str, bf16_round_nearest: bool = False):
    """Import a Triton kernel module for a CPU test: under ``TRITON_INTERPRET=1`` when there is no GPU (the flag is
    read when kernels are decorated, hence the reload), restored afterwards. ``bf16_round_nearest`` makes the
    interpreter's float32 -> bfloat16 cast round to nearest even like the hardware (it truncates otherwise)."""
    old = os.environ.get("TRITON_INTERPRET")
    patched = interp = None
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        if bf16_round_nearest:
            import numpy as np
            import triton.language as tl
            from triton.runtime import interpreter as interp
            patched = interp._convert_float

            def convert(data, src, dst, rounding):
                if src == tl.float32 and dst == tl.bfloat16:
                    t = torch.from_numpy(np.frombuffer(data.tobytes(), dtype=np.float32).copy())
                    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
                return patched(data, src, dst, rounding)
            interp._convert_float = convert
    try:
        yield importlib.reload(importlib.import_module(module))
    finally:
        if patched is not None:
            interp._convert_float = patched
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old



# Kernel tests that run on the GPU, or in Triton's interpreter on a CPU machine with Triton installed (CI has none).
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton not installed (the kernel is also tested on the GPU)")


def triton_module_fixture(name: str, module: str, **kw):
    """A module-scoped fixture ``name`` yielding ``module`` imported through :func:`triton_kernels`."""
    @pytest.fixture(scope="module", name=name)
    def fixture():
        with triton_kernels(module, **kw) as mod:
            yield mod
    return fixture


def compiled_in_subprocess(test_file: str, node: str) -> bool:
    """For tests that compile kernels offline for a GPU target (no GPU needed): in the test session, rerun the test
    ``test_file::node`` in a pytest subprocess without Triton's interpreter (this session may be in interpreter
    mode, which the kernels' decoration reads) and with ``BYTEBOUND_TRITON_COMPILE_ONLY=1``, assert that it passed
    and return True (the caller returns); inside that subprocess return False (the caller compiles)."""
    import subprocess
    if os.environ.get("BYTEBOUND_TRITON_COMPILE_ONLY") == "1":
        return False
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["BYTEBOUND_TRITON_COMPILE_ONLY"] = "1"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{test_file}::{node}"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return True


def run_offline_script(name: str, *args: str, timeout: int = 600) -> str:
    """``scripts/<name>.py args`` in a fresh interpreter without Triton's interpreter mode (this session may be in
    it, which the kernels' decoration reads), with the repository on ``PYTHONPATH``: for the offline sm_90
    compiles (no GPU needed). Asserts it exited 0; returns its stdout."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args], capture_output=True, text=True,
                       env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def load_script(name: str, module_name: str | None = None):
    """``scripts/<name>.py`` imported as a module (scripts are not a package), registered in ``sys.modules`` under
    ``module_name`` (default ``_<name>``) so that dataclasses and pickling can look it up while it loads."""
    spec = importlib.util.spec_from_file_location(module_name or f"_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def register_caps(jit_fn) -> list[tuple[int | None, int]]:
    """``(maxnreg, registers used)`` of every binary of the Triton/Gluon kernel ``jit_fn`` compiled in this process
    and loaded on a GPU (from Triton's per-device kernel cache): how a register-cap test checks that the cap reached
    ptxas, not only that the output kept its bits. Raises AssertionError when the cache cannot be read (another
    Triton layout), so such a test fails rather than passes without looking."""
    caches = getattr(jit_fn, "device_caches", None)
    assert caches, f"no compiled binaries of {jit_fn} to inspect (Triton's device_caches)"
    out = []
    for entry in caches.values():
        for kernel in entry[0].values():
            out.append((getattr(kernel.metadata, "maxnreg", None), int(getattr(kernel, "n_regs", -1))))
    return out
