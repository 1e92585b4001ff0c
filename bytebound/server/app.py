"""OpenAI-compatible FastAPI app over one batch-1 :class:`~bytebound.engine.engine.Engine`.

Concurrency model: one worker thread owns the engine (a single-thread executor); requests wait in an
``asyncio.Queue`` and a dispatcher coroutine hands them to the worker one at a time. With ``max_queue`` requests
waiting whose clients are still there, a new one gets 429 (``Retry-After: 1``); a client that leaves while queued
frees its place at once. A closing or broken worker answers 503. The worker checks the request's
cancel flag between streamed tokens, so a client that disconnects (streaming: the SSE generator is cancelled;
non-streaming: a watcher polls ``request.is_disconnected()``) stops its generation at the next token; such a
request is logged as cancelled (the access line, written when the response starts, says only ``200``) and counted
in ``bytebound_requests_cancelled_total{reason}``.
Nothing heavy runs on the event loop, so one client's large request never stalls ``/health`` or another
client's stream: the body is read with its size bounded (413 at once when ``Content-Length`` is over the limit);
JSON parsing, validation, chat templating and tokenisation run in a small thread pool (the tokenizer releases
the GIL there: :meth:`~bytebound.engine.tokenizer.Tokenizer.encode_releasing_gil`); generation runs on the
engine thread. A prompt over ``max_prompt_chars`` characters is refused before it is tokenised (400
``prompt_too_long``): by default ``max_model_len x PROMPT_CHARS_PER_TOKEN``, a bound no prompt that fits the
context comes near. The body limit follows from it (``BODY_BYTES_PER_CHAR`` JSON bytes per prompt character
plus ``BODY_SLACK``, at most ``MAX_BODY``), which also bounds ``json.loads``: it holds the GIL for its whole run,
in the pool or not.
Shutdown (:func:`make_server`, SIGINT/SIGTERM) gives the requests in flight a grace period, then cancels them:
streams end with a ``cancelled`` error event, others get 503.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming SSE and not, with the final
usage chunk when ``stream_options.include_usage``), ``GET /v1/models``, ``/health``, ``/metrics``
(Prometheus), ``/server_info`` (the start-up manifest and engine config), ``GET /v1/models/{id}`` (the served model's
card; 404 for another id).

Metrics (``/metrics``): every error response is counted in ``bytebound_request_errors_total{status, reason}``
(``reason``: the error's code, else the parameter it names, else ``invalid_request``), also the error events of
streams that had begun; ``bytebound_requests_rejected_total`` keeps counting the 429/503 refusals.

Request rules: malformed JSON, wrong types, text that is not valid Unicode (a lone UTF-16 surrogate in the
prompt, a message or a stop string: ``invalid_unicode``, naming the field), out-of-range sampling values,
``n``/``best_of`` other than 1, unsupported features (``prompt_logprobs``, echo, penalties, tools; vLLM's and
SGLang's sampling extensions ``min_tokens``, ``min_p``, ``typical_p``, ``include_stop_str_in_output``,
``skip_special_tokens`` false, ``min_new_tokens``, ``allowed_token_ids``, ``bad_words``, ``logits_processors``,
``truncate_prompt_tokens``, ``stop_regex``, beam search, guided / structured output; for chat
``add_generation_prompt`` false, ``continue_final_message``, ``chat_template`` and its kwargs; each at any value but
the neutral one) and prompts that do not fit ``max_model_len`` get 400 before queueing; an unknown model gets 404,
a request without ``model`` is for the served one. Extensions: ``top_k``, ``seed``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` (non-streaming: ``choices[0].token_ids``; streaming, as vLLM: every
chunk's choice carries the ids of that chunk, a chunk is sent for new ids even when their text is empty, and the
chunks' ids concatenated are the non-streaming ``token_ids``).
``usage.completion_tokens`` is the number of tokens whose text is returned (stop strings and EOS excluded).

Logprobs, in OpenAI's formats: completions take ``logprobs`` k (an int in [0, 20]; ``choices[0].logprobs`` =
``{tokens, token_logprobs, top_logprobs, text_offset}``, ``top_logprobs`` a list of ``{token: logprob}`` with the k
most likely tokens and the chosen one (the chosen one alone for k = 0, as vLLM); ``text_offset`` the character offset
of each token's text in the completion); chat takes ``logprobs: true`` and ``top_logprobs`` k (an int in [0, 20], a
400 without ``logprobs: true``; ``choices[0].logprobs = {content: [{token, logprob, bytes, top_logprobs: [{token,
logprob, bytes}]}]}``). Streamed, each chunk carries the records of the tokens whose text it carries (offsets relative
to the whole completion), and the chunks' records concatenated are the non-streamed ones. Values: natural-log
``log_softmax`` of the raw float32 logits (before temperature / top-k / top-p, vLLM's default ``raw_logprobs``), -inf
sent as -9999.0 as vLLM does; a token's string is its own decode (a token inside a multi-byte character decodes to
U+FFFD), ``bytes`` its UTF-8 bytes; without a tokenizer ``token_id:N``. A logprobs request decodes without MTP
speculation (the same tokens as plain decoding).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from bytebound.errors import RequestError
from bytebound.sampling import MAX_LOGPROBS, MAX_TOKENS_LIMIT, SamplingParams

log = logging.getLogger("bytebound.server")
MAX_BODY = 16 << 20                 # the largest body limit, whatever max_prompt_chars says
# Longest prompt (characters) accepted per token of max_model_len. English text averages about 4 characters per
# token and code fewer; the longest token of the ling-nano vocabulary has 16. 32 refuses only text that cannot
# fit, at no tokenisation cost; an operator with unusual text raises --max-prompt-chars.
PROMPT_CHARS_PER_TOKEN = 32
# JSON bytes one prompt character may take: "\uXXXX\uXXXX" (a surrogate pair, as ensure_ascii clients write an
# emoji) is 12 bytes for one Python character.
BODY_BYTES_PER_CHAR = 12
BODY_SLACK = 1 << 20                # the rest of the body (sampling fields, chat roles) on top of the prompt
# Deepest JSON nesting a request may have (the API's own bodies nest 4 levels). Checked before ``json.loads``, whose
# own limit is the process's recursion limit: torch.compile (``serve --cpu-compile``) raises that to 2000, so
# without this check the same body is refused or accepted depending on what the process compiled before.
MAX_JSON_DEPTH = 256
_JSON_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')   # a whole string literal (skipped) or a bracket
# json.loads joins a "\uD83D\uDE00" pair into one character, so a surrogate code point left in a parsed string is
# a lone one: not Unicode text, and the tokenizer refuses it with a bare TypeError
_SURROGATE = re.compile("[\ud800-\udfff]")
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class APIError(Exception):
    """An error with its HTTP status, rendered in the OpenAI error format."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = \
            status, message, type_, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


