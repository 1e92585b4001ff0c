"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p with a seed).

Processing order follows SGLang/vLLM: logits / T -> softmax -> top-k renorm -> top-p renorm
(``docs/references.md`` §2.4). The same :func:`probs` feeds plain sampling and speculative
verification, so both sample from exactly the same target distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bytebound.errors import RequestError

MAX_TOKENS_LIMIT = 1 << 20
MAX_LOGPROBS = 20                   # the most alternatives per token (OpenAI's and vLLM's default limit)


@dataclass
class SamplingParams:
    """Per-request generation settings (OpenAI-compatible names).

    temperature 0 means greedy. top_k <= 0 and top_p = 1 disable those filters. ``stop``: strings that end
    the output (not included in it); ``stop_token_ids``: extra ids beside the model's EOS ids.

    ``logprobs``: None = off; an int k in [0, ``MAX_LOGPROBS``] = report, for each output token, its log
    probability and (k >= 1) the k most likely tokens with theirs. The values are natural-log ``log_softmax`` of
    the model's raw logits in float32, before temperature, top-k and top-p (vLLM's default ``raw_logprobs``), so
    they do not depend on the sampling settings. A logprobs request decodes without MTP speculation
    (``Engine._tokens``).
    """
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop or ())
        self.stop_token_ids = tuple(self.stop_token_ids or ())
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def validate(self) -> None:
        """Raise :class:`RequestError` naming the first out-of-range field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or \
                not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise RequestError(f"max_tokens must be an int in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens!r}",
                               "max_tokens")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature!r}", "temperature")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}", "top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 63):
            raise RequestError(f"seed must be an int in [0, 2^63), got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings", "stop")
        if len(self.stop) > 16:
            raise RequestError("at most 16 stop strings", "stop")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be null or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                               "logprobs")


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Target distribution ``[.., V]`` float32 after temperature, top-k and top-p (renormalised each time)."""
    x = logits.float() / max(float(p.temperature), 1e-6)
    pr = torch.softmax(x, -1)
    v = pr.shape[-1]
    if 0 < p.top_k < v:
        kth = pr.topk(p.top_k, -1).values[..., -1:]
        pr = torch.where(pr >= kth, pr, torch.zeros_like(pr))
        pr = pr / pr.sum(-1, keepdim=True)
    if p.top_p < 1.0:
        sp, idx = pr.sort(-1, descending=True)
        cum = sp.cumsum(-1)
        keep = (cum - sp) < p.top_p                      # keep tokens until the mass before them reaches top_p
        # ... and always the most likely one: a top_p below float32's smallest value (1e-300) compares as 0 < 0,
        # which would keep nothing and turn the distribution into 0/0 = NaN
        keep[..., 0] = True
        sp = torch.where(keep, sp, torch.zeros_like(sp))
        pr = torch.zeros_like(pr).scatter_(-1, idx, sp)
        pr = pr / pr.sum(-1, keepdim=True)
    return pr


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``logits [.., V]`` (int64 ``[..]``): argmax when greedy, else an inverse-CDF draw."""
    if p.greedy:
        return logits.argmax(-1)
    pr = probs(logits, p)
    return draw(pr, gen)


def draw(pr: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """Sample one index per row of ``pr [.., V]`` by inverse CDF, one float64 uniform per row
    (:func:`inverse_cdf`).

    Used instead of ``torch.multinomial``: with ``multinomial`` on a shared CPU generator the chi-square test of
    MTP sampling (tests/test_spec_sampling.py) failed at p < 1e-4; with inverse-CDF draws it passes (cause
    inside multinomial not isolated). Sync-free on CUDA.
    """
    rows = pr.numel() // pr.shape[-1]
    return inverse_cdf(pr, torch.rand(rows, 1, generator=gen, device=pr.device, dtype=torch.float64))


def inverse_cdf(pr: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index per row of ``pr [.., V]`` (float, unnormalised allowed) where the float64 cumulative sum first
    reaches ``u * total``, ``u [rows, 1]`` float64 uniforms in [0, 1) (``rows`` = the product of ``pr``'s leading
    dims): :func:`draw` with its uniforms given, so a captured MTP round can read them from a buffer. int64
    ``[..]``, sync-free."""
    flat = pr.reshape(-1, pr.shape[-1]).double()
    cdf = flat.cumsum(-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp(max=pr.shape[-1] - 1)
    return idx.view(pr.shape[:-1])


class SamplingBuffers:
    """A request's temperature / top-p / top-k as device tensors, for :func:`probs_device`: one CUDA graph that
    reads them serves every sampling setting (the captured MTP round, ``speculative.round``). :meth:`write` fills
    them from a :class:`SamplingParams` with device fills only (no host sync, nothing captured).

    Buffers (0-d, on ``device``): ``temperature`` float32 ``max(T, 1e-6)`` (the divisor :func:`probs` uses),
    ``inv_temperature`` float32 ``1 / max(T, 1e-6)`` divided in double and rounded once (the factor CUDA's
    division by a Python scalar multiplies with, see :func:`probs_device`), ``top_p`` float32, ``top_p_on`` bool
    (``top_p < 1`` decided on the Python float, as :func:`probs` decides it), ``top_k`` int64.
    """

    def __init__(self, device, p: SamplingParams | None = None):
        f32 = dict(dtype=torch.float32, device=device)
        self.temperature = torch.ones((), **f32)
        self.inv_temperature = torch.ones((), **f32)
        self.top_p = torch.ones((), **f32)
        self.top_p_on = torch.zeros((), dtype=torch.bool, device=device)
        self.top_k = torch.zeros((), dtype=torch.long, device=device)
        if p is not None:
            self.write(p)

    def write(self, p: SamplingParams) -> None:
        """Set the buffers to ``p``'s settings (``p.temperature``, ``p.top_p``, ``p.top_k``)."""
        t = max(float(p.temperature), 1e-6)        # probs' divisor; fill_ rounds each value once to float32
        self.temperature.fill_(t)
        self.inv_temperature.fill_(1.0 / t)         # divided in double, as ATen's CUDA division by a scalar
        self.top_p.fill_(float(p.top_p))
        self.top_p_on.fill_(float(p.top_p) < 1.0)
        self.top_k.fill_(int(p.top_k))


def probs_device(logits: torch.Tensor, b: SamplingBuffers) -> torch.Tensor:
    """:func:`probs` with the settings in device tensors (``b``): float32 ``[.., V]`` from ``logits [.., V]``,
    static shapes, no host read (CUDA-graph capturable). The same float32 operations in the same order, so the
    result equals :func:`probs` bit for bit (tests/test_sampling.py on CPU, tests/gpu/test_engine_gpu.py on CUDA):

    * temperature: CUDA divides a tensor by a Python scalar as a multiply by the reciprocal computed in double
      and rounded once to float32 (ATen's ``div_true_kernel_cuda``; on the H200 neither a true float32 division
      nor the float32 reciprocal of float32(T) is bit-equal at every T, e.g. T = 1.7); the CPU truly divides.
      Each device here does what :func:`probs` does there.
    * top-k: the k-th largest value is read from a full descending sort (``topk`` needs k on the host); values
      ``>=`` it stay (ties at the k-th value all stay), renormalised; a filter that :func:`probs` would skip (k
      <= 0 or k >= V) is computed and then not selected, so its renormalisation leaves no trace.
    * top-p: as :func:`probs`, on a second sort of the top-k result (the order of tied values at the cut must be
      the one :func:`probs`'s sort gives), selected by ``top_p_on``.
    """
    x = logits.float()
    x = x * b.inv_temperature if x.is_cuda else x / b.temperature
    pr = torch.softmax(x, -1)
    v = pr.shape[-1]
    sp = pr.sort(-1, descending=True).values
    kth = sp.gather(-1, (b.top_k - 1).clamp(0, v - 1).expand(*sp.shape[:-1], 1))
    filt = torch.where(pr >= kth, pr, torch.zeros_like(pr))
    filt = filt / filt.sum(-1, keepdim=True)
    pr = torch.where((b.top_k > 0) & (b.top_k < v), filt, pr)
    sp, idx = pr.sort(-1, descending=True)
    cum = sp.cumsum(-1)
    keep = (cum - sp) < b.top_p
    keep[..., 0] = True                                  # the most likely token always stays (see probs)
    sp = torch.where(keep, sp, torch.zeros_like(sp))
    pp = torch.zeros_like(pr).scatter_(-1, idx, sp)
    pp = pp / pp.sum(-1, keepdim=True)
    return torch.where(b.top_p_on, pp, pr)


def make_generator(p: SamplingParams, device) -> torch.Generator | None:
    """A seeded generator for ``p.seed`` (None: nondeterministic unless greedy)."""
    if p.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(p.seed if p.seed is not None else torch.seed() % (1 << 62))
    return g


__all__ = ["SamplingParams", "SamplingBuffers", "probs", "probs_device", "sample", "draw", "inverse_cdf",
           "make_generator"]
