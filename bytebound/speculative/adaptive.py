"""Adaptive speculation: MTP only while it pays, measured online (issue 21).

An MTP round commits ``a`` tokens (the accept length) and costs ``c`` plain decode steps of wall time (the round
cost), so it speeds decoding up by ``S = a / c``. Both depend on the workload and the machine: with random weights
nothing is accepted (``a = 1``) and every round is a loss of ``c - 1`` steps; on the bundled model ``a`` is about
2.4. :class:`AdaptiveSpeculation` measures both in the running engine and switches between MTP rounds and plain
decode steps at token boundaries:

* **calibrate**: without a measured plain step (engine start, and every ``refresh_rounds`` MTP rounds since the
  last one, as the step cost grows with the context), ``calibration`` plain steps are timed first.
* **mtp**: every round's committed count and wall time go into a window of the last ``window`` rounds. Once the
  window is full and ``a / c < 1 - margin`` over it (``a``: mean committed tokens per round; ``c``: median round
  time / median plain step time), the engine falls back to plain decoding.
* **plain**: plain steps (each timed, so ``c`` stays current) for ``interval`` tokens, then a **probe** of
  ``probe_rounds`` MTP rounds: ``a / c >= 1`` over the probe switches MTP back on (and resets ``interval`` to
  ``probe_every``); otherwise the engine decodes plainly again for twice the interval (at most ``probe_max``), so
  a workload where MTP never pays (random weights) spends ever less time probing.

Times are wall times between the launch of a step and the host read that already ends it: a plain step's sampled
token (``int``), a round's verdict (``tolist``); nothing synchronises the device for the measurement's sake. The
median keeps one slow step (the first after a prefill, a garbage collection) from deciding.

Losslessness: a switch happens between tokens and depends only on what was already generated and how long it
took, never on the next token's random numbers, so each token is still drawn from the target's distribution
(plain steps sample it, rounds use the lossless acceptance rule, ``speculative.accept``) and greedy output equals
plain greedy token for token. The NEXTN draft layer reads the target hidden of every position before it: the
positions decoded plainly are kept as pending NEXTN inputs (token ``t + 1``, target hidden of ``t``) and run
through the NEXTN when MTP resumes (the same draft-extend that seeds the first round after a prefill,
:meth:`StaticRound.seed <bytebound.speculative.round.StaticRound.seed>`); the KDA and MLA target states are those
of committed tokens in both modes (a round commits and rolls back before its tokens leave).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

import torch

import bytebound.runner.runner as runner_mod
from bytebound.errors import ConfigError
from bytebound.sampling import SamplingParams, sample
from bytebound.speculative.mtp import nextn_prefix
from bytebound.speculative.round import StaticRound

MODES = ("calibrate", "mtp", "plain", "probe")


class AdaptiveSpeculation:
    """The engine-lifetime switch between MTP rounds and plain decode steps (see the module docstring).

    Args:
        window: MTP rounds in the decision window (``a`` and the round time are taken over it).
        margin: fall back when ``a / c < 1 - margin`` over a full window (switch back at ``a / c >= 1``: the gap
            keeps a break-even workload from flapping).
        probe_every: plain tokens before the first probe after a fallback.
        probe_max: the longest plain phase [tokens] (the interval doubles after each failed probe).
        probe_rounds: MTP rounds per probe.
        calibration: plain steps timed at engine start (and at each refresh) before MTP starts.
        refresh_rounds: MTP rounds after the last timed plain step before the plain step is timed again.
        cost_model: optional ``f(kind, seconds) -> seconds`` (kind ``"plain"`` | ``"round"``) replacing each
            measured time: tests force ``a / c`` with it instead of relying on this machine's timings.
        clock: the wall clock [s] (``time.perf_counter``).

    Raises:
        ConfigError: a knob out of range (window, probe_every, probe_rounds, calibration, refresh_rounds < 1;
            probe_max < probe_every; margin outside [0, 1)).
    """

    def __init__(self, window: int = 16, margin: float = 0.05, probe_every: int = 64, probe_max: int = 1024,
                 probe_rounds: int = 4, calibration: int = 8, refresh_rounds: int = 512, cost_model=None,
                 clock=time.perf_counter):
        for name, v in (("window", window), ("probe_every", probe_every), ("probe_rounds", probe_rounds),
                        ("calibration", calibration), ("refresh_rounds", refresh_rounds)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"adaptive speculation: {name} must be an integer >= 1, got {v!r}")
        if isinstance(probe_max, bool) or not isinstance(probe_max, int) or probe_max < probe_every:
            raise ConfigError(f"adaptive speculation: probe_max must be an integer >= probe_every ({probe_every}), "
                              f"got {probe_max!r}")
        if not 0.0 <= margin < 1.0:
            raise ConfigError(f"adaptive speculation: margin must be in [0, 1), got {margin!r}")
        self.window, self.margin = window, float(margin)
        self.probe_every, self.probe_max, self.probe_rounds = probe_every, probe_max, probe_rounds
        self.calibration, self.refresh_rounds = calibration, refresh_rounds
        self.cost_model, self.clock = cost_model, clock
        self._rounds: deque[tuple[int, float]] = deque(maxlen=window)     # (committed, seconds) per round
        self._plain: deque[float] = deque(maxlen=max(window, calibration))  # plain step seconds
        self.mode = "calibrate"
        self._left = calibration          # plain tokens left in this calibrate / plain phase, rounds in a probe
        self.interval = probe_every       # the current plain phase length (backs off after failed probes)
        self.rounds_since_plain = 0
        self.counts = {"plain_steps": 0, "rounds": 0, "to_plain": 0, "to_mtp": 0, "probes": 0, "probes_failed": 0,
                       "calibrations": 1, "catchups": 0, "catchup_positions": 0}
        self.decision: dict | None = None    # the estimates at the last switch or probe verdict
        self.reason = "calibrating: timing plain decode steps before the first MTP round"
        self.request = self._new_request()

    # ---- estimates ---------------------------------------------------------------------------------------
    @property
    def accept_length(self) -> float | None:
        """``a``: mean committed tokens per round over the window (None before any round in it)."""
        return sum(n for n, _ in self._rounds) / len(self._rounds) if self._rounds else None

    @property
    def plain_step_s(self) -> float | None:
        """Median wall time of the recent plain decode steps [s] (None before any)."""
        return statistics.median(self._plain) if self._plain else None

    @property
    def round_s(self) -> float | None:
        """Median wall time of the rounds in the window [s] (None before any)."""
        return statistics.median(s for _, s in self._rounds) if self._rounds else None

    @property
    def round_cost(self) -> float | None:
        """``c``: round time / plain step time (None until both are measured)."""
        t, r = self.plain_step_s, self.round_s
        return r / t if t and r is not None else None

    @property
    def speedup(self) -> float | None:
        """``a / c``: the speed-up of MTP rounds over plain decoding (None until both are measured)."""
        a, c = self.accept_length, self.round_cost
        return a / c if a is not None and c else None

    def plain_left(self) -> int:
        """Plain steps certainly left in this calibrate / plain phase, the one being timed included (0 in the
        mtp and probe modes): a pipelined loop launches a step ahead only while this is above 1."""
        return self._left if self.mode in ("calibrate", "plain") else 0

    def next_round_certain(self) -> bool:
        """Whether another MTP round follows the one in flight whatever that round commits and however long it
        takes (asked before it is observed): in a probe, more than one of its rounds left; in the mtp mode, no
        re-timing due after it and no fall-back even if it commits 1 token in unbounded time (``a`` is a mean and
        the round time a median, so that observation is the worst one). A pipelined loop launches a round ahead
        only then, so its rounds, draws and switches are those of the unpipelined loop."""
        if self.mode == "probe":
            return self._left > 1
        if self.mode != "mtp" or self.rounds_since_plain + 1 >= self.refresh_rounds:
            return False
        rounds = list(self._rounds)[-(self.window - 1):] if self.window > 1 else []
        rounds.append((1, math.inf))
        t = self.plain_step_s
        if len(rounds) < self.window or not t:
            return True
        r = statistics.median(s for _, s in rounds)
        a = sum(c for c, _ in rounds) / len(rounds)
        return math.isfinite(r) and a / (r / t) >= 1.0 - self.margin

    def wants_rounds(self) -> bool:
        """Whether the next tokens should come from MTP rounds (mode mtp or probe)."""
        return self.mode in ("mtp", "probe")

    # ---- observations ---------------------------------------------------------------------------------------
    def _cost(self, kind: str, seconds: float) -> float:
        return float(self.cost_model(kind, seconds)) if self.cost_model is not None else seconds

    def observe_plain(self, seconds: float) -> None:
        """Record one plain decode step of ``seconds`` wall time and advance the calibrate / plain phase."""
        self._plain.append(self._cost("plain", seconds))
        self.counts["plain_steps"] += 1
        self.request["plain_steps"] += 1
        self.rounds_since_plain = 0
        if self.mode not in ("calibrate", "plain"):
            return                        # a plain step MTP could not take (too few NEXTN inputs yet)
        self._left -= 1
        if self._left > 0:
            return
        if self.mode == "calibrate":
            s = self.speedup
            if len(self._rounds) == self.window and s is not None and s < 1.0 - self.margin:
                self._to_plain(f"a/c = {s:.3f} < {1 - self.margin:.3f} over the last {self.window} rounds "
                               f"(re-timed plain step)")
            else:
                self._set("mtp", "MTP on" + ("" if s is None else f": a/c = {s:.3f}"))
        else:
            self.counts["probes"] += 1
            self.request["probes"] += 1
            self._rounds.clear()          # the probe is judged on its own rounds
            self._left = self.probe_rounds
            self._set("probe", f"probing: {self.probe_rounds} MTP rounds after {self.interval} plain tokens")

    def observe_round(self, committed: int, seconds: float) -> None:
        """Record one MTP round that committed ``committed`` tokens (accepted drafts + 1) in ``seconds``, and
        decide whether the next tokens come from rounds or plain steps."""
        self._rounds.append((int(committed), self._cost("round", seconds)))
        self.counts["rounds"] += 1
        self.request["rounds"] += 1
        self.rounds_since_plain += 1
        s = self.speedup
        if self.mode == "probe":
            self._left -= 1
            if self._left > 0:
                return
            if s is not None and s >= 1.0:
                self.interval = self.probe_every
                self.counts["to_mtp"] += 1
                self.request["to_mtp"] += 1
                self._set("mtp", f"probe passed: a/c = {s:.3f} >= 1 over {len(self._rounds)} rounds", True)
            else:
                self.counts["probes_failed"] += 1
                self.interval = min(2 * self.interval, self.probe_max)
                self._to_plain(f"probe failed: a/c = {s:.3f} < 1 over {len(self._rounds)} rounds" if s is not None
                               else "probe failed: no plain step measured")
            return
        if self.mode != "mtp":
            return
        if len(self._rounds) == self.window and s is not None and s < 1.0 - self.margin:
            self._to_plain(f"a/c = {s:.3f} < {1 - self.margin:.3f} over the last {self.window} rounds")
        elif self.rounds_since_plain >= self.refresh_rounds:
            self.counts["calibrations"] += 1
            self._left = self.calibration
            self._set("calibrate", f"re-timing {self.calibration} plain steps after {self.rounds_since_plain} "
                                   f"rounds")

    def observe_catchup(self, positions: int, seconds: float) -> None:
        """Record one NEXTN catch-up over ``positions`` pending positions (:func:`adaptive_tokens`) that took
        ``seconds`` of host wall time (its launches, any JIT compile, the host syncs inside its eager layer). No
        decision depends on it: it is reported because it is spent between tokens, outside the timing of every
        plain step and round, and lands in the request's TPOT."""
        self.counts["catchups"] += 1
        self.counts["catchup_positions"] += int(positions)
        self.request["catchups"] += 1
        self.request["catchup_ms"] += seconds * 1e3

    def _to_plain(self, why: str) -> None:
        self.counts["to_plain"] += 1
        self.request["to_plain"] += 1
        self._left = self.interval
        self._set("plain", f"{why}: decoding plainly, next probe after {self.interval} tokens", True)
        self._rounds.clear()

    def _set(self, mode: str, why: str, decided: bool = False) -> None:
        if decided or self.decision is None:
            self.decision = self._estimates()
        self.mode, self.reason = mode, why

    def _estimates(self) -> dict:
        def r(v):
            return None if v is None else round(v, 4)
        return {"accept_length": r(self.accept_length), "round_cost": r(self.round_cost),
                "speedup": r(self.speedup), "window_rounds": len(self._rounds),
                "plain_step_ms": r(None if self.plain_step_s is None else self.plain_step_s * 1e3),
                "round_ms": r(None if self.round_s is None else self.round_s * 1e3)}

    # ---- reporting -------------------------------------------------------------------------------------------
    @staticmethod
    def _new_request() -> dict:
        return {"plain_steps": 0, "rounds": 0, "to_plain": 0, "to_mtp": 0, "probes": 0, "catchups": 0,
                "catchup_ms": 0.0}

    def begin_request(self) -> None:
        """Start the per-request counts (:meth:`request_dict`); the estimates and the mode carry over."""
        self.request = self._new_request()

    def request_dict(self) -> dict:
        """This request's adaptive facts for its speculative stats: the mode it ended in, its plain steps,
        rounds, switches and probes, its NEXTN catch-ups (count, host launch time [ms]), and the current
        estimates."""
        return {"on": True, "mode": self.mode, **self.request, "catchup_ms": round(self.request["catchup_ms"], 3),
                **self._estimates(), "reason": self.reason,
                "last_decision": self.decision}

    def state(self) -> dict:
        """JSON-serialisable engine-lifetime state (metrics, manifest): mode, estimates, counts, knobs, the
        estimates at the last decision and its reason. ``fell_back``: decoding plainly because MTP did not
        pay."""
        return {"on": True, "mode": self.mode, "fell_back": self.mode in ("plain", "probe"),
                **self._estimates(), **self.counts, "interval": self.interval, "reason": self.reason,
                "last_decision": self.decision,
                "knobs": {"window": self.window, "margin": self.margin, "probe_every": self.probe_every,
                          "probe_max": self.probe_max, "probe_rounds": self.probe_rounds,
                          "calibration": self.calibration, "refresh_rounds": self.refresh_rounds}}