# ---- metrics ------------------------------------------------------------------------------------------------
class Metrics:
    """Prometheus metrics in the app's own registry (several apps may live in one process)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("bytebound_time_to_first_token_seconds", "Time to first token (engine, no queue)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("bytebound_time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("bytebound_e2e_request_latency_seconds", "Request latency incl. queueing",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("bytebound_queue_time_seconds", "Time a request waited for the engine",
                                    buckets=E2E_BUCKETS, registry=r)
        self.accept = Histogram("bytebound_spec_accept_length_per_request", "MTP accept length per request",
                                buckets=(1, 1.25, 1.5, 1.75, 2, 2.25, 2.5, 2.75, 3, 3.25, 3.5, 3.75, 4, 5, 6, 8),
                                registry=r)
        self.accept_avg = Gauge("bytebound_spec_accept_length", "Cumulative MTP accept length (committed tokens "
                                "per verify round since start; 0 without MTP)", registry=r)
        self.prompt_tokens = Counter("bytebound_prompt_tokens", "Prompt tokens processed", registry=r)
        self.gen_tokens = Counter("bytebound_generation_tokens", "Tokens generated and returned", registry=r)
        self.requests = Counter("bytebound_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("bytebound_requests_rejected", "Requests refused before queueing", ["reason"],
                                registry=r)
        self.errors = Counter("bytebound_request_errors", "Error responses (every 4xx and 5xx) and error events "
                              "of begun streams, by HTTP status and reason (the error code, else the parameter "
                              "at fault)", ["status", "reason"], registry=r)
        self.cancelled = Counter("bytebound_requests_cancelled", "Requests that ended before their output was "
                                 "complete: client_disconnected | shutdown", ["reason"], registry=r)
        self.queued = Gauge("bytebound_num_queued_requests", "Requests waiting for the engine", registry=r)
        self.running = Gauge("bytebound_num_running_requests", "Requests on the engine (0 or 1)", registry=r)
        # adaptive speculation (speculative.adaptive; set by sync_adaptive, absent values are NaN)
        self.adaptive_mode = Gauge("bytebound_spec_adaptive_mode", "Adaptive speculation: 1 for the current mode "
                                   "(mtp | plain | probe | calibrate)", ["mode"], registry=r)
        self.adaptive_a = Gauge("bytebound_spec_adaptive_accept_length", "Adaptive speculation: accept length a "
                                "(committed tokens per round) at the last decision", registry=r)
        self.adaptive_c = Gauge("bytebound_spec_adaptive_round_cost", "Adaptive speculation: round cost c (round "
                                "time / plain decode step time) at the last decision", registry=r)
        self.adaptive_s = Gauge("bytebound_spec_adaptive_speedup", "Adaptive speculation: a / c at the last "
                                "decision (MTP pays above 1)", registry=r)
        self.adaptive_switches = Counter("bytebound_spec_adaptive_switches", "Adaptive speculation: switches to "
                                         "plain decoding (fallbacks, failed probes) and back to MTP", ["to"],
                                         registry=r)
        self.adaptive_plain = Counter("bytebound_spec_adaptive_plain_steps", "Adaptive speculation: tokens "
                                      "decoded by plain steps", registry=r)
        self.adaptive_probes = Counter("bytebound_spec_adaptive_probes", "Adaptive speculation: probes (MTP "
                                       "rounds tried while decoding plainly)", registry=r)
        self._synced: dict = {}
        self._sync_lock = threading.Lock()

    def sync_adaptive(self, ctrl) -> None:
        """Copy an ``AdaptiveSpeculation``'s state into the adaptive gauges and counters (counters advance by
        what changed since the last sync). Any thread."""
        st = ctrl.state()
        dec = st["last_decision"] or {}
        nan = float("nan")
        with self._sync_lock:
            for mode in ("mtp", "plain", "probe", "calibrate"):
                self.adaptive_mode.labels(mode).set(1.0 if st["mode"] == mode else 0.0)
            for g, key in ((self.adaptive_a, "accept_length"), (self.adaptive_c, "round_cost"),
                           (self.adaptive_s, "speedup")):
                v = dec.get(key)
                g.set(nan if v is None else v)
            for key, counter in (("to_plain", self.adaptive_switches.labels("plain")),
                                 ("to_mtp", self.adaptive_switches.labels("mtp")),
                                 ("plain_steps", self.adaptive_plain), ("probes", self.adaptive_probes)):
                delta = st[key] - self._synced.get(key, 0)
                if delta > 0:
                    counter.inc(delta)
                self._synced[key] = st[key]

    def error(self, e: "APIError") -> None:
        """Count one error answer; the reason's values are the fixed codes and parameter names of this module,
        so the label set stays small."""
        self.errors.labels(str(e.status), e.code or e.param or "invalid_request").inc()


# ---- the worker -----------------------------------------------------------------------------------------------
@dataclass(eq=False)          # identity: jobs are kept in a set (EngineWorker.waiting)
class Job:
    """One request on its way through the queue and the worker; events flow back through ``events``."""
    rid: str
    ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.perf_counter)
    why: str | None = None            # why it was cancelled early: client_disconnected | shutdown

    def post(self, kind: str, payload=None) -> None:
        """From any thread: queue ``(kind, payload)`` for the handler (``chunk`` | ``error`` | ``cancelled``)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:      # loop closed: nobody is listening any more
            pass


