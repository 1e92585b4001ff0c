"""``bytebound serve``: the OpenAI-compatible server (FastAPI + uvicorn) over one batch-1 engine.

Usage::

    bytebound serve [engine flags] [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]
        [--max-queue 64] [--max-prompt-chars N] [--timeout-graceful-shutdown 5] [--verify [--strict]]
        [--log-level info]

Endpoints: /v1/completions, /v1/chat/completions (SSE streaming or not), /v1/models, /health, /metrics,
/server_info (see :mod:`bytebound.server.app`). The model name is the checkpoint dir's basename unless
``--served-model-name`` is given. On SIGINT/SIGTERM, requests in flight get ``--timeout-graceful-shutdown``
seconds to finish; then they are cancelled (the engine stops at the next token) and the server exits.
FastAPI and uvicorn are imported only by this command.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    from bytebound.cli import add_engine_args
    from bytebound.helptext import plain_doc
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)",
                              description=plain_doc(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 for every interface (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (default 8000)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: checkpoint basename)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for the engine before new ones get 429 (default 64)")
    p.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                   help="longest prompt in characters (chat: all message contents), refused with 400 "
                        "prompt_too_long before tokenising; the body limit follows from it (default: "
                        "--max-model-len x 32)")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=5.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long requests in flight may run on before they are cancelled "
                        "(default 5; without a bound a long generation would hold the shutdown for minutes)")
    p.add_argument("--verify", action="store_true", help="run the start-up canaries (bytebound.verify) first")
    p.add_argument("--strict", action="store_true", help="with --verify: refuse to start when a canary fails")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(fn=cmd_serve)
    return p


def cmd_serve(a) -> int:
    from bytebound.cli import engine_config, print_fallbacks
    from bytebound.engine.engine import Engine
    from bytebound.errors import ByteboundError
    try:
        import uvicorn  # noqa: F401  (checked here to name it in the error)

        from bytebound.server.app import bind_socket, create_app, make_server
    except ImportError as e:
        print(f"[bytebound serve] needs fastapi and uvicorn: {e}", file=sys.stderr)
        return 2
    if a.max_queue < 1:
        print("[bytebound serve] --max-queue must be >= 1", file=sys.stderr)
        return 2
    if not 0 <= a.port <= 65535:
        print(f"[bytebound serve] --port must be in [0, 65535], got {a.port}", file=sys.stderr)
        return 2
    if a.max_prompt_chars is not None and a.max_prompt_chars < 1:
        print("[bytebound serve] --max-prompt-chars must be >= 1", file=sys.stderr)
        return 2
    if not a.timeout_graceful_shutdown >= 0:
        print("[bytebound serve] --timeout-graceful-shutdown must be >= 0", file=sys.stderr)
        return 2
    # the address first: a busy port or an unknown host is found in a moment, not after the model has loaded
    try:
        sock = bind_socket(a.host, a.port)
    except OSError as e:
        print(f"[bytebound serve] cannot listen on {a.host}:{a.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    cfg = engine_config(a)
    if a.verify and hasattr(cfg, "verify"):
        cfg = dataclasses.replace(cfg, verify=True, strict=a.strict)
    try:
        eng = Engine(cfg)
    except (ByteboundError, FileNotFoundError) as e:
        print(f"[bytebound serve] engine did not start: {type(e).__name__}: {e}", file=sys.stderr)
        sock.close()
        return 2
    except KeyboardInterrupt:           # Ctrl-C while the model loads: a quiet exit, the port released
        sock.close()
        print("[bytebound serve] interrupted while loading the model", file=sys.stderr)
        return 130
    print_fallbacks(eng)
    app = create_app(eng, a.served_model_name, a.max_queue, max_prompt_chars=a.max_prompt_chars)
    name = app.state.served_model_name
    res = ", ".join(f"{op}={r.resolved}" for op, r in eng.plan.resolutions.items())

    host = f"[{a.host}]" if ":" in a.host else a.host      # an IPv6 address in a URL goes in brackets

    def banner(port: int) -> None:      # once bound: with --port 0 the port is the one the system picked
        print(f"[bytebound serve] model {name!r} on {eng.device} (kernels: {res}; head path "
              f"{eng.model.lm_head.mode}, MTP steps={eng.config.speculative_steps}); http://{host}:{port}/v1",
              file=sys.stderr, flush=True)
    server = make_server(app, a.host, a.port, a.timeout_graceful_shutdown, on_started=banner, log_level=a.log_level)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:   # uvicorn re-raises the SIGINT it has handled, as uvicorn.run expects
        pass
    finally:                    # a forced exit (second Ctrl-C) skips the app's shutdown: stop the engine thread
        app.state.worker.cancel_all()
    return 0 if server.started else 1
