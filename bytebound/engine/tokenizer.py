"""Checkpoint tokenizer: a ``tokenizers.Tokenizer`` plus the chat template, eos and pad ids from the HF config files.

Reads ``tokenizer.json`` and ``tokenizer_config.json`` (``generation_config.json`` if present) and needs neither
transformers nor network. The chat template is rendered the way transformers renders it: a jinja2
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks`` and a ``raise_exception`` helper.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import tokenizers


def _token_str(tok: Any) -> str | None:
    # HF config files store special tokens either as a string or as an AddedToken dict {"content": ...}.
    return tok.get("content") if isinstance(tok, dict) else tok


def _as_ids(ids: Any) -> list[int]:
    # Accepts an int, a list of ints, or a torch / numpy array or scalar.
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def _raise_exception(message: str):
    raise ValueError(message)


@lru_cache(maxsize=8)
def _compile_template(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    """Render a jinja chat ``template`` over ``messages`` in a sandbox; ``kwargs`` become template variables."""
    return _compile_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)


class Tokenizer:
    """Byte-level BPE tokenizer of a checkpoint directory, with its chat template and stop ids."""

    def __init__(self, tok: tokenizers.Tokenizer, config: dict, generation_config: dict | None = None):
        self.tok = tok
        self.config = config
        self.generation_config = generation_config or {}
        self.chat_template: str | None = config.get("chat_template")

        ids: list[int] = []
        eos = self.token_id(_token_str(config.get("eos_token")))
        if eos is not None:
            ids.append(eos)
        gen_eos = self.generation_config.get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if i is not None and i not in ids:
                ids.append(int(i))
        self.eos_token_ids: tuple[int, ...] = tuple(ids)  # config eos first, then generation_config extras

        pad = self.token_id(_token_str(config.get("pad_token")))
        self.pad_token_id: int | None = pad if pad is not None else self.generation_config.get("pad_token_id")

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load from a checkpoint directory; raises ``FileNotFoundError`` naming a missing required file."""
        path = Path(path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{name} not found in checkpoint directory {path}")
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else None
        return cls(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")), config, gen)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-turn id (tokenizer_config's ``eos_token``)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def token_id(self, token: str | None) -> int | None:
        """Id of a single token string (e.g. ``"<|role_end|>"``), or ``None`` if it is not in the vocabulary."""
        return None if token is None else self.tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<role>``...) become their single ids."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The same ids as :meth:`encode`, but other Python threads (the server's event loop) keep running while
        it works: ``tokenizers.Tokenizer.encode`` holds the GIL for its whole run (seconds for a megabyte of
        text), ``encode_batch`` releases it. For callers off the main thread; one text, so no parallelism."""
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int] | Any, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; byte-level, so ``decode(encode(s)) == s`` for any string ``s``."""
        return self.tok.decode(_as_ids(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` (``[{"role", "content"}, ...]``) with the checkpoint's chat template to a string."""
        if not self.chat_template:
            raise ValueError("tokenizer_config.json has no chat_template")
        specials = {k: _token_str(self.config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        return render_chat_template(self.chat_template, messages, add_generation_prompt, **{**specials, **kwargs})

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        """A fresh streaming decoder over this tokenizer (one per generated sequence)."""
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas, never emitting part of a UTF-8 character.

    A byte-level token can end inside a multi-byte character; its decode then ends in U+FFFD. Such ids are held
    back until a later id completes the character. Decoding restarts from the last emitted boundary
    (``prefix``) so the cost per step stays small.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the window re-decoded each step
        self.read = 0  # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def decode_stream(self, ids: int | Iterable[int]) -> str:
        """Feed the newly generated id(s); return the text they complete ("" while a character is unfinished)."""
        self.ids.extend(_as_ids(ids))
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done):]
        return ""

    @property
    def complete(self) -> int:
        """How many of the fed ids have all their text emitted (the rest end inside an unfinished character)."""
        return self.read

    def flush(self) -> str:
        """Emit whatever is held back (as U+FFFD if the stream really ended inside a character)."""
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]
