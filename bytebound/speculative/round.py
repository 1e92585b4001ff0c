"""One MTP round with fixed shapes and every input in a device buffer, so the whole round - draft-extend,
draft steps, verify, acceptance, KDA rollback and the next round's inputs - is one CUDA-graph replay.

The eager round in :func:`bytebound.speculative.mtp.mtp_tokens` has data-dependent shapes: the draft-extend
runs over the ``j + 1`` tokens committed last round, and the KDA rollback indexes a Python list with a host
integer. Here both are made static:

* **Padded draft-extend.** The NEXTN always runs over all ``k + 1`` positions of the previous verify
  (``pos - j - 1 .. pos - j - 1 + k``) and the draft continues from row ``j`` (``index_select`` with the device
  tensor ``j``). Rows past ``j`` pair rejected drafts with their hiddens. Causal attention keeps them out of
  rows ``<= j``. Their NEXTN cache slots are ``>= pos`` and each is rewritten before any query reads it: draft
  ``i`` writes slot ``pos + i - 1`` and reads slots ``<= pos + i - 1``, and the next round's extend rewrites
  ``pos .. pos + k`` (so e.g. slot ``pos + k - 1`` after ``j = 0`` is never read while stale).
* **On-device rollback.** The verify records the KDA state after every token (``KDAState.history``). The state
  after token ``j`` is selected with ``index_select`` and copied back in place (with kda=triton straight from the
  fused kernel's per-token buffers, ``KDAState.history_tensors``).
* **Next inputs in place.** The round writes ``y`` (its bonus token), the extend ids and hiddens, ``j`` and
  ``pos`` into the buffers the next replay reads. The host reads one small tensor per round, ``out = [d_1..d_k,
  bonus, j]``, to emit tokens. That read is the round's only sync.

The first round needs ``pos >= k + 1``: :func:`static_mtp_tokens` runs the NEXTN eagerly over the prompt except
its last ``k + 1`` positions, then treats those as the previous round's "verify" with all drafts accepted
(``j = k``).

Graph capture (``StaticRound(..., capture=True)``, CUDA only) bakes in the sampling mode: it is used for greedy
requests, and sampling requests run the same body eagerly (their RNG stays with the request's generator). On
CPU the body always runs eagerly; the tests check it against plain greedy decoding token for token.
"""

from __future__ import annotations

import time

import torch

from bytebound.layers.kda import KDAState
from bytebound.runner.graphs import _restore, _snapshot, capture_graph
from bytebound.sampling import SamplingParams, sample
from bytebound.speculative.accept import accept_chain_device
from bytebound.speculative.mtp import mtp_tokens, nextn_prefix


