"""Cut tokenized documents into the fixed-length windows that get scored.

Each document is encoded on its own (no special tokens), then split into windows of at most
`window` tokens. With `add_bos` every window starts with the BOS token, so it holds
`window - 1` document tokens: the model sees each window as the start of a sequence, which is
what models trained with BOS (Gemma) need. Consecutive windows of a document start `stride`
document tokens apart; `stride < capacity` makes them overlap, so tokens late in one window are
scored again early in the next with more context, and `score_from` marks where the new ones
begin, so that every document token is counted exactly once across a document's windows.

A long document is encoded in bounded chunks (`text_encoding.encode_text`), and with a budget (`max_tokens`,
`max_windows`) only as far as the budget can reach: a 50 MB single-line document scored with
`--max-tokens 512` costs a few KB of tokenization, not the whole line at once (measured: 59 s and
6 GB RSS before).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tokq.errors import ConfigError, ModelError

from .documents import Document
from .text_encoding import TextEncoder, encode_text

logger = logging.getLogger("tokq")

class WindowConfigError(ConfigError, ValueError):
    """A window/stride/budget value that cannot work: a ConfigError for the CLI (exit 2), and a
    ValueError for library callers."""


@dataclass(frozen=True)
class TokenWindow:
    """One sequence to score, cut from document `doc_id`.

    `tokens` is `[BOS] + doc_tokens[start : start + n]` when `has_bos`, else `doc_tokens[start :
    start + n]`; `start` is an offset into the document's own token stream (BOS not counted).

    `score_from` is the first index into `tokens` whose token no earlier window of the same
    document contained: 1 for a document's first window with BOS (the BOS is not a document
    token), 0 for it without BOS, and `window - stride` for every later window (the overlap
    with the previous window, plus the BOS). So `tokens[score_from:]` over a document's windows
    are its tokens, each exactly once. Index 0 has no context to be predicted from: a scorer
    takes log p(tokens[i] | tokens[:i]) for i in `scored_positions`, which is the same as
    `positions` except that it never includes 0.
    """

    doc_id: str
    window_index: int
    start: int
    tokens: list[int] = field(repr=False)
    has_bos: bool
    score_from: int

    @property
    def positions(self) -> range:
        """Indices into `tokens` of the tokens this window adds."""
        return range(self.score_from, len(self.tokens))

    @property
    def scored_positions(self) -> range:
        """Indices whose next-token prediction this window contributes (`positions` minus 0)."""
        return range(max(self.score_from, 1), len(self.tokens))

    @property
    def doc_positions(self) -> range:
        """Document token offsets of `positions`."""
        shift = self.start - int(self.has_bos)
        return range(self.score_from + shift, len(self.tokens) + shift)

    @property
    def n_new(self) -> int:
        return len(self.tokens) - self.score_from


@dataclass
class WindowSet:
    """The windows of a set of documents and how they were cut.

    `n_tokens` counts every token of every window (BOS and overlap included: what the engine
    runs); `n_new_tokens` counts document tokens, each once. `dropped_tails` counts final windows
    of a document shorter than `min_window_tokens` document tokens (their tokens are not
    scored); `dropped_documents` are documents shorter than that in total. `stopped_by` is
    "max_tokens" or "max_windows" when a budget ended the set early, else None.
    """

    windows: list[TokenWindow]
    window: int
    stride: int
    add_bos: bool
    n_documents: int
    n_tokens: int
    dropped_tails: int = 0
    dropped_documents: list[str] = field(default_factory=list)
    min_window_tokens: int = 0
    stopped_by: str | None = None
    # ids encoded per document looked at; for one a budget ended inside, a prefix's count (which
    # is more than a window holds), not the document's
    doc_tokens: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def n_new_tokens(self) -> int:
        return sum(w.n_new for w in self.windows)

    def summary(self) -> str:
        overlap = self.window - int(self.add_bos) - self.stride
        line = (
            f"{len(self.windows):,} windows of up to {self.window:,} tokens "
            f"(stride {self.stride:,}, overlap {overlap:,}{', BOS first' if self.add_bos else ''}) "
            f"from {self.n_documents:,} documents: {self.n_tokens:,} tokens run, "
            f"{self.n_new_tokens:,} scored"
        )
        notes = []
        if self.dropped_tails:
            notes.append(f"dropped {self.dropped_tails:,} tail windows under {self.min_window_tokens} tokens")
        if self.dropped_documents:
            notes.append(
                f"dropped {len(self.dropped_documents):,} documents under {self.min_window_tokens} tokens"
            )
        if self.stopped_by:
            notes.append(f"stopped early at {self.stopped_by}")
        return line + "".join(f"\n{n}" for n in notes)

    def sample(self, count: int) -> WindowSet:
        """`count` windows spread evenly over the whole set (deterministic), for a quick look at
        every source of a large corpus. A sampled document is scored on its sampled windows only."""
        if count < 1:
            raise WindowConfigError(f"the number of sampled windows must be positive, got {count}")
        if count >= len(self.windows):
            return self
        step = len(self.windows) / count
        picked = [self.windows[int(i * step)] for i in range(count)]
        return replace(
            self,
            windows=picked,
            n_documents=len({w.doc_id for w in picked}),
            n_tokens=sum(len(w.tokens) for w in picked),
            stopped_by=f"sampled {count} of {len(self.windows)} windows",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_windows": len(self.windows),
            "window": self.window,
            "stride": self.stride,
            "add_bos": self.add_bos,
            "n_documents": self.n_documents,
            "n_tokens": self.n_tokens,
            "n_new_tokens": self.n_new_tokens,
            "min_window_tokens": self.min_window_tokens,
            "dropped_tails": self.dropped_tails,
            "dropped_documents": list(self.dropped_documents),
            "stopped_by": self.stopped_by,
        }


def build_windows(
    documents: Iterable[Document],
    encoder: TextEncoder,
    window: int,
    stride: int | None = None,
    add_bos: bool | None = None,
    max_tokens: int | None = None,
    min_window_tokens: int = 16,
    max_windows: int | None = None,
    encoded: Mapping[str, Sequence[int]] | None = None,
) -> WindowSet:
    """Split each document (in the given order) into windows of at most `window` tokens.

    `stride` is in document tokens, default the window's capacity (`window`, or `window - 1`
    with BOS): no overlap. `add_bos` defaults to the encoder's `add_bos` attribute (False if it
    has none). A final window with fewer than `min_window_tokens` document tokens (at most the
    window's capacity) is dropped, counted in `dropped_tails`, and so is a document shorter
    than that: a near-empty sequence costs a forward pass and measures only short-context
    positions. With overlap a tail holds the overlap too, so it is rarely that short. `max_tokens` caps the sum of `len(tokens)` over windows and
    `max_windows` their number; windows are taken in order and the set stops before the first
    one that would exceed a cap, so the result is always a prefix of the uncapped set.
    `encoded` holds token ids already computed by doc_id, to avoid encoding twice; without it, a
    document is encoded only as far as the caps can reach (`_ids_needed`), with the same result.
    """
    if add_bos is None:
        add_bos = bool(getattr(encoder, "add_bos", False))
    if window < 2:
        raise WindowConfigError(f"window must be at least 2 tokens, got {window}")
    capacity = window - int(add_bos)
    if stride is None:
        stride = capacity
    if not 0 < stride <= capacity:
        bos_note = " (window minus the BOS token)" if add_bos else ""
        raise WindowConfigError(
            f"stride must be in 1..{capacity}{bos_note} so windows leave no gaps, got {stride}"
        )
    if add_bos and encoder.bos_token_id is None:
        raise ModelError(
            "the tokenizer defines no BOS token, so windows cannot start with one; use add_bos=False"
        )
    for name, value in (("max_tokens", max_tokens), ("max_windows", max_windows)):
        if value is not None and value < 1:
            raise WindowConfigError(f"{name} must be positive, got {value}")

    result = WindowSet(
        windows=[],
        window=window,
        stride=stride,
        add_bos=add_bos,
        n_documents=0,
        n_tokens=0,
        min_window_tokens=min_window_tokens,
    )
    prefix = [encoder.bos_token_id] if add_bos else []
    # A window can never hold more than `capacity` tokens, so that is the most one can be asked for.
    min_tokens = max(1, min(min_window_tokens, capacity))
    for doc in documents:
        if encoded is not None:
            ids: Sequence[int] = encoded[doc.doc_id]
        else:
            ids = encode_text(encoder, doc.text, _ids_needed(result, max_tokens, max_windows, capacity, stride))
        result.doc_tokens[doc.doc_id] = len(ids)
        if len(ids) < min_tokens:
            result.dropped_documents.append(doc.doc_id)
            continue
        counted = False
        for index, start in enumerate(_window_starts(len(ids), capacity, stride)):
            chunk = list(ids[start : start + capacity])
            if index > 0 and len(chunk) < min_tokens:
                result.dropped_tails += 1
                break
            tokens = prefix + chunk
            if max_windows is not None and len(result.windows) >= max_windows:
                result.stopped_by = "max_windows"
            elif max_tokens is not None and result.n_tokens + len(tokens) > max_tokens:
                result.stopped_by = "max_tokens"
            if result.stopped_by:
                return result
            score_from = int(add_bos) if index == 0 else window - stride
            result.windows.append(TokenWindow(doc.doc_id, index, start, tokens, add_bos, score_from))
            result.n_tokens += len(tokens)
            if not counted:
                result.n_documents += 1
                counted = True
    return result


def _ids_needed(
    result: WindowSet, max_tokens: int | None, max_windows: int | None, capacity: int, stride: int
) -> int | None:
    """How many of the next document's ids the caps let matter (None: all). Its window at document
    token s is reached only when its windows before it, which cover tokens 0..s, fit the caps: so s is
    at most the tokens left (and at most stride times the windows left). That window reads ids up to
    s + capacity, and one more id tells whether the document ends there: then the windows, the tail
    check and where the set stops are all the same as with every id."""
    bounds = []
    if max_tokens is not None:
        bounds.append(max(0, max_tokens - result.n_tokens) + capacity + 1)
    if max_windows is not None:
        bounds.append(max(0, max_windows - len(result.windows)) * stride + capacity + 1)
    return min(bounds) if bounds else None


def _window_starts(n: int, capacity: int, stride: int) -> Iterable[int]:
    """Start offsets: every `stride` tokens until a window reaches the document's end."""
    start = 0
    while True:
        yield start
        if start + capacity >= n:
            return
        start += stride
