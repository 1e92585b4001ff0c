"""Every relative link and image in the repository's Markdown (README, docs, the package's and the bundled model's
notes) points at a file that exists: reports renamed when committed had kept the plot names their run wrote."""

from __future__ import annotations

import re

from conftest import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files():
    yield ROOT / "README.md"
    for top in ("docs", "bytebound", "models"):
        yield from sorted((ROOT / top).glob("**/*.md"))


def test_relative_links_resolve():
    files = list(markdown_files())
    assert len(files) > 50, "the scan found too few Markdown files to mean anything"
    broken = []
    for md in files:
        for m in LINK.finditer(md.read_text(encoding="utf-8", errors="replace")):
            target = m.group(1).split("#")[0]
            if target and not target.startswith(("http://", "https://", "mailto:")) and \
                    not (md.parent / target).exists():
                broken.append(f"{md.relative_to(ROOT)}: {m.group(1)}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def _cells(row: str) -> int:
    """The cells of a Markdown table row: ``|`` outside code spans, not escaped."""
    n, code, prev = 0, False, ""
    for ch in row.strip().strip("|"):
        if ch == "`":
            code = not code
        elif ch == "|" and not code and prev != "\\":
            n += 1
        prev = ch
    return n + 1


def test_tables_keep_their_column_count():
    """Every row of a Markdown table has as many cells as its header: a row glued onto another, or a stray
    one-cell row, no longer renders as the table it sits in (found in docs/perf/README.md by a fresh reader)."""
    bad = []
    for md in markdown_files():
        lines = md.read_text(encoding="utf-8", errors="replace").splitlines()
        for k in range(1, len(lines)):
            if not re.fullmatch(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*", lines[k].strip()):
                continue
            want, j = _cells(lines[k - 1]), k + 1
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                if _cells(lines[j]) != want:
                    bad.append(f"{md.relative_to(ROOT)}:{j + 1}: {_cells(lines[j])} cells, header has {want}")
                j += 1
    assert not bad, "table rows whose cell count differs from the header's:\n" + "\n".join(bad[:40])