class StaticRound:
    """Static buffers + the round body for ``runner`` and ``drafter`` (steps ``k``).

    Buffers (device): ``y [1]`` int64 last committed token, not yet run; ``ext_ids [k+1]`` / ``ext_hidden
    [k+1, H]`` the NEXTN inputs for the previous verify's positions; ``j`` / ``pos`` 0-d int64 (accepted drafts of
    the previous round, committed length); ``out [k+2]`` int64 ``[drafts.., bonus, j]`` of the last round.

    Args:
        runner: a ``ModelRunner``. drafter: an ``MTPDrafter`` of the same model. p / gen: the sampling
        parameters and generator the round uses (captured graphs: greedy only). capture: record the body in
        a CUDA graph (raises ``RuntimeError`` off CUDA).
    """

    def __init__(self, runner, drafter, p: SamplingParams, gen: torch.Generator | None = None,
                 capture: bool = False):
        self.r, self.dr, self.p, self.gen = runner, drafter, p, gen
        k = self.k = drafter.steps
        dev, cfg = runner.device, runner.model.cfg
        self.y = torch.zeros(1, dtype=torch.long, device=dev)
        self.ext_ids = torch.zeros(k + 1, dtype=torch.long, device=dev)
        self.ext_hidden = torch.zeros(k + 1, cfg.hidden_size, dtype=runner.model.dtype, device=dev)
        self.j = torch.zeros((), dtype=torch.long, device=dev)
        self.pos = torch.full((), k + 1, dtype=torch.long, device=dev)     # any valid position for warm-up
        self.out = torch.zeros(k + 2, dtype=torch.long, device=dev)
        self.ar = torch.arange(k + 1, device=dev)
        self.kda = [st for st in runner.state if isinstance(st, KDAState)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}       # attention span -> captured round
        if capture:
            self._capture()

    def span(self) -> int | None:
        """Attention span for the next round: the smallest of ``runner.kv_buckets`` that holds the verify's last
        slot ``pos + k`` (the CUDA path's static span, as the decode graphs pick theirs); None on the dynamic CPU
        path."""
        return self.r.kv_span(self.r.pos + self.k + 1) if self.r.static_kv else None

    def _body(self, kv_len: int | None = None) -> None:
        r, dr, k, ar = self.r, self.dr, self.k, self.ar
        state, model = r.state, r.model
        # 1. draft-extend over the previous verify's k+1 positions; continue from row j
        eh = dr.hidden(self.ext_ids, self.ext_hidden, self.pos - self.j - 1 + ar, state, kv_len)
        dh = eh.index_select(0, self.j.view(1))                                 # [1, H]
        drafts = [dr.propose(dh)]        # full head, or the hot rows (fixed N: static shapes)
        # 2. k - 1 draft steps; draft i sits at pos + i - 1
        for i in range(1, k):
            dh = dr.hidden(drafts[-1], dh, (self.pos + (i - 1)).view(1), state, kv_len)
            drafts.append(dr.propose(dh))
        d = torch.cat(drafts)                                                   # [k]
        # 3. verify [y, d] at pos..pos+k, KDA state recorded after every token
        for st in self.kda:
            st.history = []
        vh = model(torch.cat([self.y, d]).view(1, k + 1), self.pos + ar, state, kv_len)[0]
        # 4. acceptance on the device
        j, bonus = accept_chain_device(model.logits(vh), d, self.p, self.gen)
        # 5. KDA rollback to the state after token j (MLA slots past the new pos are rewritten before use)
        sel = j.view(1)
        for st in self.kda:
            conv_h, rec_h = st.history_tensors()       # the fused kda kernel's buffers as they are, else a stack
            st.conv.copy_(conv_h.index_select(0, sel)[0])
            st.rec.copy_(rec_h.index_select(0, sel)[0])
            st.history = None
        # 6. the next round's inputs: token after position pos+t is d[t] for t < j and the bonus at t = j
        self.out.copy_(torch.cat([d, bonus.view(1), j.view(1)]))
        self.ext_ids.copy_(torch.where(ar == j, bonus, torch.cat([d, bonus.view(1)])))
        self.ext_hidden.copy_(vh)
        self.y.copy_(bonus.view(1))
        self.j.copy_(j)
        self.pos.add_(j + 1)

    def _capture(self) -> None:
        if self.r.device.type != "cuda":
            raise RuntimeError("capturing an MTP round needs a CUDA device")
        if not self.p.greedy:
            raise ValueError("a captured MTP round is greedy-only: sampling rounds run eagerly")
        bufs = [self.y, self.ext_ids, self.ext_hidden, self.j, self.pos]
        saved = [b.clone() for b in bufs]
        snap = _snapshot(self.r.state)

        def reset_bufs():
            for b, v in zip(bufs, saved):
                b.copy_(v)
        # One graph per attention span (runner.kv_buckets; one span, max_len, unless buckets are on), so the
        # round attends over what the sequence needs, like the decode graphs. Each replays only its own span.
        for span in self.r.kv_buckets:
            self.graphs[span], _ = capture_graph(lambda: self._body(span), 2, reset_bufs)
            _restore(self.r.state, snap)
            reset_bufs()
        self.captured_shapes = [{"op": "mtp_round", "draft_steps": self.k, "verify_tokens": self.k + 1,
                                 "kv_slots": span} for span in self.graphs]

    def start(self, prompt: torch.Tensor, hid: torch.Tensor, y: torch.Tensor) -> None:
        """Set the buffers after a prefill of ``prompt [P]`` (``P >= k + 2``) with hiddens ``hid [P, H]`` and first
        token ``y [1]``: the NEXTN runs eagerly over positions ``0 .. P-k-2``, the rest is the first replay's
        extend."""
        dev = self.r.device
        self.seed(torch.cat([prompt[1:].to(dev), y.view(1)]), hid, 0, y)

    def seed(self, ext_ids: torch.Tensor, ext_hidden: torch.Tensor, first: int, y: torch.Tensor) -> None:
        """Set the buffers from any committed point: ``ext_ids [E]`` / ``ext_hidden [E, H]`` are the NEXTN inputs
        not yet in its cache for positions ``first .. first + E - 1`` (token ``t + 1``, target hidden of ``t``),
        ending at ``runner.pos - 1``, with ``E >= k + 1``; ``y [1]`` the last committed token, not yet run. The NEXTN
        runs eagerly over all but the last ``k + 1`` positions; those become the next replay's extend (as if the
        previous round had accepted all ``k`` drafts). After a prefill ``first = 0`` (:meth:`start`); after plain
        decode steps, the positions they decoded (:mod:`bytebound.speculative.adaptive`).

        Raises:
            ValueError: fewer than ``k + 1`` positions, or positions that do not end at ``runner.pos - 1``.
        """
        k, dev = self.k, self.r.device
        e = ext_ids.shape[0]
        if e < k + 1 or first + e != self.r.pos:
            raise ValueError(f"seeding an MTP round needs >= {k + 1} pending NEXTN positions ending at "
                             f"{self.r.pos - 1}, got {e} from {first}")
        n0 = e - k - 1
        nextn_prefix(self.dr, ext_ids[:n0], ext_hidden[:n0], torch.arange(first, first + n0, device=dev),
                     self.r.state)
        self.ext_ids.copy_(ext_ids[n0:])
        self.ext_hidden.copy_(ext_hidden[n0:])
        self.y.copy_(y.view(1))
        self.j.fill_(k)
        self.pos.fill_(self.r.pos)

    @torch.inference_mode()
    def step(self) -> list[int]:
        """Run one round (graph replay if captured); returns ``[d_1..d_k, bonus, j]`` (the one host sync) and
        advances ``runner.pos`` by ``j + 1``."""
        span = self.span()
        g = self.graphs.get(span)
        if g is not None:
            g.replay()
        else:
            self._body(span)
        out = self.out.tolist()
        self.r.pos += out[-1] + 1
        return out


