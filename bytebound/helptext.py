"""Command-line help from module docstrings: the docstrings are written for Sphinx, ``--help`` is read in a
terminal, so the markup goes and the names stay (torch-free: ``bytebound analyze`` imports it)."""

from __future__ import annotations

import re

# :func:`x`, :mod:`a.b`, :meth:`~A.f` (Sphinx's tilde: show the last component only), :py:class:`X`
_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")          # ``--flag`` -> --flag
_BLOCK = re.compile(r"(\S)::$", re.MULTILINE)  # "Usage::" (a literal block follows) -> "Usage:"


def plain_doc(doc: str | None) -> str | None:
    """``doc`` (a reST docstring) as plain text for an argparse description: roles become their target's name
    (``:func:`add_verify_args``` -> ``add_verify_args``; ``:meth:`~a.B.f``` -> ``f``), inline literals lose
    their double backticks and a literal block's ``::`` becomes ``:``. Line breaks and indentation are kept
    (the commands print it with ``RawDescriptionHelpFormatter``). ``None`` (a module run with ``-OO``) stays
    ``None``."""
    if doc is None:
        return None
    doc = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), doc)
    return _BLOCK.sub(r"\1:", _LITERAL.sub(r"\1", doc))
