"""The largest token count per call that the decode/verify fast paths serve: one number, read everywhere.

A batch-1 decode step runs M = 1 token through the model and an MTP verify runs M = k + 1 (k =
``--speculative-num-steps``). The GPU fast paths are specialised for small M:

* ``moe[triton]`` (``kernels.moe_host.MoEKernel``: the fused gluon/tl kernels and the ``split`` kernels, whose
  workspaces and partial buffers hold at most :data:`MAX_VERIFY_M` token columns, and the shared-expert slot);
* ``linear[triton]`` (``kernels.triton_fp8``: the FP8 block GEMV keeps one float32 accumulator per token in
  registers) and ``lm_head[triton]`` in FP8 mode (the FP8 head GEMV);
* the router kernels (``kernels.triton_router.fused_route`` / ``gemv_route``: one program per row, a logits scratch
  of :data:`MAX_VERIFY_M` rows) and the layer that chooses them (``layers.moe.MoE.router``).

Above that width each of them leaves its fast path (the MoE runs in :data:`MAX_VERIFY_M`-token slices, every FP8
projection is dequantised to BF16 per call, the routing runs in torch), which is right for a prefill and wrong for
a verify. So the engine refuses, at start-up, a speculative config whose verify width exceeds the width of the
fast paths it bound (``runner.backends.BackendPlan.check_speculative``); the torch reference backends (CPU) serve
any M. Raising this number needs each kernel above to support the wider tile first (tests in tests/gpu).
"""

from __future__ import annotations

MAX_VERIFY_M = 4


def verify_width(speculative_steps: int) -> int:
    """Tokens per verify call for a NEXTN chain of ``speculative_steps`` drafts (the last committed token plus
    the drafts): ``k + 1``."""
    return int(speculative_steps) + 1
