"""Compiled CPU decode step (``--cpu-compile``; ``bytebound demo``'s default, else opt-in): ``torch.compile``
(inductor's C++ backend) of the batch-1 one-token step, embedding -> decoder layers -> final norm, the CPU
counterpart of ``runner.graphs``.

On a CPU the eager decode step of a small model is per-op overhead (thousands of ATen calls per token for the
bundled ling-nano, docs/perf/cpu-decode-nano.md) and weight reads: inductor fuses the elementwise work and the bf16
products (below) into a few dozen C++ loops and calls the remaining products (``extern_kernels.mm`` / ``bmm``)
directly. Shapes are static as in the CUDA graph: the token and the position are tensors the step reads, and
attention spans a fixed number of cache slots masked by position (``runner.kv_buckets``, one compiled graph per
span, each compiled the first time a sequence reaches it). The routed experts take their traced form
(``kernels.torch_ref._moe_rows_traced``: no ``.tolist()`` host sync), and the float32 weights that convert exactly
to bfloat16 (dequantised FP8 and MXFP4 values) are read as bfloat16 inside float32 products
(``prepare_traced_weights``): the step streams its weights from memory, so half the bytes matters more than the
product kernel. The torch modules stay the reference: the compiled step computes the same maths in another
summation order (tests/test_cpu_compile.py checks it against the eager step).

The graph is traced once per span with every guard on the model and the state dropped (``guard_filter_fn``):
the weights are fixed after ``bind_model`` and the runner reuses its state buffers for every request, so those
guards could only fail by a rebinding, and checking them would cost about as much per step as the fused loops.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import time
import types
from pathlib import Path
from typing import Callable

import torch

from bytebound.errors import BackendError

# CPU attention spans start smaller than CUDA's 1024: the masked slots are real work on a CPU, and the bundled
# model's demo (a 72-token prompt + 256 tokens) stays inside the first span, so it compiles one graph.
CPU_SMALLEST_SPAN = 512
_STEP_ARGS = ("tok", "pos", "span")     # the compiled step's arguments (CompiledDecode.__init__)
Notice = Callable[..., None]            # notice(span, seconds | None, error: str | None = None): CompiledDecode
# Inductor settings for the step's compiles. cpp.vec_isa_ok: trust the CPU flags the kernel reports instead of
# dry-compiling and loading one probe library per vector ISA (each includes ATen's vector headers at -O3: seconds
# per ISA on a small machine, docs/perf/cpu-decode-nano.md); the ISA chosen is the same, and a toolchain that
# cannot build it fails the compile, which the caller reports (and ``bytebound demo`` answers eagerly).
INDUCTOR_OPTIONS = {"cpp.vec_isa_ok": True}


def compile_unavailable_reason() -> str | None:
    """Why torch.compile cannot build the CPU step here, found without compiling (None: nothing known against
    it): no C++ compiler where inductor looks (``$CXX``/``torch._inductor.config.cpp.cxx``, else ``g++``), or no
    ``Python.h`` (inductor's kernels are Python extensions), or Windows."""
    if sys.platform == "win32":
        return "torch.compile's CPU backend is not supported on Windows here"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()
    except Exception as e:              # InvalidCxxCompiler, or an import failure of inductor itself
        return f"no C++ compiler for torch.compile/inductor ({type(e).__name__}; install g++ or set CXX)"
    inc = sysconfig.get_paths().get("include")
    if not inc or not (Path(inc) / "Python.h").is_file():
        return f"no Python.h under {inc} (install the Python development headers, e.g. python3-dev)"
    return None


def inductor_cache_dir() -> str:
    """Where inductor keeps its compiled kernels (``$TORCHINDUCTOR_CACHE_DIR``, else its default under the
    temporary directory)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()


def use_persistent_cache() -> str:
    """Point inductor's cache at ``$XDG_CACHE_HOME/bytebound/torchinductor`` (``~/.cache/...``) unless
    ``TORCHINDUCTOR_CACHE_DIR`` is set: inductor's default lives under the temporary directory, which many systems
    empty at boot, and the first compile is the expensive part. For the command line; returns the directory."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, "bytebound", "torchinductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _keep_input_guards(entries) -> list[bool]:
    """``guard_filter_fn``: keep only the guards on the step's own arguments (the token and position tensors:
    dtype, shape, device; the span, an int) and dynamo's global ones (grad mode, default device: unnamed), drop
    those on the model, its bound closures, the modules' globals and the runner's state."""
    return [e.name == "" or re.split(r"[.\[(]", e.name, maxsplit=1)[0] in _STEP_ARGS for e in entries]


class CompiledDecode:
    """The compiled decode step of ``runner`` (CPU), one compiled graph per attention span in
    ``runner.kv_buckets``. ``replay(token [1] int64, pos int)`` -> final-normed hidden ``[1, H]`` float32, like
    :class:`runner.graphs.DecodeGraph`; the runner's KDA states and MLA caches are updated in place.

    ``captured_shapes`` lists the compiled spans (for the start-up manifest), ``compile_s`` the wall seconds each
    span's first call took (tracing, inductor's compile or its on-disk cache, and the step itself).

    ``warmup``: compile the first span at start-up; False compiles no span before a step (or :meth:`precompile`)
    needs one. ``notice(span, seconds, error)``: called before a span's first compile (``seconds`` None) and after
    it (the wall seconds), for a start-up message; None: silent. ``eager_on_error``: a span that fails to compile
    after start-up (a sequence reaching a new span mid-request, or a precompile) uninstalls the compiled step and
    runs that step and every later one eagerly instead of raising; ``failed`` holds the reason, also given to
    ``notice`` as ``error``.

    Raises:
        BackendError: the runner is not on a CPU, or torch.compile cannot compile the step (the message has the
            compiler's reason; the caller may run eagerly instead).
    """

    def __init__(self, runner, warmup: bool = True, notice: Notice | None = None, eager_on_error: bool = False):
        if runner.device.type != "cpu":
            raise BackendError("the compiled CPU decode step (--cpu-compile) needs device cpu; CUDA captures graphs")
        self.runner = runner
        self.tok = torch.zeros(1, dtype=torch.long)
        self.pos = torch.zeros(1, dtype=torch.long)
        self.compile_s: dict[int, float] = {}
        self.bf16_weights: dict | None = None      # what prepare_traced_weights converted (compile_decode)
        self.notice, self.eager_on_error = notice, eager_on_error
        self.failed: str | None = None
        model, state = runner.model, runner.state

        def step(tok, pos, span: int):
            return model(tok.view(1, 1), pos, state, span)[0]
        # A code object of its own: dynamo keeps compiled graphs per code object, and with the model's and the
        # state's guards dropped, another CompiledDecode (another model, or another runner's state) must never find
        # this one's graphs. ``span`` stays guarded (a Python int, specialised): one graph per span.
        step = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__,
                                  step.__closure__)
        # size_asserts off: the wrapper would check the size and stride of each of the step's ~120 inputs (the
        # weights and states are inputs, not constants) on every call; they are the tensors it was compiled for
        self.fn = torch.compile(step, fullgraph=True, dynamic=False,
                                options={"guard_filter_fn": _keep_input_guards, "size_asserts": False})
        self._starting = True           # a failed start-up compile is raised (compile_decode's caller decides)
        if warmup:          # the first span at start-up (a start-up cost, not the first request's TTFT)
            self.replay(torch.zeros(1, dtype=torch.long), 0)
            runner.reset()
        self._starting = False

    def precompile(self, first: int, last: int) -> list[int]:
        """Compile now every span that one-token steps at positions ``first .. last`` (inclusive) will use, so a
        request that runs them (e.g. the demo's long 5-shot prompt, whose steps start past the first span) does not
        stop mid-decode to compile (that time would land in its TPOT). Runs one step per new span at the span's
        last position and then ``runner.reset()``: call it while the runner holds no request. Returns the spans it
        compiled; a span that fails follows ``eager_on_error`` as :meth:`replay` does.

        Raises:
            ValueError: ``last`` past the runner's cache; BackendError: as :meth:`replay`.
        """
        r = self.runner
        lo, hi = r.kv_span(first + 1), r.kv_span(max(last, first) + 1)
        done = []
        for s in (s for s in r.kv_buckets if lo <= s <= hi and s not in self.compile_s):
            if r.graph is not self:         # a failed span uninstalled the compiled step: the rest runs eagerly
                break
            self.replay(torch.zeros(1, dtype=torch.long), s - 1)
            r.reset()
            if s in self.compile_s:
                done.append(s)
        return done

    @property
    def captured_shapes(self) -> list[dict]:
        bf = self.bf16_weights
        return [{"op": "decode", "tokens": 1, "kv_slots": s, "compiled": "inductor (cpu)", "compile_s": round(t, 2),
                 **({"bf16_weights": bf} if bf else {})} for s, t in self.compile_s.items()]

    @torch.inference_mode()
    def replay(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        span = self.runner.kv_span(pos + 1)
        self.tok.copy_(token.view(1))
        self.pos.fill_(pos)
        if span in self.compile_s:
            return self.fn(self.tok, self.pos, span)
        import torch._inductor.config       # not imported by ``import torch``
        if self.notice is not None:
            self.notice(span, None)
        t0 = time.perf_counter()
        try:
            with torch._inductor.config.patch(INDUCTOR_OPTIONS):
                out = self.fn(self.tok, self.pos, span)
        except Exception as e:          # dynamo / inductor failures have many types; report one named error
            err = BackendError(f"torch.compile could not compile the CPU decode step ({span} slots): "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if not self.eager_on_error or self._starting:
                raise err from e
            # after start-up (a later span mid-request, or a precompile): dynamo and inductor fail while tracing (on
            # fake tensors) or building, before the step runs, so the state is untouched and the eager step can take
            # this position and the rest
            self.failed = str(err)
            if self.runner.graph is self:
                self.runner.graph = None
            if self.notice is not None:
                self.notice(span, None, self.failed)
            return self.runner.model(token.view(1, 1), torch.arange(pos, pos + 1), self.runner.state, None)[0]
        self.compile_s[span] = time.perf_counter() - t0
        if self.notice is not None:
            self.notice(span, self.compile_s[span])
        return out


def _bf16_exact(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` in bfloat16 when every value converts exactly (a float32 tensor), else None."""
    if w.dtype != torch.float32:
        return None
    b = w.to(torch.bfloat16)
    return b if torch.equal(b.float(), w) else None


def prepare_traced_weights(model) -> dict:
    """Give the compiled step bfloat16 copies of the float32 weights that convert exactly: the torch backend's bound
    projections (``kernels.torch_ref.BoundLinear.traced``) and the resident routed experts (``_traced_deq``). The
    decode step on a CPU streams its weights from memory, so half the bytes is the larger part of its time; the
    products stay float32 (``traced_linear``). Weights that do not convert exactly (a float32 checkpoint) keep the
    float32 path. Returns ``{"linear": [bf16, total], "experts": [bf16, total]}`` (counts, for the manifest)."""
    from bytebound.kernels.torch_ref import BoundLinear
    from bytebound.layers.moe import RoutedExperts
    out = {"linear": [0, 0], "experts": [0, 0]}
    for m in model.modules():
        for attr in ("fn", "proj_fn", "gate_up_fn"):
            f = getattr(m, attr, None)
            if isinstance(f, BoundLinear):
                f.traced = _bf16_exact(f.weight)
                out["linear"][0] += f.traced is not None
                out["linear"][1] += 1
        if isinstance(m, RoutedExperts) and getattr(m, "_deq", None) is not None:
            got = tuple(_bf16_exact(w) for w in m._deq)
            m._traced_deq = got if all(g is not None for g in got) else None
            out["experts"][0] += m._traced_deq is not None
            out["experts"][1] += 1
    return out


def compile_decode(runner, warmup: bool = True, notice: Notice | None = None,
                   eager_on_error: bool = False) -> CompiledDecode:
    """Install the compiled CPU decode step on ``runner`` (``runner.graph``, which ``ModelRunner.forward``
    replays for every one-token step). The runner's spans become powers of two from ``CPU_SMALLEST_SPAN`` up to
    its ``max_len`` unless it was given buckets. ``warmup``, ``notice``, ``eager_on_error``: as
    :class:`CompiledDecode`.

    Raises:
        BackendError: as :class:`CompiledDecode`; the runner is then left as it was (eager step, its spans, no
            bfloat16 weight copies)."""
    from bytebound.runner.runner import pow2_buckets
    buckets = runner.kv_buckets
    if runner.kv_buckets == (runner.max_len,):
        runner.kv_buckets = pow2_buckets(runner.max_len, CPU_SMALLEST_SPAN)
    # one specialised graph per span: dynamo's per-function recompile limit (8 by default) must not send a long
    # --max-model-len back to eager for its last spans
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(runner.kv_buckets) + 1)
    runner.graph = None
    traced = prepare_traced_weights(runner.model)
    try:
        g = CompiledDecode(runner, warmup, notice, eager_on_error)
    except BackendError:
        runner.kv_buckets = buckets
        drop_traced_weights(runner.model)
        raise
    g.bf16_weights = traced
    runner.graph = g
    return g


def drop_traced_weights(model) -> None:
    """Undo :func:`prepare_traced_weights` (the eager step never reads the copies; this frees them)."""
    from bytebound.kernels.torch_ref import BoundLinear
    from bytebound.layers.moe import RoutedExperts
    for m in model.modules():
        for attr in ("fn", "proj_fn", "gate_up_fn"):
            f = getattr(m, attr, None)
            if isinstance(f, BoundLinear):
                f.traced = None
        if isinstance(m, RoutedExperts):
            m._traced_deq = None
