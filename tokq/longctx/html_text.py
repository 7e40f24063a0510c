"""Readable plain text of an HTML page (Sphinx manuals: the main body only), for the default document set."""

from __future__ import annotations

import re
from html.parser import HTMLParser

# Tags that end a line of text (of them, _PARAGRAPH_TAGS end a paragraph), tags whose content is never
# text, and void tags (no end tag).
_BLOCK_TAGS = frozenset(
    "p div section article aside h1 h2 h3 h4 h5 h6 li ul ol dl dt dd pre table tr blockquote br hr "
    "figure figcaption caption".split()
)
_PARAGRAPH_TAGS = frozenset("p pre section h1 h2 h3 h4 h5 h6 table blockquote".split())
_SKIP_TAGS = frozenset("script style nav header footer head noscript template svg".split())
_SKIP_CLASSES = frozenset("headerlink sphinxsidebar related footer navigation".split())
_VOID_TAGS = frozenset("area base br col embed hr img input link meta source track wbr".split())

_TAG = re.compile(r"<[^>]*>")


class _HTMLText(HTMLParser):
    """Plain text of an HTML page; with `main_only`, only inside the element with role="main"
    (Sphinx's page body), which leaves out navigation, sidebars and footers."""

    def __init__(self, main_only: bool):
        super().__init__(convert_charrefs=True)
        self.main_only = main_only
        self.stack: list[tuple[str, bool, bool]] = []  # open elements: (tag, skipped, role=main)
        self.n_skipped = self.n_main = self.n_pre = 0  # how many open elements are each kind
        self.parts: list[tuple[str, str]] = []  # (kind, value): kind is "text", "pre" or "break"

    def _count(self, entry: tuple[str, bool, bool], sign: int) -> None:
        tag, skipped, main = entry
        self.n_skipped += sign * skipped
        self.n_main += sign * main
        self.n_pre += sign * (tag == "pre")

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag in _BLOCK_TAGS:
            self.parts.append(("break", "\n\n" if tag in _PARAGRAPH_TAGS else "\n"))
        if tag in _VOID_TAGS:
            return
        skipped = tag in _SKIP_TAGS or bool(set((a.get("class") or "").split()) & _SKIP_CLASSES)
        entry = (tag, skipped, a.get("role") == "main")
        self.stack.append(entry)
        self._count(entry, +1)

    def handle_endtag(self, tag: str) -> None:
        # Pop to the matching tag; unclosed <p>/<li> inside it are closed implicitly.
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                for entry in self.stack[i:]:
                    self._count(entry, -1)
                del self.stack[i:]
                break
        if tag in _BLOCK_TAGS:
            self.parts.append(("break", "\n\n" if tag in _PARAGRAPH_TAGS else "\n"))

    def handle_data(self, data: str) -> None:
        if self.n_skipped or (self.main_only and not self.n_main):
            return
        self.parts.append(("pre", data) if self.n_pre else ("text", re.sub(r"\s+", " ", data)))

    def text(self) -> str:
        # Adjacent breaks (an </li><li>, or </p> then <h2>) merge into the largest of them;
        # flowing text loses the spaces around a break, <pre> text keeps its layout.
        out: list[str] = []
        pending = ""
        for kind, value in self.parts:
            if kind == "break":
                pending = max(pending, value, key=len)
                continue
            if pending and kind == "text":
                value = value.lstrip(" ")
                if not value:
                    continue
            if pending:
                out.append(pending)
                pending = ""
            out.append(value)
        return "".join(out)


def without_tags(html: str) -> str:
    """`html` with every tag removed and nothing else converted: a cheap measure of a page's length
    before parsing it."""
    return _TAG.sub("", html)


def html_to_text(html: str) -> str:
    """Readable plain text of an HTML page (Sphinx pages: the main body only)."""
    text = ""
    for main_only in (True, False):
        parser = _HTMLText(main_only)
        parser.feed(html)
        parser.close()
        text = parser.text()
        if text.strip():
            break
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"