class EngineWorker:
    """The engine's owner: one thread, fed one job at a time from a bounded asyncio queue."""

    def __init__(self, engine, max_queue: int, metrics: Metrics):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="bytebound-engine")
        self.queue: asyncio.Queue | None = None
        # the jobs in the queue; those whose client left (cancel set) still sit in it until the dispatcher reaches
        # them, and count neither towards max_queue nor as queued
        self.waiting: set[Job] = set()
        self.task: asyncio.Task | None = None
        self.current: Job | None = None
        self.closing = False
        self.served = 0

    async def start(self) -> None:
        self.queue = asyncio.Queue()         # bounded by live_queued() in submit, not by its length
        self.task = asyncio.create_task(self._dispatch(), name="bytebound-dispatch")

    def healthy(self) -> str | None:
        """None when serving, else why not."""
        if self.closing:
            return "shutting down"
        if self.task is None:
            return "not started"
        if self.task.done():
            return "dispatcher stopped"
        return None

    def submit(self, job: Job) -> None:
        why = self.healthy()
        if why:
            self.metrics.rejected.labels("unavailable").inc()
            raise APIError(503, f"server unavailable: {why}", "server_error", code="unavailable")
        if self.live_queued() >= self.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, f"the request queue is full ({self.max_queue} waiting); retry later",
                           "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        if len(self.waiting) >= 2 * self.max_queue:
            self._drop_cancelled()
        self.queue.put_nowait(job)
        self.waiting.add(job)
        self.metrics.queued.set(self.live_queued())

    def live_queued(self) -> int:
        """Jobs waiting for the engine whose client is still there (``max_queue`` bounds these, ``/server_info``
        and the ``queued`` gauge report them): a client that gave up while queued frees its place at once."""
        return sum(not j.cancel.is_set() for j in self.waiting)

    def _drop_cancelled(self) -> None:
        """Take the cancelled jobs out of the queue (on the loop), so clients that connect and leave while a long
        generation runs cannot grow it without bound; each gets its ``cancelled`` event as the dispatcher would."""
        keep = []
        while not self.queue.empty():
            job = self.queue.get_nowait()
            if job.cancel.is_set():
                self.waiting.discard(job)
                self._retire_cancelled(job)
            else:
                keep.append(job)
        for job in keep:
            self.queue.put_nowait(job)

    def _retire_cancelled(self, job: Job) -> None:
        """A queued job whose client left: counted as cancelled and told so, never run."""
        self.metrics.requests.labels("cancelled").inc()
        job.post("cancelled")

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            job = await self.queue.get()
            self.waiting.discard(job)
            self.metrics.queued.set(self.live_queued())
            if job.cancel.is_set():                  # its client left while it waited
                self._retire_cancelled(job)
                continue
            self.current = job
            try:
                await loop.run_in_executor(self.executor, self._run, job)
            except asyncio.CancelledError:
                job.cancel.set()
                raise
            except Exception:                        # _run reports its own errors; this is a bug guard
                log.exception("worker failed on %s", job.rid)
            finally:
                self.current = None

    def _run(self, job: Job) -> None:
        """Worker thread: stream the job through the engine, checking its cancel flag between tokens."""
        m, eng = self.metrics, self.engine
        m.running.set(1)
        m.queue_time.observe(time.perf_counter() - job.created)
        out, finish, sent = None, None, 0
        gen, first = None, None
        try:
            gen = eng.stream(job.ids, job.params)
            for chunk in gen:
                first = chunk.ttft_s if first is None else first
                if job.cancel.is_set():
                    finish = "cancelled"
                    break
                sent += len(chunk.token_ids)
                job.post("chunk", chunk)
                out = chunk.output or out
        except RequestError as e:
            finish = "error"
            job.post("error", APIError(400, str(e)))
        except Exception as e:                       # keep serving: report, count, move on
            finish = "error"
            log.exception("generation failed for %s", job.rid)
            job.post("error", APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error"))
        finally:
            if gen is not None:
                gen.close()
            m.running.set(0)
            self.served += 1
        if finish == "cancelled":
            m.requests.labels("cancelled").inc()
            m.prompt_tokens.inc(len(job.ids))
            m.gen_tokens.inc(sent)
            if first is not None:       # it had a first token (as vLLM counts TTFT): the engine's own measure
                m.ttft.observe(first)
            job.post("cancelled")
        elif finish == "error":
            m.requests.labels("error").inc()
        elif out is not None:
            m.requests.labels(out.finish_reason).inc()
            m.prompt_tokens.inc(out.prompt_tokens)
            m.gen_tokens.inc(out.completion_tokens)
            m.ttft.observe(out.ttft_s)
            if out.completion_tokens > 1:
                m.tpot.observe(out.tpot_s)
            m.e2e.observe(time.perf_counter() - job.created)
            if out.spec:
                # committed tokens per verify round: undefined without a round (max_tokens=1, or EOS from the
                # prefill), where to_dict says 0, below any real accept length
                if out.spec["rounds"] > 0:
                    m.accept.observe(out.spec["accept_length"])
                m.accept_avg.set(eng.spec_totals.accept_length)
        if getattr(eng, "adaptive", None) is not None:
            m.sync_adaptive(eng.adaptive)

    def close(self, grace: float) -> None:
        """Shutdown has begun (on the loop, before uvicorn waits for connections): refuse new work and give the
        jobs in flight ``grace`` seconds, then cancel them, so their streams end with a ``cancelled`` event
        instead of holding the shutdown for a whole generation."""
        self.closing = True
        asyncio.get_running_loop().call_later(grace, self.cancel_all)

    def cancel_all(self) -> None:
        """Cancel the queued jobs and the running one (it stops at the next token). Any thread."""
        while self.queue is not None and not self.queue.empty():
            job = self.queue.get_nowait()
            self.waiting.discard(job)
            job.why = job.why or "shutdown"
            job.cancel.set()
            job.post("cancelled")
        job = self.current
        if job is not None:
            job.why = job.why or "shutdown"
            job.cancel.set()

    async def stop(self) -> None:
        """Refuse new work, cancel queued and running jobs, wait for the worker thread (bounded: it stops at
        the next token)."""
        self.closing = True
        self.cancel_all()
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        await asyncio.get_running_loop().run_in_executor(None, lambda: self.executor.shutdown(wait=True))


# ---- request parsing --------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body: dict, key: str, kind: str, default=None):
    """``body[key]`` checked against ``kind`` (int | number | bool | str | list | dict); None -> default."""
    v = body.get(key)
    if v is None:
        return default
    ok = {"int": _is_int, "number": _is_num, "bool": lambda x: isinstance(x, bool), "str": lambda x: isinstance(x, str),
          "list": lambda x: isinstance(x, list), "dict": lambda x: isinstance(x, dict)}[kind](v)
    if not ok:
        raise APIError(400, f"'{key}' must be {'an' if kind[0] in 'ai' else 'a'} {kind}, got {type(v).__name__}",
                       param=key)
    return v


def _is_num_equal(x):
    """A check that holds for a JSON number equal to ``x`` (not a bool: ``False == 0`` in Python)."""
    return lambda v: _is_num(v) and v == x


def _reject_unsupported(body: dict, chat: bool) -> None:
    checks = [("n", lambda v: v == 1), ("best_of", lambda v: v == 1), ("echo", lambda v: v is False),
              ("presence_penalty", lambda v: v == 0), ("frequency_penalty", lambda v: v == 0),
              ("repetition_penalty", lambda v: v == 1), ("logit_bias", lambda v: not v), ("suffix", lambda v: False),
              ("tools", lambda v: not v), ("functions", lambda v: not v),
              ("response_format", lambda v: isinstance(v, dict) and v.get("type") == "text"),
              # vLLM / SGLang extensions this engine does not implement: refused rather than ignored, so a client
              # never gets other sampling or another prompt than it asked for without being told; accepted only at
              # the value that changes nothing, of its own type (False is not 0 here)
              ("min_tokens", _is_num_equal(0)), ("min_new_tokens", _is_num_equal(0)), ("min_p", _is_num_equal(0)),
              ("typical_p", _is_num_equal(1)), ("length_penalty", _is_num_equal(1)),
              ("include_stop_str_in_output", lambda v: v is False), ("skip_special_tokens", lambda v: v is True),
              ("spaces_between_special_tokens", lambda v: v is True), ("no_stop_trim", lambda v: v is False),
              ("use_beam_search", lambda v: v is False), ("prompt_logprobs", lambda v: False),
              ("allowed_token_ids", lambda v: False), ("bad_words", lambda v: v == []),
              ("logits_processors", lambda v: v == []), ("truncate_prompt_tokens", lambda v: False),
              ("stop_regex", lambda v: v == []), ("guided_json", lambda v: False),
              ("guided_regex", lambda v: False), ("guided_choice", lambda v: False),
              ("guided_grammar", lambda v: False), ("structured_outputs", lambda v: False),
              ("regex", lambda v: False), ("json_schema", lambda v: False), ("ebnf", lambda v: False)]
    if chat:        # the chat template's controls: the server always renders the model's own template
        checks += [("add_generation_prompt", lambda v: v is True), ("continue_final_message", lambda v: v is False),
                   ("chat_template", lambda v: False), ("chat_template_kwargs", lambda v: v == {})]
    for key, fine in checks:
        v = body.get(key)
        if v is not None and not fine(v):
            raise APIError(400, f"'{key}'={v!r} is not supported by this server", param=key)


def _float(body: dict, key: str, default: float) -> float:
    try:
        return float(_get(body, key, "number", default))
    except OverflowError:                            # a JSON integer too big for a float
        raise APIError(400, f"'{key}' is out of range", param=key) from None


def _sampling(body: dict, chat: bool, prompt_len: int, engine) -> SamplingParams:
    _reject_unsupported(body, chat)
    room = engine.max_new_tokens(prompt_len)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    given = body.get(key) is not None
    mt = _get(body, key, "int", None if chat else 16)
    if mt is None:          # chat without a limit: whatever fits; a prompt that leaves no room is reported below
        mt = min(max(room, 1), MAX_TOKENS_LIMIT)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
    for i, s in enumerate(stop or ()):              # a lone surrogate would never match the decoded text
        _check_unicode(s, f"stop[{i}]", "stop")
    ids = _get(body, "stop_token_ids", "list", [])
    if not all(_is_int(i) for i in ids):
        raise APIError(400, "'stop_token_ids' must be a list of ints", param="stop_token_ids")
    vocab = engine.model.cfg.vocab_size
    if any(not 0 <= i < vocab for i in ids):         # the engine would never sample them: silently ignored
        raise APIError(400, f"stop token ids must be in [0, {vocab})", param="stop_token_ids")
    logprobs = _logprobs(body, chat)
    try:
        p = SamplingParams(max_tokens=mt, temperature=_float(body, "temperature", 1.0),
                           top_p=_float(body, "top_p", 1.0), top_k=_get(body, "top_k", "int", 0),
                           seed=_get(body, "seed", "int", None), stop=tuple(stop or ()),
                           stop_token_ids=tuple(ids), ignore_eos=_get(body, "ignore_eos", "bool", False),
                           logprobs=logprobs)
    except RequestError as e:
        # validate names the field; max_tokens is reported under the key the client used (chat's top_logprobs
        # range is checked in _logprobs, so a logprobs error here is completions' own logprobs key)
        raise APIError(400, str(e), param=key if e.param == "max_tokens" else e.param) from None
    if mt > room:           # the prompt alone overflows (its fault) or with max_tokens (the limit's fault)
        head = (f"this model's maximum context length is {engine.runner.max_len} tokens; the prompt has "
                f"{prompt_len} tokens")
        if room < 1:        # = prompt_len > max_len (engine.max_new_tokens): no max_tokens could help
            raise APIError(400, f"{head}, so the prompt itself does not fit; shorten it",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        limit = f" and {key} is {mt}{'' if given else ' (the default)'}" if given or not chat else ""
        raise APIError(400, f"{head}{limit} (room for at most {room} new "
                       f"tokens{' with MTP draft slots' if engine.config.speculative_steps else ''})",
                       param=key, code="context_length_exceeded")
    return p


def _logprobs(body: dict, chat: bool) -> int | None:
    """``SamplingParams.logprobs``: completions' ``logprobs`` k (int or null; its range is
    :meth:`SamplingParams.validate`'s); chat's ``logprobs`` (bool) with ``top_logprobs`` k (int in [0, 20] or null,
    default 0), as OpenAI's API has them. APIError 400: a wrong type; chat's ``top_logprobs`` out of range or without
    ``logprobs: true`` (OpenAI and vLLM refuse it); ``top_logprobs`` on completions (its field is ``logprobs``)."""
    if not chat:
        if body.get("top_logprobs") is not None:
            raise APIError(400, "'top_logprobs' is a chat field: completions take 'logprobs': k", param="top_logprobs")
        return _get(body, "logprobs", "int", None)
    on, k = _get(body, "logprobs", "bool", False), _get(body, "top_logprobs", "int", None)
    if k is not None and not on:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if k is not None and not 0 <= k <= MAX_LOGPROBS:        # said here: validate would name 'logprobs'
        raise APIError(400, f"top_logprobs must be an int in [0, {MAX_LOGPROBS}], got {k}", param="top_logprobs")
    return (k or 0) if on else None


def _token_ids(v, vocab: int) -> list[int] | None:
    if isinstance(v, list) and v and all(_is_int(i) for i in v):
        if any(not 0 <= i < vocab for i in v):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(v)
    return None


def _check_unicode(text: str, where: str, param: str) -> None:
    """400 ``invalid_unicode`` when ``text`` (the request field ``where``, e.g. ``messages[1].content``) holds a
    lone UTF-16 surrogate, a ``\\uD800``-``\\uDFFF`` JSON escape without its pair."""
    m = _SURROGATE.search(text)
    if m is not None:
        raise APIError(400, f"{where} is not valid Unicode: it contains a lone UTF-16 surrogate "
                       f"U+{ord(m.group()):04X} at character {m.start()} (a \\u escape without its pair)",
                       param=param, code="invalid_unicode")


def _check_chars(n: int, max_chars: int | None, param: str) -> None:
    """400 ``prompt_too_long`` for an ``n``-character prompt over the limit, before any tokenisation."""
    if max_chars is not None and n > max_chars:
        raise APIError(400, f"the prompt has {n} characters, over this server's limit of {max_chars} "
                       f"(--max-prompt-chars; by default max_model_len x {PROMPT_CHARS_PER_TOKEN}): it is refused "
                       "without tokenising it", param=param, code="prompt_too_long")


def _completion_prompt(body: dict, engine, max_chars: int | None = None) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    ids = _token_ids(p, engine.model.cfg.vocab_size)
    if ids is not None:
        return ids
    if isinstance(p, list):
        raise APIError(400, "'prompt' must be one string or one list of token ids (batched prompts are not "
                       "supported: this is a batch-1 engine)", param="prompt")
    if not isinstance(p, str) or not p:
        raise APIError(400, "'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt")
    _check_chars(len(p), max_chars, "prompt")
    _check_unicode(p, "'prompt'", "prompt")
    if engine.tokenizer is None:
        raise APIError(400, "this engine has no tokenizer (dummy weights): send token ids", param="prompt")
    ids = _encode(engine, p, "prompt")
    if not ids:
        raise APIError(400, "'prompt' encodes to no tokens", param="prompt")
    return ids


def _chat_prompt(body: dict, engine, max_chars: int | None = None) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    if engine.tokenizer is None:
        raise APIError(400, "this engine has no tokenizer (dummy weights): chat is unavailable", param="messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        role = {"developer": "system"}.get(m["role"], m["role"])
        if role not in ("system", "user", "assistant"):
            raise APIError(400, f"messages[{i}].role={m['role']!r} is not supported", param="messages")
        c = m.get("content")
        if isinstance(c, list):
            if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            for j, x in enumerate(c):
                _check_unicode(x["text"], f"messages[{i}].content[{j}].text", "messages")
            c = "".join(x["text"] for x in c)
        elif isinstance(c, str):
            _check_unicode(c, f"messages[{i}].content", "messages")
        if c is None and role == "assistant":
            c = ""
        if not isinstance(c, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        clean.append({"role": role, "content": c})
    _check_chars(sum(len(m["content"]) for m in clean), max_chars, "messages")
    try:
        text = engine.tokenizer.apply_chat_template(clean)
    except ValueError as e:
        raise APIError(400, f"chat template: {e}", param="messages") from None
    return _encode(engine, text, "messages")


def _encode(engine, text: str, param: str) -> list[int]:
    """Tokenise or answer 400 (lone surrogates are refused before, by :func:`_check_unicode`)."""
    try:
        return engine.tokenizer.encode_releasing_gil(text)
    except Exception as e:
        raise APIError(400, f"'{param}' cannot be tokenized: {type(e).__name__}", param=param) from None


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw body, at most ``limit`` bytes; APIError 413 ``body_too_large`` over it (at once when
    ``Content-Length`` says so, else as soon as the bytes read pass it: a huge body is never buffered), 400
    ``client_disconnected`` when the client leaves mid-body (nobody reads the answer)."""
    def too_large(n: str) -> APIError:
        return APIError(413, f"the request body has {n} bytes, over this server's limit of {limit} (it follows "
                        "from --max-prompt-chars)", code="body_too_large")

    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(length)
    chunks, n = [], 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_large(f"over {n}")
            chunks.append(chunk)
    except ClientDisconnect:
        log.warning("client %s left while sending the request body of %s", _peer(request), request.url.path)
        raise APIError(400, "the client disconnected while sending the request body",
                       code="client_disconnected") from None
    return b"".join(chunks)


def _parse_json(raw: bytes) -> dict:
    """The JSON object in ``raw``; APIError 400 ``invalid_json`` when malformed (bad UTF-8, syntax, nesting too
    deep, an integer too long) or not an object."""
    if _nested_deeper_than(raw, MAX_JSON_DEPTH):
        raise APIError(400, f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        body = json.loads(raw)
    except ValueError as e:              # JSONDecodeError, UnicodeDecodeError, int over the digit limit
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the JSON body must be an object", code="invalid_json")
    return body


def _nested_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` opens more than ``limit`` arrays/objects at once (brackets inside string
    literals do not count). Cheap for ordinary bodies: the scan runs only when the body holds more than ``limit``
    opening brackets, and stops at the first level past the limit. Malformed text is left to ``json.loads``."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for m in _JSON_TOKENS.finditer(raw):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif c in (b"]", b"}"):
            depth -= 1
    return False


def _peer(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c else "?"


# ---- responses --------------------------------------------------------------------------------------------
def _usage(out) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


class _Logprobs:
    """A request's logprob records (``engine.TokenLogprob``) in OpenAI's response formats, chunk by chunk: each
    :meth:`chat` / :meth:`completion` call takes the records of the next tokens and keeps the text decoded so
    far, so ``text_offset`` counts from the start of the completion. Token strings are decoded once per id."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.dec = tokenizer.incremental_decoder() if tokenizer is not None else None
        self.chars = 0                      # characters of the completion text completed by the tokens so far
        self.names: dict[int, str] = {}

    def name(self, i: int) -> str:
        s = self.names.get(i)
        if s is None:
            s = self.names[i] = self.tok.decode([i]) if self.tok is not None else f"token_id:{i}"
        return s

    def entry(self, i: int, lp: float) -> dict:
        s = self.name(i)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    def chat(self, recs) -> dict:
        return {"content": [self.entry(r.token_id, r.logprob)
                            | {"top_logprobs": [self.entry(i, lp) for i, lp in r.top]} for r in recs]}

    def completion(self, recs) -> dict:
        offsets = []
        for r in recs:
            offsets.append(self.chars)      # where this token's text starts: after the whole characters before it
            if self.dec is not None:
                self.chars += len(self.dec.decode_stream(r.token_id))
        # the k most likely and, as OpenAI's and vLLM's, always the chosen one (k = 0: the chosen one alone)
        tops = [{self.name(i): _finite(lp) for i, lp in r.top} | {self.name(r.token_id): _finite(r.logprob)}
                for r in recs]
        return {"tokens": [self.name(r.token_id) for r in recs], "token_logprobs": [_finite(r.logprob) for r in recs],
                "top_logprobs": tops, "text_offset": offsets}


def _finite(lp: float) -> float:
    """A logprob JSON can carry: -inf (a masked token; raw logits have none) as -9999.0, as vLLM sends it."""
    return max(lp, -9999.0)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _watch_disconnect(request: Request, job: Job, every: float = 0.1) -> None:
    while not job.cancel.is_set():
        if await request.is_disconnected():
            job.why = job.why or "client_disconnected"
            job.cancel.set()
            return
        await asyncio.sleep(every)


async def _collect(job: Job, request: Request):
    """Wait for the job's RequestOutput, cancelling it if the client goes away."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        while True:
            kind, payload = await job.events.get()
            if kind == "chunk" and payload.output is not None:
                return payload.output
            if kind == "error":
                raise payload
            if kind == "cancelled":
                raise APIError(503, "request cancelled (client disconnected or server shutting down)",
                               "server_error", code="cancelled")
    finally:                          # also when the handler is cancelled (shutdown past its grace period)
        watcher.cancel()
        job.cancel.set()


def create_app(engine, served_model_name: str | None = None, max_queue: int = 64, manifest: dict | None = None,
               max_prompt_chars: int | None = None, max_body_bytes: int | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``. ``served_model_name`` defaults to the checkpoint dir's basename;
    ``max_queue``: requests that may wait for the engine (beyond the one running) before 429.
    ``max_prompt_chars``: longest prompt in characters (the sum of a chat's message contents), refused before
    tokenisation; None = ``max_model_len x PROMPT_CHARS_PER_TOKEN``. ``max_body_bytes``: the request body limit
    in bytes; None = ``BODY_BYTES_PER_CHAR x max_prompt_chars + BODY_SLACK``, at most ``MAX_BODY``.
    Raises ValueError for a limit below 1."""
    from bytebound import __version__ as version
    from bytebound.bench.report import _jsonable, engine_manifest
    name = served_model_name or Path(str(engine.config.model)).name
    if max_prompt_chars is None:
        max_prompt_chars = engine.runner.max_len * PROMPT_CHARS_PER_TOKEN
    if max_body_bytes is None:
        max_body_bytes = min(MAX_BODY, BODY_BYTES_PER_CHAR * max_prompt_chars + BODY_SLACK)
    if max_prompt_chars < 1 or max_body_bytes < 1:
        raise ValueError(f"max_prompt_chars and max_body_bytes must be >= 1, got {max_prompt_chars}, "
                         f"{max_body_bytes}")
    # parsing, templating and tokenising of the requests: off the event loop, two at a time (a burst of large
    # prompts queues here instead of taking every core from the engine thread)
    prep = ThreadPoolExecutor(2, thread_name_prefix="bytebound-prepare")
    metrics = Metrics()
    worker = EngineWorker(engine, max_queue, metrics)
    manifest = manifest if manifest is not None else engine_manifest(engine)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        await worker.start()
        try:
            yield
        finally:
            await worker.stop()
            prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="bytebound", version=version, lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.engine, app.state.served_model_name = worker, metrics, engine, name

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        metrics.error(exc)
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        """Routing errors (unknown path 404, wrong method 405) in the same error shape as the rest."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        e = APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", code=code,
                     headers=exc.headers)
        metrics.error(e)
        return e.response()

    @app.api_route("/health", methods=["GET", "HEAD"])        # HEAD: load balancers' and curl -I's probe
    async def health():
        why = worker.healthy()
        if why:
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return {"status": "ok"}

    def check_model(model: str) -> None:
        """404 ``model_not_found`` unless ``model`` is the served model's name (requests and retrieve-model)."""
        if model != name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {name!r}", param="model",
                           code="model_not_found")

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "bytebound",
                "root": str(engine.config.model), "max_model_len": engine.runner.max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """OpenAI's retrieve-model (``client.models.retrieve``): the served model's card, 404 for another name."""
        check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def prom():
        metrics.queued.set(worker.live_queued())        # clients may have left the queue since the last change
        if engine.drafter is not None:
            metrics.accept_avg.set(engine.spec_totals.accept_length)
        if getattr(engine, "adaptive", None) is not None:
            metrics.sync_adaptive(engine.adaptive)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info():
        acc = engine.spec_totals.accept_length if engine.drafter is not None else None
        return _jsonable({"served_model_name": name, "version": version, "model_path": str(engine.config.model),
                          "max_model_len": engine.runner.max_len, "max_queue": max_queue,
                          "max_prompt_chars": max_prompt_chars, "max_body_bytes": max_body_bytes,
                          "queued": worker.live_queued(),
                          "running": worker.current is not None, "served": worker.served,
                          "engine_config": asdict(engine.config), "avg_spec_accept_length": acc,
                          "internal_states": [{"avg_spec_accept_length": acc}], "manifest": manifest})

    def prepare(raw: bytes, chat: bool) -> tuple[list[int], SamplingParams, bool, bool, bool]:
        """Pool thread: parse and check the body, template and tokenise the prompt ->
        ``(ids, params, stream, include_usage, return_token_ids)``; APIError 4xx on bad input."""
        body = _parse_json(raw)
        # left out: the one model this server serves, as vLLM and SGLang do (OpenAI requires it); a wrong name is 404
        model = body.get("model", name)
        if not isinstance(model, str):
            raise APIError(400, "'model' must be a string (or left out: the served model)", param="model")
        check_model(model)
        ids = (_chat_prompt if chat else _completion_prompt)(body, engine, max_prompt_chars)
        params = _sampling(body, chat, len(ids), engine)
        stream = _get(body, "stream", "bool", False)
        opts = _get(body, "stream_options", "dict", None)
        if opts is not None and not stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
        usage = (opts or {}).get("include_usage")
        if usage is not None and not isinstance(usage, bool):     # "no" must not mean yes
            raise APIError(400, f"'stream_options.include_usage' must be a bool, got {type(usage).__name__}",
                           param="stream_options")
        return ids, params, stream, usage is True, _get(body, "return_token_ids", "bool", False)

    async def handle(request: Request, chat: bool):
        loop = asyncio.get_running_loop()
        raw = await _read_body(request, max_body_bytes)
        ids, params, stream, include_usage, want_ids = await loop.run_in_executor(prep, prepare, raw, chat)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        job = Job(rid, ids, params, loop)
        worker.submit(job)
        now = int(time.time())
        lp = _Logprobs(engine.tokenizer) if params.logprobs is not None else None
        if stream:
            return StreamingResponse(_stream(job, request, chat, include_usage, now, want_ids, lp),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            out = await _collect(job, request)
        except APIError as e:
            if e.code == "cancelled":
                _log_cancelled(request, job, None)
            raise
        lps = None if lp is None else lp.chat(out.logprobs) if chat else lp.completion(out.logprobs)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": lps,
                      "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": lps, "finish_reason": out.finish_reason}
        if want_ids:
            choice["token_ids"] = out.token_ids
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now, "model": name,
                "choices": [choice], "usage": _usage(out),
                # extension with MTP on: accept length, rounds and (adaptive speculation) the mode decisions
                **({"speculative": out.spec} if out.spec else {})}

    def _log_cancelled(request: Request, job: Job, tokens: int | None) -> None:
        """One line and one count for a request that ended before its output was complete (the access line
        uvicorn wrote when the response started says only its status)."""
        why = job.why or "client_disconnected"
        metrics.cancelled.labels(why).inc()
        sent = f" after {tokens} streamed tokens" if tokens is not None else ""
        log.info('%s - "%s %s" %s cancelled (%s)%s, %.2f s', _peer(request), request.method, request.url.path,
                 job.rid, why.replace("_", " "), sent, time.perf_counter() - job.created)

    async def _stream(job: Job, request: Request, chat: bool, include_usage: bool, now: int, want_ids: bool,
                      lp: _Logprobs | None):
        """SSE events of one request. ``want_ids`` (``return_token_ids``): every choice carries ``token_ids``, the
        ids generated since the previous chunk (``[]`` on the role and finish chunks), and new ids are sent even
        when their text is empty (random weights, a partial UTF-8 character, no tokenizer). ``lp`` (logprobs
        asked): each chunk of new ids carries their records (null on the role and finish chunks), and it is sent
        even when its text is empty, so no record is lost."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        complete, tokens = False, 0

        def chunk(text: str | None = None, finish: str | None = None, role: bool = False,
                  ids: list[int] | None = None, recs=None) -> dict:
            lps = None if recs is None else lp.chat(recs) if chat else lp.completion(recs)
            if chat:
                delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
                c = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": lps, "finish_reason": finish}
            if want_ids:
                c["token_ids"] = list(ids or ())
            d = {"id": job.rid, "object": obj, "created": now, "model": name, "choices": [c]}
            if include_usage:
                d["usage"] = None
            return d

        try:
            if chat:
                yield _sse(chunk(role=True))
            while True:
                kind, payload = await job.events.get()
                if kind == "chunk":
                    tokens += len(payload.token_ids)
                    if payload.text or ((want_ids or lp is not None) and payload.token_ids):
                        yield _sse(chunk(payload.text, ids=payload.token_ids, recs=payload.logprobs))
                    if payload.output is not None:
                        yield _sse(chunk(finish=payload.output.finish_reason))
                        if include_usage:
                            yield _sse({"id": job.rid, "object": obj, "created": now, "model": name, "choices": [],
                                        "usage": _usage(payload.output)})
                        break
                elif kind == "error":
                    metrics.error(payload)
                    yield _sse({"error": {"message": payload.message, "type": payload.type, "code": payload.code}})
                    break
                else:
                    job.why = job.why or "shutdown"
                    yield _sse({"error": {"message": "request cancelled (server shutting down)",
                                          "type": "server_error", "code": "cancelled"}})
                    break
            yield "data: [DONE]\n\n"
            complete = job.why is None
        finally:                      # normal end, client disconnect (generator cancelled/closed) or error
            job.cancel.set()
            if not complete:
                _log_cancelled(request, job, tokens)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def bind_socket(host: str, port: int, backlog: int = 2048):
    """A TCP socket bound to ``host:port`` (port 0: one the system picks) and listening (``backlog``, uvicorn's
    default), for ``make_server(...).run(sockets=[sock])``: ``bytebound serve`` makes it before loading the model, so
    a busy port or an unknown host is an error at once. IPv6 for a host with a colon; ``SO_REUSEADDR`` as uvicorn
    sets it (a port in TIME_WAIT is usable, one another server has bound and listens on is not).

    Raises:
        OSError: the host does not resolve or the address cannot be bound (in use, not this machine's, no
            permission)."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        # listening at once: two sockets with SO_REUSEADDR may both bind a port that nobody listens on yet, so a
        # second server would pass the bind and fail after loading its model; connections made during the load
        # wait in the backlog and are served once the server starts
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, timeout_graceful_shutdown: float = 5.0,
                on_started=None, **config):
    """A ``uvicorn.Server`` for ``app`` whose shutdown is prompt: when it begins, the worker refuses new work
    and cancels what is still running ``timeout_graceful_shutdown`` seconds later (plain uvicorn would wait
    for every stream to run to its end). ``on_started(port)``, if given, is called once the socket is bound, with
    the port it is bound to (with ``port`` 0 the system picks it). ``config``: more ``uvicorn.Config`` arguments;
    without a ``log_config`` the server's own lines (cancelled requests, clients leaving mid-body) go to uvicorn's
    handler at its ``log_level``, next to its access lines (otherwise only warnings would reach stderr)."""
    import copy

    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    if "log_config" not in config:
        level = config.get("log_level") or "info"
        log_config = copy.deepcopy(LOGGING_CONFIG)
        log_config["loggers"][log.name] = {"handlers": ["default"], "propagate": False,
                                           "level": level.upper() if isinstance(level, str) else level}
        config["log_config"] = log_config

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_started is not None and self.started and self.servers and self.servers[0].sockets:
                on_started(self.servers[0].sockets[0].getsockname()[1])

        async def shutdown(self, sockets=None):
            app.state.worker.close(timeout_graceful_shutdown)
            await super().shutdown(sockets)

    # uvicorn's own timeout is the backstop (it cuts the connections that still have not closed, e.g. a
    # client that stopped reading); the margin lets cancelled streams end cleanly first.
    return Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=timeout_graceful_shutdown + 2,
                                 **config))
