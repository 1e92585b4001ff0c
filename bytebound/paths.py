"""Paths the package needs before anything heavy loads (the command line builds its parser from them)."""

from __future__ import annotations

from pathlib import Path

#: the bundled, trained ling-nano checkpoint next to the source tree (hence the editable install)
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "ling-nano"
