"""Held-out documents no tokq benchmark calibrates on: the Debian Reference (English) and the Jargon File.

    apt-get install debian-reference-en jargon-text
    python benchmarks/heldout_docs.py [OUT]      (default: $TOKQ_HOME/data/heldout-shift)

The text issue 20 judged GPTQ on ("a Debian manual and a hacker dictionary"), as a folder
`benchmarks/calibration_shift.py --eval heldout=OUT` reads: each Debian Reference chapter's HTML as
plain text (tokq.longctx.html_text), and the Jargon File split at entry boundaries into parts of
about 84K characters, so that the document-clustered intervals have more than one cluster to
resample (a dictionary's entries are independent of each other). Licences: the Debian Reference
is GPL-2.0-or-later; the Jargon File is in the public domain (its Debian copyright file).
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

from tokq.longctx.html_text import html_to_text
from tokq.paths import data_dir

REFERENCE = Path("/usr/share/debian-reference")
JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
PART_CHARS = 84_000


def jargon_parts(text: str) -> list[str]:
    """The Jargon File cut at blank lines (between entries) into parts of just over PART_CHARS."""
    parts, current, size = [], [], 0
    for paragraph in text.split("\n\n"):
        current.append(paragraph)
        size += len(paragraph)
        if size > PART_CHARS:
            parts.append("\n\n".join(current))
            current, size = [], 0
    if current:
        parts.append("\n\n".join(current))
    return parts


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else data_dir() / "heldout-shift"
    chapters = sorted(REFERENCE.glob("ch[0-9][0-9].en.html"))
    if not chapters or not JARGON.is_file():
        sys.exit("install the Debian packages debian-reference-en and jargon-text first")
    out.mkdir(parents=True, exist_ok=True)
    for html in chapters:
        (out / html.name.replace(".html", ".txt")).write_text(html_to_text(html.read_text(encoding="utf-8")),
                                                               encoding="utf-8")
    parts = jargon_parts(gzip.decompress(JARGON.read_bytes()).decode("utf-8"))
    for i, part in enumerate(parts):
        (out / f"jargon-{i:02d}.txt").write_text(part, encoding="utf-8")
    print(f"{out}: {len(chapters)} Debian Reference chapters, {len(parts)} Jargon File parts")


if __name__ == "__main__":
    main()
