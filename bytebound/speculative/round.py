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
  the buffers the next round reads. The host reads one small tensor per round, ``out = [d_1..d_k, bonus, j]``, to
  emit tokens. That read is the round's only sync.

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
from bytebound.speculative.accept import accept_chain_device, accept_sampled, chain_uniforms
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
            j, bonus = accept_chain_device(r.logits(vh), d, self.p, None)
        verdict = _from_rank0(r, torch.cat([d, bonus.view(1), j.view(1)]))
        j, bonus = verdict[-1], verdict[-2]
        # 5. KDA states after token j (MLA slots past the new committed length are rewritten before use)
        r.commit_state(j)
        # 6. the next round's inputs: token after position pos+t is d[t] for t < j and the bonus at t = j
        self.out.copy_(verdict)
        self.ext_ids.copy_(torch.where(ar == j, bonus, torch.cat([d, bonus.view(1)])))
        self.ext_hidden.copy_(vh)
        self.y.copy_(bonus.view(1))
        self.j.copy_(j)

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
        r = self.r
        r.begin_verify(self.k)           # the verify writes k + 1 slots past the committed length
        if self.sampled:                 # this round's uniforms, from the request's generator, outside any graph
            chain_uniforms(self.gen, self.u, self.u_draw)
        span = self.span()
        g = self.graphs.get(span)
        if g is not None:
            g.replay()
        else:
            self._body(span)
        out = self.last = self.out.tolist()
        r.commit_length(out[-1])
        return out

    def rounds(self, stats, n: int = 0, clock=time.perf_counter, until=None):
        """Rounds until the caller stops iterating: yields ``(token, round id)`` with ids ``n + 1, ...``, the
        round's accepted drafts then its bonus token. ``stats`` (a ``SpecStats``) gets each round (``verify_s``:
        the whole round's time - draft, verify and rollback are not separable inside one replay) before its
        tokens leave; ``until(j, seconds) -> bool``, if given, is called then too, and True ends the rounds after
        this round's tokens (the next inputs are then :meth:`pending`)."""
        while True:
            n += 1
            t0 = clock()
            out = self.step()
            dt = clock() - t0
            stats.verify_s += dt
            j = out[-1]
            stats.add_round(j)
            stop = until is not None and until(j, dt)
            for tok in out[:j] + [out[-2]]:
                stats.committed += 1
                yield tok, n
            if stop:
                return

    def pending(self) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """After a round: the NEXTN inputs its commit left pending, ``(ids [j+1], hidden [j+1, H], first
        position, y [1])`` (copies), for plain decoding to continue from and a later :meth:`seed`."""
        j = self.last[-1]
        return (self.ext_ids[: j + 1].clone(), self.ext_hidden[: j + 1].clone(), self.r.pos - j - 1,
                self.y.clone())


@torch.inference_mode()
def mtp_tokens(runner, drafter, prompt: torch.Tensor, p: SamplingParams, gen, stats,
               round_: StaticRound | None = None):
    """Yield ``(token, round)`` pairs: round 0 is the prefill's token, then one round id per verify (each a
    :meth:`StaticRound.step`; a graph replay when ``round_`` was captured, else a new uncaptured round for ``p``
    and ``gen``; a given ``round_`` is set to serve them, :meth:`StaticRound.use`). The caller stops iterating at
    EOS / stop strings / max_tokens; only what it consumed is committed (every round commits before its tokens
    leave)."""
    rnd = round_.use(p, gen) if round_ is not None else StaticRound(runner, drafter, p, gen)
    hid = runner.prefill(prompt.to(runner.device))                            # [P, H]
    y = _from_rank0(runner, sample(runner.logits(hid[-1:]), p, gen).view(1))   # [1] on the device
    # The NEXTN pass over the prompt is part of the prefill (as the draft extend of SGLang's and vLLM's
    # speculative prefill): it runs before the first token leaves, so it is in TTFT, not in the decode time.
    rnd.start(prompt, hid, y)
    yield int(y), 0
    yield from rnd.rounds(stats)