@torch.inference_mode()
def static_mtp_tokens(runner, drafter, prompt: torch.Tensor, p: SamplingParams, gen, stats,
                      round_: StaticRound | None = None):
    """Like :func:`bytebound.speculative.mtp.mtp_tokens`, but each round is one :class:`StaticRound` step (a CUDA
    graph replay when ``round_`` was captured). Yields ``(token, round)``. Prompts shorter than ``k + 2``
    tokens use the eager rounds.

    ``stats.verify_s`` receives the whole round's time (draft, verify and rollback are not separable inside one
    replay; ``draft_s`` and ``rollback_s`` stay 0).
    """
    k = drafter.steps
    if prompt.shape[0] < k + 2:
        yield from mtp_tokens(runner, drafter, prompt, p, gen, stats)
        return
    rnd = round_ if round_ is not None else StaticRound(runner, drafter, p, gen)
    dev = runner.device
    hid = runner.prefill(prompt.to(dev))
    y = sample(runner.logits(hid[-1:]), p, gen).view(1)
    yield int(y), 0
    rnd.start(prompt, hid, y)
    n = 0
    while True:
        runner._check_room(k + 1)                      # the verify writes k + 1 slots past the committed length
        n += 1
        t0 = time.perf_counter()
        out = rnd.step()
        stats.verify_s += time.perf_counter() - t0
        j, bonus = out[-1], out[-2]
        stats.add_round(j)
        for tok in out[:j] + [bonus]:
            stats.committed += 1
            yield tok, n