class _Pending:
    """NEXTN inputs not yet in its cache: ids ``[n]`` (token ``t + 1``) and target hiddens ``[n, H]`` (position
    ``t``) for positions ``first .. first + n - 1``, kept as a list of pieces (one per plain step)."""

    def __init__(self, ids: torch.Tensor, hidden: torch.Tensor, first: int):
        self.ids, self.hidden, self.first, self.n = [ids], [hidden], first, ids.shape[0]

    def append(self, tok: torch.Tensor, hidden: torch.Tensor) -> None:
        self.ids.append(tok)
        self.hidden.append(hidden)
        self.n += 1

    def take(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        ids, hid = torch.cat(self.ids), torch.cat(self.hidden)
        self.ids, self.hidden = [ids], [hid]
        return ids, hid, self.first

    def flush(self, drafter, state, keep: int, ctrl: "AdaptiveSpeculation | None" = None) -> None:
        """Run the NEXTN over all but the last ``keep`` positions (in prefill chunks); ``ctrl`` records the
        catch-up (:meth:`AdaptiveSpeculation.observe_catchup`)."""
        if self.n <= keep:
            return
        t0 = ctrl.clock() if ctrl is not None else 0.0
        ids, hid, first = self.take()
        m = self.n - keep
        nextn_prefix(drafter, ids[:m], hid[:m], torch.arange(first, first + m, device=ids.device), state)
        self.ids, self.hidden, self.first, self.n = [ids[m:]], [hid[m:]], first + m, keep
        if ctrl is not None:
            ctrl.observe_catchup(m, ctrl.clock() - t0)


@torch.inference_mode()
def adaptive_tokens(runner, drafter, prompt: torch.Tensor, p: SamplingParams, gen, stats,
                    ctrl: AdaptiveSpeculation, round_: StaticRound | None = None, pipelined: bool = False):
    """Yield ``(token, round)`` like :func:`bytebound.speculative.round.mtp_tokens`, each token from a plain decode
    step (round 0) or an MTP round (round ids 1, 2, ... over the request), as ``ctrl`` decides between tokens.

    Args:
        runner / drafter: the engine's ``ModelRunner`` and ``MTPDrafter``. prompt: ``[P]`` int64 token ids.
        p / gen: sampling parameters and generator (shared by plain steps and rounds). stats: the request's
        ``SpecStats`` (rounds only; plain steps are counted by ``ctrl``). ctrl: the engine's controller.
        round_: the :class:`~bytebound.speculative.round.StaticRound` for the rounds (the engine's captured
            round of ``p``'s kind, set to serve ``p`` and ``gen``), else an uncaptured one for ``p`` and ``gen``.
        pipelined: plain phases launch each step before the host reads the token it follows (the engine's
            ``pipelined``); the tokens are the same either way.
    """
    dev, k = runner.device, drafter.steps
    clock = ctrl.clock
    cuda = dev.type == "cuda"
    host = torch.empty(1, dtype=torch.long, pin_memory=cuda)     # the plain steps' host reads
    ready = torch.cuda.Event() if cuda else None
    rnd = round_.use(p, gen) if round_ is not None else StaticRound(runner, drafter, p, gen)
    hid = runner.prefill(prompt.to(dev))
    y = sample(runner.logits(hid[-1:]), p, gen).view(1)
    pend = _Pending(torch.cat([prompt[1:].to(dev), y]), hid, 0)
    if ctrl.wants_rounds():
        # as mtp_tokens: the NEXTN pass over the prompt belongs to the prefill (TTFT) when rounds follow at once;
        # in plain mode it waits for the next probe (or for PREFILL_CHUNK pending positions)
        pend.flush(drafter, runner.state, k + 1)
    yield int(y), 0
    n = 0                                 # round ids of this request

    def until(j: int, seconds: float) -> bool:      # after each round: its verdict decides whether more follow
        ctrl.observe_round(j + 1, seconds)
        return not ctrl.wants_rounds()
    while True:
        if ctrl.wants_rounds():
            pend.flush(drafter, runner.state, k + 1, ctrl)   # the catch-up is no part of the first round's cost
            ids, hs, first = pend.take()
            rnd.seed(ids, hs, first, y)
            for tok, n in rnd.rounds(stats, n, clock, until, pipelined, ctrl.next_round_certain):
                yield tok, n
            ids, hs, first, y = rnd.pending()          # the last round's committed positions feed the NEXTN later
            pend = _Pending(ids, hs, first)
            continue
        # a plain phase: one step per token, each timed from the host read before it (or its launch) to its own
        # host read. Pipelined (the engine's plain loop, ``EngineConfig.pipeline_decode``): the next step is
        # launched before this step's token is read, but only while the phase surely goes on (``plain_left``),
        # so the steps, their generator draws and the switches are those of the unpipelined loop
        ahead = None                                   # (token [1], hidden [1, H]) of a step already launched
        t0 = clock()
        while not ctrl.wants_rounds():
            if pend.n > runner_mod.PREFILL_CHUNK:     # bound what a long plain phase holds
                pend.flush(drafter, runner.state, k + 1, ctrl)
            if ahead is None:
                t0 = clock()
                ahead = _plain_step(runner, y, p, gen)
            nxt, h = ahead
            ahead = None
            host.copy_(nxt, non_blocking=cuda)
            if ready is not None:
                ready.record()
            if pipelined and ctrl.plain_left() > 1 and runner.pos + 1 <= runner.max_len:
                ahead = _plain_step(runner, nxt, p, gen)
            if ready is not None:
                ready.synchronize()
            tok = int(host[0])                         # the step's host read
            t1 = clock()
            pend.append(nxt, h)
            ctrl.observe_plain(t1 - t0)
            t0, y = t1, nxt
            yield tok, 0


def catchup_sizes(max_len: int) -> list[int]:
    """The catch-up lengths :func:`warm_catchup` runs: 1, then ``2^i`` and ``2^i + 1`` for ``2 <= 2^i <=
    PREFILL_CHUNK`` (both below ``max_len``). A kernel that picks its tiling by a power-of-two bucket of M, or that
    Triton specialises on M's divisibility by 16 (and on M == 1), sees every variant a catch-up of any length can
    reach (a longer catch-up runs in ``PREFILL_CHUNK`` pieces)."""
    out = [1]
    b = 2
    while b <= runner_mod.PREFILL_CHUNK:
        out += [m for m in (b, b + 1) if m < max_len]
        b *= 2
    return out


@torch.inference_mode()
def warm_catchup(runner, drafter) -> dict:
    """Run the NEXTN layer eagerly over :func:`catchup_sizes` positions (token 0, zero target hiddens, positions
    ``0..m-1``) so the kernels of the catch-ups that adaptive speculation runs between tokens are compiled at
    start-up instead of inside a request: a plain phase of ``n`` tokens ends in a catch-up of about ``n``
    positions, and the phases grow 64, 128, ..., 1024 tokens, each length a new tiling bucket of the grouped MoE
    prefill kernel (``triton_moe_grouped.prefill_config``). The NEXTN cache rows written here hold garbage that
    every request overwrites before a round reads them (a round reads only positions below the committed length,
    each written by the request's own seed or catch-ups). Returns ``{"sizes": [...], "seconds": s}``."""
    t0 = time.perf_counter()
    dev, H = runner.device, runner.model.cfg.hidden_size
    dtype = drafter.embedding.weight.dtype           # the activations' dtype, as the target hiddens have
    sizes = catchup_sizes(runner.max_len)
    for m in sizes:
        nextn_prefix(drafter, torch.zeros(m, dtype=torch.long, device=dev), torch.zeros(m, H, dtype=dtype, device=dev),
                     torch.arange(m, device=dev), runner.state)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"sizes": sizes, "seconds": round(time.perf_counter() - t0, 3)}


