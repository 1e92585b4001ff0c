"""``bytebound`` command line: generate, demo, verify, analyze, bench, serve."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bytebound.paths import DEFAULT_MODEL

# the deprecated per-op backend flags: --moe-backend NAME = --backend moe=NAME (torch-free here, so --help and
# --version do not import torch)
OP_FLAGS = {"moe": "--moe-backend", "linear": "--linear-backend", "kda": "--kda-backend", "mla": "--mla-backend"}


# MTP draft steps per round without --speculative-num-steps (the seed's 3 drafts, 4 verified positions)
SPEC_STEPS = 3


def spec_steps(a) -> int:
    """``--speculative-num-steps``, or its default :data:`SPEC_STEPS` when not given."""
    return SPEC_STEPS if a.speculative_num_steps is None else a.speculative_num_steps


def add_engine_args(p: argparse.ArgumentParser, cpu_compile: bool | str = False) -> None:
    """Flags shared by every command that starts an engine. ``cpu_compile``: the command's default for
    ``--cpu-compile`` (``"auto"``: compile the CPU decode step where torch.compile can, else run eagerly)."""
    # --model-path: SGLang's spelling of the same flag, accepted so a command line copied from it works
    p.add_argument("--model", "--model-path", dest="model", default=str(DEFAULT_MODEL),
                   help="checkpoint dir (default: bundled ling-nano); --model-path (SGLang's name) is the same")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--lm-head", default="bf16", choices=["bf16", "fp32", "fp8"],
                   help="bf16 (checkpoint), fp32 (fp32 logits, --enable-fp32-lm-head), fp8 (online FP8)")
    p.add_argument("--enable-fp32-lm-head", action="store_true", help="alias of --lm-head fp32")
    p.add_argument("--backend", action="append", default=[], metavar="ENTRY=NAME",
                   help="override one plan entry (repeatable, or comma-separated): a kernel op - moe=torch|triton|"
                        "humming, linear=torch|triton, lm_head=torch|triton, kda=torch|fla|triton, mla=torch|triton, "
                        "sampling=torch - or a switch - router=gemv|triton|torch, norm=triton|torch, "
                        "moe_shared=fused|separate, kv=buckets|exact, round=static|eager, graphs=captured|eager "
                        "(default: the device's plan; "
                        "bytebound verify prints it per op and regime; the older per-op and --fused-* flags still "
                        "work, unlisted)")
    # Deprecated aliases, kept working but not listed by --help (help=SUPPRESS): the registry ops' per-op flags
    # (--moe-backend NAME = --backend moe=NAME, OP_FLAGS) and, below, the switches' booleans.
    hidden = argparse.SUPPRESS
    for flag in OP_FLAGS.values():
        p.add_argument(flag, default=None, help=hidden)
    p.add_argument("--allow-fallback", action="store_true",
                   help="substitute the torch backend when a requested one is unusable (recorded and printed)")
    p.add_argument("--speculative-algorithm", default=None, choices=["NEXTN"], help="NEXTN = MTP drafting (default off)")
    # default None, read through spec_steps: a value the user gave is told from the default
    p.add_argument("--speculative-num-steps", type=int, default=None,
                   help=f"with NEXTN: draft steps per MTP round (default {SPEC_STEPS})")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help=f"with NEXTN: tokens verified per round, --speculative-num-steps + 1 (chain, top-k 1; "
                        f"default: that, {SPEC_STEPS + 1} with the default steps)")
    p.add_argument("--speculative-draft-vocab", default=None, metavar="N|COVERAGE|FILE",
                   help="hot-vocabulary draft head (opt-in): the draft steps score only N tokens of the target's LM "
                        "head - N, a coverage in (0, 1) of the checkpoint's token-frequency ranking (e.g. 0.99), or "
                        "a token-id file; 0 is the full head; the verify always uses the full head (default: full head)")
    onoff = argparse.BooleanOptionalAction
    # deprecated aliases of plan entries, hidden from --help (runner.plan.ALIASES says what each maps to)
    for flag in ("--fused-router", "--fused-norm", "--fused-shared-expert", "--fused-router-gemv",
                 "--decode-kv-buckets", "--spec-static-round"):
        p.add_argument(flag, action=onoff, default=None, help=hidden)
    p.add_argument("--speculative-adaptive", action="store_true",
                   help="with NEXTN: run MTP rounds only while the measured accept length / round cost pays, "
                        "decode plainly otherwise and probe back periodically (default off)")
    p.add_argument("--adaptive-window", type=int, default=16, help="adaptive speculation: rounds per decision")
    p.add_argument("--adaptive-margin", type=float, default=0.05,
                   help="adaptive speculation: fall back below a/c = 1 - margin (back on at a/c >= 1)")
    p.add_argument("--adaptive-probe-every", type=int, default=64,
                   help="adaptive speculation: plain tokens before a probe (doubles after each failed probe)")
    p.add_argument("--adaptive-probe-max", type=int, default=1024,
                   help="adaptive speculation: the longest plain phase between probes [tokens]")
    p.add_argument("--adaptive-probe-rounds", type=int, default=4, help="adaptive speculation: MTP rounds per probe")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="longest request in tokens: prompt + generated (+ MTP draft slots), at most the model's "
                        "max_position_embeddings (default 4096)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="auto: the checkpoint's weights; dummy: random weights at the config's shapes, no tokenizer "
                        "(default auto)")
    p.add_argument("--enforce-eager", action="store_true", help=hidden)     # = --backend graphs=eager
    if cpu_compile == "auto":
        what = ("default: on where torch.compile can build it (else eager, with the reason); the first run "
                "compiles for 30-60 s on 2 cores, later ones load the cache in seconds")
    else:
        what = "default: off; the first compile takes 30-60 s on 2 cores"
    p.add_argument("--cpu-compile", action=onoff, default=cpu_compile,
                   help="CPU: compile the one-token decode step with torch.compile (inductor, C++; needs a C++ "
                        f"compiler) for 2-3x faster steps ({what}; docs/perf/cpu-decode-nano.md). "
                        "--no-cpu-compile or --backend graphs=eager runs the eager step")
    p.add_argument("--tensor-parallel-size", "--tp-size", "--tp", dest="tensor_parallel_size", type=int, default=1,
                   help="N processes, one shard of the model each (heads, experts, vocabulary; gloo on CPU, NCCL on "
                        "CUDA with one GPU per rank); bytebound starts them itself, or runs as a rank under torchrun")
    p.add_argument("--pipeline-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="plain decoding: launch each step before the host reads the previous token, so the GPU "
                        "need not wait for the per-token host work (same tokens; default: on with CUDA and one "
                        "process, off on CPU and with --tensor-parallel-size > 1)")


def engine_config(a, mtp_steps_used: bool = False):
    """The EngineConfig of a parsed command line (:func:`add_engine_args`). ``mtp_steps_used``: the command reads
    ``--speculative-num-steps`` and ``--speculative-draft-vocab`` without NEXTN itself (bench ablation's +mtp
    step), so giving them is not pointless.

    Raises:
        ConfigError: contradictory or out-of-range flags (a flag that needs NEXTN given without it, a bad
            ``--speculative-num-steps`` / ``--speculative-num-draft-tokens`` pair, a deprecated per-op flag
            against ``--backend``).
    """
    from bytebound.engine.engine import EngineConfig
    from bytebound.errors import ConfigError
    steps = 0
    draft = a.speculative_num_draft_tokens
    if a.speculative_algorithm == "NEXTN":
        steps = spec_steps(a)
        if steps < 1:
            raise ConfigError(f"--speculative-num-steps must be >= 1 with NEXTN, got {steps}")
        if draft is not None and draft != steps + 1:       # not given: it follows --speculative-num-steps
            raise ConfigError("--speculative-num-draft-tokens must equal --speculative-num-steps + 1 (chain, top-k 1)")
    else:
        given = [flag for flag, v in (("--speculative-num-steps", None if mtp_steps_used else a.speculative_num_steps),
                                      ("--speculative-num-draft-tokens", draft)) if v is not None]
        if given:           # like --top-p at temperature 0: said, not refused (the flags are harmless without MTP)
            print(f"[bytebound] note: {' and '.join(given)} {'has' if len(given) == 1 else 'have'} no effect "
                  "without --speculative-algorithm NEXTN (MTP is off)", file=sys.stderr)
    from bytebound.runner.plan import parse_backend_specs
    backends = parse_backend_specs(getattr(a, "backend", None) or [])
    for op, flag in OP_FLAGS.items():           # the deprecated per-op flags: one more way to say --backend op=
        v = getattr(a, f"{op}_backend", None)
        if v and backends.get(op, v) != v:
            raise ConfigError(f"{flag} {v} contradicts --backend {op}={backends[op]}; give one of them")
        if v:
            backends[op] = v
    if (a.spec_static_round is True or backends.get("round") == "static") and a.speculative_algorithm != "NEXTN":
        raise ConfigError("--spec-static-round (--backend round=static) needs --speculative-algorithm NEXTN")
    if a.speculative_draft_vocab not in (None, "", "0") and a.speculative_algorithm != "NEXTN" \
            and not mtp_steps_used:     # (bench ablation: its +mtp step turns MTP on and takes the draft vocabulary)
        raise ConfigError("--speculative-draft-vocab needs --speculative-algorithm NEXTN")
    if getattr(a, "speculative_adaptive", False) and a.speculative_algorithm != "NEXTN":
        raise ConfigError("--speculative-adaptive needs --speculative-algorithm NEXTN")
    adaptive = {}
    if hasattr(a, "speculative_adaptive"):
        adaptive = dict(speculative_adaptive=a.speculative_adaptive, adaptive_window=a.adaptive_window,
                        adaptive_margin=a.adaptive_margin, adaptive_probe_every=a.adaptive_probe_every,
                        adaptive_probe_max=a.adaptive_probe_max, adaptive_probe_rounds=a.adaptive_probe_rounds)
    cpu_compile = getattr(a, "cpu_compile", False)
    if cpu_compile and a.device == "cpu":       # the command line keeps inductor's kernels across reboots
        from bytebound.runner.cpu_compile import use_persistent_cache
        use_persistent_cache()
    return EngineConfig(model=a.model, device=a.device, dtype=a.dtype,
                        lm_head="fp32" if a.enable_fp32_lm_head else a.lm_head, backends=backends,
                        allow_fallback=a.allow_fallback, speculative_steps=steps, max_model_len=a.max_model_len,
                        load_format=a.load_format, enforce_eager=a.enforce_eager,
                        cpu_compile=cpu_compile,
                        spec_static_round=a.spec_static_round, kv_buckets=a.decode_kv_buckets,
                        fused_router=a.fused_router, fused_norm=a.fused_norm,
                        fused_shared=a.fused_shared_expert, fused_router_gemv=a.fused_router_gemv,
                        tensor_parallel_size=a.tensor_parallel_size, draft_vocab=a.speculative_draft_vocab,
                        pipeline_decode=getattr(a, "pipeline_decode", None), **adaptive)


def print_fallbacks(engine) -> None:
    for r in engine.plan.fallbacks():
        print(f"[bytebound] FALLBACK op={r.op}: requested {r.fallback_from!r}, running {r.resolved!r} ({r.reason})",
              file=sys.stderr)


def cmd_generate(a) -> int:
    from bytebound.engine.engine import Engine
    from bytebound.errors import RequestError
    from bytebound.sampling import SamplingParams
    # request values first: a bad one is reported before the model loads
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=tuple(a.stop or ()))
    prompt = a.prompt
    if a.prompt_ids is not None:
        try:
            prompt = [int(t) for t in a.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise RequestError(f"--prompt-ids must be integers separated by commas or spaces, got {a.prompt_ids!r}")
        if not prompt:
            raise RequestError("--prompt-ids is empty")
        if a.chat:
            print("[bytebound] note: --chat has no effect with --prompt-ids (token ids go in as given; the chat "
                  "template wraps --prompt text)", file=sys.stderr)
    # a shell's plain quotes keep "\n" as a backslash and an n: say so, since a stop string of those two characters
    # seldom matches and a prompt with them is not the format the bundled model learned (the text is used as given)
    for flag, text in [("--prompt", a.prompt)] + [("--stop", s) for s in a.stop or ()]:
        if isinstance(text, str) and ("\\n" in text or "\\t" in text) and "\n" not in text:
            print(f"[bytebound] note: {flag} {text!r} holds a backslash and a letter, not a newline or tab (used as "
                  f"given); in bash write {flag} $'...\\n...' for a real newline", file=sys.stderr)
    if params.temperature == 0 and (a.top_p != 1.0 or a.top_k not in (0, -1) or a.seed is not None):
        print("[bytebound] note: --temperature 0 is greedy decoding; --top-p/--top-k/--seed have no effect "
              "(give --temperature > 0 to sample)", file=sys.stderr)
    eng = Engine(engine_config(a))
    print_fallbacks(eng)
    out = None
    for chunk in eng.stream(prompt, params, chat=a.chat):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        out = chunk.output or out
    print()
    if eng.tokenizer is None:          # dummy weights: no text to show, so the ids
        print("token ids:", " ".join(map(str, out.token_ids)))
    msg = (f"[{out.completion_tokens} tokens, finish={out.finish_reason}, TTFT {out.ttft_s * 1e3:.1f} ms, "
           f"TPOT {out.tpot_s * 1e3:.2f} ms, decode {out.decode_tok_s:.1f} tok/s")
    if out.spec:
        msg += f", accept length {out.spec['accept_length']:.2f}"
        ad = out.spec.get("adaptive")
        if ad:
            msg += (f", adaptive: {ad['plain_steps']} plain steps, {ad['rounds']} rounds, ended {ad['mode']}"
                    f" ({ad['reason']})")
    print(msg + "]", file=sys.stderr)
    return 0


# What the demo's answer line means for the bundled model: its greedy GSM8K exact match is the model card's
# (models/ling-nano/README.md, "Measured quality": 8 / 400 = 2.0 %); tests/test_first_run.py checks the card still
# says so.
DEMO_MODEL_NOTE = ("note: the bundled 21 MB model answers about 2 % of GSM8K correctly (models/ling-nano/README.md); "
                   "the demo shows the engine, not the model's quality")


def cmd_demo(a) -> int:
    """Answer one GSM8K test question with the bundled model: print the answer, the gold and the speed. On a
    CPU it compiles the decode step by default (``--cpu-compile`` auto)."""
    from dataclasses import replace

    from bytebound.data.gsm8k import FEW_SHOT_STOP, answers_match, extract_answer, few_shot_prompt, load_split
    from bytebound.engine.engine import Engine
    from bytebound.sampling import SamplingParams
    from bytebound.errors import RequestError
    test = load_split("test")
    if not 0 <= a.index < len(test):
        raise RequestError(f"--index must be in [0, {len(test) - 1}], got {a.index}")
    rec = test[a.index]
    # no start-up compile: the spans this answer reaches are compiled below (the 5-shot prompt's steps start past
    # the first 512 slots, which would be compiled for nothing)
    eng = Engine(replace(engine_config(a), cpu_compile_warmup=False))
    print_fallbacks(eng)
    if eng.tokenizer is None:      # the demo's prompt is text: say so before showing the question
        why = "--load-format dummy has none" if a.load_format == "dummy" else f"no tokenizer.json in {a.model}"
        raise RequestError(f"demo needs the checkpoint's tokenizer ({why}); for random weights use "
                           "generate --load-format dummy --prompt-ids 1,2,3")
    print(f"GSM8K test #{a.index}: {rec['question']}\n")
    if a.format == "chat":
        prompt, stop, chat = rec["question"], (), True
    else:
        prompt, stop, chat = few_shot_prompt(rec["question"]), FEW_SHOT_STOP, False
    params = SamplingParams(max_tokens=a.max_tokens, stop=stop)
    from bytebound.runner.cpu_compile import CompiledDecode
    if isinstance(eng.runner.graph, CompiledDecode):
        # compile the spans this answer's steps reach now (only those), not mid-answer inside its TPOT
        n = len(eng.encode_prompt(prompt, chat=chat))
        if n < eng.runner.max_len:
            eng.runner.graph.precompile(n, min(n + a.max_tokens, eng.runner.max_len) - 1)
    out = None
    for chunk in eng.stream(prompt, params, chat=chat):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        out = chunk.output or out
    pred = extract_answer(out.text)
    ok = answers_match(pred, rec["final"])
    print(f"\n\nanswer: {pred}   gold: {rec['final']}   {'correct' if ok else 'wrong'}")
    if Path(a.model).resolve() == DEFAULT_MODEL.resolve():
        print(DEMO_MODEL_NOTE)
    spec = f", accept length {out.spec['accept_length']:.2f}" if out.spec else ""
    print(f"{out.completion_tokens} tokens, prompt {out.prompt_tokens} tokens, TTFT {out.ttft_s * 1e3:.0f} ms, "
          f"TPOT {out.tpot_s * 1e3:.1f} ms, decode {out.decode_tok_s:.1f} tok/s{spec} ({a.device})")
    return 0


def main(argv=None) -> int:
    from bytebound import __version__
    from bytebound.helptext import plain_doc
    ap = argparse.ArgumentParser(prog="bytebound", description=plain_doc(__doc__))
    ap.add_argument("--version", action="version", version=f"bytebound {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as token ids, e.g. '1,2,3' (needed with --load-format dummy: "
                                          "random weights come without a tokenizer)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (the default) is greedy, where --top-p/--top-k/--seed do nothing")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default 0: off)")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: a fresh one per run)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.set_defaults(fn=cmd_generate)
    d = sub.add_parser("demo", help="answer a GSM8K test question with the bundled model, print answer and speed")
    add_engine_args(d, cpu_compile="auto")
    d.add_argument("--index", type=int, default=0, help="GSM8K test question index, 0-1318 (default 0)")
    d.add_argument("--format", default="chat", choices=["chat", "5shot"],
                   help="chat: the question in the chat template; 5shot: the benchmark's five-exemplar prompt "
                        "(default chat)")
    d.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    d.set_defaults(fn=cmd_demo)
    import importlib
    for mod in ("bytebound.analysis.cli", "bytebound.verify.cli", "bytebound.bench.cli", "bytebound.server.cli"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:   # a subcommand module not written yet; real import errors propagate
            if e.name is None or not mod.startswith(e.name):
                raise
            continue
        m.add_parser(sub)
    # a missing command is reported by its metavar (else by its dest, "cmd"): name the commands instead
    sub.metavar = "{" + ",".join(sub.choices) + "}"
    a = ap.parse_args(argv)
    from bytebound.errors import ByteboundError
    try:
        if getattr(a, "tensor_parallel_size", 1) != 1:
            return _parallel(a, sys.argv[1:] if argv is None else list(argv))
        return a.fn(a)
    except ByteboundError as e:          # a named, expected failure: one clear line, no traceback
        print(f"bytebound: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except OSError as e:                 # a path the user gave that cannot be read or written (names the path)
        print(f"bytebound: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


# Commands that run SPMD under tensor parallelism: every rank runs the same command, rank 0 decides and prints.
TP_COMMANDS = ("generate", "verify", "demo")


def _parallel(a, argv: list[str]) -> int:
    """``--tensor-parallel-size N``: as a rank under torchrun (``WORLD_SIZE`` set), join the group and run the
    command; otherwise start N ranks of this command line (``bytebound.parallel.launch``) and return rank 0's
    exit status. The other ranks' stdout and stderr are discarded."""
    import os
    import tempfile
    from bytebound.errors import ConfigError
    from bytebound.parallel import current_group, init_from_env, launch
    n = a.tensor_parallel_size
    if n < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {n}")
    if a.cmd not in TP_COMMANDS:
        raise ConfigError(f"--tensor-parallel-size > 1 is available for {', '.join(TP_COMMANDS)}; "
                          f"not yet for {a.cmd}")
    if current_group() is not None or "WORLD_SIZE" in os.environ:
        tp = init_from_env(a.device)
        if tp.world != n:
            raise ConfigError(f"--tensor-parallel-size {n} but WORLD_SIZE is {tp.world}")
        if tp.rank:        # rank 0 prints; a follower's failure reaches the launcher as an exception
            sys.stdout = sys.stderr = open(os.devnull, "w")
        return a.fn(a)
    with tempfile.TemporaryDirectory() as d:
        rc_file = os.path.join(d, "rc")
        launch(_rank_main, n, (argv, rc_file), device=a.device)
        try:
            with open(rc_file) as f:
                return int(f.read())
        except (OSError, ValueError):
            return 1


def _rank_main(rank: int, argv: list[str], rc_file: str) -> None:
    rc = main(argv)
    if rank == 0:
        with open(rc_file, "w") as f:
            f.write(str(rc))


if __name__ == "__main__":
    sys.exit(main())
