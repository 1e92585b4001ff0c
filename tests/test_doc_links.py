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