def _plain_step(runner, tok: torch.Tensor, p: SamplingParams, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch one plain decode step of ``tok [1]``: its token ``[1]`` and hidden ``[1, H]``, copied out of the token
    graphs' static buffers (in stream order, before any later step rewrites them)."""
    nxt, h = runner.decode_token(tok, p, gen)
    return nxt.clone(), h.clone()


def check_knobs(cfg) -> None:
    """ConfigError for adaptive speculation without MTP (``speculative_adaptive`` with ``speculative_steps`` 0) or
    with tensor parallelism (``tensor_parallel_size`` > 1); the knobs themselves are checked by
    :class:`AdaptiveSpeculation`."""
    if cfg.speculative_adaptive and not cfg.speculative_steps:
        raise ConfigError("--speculative-adaptive (speculative_adaptive) needs MTP: add --speculative-algorithm "
                          "NEXTN (speculative_steps >= 1)")
    if cfg.speculative_adaptive and cfg.tensor_parallel_size > 1:
        # every rank's controller decides between rounds and plain steps on its own clock, and a plain step keeps
        # the rank's own token (no from_rank0): the ranks would soon run different collectives
        raise ConfigError("--speculative-adaptive (speculative_adaptive) is single-process only: with "
                          f"--tensor-parallel-size {cfg.tensor_parallel_size} each rank would switch between MTP "
                          "rounds and plain steps on its own timings; use fixed MTP or plain decoding")
