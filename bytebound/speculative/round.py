"""The MTP round: one implementation with fixed shapes and every input in a device buffer, run eagerly on CPU
and replayed as one CUDA graph per attention span on CUDA (greedy and sampling requests alike). The round -
draft-extend, draft steps, verify, acceptance, KDA rollback and the next round's inputs - has no data-dependent
shape and no host read but the one that ends it:

* **Padded draft-extend.** The NEXTN always runs over ``k + 1`` positions ending past the committed length
  (``pos - j - 1 .. pos - j - 1 + k``, ``j`` the previous round's accepted drafts) and the draft continues from row
  ``j`` (``index_select`` with the device tensor ``j``). Rows past ``j`` pair rejected drafts (or, after a seed
  with fewer than ``k + 1`` pending positions, padding) with their hiddens. Causal attention keeps them out of
  rows ``<= j``. Their NEXTN cache slots are ``>= pos`` and each is rewritten before any query reads it: draft
  ``i`` writes slot ``pos + i - 1`` and reads slots ``<= pos + i - 1``, and the next round's extend rewrites
  ``pos .. pos + k`` (so e.g. slot ``pos + k - 1`` after ``j = 0`` is never read while stale).
* **The runner's state protocol.** ``runner.begin_verify(k)`` (host: room, ``runner.pos_buf``), ``runner.verify``
  at ``pos_buf + 0..k`` (KDA states recorded per token), ``runner.commit_state(j)`` with the device tensor ``j``
  (an index into the recorded states: with kda=triton the fused kernel's per-token buffers) inside the body, and
  ``runner.commit_length(j)`` on the host after the read.
* **Next inputs in place.** The round writes ``y`` (its bonus token), the extend ids and hiddens and ``j`` into
  the buffers the next round reads, and advances ``runner.pos_buf`` by its ``j + 1`` kept tokens. The host reads
  one small tensor per round, ``out = [d_1..d_k, bonus, j]``, to emit tokens. That read is the round's only sync.
* **Pipelined rounds.** So the next round needs nothing from the host: :meth:`StaticRound.rounds` can launch it
  (``runner.chain_verify``) before reading this one, and the GPU runs it while the host reads the verdict, emits
  the tokens and launches the graph (a captured round's launch alone is ~150 us of host time at full scale).

The first round after a prefill of ``P`` tokens: the NEXTN runs eagerly over all but the last ``min(P, k + 1)``
prompt positions, and those are the first round's extend, as if a previous round had accepted ``j = min(P, k +
1) - 1`` drafts (:meth:`StaticRound.seed`).

Greedy and sampled rounds are two bodies (a round is one or the other; the engine holds a captured round of
each): the greedy one takes the target argmax and is what it always was; the sampled one reads the request's
temperature / top-p / top-k from device buffers (``sampling.SamplingBuffers``, written per request by
:meth:`StaticRound.use`) and the round's uniforms from a buffer too: :meth:`StaticRound.step` draws them from the
request's generator just before the body (``accept.chain_uniforms``, the same draws in the same order as the
acceptance rule makes them inline), so replay equals the eager body bit for bit and the seed still decides the
output. With tensor parallelism (``runner.tp``) the body takes rank 0's drafts and verdict, a collective, so it is
not captured.
"""

from __future__ import annotations

import time

import torch

from bytebound.runner.graphs import capture_graph
from bytebound.sampling import SamplingBuffers, SamplingParams, probs_device, sample
from bytebound.speculative.accept import accept_greedy, accept_sampled, chain_uniforms
from bytebound.speculative.mtp import _from_rank0, nextn_prefix


