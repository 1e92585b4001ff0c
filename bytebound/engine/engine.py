"""The engine: load a checkpoint, bind kernels, generate (batch 1) with stops, streaming and metrics.

``Engine.generate(prompts, params)`` returns one :class:`RequestOutput` per prompt; ``Engine.stream`` yields
:class:`StreamChunk` deltas. Requests run one at a time (batch 1); callers serialise access (the server
queues them).
"""

from __future__ import annotations

import bisect
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, NamedTuple

import torch

from bytebound.engine.tokenizer import Tokenizer
from bytebound.errors import BackendError, CheckpointError, ConfigError, RequestError
from bytebound.paths import DEFAULT_MODEL
from bytebound.runner.backends import BackendPlan, bind_model
from bytebound.runner.plan import alias_values
from bytebound.runner.runner import ModelRunner, pow2_buckets
from bytebound.sampling import SamplingParams, make_generator, sample
from bytebound.speculative.adaptive import AdaptiveSpeculation, adaptive_tokens, check_knobs, warm_catchup
from bytebound.speculative.mtp import MTPDrafter, SpecStats
from bytebound.speculative.round import StaticRound, mtp_tokens
from bytebound.verify.watchdog import AcceptWatchdog, watch_rounds


@dataclass
class EngineConfig:
    """Everything ``Engine`` needs to start. ``lm_head``: bf16 | fp32 | fp8. ``backends``: plan entry -> name,
    the one override mechanism (``--backend ENTRY=NAME``; entries and choices: ``runner.plan``), e.g.
    ``{"moe": "torch", "router": "torch", "round": "eager"}``. ``speculative_steps`` 0 disables MTP."""
    model: str = str(DEFAULT_MODEL)
    device: str = "cpu"
    dtype: str | None = None
    lm_head: str = "bf16"
    backends: dict = field(default_factory=dict)
    allow_fallback: bool = False
    speculative_steps: int = 0
    max_model_len: int = 4096
    load_format: str = "auto"
    draft_share: str = "module"       # "weight-only" exists only to reproduce the seed's failure in tests
    # Hot-vocabulary draft head (speculative.hot_vocab; opt-in): the draft steps score only N rows of the target's
    # LM-head module. None / 0 = the full head; an int N = the N most frequent tokens of the checkpoint's ranking
    # (draft_vocab.json, else counted at load); a float in (0, 1) = the tokens covering that share of the counted
    # mass; a path = a token-id file. The verify always uses the full head.
    draft_vocab: int | float | str | None = None
    verify: bool = False              # run the start-up canaries (bytebound.verify) and print the manifest
    strict: bool = False              # a failed canary / unresolved lever / watchdog alarm raises VerificationError
    watchdog_window: int = 64         # rolling accept-length watchdog (MTP only): rounds in the window
    watchdog_threshold: float = 1.05  # ... alarm at or below this accept length
    enforce_eager: bool = False       # CUDA: skip graph capture of the decode step (and of the MTP round)
    # Deprecated aliases of plan entries (runner.plan.ALIASES; None = the plan's device default). Use
    # ``backends`` instead: fused_router -> router=triton|torch, fused_router_gemv -> router=gemv|triton,
    # fused_norm -> norm=triton|torch, fused_shared -> moe_shared=fused|separate, kv_buckets -> kv=buckets|exact,
    # spec_static_round -> round=static|eager (enforce_eager above -> graphs=eager).
    fused_router: bool | None = None
    fused_norm: bool | None = None
    fused_shared: bool | None = None
    fused_router_gemv: bool | None = None
    kv_buckets: bool | None = None
    spec_static_round: bool | None = None
    cpu_threads: int | None = 1       # batch-1 CPU steps are many tiny ops: one thread avoids sync overhead
    # CPU: the one-token decode step compiled by torch.compile (inductor C++; runner.cpu_compile), the CPU
    # counterpart of the CUDA graph. False (default here: the first compile takes 30-60 s on a 2-core machine,
    # docs/perf/cpu-decode-nano.md), True (compile; BackendError when it cannot), or "auto" (compile
    # when it can, else run eagerly with the reason printed and in ``cpu_compile_fallback``; ``bytebound demo``'s
    # default). enforce_eager / --backend graphs=... win over it.
    cpu_compile: bool | str = False
    # cpu_compile: compile the first attention span at start-up (True), or no span until a step or the caller
    # (runner.graph.precompile) needs one: ``bytebound demo`` precompiles only the spans its prompt reaches
    cpu_compile_warmup: bool = True
    # N processes, one shard each (bytebound.parallel): the process must already be rank r of an N-process group
    # (bytebound's --tensor-parallel-size launcher or torchrun, bytebound.parallel.init_from_env).
    tensor_parallel_size: int = 1
    # Adaptive speculation (speculative.adaptive): MTP rounds only while the measured accept length a over the
    # measured round cost c (round time / plain step time) pays; plain decoding with periodic probes otherwise.
    # Opt-in (needs MTP). On the H200 with the bundled model's GSM8K it ran no slower than fixed MTP (0.542 vs
    # 0.552 ms TPOT, docs/perf/request-overhead-h200.md); with synthetic weights it falls back to plain decoding.
    speculative_adaptive: bool = False
    adaptive_window: int = 16         # MTP rounds in the decision window
    adaptive_margin: float = 0.05     # fall back below a/c = 1 - margin; back on at a/c >= 1
    adaptive_probe_every: int = 64    # plain tokens before the first probe after a fallback (doubles per failure)
    adaptive_probe_max: int = 1024    # ... up to this many
    adaptive_probe_rounds: int = 4    # MTP rounds per probe
    adaptive_calibration: int = 8     # plain steps timed at start (and per refresh) before MTP
    adaptive_refresh_rounds: int = 512  # MTP rounds before the plain step is timed again (cost grows with context)
    # Decoding, pipelined: each step is launched before the host reads the token it follows (the step reads
    # that token from the device; the host reads a pinned copy), so on CUDA the GPU need not wait for the host's
    # per-token work (detokenising, stop checks, streaming). The tokens are the same; one step more runs after the
    # last one and is discarded with the request. MTP rounds likewise: each is launched before the host reads the
    # round before it (StaticRound.rounds), where room, span and the adaptive controller make it certain. None (the default): on with CUDA and one process (measured
    # faster on the H200, docs/perf/README.md), off on CPU, where a step runs synchronously, so launching it early
    # gains nothing and delays the token it follows by one step. Tensor parallelism keeps the plain loop (its ranks
    # exchange every token): an explicit True is then a recorded fallback in the manifest (``decode_loop``).
    pipeline_decode: bool | None = None


