"""Hot-vocabulary draft head: the MTP draft steps score only the N most frequent tokens (issue 21).

The idea is FR-Spec's (Zhao et al. 2025, arXiv 2502.14856) and EAGLE-3's draft vocabulary (Li et al. 2025, arXiv
2503.01840): at batch 1 a draft step reads the whole LM head (Ling-3.0-flash: 157184 x 4096, 403 MB in FP8), yet
almost all accepted drafts are frequent tokens. Scoring a fixed row subset of N tokens reads N/V of those bytes.

* **Same module.** :class:`HotHead` is derived from the target's LM-head *module* (``LMHead``): the FP8 rows and
  their per-output-channel scales (``w_fp8[ids]``, ``w_scale[ids]``), or the BF16 rows for the bf16/fp32 paths,
  gathered once at load into contiguous copies, and bound to the same backend (``lm_head.backend``) as the full
  head. The ``draft_hot_rows`` canary proves the copies equal the head's rows bit for bit.
* **Lossless.** Verification always uses the full head. Drafts are the argmax over the hot set, mapped back to
  vocabulary ids: the proposal is ``q = delta(x)`` with ``x`` in the hot set - the hot-restricted draft
  distribution's mode - and every token outside the hot set has ``q = 0``. The acceptance rule of
  :mod:`bytebound.speculative.accept` (accept with ``min(1, p/q)``, resample from ``norm(max(0, p - q))``) is
  exact for any ``q``, so the emitted distribution is still the target's; cold tokens appear only through the
  residual (or bonus) draw. Greedy: a draft is accepted iff it equals the target argmax, so the output is plain
  greedy's whatever the draft proposes.
* **From data.** The hot set is the head of a token-frequency ranking over a corpus (bundled model: the GSM8K
  train solutions, tokenised as the model generates them), stored with its provenance
  (``scripts/hot_vocab.py`` writes ``models/ling-nano/draft_vocab.json``) or computed at load and cached per
  tokenizer. Its size is fixed at load, so the captured MTP round keeps static shapes.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

import torch

from bytebound.errors import ConfigError

RANKING_FILE = "draft_vocab.json"      # in the checkpoint dir: frequency ranking + provenance
FORMAT = "bytebound.draft_vocab/1"
ALIGN = 128                            # coverage-sized hot sets round up to this (FP8 GEMV tile, cuBLAS /16)
DEFAULT_COVERAGE = 0.99


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---- the frequency ranking ------------------------------------------------------------------------------
def gsm8k_completion_texts() -> list[tuple[str, str]]:
    """``(prompt, completion)`` pairs of the bundled GSM8K train split in the two forms the bundled model was
    trained on and generates: the chat assistant turn and the 5-shot completion ``" " + clean solution``. The
    prompts are given so that completions are tokenised in context (BPE merges across the boundary)."""
    from bytebound.data.gsm8k import clean_solution, load_split
    return [(r["question"], clean_solution(r["answer"])) for r in load_split("train")]


def count_tokens(tokenizer, vocab_size: int) -> tuple[torch.Tensor, dict]:
    """Token counts ``[V]`` int64 of what the model generates for the GSM8K train questions: the completion tokens
    (and the EOS that ends them) of the chat form, and those of the 5-shot form's ``" " + solution``.

    Completion tokens are the full text's tokens after the prompt's, when the prompt's tokens are a prefix of the
    full text's (always for the chat template, whose generation prompt ends in a special token); otherwise the
    completion is tokenised alone. Returns ``(counts, info)`` with the counted token total.

    Raises:
        ConfigError: a token id outside ``[0, vocab_size)`` (tokenizer and model do not match)."""
    from bytebound.data.gsm8k import chat_messages
    counts = torch.zeros(vocab_size, dtype=torch.long)
    eos = tokenizer.eos_token_id
    total = 0

    def add(prompt_ids: list[int], full_ids: list[int], completion: str) -> None:
        nonlocal total
        n = len(prompt_ids)
        ids = full_ids[n:] if full_ids[:n] == prompt_ids else tokenizer.encode(completion)
        t = torch.tensor(ids, dtype=torch.long)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
            raise ConfigError(f"draft vocabulary: the tokenizer produced id {int(t.max())} outside the model's "
                              f"vocabulary [0, {vocab_size}): tokenizer and checkpoint do not match")
        counts.index_add_(0, t, torch.ones_like(t))
        total += t.numel()
    for q, sol in gsm8k_completion_texts():
        prompt = tokenizer.apply_chat_template(chat_messages(q))
        full = tokenizer.apply_chat_template(chat_messages(q, sol), add_generation_prompt=False)
        add(tokenizer.encode(prompt), tokenizer.encode(full), sol)
        shot = f"Question: {q.strip()}\nAnswer:"
        add(tokenizer.encode(shot), tokenizer.encode(shot + " " + sol), " " + sol)
    if eos is not None and 0 <= eos < vocab_size:
        counts[eos] = max(int(counts[eos]), 1)      # generation ends with it: never leave it out
    return counts, {"tokens_counted": total}


def ranking_from_counts(counts: torch.Tensor) -> list[int]:
    """Token ids by descending count, ties (and unseen tokens) by ascending id: a deterministic total order."""
    order = sorted(range(counts.numel()), key=lambda i: (-int(counts[i]), i))
    return order


def build_ranking(model_dir: str | Path, tokenizer, vocab_size: int) -> dict:
    """The ranking record (``draft_vocab.json``): format, vocab size, provenance (corpus file and tokenizer with
    their SHA-256, what was counted) and ``ranking`` / ``counts`` (seen tokens only; unseen follow by id)."""
    from bytebound.data.gsm8k import ASSET_DIR
    counts, info = count_tokens(tokenizer, vocab_size)
    rank = ranking_from_counts(counts)
    seen = int((counts > 0).sum())
    corpus = ASSET_DIR / "train.jsonl"
    return {"format": FORMAT, "vocab_size": vocab_size,
            "provenance": {"corpus": "bytebound/assets/gsm8k/train.jsonl", "corpus_sha256": _sha256(corpus),
                           "tokenizer_sha256": _sha256(Path(model_dir) / "tokenizer.json"),
                           "counted": "completion tokens of every train question in the chat form (assistant turn "
                                      "+ EOS) and the 5-shot form (' ' + clean solution), tokenised in context",
                           **info, "distinct_tokens_seen": seen},
            "ranking": rank[:seen], "counts": [int(counts[i]) for i in rank[:seen]]}


@lru_cache(maxsize=4)
def _computed_ranking(model_dir: str, tok_sha: str, vocab_size: int) -> str:
    from bytebound.engine.tokenizer import Tokenizer
    return json.dumps(build_ranking(model_dir, Tokenizer.from_dir(model_dir), vocab_size))


def load_ranking(model_dir: str | Path, vocab_size: int) -> dict:
    """The checkpoint's ranking record: ``model_dir/draft_vocab.json`` when present, else computed now from the
    bundled GSM8K train split with the checkpoint's tokenizer (cached in-process per tokenizer hash).

    Raises:
        ConfigError: no ranking file and no ``tokenizer.json`` to compute one; a file of another format, vocab
            size or tokenizer (stale: rerun ``scripts/hot_vocab.py``)."""
    model_dir = Path(model_dir)
    tok = model_dir / "tokenizer.json"
    f = model_dir / RANKING_FILE
    if f.is_file():
        try:
            rec = json.loads(f.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConfigError(f"{f}: not JSON ({e})") from None
        if not isinstance(rec, dict) or rec.get("format") != FORMAT or rec.get("vocab_size") != vocab_size:
            raise ConfigError(f"{f}: expected format {FORMAT!r} for vocab_size {vocab_size}, got format "
                              f"{rec.get('format') if isinstance(rec, dict) else type(rec).__name__!r}, vocab_size "
                              f"{rec.get('vocab_size') if isinstance(rec, dict) else None}")
        want = rec.get("provenance", {}).get("tokenizer_sha256")
        if tok.is_file() and want is not None and want != _sha256(tok):
            raise ConfigError(f"{f} was counted with another tokenizer.json (sha256 {want[:12]}..., this one "
                              f"{_sha256(tok)[:12]}...): rerun scripts/hot_vocab.py")
        return rec
    if not tok.is_file():
        raise ConfigError(f"--speculative-draft-vocab: {model_dir} has neither {RANKING_FILE} nor a tokenizer.json "
                          "to count token frequencies with; pass a token-id file instead")
    return json.loads(_computed_ranking(str(model_dir), _sha256(tok), vocab_size))


def size_for_coverage(counts: list[int], coverage: float, vocab_size: int, align: int = ALIGN) -> int:
    """Smallest N whose top-N tokens hold ``coverage`` of the counted mass, rounded up to ``align`` (<= V)."""
    c = torch.tensor(counts, dtype=torch.float64)
    cum = c.cumsum(0) / c.sum()
    n = int((cum < coverage).sum()) + 1
    return min(vocab_size, -(-n // align) * align)


def hot_ids_from_ranking(rec: dict, n: int) -> list[int]:
    """The first ``n`` ids of the record's ranking (seen tokens, then unseen ones by ascending id)."""
    v = rec["vocab_size"]
    rank = list(rec["ranking"])
    if n > len(rank):
        seen = set(rank)
        rank += [i for i in range(v) if i not in seen][: n - len(rank)]
    return rank[:n]