class StaticRound:
    """Static buffers + the round body for ``runner`` and ``drafter`` (steps ``k``).

    Buffers (device): ``y [1]`` int64 last committed token, not yet run; ``ext_ids [k+1]`` / ``ext_hidden
    [k+1, H]`` the NEXTN inputs for the previous round's verify positions; ``j`` 0-d int64 (accepted drafts of the
    previous round: the extend row the drafts continue from); ``out [k+2]`` int64 ``[drafts.., bonus, j]`` of the
    last round. The committed length comes from the runner (``runner.pos_buf``, written by ``begin_verify``).
    A sampled round (``p`` not greedy) also has ``sp`` (a ``SamplingBuffers``: the request's settings) and the
    uniforms of one round, ``u [k]`` float32 (the draft tests) and ``u_draw [1, 1]`` float64 (the bonus draw).

    Args:
        runner: a ``ModelRunner``. drafter: an ``MTPDrafter`` of the same model. p / gen: the sampling
        parameters and generator of the first request (:meth:`use` sets later ones); whether ``p`` is greedy
        decides which body the round has. capture: record the body in a CUDA graph per attention span.

    Raises:
        RuntimeError: ``capture`` off CUDA. ValueError: ``capture`` with tensor parallelism.
    """

    def __init__(self, runner, drafter, p: SamplingParams, gen: torch.Generator | None = None,
                 capture: bool = False):
        self.r, self.dr, self.p, self.gen = runner, drafter, p, gen
        k = self.k = drafter.steps
        dev, cfg = runner.device, runner.model.cfg
        self.sampled = not p.greedy
        if self.sampled:
            self.sp = SamplingBuffers(dev, p)
            self.u = torch.zeros(k, dtype=torch.float32, device=dev)
            self.u_draw = torch.zeros(1, 1, dtype=torch.float64, device=dev)
        self.y = torch.zeros(1, dtype=torch.long, device=dev)
        self.ext_ids = torch.zeros(k + 1, dtype=torch.long, device=dev)
        self.ext_hidden = torch.zeros(k + 1, cfg.hidden_size, dtype=runner.model.dtype, device=dev)
        self.j = torch.zeros((), dtype=torch.long, device=dev)
        self.out = torch.zeros(k + 2, dtype=torch.long, device=dev)
        self.ar = torch.arange(k + 1, device=dev)
        self.last: list[int] | None = None                     # the host copy of ``out`` after a step
        self.ahead_rounds = 0            # rounds launched before the previous one's read (pipelined)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}       # attention span -> captured round
        self.captured_shapes: list[dict] = []
        if capture:
            self._capture()

    def use(self, p: SamplingParams, gen: torch.Generator | None) -> "StaticRound":
        """Serve the request with settings ``p`` and generator ``gen`` from now on (a captured round serves every
        request of its kind): a sampled round writes ``p`` into its buffers. Returns ``self``.

        Raises:
            ValueError: ``p`` greedy for a sampled round, or sampling for a greedy one.
        """
        if p.greedy == self.sampled:
            have, got = ("sampled", "greedy") if self.sampled else ("greedy", "sampling")
            raise ValueError(f"a {have} MTP round cannot serve a {got} request (temperature={p.temperature}, "
                             f"top_k={p.top_k})")
        self.p, self.gen = p, gen
        if self.sampled:
            self.sp.write(p)
        return self

    def span(self) -> int | None:
        """Attention span for the next round: the smallest of ``runner.kv_buckets`` that holds the verify's last
        slot ``pos + k`` (the CUDA path's static span, as the decode graphs pick theirs); None on the dynamic CPU
        path."""
        return self.r.kv_span(self.r.pos + self.k + 1) if self.r.static_kv else None

    def _body(self, kv_len: int | None = None) -> None:
        """One round after ``runner.begin_verify(k)``: device work only (no host read), so it can be captured."""
        r, dr, k, ar = self.r, self.dr, self.k, self.ar
        pos = r.pos_buf
        # 1. draft-extend over the previous verify's k+1 positions; continue from row j
        eh = dr.hidden(self.ext_ids, self.ext_hidden, pos - self.j - 1 + ar, r.state, kv_len)
        dh = eh.index_select(0, self.j.view(1))                                 # [1, H]
        drafts = [dr.propose(dh)]        # full head, or the hot rows (fixed N: static shapes)
        # 2. k - 1 draft steps; draft i sits at pos + i - 1
        for i in range(1, k):
            dh = dr.hidden(drafts[-1], dh, (pos + (i - 1)).view(1), r.state, kv_len)
            drafts.append(dr.propose(dh))
        d = _from_rank0(r, torch.cat(drafts))                                   # [k]
        # 3. verify [y, d] at pos..pos+k, KDA state recorded after every token
        vh = r.verify(torch.cat([self.y, d]), pos + ar, kv_len)
        # 4. acceptance on the device (tensor parallel: rank 0 decides for every rank); a sampled round reads its
        # settings and this round's uniforms (drawn by step) from buffers
        if self.sampled:
            j, bonus = accept_sampled(probs_device(r.logits(vh), self.sp), d, self.u, self.u_draw)
        else:
            # only the target's argmax matters: the head reduces it in its kernel where it can (no logits stored)
            j, bonus = accept_greedy(r.model.lm_head.argmax(vh), d)
        verdict = _from_rank0(r, torch.cat([d, bonus.view(1), j.view(1)]))
        j, bonus = verdict[-1], verdict[-2]
        # 5. KDA states after token j (MLA slots past the new committed length are rewritten before use)
        r.commit_state(j)
        # 6. the next round's inputs: token after position pos+t is d[t] for t < j and the bonus at t = j; the
        # committed length moves on the device too, so a pipelined next round needs nothing from the host
        self.out.copy_(verdict)
        self.ext_ids.copy_(torch.where(ar == j, bonus, torch.cat([d, bonus.view(1)])))
        self.ext_hidden.copy_(vh)
        self.y.copy_(bonus.view(1))
        self.j.copy_(j)
        pos.add_(j + 1)

    def _capture(self) -> None:
        if self.r.device.type != "cuda":
            raise RuntimeError("capturing an MTP round needs a CUDA device")
        if getattr(self.r, "tp", None) is not None:
            raise ValueError("an MTP round with tensor parallelism is not captured (rank 0's verdict is a "
                             "collective): it runs eagerly")
        r, k = self.r, self.k
        self.j.zero_()
        bufs = [self.y, self.ext_ids, self.ext_hidden, self.j]
        saved = [b.clone() for b in bufs]
        snap = r.snapshot()

        def reset_bufs():
            for b, v in zip(bufs, saved):
                b.copy_(v)
            # the body advances pos_buf by its kept tokens: every warm-up and the capture run at begin_verify's
            # position (restoring a value saved before reset(1) could put a warm-up's extend at position -1)
            r.pos_buf.fill_(r.pos)
        # One graph per attention span (runner.kv_buckets; one span, max_len, unless buckets are on), so the
        # round attends over what the sequence needs, like the decode graphs. Each replays only its own span.
        # Warm-up and capture run at a synthetic committed length 1 (with j = 0 the extend starts at position
        # pos - j - 1 = 0); the snapshot puts the request's state back.
        try:
            for span in r.kv_buckets:
                r.reset(1)
                r.begin_verify(k)
                self.graphs[span], _ = capture_graph(lambda: self._body(span), 2, reset_bufs)
                reset_bufs()
        finally:
            r.restore(snap)
        self.captured_shapes = [{"op": "mtp_round", "draft_steps": self.k, "verify_tokens": self.k + 1,
                                 "kv_slots": span, "sampling": "sampled" if self.sampled else "greedy"}
                                for span in self.graphs]

    def start(self, prompt: torch.Tensor, hid: torch.Tensor, y: torch.Tensor) -> None:
        """Set the buffers after a prefill of ``prompt [P]`` (``P >= 1``) with hiddens ``hid [P, H]`` and first
        token ``y [1]``: the NEXTN runs eagerly over all but the last ``min(P, k + 1)`` positions, the rest is the
        first round's extend."""
        dev = self.r.device
        self.seed(torch.cat([prompt[1:].to(dev), y.view(1)]), hid, 0, y)

    def seed(self, ext_ids: torch.Tensor, ext_hidden: torch.Tensor, first: int, y: torch.Tensor) -> None:
        """Set the buffers from any committed point: ``ext_ids [E]`` / ``ext_hidden [E, H]`` are the NEXTN inputs
        not yet in its cache for positions ``first .. first + E - 1`` (token ``t + 1``, target hidden of ``t``),
        ending at ``runner.pos - 1``, with ``E >= 1``; ``y [1]`` the last committed token, not yet run. The NEXTN
        runs eagerly over all but the last ``m = min(E, k + 1)`` positions; those become the next round's extend
        rows ``0..m-1`` (as if the previous round had accepted ``j = m - 1`` drafts; rows past it are padding).
        After a prefill ``first = 0`` (:meth:`start`); after plain decode steps, the positions they decoded
        (:mod:`bytebound.speculative.adaptive`).

        Raises:
            ValueError: no positions, or positions that do not end at ``runner.pos - 1``.
        """
        k, dev = self.k, self.r.device
        e = ext_ids.shape[0]
        if e < 1 or first + e != self.r.pos:
            raise ValueError(f"seeding an MTP round needs >= 1 pending NEXTN positions ending at "
                             f"{self.r.pos - 1}, got {e} from {first}")
        m = min(e, k + 1)
        n0 = e - m
        nextn_prefix(self.dr, ext_ids[:n0], ext_hidden[:n0], torch.arange(first, first + n0, device=dev),
                     self.r.state)
        self.ext_ids.zero_()
        self.ext_hidden.zero_()
        self.ext_ids[:m].copy_(ext_ids[n0:])
        self.ext_hidden[:m].copy_(ext_hidden[n0:])
        self.y.copy_(y.view(1))
        self.j.fill_(m - 1)

    @torch.inference_mode()
    def step(self) -> list[int]:
        """Run one round (graph replay if captured); returns ``[d_1..d_k, bonus, j]`` (the one host sync) and
        commits ``j + 1`` tokens (``runner.pos`` advances by ``j + 1``).

        Raises:
            ValueError: the round's verify would exceed the runner's cache.
        """
        return self._finish(self._launch(chained=False))

    def _span_ahead(self) -> int | None:
        """The attention span of a round chained behind the pending one, if it does not depend on that round's
        verdict (the spans for the fewest and the most kept tokens agree; else -1: do not chain). None on the
        dynamic CPU path."""
        if not self.r.static_kv:
            return None
        start, width = self.r._verify
        lo, hi = self.r.kv_span(start + 1 + self.k + 1), self.r.kv_span(start + width + self.k + 1)
        return lo if lo == hi else -1

    def can_chain(self) -> bool:
        """Whether the next round can be launched before this one's verdict is read: room for it whatever this
        round keeps (``runner.can_chain``) and the same attention span whatever it keeps (so a pipelined round runs
        exactly the kernels an unpipelined one would)."""
        return self.r.can_chain(self.k) and self._span_ahead() != -1

    def _launch(self, chained: bool):
        """Launch one round without reading it: after :meth:`step`'s host bookkeeping (``begin_verify``), or, with
        ``chained``, behind the round in flight (``runner.chain_verify``: the device already holds its committed
        length). The verdict is copied to host memory in stream order before any later round rewrites ``out``.
        Returns the handle :meth:`_finish` reads."""
        r = self.r
        if chained:
            span = self._span_ahead()
            r.chain_verify(self.k)
        else:
            r.begin_verify(self.k)       # the verify writes k + 1 slots past the committed length
            span = self.span()
        if self.sampled:                 # this round's uniforms, from the request's generator, outside any graph
            chain_uniforms(self.gen, self.u, self.u_draw)
        g = self.graphs.get(span)
        if g is not None:
            g.replay()
        else:
            self._body(span)
        cuda = self.out.is_cuda
        if not cuda:
            return self.out.clone(), None
        if not hasattr(self, "_host"):
            # two pinned buffers: the verdict of a round launched ahead must not land on the one being read
            self._host = [torch.empty(self.k + 2, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._flip = 0
        self._flip ^= 1
        host = self._host[self._flip]
        host.copy_(self.out, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return host, ev

    def _finish(self, handle) -> list[int]:
        """Wait for the round of ``handle`` (the host read), commit its length; returns ``[d_1..d_k, bonus, j]``."""
        host, ev = handle
        if ev is not None:
            ev.synchronize()
        out = self.last = host.tolist()
        self.r.commit_length(out[-1])
        return out

    def rounds(self, stats, n: int = 0, clock=time.perf_counter, until=None, pipelined: bool = False, sure=None):
        """Rounds until the caller stops iterating: yields ``(token, round id)`` with ids ``n + 1, ...``, the
        round's accepted drafts then its bonus token. ``stats`` (a ``SpecStats``) gets each round (``verify_s``:
        the whole round's time - draft, verify and rollback are not separable inside one replay) before its
        tokens leave; ``until(j, seconds) -> bool``, if given, is called then too, and True ends the rounds after
        this round's tokens (the next inputs are then :meth:`pending`).

        ``pipelined``: launch the next round before this one's verdict is read (``runner.chain_verify``), so the
        GPU runs it while the host reads, emits and the caller handles these tokens - the MTP counterpart of the
        engine's pipelined plain loop. Only where the next round is certain: room and span (:meth:`can_chain`),
        and ``sure() -> bool`` (asked before the round in flight is observed; None: always, as without
        ``until``). The rounds, their generator draws and their verdicts are those of the unpipelined loop; a
        round's time then runs from its launch or the previous round's read, whichever is later, to its read. When
        the caller stops with a round in flight, that round is read and committed (as the pipelined plain loop's
        extra step, it ran past the request's end)."""
        ahead = None                     # (handle, launch time) of a round launched before the last read
        t_read = None
        draining = False                 # the caller asked to stop with a round in flight: read that one, then stop
        try:
            while True:
                n += 1
                if ahead is None:
                    t0 = clock()
                    h = self._launch(chained=False)
                else:
                    h, t0 = ahead
                    t0 = max(t0, t_read)
                    ahead = None
                    self.ahead_rounds += 1
                    stats.pipelined += 1
                if pipelined and (sure is None or sure()) and self.can_chain():
                    ahead = (self._launch(chained=True), clock())
                out = self._finish(h)
                t_read = clock()
                dt = t_read - t0
                stats.verify_s += dt
                j = out[-1]
                stats.add_round(j)
                stop = until is not None and until(j, dt)
                for tok in out[:j] + [out[-2]]:
                    stats.committed += 1
                    yield tok, n
                if stop or draining:
                    if ahead is None:
                        return
                    # (sure() promised that the round in flight follows: it is still read and emitted, then stop)
                    draining, until, pipelined = True, None, False
        finally:
            if ahead is not None:
                self._finish(ahead[0])

    def pending(self) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """After a round: the NEXTN inputs its commit left pending, ``(ids [j+1], hidden [j+1, H], first
        position, y [1])`` (copies), for plain decoding to continue from and a later :meth:`seed`."""
        j = self.last[-1]
        return (self.ext_ids[: j + 1].clone(), self.ext_hidden[: j + 1].clone(), self.r.pos - j - 1,
                self.y.clone())


@torch.inference_mode()
def mtp_tokens(runner, drafter, prompt: torch.Tensor, p: SamplingParams, gen, stats,
               round_: StaticRound | None = None, pipelined: bool = False):
    """Yield ``(token, round)`` pairs: round 0 is the prefill's token, then one round id per verify (each a
    :meth:`StaticRound.step`; a graph replay when ``round_`` was captured, else a new uncaptured round for ``p``
    and ``gen``; a given ``round_`` is set to serve them, :meth:`StaticRound.use`). The caller stops iterating at
    EOS / stop strings / max_tokens; every round commits before its tokens leave. ``pipelined``: each round is
    launched before the host reads the one before it (:meth:`StaticRound.rounds`; the engine's ``pipelined``):
    the same tokens, and one round more runs past the request's end, discarded with it."""
    rnd = round_.use(p, gen) if round_ is not None else StaticRound(runner, drafter, p, gen)
    hid = runner.prefill(prompt.to(runner.device))                            # [P, H]
    y = _from_rank0(runner, sample(runner.logits(hid[-1:]), p, gen).view(1))   # [1] on the device
    # The NEXTN pass over the prompt is part of the prefill (as the draft extend of SGLang's and vLLM's
    # speculative prefill): it runs before the first token leaves, so it is in TTFT, not in the decode time.
    rnd.start(prompt, hid, y)
    yield int(y), 0
    yield from rnd.rounds(stats, pipelined=pipelined)