class TokenLogprob(NamedTuple):
    """One output token's log probability (``SamplingParams.logprobs``): natural-log ``log_softmax`` of the raw
    float32 logits it was chosen from (before temperature / top-k / top-p). ``top``: the k most likely
    ``(token id, logprob)`` pairs, most likely first (empty for k = 0)."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _logprob_record(logits: torch.Tensor, tok: torch.Tensor, k: int) -> TokenLogprob:
    """The :class:`TokenLogprob` of ``tok [1]`` int64 chosen from ``logits [1, V]``, with the top ``k``. One host
    read per token: the id, its logprob and the top pairs travel in one float64 tensor (ids < 2^53 are exact)."""
    lp = torch.log_softmax(logits.float(), -1)[0]
    top = lp.topk(k) if k else None
    parts = [tok.view(1).double(), lp.gather(0, tok.view(1)).double()]
    if top is not None:
        parts += [top.values.double(), top.indices.double()]
    row = torch.cat(parts).tolist()
    return TokenLogprob(int(row[0]), row[1], tuple(zip(map(int, row[2 + k:]), row[2:2 + k])))


@dataclass
class RequestOutput:
    """One finished request. Times in seconds; ``tpot_s`` = mean time per output token after the first.
    ``logprobs``: one :class:`TokenLogprob` per ``token_ids`` entry when the request asked for them, else None."""
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    spec: dict | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / self.tpot_s if self.tpot_s > 0 else 0.0


@dataclass
class StreamChunk:
    """A streamed delta: new text and the token ids generated since the previous chunk (text held back while it
    may start a stop string comes later, with the ids of a later chunk); ``finish_reason`` and ``output`` set on
    the last chunk. Concatenated, the chunks give exactly ``output.text`` and ``output.token_ids``. ``ttft_s``: the
    request's time to first token in seconds (from the start of :meth:`Engine.stream` to the first sampled token,
    ``RequestOutput.ttft_s``), on every chunk once that token exists, so a consumer that stops early still knows it.
    ``logprobs``: the :class:`TokenLogprob` of each of ``token_ids`` when the request asked for them, else None."""
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    output: RequestOutput | None = None
    ttft_s: float | None = None
    logprobs: list[TokenLogprob] | None = None


def _stop_at(text: str, sent: int, stops) -> int | None:
    """Where the first stop string in ``text`` starts, or None. Text before ``sent - len(stop)`` was searched
    already (and sent text never holds the start of a stop string: the stream holds back the longest one's
    length)."""
    hits = [i for i in (text.find(s, max(0, sent - len(s))) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _cut(text: str, ids: list[int], ends: list[int], hit: int, reported: int) -> tuple[str, list[int], str]:
    """Cut the output where a stop string starts (``hit``): ``(text, token ids, "stop")``. The ids are those the
    kept text needs, never fewer than the ``reported`` ones already streamed (their text lies before any stop)."""
    return text[:hit], ids[:max(_covering(ends, hit), reported)], "stop"


def _covering(ends: list[int], nchars: int) -> int:
    """How many tokens the kept ``nchars`` characters need: the shortest prefix whose completed text (``ends``:
    the text length once each token's text is complete, equal for tokens that complete one character together)
    reaches ``nchars``."""
    if nchars <= 0:
        return 0
    j = bisect.bisect_left(ends, nchars)
    # tokens that complete a character together share one end: keep the whole group
    return bisect.bisect_right(ends, ends[j]) if j < len(ends) else len(ends)


def _dtype(name: str | None, device: str) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}[name]


class _StartupClock:
    """Wall time of the start-up phases [s] (``lap(name)`` after each, the device synchronised first) and how
    many kernels Triton compiled meanwhile on CUDA: new entries in its on-disk cache (``TRITON_CACHE_DIR``,
    default ``~/.triton/cache``), 0 when every kernel came from a warm cache."""

    def __init__(self):
        self.t = time.perf_counter()
        self.t0 = self.t
        self.cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
        self.before = self._entries()
        self.times: dict = {}

    def _entries(self) -> int:
        try:
            return sum(1 for _ in self.cache.iterdir())
        except OSError:
            return 0

    def lap(self, name: str, dev: torch.device) -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        now = time.perf_counter()
        self.times[name] = round(now - self.t, 3)
        self.times["total_s"] = round(now - self.t0, 3)
        if dev.type == "cuda":
            self.times["triton_compiled"] = self._entries() - self.before
            self.times["triton_cache"] = str(self.cache)
        self.t = now


def _generation_eos(path: Path) -> tuple[int, ...]:
    """``eos_token_id`` (an int or a list) of ``path/generation_config.json``, () without the file: the stop ids
    transformers' ``generate`` uses. (With a tokenizer, :class:`Tokenizer` reads them.)

    Raises:
        CheckpointError: the file is not JSON, or its ``eos_token_id`` is not an int or a list of ints."""
    f = path / "generation_config.json"
    if not f.is_file():
        return ()
    try:
        eos = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id")
    except (ValueError, AttributeError) as e:       # bad JSON, or JSON that is not an object
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from None
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
        raise CheckpointError(f"{f}: eos_token_id={eos!r} must be an int or a list of ints")
    return tuple(eos)


class Engine:
    """Batch-1 generation over a Ling checkpoint (see :class:`EngineConfig`).

    Raises at start-up: ConfigError (bad config or engine settings; MTP requested on a checkpoint without a NEXTN
    layer), CheckpointError (bad checkpoint or tokenizer files), BackendError (CUDA absent, or an unusable backend
    without ``allow_fallback``). A checkpoint without ``tokenizer.json`` starts with ``tokenizer = None``: token-id
    prompts only (a text prompt is a RequestError).
    """

    def __init__(self, config: EngineConfig | None = None, **kw):
        self.config = cfg = config or EngineConfig(**kw)
        self.generation_eos: tuple[int, ...] = ()     # generation_config.json's, read here only without a tokenizer
        try:
            dev = torch.device(cfg.device)
        except RuntimeError as e:
            raise ConfigError(f"--device {cfg.device!r} is not a device torch knows ({e})") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise BackendError(f"--device {cfg.device}: CUDA requested but torch.cuda.is_available() is False "
                               f"(torch {torch.__version__})")
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"--device {cfg.device!r}: only cpu and cuda are supported")
        if cfg.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {cfg.max_model_len}")
        if cfg.speculative_steps < 0:
            raise ConfigError(f"--speculative-num-steps must be >= 0, got {cfg.speculative_steps}")
        if cfg.cpu_compile not in (False, True, "auto"):
            raise ConfigError(f"cpu_compile must be False, True or 'auto', got {cfg.cpu_compile!r}")
        self.cpu_compile_fallback: str | None = None    # why cpu_compile="auto" runs the eager step
        check_knobs(cfg)
        adaptive = (AdaptiveSpeculation(cfg.adaptive_window, cfg.adaptive_margin, cfg.adaptive_probe_every,
                                        cfg.adaptive_probe_max, cfg.adaptive_probe_rounds, cfg.adaptive_calibration,
                                        cfg.adaptive_refresh_rounds) if cfg.speculative_adaptive else None)
        self.tp = None
        if cfg.tensor_parallel_size != 1:
            from bytebound.parallel import current_group
            tp = current_group()
            if cfg.tensor_parallel_size < 1:
                raise ConfigError(f"--tensor-parallel-size must be >= 1, got {cfg.tensor_parallel_size}")
            if tp is None or tp.world != cfg.tensor_parallel_size:
                raise ConfigError(f"--tensor-parallel-size {cfg.tensor_parallel_size}: this process is "
                                  + ("in no process group" if tp is None else f"rank {tp.rank} of {tp.world}")
                                  + " (the bytebound command line starts the processes itself; from Python use "
                                    "bytebound.parallel.launch, or torchrun + init_from_env)")
            if tp.device.type != dev.type:
                raise ConfigError(f"--device {cfg.device}: the process group runs on {tp.device.type}")
            self.tp, dev = tp, tp.device
        # every binding decision, validated once (ConfigError) before anything loads; bound in _build
        self.plan = BackendPlan.build(dev, cfg.backends, alias_values(cfg), allow_fallback=cfg.allow_fallback,
                                      steps=cfg.speculative_steps, tensor_parallel=self.tp is not None)
        if dev.type == "cpu" and cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        dtype = _dtype(cfg.dtype, cfg.device)
        clock = _StartupClock()
        if cfg.load_format == "dummy":
            from bytebound.checkpoint.synthetic import dummy_model
            from bytebound.config import LingConfig
            self.model = dummy_model(LingConfig.from_file(cfg.model), dev, dtype)
            self.tokenizer = None
        else:
            from bytebound.checkpoint.loader import load_model
            self.model = load_model(cfg.model, dev, dtype)
            if not (Path(cfg.model) / "tokenizer.json").is_file():
                # e.g. transformers' model.save_pretrained alone: token ids in and out (encode_prompt says so)
                self.tokenizer = None
                self.generation_eos = _generation_eos(Path(cfg.model))
            else:
                try:
                    self.tokenizer = Tokenizer.from_dir(cfg.model)
                except Exception as e:     # incomplete or corrupt tokenizer files: name them
                    raise CheckpointError(f"{cfg.model}: tokenizer files missing or unreadable "
                                          f"({type(e).__name__}: {e})") from None
        if cfg.max_model_len > self.model.cfg.max_position_embeddings:
            raise ConfigError(f"--max-model-len {cfg.max_model_len} exceeds the model's max_position_embeddings "
                              f"{self.model.cfg.max_position_embeddings}")
        # before kernels are bound and graphs captured: the draft layer is missing, MTP cannot start
        if cfg.speculative_steps and self.model.nextn is None:
            why = ("the config says num_nextn_predict_layers: 1 but the checkpoint holds no model.layers."
                   f"{self.model.cfg.num_hidden_layers}.* tensors (transformers' save_pretrained drops them)"
                   if getattr(self.model, "nextn_absent", False) else "num_nextn_predict_layers = 0")
            raise ConfigError(f"MTP (--speculative-algorithm NEXTN, speculative_steps={cfg.speculative_steps}) "
                              f"needs the checkpoint's NEXTN layer, and {cfg.model} has none: {why}; "
                              "run without speculative decoding")
        self.sharding = {"size": 1, "rank": 0}
        if self.tp is not None:        # before binding: every backend prepares the rank's slices only
            from bytebound.parallel import shard_model
            self.sharding = shard_model(self.model, self.tp)
        clock.lap("load_s", dev)
        self.device = dev
        # the plain decoding loop (EngineConfig.pipeline_decode), resolved once; the manifest's ``decode_loop``
        self.pipelined = (dev.type == "cuda" if cfg.pipeline_decode is None else bool(cfg.pipeline_decode)) \
            and self.tp is None
        self._build(self.plan)
        self.spec_totals = SpecStats(cfg.speculative_steps or 1)
        self.watchdog = (AcceptWatchdog(cfg.watchdog_window, cfg.watchdog_threshold, cfg.strict)
                         if self.drafter is not None else None)
        self.adaptive = adaptive        # AdaptiveSpeculation (engine lifetime), None unless speculative_adaptive
        self.canaries = None
        clock.lap("bind_capture_s", dev)
        self.startup = clock.times
        if cfg.verify:
            from bytebound.verify import build_manifest, print_manifest, run_canaries
            try:
                run_canaries(self, cfg.strict)
            finally:
                clock.lap("canaries_s", dev)
            print_manifest(build_manifest(self), file=sys.stderr)

    def _build(self, plan: BackendPlan) -> None:
        """Bind the loaded model to ``plan`` and build what runs it: width check, runner (``kv``), decode graphs
        (``graphs``), drafter and captured MTP round (``round``). Start-up and :meth:`rebind` both run this.

        Raises:
            BackendError: a named backend is unusable (``bind_model``). ConfigError: MTP wider than the bound
                fast paths (``BackendPlan.check_speculative``), a draft vocabulary without MTP."""
        cfg, dev = self.config, self.device
        self.plan = bind_model(self.model, plan, dev, cfg.lm_head)
        self.plan.check_speculative(cfg.speculative_steps)     # ConfigError: a verify wider than the fast paths
        # the previous runner's cache and graphs go before the new ones are made; the captured rounds hold it, and
        # a runner and its graph hold each other (DecodeGraph.runner): a cycle that only a full collection frees
        rebinding = getattr(self, "runner", None) is not None
        self.runner = self.spec_round = self.spec_round_sampled = None
        if rebinding:
            gc.collect()
        self.runner = ModelRunner(self.model, cfg.max_model_len, dev,
                                  pow2_buckets(cfg.max_model_len) if self.plan.choice("kv") == "buckets" else None)
        self.runner.tp = self.tp         # the MTP rounds take rank 0's drafts and accept decision
        if self.plan.choice("graphs") == "captured":
            from bytebound.runner.graphs import capture_decode
            capture_decode(self.runner)
        elif cfg.cpu_compile and dev.type == "cpu" and "graphs" not in self.plan.explicit:
            self._compile_cpu_step(cfg.cpu_compile == "auto")
        hot = None
        draft_vocab_on = cfg.draft_vocab not in (None, 0, "", "0")
        if cfg.speculative_steps and draft_vocab_on:
            from bytebound.speculative.hot_vocab import HotHead, resolve_draft_vocab
            got = resolve_draft_vocab(cfg.draft_vocab, cfg.model, self.model.cfg.vocab_size)
            hot = HotHead(self.model.lm_head, *got) if got is not None else None
        elif draft_vocab_on:
            raise ConfigError("--speculative-draft-vocab (draft_vocab) needs MTP (--speculative-algorithm NEXTN)")
        self.drafter = (MTPDrafter(self.model, cfg.speculative_steps, cfg.draft_share, hot)
                        if cfg.speculative_steps else None)
        # The captured MTP rounds (CUDA: round=static, graphs=captured): one for greedy requests, one for sampling
        # requests (their settings and uniforms in device buffers: one graph per span serves every setting). Two
        # bodies, not one with a flag: the greedy round would otherwise pay the sampled one's softmax and sorts.
        self.spec_round = self.spec_round_sampled = None
        if self.drafter is not None and self.static_round and self.plan.choice("graphs") == "captured":
            self.spec_round = StaticRound(self.runner, self.drafter, SamplingParams(), None, capture=True)
            self.spec_round_sampled = StaticRound(self.runner, self.drafter, SamplingParams(temperature=1.0), None,
                                                  capture=True)
        # Adaptive speculation runs the NEXTN over the positions a plain phase decoded when MTP resumes, between
        # tokens and at lengths no prefill has had; compiled here, not inside a request's TPOT (warm_catchup).
        # BYTEBOUND_ADAPTIVE_WARMUP=0 skips it (an A/B switch for measuring what it saves).
        self.catchup_warmup = None
        if (cfg.speculative_adaptive and self.drafter is not None and dev.type == "cuda"
                and os.environ.get("BYTEBOUND_ADAPTIVE_WARMUP", "1") != "0"):
            self.catchup_warmup = warm_catchup(self.runner, self.drafter)

    def _compile_cpu_step(self, auto: bool) -> None:
        """Install the compiled CPU decode step (``runner.cpu_compile``), with a one-line notice on stderr around
        each compile. ``auto``: when it cannot be built (no C++ compiler, no Python headers, a failed compile),
        keep the eager step, print why and record it in ``cpu_compile_fallback``; under tensor parallelism it is
        not tried.

        Raises:
            BackendError: not ``auto`` and the step cannot be compiled."""
        from bytebound.runner.cpu_compile import compile_decode, compile_unavailable_reason, inductor_cache_dir
        self.cpu_compile_fallback = None
        if auto and self.tp is not None:        # not a failure: "auto" leaves tensor parallelism eager, silently
            self.cpu_compile_fallback = "not tried with tensor parallelism (single-process only)"
            return
        reason = compile_unavailable_reason()
        if reason is None:
            def notice(span: int, seconds: float | None, error: str | None = None) -> None:
                if error is not None:           # a later span failed mid-request: eager from here on
                    self.cpu_compile_fallback = error
                    print(f"[bytebound] FALLBACK cpu_compile: running the eager CPU decode step from here on "
                          f"({error})", file=sys.stderr, flush=True)
                elif seconds is None:
                    print(f"[bytebound] compiling the CPU decode step ({span} cache slots): 30-60 s on 2 cores "
                          f"the first time, seconds once cached in {inductor_cache_dir()} (--no-cpu-compile "
                          "runs eagerly)", file=sys.stderr, flush=True)
                else:
                    print(f"[bytebound] CPU decode step ready in {seconds:.1f} s", file=sys.stderr, flush=True)
            try:
                compile_decode(self.runner, self.config.cpu_compile_warmup, notice=notice, eager_on_error=auto)
                return
            except BackendError as e:
                if not auto:
                    raise
                reason = str(e)
        elif not auto:
            raise BackendError(f"--cpu-compile: {reason}")
        self.cpu_compile_fallback = reason
        print(f"[bytebound] FALLBACK cpu_compile: running the eager CPU decode step ({reason})", file=sys.stderr)

    def rebind(self, backends: dict | None = None, **changes) -> "Engine":
        """Re-plan and re-bind the loaded model: ``backends`` replaces ``config.backends`` (plan entries) and
        ``changes`` other :class:`EngineConfig` fields that binding reads (``lm_head``, ``max_model_len``,
        ``speculative_steps``, ``allow_fallback``, the deprecated aliases). The weights stay; the runner, graphs,
        drafter and captured round are rebuilt as start-up builds them. For benchmarks that compare plans on one
        model (``scripts/bench_decode.py``).

        Raises:
            ConfigError: a bad plan entry (``BackendPlan.build``) or a field binding does not read.
            BackendError: a named backend unusable here."""
        allowed = {"lm_head", "max_model_len", "speculative_steps", "allow_fallback", "draft_vocab"} | set(
            alias_values(self.config))
        bad = sorted(set(changes) - allowed)
        if bad:
            raise ConfigError(f"Engine.rebind: {', '.join(bad)} cannot change without a new Engine")
        cfg = replace(self.config, **changes, **({"backends": dict(backends)} if backends is not None else {}))
        plan = BackendPlan.build(self.device, cfg.backends, alias_values(cfg), allow_fallback=cfg.allow_fallback,
                                 steps=cfg.speculative_steps, tensor_parallel=self.tp is not None)
        self.config = cfg
        self._build(plan)
        self.spec_totals = SpecStats(cfg.speculative_steps or 1)
        self.watchdog = (AcceptWatchdog(cfg.watchdog_window, cfg.watchdog_threshold, cfg.strict)
                         if self.drafter is not None else None)
        return self

    @property
    def static_round(self) -> bool:
        """Whether MTP rounds run with static shapes (the plan's ``round`` entry)."""
        return self.plan.choice("round") == "static"

    # -------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Token ids of ``prompt``: a string is tokenized (with the chat template if ``chat``); a list of ids is
        checked against the vocabulary and returned as is.

        Raises:
            RequestError: ids that are not integers in ``[0, vocab_size)`` (the embedding would index out of
                range), a string without a tokenizer (dummy weights), or text the tokenizer cannot take.
        """
        if isinstance(prompt, list):
            vocab = self.model.cfg.vocab_size
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise RequestError(f"prompt token ids must be integers in [0, {vocab}) (the model's vocab_size), "
                                   f"got {bad[0]!r}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else ""),
                                   param="prompt")
            return prompt
        if self.tokenizer is None:
            why = ("dummy weights" if self.config.load_format == "dummy"
                   else f"no tokenizer.json in {self.config.model}")
            raise RequestError(f"this engine has no tokenizer ({why}): pass token ids (generate "
                               "--prompt-ids 1,2,3; the server takes a token-id list as the prompt)")
        try:
            if chat:
                prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        except RequestError:
            raise
        except Exception as e:            # e.g. lone surrogates the tokenizer cannot take
            raise RequestError(f"prompt cannot be tokenized: {type(e).__name__}: {e}") from None

    def stop_ids(self, p: SamplingParams) -> set[int]:
        """EOS ids (union of config and generation_config) plus the request's ``stop_token_ids``."""
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids |= set(self.model.cfg.eos_ids)
            if self.tokenizer is not None:
                ids |= set(self.tokenizer.eos_token_ids)
            ids |= set(self.generation_eos)
        return ids

    def _tokens(self, ids: torch.Tensor, p: SamplingParams, gen, stats: SpecStats | None,
                records: list | None = None):
        """Raw token source: plain decode or MTP rounds; yields ``(token, round)``. A request with ``p.logprobs``
        takes :meth:`_logprob_tokens` (plain, unpipelined, no MTP) and appends one :class:`TokenLogprob` per
        yielded token to ``records``."""
        if p.logprobs is not None:
            yield from self._logprob_tokens(ids, p, gen, records)
            return
        if self.drafter is not None:
            # the captured round of the request's kind when there is one, else an uncaptured round for it
            rnd = self.spec_round if p.greedy else self.spec_round_sampled
            if self.adaptive is not None:
                src = adaptive_tokens(self.runner, self.drafter, ids, p, gen, stats, self.adaptive, rnd,
                                      pipelined=self.pipelined)
            else:
                src = mtp_tokens(self.runner, self.drafter, ids, p, gen, stats, rnd, pipelined=self.pipelined)
            yield from watch_rounds(src, stats, self.watchdog)
            return
        r = self.runner
        nxt = sample(r.logits(r.prefill(ids.to(self.device))[-1:]), p, gen)[:1]
        if self.pipelined:
            yield from self._pipelined_tokens(nxt, p, gen)
            return
        while True:
            if self.tp is not None:
                nxt = self.tp.from_rank0(nxt)           # every rank runs rank 0's token
            yield int(nxt[0]), 0
            # the step and its token: on CUDA one decode graph and one head/sampling graph, one host read (above)
            nxt, _ = r.decode_token(nxt, p, gen)

    def _logprob_tokens(self, ids: torch.Tensor, p: SamplingParams, gen, records: list):
        """Plain decoding that also reports each token's :class:`TokenLogprob` (appended to ``records`` before the
        token is yielded), computed from the very logits the token was sampled from: the prefill's last row, then
        each step's. The steps are ``runner.decode_token``'s eager form (forward, LM head, sample), so the tokens
        are plain decoding's and the record costs no second LM head. MTP speculation is bypassed (an engine with
        a drafter comes here too): every token then has the logits of its own decode step, not of a verify, and
        the tokens are those of plain decoding. Not pipelined: the record's host read comes with each token."""
        r = self.runner
        h = r.prefill(ids.to(self.device))[-1:]
        while True:
            logits = r.logits(h)
            nxt = sample(logits, p, gen).view(1)
            if self.tp is not None:
                nxt = self.tp.from_rank0(nxt)           # every rank runs rank 0's token
            rec = _logprob_record(logits, nxt, p.logprobs)
            records.append(rec)
            yield rec.token_id, 0
            h = r.forward(nxt)

    def _pipelined_tokens(self, nxt: torch.Tensor, p: SamplingParams, gen):
        """Plain decoding from the prefill's token ``nxt [1]`` (device) with each step launched before the host
        reads the token it follows (``EngineConfig.pipeline_decode``); yields ``(token, 0)`` like the plain loop
        and emits the same tokens (the steps and their generator draws run in the same order, only earlier). The
        token is copied to pinned host memory before the next step is launched, which rewrites its static buffer
        later in stream order. A step is launched ahead only while the cache has room for it; past that, asking
        for another token raises as the plain loop does."""
        r = self.runner
        cuda = nxt.is_cuda
        host = torch.empty(1, dtype=torch.long, pin_memory=cuda)
        ready = torch.cuda.Event() if cuda else None
        while True:
            host.copy_(nxt.view(1), non_blocking=cuda)
            if ready is not None:
                ready.record()
            ahead = r.pos + 1 <= r.max_len
            if ahead:
                after, _ = r.decode_token(nxt, p, gen)
            if ready is not None:
                ready.synchronize()
            yield int(host[0]), 0
            nxt = after if ahead else r.decode_token(nxt, p, gen)[0]

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most tokens a request with a ``prompt_len``-token prompt may generate within ``max_model_len``
        cache slots (<= 0: the prompt alone does not fit). Plain decoding forwards every generated token but the
        last: ``prompt_len + n - 1`` slots. With MTP the last round may verify ``speculative_steps`` slots past
        that, for ``n >= 2`` (measured on CPU: exactly these bounds fit, one more token overflows the cache when
        the drafts are rejected); ``n = 1`` comes from the prefill alone."""
        spare = self.config.speculative_steps if self.drafter else 0
        room = self.runner.max_len - prompt_len + 1 - spare
        # one token comes from the prefill alone, with no verify round: any prompt that fits may ask for it
        return max(room, 1) if prompt_len <= self.runner.max_len else room

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, chat: bool = False
               ) -> Iterator[StreamChunk]:
        """Generate for one prompt, yielding text deltas. Stops on EOS/stop ids (not emitted), stop strings
        (output truncated before them) or ``max_tokens``; token ids, text and usage end at the same place."""
        p = params or SamplingParams()
        follower = self.tp is not None and not self.tp.lead
        if follower:            # rank > 0: rank 0's request (its prompt and settings), never our own
            req = self.tp.sync_request(None, None)
            if req is None:
                return
            ids, p = req
        else:
            ids = self.encode_prompt(prompt, chat)
        if not ids:
            raise RequestError("empty prompt")
        if not follower and len(ids) > self.runner.max_len:     # no max_tokens could make it fit
            raise RequestError(f"the prompt itself ({len(ids)} tokens) does not fit the engine's max length "
                               f"{self.runner.max_len} (--max-model-len)", param="prompt")
        if not follower and p.max_tokens > self.max_new_tokens(len(ids)):
            spare = self.config.speculative_steps if self.drafter else 0
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) needs "
                               f"{len(ids) + p.max_tokens - 1 + spare} cache slots"
                               + (f" (with {spare} MTP draft slots)" if spare else "")
                               + f", which exceeds the engine's max length {self.runner.max_len} (--max-model-len)")
        self.runner.reset()
        gen = make_generator(p, self.device)
        # a logprobs request runs no MTP round (_logprob_tokens): no speculation statistics
        stats = SpecStats(self.config.speculative_steps) if self.drafter and p.logprobs is None else None
        if self.adaptive is not None:
            self.adaptive.begin_request()
        stop_ids = self.stop_ids(p)
        out_ids: list[int] = []
        rounds: list[int] = []          # verify round of each emitted token (0 = from prefill)
        text, sent = "", 0
        reported = 0                    # out_ids already sent in chunks: those whose text is fully sent
        ends: list[int] = []            # len(text) once each token's text is complete (decoder: whole characters)
        holdback = max((len(s) for s in p.stop), default=0)
        dec = self.tokenizer.incremental_decoder() if self.tokenizer is not None else None
        # logprobs: one TokenLogprob per token the source yields (filled by _tokens), so records[i] is out_ids[i]'s
        records: list[TokenLogprob] | None = [] if p.logprobs is not None else None

        def lps(a: int, b: int) -> list[TokenLogprob] | None:
            return None if records is None else records[a:b]
        cut = False                     # output truncated at a stop string
        t0 = time.perf_counter()
        t_first = t_last = None
        finish = None
        if self.tp is not None and not follower:
            self.tp.sync_request(ids, p)
        source = self._tokens(torch.tensor(ids), p, gen, stats, records)
        if self.tp is not None:         # rank 0 says when to stop; the others run until it does
            source = self.tp.follow_tokens(source) if follower else self.tp.lead_tokens(source)
        try:
            for tok, rnd in source:
                now = time.perf_counter()
                t_first = t_first or now
                t_last = now
                if tok in stop_ids:
                    finish = "stop"
                    break
                out_ids.append(tok)
                rounds.append(rnd)
                if dec is not None:
                    text += dec.decode_stream(tok)      # incremental: O(1) per token, whole UTF-8 chars only
                    ends.extend([len(text)] * (dec.complete - len(ends)))
                    hit = _stop_at(text, sent, p.stop)
                    if hit is not None:
                        cut = True
                        text, out_ids, finish = _cut(text, out_ids, ends, hit, reported)
                        break
                if len(out_ids) >= p.max_tokens:
                    finish = "length"
                    break
                safe = len(text) - holdback
                if safe > sent or dec is None:
                    new_sent = max(safe, sent)
                    done = len(out_ids) if dec is None else bisect.bisect_right(ends, new_sent)
                    chunk = StreamChunk(text[sent:new_sent], out_ids[reported:done], ttft_s=t_first - t0,
                                        logprobs=lps(reported, done))
                    sent, reported = new_sent, max(reported, done)
                    yield chunk
        finally:
            source.close()
        if dec is not None and not cut:
            text += dec.flush()                      # a character left unfinished at the very end (as U+FFFD)
            ends.extend([len(text)] * (len(out_ids) - len(ends)))
            hit = _stop_at(text, sent, p.stop)        # the flushed text may complete a stop string too
            if hit is not None:
                text, out_ids, finish = _cut(text, out_ids, ends, hit, reported)
        end = time.perf_counter()
        n = len(out_ids)
        tpot = (t_last - t_first) / (n - 1) if n > 1 and t_first else 0.0
        spec = None
        if stats:
            # Accept length counts the tokens the request kept: EOS and text cut by a stop string do not count.
            stats.committed = sum(1 for r in rounds[:n] if r > 0)
            spec = stats.to_dict()
            if self.adaptive is not None:
                spec["adaptive"] = self.adaptive.request_dict()
            self.spec_totals.add(stats)
        out = RequestOutput(text, out_ids, finish or "length", len(ids), n, (t_first or end) - t0, tpot, end - t0,
                            spec, lps(0, n))
        yield StreamChunk(text[sent:], out_ids[reported:], finish or "length", out, out.ttft_s, lps(reported, n))

    def follow(self) -> None:
        """Tensor parallel, ranks > 0: run rank 0's requests (:meth:`stream` on rank 0, e.g. the server's) until
        rank 0 calls :meth:`close`. No-op on rank 0 and without tensor parallelism."""
        while self.tp is not None and not self.tp.lead and not self.tp.closed:
            for _ in self.stream(None):
                pass

    def close(self) -> None:
        """Tensor parallel, rank 0: release the followers waiting in :meth:`follow`. No-op elsewhere."""
        if self.tp is not None and self.tp.lead:
            self.tp.shutdown()

    def generate(self, prompts, params: SamplingParams | None = None, chat: bool = False) -> list[RequestOutput]:
        """Run each prompt (a string, token-id list, or a list of those) to completion, in order."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        outs = []
        for pr in ([prompts] if single else prompts):
            last = None
            for last in self.stream(pr, params, chat):
                pass
            outs.append(last.output)
        return outs