def read_id_file(path: str | Path, vocab_size: int) -> tuple[list[int], dict]:
    """Token ids from a file: JSON ``{"ids": [...]}`` (other keys kept as provenance), a JSON list, a ranking record
    (its :data:`DEFAULT_COVERAGE` head), or text with ids separated by commas / whitespace.

    Raises:
        ConfigError: unreadable file or entries that are not integers."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--speculative-draft-vocab {path}: cannot read ({e})") from None
    prov = {"file": str(p), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    try:
        obj = json.loads(text)
    except ValueError:
        try:
            return [int(t) for t in text.replace(",", " ").split()], prov
        except ValueError:
            raise ConfigError(f"--speculative-draft-vocab {path}: expected JSON or integer token ids") from None
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        n = size_for_coverage(obj["counts"], DEFAULT_COVERAGE, obj["vocab_size"])
        return hot_ids_from_ranking(obj, n), {**prov, "coverage": DEFAULT_COVERAGE, **obj.get("provenance", {})}
    ids = obj.get("ids") if isinstance(obj, dict) else obj
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"--speculative-draft-vocab {path}: 'ids' must be a list of integers")
    if isinstance(obj, dict):
        prov.update({k: v for k, v in obj.items() if k != "ids"})
    return ids, prov


def resolve_draft_vocab(spec, model_dir: str | Path, vocab_size: int) -> tuple[list[int], dict] | None:
    """Turn ``EngineConfig.draft_vocab`` into ``(ids, provenance)``, or None for the full head.

    ``spec``: None / 0 = full head; an int N > 0 = the N most frequent tokens of the checkpoint's ranking; a float
    in (0, 1) = the fewest tokens covering that share of the counted mass (rounded up to :data:`ALIGN`); a str /
    Path = a token-id file (:func:`read_id_file`); a numeric string is read as a number.

    Raises:
        ConfigError: N < 0 or N > V, a coverage outside (0, 1), or anything :func:`load_ranking` /
            :func:`read_id_file` raises."""
    if spec is None or spec == 0 or spec == "":
        return None
    if isinstance(spec, str):
        try:
            spec = int(spec)
        except ValueError:
            try:
                spec = float(spec)
            except ValueError:
                return read_id_file(spec, vocab_size)
        if spec == 0:
            return None
    if isinstance(spec, Path):
        return read_id_file(spec, vocab_size)
    if isinstance(spec, bool) or not isinstance(spec, (int, float)):
        raise ConfigError(f"draft_vocab must be None, a token count, a coverage in (0, 1) or a file, got {spec!r}")
    if isinstance(spec, float) and not spec.is_integer():
        if not 0.0 < spec < 1.0:
            raise ConfigError(f"--speculative-draft-vocab: a coverage must lie in (0, 1), got {spec}")
        rec = load_ranking(model_dir, vocab_size)
        n = size_for_coverage(rec["counts"], spec, vocab_size)
        return hot_ids_from_ranking(rec, n), {**rec["provenance"], "coverage": spec}
    n = int(spec)
    if not 0 < n <= vocab_size:
        raise ConfigError(f"--speculative-draft-vocab: N must be in [1, {vocab_size}] (the vocabulary; 0: the full "
                          f"head), got {n}")
    rec = load_ranking(model_dir, vocab_size)
    c = torch.tensor(rec["counts"], dtype=torch.float64)
    covered = float(c[:n].sum() / c.sum())
    return hot_ids_from_ranking(rec, n), {**rec["provenance"], "top_n": n, "coverage": round(covered, 6)}


# ---- the head ------------------------------------------------------------------------------------------
class HotHead:
    """A row subset of the target's LM-head module: ``logits [M, N] float32 = head(x [M, H])[:, ids]``.

    Holds ``head`` (the target's ``LMHead`` object itself), ``ids [N]`` int64 (sorted, unique vocabulary ids, on
    the head's device) and gathered contiguous copies of the rows the head's path reads: ``w_fp8 [N, H]``
    float8_e4m3fn + ``w_scale [N]`` float32 (fp8), or ``weight [N, H]`` in the checkpoint dtype (bf16, fp32). It
    duck-types the ``LMHead`` attributes the backends read (``mode``, ``weight``, ``w_fp8``, ``w_scale``) and is
    bound with the head's own backend, so draft logits take the full head's path on fewer rows.

    Args:
        head: the target's ``LMHead`` (configured; ``head.backend`` as ``bind_model`` resolved it, or None for
            the torch reference). ids: token ids (any order, no duplicates). provenance: where the set came from.
    Raises:
        ConfigError: empty ids, duplicates, ids outside ``[0, V)``.
    """

    def __init__(self, head, ids, provenance: dict | None = None):
        v = head.weight.shape[0]
        t = torch.as_tensor(ids, dtype=torch.long).flatten().cpu()
        if t.numel() == 0:
            raise ConfigError("the draft vocabulary is empty")
        if int(t.min()) < 0 or int(t.max()) >= v:
            bad = int(t.min()) if int(t.min()) < 0 else int(t.max())
            raise ConfigError(f"draft vocabulary id {bad} outside the model's vocabulary [0, {v})")
        t = t.sort().values
        if t.numel() > 1 and bool((t[1:] == t[:-1]).any()):
            raise ConfigError(f"draft vocabulary has duplicate ids (e.g. {int(t[1:][t[1:] == t[:-1]][0])})")
        self.head = head
        self.ids = t.to(head.weight.device)
        self.provenance = dict(provenance or {})
        self.build()

    @property
    def n(self) -> int:
        """N, the number of hot tokens (fixed at load: the captured round's shapes depend on it)."""
        return self.ids.numel()

    def build(self) -> None:
        """Gather the rows for the head's current mode and bind the head's backend to them (at load; again if the
        head's mode changes)."""
        head = self.head
        self.mode = head.mode
        with torch.no_grad():
            if head.mode == "fp8":
                self.weight = None
                self.w_fp8 = head.w_fp8.index_select(0, self.ids).contiguous()
                self.w_scale = head.w_scale.index_select(0, self.ids).contiguous()
            else:
                self.weight = head.weight.detach().index_select(0, self.ids).contiguous()
                self.w_fp8 = self.w_scale = None
        self.backend = head.backend
        self.fn = None
        if head.backend is not None and head.fn is not None:
            from bytebound.kernels.registry import resolve
            impl, _ = resolve("lm_head", head.backend, self.ids.device)
            self.fn = impl.bind(self, head.weight.dtype)

    def bytes_per_call(self) -> int:
        """Weight bytes one draft step reads: N*H*2 (BF16), N*H + 4N (FP8 + scales) - the full head's x N/V."""
        n, h = self.n, self.head.weight.shape[1]
        return n * h + 4 * n if self.mode == "fp8" else n * h * self.head.weight.element_size()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Hot-set logits ``[.., N]`` float32 for ``x [.., H]``, column i for vocabulary id ``ids[i]``."""
        if self.mode != self.head.mode:
            self.build()
        from bytebound.layers.lm_head import head_logits
        return head_logits(self, x)

    def propose(self, x: torch.Tensor) -> torch.Tensor:
        """Draft tokens ``[..]`` int64 (vocabulary ids): the argmax over the hot set, on the device, no sync."""
        if self.mode != self.head.mode:
            self.build()
        from bytebound.layers.lm_head import head_argmax
        # the hot rows' argmax mapped to vocabulary ids, both inside the head kernel where the backend can
        return head_argmax(self, x, self.ids)

    def facts(self) -> dict:
        """Manifest facts: size, share of V, bytes per draft step vs the full head's, provenance."""
        v = self.head.weight.shape[0]
        full = self.head.bytes_per_call()
        return {"n": self.n, "vocab_size": v, "share": round(self.n / v, 6), "head_mode": self.mode,
                "bytes_per_draft_step": self.bytes_per_call(), "full_head_bytes": full,
                "saved_bytes_per_draft_step": full - self.bytes_per_call(), "provenance": self.provenance}
