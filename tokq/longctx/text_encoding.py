"""Text to token ids for windowing: the TextEncoder a tokenizer is seen as, and `encode_text`, which encodes a
long document in bounded chunks (checked at each cut) and, with a budget, only as far as the budget reaches."""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from tokq.errors import ModelError

from .documents import Document

logger = logging.getLogger("tokq")

# A text longer than this many characters is encoded a chunk at a time (see encode_text).
CHUNK_CHARS = 1 << 18
# Characters before a cut that are encoded again, alone and with the next chunk, to check the cut.
SEAM_CHARS = 1024
# The first chunk when only a prefix is needed: this many characters, or 8 per id needed, if more.
MIN_PREFIX_CHARS = 4096
# A whitespace right after a letter or digit: a boundary between pre-tokens for byte-level BPE
# (GPT-2, Llama 3), SentencePiece/Metaspace and word-level tokenizers alike. After punctuation it is
# not always one: Llama 3 keeps ".\n\n" together.
_CLEAN_CUT = re.compile(r"[^\W_]\s")


@runtime_checkable
class TextEncoder(Protocol):
    """What windowing needs from a tokenizer: plain token ids for a text, and the BOS id."""

    bos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...


class HFTextEncoder:
    """A transformers tokenizer seen as a TextEncoder: encodes without special tokens (windows
    add BOS themselves) and says whether the model wants a BOS at the start of each window."""

    def __init__(self, tokenizer: Any, add_bos: bool):
        self.tokenizer = tokenizer
        self.bos_token_id: int | None = tokenizer.bos_token_id
        self.add_bos = add_bos
        self.name: str = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        if add_bos and self.bos_token_id is None:
            raise ModelError(f"{self.name}: the model needs a BOS token but its tokenizer defines none")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def __repr__(self) -> str:
        return f"HFTextEncoder({self.name!r}, add_bos={self.add_bos})"


def as_text_encoder(hf_tokenizer: Any, add_bos: bool) -> HFTextEncoder:
    return HFTextEncoder(hf_tokenizer, add_bos)


def tokenize_documents(documents: Iterable[Document], encoder: TextEncoder) -> dict[str, list[int]]:
    """Token ids (no special tokens) of each document, by doc_id."""
    return {doc.doc_id: encode_text(encoder, doc.text) for doc in documents}


def count_tokens(documents: Iterable[Document], encoder: TextEncoder) -> dict[str, int]:
    return {doc.doc_id: len(encode_text(encoder, doc.text)) for doc in documents}


def encode_text(encoder: TextEncoder, text: str, max_ids: int | None = None) -> list[int]:
    """The ids of `text`; with `max_ids`, the first ids of it, at least `max_ids` of them (all, if it
    has fewer), from encoding only a prefix of the text.

    A text longer than CHUNK_CHARS (or than a prefix needs) is encoded in chunks, each cut before a
    whitespace that follows a letter or digit, so a tokenizer never holds a 50 MB line at once. A cut
    must not change any id: the SEAM_CHARS before it are encoded alone and together with the next
    chunk, and must give the same ids both times (the cut is a token boundary) and end the same way
    the ids so far do. Where a check fails (a tokenizer whose ids depend on text far away, or a
    cut inside a long run without whitespace that splits a token), the whole text is encoded at
    once, as before: correct, bounded only by the per-document cap (--max-doc-mb).
    """
    if len(text) <= (CHUNK_CHARS if max_ids is None else _first_chunk(max_ids)):
        return list(encoder.encode(text))
    ids = _encode_chunks(encoder, text, max_ids)
    if ids is None:
        logger.debug("encoding a %d-character document whole: a chunk boundary changed its ids", len(text))
        return list(encoder.encode(text))
    return ids


def _first_chunk(max_ids: int) -> int:
    return min(CHUNK_CHARS, max(MIN_PREFIX_CHARS, 8 * max_ids))


def _encode_chunks(encoder: TextEncoder, text: str, max_ids: int | None) -> list[int] | None:
    """encode_text chunk by chunk; None where a cut fails its check."""
    size = CHUNK_CHARS if max_ids is None else _first_chunk(max_ids)
    ids: list[int] = []
    pos = 0  # text[:pos] is encoded into ids
    while pos < len(text):
        # a clean cut where there is one; else (no whitespace for a chunk's length) a hard one, which the checks
        # in _encode_after accept only where it changes no id
        end = len(text) if pos + size >= len(text) else _cut(text, pos + size, pos) or pos + size
        if pos == 0:
            ids = list(encoder.encode(text[:end]))
        else:
            more = _encode_after(encoder, text, pos, end, ids)
            if more is None:
                return None
            ids.extend(more)
        pos = end
        if max_ids is not None and len(ids) >= max_ids and pos < len(text):
            # no later chunk checks this last cut: check it against the text just after it
            after = _cut(text, pos + SEAM_CHARS, pos) or min(pos + SEAM_CHARS, len(text))
            return ids if _encode_after(encoder, text, pos, after, ids) is not None else None
        size = min(2 * size, CHUNK_CHARS)
    return ids


def _encode_after(encoder: TextEncoder, text: str, pos: int, end: int, ids: list[int]) -> list[int] | None:
    """The ids of text[pos:end] as they follow `ids` (the ids of text[:pos]), encoded with up to
    SEAM_CHARS of the text before `pos` as context; None if `pos` is not a clean token boundary."""
    start = _cut(text, pos - SEAM_CHARS, pos - 2 * SEAM_CHARS) or max(0, pos - SEAM_CHARS)
    head = list(encoder.encode(text[start:pos]))
    both = list(encoder.encode(text[start:end]))
    if both[: len(head)] != head:  # a token spans the cut, or text after it changed ids before it
        return None
    # The start of `head` may differ from `ids` (a tokenizer adds a prefix space at the start of a text),
    # but its second half, well past that start, must be what `ids` ends with.
    tail = len(head) // 2
    if tail and ids[-tail:] != head[-tail:]:
        return None
    return both[len(head) :]


def _cut(text: str, end: int, lo: int) -> int | None:
    """The last index in (lo, end] of a whitespace right after a letter or digit, or None."""
    lo = max(lo, 0)
    span = 256  # look near `end` first: most text has a cut within a few words
    while True:
        start = max(lo, end - span)
        last = deque(_CLEAN_CUT.finditer(text, start, end + 1), maxlen=1)
        if last:
            return last[0].start() + 1
        if start == lo:
            return None
        span *= 16
